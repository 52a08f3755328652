"""A rank that stalls, tried as each of ranks 0, 1 and 2 of three, on every
path the data takes: MPI's own (small arrays), shared memory (arrays of at
least commlib.transport.shm.MIN_BYTES) and the thread transport of
tests/inprocess.py; with the consistency check on (the peers wait in it, or
the late rank stalls inside the data phase) and off (the peers wait inside
the transport).

For each: the peers raise at the deadline naming the late rank where the
library can know it; the late rank, once they gave up (it waits for their
notice, not for a guessed time), raises PeerError passing their blame on;
no array is written after an error, not even once MPI completes what was
abandoned. Rank programs: tests/faults/fault_programs.py (``stalls``).

A rank stalled inside the data phase with the check on had entered the
collective like everyone else: on shared memory its missing flag names it,
on MPI's path and the thread transport its silence on the status board
(waiting ranks look at it every few milliseconds, a stalled one does not).
A rank that gave up is never blamed for it.
"""
import re
import threading
import time

import numpy as np
import pytest

from commlib.errors import CommlibError
from commlib.transport.shm import MIN_BYTES
from fault_jobs import assert_raised, find, others, run
from fault_programs import LARGE, SMALL, STALL_DEADLINE, Hold
from inprocess import run_ranks

N = 3
TIMED_OUT = "CollectiveTimeoutError"


def test_the_sizes_take_the_paths_they_are_named_for():
    assert SMALL * 4 < MIN_BYTES <= LARGE * 4


DEADLINE_PASSED = "all_reduce #1 did not complete before its deadline"


def not_arrived(late):
    return DEADLINE_PASSED + ": waiting for rank %d (has not entered any collective)" % late


def entered(late):
    return DEADLINE_PASSED + ": waiting for rank %d (last entered all_reduce #1" % late


def assert_peers_gave_up(records, late, size, text, culprits):
    """The peers of ``late``: each raised CollectiveTimeoutError at the
    deadline with ``text`` naming ``culprits``, or, having seen a peer that
    timed out give up first, PeerError saying so and naming whom that peer
    blamed (``culprits``: never the peer for giving up); at least one timed
    out. Their arrays are untouched and stay so; their communicator
    is unusable."""
    where = dict(late=late, size=size)
    timed_out = []
    for r in others(N, late):
        got = find(records, r, "stall", **where)
        if got["error"] == TIMED_OUT:
            # its own deadline; a rank told by a peer that gave up may have
            # entered later than that peer (a busy machine), so sooner
            assert got["seconds"] >= STALL_DEADLINE - 0.05, got
            assert_raised(got, TIMED_OUT, culprits, STALL_DEADLINE + 5,
                          ["rank %d: %s" % (r, text)])
            timed_out.append(r)
        assert not find(records, r, "after", **where)["written_after"]
        assert find(records, r, "next", **where)["error"] == "ClosedError"
    assert timed_out, records
    for r in others(N, late):
        got = find(records, r, "stall", **where)
        if got["error"] != TIMED_OUT:
            (first,) = [q for q in timed_out if q != r]
            assert_raised(got, "PeerError", culprits, STALL_DEADLINE + 5,
                          ["rank %d: rank %d gave up in collective #1" % (r, first), text])


def assert_late_learns(records, late, size, culprits, untouched=True):
    """The late rank's call raised PeerError naming ``culprits``, saying its
    lowest peer gave up; or (MPI's path: a collective its peers abandoned
    inside MPI may still complete) it completed and its next call raised
    that PeerError. Every element holds its input or the sum."""
    where = dict(late=late, size=size)
    got = find(records, late, "stall", **where)
    said = "rank %d: rank %d gave up in collective #1" % (late, min(others(N, late)))
    following = find(records, late, "next", **where)
    if got["error"] is None and size == SMALL:
        assert_raised(following, "PeerError", culprits, 3, [said], untouched=None)
    else:
        assert_raised(got, "PeerError", culprits, 3, [said], untouched=untouched)
        assert following["error"] == "ClosedError", following
    assert find(records, late, "input_or_sum", **where)["ok"]
    assert not find(records, late, "after", **where)["written_after"]


