"""The sparsifying strategies' records (``commlib.compression._payload``)
on the device, each one launch of ``kernels/records.cu`` with no host
synchronization and no memset (the kernels leave their workspaces zeroed),
and a numpy twin of each:

- :func:`accumulate_finite`: ``acc = residual + x`` with NaN and +-inf
  stored as 0 and counted into a record's header;
- :func:`split_records`: every rank's entries out of the gathered records
  into one index and one value array, checked on the way (the counts the
  host reads after the exchange, with the headers).
"""
import numpy as np

from ..errors import ArgumentError
from .arrays import is_cupy
from .selection import check_length, check_same_kind, check_vector

HEADER = 4    # int32 words of a record's header
_BLOCK = 256


def accumulate_finite(residual, x, acc, header, entries):
    """``acc = residual + x`` (``x`` alone when ``residual`` is None), with
    its NaN and +-inf stored as 0, and ``header[:4] = [entries, how many
    there were, 0, 0]``.

    Args:
        residual: None or a 1-D contiguous float32 array like ``x``.
        x: 1-D contiguous float32 array (numpy or cupy).
        acc: float32 array of ``x``'s length and kind, written; may be
            ``x`` or ``residual`` itself.
        header: 1-D contiguous int32 array of at least 4 elements, like
            ``x``'s kind; its first 4 written (on the device for cupy: the
            count is not read).
        entries: int written to ``header[0]``.

    The sum is numpy's float32 add, bit for bit (subnormals kept).

    Raises:
        ArgumentError, ArrayTypeError, DeviceMismatchError: a bad argument.
    """
    check_vector(x, "x", np.float32)
    check_vector(acc, "acc", np.float32)
    check_vector(header, "header", np.int32)
    if residual is not None:
        check_vector(residual, "residual", np.float32)
    check_same_kind(x=x, acc=acc, header=header, residual=residual)
    for name, a in (("acc", acc), ("residual", residual)):
        if a is not None and a.size != x.size:
            raise ArgumentError("%s: length %d differs from x's %d" % (name, a.size, x.size))
    if header.size < HEADER:
        raise ArgumentError("header: %d elements, expected at least %d" % (header.size, HEADER))
    check_length(x.size, "x")
    entries = np.int32(entries)
    if not is_cupy(x):
        if residual is None:
            acc[...] = x
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                np.add(residual, x, out=acc)
        bad = ~np.isfinite(acc)
        count = int(np.count_nonzero(bad))
        if count:
            acc[bad] = 0
        header[:HEADER] = (entries, count, 0, 0)
        return
    import cupy
    from . import _launch, _loader
    with x.device:
        device = x.device.id
        kernel, grid, block, n64 = _launch.plan(
            ("accumulate_finite", device, x.size, _loader.get_function),
            lambda: _grid_stride_plan("accumulate_finite", x.size))
        ws = _launch.workspace(device, "accumulate_finite", 2, cupy.uint64, zeroed=True)
        kernel(grid, block, (x if residual is None else residual, np.int32(residual is not None),
                             x, acc, n64, header, entries, ws))


def _grid_stride_plan(name, n):
    from ._loader import get_function, launch_config
    kernel = get_function("records.cu", name)
    grid, block = launch_config(n, kernel, _BLOCK)
    return kernel, grid, block, np.int64(n)


