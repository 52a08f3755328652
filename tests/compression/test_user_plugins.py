"""A user-written compression strategy (tests/compression/user_compression.py) works
through commlib's documented interface without touching commlib's code: in
ranks of this process and in a real MPI job, against a reference computed
apart; its state dict is kept per bucket; its argument check runs before
any communication."""
import numpy as np
import pytest

import commlib
from inprocess import run_ranks
from mpirun import assert_each_rank, run_mpi
from user_compression import Int8, Int8Deferred, expected

SHAPES = [(5,), (3, 7), (1,), (0,), (129,)]


def inputs(rank, step):
    rng = np.random.default_rng(100 * step + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_user_strategy_in_ranks_of_this_process(n, op):
    def body(comm):
        got = []
        for step in range(2):
            arrays = inputs(comm.rank, step)
            if step == 0:
                comm.all_reduce(arrays, op=op, compression=Int8())
            else:                    # asynchronously too
                comm.all_reduce(arrays, op=op, compression=Int8(), async_op=True).wait()
            got.append(np.concatenate([a.reshape(-1) for a in arrays]))
        return got
    results = run_ranks(n, body)
    for step in range(2):
        flats = [np.concatenate([a.reshape(-1) for a in inputs(r, step)]) for r in range(n)]
        want = expected(flats, 1.0 / n if op == "avg" else None)
        for rank in range(n):
            assert np.array_equal(results[rank][step], want), (n, op, step, rank)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_user_strategy_returning_completions(n):
    # a strategy that returns each bucket's completion (DDP's future): every
    # bucket of the call is issued before the first completes, completions
    # run in bucket order, and the result is the strategy's
    def body(comm):
        log = []
        arrays, direct = inputs(comm.rank, 3), inputs(comm.rank, 3)
        comm.all_reduce(arrays, op="avg", compression=Int8Deferred(log))
        comm.all_reduce(direct, op="avg", compression=Int8())
        return [np.concatenate([a.reshape(-1) for a in x]) for x in (arrays, direct)], log
    # 64-byte buckets: the list's 151 floats make several, each with a scale
    # of its own (so the reference is Int8 on the same buckets, which the
    # tests above check against numpy)
    results = run_ranks(n, body, bucket_bytes=64)
    flats = [np.concatenate([a.reshape(-1) for a in inputs(r, 3)]) for r in range(n)]
    peak = max(float(np.abs(f).max()) for f in flats)
    for rank, ((got, want), log) in enumerate(results):
        assert np.array_equal(got, want), (n, rank)
        # and it is the average, within the 8-bit codes' rounding (half a
        # step of at most peak / 127 per rank)
        assert np.allclose(got, np.mean(flats, axis=0), rtol=0, atol=peak / 127), (n, rank)
        buckets = len(log) // 2
        assert buckets >= 3, log
        assert log == ([("issue", i) for i in range(buckets)]
                       + [("complete", i) for i in range(buckets)]), (rank, log)


def test_user_strategy_argument_check_runs_before_communication():
    def body(comm):
        arrays = inputs(comm.rank, 0)
        before = [a.copy() for a in arrays]
        with pytest.raises(commlib.ArgumentError, match="Int8 serves sum and avg only"):
            comm.all_reduce(arrays, op="max", compression=Int8())
        return all(np.array_equal(a, b) for a, b in zip(arrays, before))
    assert run_ranks(2, body) == [True, True]


CODE = """
import sys
import numpy as np
import commlib
from user_compression import Int8, Int8Deferred, expected
from test_user_plugins import inputs
comm = commlib.init()
arrays = inputs(comm.rank, 5)
comm.all_reduce(arrays, op="avg", compression=Int8())
flats = [np.concatenate([a.reshape(-1) for a in inputs(r, 5)]) for r in range(comm.size)]
want = expected(flats, 1.0 / comm.size)
assert np.array_equal(np.concatenate([a.reshape(-1) for a in arrays]), want)
print("user strategy rank %d ok" % comm.rank, flush=True)
comm.close()
"""


@pytest.mark.parametrize("n", [2, 3])
def test_user_strategy_in_a_real_mpi_job(n):
    proc = run_mpi(n, CODE, timeout=90)
    assert_each_rank(proc.stdout, r"user strategy rank (?P<rank>\d+) ok", n)


TRANSPORT_CODE = """
import numpy as np
from mpi4py import MPI
import commlib
from user_transport import BlockingMpi
world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
transport = BlockingMpi(world.Dup())
comm = commlib.Communicator.from_transport(transport)
assert (comm.rank, comm.size, comm.backend) == (rank, n, "user-mpi"), comm
rng = np.random.default_rng(rank)
mine = [rng.standard_normal(s).astype(np.float32) for s in [(3,), (4, 5), (0,), (1001,)]]
every = world.allgather(mine)
got = [a.copy() for a in mine]
comm.all_reduce(got, op="avg")
for k, a in enumerate(got):
    want = np.zeros_like(a)
    for r in range(n):
        want += every[r][k]
    want *= np.float32(1.0 / n)
    assert np.array_equal(a, want), k
x = np.arange(6, dtype=np.float64) + rank
comm.broadcast(x, root=n - 1)
assert np.array_equal(x, np.arange(6, dtype=np.float64) + n - 1)
g = comm.all_gather(np.full(2, rank, np.int32))
assert np.array_equal(g, np.repeat(np.arange(n, dtype=np.int32)[:, None], 2, axis=1))
s = comm.reduce_scatter(np.ones(2 * n, np.float32))
assert np.array_equal(s, np.full(2, n, np.float32))
try:                                  # the consistency check runs over the transport too
    comm.all_reduce(np.ones(3 + rank, np.float32))
except commlib.ConsistencyError as exc:
    assert "disagree" in str(exc), exc
else:
    assert n == 1
comm.barrier()
assert transport.calls > 0
comm.close()
print("user transport rank %d ok" % rank, flush=True)
"""


@pytest.mark.parametrize("n", [1, 2, 3])
def test_user_transport_in_a_real_mpi_job(n):
    proc = run_mpi(n, TRANSPORT_CODE, timeout=90)
    assert_each_rank(proc.stdout, r"user transport rank (?P<rank>\d+) ok", n)


def test_both_boards_take_the_same_leave_arguments():
    """The communicator tells either board that it gave up, naming whom it
    blames; the fingerprint exchange (ranks sharing no memory, or a
    transport of one's own) once lacked ``blame`` and turned every failed
    collective into a TypeError."""
    import inspect
    from commlib.faults.board import StatusBoard
    from commlib.faults.board_exchange import ExchangeBoard
    assert list(inspect.signature(ExchangeBoard.leave).parameters) == \
        list(inspect.signature(StatusBoard.leave).parameters)


class FirstK(commlib.compression.TopK):
    """Top-K's count, but the first k entries instead of the largest."""

    def select(self, acc):
        indices, _ = super().select(acc)          # the built-in selection still works
        k = indices.size
        return np.arange(k, dtype=np.int32), acc[:k].copy()


class PositiveOnly(commlib.compression.Threshold):
    """Threshold's entries above it, but only the positive ones."""

    def select(self, acc):
        indices, values = super().select(acc)
        keep = values > 0
        return indices[keep], values[keep]


def test_topk_and_threshold_select_as_documented():
    x = np.array([0.5, -3, 3, 0, -7, 1, 7, 2], np.float32)      # ties: |3| twice, |7| twice
    indices, values = commlib.compression.TopK(0.5).select(x)   # k = 4: 7 and -7, then 3, -3
    assert indices.tolist() == [1, 2, 4, 6] and values.tolist() == [-3, 3, -7, 7]
    indices, values = commlib.compression.TopK(0.375).select(x)  # k = 3: the lower 3 index wins
    assert indices.tolist() == [1, 4, 6] and values.tolist() == [-3, -7, 7]
    indices, values = commlib.compression.Threshold(2).select(x)
    assert indices.tolist() == [1, 2, 4, 6] and values.tolist() == [-3, 3, -7, 7]


@pytest.mark.parametrize("make, picks", [
    (lambda: FirstK(0.25, error_feedback=False), lambda x: np.arange(x.size) < 16),
    (lambda: PositiveOnly(20.0, error_feedback=False), lambda x: x > 20)])
def test_a_subclass_that_selects_its_own_way_is_used(make, picks):
    """A subclass of TopK or Threshold that overrides select() is reduced
    with its selection, not the built-in fused pass: each rank's picked
    entries summed, the others zero."""
    n = 3

    def data(rank):
        return np.random.default_rng(rank).integers(-50, 50, 64).astype(np.float32)

    def body(comm):
        x = data(comm.rank)
        comm.all_reduce(x, op="sum", compression=make())
        return x

    results = run_ranks(n, body)
    want = np.zeros(64, np.float32)
    for r in range(n):
        x = data(r)
        want += np.where(picks(x), x, np.float32(0))
    for r in range(n):
        assert np.array_equal(results[r], want), (r, results[r], want)


def test_topk_select_into_writes_its_selection_or_declines():
    """select_into (what the GPU path calls to write a record in place):
    TopK's own selection into arrays of k elements; False, nothing
    written, for arrays of another size or a subclass with its own select."""
    x = np.array([0.5, -3, 3, 0, -7, 1, 7, 2], np.float32)
    indices, values = np.full(4, -9, np.int32), np.full(4, -9, np.float32)
    assert commlib.compression.TopK(0.5).select_into(x, indices, values) is True
    assert indices.tolist() == [1, 2, 4, 6] and values.tolist() == [-3, 3, -7, 7]
    for strategy, k in ((commlib.compression.TopK(0.25), 4), (FirstK(0.5), 4)):
        indices, values = np.full(k, -9, np.int32), np.full(k, -9, np.float32)
        assert strategy.select_into(x, indices, values) is False
        assert (indices == -9).all() and (values == -9).all()


class FP16BucketByBucket(commlib.compression.FP16):
    """FP16 through the base class's reduce_all: its reduce(), one bucket
    at a time, instead of its own reduce_all (every bucket in one wire)."""

    reduce_all = commlib.compression.Compression.reduce_all


@pytest.mark.parametrize("op", ["avg", "sum"])
def test_half_precision_bucket_by_bucket_equals_all_buckets_at_once(op):
    """Thread ranks, three buckets and an array reduced in place: FP16's
    reduce() bucket by bucket gives, bit for bit, what its reduce_all gives,
    and both the float16 reference (each rank's values, times 1/n when
    averaging, rounded to float16, summed in rank order in float32 and
    rounded back at each step)."""
    n, shapes = 3, [(5,), (3, 7), (40,), (2,), (300,)]

    def inputs(rank):
        rng = np.random.default_rng(rank)
        return [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def body(comm):
        out = []
        for strategy in (commlib.compression.FP16(), FP16BucketByBucket()):
            arrays = inputs(comm.rank)
            comm.all_reduce(arrays, op=op, compression=strategy)
            out.append(arrays)
        return out

    results = run_ranks(n, body, bucket_bytes=256)
    for i in range(len(shapes)):
        terms = [(x[i] * np.float32(1.0 / n) if op == "avg" else x[i]).astype(np.float16)
                 for x in map(inputs, range(n))]
        want = terms[0]
        for t in terms[1:]:
            want = (want.astype(np.float32) + t.astype(np.float32)).astype(np.float16)
        want = want.astype(np.float32)
        for r in range(n):
            for got in results[r]:
                assert got[i].tobytes() == want.tobytes(), (op, i, r)
