"""Checks of compressed all-reduce run inside MPI jobs (tests/compression/test_compression.py).

Every rank reduces its own random inputs; the expected values are computed
independently with numpy from every rank's inputs (all-gathered)."""
import sys
import warnings

import numpy as np
from mpi4py import MPI

import commlib
from commlib import errors
from commlib.compression import BF16, FP16, HalfPrecision, Partial, Threshold, TopK

WORLD = MPI.COMM_WORLD
SHAPES = [(3,), (0,), (17, 5), (1,), (257,), (300_001,), (64, 64), (2,)]   # one > the bucket


def halves(x, fmt="fp16"):
    """``x`` rounded to float16 or bfloat16 (to nearest even), as float32;
    bfloat16 through ml_dtypes, independently of commlib's casts."""
    if fmt == "fp16":
        return x.astype(np.float16).astype(np.float32)
    import ml_dtypes
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def check_half(comm, xp, to_host, op, division, seed, views=False, fmt="fp16"):
    """``views``: the float32 arrays are commlib.flat_arrays (zero-copy buckets)."""
    rank, n = comm.rank, comm.size
    rng = np.random.default_rng(seed * 100 + rank)
    averaging = op == "avg" or division
    # as views, the large array goes last so the small ones form one zero-copy bucket
    shapes = sorted(SHAPES, key=lambda s: np.prod(s) > 100_000) if views else SHAPES
    host = [(rng.standard_normal(s) * 3).astype(np.float32) for s in shapes]
    arrays = commlib.flat_arrays(shapes, np.float32, xp=xp) if views else []
    for a, h in zip(arrays, host):
        a[...] = xp.asarray(h)
    host.append(rng.standard_normal(5))                                   # float64: as is
    if not averaging:
        host.append(rng.integers(-9, 9, 6).astype(np.int32))              # int32: as is
    arrays += [xp.asarray(h) for h in host[len(arrays):]]
    everyone = WORLD.allgather(host)
    comm.all_reduce(arrays, op=op, division=division, compression=fmt)
    got = [to_host(a) for a in arrays]
    reduce = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}[op]
    for k, g in enumerate(got):
        inputs = [everyone[r][k] for r in range(n)]
        if g.dtype != np.float32:                   # uncompressed: exact rank-order result
            want = inputs[0].copy()
            for x in inputs[1:]:
                want = reduce(want, x)
            if averaging:
                want = want / n
            assert np.allclose(g, want, rtol=1e-12, atol=0), (k, op)
            continue
        # travelled in half precision: divided by n first when averaging, then cast
        terms = [halves(x / np.float32(n) if averaging else x, fmt).astype(np.float64)
                 for x in inputs]
        want = terms[0]
        for t in terms[1:]:
            want = reduce(want, t)
        eps = 2.0 ** -10 if fmt == "fp16" else 2.0 ** -7
        bound = sum(np.abs(t) for t in terms) * (n * eps) + 2.0 ** -24
        assert (halves(g, fmt) == g).all(), "result did not come through " + fmt
        assert (np.abs(g - want) <= bound).all(), (k, op, fmt, np.abs(g - want).max())
    mine = b"".join(g.tobytes() for g in got)
    assert all(b == mine for b in WORLD.allgather(mine)), "ranks differ"


SPARSE_SHAPES = [(3,), (0,), (17, 5), (1,), (257,), (64, 64), (2,), (20_000,)]
SPARSE_BUCKET = 64 << 10        # all but the last array form one bucket; the last is its own


def units(arrays):
    """The reduction units of SPARSE_SHAPES under SPARSE_BUCKET: the small
    arrays back to back, then the large one."""
    return [np.concatenate([a.reshape(-1) for a in arrays[:-1]]), arrays[-1].reshape(-1)]


def select_topk(acc, ratio):
    """Indices of the k largest |acc| (k = max(1, ceil(ratio * n))), lowest
    index first among equals, NaN never; ascending."""
    k = min(acc.size, max(1, int(np.ceil(ratio * acc.size))))
    mag = np.abs(acc.astype(np.float64))
    mag[np.isnan(mag)] = -1.0
    order = np.lexsort((np.arange(acc.size), -mag))[:k]
    return np.sort(order[mag[order] >= 0])


def select_threshold(acc, t):
    return np.flatnonzero(np.abs(acc) > np.float32(t))


