"""Checks run inside MPI jobs (imported by the ranks of tests/collective/test_collectives.py).

Each check builds per-rank inputs, runs one commlib collective, and compares
with numpy applied to every rank's inputs gathered by plain mpi4py (never by
commlib itself). A failed check raises AssertionError, which aborts the job.
"""
import json
from pathlib import Path

import numpy as np
from mpi4py import MPI

import commlib

WORLD = MPI.COMM_WORLD
DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]
LENGTHS = [0, 1, 2, 3, 7, 13, 31, 127, 8191, 100003]
REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def gathered(a):
    """Every rank's copy of ``a`` (list indexed by rank), via plain mpi4py."""
    return WORLD.allgather(np.array(a, copy=True))


def make(rng, dtype, shape, op="sum"):
    """Random values whose reduction is exact in ``dtype`` for 4 ranks."""
    if op == "prod":
        values = rng.integers(1, 3, size=shape)
    elif np.dtype(dtype).kind == "f":
        values = rng.integers(-8, 9, size=shape) / 4
    elif dtype == "uint8":
        values = rng.integers(0, 60, size=shape)
    else:
        values = rng.integers(-1000, 1000, size=shape)
    return np.asarray(values).astype(dtype)


def expected_reduce(inputs, op, size):
    if op == "avg":
        total = inputs[0].astype(np.float64)
        for x in inputs[1:]:
            total = total + x
        return (total / size).astype(inputs[0].dtype)
    acc = inputs[0].copy()
    for x in inputs[1:]:
        REDUCE[op](acc, x, out=acc)
    return acc


def assert_equal(got, want, what):
    assert got.dtype == want.dtype, "%s: dtype %s != %s" % (what, got.dtype, want.dtype)
    assert got.shape == want.shape, "%s: shape %s != %s" % (what, got.shape, want.shape)
    if got.dtype.kind == "f":
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3, atol=1e-3)
    else:
        ok = np.array_equal(got, want)
    assert ok, "%s: rank %d got %s, want %s" % (what, WORLD.rank, got[:8], want[:8])


def check_all_reduce_dtypes_lengths(comm, rng):
    for dtype in DTYPES:
        ops = ["sum", "max", "min", "prod"] + (["avg"] if np.dtype(dtype).kind == "f" else [])
        for op in ops:
            arrays = [make(rng, dtype, (n,), op) for n in LENGTHS]
            inputs = [gathered(a) for a in arrays]
            result = comm.all_reduce(arrays, op=op)
            assert result is arrays
            for n, a, ins in zip(LENGTHS, arrays, inputs):
                assert_equal(a, expected_reduce(ins, op, comm.size), "all_reduce %s %s n=%d"
                             % (dtype, op, n))
    # a single array, and division=True (nnabla's spelling of avg)
    x = make(rng, "float32", (5, 7))
    ins = gathered(x)
    assert comm.all_reduce(x, division=True) is x
    assert_equal(x, expected_reduce(ins, "avg", comm.size), "division=True")


def check_many_small_arrays(comm, rng):
    same = np.random.default_rng(99)        # shapes agree on every rank
    shapes = [tuple(same.integers(1, 6, size=same.integers(0, 4))) for _ in range(300)]
    dts = [DTYPES[i % 3 + 1] for i in range(300)]           # mixed float32/64, int32
    arrays = [make(rng, dt, s) for dt, s in zip(dts, shapes)]
    inputs = [gathered(a) for a in arrays]
    comm.all_reduce(arrays)
    for i, (a, ins) in enumerate(zip(arrays, inputs)):
        assert_equal(a, expected_reduce(ins, "sum", comm.size), "300 arrays [%d]" % i)


