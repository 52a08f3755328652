"""Top-K by magnitude with optional fused error feedback.

``topk(x, k)`` returns the ``min(k, len(x))`` entries of largest ``|x|`` in
ascending index order; among equal magnitudes the lowest index wins, NaN is
never selected (missing entries are padding: index -1, value 0), ``+-inf``
rank highest and ``-0.0`` ties with ``+0.0``.

With cupy input this is a radix select on the magnitude bits in
``kernels/topk.cu``: one memset and up to five kernels, no host
synchronization, and usually a single full read of the input (a sampled low
bound lets the first pass gather the candidates). numpy input runs the numpy
twin, an exact partition on the same keys.
"""
import collections
import math

import numpy as np

from ..errors import ArgumentError
from .arrays import is_cupy
from .selection import (BLOCK, INF_KEY, TILE, check_count, check_length, check_same_kind,
                        check_vector, grid_for, magnitude_keys, tiles_of)

# u32 words of the workspace before the look-back status words (kernels/topk.cu)
_WS_STATUS = 16 + 2048 + 2048 + 512
SAMPLES = 8192  # elements read by topk_sample


def topk(x, k, *, residual=None, out=None):
    """Indices and values of the ``min(k, len(x))`` largest ``|x|``.

    x: 1-D contiguous float32 array (numpy or cupy; any element offset).
    k: non-negative int. residual: optional float32 array of the same
    length and kind. With it, selection runs on ``acc = residual + x``, the
    returned values are ``acc``'s, and on return ``residual`` holds ``acc``
    with the selected entries zeroed (NaN payloads in ``residual`` may differ
    between numpy and CUDA). out: optional ``(indices, values)``, 1-D
    contiguous int32 and float32 arrays of ``min(k, len(x))`` elements of
    ``x``'s kind, written instead of new arrays (for instance the parts of
    a record about to be sent).

    Returns ``(indices, values)``: int32 and float32 arrays of exactly
    ``min(k, len(x))`` entries (``out`` when given); selected entries first
    in ascending index order, then padding (-1, 0.0) when fewer non-NaN
    elements exist.
    """
    check_vector(x, "x", np.float32)
    k = check_count(k, "k")
    if residual is not None:
        check_vector(residual, "residual", np.float32)
        check_same_kind(x=x, residual=residual)
        if residual.size != x.size:
            raise ArgumentError("residual: length %d differs from x's %d"
                                % (residual.size, x.size))
    check_length(x.size, "x")
    kk = min(k, x.size)
    if out is not None:
        _check_out(out, x, kk)
    if is_cupy(x):
        return _topk_cuda(x, kk, residual, out)
    return _topk_numpy(x, kk, residual, out)


def _check_out(out, x, kk):
    if not isinstance(out, tuple) or len(out) != 2:
        raise ArgumentError("out: expected a tuple (indices, values), got %r" % (out,))
    check_vector(out[0], "out[0]", np.int32)
    check_vector(out[1], "out[1]", np.float32)
    check_same_kind(x=x, out_indices=out[0], out_values=out[1])
    for name, a in zip(("out[0]", "out[1]"), out):
        if a.size != kk:
            raise ArgumentError("%s: %d elements, expected min(k, len(x)) = %d"
                                % (name, a.size, kk))


def _topk_numpy(x, kk, residual, out=None):
    src = x
    if residual is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            np.add(residual, x, out=residual)
        src = residual
    if out is None:
        indices = np.empty(kk, dtype=np.int32)
        values = np.empty(kk, dtype=np.float32)
    else:
        indices, values = out
    indices[...] = -1
    values[...] = 0
    keys = magnitude_keys(src)
    nan = keys > INF_KEY
    keys[nan] = 0
    s = min(kk, src.size - int(np.count_nonzero(nan)))
    if s == 0:
        return indices, values
    kth = np.partition(keys, src.size - s)[src.size - s]  # s-th largest key
    chosen = keys > kth
    rem = s - int(np.count_nonzero(chosen))
    if rem:
        chosen[np.flatnonzero((keys == kth) & ~nan)[:rem]] = True
    sel = np.flatnonzero(chosen)
    indices[:s] = sel
    values[:s] = src[sel]
    if residual is not None:
        residual[sel] = 0.0
    return indices, values