def check_sparse(comm, xp, to_host, strategy, select, op, steps=3):
    """``steps`` calls with fresh gradients; residuals tracked independently.
    Rank 0 has a NaN and the last rank an inf (step 1) in the large array:
    with ``nonfinite="warn"`` they are dropped (residual 0) with one warning
    per call of that unit."""
    rank, n = comm.rank, comm.size
    arrays = [xp.zeros(s, dtype=np.float32) for s in SPARSE_SHAPES]
    residual = [[np.zeros(u.size, np.float32) for u in units([np.zeros(s, np.float32)
                                                              for s in SPARSE_SHAPES])]
                for _ in range(n)]
    for step in range(steps):
        rng = np.random.default_rng(1000 * step + 17)          # every rank's inputs, everywhere
        inputs = [[(rng.standard_normal(s) * (r + 1)).astype(np.float32) for s in SPARSE_SHAPES]
                  for r in range(n)]
        inputs[0][-1][5] = np.nan                               # never sent
        inputs[n - 1][-1][7] = np.inf if step == 1 else inputs[n - 1][-1][7]
        for a, h in zip(arrays, inputs[rank]):
            a[...] = xp.asarray(h)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm.all_reduce(arrays, op=op, compression=strategy)
        caught = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        dropped = "rank 0 (1 value)" + (", rank %d (1 value)" % (n - 1) if step == 1 else "")
        if n == 1 and step == 1:
            dropped = "rank 0 (2 values)"
        assert len(caught) == 1 and dropped in str(caught[0].message), \
            (step, [str(w.message) for w in caught])
        expected = [np.zeros(u.size, np.float32) for u in units(inputs[0])]
        for r in range(n):
            for u, (grad, res, out) in enumerate(zip(units(inputs[r]), residual[r], expected)):
                acc = res + grad if strategy.error_feedback else grad.copy()
                acc[~np.isfinite(acc)] = 0                      # dropped: not sent, not owed
                chosen = select(acc)
                out[chosen] += acc[chosen]
                acc[chosen] = 0
                residual[r][u] = acc if strategy.error_feedback else res
        if op == "avg":
            for out in expected:
                out *= np.float32(1.0 / n)
        got = units([to_host(a) for a in arrays])
        for g, e in zip(got, expected):
            assert g.tobytes() == e.tobytes(), (strategy, step, np.flatnonzero(g != e)[:5])
        mine = b"".join(g.tobytes() for g in got)
        assert all(b == mine for b in WORLD.allgather(mine)), "ranks differ"


def check_partial(comm, xp, to_host, fraction, op, calls=7):
    """Each call reduces the next window of each unit; the rest stays local.
    Integer-valued inputs keep every sum exact in any order."""
    rank, n = comm.rank, comm.size
    strategy = Partial(fraction)
    arrays = [xp.zeros(s, dtype=np.float32) for s in SPARSE_SHAPES]
    for call in range(calls):
        rng = np.random.default_rng(call)
        inputs = [[rng.integers(-50, 50, s).astype(np.float32) for s in SPARSE_SHAPES]
                  for _ in range(n)]
        for a, h in zip(arrays, inputs[rank]):
            a[...] = xp.asarray(h)
        comm.all_reduce(arrays, op=op, compression=strategy)
        got = units([to_host(a) for a in arrays])
        for u, g in enumerate(got):
            width = max(1, int(np.ceil(fraction * g.size)))
            start = (call % int(np.ceil(g.size / width))) * width
            stop = min(g.size, start + width)
            want = units(inputs[rank])[u].copy()
            pieces = [units(inputs[r])[u][start:stop] for r in range(n)]
            total = np.maximum.reduce(pieces) if op == "max" else sum(pieces)
            want[start:stop] = total * np.float32(1.0 / n) if op == "avg" else total
            assert g.tobytes() == want.tobytes(), (fraction, op, call, u)


def check_range(comm, xp, to_host):
    """Averaging divides before the cast: no overflow; a sum beyond float16 is
    inf; bfloat16 has float32's range."""
    n = comm.size
    x = xp.full(1000, 40000.0, dtype=np.float32)
    comm.all_reduce(x, op="avg", compression="fp16")
    assert (to_host(x) == 40000.0).all()
    x = xp.full(1000, 40000.0, dtype=np.float32)
    try:                                # default nonfinite="raise": no rank to blame
        comm.all_reduce(x, op="sum", compression="fp16")
        assert n == 1, "a float16 overflow was not reported"
    except errors.NonFiniteError as exc:
        assert n > 1 and exc.counts == (0,) * n and exc.culprits == (), (exc, exc.counts)
        assert "holds 1000 NaN or inf" in str(exc) and "overflowed" in str(exc), exc
    assert (to_host(x) == 40000.0).all(), to_host(x)[:3]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.all_reduce(x, op="sum", compression=FP16(nonfinite="warn"))
    want = np.inf if n > 1 else 40000.0
    assert (to_host(x) == want).all(), to_host(x)[:3]
    assert len(caught) == (n > 1), [str(w.message) for w in caught]
    x = xp.full(1000, 3.0e38, dtype=np.float32)
    comm.all_reduce(x, op="avg", compression="bf16")
    got = to_host(x).astype(np.float64)
    assert np.isfinite(got).all() and (np.abs(got - 3.0e38) <= 3.0e38 * n * 2.0 ** -7).all(), got[:3]