def check_larger_than_bucket(comm, rng):
    """Buckets of 4 KiB: many buckets, and arrays reduced in place."""
    small = commlib.Communicator.from_mpi(bucket_bytes=4096)
    arrays = [make(rng, "float32", (n,)) for n in (1000, 1023, 1024, 1025, 5000, 3, 77777)]
    inputs = [gathered(a) for a in arrays]
    small.all_reduce(arrays, op="avg")
    for a, ins in zip(arrays, inputs):
        assert_equal(a, expected_reduce(ins, "avg", small.size), "bucket 4 KiB n=%d" % a.size)
    small.close()
    # buckets and arrays larger than the shared-memory window (2 MiB): reduced piece by piece
    large = commlib.Communicator.from_mpi(bucket_bytes=8 << 20)
    arrays = [make(rng, "float32", (60_001,)) for _ in range(12)]        # one 2.9 MB bucket
    arrays.append(make(rng, "float64", (1_200_007,)))                   # 9.6 MB, in place
    inputs = [gathered(a) for a in arrays]
    large.all_reduce(arrays, op="avg")
    for a, ins in zip(arrays, inputs):
        assert_equal(a, expected_reduce(ins, "avg", large.size), "bucket 8 MiB n=%d" % a.size)
    large.close()


def check_flat_views(comm, rng):
    """Arrays that are views of one buffer: reduced in place, no copy."""
    small = commlib.Communicator.from_mpi(bucket_bytes=4096)
    shapes = [(7, 3), (100,), (1,), (300,), (2, 2, 2), (2000,), (5,)]
    arrays = commlib.flat_arrays(shapes)
    for step in range(3):                       # repeated: the fusion cache is used
        for a in arrays:
            a[...] = make(rng, "float32", a.shape)
        inputs = [gathered(a) for a in arrays]
        small.all_reduce(arrays, op="avg")
        for a, ins in zip(arrays, inputs):
            assert_equal(a, expected_reduce(ins, "avg", small.size), "flat views %s" % (a.shape,))
    root = small.size - 1
    want = WORLD.bcast([a.copy() for a in arrays], root=root)
    small.broadcast(arrays, root=root)
    for a, w in zip(arrays, want):
        assert_equal(a, w, "flat views broadcast")
    small.close()


def check_sub_communicator(comm, rng):
    """A communicator built on a split of COMM_WORLD reduces within its group."""
    color = WORLD.rank % 2
    group = WORLD.Split(color, key=WORLD.rank)
    sub = commlib.Communicator.from_mpi(group)
    assert (sub.rank, sub.size) == (group.rank, group.size)
    arrays = [make(rng, "float32", (n,)) for n in (3, 70000, 300000)]
    inputs = [group.allgather(a.copy()) for a in arrays]
    sub.all_reduce(arrays, op="avg")
    for a, ins in zip(arrays, inputs):
        assert_equal(a, expected_reduce(ins, "avg", sub.size), "sub-communicator n=%d" % a.size)
    sub.close()
    group.Free()


def check_resnet50(comm, rng, shapes_path):
    shapes = json.loads(Path(shapes_path).read_text())["shapes"]
    # values k/8 with |k| <= 64: exact in float32 for any order of summation
    arrays = [(rng.integers(-64, 65, size=s) / 8).astype(np.float32) for s in shapes]
    flat = np.concatenate([a.ravel() for a in arrays])
    total = np.zeros_like(flat)
    for r in range(comm.size):
        buf = flat if r == comm.rank else np.empty_like(flat)
        WORLD.Bcast(buf, root=r)
        total += buf
    comm.all_reduce(arrays)
    got = np.concatenate([a.ravel() for a in arrays])
    assert np.array_equal(got, total), "resnet50 list differs at %s" % np.flatnonzero(got != total)[:5]


def check_broadcast_reduce(comm, rng):
    n = comm.size
    for root in range(n):
        arrays = [make(rng, dt, (m,)) for dt in ("float32", "int64", "uint8") for m in (0, 1, 17, 70001)]
        want = WORLD.bcast([a.copy() for a in arrays], root=root)
        assert comm.broadcast(arrays, root=root) is arrays
        for a, w in zip(arrays, want):
            assert_equal(a, w, "broadcast root=%d" % root)
        arrays = [make(rng, "float64", (m,)) for m in (1, 13, 30011)]
        before = [a.copy() for a in arrays]
        inputs = [gathered(a) for a in arrays]
        comm.reduce(arrays, root=root, op="max")
        for a, b, ins in zip(arrays, before, inputs):
            want = expected_reduce(ins, "max", n) if comm.rank == root else b
            assert_equal(a, want, "reduce root=%d" % root)


