"""How a rank polls while it waits for its peers: back to back, or with
sleeps in between where the node's ranks outnumber its cores
(``COMMLIB_WAIT``, :func:`commlib.settings.waits_sleep`,
:func:`commlib.core.waiting.set_cores_shared`)."""
import os
import time

import pytest

from commlib import settings
from commlib.core import waiting
from commlib.errors import ArgumentError

from mpirun import assert_each_rank, run_mpi


@pytest.fixture
def cores(monkeypatch):
    """The waits' pacing as a fresh process has it, and the cores a rank
    may use set by the test."""
    monkeypatch.setattr(waiting, "_cores_shared", False)
    monkeypatch.delenv(settings.WAIT, raising=False)

    def set_cores(n):
        monkeypatch.setattr(settings, "usable_cores", lambda: n)
    return set_cores, monkeypatch


@pytest.mark.parametrize("policy,local_size,n_cores,sleeps", [
    (None, 3, 2, True), (None, 2, 2, False), (None, 1, 2, False), (None, 9, 8, True),
    ("auto", 8, 8, False), ("Auto", 3, 2, True),
    ("spin", 3, 2, False), ("SPIN", 64, 1, False),
    ("sleep", 1, 2, True), ("sleep", 2, 64, True),
])
def test_the_policy_and_the_node_choose(cores, policy, local_size, n_cores, sleeps):
    set_cores, monkeypatch = cores
    set_cores(n_cores)
    if policy is not None:
        monkeypatch.setenv(settings.WAIT, policy)
    assert settings.waits_sleep(local_size) is sleeps


def test_a_bad_policy_names_the_variable_and_the_choices(cores):
    _, monkeypatch = cores
    monkeypatch.setenv(settings.WAIT, "yield")
    with pytest.raises(ArgumentError, match=r"^COMMLIB_WAIT='yield': expected auto/spin/sleep$"):
        settings.waits_sleep(2)


def test_a_crowded_node_stays_crowded(cores):
    assert waiting.cores_shared() is False
    waiting.set_cores_shared(False)
    assert waiting.cores_shared() is False
    waiting.set_cores_shared(True)
    waiting.set_cores_shared(False)       # a later communicator of fewer ranks
    assert waiting.cores_shared() is True


def _wait_for(seconds, pace="auto"):
    """Run one wait whose step answers once ``seconds`` passed; returns
    the slices its steps were given."""
    slices, end = [], time.monotonic() + seconds

    def step(slice_s):
        slices.append(slice_s)
        return True if time.monotonic() >= end else None
    assert waiting.until(step, waiting.Wait(), pace=pace) is True
    return slices


def test_spinning_polls_back_to_back_with_slices(cores):
    slices = _wait_for(0.05)
    # the first look gets no slice, every later one the check's interval
    assert slices[0] == 0.0 and set(slices[1:]) == {waiting.CHECK_EVERY_S}


@pytest.mark.parametrize("how", ["shared", "sleep", "shared, relaxed"])
def test_shared_cores_sleep_between_polls(cores, how):
    # every poll after the first RELAXED_SPINS (and, on shared cores in a
    # thread the caller waits in, CROWDED_YIELDS polls that yield the core)
    # sleeps at least the shortest sleep, doubling up to the longest: a
    # bound on the number of polls that no spinning wait keeps (it polls
    # back to back)
    _, monkeypatch = cores
    yields = []
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))
    wall = 0.2
    if how.startswith("shared"):
        waiting.set_cores_shared(True)
        if how.endswith("relaxed"):      # a progress thread: it sleeps, never yields
            monkeypatch.setattr(waiting._thread, "relaxed", lambda: True, raising=False)
        slices = _wait_for(wall)
    else:
        slices = _wait_for(wall, pace="sleep")
    shortest, longest = waiting.RELAXED_SLEEP_S
    doublings = 0
    while shortest * 2 ** doublings < longest:
        doublings += 1
    want = waiting.CROWDED_YIELDS if how == "shared" else 0
    assert len(yields) == want, (len(yields), want)
    bound = 1 + waiting.RELAXED_SPINS + want + doublings + wall / longest + 1
    assert set(slices) == {0.0}
    assert len(slices) <= bound, (len(slices), bound)


@pytest.mark.parametrize("pace", ["spin", "auto"])
def test_spin_waits_sleep_too_on_shared_cores(cores, pace):
    # the shared-memory reducer's synchronisations (pace="spin") spin in C
    # for slices of CHECK_EVERY_S: on shared cores a slice spent while the
    # peer waits for the core cost each synchronisation up to that long
    # (4 ranks on 2 cores: 4 KiB all-reduces took 17-31 ms, now 1.8 ms)
    slices = _wait_for(0.05, pace=pace)
    assert set(slices[1:]) == {waiting.CHECK_EVERY_S}
    waiting.set_cores_shared(True)
    assert set(_wait_for(0.05, pace=pace)) == {0.0}


PROGRAM = r"""
import commlib
from commlib.core import waiting
comm = commlib.init()
print("rank %d of local size %d: shared %s;" % (comm.rank, comm.local_size, waiting.cores_shared()),
      flush=True)
comm.close()
"""


@pytest.mark.parametrize("n,policy", [(3, None), (2, None), (2, "sleep"), (4, "spin")])
def test_each_rank_of_a_job_paces_as_its_node_says(n, policy):
    env = {settings.WAIT: policy} if policy else {}
    out = run_mpi(n, PROGRAM, env=env, timeout=120).stdout
    want = n > len(os.sched_getaffinity(0)) if policy is None else policy == "sleep"
    assert_each_rank(out, r"rank (?P<rank>\d+) of local size %d: shared %s;" % (n, want), n)
