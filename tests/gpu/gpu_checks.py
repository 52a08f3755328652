"""GPU checks run inside MPI jobs (imported by tests/gpu/test_gpu.py)."""
import numpy as np

import commlib
from commlib import errors
from collective_checks import assert_equal, expected_reduce, gathered, make


def to_host(a):
    import cupy
    return cupy.asnumpy(a)


def collectives_on_cupy(comm, rng):
    """all_reduce/broadcast/reduce/all_gather/reduce_scatter/all_gatherv with
    cupy arrays, checked against numpy on every rank's inputs."""
    import cupy
    n = comm.size
    for dtype in ["float16", "float32", "float64", "int32", "int64", "uint8"]:
        for op in ["sum", "max", "min"] + (["avg"] if np.dtype(dtype).kind == "f" else []):
            host = [make(rng, dtype, (m,), op) for m in (0, 1, 7, 4099, 300001)]
            ins = [gathered(h) for h in host]
            dev = [cupy.asarray(h) for h in host]
            assert comm.all_reduce(dev, op=op) is dev
            for d, i in zip(dev, ins):
                assert_equal(to_host(d), expected_reduce(i, op, n), "cupy %s %s" % (dtype, op))
    shapes = [(64, 3, 7, 7), (64,), (64,), (256, 64, 1, 1), (1000, 2048), (1000,)]
    host = [make(rng, "float32", s) for s in shapes]
    ins = [gathered(h) for h in host]
    dev = [cupy.asarray(h) for h in host]
    comm.all_reduce(dev, division=True)
    for d, i in zip(dev, ins):
        assert_equal(to_host(d), expected_reduce(i, "avg", n), "cupy list avg")
    for root in range(n):
        host = [make(rng, "float32", (m,)) for m in (1, 33, 70001)]
        want = gathered(host[0])[root], gathered(host[1])[root], gathered(host[2])[root]
        dev = [cupy.asarray(h) for h in host]
        comm.broadcast(dev, root=root)
        for d, w in zip(dev, want):
            assert_equal(to_host(d), w, "cupy broadcast")
        h = make(rng, "float64", (999,))
        ins = gathered(h)
        d = cupy.asarray(h)
        comm.reduce(d, root=root)
        assert_equal(to_host(d), expected_reduce(ins, "sum", n) if comm.rank == root else h,
                     "cupy reduce")
    h = make(rng, "int32", (3, 5))
    assert_equal(to_host(comm.all_gather(cupy.asarray(h))), np.stack(gathered(h)), "cupy all_gather")
    h = make(rng, "float32", (n * 1001,))
    ins = gathered(h)
    got = comm.reduce_scatter(cupy.asarray(h))
    assert_equal(to_host(got), expected_reduce(ins, "sum", n)[comm.rank * 1001:(comm.rank + 1) * 1001],
                 "cupy reduce_scatter")
    h = make(rng, "float32", (comm.rank * 3 + 1,))
    values, counts = comm.all_gatherv(cupy.asarray(h))
    assert_equal(to_host(values), np.concatenate(gathered(h)), "cupy all_gatherv")
    # a repeated list (fusion cache from the second call; its buckets'
    # packs and unpacks replayed as CUDA graphs from the third) stays right:
    # float32 buckets and arrays reduced in place, float64 ones averaged
    # (copied by cupy operations, outside the graphs)
    sizes = [(100, "float32")] * 50 + [(7, "float32"), (300001, "float32"), (1, "float32"),
                                       (33, "float64"), (9, "float64")]
    dev = [cupy.zeros(m, dtype=dt) for m, dt in sizes]
    for step in range(6):
        host = [make(rng, dt, (m,)) for m, dt in sizes]
        ins = [gathered(h) for h in host]
        for d, h in zip(dev, host):
            d.set(h)
        assert comm.all_reduce(dev, op="avg") is dev
        for d, i in zip(dev, ins):
            assert_equal(to_host(d), expected_reduce(i, "avg", n),
                         "cupy repeated list avg, call %d" % step)
    comm.barrier(timeout=30)


def device_errors(comm):
    import cupy
    a = cupy.ones(4, dtype=cupy.float32)
    try:
        comm.all_reduce([a, np.ones(4, np.float32)])
    except errors.ArrayTypeError as exc:
        assert "arrays[1] is a numpy.ndarray but arrays[0] is a cupy.ndarray" in str(exc), exc
    else:
        raise AssertionError("mixed numpy/cupy accepted")
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device((comm.device + 1) % cupy.cuda.runtime.getDeviceCount()):
            b = cupy.ones(4, dtype=cupy.float32)
        try:
            comm.all_reduce(b)
        except errors.DeviceMismatchError as exc:
            assert "but this communicator uses GPU %d" % comm.device in str(exc)
        else:
            raise AssertionError("array on another GPU accepted")


