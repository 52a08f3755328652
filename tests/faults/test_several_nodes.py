"""Ranks that share no memory (MPICH told every rank is on a node of its
own: ``MPIR_CVAR_NOLOCAL=1``): the consistency check is a fingerprint
exchange over MPI (:class:`commlib.faults.board_exchange.ExchangeBoard`), with the
check on and off, at 2-4 real ranks."""
import pytest

from mpirun import assert_each_rank, run_mpi

NOLOCAL = {"MPIR_CVAR_NOLOCAL": "1"}

CODE = r"""
import numpy as np
import commlib
from commlib.faults.board_exchange import ExchangeBoard
for check in (True, False):
    comm = commlib.Communicator.from_mpi(check=check)
    assert isinstance(comm._session.board, ExchangeBoard), type(comm._session.board)
    assert comm.backend == "mpi" and comm.local_size == 1
    rng = np.random.default_rng(0)
    inputs = [[rng.standard_normal(n).astype(np.float32) for n in (0, 1, 4097, 300001)]
              for _ in range(comm.size)]                 # every rank's arrays, known to all
    mine = [a.copy() for a in inputs[comm.rank]]
    comm.all_reduce(mine, op="avg")
    for i, a in enumerate(mine):
        expected = np.add.reduce(np.stack([inputs[r][i] for r in range(comm.size)]), axis=0)
        np.testing.assert_allclose(a, expected / comm.size, rtol=1e-6, atol=1e-6)
    w = comm.all_reduce(np.arange(7.0) * (comm.rank + 1), op="sum", async_op=True)
    assert np.array_equal(w.wait(), np.arange(7.0) * sum(range(1, comm.size + 1)))
    if check:
        try:
            comm.all_reduce(np.zeros(3 + comm.rank, np.float32))
        except commlib.ConsistencyError as exc:
            assert type(exc) is commlib.ConsistencyError and "disagree" in str(exc), exc
            assert exc.culprits == tuple(range(1, comm.size)), exc.culprits
            print("mismatch named by rank %d" % comm.rank, flush=True)
    rank = comm.rank
    comm.close()
    print("nodes ok check=%s rank %d" % (check, rank), flush=True)
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_reduce_across_nodes_with_the_check_on_and_off(n):
    proc = run_mpi(n, CODE, timeout=90, env=NOLOCAL)
    for check in ("True", "False"):
        assert_each_rank(proc.stdout, r"nodes ok check=%s rank (?P<rank>\d+)" % check, n)
    assert_each_rank(proc.stdout, r"mismatch named by rank (?P<rank>\d+)", n)


UNEVEN = r"""
import json, sys
import numpy as np
import commlib
from commlib.faults.board_exchange import ExchangeBoard
comm = commlib.init()
assert isinstance(comm._session.board, ExchangeBoard), type(comm._session.board)
steps = 3 if comm.rank == 1 else 2          # rank 1 takes one step more
try:
    for _ in range(steps):
        comm.all_reduce(np.ones(4))
    comm.close()
except commlib.PeerError as exc:
    print("BLAME " + json.dumps({"rank": comm.rank, "culprits": list(exc.culprits)}),
          flush=True)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_uneven_steps_across_nodes_blame_the_minority(n):
    """Across nodes, as on one: the rank whose number of collectives differs
    from the majority's is blamed on every rank; both ranks of two."""
    import json
    import re
    proc = run_mpi(n, UNEVEN, timeout=90, env=NOLOCAL)
    said = {r["rank"]: r["culprits"] for r in
            (json.loads(m) for m in re.findall(r"BLAME (\{[^}]*\})", proc.stdout))}
    assert sorted(said) == list(range(n)), proc.stdout
    assert all(c == ([1] if n > 2 else [0, 1]) for c in said.values()), said
