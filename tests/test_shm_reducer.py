"""commlib.transport.shm.SharedMemoryReducer on 1-4 real MPI ranks: every
dtype and op, odd and zero lengths, repeated calls of changing size, against
a numpy reduction in rank order of every rank's input, bit for bit on every
rank."""
import pytest

from mpirun import run_mpi

REDUCE_CODE = """
import sys
import numpy as np
from mpi4py import MPI
from commlib.transport.shm import SharedMemoryReducer

comm = MPI.COMM_WORLD
rank, n = comm.Get_rank(), comm.Get_size()
sync = sys.argv[1]
DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]
try:
    import ml_dtypes
    DTYPES.append(ml_dtypes.bfloat16)
except ImportError:
    pass
UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
CAPACITY = 8192
red = SharedMemoryReducer(comm, capacity_bytes=CAPACITY, sync=sync)
assert red.usable and red.capacity_bytes == CAPACITY

def make(dtype, length, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return (rng.standard_normal(length) * 4).astype(dtype)
    return rng.integers(0, 200, length).astype(dtype)

def check(dtype, length, op, seed):
    x = make(dtype, length, seed * 10 + rank)
    everyone = comm.allgather(x)
    with np.errstate(all="ignore"):
        ref = everyone[0].copy()
        for other in everyone[1:]:
            ref = UFUNCS[op](ref, other).astype(ref.dtype)
        assert red.all_reduce(x, op) is True
    mine = x.view(np.uint8).tobytes()
    assert mine == ref.view(np.uint8).tobytes(), (np.dtype(dtype).name, length, op, x, ref)
    assert all(b == mine for b in comm.allgather(mine)), "ranks differ"

seed = 0
for dtype in DTYPES:
    itemsize = np.dtype(dtype).itemsize
    for length in (0, 1, 2, 3, 5, 7, 64, 1001, CAPACITY // itemsize):
        for op in UFUNCS:
            seed += 1
            check(dtype, length, op, seed)

# repeated calls of changing sizes and dtypes, no synchronisation in between
rng = np.random.default_rng(1234)       # same sequence on every rank
plan = [(DTYPES[rng.integers(len(DTYPES))], int(rng.integers(0, 600)),
         list(UFUNCS)[rng.integers(4)]) for _ in range(60)]
inputs = [make(d, length, 7919 * i + rank) for i, (d, length, _) in enumerate(plan)]
outputs = [x.copy() for x in inputs]
with np.errstate(all="ignore"):
    for (_, _, op), x in zip(plan, outputs):
        assert red.all_reduce(x, op)
    everyone = comm.allgather(inputs)
    for i, (_, _, op) in enumerate(plan):
        ref = everyone[0][i].copy()
        for r in range(1, n):
            ref = UFUNCS[op](ref, everyone[r][i]).astype(ref.dtype)
        assert outputs[i].tobytes() == ref.tobytes(), (i, plan[i])

# too big, not numpy, unsupported dtype: declined, buffer untouched
big = np.ones(CAPACITY // 4 + 1, np.float32)
assert red.all_reduce(big, "sum") is False and (big == 1).all()
assert red.all_reduce([1.0, 2.0], "sum") is False
assert red.all_reduce(np.ones(4, np.complex64), "sum") is False
assert red.all_reduce(np.ones(4, np.int16), "sum") is False
red.close()
red.close()
print("rank %d ok" % rank)
"""

ERROR_CODE = """
import numpy as np
from mpi4py import MPI
from commlib.errors import ArgumentError, ArrayTypeError
from commlib.transport.shm import SharedMemoryReducer

comm = MPI.COMM_WORLD
for bad in (dict(capacity_bytes=0), dict(sync="spin")):
    try:
        SharedMemoryReducer(comm, **bad)
    except ArgumentError:
        pass
    else:
        raise AssertionError(bad)
red = SharedMemoryReducer(comm)
try:
    red.all_reduce(np.ones(4, np.float32), "avg")
except ArgumentError:
    pass
else:
    raise AssertionError("bad op accepted")
for bad in (np.ones((2, 2), np.float32), np.ones(8, np.float32)[::2]):
    try:
        red.all_reduce(bad, "sum")
    except ArrayTypeError:
        pass
    else:
        raise AssertionError("bad layout accepted")
x = np.full(3, comm.Get_rank() + 1.0)
assert red.all_reduce(x, "sum") and (x == comm.Get_size() * (comm.Get_size() + 1) / 2).all()
red.close()
print("ok")
"""


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reducer_matches_rank_order_numpy_reduction(n):
    run_mpi(n, REDUCE_CODE, timeout=60, args=("auto",))


def test_reducer_with_mpi_barrier_sync():
    run_mpi(3, REDUCE_CODE, timeout=60, args=("barrier",))


def test_reducer_argument_errors():
    run_mpi(2, ERROR_CODE, timeout=60)