def main(which):
    rng = np.random.default_rng(4321 + 17 * __import__("mpi4py").MPI.COMM_WORLD.rank)
    if which == "nccl":
        comm = commlib.Communicator.from_mpi(backend="nccl")
        assert comm.backend == "nccl"
    else:
        comm = commlib.Communicator.from_mpi(backend="mpi")
        assert comm.backend == "mpi"
    if comm.device is not None:     # arrays on the rank's GPU, as a training loop makes them
        import cupy
        cupy.cuda.Device(comm.device).use()
    collectives_on_cupy(comm, rng)
    new_calls_on_cupy(comm)
    device_errors(comm)
    comm.close()
    print("gpu %s rank %d ok" % (which, comm.rank))


def new_calls_on_cupy(comm):
    """send/recv, batch_send_recv, scatter, gather, all_to_all(v), objects
    and split with cupy arrays (tests/collective/p2p_checks.py), against
    numpy and mpi4py on every rank's inputs."""
    import cupy
    import p2p_checks
    p2p_checks.check_p2p(comm, cupy)
    p2p_checks.check_exchanges(comm, cupy)


def p2p_nccl():
    """The new calls at NCCL world size 1 (scripts/gpu_check.sh's p2p stage)."""
    import cupy
    comm = commlib.Communicator.from_mpi(backend="nccl")
    cupy.cuda.Device(comm.device).use()
    new_calls_on_cupy(comm)
    comm.close()
    print("p2p nccl world size 1 ok")


# ---------------------------------------------------------------- one-shot GPU check stages
# (scripts/gpu_check.sh runs ``python tests/gpu/gpu_checks.py STAGE``)

def compile_all():
    """Compile every kernel module through NVRTC (cupy.RawModule); prints seconds per module."""
    import time
    from commlib.ops import _loader, _pack_cuda, cast as cast_mod
    names = {"cast.cu": cast_mod.KERNEL_NAMES, "pack.cu": _pack_cuda.KERNEL_NAMES,
             "topk.cu": ("topk_sample", "topk_hist1", "topk_hist1_resid",
                         "topk_hist1_resid_scalar", "topk_filter", "topk_refine", "topk_compact"),
             "threshold.cu": ("threshold_select",), "sparse.cu": ("scatter_add",),
             "records.cu": ("accumulate_finite", "split_records")}
    total = 0.0
    for source, kernels in names.items():
        t0 = time.perf_counter()
        for k in kernels:
            fn = _loader.get_function(source, k)
            a = fn.attributes
            print("  %s %s: %d regs, %d B shared, %d B local, %d blocks/SM" % (
                source, k, a["num_regs"], a["shared_size_bytes"], a["local_size_bytes"],
                _loader.resident_blocks(fn, 256)))
        dt = time.perf_counter() - t0
        total += dt
        print("%s: %.2f s" % (source, dt))
    print("all modules: %.2f s" % total)


def _topk_twin(x, k, resid=None):
    from commlib.ops.topk import _topk_numpy
    return _topk_numpy(x.copy(), k, None if resid is None else resid.copy())


K_LOW = 8  # kernels/topk.cu: workspace word of the sampled low bound