def split_records(src, layout, n, indices, values, reads, header_stride=None):
    """Copy every rank's entries out of ``src`` and check them.

    Args:
        src: 1-D contiguous int32 array (numpy or cupy): the records.
        layout: per rank, ``(idx_at, val_at, count)`` ints: its ``count``
            indices start at ``src[idx_at]``, the bits of its float32 values
            at ``src[val_at]``.
        n: the bucket's length (valid indices are ``[0, n)``).
        indices: int32 array of ``sum(count)`` elements, written: the
            ranks' indices back to back, in rank order.
        values: float32 array of as many elements, written likewise.
        reads: int64 array, written: with ``header_stride``, first the 4
            header words of each rank's record (``src[r * header_stride:
            r * header_stride + 4]``) widened, then ``[bad, unordered]``
            (``4 * len(layout) + 2`` elements); without it just the two.
        header_stride: int32 words from one rank's record to the next, or
            None.

    ``bad`` counts the entries whose index is outside ``[0, n)`` and not the
    padding (index -1 with value 0), or whose value is NaN or +-inf;
    ``unordered`` the entries, other than each rank's first, that are not
    padding and follow padding or an index not below their own (what
    :func:`commlib.compression._payload.check_entries` looks at).

    Raises:
        ArgumentError, ArrayTypeError, DeviceMismatchError: a bad argument,
            or a layout reaching outside ``src``.
    """
    check_vector(src, "src", np.int32)
    check_vector(indices, "indices", np.int32)
    check_vector(values, "values", np.float32)
    check_vector(reads, "reads", np.int64)
    check_same_kind(src=src, indices=indices, values=values, reads=reads)
    layout = _check_layout(src, layout, indices, values, reads, header_stride)
    ranks = len(layout)
    if not is_cupy(src):
        _split_numpy(src, layout, n, indices, values, reads, header_stride)
        return
    import cupy
    from . import _launch, _loader
    with src.device:
        device = src.device.id
        kernel, grid, block, table = _launch.plan(
            ("split_records", device, layout, _loader.get_function),
            lambda: _split_plan(layout))
        ws = _launch.workspace(device, "split_records", 3, cupy.uint64, zeroed=True)
        kernel(grid, block, (src, table, np.int32(ranks), np.int64(n), indices, values,
                             np.int64(header_stride or 0), reads, ws))


def _check_layout(src, layout, indices, values, reads, header_stride):
    """``layout`` as a tuple of int triples, checked against the arrays."""
    layout = tuple((int(i), int(v), int(c)) for i, v, c in layout)
    total, ranks = sum(c for _, _, c in layout), len(layout)
    for r, (i, v, c) in enumerate(layout):
        if c < 0 or min(i, v) < 0 or max(i, v) + c > src.size:
            raise ArgumentError("layout: rank %d's entries (indices at %d, values at %d, %d "
                                "each) reach outside src's %d words" % (r, i, v, c, src.size))
    if indices.size != total or values.size != total:
        raise ArgumentError("indices, values: %d and %d elements, expected %d (the layout's "
                            "entries)" % (indices.size, values.size, total))
    if header_stride is not None and (header_stride < HEADER
                                      or (ranks - 1) * header_stride + HEADER > src.size):
        raise ArgumentError("header_stride: %d does not fit %d headers in src's %d words"
                            % (header_stride, ranks, src.size))
    want = (HEADER * ranks if header_stride is not None else 0) + 2
    if reads.size != want:
        raise ArgumentError("reads: %d elements, expected %d" % (reads.size, want))
    return layout


def _split_plan(layout):
    import cupy
    counts = [c for _, _, c in layout]
    table = np.concatenate(([i for i, _, _ in layout], [v for _, v, _ in layout], counts,
                            np.concatenate(([0], np.cumsum(counts)))))
    kernel, grid, block, _ = _grid_stride_plan("split_records", sum(counts))
    return kernel, grid, block, cupy.asarray(table.astype(np.int64))


def _split_numpy(src, layout, n, indices, values, reads, header_stride):
    at = 0
    bad = unordered = 0
    for r, (i, v, c) in enumerate(layout):
        idx = src[i:i + c]
        val = src[v:v + c].view(np.float32)
        indices[at:at + c] = idx
        values[at:at + c] = val
        at += c
        pad = (idx == -1) & (val == 0)
        bad += int(np.count_nonzero(~((idx.view(np.uint32) < n) | pad) | ~np.isfinite(val)))
        unordered += int(np.count_nonzero(((idx[1:] <= idx[:-1]) | pad[:-1]) & ~pad[1:]))
    base = 0
    if header_stride is not None:
        base = HEADER * len(layout)
        for r in range(len(layout)):
            reads[HEADER * r:HEADER * (r + 1)] = src[r * header_stride:r * header_stride + HEADER]
    reads[base:base + 2] = (bad, unordered)