def check_all_gather_reduce_scatter(comm, rng):
    n = comm.size
    for dtype in DTYPES:
        for shape in [(0,), (1,), (3, 5), (13,)]:
            a = make(rng, dtype, shape)
            got = comm.all_gather(a)
            assert_equal(got, np.stack(gathered(a)), "all_gather %s %s" % (dtype, shape))
        for m in (0, 1, 7, 4099):
            a = make(rng, dtype, (n * m,))
            ins = gathered(a)
            got = comm.reduce_scatter(a)
            assert_equal(got, expected_reduce(ins, "sum", n)[comm.rank * m:(comm.rank + 1) * m],
                         "reduce_scatter %s m=%d" % (dtype, m))
    a = make(rng, "float32", (n * 6, 2))
    ins = gathered(a)
    got = comm.reduce_scatter(a, op="avg")
    want = expected_reduce(ins, "avg", n).reshape(-1)[comm.rank * 12:(comm.rank + 1) * 12]
    assert_equal(got, want, "reduce_scatter avg")
    # variable-length gather
    a = make(rng, "float32", (int(rng.integers(0, 50)) * (comm.rank != 1),))
    values, counts = comm.all_gatherv(a)
    ins = gathered(a)
    assert list(counts) == [x.size for x in ins]
    assert_equal(values, np.concatenate(ins), "all_gatherv")
    comm.barrier()
    comm.barrier(timeout=30)


def check_bfloat16(comm, rng):
    """bfloat16 (ml_dtypes) over MPI: user-defined reduction operators."""
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    for op in ("sum", "max", "min", "avg"):
        arrays = [make(rng, "float32", (n,)).astype(bf16) for n in (1, 7, 1000, 300001)]
        inputs = [gathered(a) for a in arrays]
        comm.all_reduce(arrays, op=op)
        for a, ins in zip(arrays, inputs):
            assert a.dtype == bf16
            want = expected_reduce([x.astype(np.float32) for x in ins], op, comm.size)
            got = a.astype(np.float32)
            if op == "avg":     # sum rounded to bfloat16, then scaled: 2 roundings
                ok = np.allclose(got, want, rtol=2 ** -7, atol=2 ** -9)
            else:               # sums of multiples of 1/4 below 64 are exact in bfloat16
                ok = np.array_equal(got, want)
            assert ok, "bfloat16 %s n=%d: %s vs %s" % (op, a.size, got[:4], want[:4])
    x = make(rng, "float32", (6,)).astype(bf16)
    assert_equal(comm.all_gather(x).astype(np.float32),
                 np.stack(gathered(x)).astype(np.float32), "bfloat16 all_gather")


def main(which, shapes_path=None):
    comm = commlib.Communicator.from_mpi()
    rng = np.random.default_rng(1234 + 7919 * comm.rank)
    checks = {
        "all_reduce": lambda: check_all_reduce_dtypes_lengths(comm, rng),
        "many": lambda: check_many_small_arrays(comm, rng),
        "buckets": lambda: check_larger_than_bucket(comm, rng),
        "flat_views": lambda: check_flat_views(comm, rng),
        "sub": lambda: check_sub_communicator(comm, rng),
        "resnet50": lambda: check_resnet50(comm, rng, shapes_path),
        "broadcast_reduce": lambda: check_broadcast_reduce(comm, rng),
        "gather_scatter": lambda: check_all_gather_reduce_scatter(comm, rng),
        "bfloat16": lambda: check_bfloat16(comm, rng),
    }
    for name in which.split(","):
        checks[name]()
    comm.close()
    print("rank %d ok" % comm.rank)
