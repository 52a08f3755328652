"""The communicator's own logic (fusion, averaging, the consistency check,
compression bookkeeping, closing) with ranks as threads of this process
(tests/inprocess.py), against numpy computed independently from every
rank's inputs. The transports have their own multi-process tests."""
import numpy as np
import pytest

import commlib
from commlib.collective import bucketing
from commlib.compression import Threshold, TopK
from commlib.errors import ArrayTypeError, ConsistencyError, PeerError
from inprocess import run_ranks

SIZES = [1, 2, 3, 4]
REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def inputs(rank, dtype, lengths, op, seed):
    """Rank ``rank``'s arrays: small integers, so every reduction is exact."""
    rng = np.random.default_rng([seed, rank])
    low, high = (1, 3) if op == "prod" else ((0, 50) if dtype == "uint8" else (-20, 21))
    return [rng.integers(low, high, n).astype(dtype) for n in lengths]


def reference(everyone, op, size):
    """Rank-order numpy reduction of every rank's list; ``avg`` is the sum
    times ``1/size``, in the arrays' dtype (commlib's definition)."""
    out = []
    for k in range(len(everyone[0])):
        if op == "avg":
            total = sum(e[k].astype(np.float64) for e in everyone)    # exact: small integers
            dtype = everyone[0][k].dtype
            out.append(total.astype(dtype) * dtype.type(1.0 / size))
            continue
        acc = everyone[0][k].copy()
        for e in everyone[1:]:
            acc = REDUCE[op](acc, e[k]).astype(acc.dtype)
        out.append(acc)
    return out


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_every_dtype_op_and_length(n):
    lengths = [0, 1, 3, 7, 255, 1000, 70001]
    cases = [(d, op) for d in ("float32", "float64", "int32", "int64", "uint8", "float16")
             for op in REDUCE if not (d == "uint8" and op == "prod")]
    cases += [("float32", "avg"), ("float64", "avg")]

    def body(comm):
        got = []
        for seed, (dtype, op) in enumerate(cases):
            arrays = inputs(comm.rank, dtype, lengths, op, seed)
            assert comm.all_reduce(arrays, op=op) is arrays
            got.append(arrays)
        return got

    results = run_ranks(n, body, bucket_bytes=4096)      # many buckets and arrays in place
    for seed, (dtype, op) in enumerate(cases):
        want = reference([inputs(r, dtype, lengths, op, seed) for r in range(n)], op, n)
        for r in range(n):
            for g, w in zip(results[r][seed], want):
                assert g.dtype == w.dtype and np.array_equal(g, w), (n, dtype, op, r)


@pytest.mark.parametrize("n", [2, 3])
def test_zero_copy_views_and_repeated_lists(n):
    # at 8192 bytes a bucket: the first layout's bucket (0, 1, 2, 4) has an
    # array reduced in place among its arrays, so it is copied; the
    # second's (1, 2, 3, 4) lies back to back and is reduced where it lies
    layouts = [[(3, 5), (1000,), (7,), (64, 64), (1,)], [(64, 64), (3, 5), (1000,), (7,), (1,)]]
    for shapes, buckets, zero_copy in zip(layouts, [(0, 1, 2, 4), (1, 2, 3, 4)], [False, True]):
        views = commlib.flat_arrays(shapes, "float32")
        plan = bucketing.plan_for(views, 8192)
        assert [b.indices for b in plan.buckets] == [buckets]
        assert bucketing.PreparedList(views, plan, "numpy", True).zero_copy(0) is zero_copy

    def body(comm):
        out = []
        for shapes in layouts:
            views = commlib.flat_arrays(shapes, "float32")
            for step in range(3):                  # the same list: its plan is reused
                for k, v in enumerate(views):
                    v[...] = comm.rank + step + k
                comm.all_reduce(views, op="avg")
                out.append([v.copy() for v in views])
        return out

    for per_rank in run_ranks(n, body, bucket_bytes=8192):
        assert len(per_rank) == 3 * len(layouts)
        for i, arrays in enumerate(per_rank):
            step = i % 3
            for k, a in enumerate(arrays):
                assert np.all(a == np.float32((n - 1) / 2 + step + k)), (i, k)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_broadcast_reduce_gather_scatter(n):
    def body(comm):
        r = comm.rank
        b = [np.full(5, r, np.int64), np.arange(3.0) * r]
        comm.broadcast(b, root=n - 1)
        red = [np.full(4, r + 1, np.int32)]
        comm.reduce(red, root=0, op="max")
        gathered = comm.all_gather(np.full(2, r, np.int32))
        values, counts = comm.all_gatherv(np.arange(r + 1, dtype=np.float64))
        block = comm.reduce_scatter(np.arange(2 * n, dtype=np.float64) * (r + 1))
        comm.barrier()
        return b, red, gathered, values, counts, block

    total = n * (n + 1) / 2
    for r, (b, red, gathered, values, counts, block) in enumerate(run_ranks(n, body)):
        assert np.all(b[0] == n - 1) and np.array_equal(b[1], np.arange(3.0) * (n - 1))
        assert np.all(red[0] == (n if r == 0 else r + 1))      # others unchanged
        assert np.array_equal(gathered, np.repeat(np.arange(n), 2).reshape(n, 2))
        assert counts.tolist() == list(range(1, n + 1))
        assert np.array_equal(values, np.concatenate([np.arange(q + 1.0) for q in range(n)]))
        assert np.array_equal(block, np.arange(2 * r, 2 * r + 2) * total)