class _forced_topk_path:
    """Forces a top-K path: "sample_high" overwrites the sampled bound after
    topk_sample with one above every key (the first pass gathers nothing, so
    topk_filter compacts the bucket and above, or the input is read again);
    "no_buffer" turns the candidate buffer off (no sample, every pass reads
    the input); None leaves things as they are."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        from commlib.ops import _loader, topk
        self.saved = (topk._candidate_capacity, _loader.get_function)
        if self.mode == "no_buffer":
            topk._candidate_capacity = lambda n, k: 0
        elif self.mode == "sample_high":
            real = self.saved[1]

            def get_function(source, name, *a):
                fn = real(source, name, *a)
                if name != "topk_sample":
                    return fn

                def launch(grid, block, args, **kw):
                    fn(grid, block, args, **kw)
                    args[4][K_LOW] = 0x7F800001   # the workspace, same stream
                return launch
            _loader.get_function = get_function
        return self

    def __exit__(self, *exc):
        from commlib.ops import _loader, topk
        topk._candidate_capacity, _loader.get_function = self.saved
        return False


def _check_topk(topk, x, k, off, rng):
    import cupy
    from commlib.ops.topk import _topk_numpy
    xd = cupy.asarray(np.concatenate([np.zeros(off, np.float32), x]))[off:]
    got = [cupy.asnumpy(a) for a in topk.topk(xd, k)]
    want = _topk_twin(x, k)
    assert all(np.array_equal(g.view(np.uint32), w.view(np.uint32))
               for g, w in zip(got, want)), ("topk", x.size, k, off)
    r = rng.standard_normal(x.size).astype(np.float32)
    # off and 1 - off: the residual misaligned like x, or differently
    rd = cupy.asarray(np.concatenate([np.zeros(1 - off, np.float32), r]))[1 - off:]
    got = [cupy.asnumpy(a) for a in topk.topk(xd, k, residual=rd)]
    want_r = r.copy()
    want = _topk_numpy(x, k, want_r)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), \
        ("topk residual", x.size, k, off)
    assert np.array_equal(cupy.asnumpy(rd), want_r, equal_nan=True)
    return xd


def small_workload(quick=False):
    """Small calls of every kernel path (for compute-sanitizer), each checked
    against its twin: top-K with the candidate buffer gathered in the first
    pass, filled by the second, or off, settled early (k = n), with error
    feedback aligned and misaligned, NaN and tie-heavy inputs; threshold;
    scatter-add; pack. ``quick``: fewer sizes and inputs."""
    import cupy
    from commlib.ops import pack as pack_mod, sparse, threshold, topk
    rng = np.random.default_rng(1)
    sizes = ((70001, 700), (5000, 5000)) if quick else \
        ((70001, 700), (70001, 30000), (5000, 5000), (4096 * 3 + 7, 1))
    for n, k in sizes:
        for kind in (("normal", "nan") if quick else ("normal", "ties", "nan")):
            x = rng.standard_normal(n).astype(np.float32)
            if kind == "ties":
                x = np.round(x * 2).astype(np.float32)
            if kind == "nan":
                x[::3] = np.nan
            for off in (0, 1):
                for mode in (None, "sample_high", "no_buffer"):
                    with _forced_topk_path(mode):
                        xd = _check_topk(topk, x, k, off, rng)
                idx, val, cnt = threshold.threshold(xd, 1.5)
                widx, wval, wcnt = threshold._threshold_numpy(x, threshold.threshold_key(1.5), n)
                m = int(wcnt)
                assert int(cnt) == m and np.array_equal(cupy.asnumpy(idx)[:m], widx[:m])
    dense = rng.standard_normal(100003).astype(np.float32)
    idx = np.concatenate([rng.choice(dense.size, 1000, replace=False) for _ in range(4)]).astype(np.int32)
    val = rng.standard_normal(idx.size).astype(np.float32)
    dd = cupy.asarray(dense)
    bad = sparse.scatter_add(dd, cupy.asarray(idx), cupy.asarray(val), segments=[1000] * 4)
    want = dense.copy()
    sparse._scatter_add_numpy(want, idx, val, np.float32(1))
    assert int(bad) == 0 and np.array_equal(cupy.asnumpy(dd), want)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in (1, 7, 4099, 300, 65536 + 3)]
    total = sum(a.size for a in arrays)
    bucket = cupy.zeros(total + 5, dtype=cupy.float16)
    pack_mod.pack([cupy.asarray(a) for a in arrays], bucket[1:], scale=0.5)
    host = np.zeros(total + 4, np.float16)
    pack_mod.pack(arrays, host, scale=0.5)
    assert np.array_equal(cupy.asnumpy(bucket[1:]), host)
    cupy.cuda.Device().synchronize()
    print("small workload ok")


def concurrent_streams(sizes=(25_000_000, 9_000_001)):
    """Top-K and threshold calls in flight at once on one stream per size
    (each with its own workspace), compared with the twins."""
    import cupy
    from commlib.ops import threshold, topk
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in xs]
    out = []
    for x, s in zip(xs, streams):
        with s:
            xd = cupy.asarray(x)
            out.append((topk.topk(xd, x.size // 100), threshold.threshold(xd, 2.5)))
    for s in streams:
        s.synchronize()
    for x, ((i, v), (ti, tv, tc)) in zip(xs, out):
        wi, wv = _topk_twin(x, x.size // 100)
        assert np.array_equal(cupy.asnumpy(i), wi) and np.array_equal(cupy.asnumpy(v), wv)
        hit = np.flatnonzero(np.abs(x) > 2.5)
        assert int(tc) == hit.size and np.array_equal(cupy.asnumpy(ti)[:hit.size], hit)
    print("concurrent streams ok")


def replayed_buckets(calls=8, nan_at=5):
    """The compressed buckets whose launches are replayed as CUDA graphs
    (commlib.ops.graphs: top-K with error feedback, fp16, bf16) against
    numpy (:func:`against_numpy`), on the null stream and on a stream of its
    own; graphs were captured and launched."""
    import cupy
    from commlib.compression import TopK
    from commlib.ops import graphs
    ways = []
    replay = graphs.replay

    def counted(store, key, issue):
        ways.append(replay(store, key, issue))
        return ways[-1]
    graphs.replay = counted
    try:
        for stream in (cupy.cuda.Stream.null, cupy.cuda.Stream(non_blocking=True)):
            for compression in (TopK(0.01), "fp16", "bf16"):
                # one bucket; then several, issued together (reduce_all),
                # the NaN in a later one
                with stream:
                    against_numpy((1_000_003, 4096, 17, 250_000, 3), compression,
                                  calls=calls, nan_at=nan_at, seed=8)
                    against_numpy((1_000_003, 4096, 17, 250_000, 3), compression,
                                  calls=calls, nan_at=nan_at, seed=9, bucket_bytes=1 << 20,
                                  nan_in=(3,))
    finally:
        graphs.replay = replay
    tally = {w: ways.count(w) for w in ("direct", "captured", "graph")}
    assert tally["captured"] and tally["graph"] > tally["captured"], tally
    print("replayed buckets ok: %s" % tally)


def against_numpy(sizes, compression, op="avg", calls=7, nan_at=None, seed=0,
                  bucket_bytes=1 << 22, nan_in=None):
    """``calls`` all-reduces of new gradients in the same cupy arrays (the
    buckets' launches become graphs from the third call) by a communicator
    of one process against one on numpy arrays of the same values, both in
    buckets of ``bucket_bytes``: the same bits after every call; at call
    ``nan_at`` a NaN in every array (or in those ``nan_in`` lists), and
    both raise NonFiniteError (with the arrays unchanged when every array
    got one; else the buckets before the first bad one are written, alike
    on both)."""
    import cupy
    rng = np.random.default_rng(seed)
    host = [np.zeros(n, np.float32) for n in sizes]
    dev = [cupy.zeros(n, np.float32) for n in sizes]
    comms = [commlib.Communicator.single(bucket_bytes=bucket_bytes),
             commlib.Communicator.single(device=0, bucket_bytes=bucket_bytes)]
    try:
        for call in range(calls):
            for i, (h, d) in enumerate(zip(host, dev)):
                h[:] = rng.standard_normal(h.size).astype(np.float32)
                if call == nan_at and (nan_in is None or i in nan_in):
                    h[h.size // 2] = np.nan
                d.set(h)
            kept = [h.copy() for h in host]
            for c, arrays in zip(comms, (host, dev)):
                try:
                    c.all_reduce(arrays, op=op, compression=compression)
                except errors.NonFiniteError:
                    assert call == nan_at, (compression, call)
                else:
                    assert call != nan_at, (compression, call)
            for i, (h, d) in enumerate(zip(host, dev)):
                if call == nan_at and nan_in is None:
                    assert np.array_equal(h, kept[i], equal_nan=True), (compression, call, i)
                assert np.array_equal(h.view(np.uint32), cupy.asnumpy(d).view(np.uint32)), \
                    (compression, call, i)
    finally:
        for c in comms:
            c.close()


def large_n(n=None, k=1000):
    """The largest length the selection kernels accept (n = 2^31 - 1 by
    default, int32 indices): k planted values, the last ones at the very end,
    must be exactly what top-K and threshold return."""
    import cupy
    from commlib.ops import threshold, topk
    from commlib.ops.selection import MAX_LEN
    n = MAX_LEN if n is None else n
    x = cupy.random.default_rng(3).random(n, dtype=cupy.float32)   # [0, 1)
    pos = np.unique(np.concatenate([np.linspace(0, n - 1, k - 3).astype(np.int64),
                                    [n - 3, n - 2, n - 1]]))
    x[cupy.asarray(pos)] = cupy.asarray(2.0 + np.arange(pos.size, dtype=np.float32))
    i, v = topk.topk(x, pos.size)
    assert np.array_equal(cupy.asnumpy(i), pos), "topk indices"
    ti, tv, tc = threshold.threshold(x, 1.5, capacity=2 * k)
    assert int(tc) == pos.size and np.array_equal(cupy.asnumpy(ti)[:pos.size], pos)
    print("N = %d ok" % n)


if __name__ == "__main__":
    import sys
    {"compile": compile_all, "small": small_workload,
     "small-quick": lambda: small_workload(quick=True), "streams": concurrent_streams,
     "replayed": replayed_buckets, "p2p": p2p_nccl,
     "large": large_n}[sys.argv[1]]()
