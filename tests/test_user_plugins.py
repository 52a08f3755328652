"""A user-written compression strategy (tests/user_compression.py) works
through commlib's documented interface without touching commlib's code: in
ranks of this process and in a real MPI job, against a reference computed
apart; its state dict is kept per bucket; its argument check runs before
any communication."""
import numpy as np
import pytest

import commlib
from inprocess import run_ranks
from mpirun import assert_each_rank, run_mpi
from user_compression import Int8, expected

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
from user_compression import Int8, expected
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
