"""Every kernel of kernels/*.cu run on the CPU with per-thread CUDA semantics
(the cooperative host build, tests/ops/cuda_host/) through the real wrappers of
commlib.ops, against their numpy twins, under several block and thread
schedules; and planted bugs in patched copies of the sources are caught.

Each CUDA thread is a fiber: __syncthreads is a block barrier, warp
intrinsics are rendezvous of the lanes in their mask, shared memory is per
block (junk at block start), blocks run one after another in ascending,
descending or random order or all at once with random interleaving (so a
decoupled look-back spins on flags that other blocks are still computing),
and every load and store is checked against the launch's arrays.
"""
import numpy as np
import pytest

import commlib.errors
import cuda_host_build as chb
from host_fixtures import gpu, kernels  # noqa: F401 -- fixtures
from cuda_host_build import SCHEDULES, KernelFault
from commlib.ops import cast as cast_mod, pack as pack_mod, sparse as sparse_mod
from commlib.ops import records as records_mod, threshold as threshold_mod, topk as topk_mod
from commlib.ops.selection import TILE
from test_ops_cast import adversarial

pytestmark = pytest.mark.skipif(chb.GXX is None or chb.OBJCOPY is None,
                                reason="g++ or objcopy not found on PATH")

# lengths around tile (4096) and 16-byte vector boundaries
LENGTHS = (1, 2, 5, TILE - 1, TILE, TILE + 1, 3 * TILE + 7)
# kernels/select_common.cuh: elements per super-tile (one look-back each) and
# selected elements one super-tile holds in shared memory
SUPER, STASH = 8 * TILE, 4096
# topk.cu's workspace words (kernels/topk.cu, enum at the top)
K_DONE, K_USE_BUF, K_FILL = 4, 5, 6


def schedules_for(i, count=2):
    """``count`` schedules for case ``i``, rotating through all of them."""
    return [SCHEDULES[(i + j) % len(SCHEDULES)] for j in range(count)]


# (SMs, threads per SM): the grids the wrappers launch range from one block
# that loops over every tile to one block per tile
DEVICES = ((1, 256), (2, 2048), (1, 512), (3, 1024))


def vary_device(gpu, i):
    gpu.set_device(*DEVICES[i % len(DEVICES)])


def on_device(gpu, a, off=0):
    """A device copy of ``a`` starting ``off`` elements past a 256-byte boundary."""
    base = gpu.module.zeros(a.size + off, a.dtype)
    view = base[off:off + a.size]
    view[...] = a
    return view


def same_bits(a, b, nan_equal=False):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if nan_equal and a.dtype.kind == "f":
        both_nan = np.isnan(a) & np.isnan(b)
        return bool(np.all(both_nan | (a.view(np.uint8).reshape(a.size, -1)
                                       == b.view(np.uint8).reshape(b.size, -1)).all(axis=1)))
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


def selection_values(n, seed, kind="mixed"):
    """float32 inputs for top-K / threshold: NaN (several payloads), +-inf,
    ties, subnormals, +-0.0, or all |x| < 1 ("small"), all equal ("ties")."""
    rng = np.random.default_rng(seed)
    if kind == "ties":
        return np.where(rng.random(n) < 0.5, -1.0, 1.0).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "small":
        return (x / (np.abs(x).max() + 1) * 0.999).astype(np.float32)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45,
                         1.1754942e-38, 2.5, -2.5, 2.5, 3.0], np.float32)
    pick = rng.random(n) < 0.15
    x[pick] = rng.choice(specials, int(pick.sum()))
    payload = rng.random(n) < 0.01
    x[payload] = np.uint32(0x7F800123).view(np.float32)
    return x


# ---------------------------------------------------------------- top-K

def check_topk(gpu, x, k, off=0, residual=None, roff=None):
    """topk on the device (x at element offset off, residual at roff) against
    the numpy twin; returns the workspace flags seen after each launch."""
    seen = []
    gpu.after_launch = lambda name, args: seen.append((name, np.array(next(
        a for a in args if isinstance(a, np.ndarray) and a.dtype == np.uint32)[:16])))
    gx = on_device(gpu, x, off)
    gr = None if residual is None else on_device(gpu, residual, off if roff is None else roff)
    idx, val = topk_mod.topk(gx, k, residual=gr)
    res_t = None if residual is None else residual.copy()
    want_idx, want_val = topk_mod.topk(x.copy(), k, residual=res_t)
    assert np.array_equal(np.asarray(idx), want_idx), (x.size, k, off, gpu.schedule.name)
    assert same_bits(val, want_val), (x.size, k, off, gpu.schedule.name)
    if residual is not None:
        assert same_bits(gr, res_t, nan_equal=True), (x.size, k, off, gpu.schedule.name)
    gpu.after_launch = None
    return seen


def _paths(seen):
    """Which way the selection went: after topk_hist1 the candidates were the
    gathered buffer, the buffer filled by topk_filter, or the input; the
    selection was settled by hist1, filter or refine."""
    after = {name: ws for name, ws in seen}
    h1 = next(ws for name, ws in seen if name.startswith("topk_hist1"))
    where = "input" if not h1[K_USE_BUF] else ("filled" if h1[K_FILL] else "gathered")
    if h1[K_DONE]:
        settled = "hist1"
    elif after["topk_filter"][K_DONE]:
        settled = "filter"
    else:
        settled = "refine"
    return where, settled