def test_late_arrival_with_the_check_on_each_rank_in_turn():
    """The peers wait in the consistency check: a deadline naming the rank
    that has not entered, a warning before it; the late rank, when it
    comes, learns that they gave up waiting for it (blame passed on, rank
    0 included)."""
    records, proc = run(N, "stalls_board", env={"COMMLIB_STALL_WARNING": "0.3"})
    for late in range(N):
        size = LARGE if late == 1 else SMALL
        assert_peers_gave_up(records, late, size, not_arrived(late), [late])
        assert_late_learns(records, late, size, [late])
        for r in others(N, late):
            said = re.findall(r"commlib: rank %d has waited \d+ s in all_reduce #1; rank %d has "
                              r"not entered any collective" % (r, late), proc.stderr)
            assert len(said) == 1, proc.stderr


def test_late_arrival_with_the_check_off_each_rank_in_turn():
    """The peers wait inside the transport (MPI's requests, the shared-memory
    flags): they still give up at the deadline naming the late rank."""
    records, _ = run(N, "stalls_off")
    for late in range(N):
        for size in (SMALL, LARGE):
            assert_peers_gave_up(records, late, size, not_arrived(late), [late])
            # shared memory: the late rank passed the first synchronisation
            # and wrote its own share's sum before it learnt
            assert_late_learns(records, late, size, [late],
                               untouched=None if size == LARGE else True)


def test_stall_inside_the_data_phase_each_rank_in_turn():
    """The check on, the late rank stalls after it: on shared memory the
    peers name it by its missing flag, on MPI's path by its silence on the
    status board (every rank had entered)."""
    records, _ = run(N, "stalls_inside")
    for late in range(N):
        assert_peers_gave_up(records, late, LARGE, entered(late), [late])
        assert_late_learns(records, late, LARGE, [late], untouched=None)
        assert_peers_gave_up(records, late, SMALL, entered(late), [late])
        assert_late_learns(records, late, SMALL, [late])


# -- the thread transport (ranks as threads of this process) ----------------------------------

THREAD_DEADLINE = 0.5


def thread_episode(monkeypatch, late, check, inside):
    """Rank ``late`` of three thread ranks comes (``inside``: stalls in the
    data phase) once the others gave up; returns per rank (error class,
    culprits, text, seconds, arrays untouched)."""
    monkeypatch.setenv("COMMLIB_WATCHDOG_TIMEOUT", str(THREAD_DEADLINE))
    gave_up = [threading.Event() for _ in range(N)]

    def hold():
        for r in others(N, late):
            assert gave_up[r].wait(30), "rank %d never gave up" % r

    def body(comm):
        x = np.full(SMALL, comm.rank + 1.0, np.float32)
        if comm.rank == late and not inside:
            hold()
        start = time.monotonic()
        try:
            comm.all_reduce([x], compression=Hold(late, hold) if inside else None)
            error = None
        except CommlibError as exc:
            error = exc
        seconds = time.monotonic() - start
        gave_up[comm.rank].set()
        return (type(error).__name__ if error else None, list(getattr(error, "culprits", ())),
                str(error), seconds, bool((x == comm.rank + 1.0).all()))

    return run_ranks(N, body, check=check)


@pytest.mark.parametrize("late", range(N))
@pytest.mark.parametrize("check, inside", [(False, False), (True, True), (True, False)],
                         ids=["check off", "inside", "check on"])
def test_thread_transport_peers_give_up_on_a_late_rank(monkeypatch, late, check, inside):
    """The peers raise CollectiveTimeoutError at the deadline naming the
    late rank (inside the data phase: by its silence on the status board),
    or PeerError passing on the blame of a peer that gave up first."""
    got = thread_episode(monkeypatch, late, check, inside)
    timed_out = [r for r in others(N, late) if got[r][0] == TIMED_OUT]
    assert timed_out, got
    for r in others(N, late):
        error, culprits, text, seconds, untouched = got[r]
        assert untouched and culprits == [late], got[r]
        # only a rank that timed out itself is held to the deadline from
        # below: one told by a peer that gave up may have entered after it
        assert seconds <= THREAD_DEADLINE + 5, got[r]
        if error == TIMED_OUT:
            assert THREAD_DEADLINE - 0.05 <= seconds, got[r]
            want = entered(late) if inside else not_arrived(late)
            assert "rank %d: %s" % (r, want) in text, got[r]
        else:
            assert error == "PeerError" and "gave up in collective #1" in text, got[r]


@pytest.mark.parametrize("check", [False, True], ids=["check off", "check on"])
def test_thread_transport_late_rank_learns_its_peers_gave_up(monkeypatch, check):
    late = 0
    error, culprits, text, seconds, _ = thread_episode(monkeypatch, late, check, False)[late]
    assert error == "PeerError" and culprits == [late], (error, culprits, text)
    assert "rank %d: rank 1 gave up in collective #1" % late in text and seconds < 0.25, text
