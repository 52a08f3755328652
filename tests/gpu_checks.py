"""GPU checks run inside MPI jobs (imported by tests/test_gpu.py)."""
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
    # a repeated list (fusion cache) stays right
    dev = [cupy.full(100, comm.rank + 1.0, dtype=cupy.float32) for _ in range(50)]
    for step in range(3):
        for d in dev:
            d.fill(comm.rank + 1.0)
        comm.all_reduce(dev)
        assert all(float(d[0]) == n * (n + 1) / 2 for d in dev)
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
    collectives_on_cupy(comm, rng)
    device_errors(comm)
    comm.close()
    print("gpu %s rank %d ok" % (which, comm.rank))