@pytest.mark.parametrize("n", [2, 3])
def test_a_mismatch_raises_on_every_rank_and_the_next_call_works(n):
    def body(comm):
        x = np.ones(6 if comm.rank == n - 1 else 5, np.float32)
        with pytest.raises(ConsistencyError, match="^rank %d: ranks disagree on all_reduce #1:"
                                                   % comm.rank) as info:
            comm.all_reduce(x)
        assert info.value.culprits == (n - 1,)      # the odd one out (of two: the second)
        text = str(info.value)
        x = np.full(4, comm.rank + 1.0)
        comm.all_reduce(x)
        return text, x

    for text, x in run_ranks(n, body):
        assert "float32(5,)" in text and "float32(6,)" in text and "[%d]" % (n - 1) in text
        assert np.all(x == n * (n + 1) / 2)


def test_rejected_arguments_reach_every_rank():
    def body(comm):
        x = np.ones(4, np.complex64 if comm.rank == 1 else np.float32)
        with pytest.raises((ArrayTypeError, ConsistencyError)) as info:
            comm.all_reduce(x)
        return type(info.value).__name__, str(info.value), info.value.culprits

    got = run_ranks(3, body)
    assert got[1][0] == "ArrayTypeError" and "complex64" in got[1][1] and got[1][2] == ()
    assert got[1][1].startswith("rank 1: "), got[1]
    for r in (0, 2):
        assert got[r][0] == "ConsistencyError" and got[r][2] == (1,)
        assert "rank 1 rejected its arguments" in got[r][1]


def top_k(acc, k):
    """The indices of the k largest |acc|, ties to the lowest index, ascending."""
    return np.sort(np.lexsort((np.arange(acc.size), -np.abs(acc)))[:k])


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("make, chosen", [
    (lambda: TopK(0.05), lambda acc: top_k(acc, 10)),
    (lambda: Threshold(1.5), lambda acc: np.nonzero(np.abs(acc) > np.float32(1.5))[0])],
    ids=["topk", "threshold"])
def test_topk_and_threshold_error_feedback_over_steps(n, make, chosen):
    """Residuals follow each rank's unsent values; a new strategy object per
    call with the same settings continues the same residuals."""
    size, steps = 200, 4

    def grads(rank, step):
        return np.random.default_rng([rank, step]).standard_normal(size).astype(np.float32)

    def body(comm):
        out = []
        for step in range(steps):
            g = [grads(comm.rank, step)]
            comm.all_reduce(g, op="avg", compression=make())     # a new object each time
            out.append(g[0])
        return out

    results = run_ranks(n, body)
    residual = [np.zeros(size, np.float32) for _ in range(n)]
    for step in range(steps):
        want = np.zeros(size, np.float32)
        for r in range(n):
            acc = residual[r] + grads(r, step)
            picked = chosen(acc)
            assert picked.size
            want[picked] += acc[picked]
            acc[picked] = 0
            residual[r] = acc
        want *= np.float32(1.0 / n)
        for r in range(n):
            assert np.array_equal(results[r][step], want), (step, r)


def test_uneven_steps_are_an_error_on_both_sides():
    def body(comm):
        comm.all_reduce(np.ones(3))
        with pytest.raises(PeerError) as info:
            if comm.rank == 1:
                comm.close()
            else:
                comm.all_reduce(np.ones(3))
        assert type(info.value) is PeerError
        return str(info.value), info.value.culprits

    (text0, blamed0), (text1, blamed1) = run_ranks(2, body)
    # two ranks: neither count is the majority's, so both are named
    assert "rank 1 closed the communicator after collective #1" in text0 and blamed0 == (0, 1)
    assert "this rank left after collective #1" in text1 and blamed1 == (0, 1)
    assert "blaming ranks 0, 1" in text0 and "blaming ranks 0, 1" in text1