def check_errors(comm, xp):
    x = xp.ones(4, dtype=np.float32)
    try:
        comm.all_reduce(x, compression="zip")
    except errors.ArgumentError as exc:
        assert "rank %d" % comm.rank in str(exc) and "compression='zip'" in str(exc), exc
    else:
        raise AssertionError("compression='zip' accepted")
    assert (to_host_any(x) == 1).all()              # untouched
    checked = commlib.Communicator.from_mpi(backend=comm.backend, check=True)
    try:
        if comm.size > 1:
            checked.all_reduce(x, compression="fp16" if comm.rank == 0 else None)
            raise AssertionError("ranks with and without compression were not told apart")
    except errors.ConsistencyError as exc:
        assert "compression=fp16" in str(exc), exc
    finally:
        checked.close()


def check_sparse_errors(comm, xp):
    ratio = "TopK: ratio must be a number in (0, 1], got %s"
    for bad, text in ((lambda: TopK(0), ratio % 0), (lambda: TopK(1.5), ratio % 1.5),
                      (lambda: TopK(True), ratio % True),
                      (lambda: Threshold(-1), "Threshold: threshold must be a finite number "
                                              ">= 0, got -1"),
                      (lambda: Threshold(float("inf")), "Threshold: threshold must be a finite "
                                                        "number >= 0, got inf"),
                      (lambda: Partial(0), "Partial: fraction must be a number in (0, 1], got 0"),
                      (lambda: Partial("a"), "Partial: fraction must be a number in (0, 1], "
                                             "got 'a'"),
                      (lambda: TopK(nonfinite="ignore"), "TopK: nonfinite must be 'raise' or "
                                                         "'warn', got 'ignore'"),
                      (lambda: Threshold(1, nonfinite=None), "Threshold: nonfinite must be "
                                                             "'raise' or 'warn', got None"),
                      (lambda: FP16(nonfinite="Raise"), "FP16: nonfinite must be 'raise' or "
                                                        "'warn', got 'Raise'"),
                      (lambda: BF16(nonfinite=1), "BF16: nonfinite must be 'raise' or 'warn', "
                                                  "got 1"),
                      (lambda: HalfPrecision("float16", "zero"), "HalfPrecision: nonfinite "
                                                                 "must be 'raise' or 'warn', "
                                                                 "got 'zero'")):
        try:
            bad()
        except errors.ArgumentError as exc:
            assert type(exc) is errors.ArgumentError and str(exc) == text, (str(exc), text)
        else:
            raise AssertionError("bad compression settings accepted: " + text)
    x = xp.ones(8, dtype=np.float32)
    for strategy in (TopK(0.5), Threshold(0.5)):
        try:
            comm.all_reduce(x, op="max", compression=strategy)
        except errors.ArgumentError as exc:
            assert "rank %d" % comm.rank in str(exc) and "op='max'" in str(exc), exc
        else:
            raise AssertionError("op='max' accepted with %s" % strategy)
        assert (to_host_any(x) == 1).all()


def to_host_any(a):
    return a if isinstance(a, np.ndarray) else a.get()


def main(which):
    if which == "cupy":
        import cupy
        xp, to_host = cupy, (lambda a: a.get())
        comm = commlib.init()
    else:
        xp, to_host = np, (lambda a: a)
        comm = commlib.Communicator.from_mpi(backend="mpi")
    seed = 0
    every = ((False, "fp16"), (False, "fp16"), (True, "fp16"), (False, "bf16"),
             (True, "bf16"))                        # repeated: buffers reused
    for op, division in [("avg", False), ("sum", True), ("sum", False), ("max", False),
                         ("min", False)]:
        # every layout and format with the average; each other op with each format,
        # one of them on views
        for views, fmt in every if op == "avg" else ((False, "fp16"), (True, "bf16")):
            seed += 1
            check_half(comm, xp, to_host, op, division, seed, views, fmt)
    check_range(comm, xp, to_host)
    check_errors(comm, xp)
    comm.close()

    def sparse_comm():
        return commlib.Communicator.from_mpi(backend=None if which == "cupy" else "mpi",
                                             bucket_bytes=SPARSE_BUCKET)

    # several buckets and an array reduced in place (cupy: issued together)
    with sparse_comm() as small:
        for fmt in ("fp16", "bf16"):
            seed += 1
            check_half(small, xp, to_host, "avg", False, seed, False, fmt)

    # residuals belong to the communicator and the strategy's settings: each
    # run starts from zero residuals on a communicator of its own
    for ef in (True, False):
        for op in ("avg", "sum"):
            for strategy, select in (
                    (TopK(0.05, error_feedback=ef, nonfinite="warn"),
                     lambda acc: select_topk(acc, 0.05)),
                    (Threshold(1.2, error_feedback=ef, nonfinite="warn"),
                     lambda acc: select_threshold(acc, 1.2))):
                with sparse_comm() as sparse:
                    check_sparse(sparse, xp, to_host, strategy, select, op)
    sparse = sparse_comm()
    check_sparse_errors(sparse, xp)
    sparse.close()
    for fraction in (0.3, 1.0, 1e-9):
        for op in ("avg", "sum", "max"):
            with sparse_comm() as fresh:       # the windows start at the first
                check_partial(fresh, xp, to_host, fraction, op)
    print("compression rank %d ok" % WORLD.rank)


if __name__ == "__main__":
    main(sys.argv[1])
