"""overlap="auto": buckets start early unless the reduction is CPU work on
cores the ranks already fill; True and False force the choice; the results
are the same bits whichever starts them."""
import numpy as np
import pytest

import commlib
from commlib import overlap
from commlib.errors import ArgumentError
from inprocess import run_ranks


class _Comm:
    """What early_start_pays reads of a communicator."""

    def __init__(self, transport, local_size):
        self._name, self.local_size = transport, local_size

    def transport_for(self, kind):
        return self._name


GRADS = [np.zeros(3, np.float32)]


@pytest.mark.parametrize("cores,local_size,transport,pays", [
    (2, 2, "shm", False),        # every core runs a rank: the reduction competes
    (2, 3, "shm", False),
    (8, 2, "shm", True),         # spare cores do the reduction
    (2, 2, "mpi", True),         # across nodes: the wire, not the cores, is the cost
    (2, 2, "threads", True),
])
def test_auto_choice(monkeypatch, cores, local_size, transport, pays):
    monkeypatch.setattr(overlap.settings, "usable_cores", lambda: cores)
    assert overlap.early_start_pays(_Comm(transport, local_size), GRADS) is pays


def test_no_arrays_always_may_start():
    assert overlap.early_start_pays(_Comm("shm", 64), []) is True


@pytest.mark.parametrize("choice", [True, False, "auto"])
def test_forced_and_auto_give_the_same_bits(choice):
    def body(comm):
        rng = np.random.default_rng(comm.rank)
        grads = commlib.flat_arrays([(37,), (5, 3), (101,), (1,)], "float32")
        red = commlib.BackwardReducer(comm, grads, bucket_bytes=200, overlap=choice)
        results = []
        for _ in range(3):
            for g in grads:
                g[...] = rng.standard_normal(g.shape).astype(np.float32)
            sent = [g.copy() for g in grads]
            started = []
            for j in reversed(range(len(grads))):
                red.ready(j)
                started.append(len(red._works))
            red.wait()
            results.append(([g.copy() for g in grads], sent, started))
        return red.overlap, results

    out = run_ranks(3, body)
    for rank in range(3):
        forced, steps = out[rank]
        assert forced is (choice is not False)     # threads transport: auto starts early
        for step, (got, _, started) in enumerate(steps):
            want = [np.mean([out[r][1][step][1][i] for r in range(3)], axis=0,
                            dtype=np.float32) for i in range(len(got))]
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
            assert (max(started) > 0) is (choice is not False), started


def test_bad_overlap_is_named():
    def body(comm):
        with pytest.raises(ArgumentError, match=r"rank 0.*overlap must be True, False or 'auto'"):
            commlib.BackwardReducer(comm, GRADS, overlap="yes")
        with pytest.raises(ArgumentError, match=r"rank 0.*overlap must be True, False or 'auto'"):
            commlib.DistributedOptimizer(comm, [np.zeros(3, np.float32)],
                                         commlib.optim.SGD(0.1), overlap="sometimes")
    run_ranks(1, body)