def _candidate_capacity(n, k):
    """Pairs the candidate buffer holds (a multiple of 4; 0 disables it).

    The buffer pays off while the candidates stay well under a third of the
    input (8 bytes per pair, written once, read up to three times); it must
    also hold the k selected entries.
    """
    cap = (min(max(8 * k, n // 64) + 65536, n // 3) // 4) * 4
    return cap if cap >= k else 0


def _sample_rank(n, k):
    """Rank of the sampled low bound: comfortably above the k * SAMPLES / n
    sampled keys expected above the k-th largest, so the bound lies below it
    with overwhelming probability."""
    expected = SAMPLES * k / n
    return int(min(SAMPLES, math.ceil(1.25 * expected + 4.0 * math.sqrt(expected) + 16)))


STASH = 4096       # candidates one super-tile of the first pass holds (kernels/select_common.cuh)
SUPER_TILES = 8    # tiles per super-tile at most


def _super_tiles(rank):
    """Tiles per super-tile of the first pass: as many as keep the expected
    candidates of a super-tile (a fraction rank / SAMPLES of its elements)
    within three quarters of its stash (more are read twice)."""
    per = SUPER_TILES
    while per > 1 and rank * per * TILE > 0.75 * STASH * SAMPLES:
        per //= 2
    return per


def _topk_cuda(x, kk, residual, out):
    import cupy
    from . import _launch
    n = x.size
    with x.device:
        if out is None:
            indices = cupy.empty(kk, dtype=cupy.int32)
            values = cupy.empty(kk, dtype=cupy.float32)
        else:
            indices, values = out
        if n == 0 or (kk == 0 and residual is None):
            return indices, values
        src = x if residual is None else residual
        off = (src.data.ptr % 16) // 4
        xoff = off if residual is None else (x.data.ptr % 16) // 4
        device = x.device.id
        # the plan depends on these module globals too (tests and the
        # benchmark replace them)
        from . import _loader
        key = ("topk", device, n, kk, off, residual is None, xoff == off,
               _candidate_capacity, _sample_rank, _loader.get_function)
        p = _launch.plan(key, lambda: _topk_plan(n, kk, off, residual is not None, xoff == off))
        ws = _launch.workspace(device, "topk", p.ws_words, cupy.uint32)
        _launch.memset0(ws, 4 * p.ws_words)
        if p.cap:
            cand = _launch.workspace(device, "topk-candidates", 2 * p.cap, cupy.int32)
            views = _candidate_views.get(id(cand))
            if views is None or views[0] is not cand or views[1].size != p.cap:
                views = (cand, cand[:p.cap], cand[p.cap:2 * p.cap].view(cupy.float32))
                _candidate_views.clear()  # the latest only: holds no dropped buffer alive
                _candidate_views[id(cand)] = views
            cand_idx, cand_val = views[1], views[2]
        else:
            cand_idx = cand_val = ws  # never touched
        n64, k32, cap32 = p.n64, p.k32, p.cap32
        if p.sample is not None:
            kernel, grid, rank = p.sample
            kernel(grid, _BLOCK_DIM, (x, src, p.has_resid, n64, ws, rank))
        kernel, grid, off1, per = p.hist1
        kernel(grid, _BLOCK_DIM, (x, src, n64, off1, ws, k32, cap32, cand_idx, cand_val, per))
        off32 = p.off32
        kernel, grid = p.filter
        kernel(grid, _BLOCK_DIM, (src, n64, off32, ws, cand_idx, cand_val, cap32))
        kernel, grid = p.refine
        kernel(grid, _BLOCK_DIM, (src, n64, off32, ws, cand_idx, cand_val))
        kernel, grid = p.compact
        kernel(grid, _BLOCK_DIM, (src, n64, off32, ws, cand_idx, cand_val, src, p.has_resid,
                                  indices, values, k32))
    return indices, values


_BLOCK_DIM = (BLOCK,)
_candidate_views = {}  # id(buffer) -> (buffer, index view, value view), the latest call's
_Plan = collections.namedtuple(
    "_Plan", "ws_words cap n64 k32 cap32 off32 has_resid sample hist1 filter refine compact")


def _topk_plan(n, kk, off, has_resid, same_off):
    """Kernels, grids and constant arguments of one call shape (current device)."""
    from ._loader import get_function

    def kernel_grid(name, tiles):
        # tiles: what the pass may have to read; one wave of resident blocks at most
        kernel = get_function("topk.cu", name)
        return kernel, ((1,) if tiles is None else grid_for(tiles, kernel))

    tiles = tiles_of(n, off)
    cap = _candidate_capacity(n, kk)
    sample = None
    per = 1
    if cap:
        rank = _sample_rank(n, kk)
        sample = kernel_grid("topk_sample", None) + (np.uint32(rank),)
        per = _super_tiles(rank)
    off1 = off if not has_resid or same_off else 0
    tiles1 = tiles_of(n, off1)
    name = "topk_hist1" if not has_resid else ("topk_hist1_resid" if same_off
                                               else "topk_hist1_resid_scalar")
    # with a sample, pass 1 pulls super-tiles of `per` tiles, else it strides over tiles
    hist1 = kernel_grid(name, -(-tiles1 // per) if cap else tiles1) + (np.int32(off1),
                                                                       np.int32(per))
    return _Plan(ws_words=_WS_STATUS + 6 * (n // TILE + 2), cap=cap, n64=np.int64(n),
                 k32=np.uint32(kk), cap32=np.uint32(cap), off32=np.int32(off),
                 has_resid=np.int32(has_resid), sample=sample, hist1=hist1,
                 filter=kernel_grid("topk_filter", tiles),
                 refine=kernel_grid("topk_refine", tiles),
                 compact=kernel_grid("topk_compact", tiles))