def test_topk_lengths_offsets_and_k(gpu):
    i = 0
    for n in (0,) + LENGTHS:
        x = selection_values(n, n)
        for k in sorted({0, 1, 7, n // 3, n // 2, n - 1, n, n + 5}):
            if k < 0:
                continue
            off = i % 4
            vary_device(gpu, i)
            for sched in schedules_for(i):
                gpu.schedule = sched
                check_topk(gpu, x, k, off)
            i += 1


def test_topk_every_candidate_path(gpu, monkeypatch):
    """Force every path of kernels/topk.cu and check that each was taken."""
    n = 3 * TILE + 7
    rng = np.random.default_rng(11)
    spread = (rng.standard_normal(n) * 1e-3).astype(np.float32)   # top 50 in distinct buckets
    spread[rng.permutation(n)[:50]] = 2.0 ** np.arange(50)
    mid = (1 + rng.permutation(n) % 512 * 2.0 ** -14).astype(np.float32)  # one top bucket
    low = (1 + rng.permutation(n) % 512 * 2.0 ** -23).astype(np.float32)  # one 22-bit prefix
    cases = [
        ("normal", selection_values(n, 1), 100, None),
        ("normal, low sample bound", selection_values(n, 2), 100, topk_mod.SAMPLES),
        ("normal, high sample bound", selection_values(n, 3), 100, 1),
        ("all ties", selection_values(n, 4, "ties"), 100, None),
        ("all |x| < 1", selection_values(n, 5, "small"), 300, None),
        ("distinct buckets", spread, 50, None),
        ("middle digit", mid, 37, None),
        ("low digit with ties", low, 1000, None),
        ("no candidate buffer", selection_values(n, 6), n // 2, None),
        ("no buffer, ties", low, n // 2 + 3, None),
    ]
    paths = set()
    real_rank = topk_mod._sample_rank
    for i, (what, x, k, rank) in enumerate(cases):
        monkeypatch.setattr(topk_mod, "_sample_rank",
                            real_rank if rank is None else (lambda n, k, r=rank: r))
        vary_device(gpu, i)
        for sched in schedules_for(i):
            gpu.schedule = sched
            path = _paths(check_topk(gpu, x, k, off=i % 4))
            paths.add(path)
    wanted = {("gathered", "refine"), ("filled", "refine"), ("input", "refine"),
              ("gathered", "hist1"), ("input", "filter"), ("gathered", "filter")}
    assert wanted <= paths, sorted(paths)


def test_topk_with_residual(gpu):
    for i, n in enumerate((1, TILE - 1, TILE + 1, 2 * TILE + 3)):
        x = selection_values(n, 20 + i)
        r = selection_values(n, 40 + i, "small")
        for k in (1, max(1, n // 5), n // 2 + 1):
            # same misalignment (vector pass), then a different one (scalar pass)
            for off, roff in ((i % 4, i % 4), (1, 2)):
                gpu.schedule = SCHEDULES[(i + k + off) % len(SCHEDULES)]
                vary_device(gpu, i + k)
                check_topk(gpu, x, k, off, r, roff)


# ---------------------------------------------------------------- threshold

def check_threshold(gpu, x, t, capacity=None, off=0):
    gx = on_device(gpu, x, off)
    idx, val, count = threshold_mod.threshold(gx, t, capacity=capacity)
    want_idx, want_val, want_count = threshold_mod.threshold(x.copy(), t, capacity=capacity)
    where = (x.size, t, capacity, off, gpu.schedule.name)
    assert int(count) == int(want_count), where
    m = min(int(want_count), idx.size)
    assert np.array_equal(np.asarray(idx)[:m], want_idx[:m]), where
    assert same_bits(np.asarray(val)[:m], want_val[:m]), where


def test_threshold_lengths_offsets_thresholds(gpu):
    i = 0
    for n in LENGTHS:
        x = selection_values(n, 100 + n)
        for t in (0.0, 1e-45, 0.5, 2.5, 3e38, float("inf")):
            vary_device(gpu, i)
            for sched in schedules_for(i):
                gpu.schedule = sched
                check_threshold(gpu, x, t, off=i % 4)
            i += 1


def test_look_back_waits_on_running_blocks(gpu):
    # all blocks resident: a block reaches the look-back of its tile while the
    # block owning an earlier tile is still working on it, and spins
    x = selection_values(8 * TILE + 3, 9)
    gpu.set_device(2, 2048)
    for sched in SCHEDULES:
        gpu.schedule = sched
        before = gpu.kernels.spins
        check_threshold(gpu, x, 0.5, off=1)
        spun = gpu.kernels.spins - before
        assert (spun > 0) == (sched.resident > 1), (sched.name, spun)


def test_threshold_capacity_overflow_and_small_values(gpu):
    n = 3 * TILE + 7
    for i, (kind, t) in enumerate((("mixed", 0.5), ("small", 0.25), ("ties", 0.5))):
        x = selection_values(n, 200 + i, kind)
        hits = int(threshold_mod.threshold(x, t)[2])
        for capacity in (0, 1, hits // 2, hits - 1, hits, hits + 3):
            gpu.schedule = SCHEDULES[(i + capacity) % len(SCHEDULES)]
            vary_device(gpu, i + capacity)
            check_threshold(gpu, x, t, capacity, off=(i + capacity) % 4)


def _super_counts(x, t=None, low=None, per=8):
    """Selected elements per super-tile of ``per`` tiles: |x| > t, or magnitude
    keys >= low (NaN never)."""
    keys = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
    hit = np.abs(x) > t if t is not None else (keys >= low) & (keys <= 0x7F800000)
    return np.add.reduceat(hit, np.arange(0, x.size, per * TILE))


def test_super_tiles_stash_and_second_read(gpu, monkeypatch):
    # several super-tiles (a look-back between each), the last one partial;
    # few selected elements per super-tile (written from the stash) and more
    # than the stash holds (the super-tile read a second time)
    n = 2 * SUPER + TILE + 5
    x = selection_values(n, 31)
    held, reread = False, False
    for i, t in enumerate((0.0, 2.5, 3.3)):
        counts = _super_counts(x, t=t)
        held |= counts.max() <= STASH
        reread |= counts.max() > STASH
        for capacity in (None, int(counts.sum()) // 2):
            gpu.schedule = SCHEDULES[(i + (capacity is None)) % len(SCHEDULES)]
            vary_device(gpu, i + 2 * (capacity is None))
            check_threshold(gpu, x, t, capacity, off=(i + 1) % 4)
    assert held and reread
    # top-K's first pass: candidates of a super-tile in the stash, and (the
    # largest magnitudes all at the start) more than it holds
    r = selection_values(n, 32, "small")
    clustered = x[np.argsort(-np.abs(np.nan_to_num(x, nan=0.0)), kind="stable")]
    lows = []
    seen = []
    gpu.after_launch = None
    for i, (data, k) in enumerate(((x, n // 100), (clustered, n // 100), (x, n // 4),
                                   (clustered, n // 4))):
        for off, roff in ((i % 4, i % 4), (1, 3)):
            gpu.schedule = SCHEDULES[(2 * i + off) % len(SCHEDULES)]
            vary_device(gpu, 2 * i + off)
            seen = check_topk(gpu, data, k, off)
            if data is x:
                assert _paths(seen)[0] == "gathered", (i, k)
            ws = next(w for name, w in seen if name == "topk_sample")
            per = topk_mod._super_tiles(topk_mod._sample_rank(n, k))
            lows.append(_super_counts(data, low=ws[8], per=per).max())  # kLow
            check_topk(gpu, data, k, off, r, roff)
    assert min(lows) <= STASH < max(lows), lows


# ---------------------------------------------------------------- scatter-add

def check_scatter(gpu, dense, idx, val, alpha, segments, offs=(0, 0, 0)):
    gd, gi, gv = (on_device(gpu, a, o) for a, o in zip((dense, idx, val), offs))
    bad = sparse_mod.scatter_add(gd, gi, gv, alpha=alpha, segments=segments)
    want = dense.copy()
    want_bad = 0
    lo = 0
    for c in (segments or [idx.size]):   # the twin, one segment after another
        want_bad += int(sparse_mod.scatter_add(want, idx[lo:lo + c], val[lo:lo + c],
                                               alpha=alpha))
        lo += c
    where = (dense.size, idx.size, alpha, segments, gpu.schedule.name)
    assert int(bad) == want_bad, where
    assert same_bits(gd, want, nan_equal=True), where


def sparse_sets(n_dense, sizes, seed):
    """Indices unique within each segment (with -1 padding and out-of-range
    entries), repeated across segments; values with specials."""
    rng = np.random.default_rng(seed)
    idx, val = [], []
    for c in sizes:
        i = rng.permutation(n_dense + 3)[:c].astype(np.int64) - 1  # -1 .. n_dense + 1
        bad = rng.random(c) < 0.05
        i[bad] = rng.choice([-2, -(2 ** 31), n_dense, 2 ** 31 - 1], int(bad.sum()))
        idx.append(i.astype(np.int32))
        val.append(selection_values(c, seed + c))
    return np.concatenate(idx), np.concatenate(val)


def test_scatter_add_segments_padding_and_bad_indices(gpu):
    i = 0
    for n_dense in (1, 7, TILE + 1, 3 * TILE + 7):
        for sizes in ([min(n_dense, 1)], [min(n_dense, 5), 0, min(n_dense, 300)],
                      [min(n_dense + 2, 2000)] * 3):
            idx, val = sparse_sets(n_dense, sizes, i)
            dense = selection_values(n_dense, 300 + i, "small")
            for alpha in (1.0, -1.0, 0.375, 1e-40):
                gpu.schedule = SCHEDULES[i % len(SCHEDULES)]
                vary_device(gpu, i)
                check_scatter(gpu, dense, idx, val, alpha, sizes, offs=(i % 4, (i + 1) % 4, i % 3))
                i += 1


def test_scatter_add_waits_for_earlier_segments(gpu):
    # all blocks resident: an item of a later segment waits (spins) until
    # every item of the earlier segments is done
    for sched in SCHEDULES:
        gpu.schedule = sched
        before = gpu.kernels.spins
        _scatter_ordered(gpu)
        spun = gpu.kernels.spins - before
        assert (spun > 0) == (sched.resident > 1), (sched.name, spun)


def test_scatter_add_empty_and_all_padding(gpu):
    dense = selection_values(33, 7)
    check_scatter(gpu, dense, np.zeros(0, np.int32), np.zeros(0, np.float32), 1.0, None)
    pad = np.full(300, -1, np.int32)
    check_scatter(gpu, dense, pad, selection_values(300, 8), 2.0, [100, 200])


# ---------------------------------------------------------------- cast and pack

FMTS = ("float32", "float16", "bfloat16")
CAST_LENGTHS = (0, 1, 3, 7, 8, 9, 31, 33, 1001, 9000)


def check_cast(gpu, x, dst, scale, accumulate, xoff, ooff):
    gx = on_device(gpu, x, xoff)
    old = adversarial(dst, x.size, 99)
    go = on_device(gpu, old, ooff)
    counter = gpu.module.zeros((), np.int64)
    cast_mod.cast(gx, dst, scale=scale, out=go, accumulate=accumulate, nonfinite=counter)
    want = old.copy()
    want_count = cast_mod.numpy_cast_into(x, want, np.float32(scale), accumulate)
    where = (x.dtype, dst, x.size, scale, accumulate, xoff, ooff, gpu.schedule.name)
    assert int(counter) == want_count, where
    assert same_bits(go, want), where


@pytest.mark.parametrize("src", FMTS)
def test_cast_every_pair_offsets_and_lengths(gpu, src):
    i = 0
    for dst in FMTS:
        for accumulate in (False, True):
            for n in CAST_LENGTHS:
                x = adversarial(src, n, i)
                gpu.schedule = SCHEDULES[i % len(SCHEDULES)]
                vary_device(gpu, i)
                check_cast(gpu, x, dst, (1.0, 0.375, 3e5)[i % 3], accumulate, i % 8, (i // 8) % 8)
                i += 1


SHAPES = [(3, 5), (0,), (64,), (1,), (7, 3), (1000,), (17,), (8200,), (5,)]


def check_pack(gpu, afmt, bfmt, scale, accumulate, flat_off, bucket_off, seed):
    sizes = [int(np.prod(s)) for s in SHAPES]
    total = sum(sizes)
    flat = adversarial(afmt, total + 8, seed)
    gflat = on_device(gpu, flat, flat_off)
    arrays, garrays, lo = [], [], 0
    for s, n in zip(SHAPES, sizes):
        arrays.append(flat[lo:lo + n].reshape(s))
        garrays.append(gflat[lo:lo + n].reshape(s))
        lo += n
    bucket = adversarial(bfmt, total + 5, seed + 1)
    gbucket = on_device(gpu, bucket, bucket_off)
    where = (afmt, bfmt, scale, accumulate, flat_off, bucket_off, gpu.schedule.name)
    counter = gpu.module.zeros((), np.int64)
    want_count = np.zeros((), np.int64)
    # a non-zero guard: nothing written, nothing counted, on both paths
    stop = gpu.module.asarray(np.array(seed + 1, np.int64))
    before_bucket, before_flat = np.array(gbucket), np.array(gflat)
    pack_mod.pack(garrays, gbucket, scale, nonfinite=counter, unless=stop)
    pack_mod.unpack(gbucket, garrays, scale, accumulate, nonfinite=counter, unless=stop)
    pack_mod.pack(arrays, bucket, scale, nonfinite=want_count, unless=np.array(1, np.int64))
    assert same_bits(gbucket, before_bucket) and same_bits(gflat, before_flat), where
    assert int(counter) == 0 and same_bits(bucket, before_bucket), where
    go = gpu.module.zeros((), np.int64)          # a zero guard: as without one
    pack_mod.pack(garrays, gbucket, scale, nonfinite=counter, unless=go)
    pack_mod.pack(arrays, bucket, scale, nonfinite=want_count)
    assert int(counter) == int(want_count), where
    assert same_bits(gbucket, bucket), where
    # and back into the arrays (bucket values now the packed ones)
    counter[...] = 0
    want_count[...] = 0
    pack_mod.unpack(gbucket, garrays, scale, accumulate, nonfinite=counter, unless=go)
    pack_mod.unpack(bucket, arrays, scale, accumulate, nonfinite=want_count)
    assert int(counter) == int(want_count), where
    assert same_bits(gflat, flat), where


@pytest.mark.parametrize("afmt", FMTS)
def test_pack_unpack_views_and_offsets(gpu, afmt):
    i = 0
    for bfmt in FMTS:
        for scale, accumulate in ((None, False), (0.5, False), (2.0, True)):
            gpu.schedule = SCHEDULES[i % len(SCHEDULES)]
            vary_device(gpu, i)
            check_pack(gpu, afmt, bfmt, scale, accumulate, i % 4, (i + 1) % 3, i)
            i += 1


def test_raw_pack_copies_bits(gpu):
    for i, dtype in enumerate((np.int8, np.int16, np.float32, np.float64, np.complex128)):
        rng = np.random.default_rng(i)
        arrays = [rng.integers(0, 100, s).astype(dtype) for s in SHAPES]
        garrays = [on_device(gpu, a.ravel(), 0).reshape(a.shape) for a in arrays]
        total = sum(a.size for a in arrays)
        gbucket = on_device(gpu, np.zeros(total + 3, dtype), i % 2)
        gpu.schedule = SCHEDULES[i % len(SCHEDULES)]
        pack_mod.pack(garrays, gbucket)
        assert gpu.launches[-1][0].startswith("pack_raw")
        assert np.array_equal(np.asarray(gbucket)[:total],
                              np.concatenate([a.ravel() for a in arrays]))
        outs = [gpu.module.zeros(a.shape, dtype) for a in arrays]
        pack_mod.unpack(gbucket, outs)
        for a, o in zip(arrays, outs):
            assert np.array_equal(a, np.asarray(o))


# ---------------------------------------------------------------- the checks themselves

def test_each_kernel_has_its_sources_shared_memory(kernels):
    # a block's shared memory is the __shared__ statics of its kernel's
    # source (section coop_shared_<source>), not every source's: a cast
    # block starts, fills with junk and swaps a few bytes, not top-K's stashes
    sources = sorted(chb.KERNELS.glob("*.cu"))
    assert len(sources) == 6
    for path in sources:
        names = chb.kernel_names(path.name, path.read_text())
        assert names
        for name in names:
            assert kernels.lib.coop_unit(name.encode()).decode() == path.stem, name
        # the unit's section holds its own statics (its kernels' registrars)
        own = {sym for _, _, sym in kernels.shared_symbols(path.stem)}
        assert {"coop_registrar_" + n for n in names} <= own, (path.name, sorted(own)[:5])
    sizes = {path.stem: sum(size for _, size, _ in kernels.shared_symbols(path.stem))
             for path in sources}
    assert sizes["cast"] < 64 and sizes["pack"] < 64, sizes
    topk = {sym for _, _, sym in kernels.shared_symbols("topk")}
    assert any(s.endswith("::bins") for s in topk) and any(s.endswith("::stash") for s in topk)
    assert not any("topk" in sym for _, _, sym in kernels.shared_symbols("threshold")), sizes



def test_out_of_bounds_and_misaligned_accesses_are_reported(kernels):
    x = np.zeros(16, np.float32)
    out = np.zeros(15, np.float32)   # one element short
    counter = np.zeros((), np.uint64)
    with pytest.raises(KernelFault, match=r"out-of-bounds 16-byte store at byte offset 48 of "
                                          r"'argument 1' \(60 bytes\)"):
        kernels.launch("cast_f32_f32", 1, 32, [x, out, np.int64(16), np.float32(1), counter])
    ws = np.zeros(8, np.uint64)
    idx, val = np.zeros(8, np.int32), np.zeros(8, np.float32)
    count = np.zeros(1, np.int64)
    with pytest.raises(KernelFault, match="misaligned 16-byte load"):
        # claims x is 16-byte aligned (off 0) when it is not: float4 loads misaligned
        y = np.zeros(4097, np.float32)[1:]
        kernels.launch("threshold_select", 1, 256, [y, np.int64(4096), np.int32(0),
                                                    np.float32(0), ws, idx, val,
                                                    np.int64(8), count])


def test_collective_and_barrier_misuse_is_reported(kernels):
    # a block of 48 threads: warp 1 has 16 lanes, so full-mask collectives name
    # lanes outside the block
    dense = np.zeros(4, np.float32)
    idx, val = np.zeros(4, np.int32), np.ones(4, np.float32)
    bad = np.zeros((), np.uint64)
    table = np.array([0, 1, 0, 4], np.int64)   # one segment of 4 entries, one item
    ws = np.zeros(3, np.uint32)
    with pytest.raises(KernelFault, match="names lanes outside the block"):
        kernels.launch("scatter_add", 1, 48, [dense, np.int64(4), idx, val, table,
                                              np.int64(1), np.float32(1), bad, ws])


def test_endless_spin_is_reported(kernels):
    # a look-back whose predecessor super-tile never publishes: status of
    # super-tile 0 stays zero while block 0 starts at super-tile 1 (counter preset)
    x = np.ones(2 * SUPER, np.float32)
    ws = np.zeros(2 * SUPER // TILE + 1, np.uint64)
    ws[0] = 1
    idx, val = np.zeros(2 * SUPER, np.int32), np.zeros(2 * SUPER, np.float32)
    count = np.zeros(1, np.int64)
    with pytest.raises(KernelFault, match="spun more than"):
        kernels.launch("threshold_select", 1, 256, [x, np.int64(2 * SUPER), np.int32(0),
                                                    np.float32(0), ws, idx, val,
                                                    np.int64(2 * SUPER), count],
                       spin_limit=10000)


# ---------------------------------------------------------------- planted bugs

def _topk_ties(gpu):
    n = TILE + 5
    check_topk(gpu, selection_values(n, 1, "ties"), 100, off=1)
    low = (1 + np.arange(n) % 700 * 2.0 ** -23).astype(np.float32)
    check_topk(gpu, low, 1000, off=2)


def _topk_no_buffer(gpu):
    # k > n / 3: no candidate buffer, so topk_hist1 visits the input with no
    # barrier between zero_bins and its first shared atomics
    n = 3 * TILE + 7
    check_topk(gpu, selection_values(n, 2), n // 2 + 1, off=3)


def _threshold(gpu):
    # three super-tiles, the last one partial; one block per SM on the
    # smallest device, so a block takes more than one super-tile
    x = selection_values(2 * SUPER + 7, 3)
    gpu.set_device(2, 2048)
    check_threshold(gpu, x, 2.5, off=1)
    gpu.set_device(1, 256)
    check_threshold(gpu, x, 2.5, off=1)


def _scatter(gpu):
    idx, val = sparse_sets(300, [200, 50], 4)
    check_scatter(gpu, selection_values(300, 5), idx, val, 1.0, [200, 50])


def _scatter_ordered(gpu):
    # three segments of several items each over few elements: most indices
    # repeat across segments, so segment order matters
    sizes = [2500, 3000, 2000]
    idx, val = sparse_sets(3100, sizes, 6)
    gpu.set_device(2, 2048)
    check_scatter(gpu, selection_values(3100, 7, "small"), idx, val, 0.375, sizes)


def _cast(gpu):
    for n, xoff, ooff in ((9, 0, 0), (33, 1, 1), (1001, 2, 2)):
        check_cast(gpu, adversarial("float32", n, n), "float16", 1.0, False, xoff, ooff)


def _pack(gpu):
    check_pack(gpu, "float32", "bfloat16", None, False, 0, 0, 6)


# ---------------------------------------------------------------- records

def check_accumulate(gpu, x, residual, off, entries=7):
    """accumulate_finite on the device (arrays ``off`` elements past a
    boundary; acc a third array, or x itself) against the twin."""
    want_acc = np.empty_like(x)
    want_header = np.full(6, -5, np.int32)
    records_mod.accumulate_finite(residual, x, want_acc, want_header, entries)
    gx = on_device(gpu, x, off)
    gr = None if residual is None else on_device(gpu, residual, (off + 1) % 4)
    for in_place in (False, True):
        gacc = gx if in_place else on_device(gpu, np.zeros_like(x), (off + 2) % 4)
        if in_place:
            gx[...] = x
        header = on_device(gpu, np.full(6, -5, np.int32))
        records_mod.accumulate_finite(gr, gx, gacc, header, entries)
        assert same_bits(gacc, want_acc), (x.size, off, in_place, gpu.schedule.name)
        assert np.array_equal(np.asarray(header), want_header), (np.asarray(header), want_header)
    return int(want_header[1])


def test_accumulate_finite_lengths_offsets_and_specials(gpu):
    seen = 0
    for i, n in enumerate((0,) + LENGTHS + (70001,)):
        x = selection_values(n, 100 + n)
        # residual + x overflows to inf at some entries, and meets NaN/inf in x
        with np.errstate(over="ignore", invalid="ignore"):
            r = selection_values(n, 200 + n) * np.float32(3e38) if n % 2 else None
        vary_device(gpu, i)
        for sched in schedules_for(i):
            gpu.schedule = sched
            seen += check_accumulate(gpu, x, r, i % 4)
    assert seen > 0          # non-finite values were met and counted


def record_sets(rng, ranks, slots, n, faults=()):
    """Records of ``ranks`` ranks, back to back (header, slots indices,
    slots value bits), ascending valid sets with padding at the end, and
    planted faults: (rank, kind) with kind "range", "dup", "nan", "order",
    "pad-value"."""
    width = 4 + 2 * slots
    src = np.zeros(ranks * width, np.int32)
    planted = set()
    for r in range(ranks):
        m = max(0, slots - r % 3)               # the rest is padding
        idx = np.full(slots, -1, np.int32)
        idx[:m] = np.sort(rng.choice(n, m, replace=False))
        val = np.zeros(slots, np.float32)
        val[:m] = rng.standard_normal(m).astype(np.float32)
        val[:m][::5] = -0.0 if r % 2 else 0.0   # zeros that are not padding
        for fr, kind in faults:
            if fr != r or m < 3 or (kind == "pad-value" and m == slots):
                continue
            planted.add(kind)
            if kind == "range":
                idx[m - 1] = n + r              # still ascending
            elif kind == "dup":
                idx[2] = idx[1]
            elif kind == "nan":
                val[0] = np.float32("nan")
            elif kind == "order":
                idx[0], idx[1] = idx[1], idx[0]
            elif kind == "pad-value" and m < slots:
                val[m] = 1.0
        src[r * width:r * width + 4] = (m, r, 0, r + 1)
        src[r * width + 4:r * width + 4 + slots] = idx
        src[r * width + 4 + slots:(r + 1) * width] = val.view(np.int32)
    layout = [(r * width + 4, r * width + 4 + slots, slots) for r in range(ranks)]
    return src, layout, width, planted


def check_split(gpu, src, layout, n, stride, off):
    total = sum(c for _, _, c in layout)
    nreads = (4 * len(layout) if stride else 0) + 2
    want = (np.empty(total, np.int32), np.empty(total, np.float32), np.empty(nreads, np.int64))
    records_mod.split_records(src, layout, n, *want, header_stride=stride)
    got = (on_device(gpu, np.zeros(total, np.int32), off),
           on_device(gpu, np.zeros(total, np.float32), (off + 1) % 4),
           on_device(gpu, np.zeros(nreads, np.int64)))
    records_mod.split_records(on_device(gpu, src, off), layout, n, *got, header_stride=stride)
    for w, g in zip(want, got):
        assert same_bits(g, w), (len(layout), n, stride, gpu.schedule.name)
    return want[2][-2:].tolist()


def test_split_records_counts_every_fault(gpu):
    rng = np.random.default_rng(3)
    i = 0
    met = set()
    for ranks, slots, n in ((1, 0, 10), (1, 1, 5), (2, 37, 1000), (3, 700, 5000),
                            (4, 2500, 100000)):
        for faults in ((), ((0, "range"),), ((ranks - 1, "dup"),), ((0, "nan"), (0, "order")),
                       ((ranks - 1, "pad-value"),)):
            src, layout, width, kinds = record_sets(rng, ranks, slots, n, faults)
            met |= kinds
            vary_device(gpu, i)
            for sched in schedules_for(i):
                gpu.schedule = sched
                bad, unordered = check_split(gpu, src, layout, n, width if i % 2 else None, i % 4)
            i += 1
            assert (bad > 0) == bool(kinds & {"range", "nan", "pad-value"}), (faults, bad)
            # a padding index with a value is out of order too (it follows a real index)
            assert (unordered > 0) == bool(kinds & {"dup", "order", "pad-value"}), \
                (faults, unordered)
    assert met == {"range", "dup", "nan", "order", "pad-value"}, met


SEQUENTIAL = [s for s in SCHEDULES if s.resident == 1]
CONCURRENT = [s for s in SCHEDULES if s.resident > 1]

# (id, file, original text, planted bug, workload, schedules that must catch
#  it, schedules that must not, what catches it: a host build report or
#  "mismatch" with the twin)
def _split_dup(gpu):
    src, layout, width, _ = record_sets(np.random.default_rng(4), 3, 900, 4000, ((2, "dup"),))
    assert check_split(gpu, src, layout, 4000, width, 1)[1] == 1


def _accumulate(gpu):
    check_accumulate(gpu, selection_values(9001, 5), None, 1)


MUTATIONS = [
    ("split-records-duplicate-not-seen", "records.cu", "unordered += pad_before || i <= p",
     "unordered += pad_before || i < p", _split_dup, SCHEDULES, (), "mismatch"),
    ("accumulate-count-of-one-warp", "records.cu", "a += __shfl_xor_sync(kFull, a, d);",
     "a += __shfl_xor_sync(0x0000ffffu, a, d);", _accumulate, SCHEDULES, (),
     "not in mask 0x0000ffff"),
    ("records-block-sum-no-barrier", "records.cu", "    part[1][warp] = b;\n  }\n  __syncthreads();",
     "    part[1][warp] = b;\n  }\n", _accumulate, SCHEDULES, (), "shared memory race"),
    ("topk-tie-break", "topk.cu", "return h > prefix ? 1 : (h == prefix ? 2 : 0);",
     "return h >= prefix ? 1 : 0;", _topk_ties, SCHEDULES, (), "mismatch"),
    ("topk-zero-bins-no-barrier", "select_common.cuh",
     "bins[b] = 0;\n  __syncthreads();", "bins[b] = 0;\n", _topk_no_buffer, SCHEDULES, (),
     "shared memory race"),
    ("threshold-no-barrier-after-look-back", "select_common.cuh",
     "if (st == supers - 1) pol.total(before + agg);\n    }\n  }\n  __syncthreads();",
     "if (st == supers - 1) pol.total(before + agg);\n    }\n  }\n", _threshold, SCHEDULES,
     (), "shared memory race"),
    ("threshold-stash-ignores-earlier-tiles", "select_common.cuh",
     "u32 s = run + table[r * kWarps + warp] + excl[r];",
     "u32 s = table[r * kWarps + warp] + excl[r];", _threshold, SCHEDULES, (), "mismatch"),
    ("threshold-look-back-no-wait", "select_common.cuh",
     "while ((s & ~kValueMask) == 0) {\n        __nanosleep(64);\n        s = st[t];\n      }",
     "if ((s & ~kValueMask) == 0) s = kFlagAgg;", _threshold, CONCURRENT, SEQUENTIAL,
     "mismatch"),
    ("scatter-add-wrong-mask", "sparse.cu", "__shfl_xor_sync(0xffffffffu, nbad, d)",
     "__shfl_xor_sync(0x0000ffffu, nbad, d)", _scatter, SCHEDULES, (), "not in mask 0x0000ffff"),
    ("scatter-add-no-wait-for-earlier-segments", "sparse.cu",
     "while ((long long)*done < first[s]) __nanosleep(100);", "", _scatter_ordered,
     CONCURRENT, SEQUENTIAL, "mismatch"),
    ("cast-vector-tail-off-by-one", "common.cuh", "nvec = (n - head) / V;",
     "nvec = (n - head + V - 1) / V;", _cast, SCHEDULES, (), "out-of-bounds 16-byte load"),
    ("pack-segment-edge-off-by-one", "pack.cu", "if (first[mid] <= c) lo = mid;",
     "if (first[mid] < c) lo = mid;", _pack, SCHEDULES, (), "mismatch"),
]


def outcome(gpu, workload):
    """'fault: ...' (the host build reported), 'mismatch' (against the twin)
    or 'ok'."""
    try:
        workload(gpu)
    except KernelFault as e:
        return "fault: " + str(e).split("\n")[0]
    except AssertionError:
        return "mismatch"
    return "ok"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_planted_bug_is_caught(mutation, kernels, monkeypatch):
    _, source, old, new, workload, catching, passing, expect = mutation
    for sched in SCHEDULES:            # the workload passes on the real sources
        gpu = chb.HostCupy(kernels, sched)
        gpu.install(monkeypatch)
        assert outcome(gpu, workload) == "ok", sched.name
    bad = chb.build({source: [(old, new)]})
    results = {}
    for sched in SCHEDULES:
        gpu = chb.HostCupy(bad, sched)
        gpu.install(monkeypatch)
        results[sched.name] = outcome(gpu, workload)
    print(mutation[0], results)
    for sched in catching:
        assert expect in results[sched.name], (sched.name, results)
    for sched in passing:
        assert results[sched.name] == "ok", (sched.name, results)


# ---------------------------------------------------------------- misuse the runtime reports

def _faults_with(kernels, monkeypatch, source, old, new, workload):
    """The KernelFault messages of ``workload`` on the sources with one patch."""
    gpu = chb.HostCupy(chb.build({source: [(old, new)]}), SCHEDULES[0])
    gpu.install(monkeypatch)
    with pytest.raises(KernelFault) as info:
        workload(gpu)
    return str(info.value)


def test_barrier_reached_by_part_of_the_block_is_reported(kernels, monkeypatch):
    msg = _faults_with(kernels, monkeypatch, "select_common.cuh",
                       "bins[b] = 0;\n  __syncthreads();",
                       "bins[b] = 0;\n  if (threadIdx.x < 128) __syncthreads();", _topk_no_buffer)
    assert "__syncthreads at" in msg and ("while 128 threads wait at the one at" in msg
                                          or "reached by 128 of 256 threads" in msg), msg


def test_collective_naming_an_exited_lane_is_reported(kernels, monkeypatch):
    msg = _faults_with(kernels, monkeypatch, "sparse.cu", "#pragma unroll\n  for (int d = 16;",
                       "if ((threadIdx.x & 31u) == 5) return;\n  for (int d = 16;", _scatter)
    assert "exited" in msg and "__shfl_xor_sync" in msg, msg


def test_launch_arguments_are_checked(kernels):
    from commlib.errors import ArgumentError, ArrayTypeError
    x = np.zeros(4, np.float32)
    counter = np.zeros((), np.uint64)
    with pytest.raises(ArgumentError, match="takes 5 arguments, got 4"):
        kernels.launch("cast_f32_f32", 1, 32, [x, x, np.int64(4), np.float32(1)])
    with pytest.raises(ArgumentError, match=r"args\[3\] of cast_f32_f32: expected np.float32"):
        kernels.launch("cast_f32_f32", 1, 32, [x, x, np.int64(4), 1.0, counter])
    with pytest.raises(ArgumentError, match=r"args\[2\] of cast_f32_f32: expected an integer"):
        kernels.launch("cast_f32_f32", 1, 32, [x, x, 4.0, np.float32(1), counter])
    with pytest.raises(ArrayTypeError, match=r"args\[0\] of cast_f32_f32: expected an array"):
        kernels.launch("cast_f32_f32", 1, 32, [0, x, np.int64(4), np.float32(1), counter])
    with pytest.raises(ArgumentError, match="no kernel 'cast_f64_f32'"):
        kernels.launch("cast_f64_f32", 1, 32, [])
    with pytest.raises(KernelFault, match="bad launch configuration: grid 1, block 2048"):
        kernels.launch("cast_f32_f32", 1, 2048, [x, x, np.int64(4), np.float32(1), counter])


def test_every_output_byte_is_stored_once(kernels):
    # the kernels launched directly, each output byte's stores counted
    from commlib.ops import _pack_cuda
    for n, xoff, ooff in ((0, 0, 0), (1, 1, 0), (37, 3, 1), (4099, 2, 5)):
        x = adversarial("float32", n + 8, n)[xoff:xoff + n]
        out = np.zeros(n + 8, np.uint16)[ooff:ooff + n]
        counts = np.zeros(out.nbytes, np.uint8)
        counter = np.zeros((), np.uint64)
        for sched in SCHEDULES[:3]:
            counts[:] = 0
            kernels.launch("cast_f32_bf16", 3, 64, [x, out, np.int64(n), np.float32(1), counter],
                           sched, [(out.ctypes.data, out.ctypes.data + out.nbytes, "out", counts)])
            assert np.all(counts == 1), (n, xoff, ooff, sched.name)
    arrays = [adversarial("float16", s, s) for s in (3, 9000, 1, 8193)]
    bucket = np.zeros(sum(a.size for a in arrays) + 3, np.float32)[1:]
    total = sum(a.size for a in arrays)
    counts = np.zeros(4 * total, np.uint8)
    (launch,) = _pack_cuda.plan("pack", [a.dtype for a in arrays], [a.size for a in arrays],
                                [a.ctypes.data for a in arrays], bucket.dtype,
                                bucket.ctypes.data, "cast")
    table, nchunks = _pack_cuda.build_table(launch.segments, launch.chunk)
    regions = [(bucket.ctypes.data, bucket.ctypes.data + 4 * total, "bucket", counts)]
    regions += chb._pack_segments(launch.kernel, table, len(launch.segments))
    kernels.launch(launch.kernel, min(nchunks, 3), 256,
                   [table, np.int64(len(launch.segments)), np.int64(launch.chunk), bucket,
                    np.float32(0.5), np.zeros((), np.uint64), np.zeros((), np.int64)],
                   SCHEDULES[3], regions)
    assert np.all(counts == 1)
    want = np.zeros(total, np.float32)
    pack_mod.pack(arrays, want, 0.5)
    assert same_bits(bucket[:total], want)


def test_to_host_reads_every_device_array_in_one_read(gpu):
    from commlib.ops.arrays import to_host
    from commlib.compression import Completion
    xp = gpu.module
    host = [np.array(7, np.int64), np.arange(8, dtype=np.int32).reshape(2, 4) - 3,
            np.array([1, 2**40], np.int64), np.array([5], np.uint8)]
    kept = np.array([9, 9], np.int32)                  # a numpy array passes through
    groups = [(xp.asarray(host[0]),), (xp.asarray(host[1]), kept), (),
              (xp.asarray(host[2]), xp.asarray(host[3]))]
    del gpu.reads[:]
    got = to_host(groups)
    assert len(gpu.reads) == 1, gpu.reads
    assert [len(g) for g in got] == [1, 2, 0, 2] and got[1][1] is kept
    for want, a in zip(host, [got[0][0], got[1][0], got[3][0], got[3][1]]):
        assert type(a) is np.ndarray and a.dtype == want.dtype and a.shape == want.shape
        assert np.array_equal(a, want)
    # a Completion called on its own reads its values and finishes
    seen = []
    Completion((xp.asarray(host[1]), xp.asarray(host[0])), lambda *v: seen.append(v))()
    assert np.array_equal(seen[0][0], host[1]) and int(seen[0][1]) == 7
    with pytest.raises(commlib.errors.ArrayTypeError, match="expected integer arrays, got "
                       "dtype float32"):
        to_host([(xp.zeros(3, np.float32),)])
