"""Collectives in flight (commlib/progress/inflight.py and the pipelined Progress of
commlib/progress/work.py), without MPI: parts whose completion the test controls,
so order, publication, failure and interruption are deterministic. The
same machinery over real MPI ranks is tested in tests/progress/test_async.py."""
import threading
import time

import numpy as np
import pytest

from commlib.core import waiting
from commlib.errors import ClosedError, CollectiveTimeoutError, PeerError
from commlib.progress.inflight import (MAX_SLEEP_S, MIN_SLEEP_S, SLEEP_SHARE, InFlight, Pacer,
                                       overlap, spans)
from commlib.collective.stats import CommStats
from commlib.progress.work import Progress


class Part:
    """An InFlight part that completes when the test says so (or fails)."""

    def __init__(self):
        self.done = threading.Event()
        self.error = None
        self.abandoned = False

    def test(self):
        if self.error is not None:
            raise self.error
        return self.done.is_set()

    def abandon(self):
        self.abandoned = True


def until(condition, seconds=5.0):
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


class Harness:
    """A threaded Progress of ``depth`` whose collectives each start one
    controllable Part (or run whole), logging what runs when."""

    def __init__(self, depth, deadline=None):
        self.errors = []
        self.failed = None
        self.progress = Progress(CommStats(), True, lambda exc: None, depth=depth,
                                 on_error=self._on_error, failed=lambda: self.failed)
        self.log = []
        self.deadline = deadline

    def _on_error(self, exc):
        self.errors.append(exc)
        self.failed = self.failed or exc

    def deferred(self, name, out):
        """A collective that leaves a Part in flight and writes ``out`` once done."""
        part = Part()

        def run():
            self.log.append(("start", name))
            assert self.progress.may_defer()
            flight = InFlight(waiting.Wait(self.deadline, rank=0), holds=[out])
            flight.add(part)
            flight.nbytes = out.nbytes
            flight.then(lambda: (out.fill(1), self.log.append(("finish", name))))
            self.progress.defer(flight)
            return name

        return self.progress.submit(run, [out]), part

    def several(self, k, length=5):
        """``k`` deferred collectives, once the last has started: (outs, [(work, part)])."""
        outs = [np.zeros(length) for _ in range(k)]
        started = [self.deferred(j, outs[j]) for j in range(k)]
        until(lambda: ("start", k - 1) in self.log)
        return outs, started

    def whole(self, name):
        def run():
            self.log.append(("whole", name, len(self.progress.in_flight())))
            return name
        return self.progress.submit(run, None)


def test_spans_and_overlap():
    buf = np.zeros(100, np.float32)
    assert spans([buf[5:5]]).shape == (0, 2)
    assert spans([buf[:10]]).tolist() == [[buf.ctypes.data, buf.ctypes.data + 40]]
    assert not overlap(spans([buf[:10]]), spans([buf[10:20]]))        # adjacent
    assert overlap(spans([buf[:11]]), spans([buf[10:20]]))
    assert overlap(spans([buf[30:40], buf[:5]]), spans([buf[10:20], buf[38:50]]))
    assert not overlap(spans([buf[30:40], buf[:5]]), spans([buf[10:20], buf[40:50]]))
    assert overlap(spans([buf[12:13]]), spans([buf[60:70], buf[:50]]))   # inside a long one
    assert not overlap(spans([buf[3:3]]), spans([buf]))                  # empty
    assert not overlap(spans([]), spans([buf]))
    other = np.zeros(10, np.float32)
    assert not overlap(spans([other]), spans([buf]))


def test_pacer_sleeps_a_share_of_the_remaining_time_within_bounds():
    pacer = Pacer()
    assert MIN_SLEEP_S <= pacer.longest_sleep(1 << 20) <= MAX_SLEEP_S     # nothing measured
    started = time.perf_counter() - 0.02          # 1 MiB served in 20 ms
    pacer.completed(started, 1 << 20)
    served = time.perf_counter() - started        # at least the time the pacer measured
    assert pacer.longest_sleep(1 << 20) == MAX_SLEEP_S     # an eighth of 20 ms or more
    assert pacer.longest_sleep(0) == MIN_SLEEP_S
    # an eighth of the time 100,000 bytes need at that rate: 0.24 ms at 20 ms a MiB
    low, high = (SLEEP_SHARE * 100_000 * t / (1 << 20) for t in (0.02, served))
    assert MIN_SLEEP_S < low < MAX_SLEEP_S
    assert low <= pacer.longest_sleep(100_000) <= min(high, MAX_SLEEP_S)


def test_collectives_in_flight_start_in_order_and_complete_in_order():
    h = Harness(depth=3)
    outs = [np.zeros(4) for _ in range(4)]
    (w0, p0), (w1, p1), (w2, p2), (w3, p3) = [h.deferred(k, outs[k]) for k in range(4)]
    until(lambda: ("start", 2) in h.log)
    time.sleep(0.05)
    assert ("start", 3) not in h.log              # depth 3: the fourth waits
    p1.done.set()                                 # a later one completes first
    time.sleep(0.05)
    assert not w1.done() and not w0.done() and outs[1][0] == 0   # not before the oldest
    p0.done.set()
    assert w1.wait() == 1 and w0.wait() == 0
    assert outs[0][0] == outs[1][0] == 1
    until(lambda: ("start", 3) in h.log)
    p2.done.set()
    p3.done.set()
    assert w3.wait() == 3 and w2.done()
    assert [e for e in h.log if e[0] == "finish"] == [("finish", k) for k in range(4)]
    assert h.progress.idle() and not h.errors
    h.progress.stop()


def test_a_whole_collective_waits_for_nothing_but_is_published_after_the_ones_before():
    h = Harness(depth=4)
    out = np.zeros(3)
    work, part = h.deferred("a", out)
    whole = h.whole("b")
    until(lambda: any(e[0] == "whole" for e in h.log))
    time.sleep(0.05)
    assert not whole.done()                       # ran, but "a" is still in flight
    part.done.set()
    assert whole.wait() == "b" and work.done() and out[0] == 1
    h.progress.stop()


def test_depth_one_starts_nothing_beside_a_collective_in_flight():
    h = Harness(depth=1)
    assert not h.progress.may_defer()             # not on its thread either
    work = h.whole("x")
    assert work.wait() == "x"
    h.progress.stop()


def test_a_failure_in_flight_fails_every_started_collective_and_writes_nothing():
    h = Harness(depth=4)
    outs, started = h.several(3)
    started[2][1].done.set()                      # complete, but after the failing one
    started[0][1].error = PeerError("rank 1 left", culprits=(1,))
    with pytest.raises(PeerError, match="rank 1 left"):
        started[0][0].wait()
    for work, part in started[1:]:
        with pytest.raises(ClosedError, match="earlier collective failed: PeerError"):
            work.wait()
    assert all(part.abandoned for _, part in started[:2])
    assert all(not out.any() for out in outs)     # no write-back after the failure
    assert len(h.errors) == 1 and isinstance(h.errors[0], PeerError)
    assert not any(e[0] == "finish" for e in h.log)
    h.progress.stop()


def test_a_deadline_in_flight_is_checked_while_polling():
    h = Harness(depth=2, deadline=time.monotonic() + 0.2)
    out = np.zeros(2)
    work, part = h.deferred("a", out)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="did not complete before its deadline"):
        work.wait(timeout=5)
    assert time.monotonic() - start < 2
    assert part.abandoned and not out.any()
    assert isinstance(h.errors[0], CollectiveTimeoutError)
    h.progress.stop()


def test_the_communicator_failing_elsewhere_stops_completion():
    h = Harness(depth=2)
    out = np.zeros(2)
    work, part = h.deferred("a", out)
    until(lambda: ("start", "a") in h.log)
    h.failed = PeerError("rank 3 left", culprits=(3,))     # e.g. in another wait
    part.done.set()
    with pytest.raises(ClosedError, match="failed while this collective was in flight: "
                                          "rank 3 left") as info:
        work.wait()
    assert info.value.culprits == (3,)
    assert not out.any()
    h.progress.stop()


def test_interrupt_fails_the_collectives_in_flight():
    h = Harness(depth=3)
    outs, started = h.several(2)
    assert h.progress.interrupt(stop_s=5)
    with pytest.raises(KeyboardInterrupt) as info:
        started[0][0].wait()
    assert type(info.value) is KeyboardInterrupt
    with pytest.raises(ClosedError, match="^an earlier collective failed: KeyboardInterrupt: $"):
        started[1][0].wait()
    assert not any(out.any() for out in outs)
    h.progress.stop()


def test_waits_call_the_background_poll_and_raise_its_error():
    calls = []

    def poll():
        calls.append(1)
        if len(calls) == 5:
            raise ClosedError("in flight failed")

    words = np.zeros(2, np.int64)
    waiting.set_background(poll)
    try:
        with pytest.raises(ClosedError, match="in flight failed"):
            waiting.until(lambda s: None if waiting.spin_py(words, 1, None, 1, 0, s) == -1
                          else True, waiting.Wait())
        calls.clear()
        with pytest.raises(ClosedError, match="in flight failed"):
            waiting.until(lambda _: None, waiting.Wait())
    finally:
        waiting.set_background(None)
    assert waiting.background() is None
