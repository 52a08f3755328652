"""Collectives in flight: all-reduces over MPI that a communicator's
progress thread has started and not yet completed.

The progress thread (:class:`commlib.progress.work.Progress`) starts the next queued
all-reduce while up to ``depth - 1`` earlier ones still move over MPI, so
the link does not idle while the thread notices that one completed and
starts the next, and the thread can poll less often (each wake-up takes the
CPU from the computation it overlaps). An all-reduce qualifies when its
data phase is MPI requests alone: numpy arrays, no compression, the MPI
transport (not shared memory). Every other collective, and an all-reduce of
memory that one in flight writes, first completes the ones in flight.

The order and the guarantees are those of blocking collectives: the
consistency check runs first, in order (the status board holds two calls'
fingerprints, so the next one can be entered while one is in flight, and
the waits there keep the ones in flight moving); every rank starts the
requests in the same order; a collective completes only after every earlier
one. What follows a collective's requests (its staged result copied into
the caller's arrays times the average's scale, a packed bucket unpacked)
runs once all of them completed, so a failure leaves the caller's arrays as
they were.
"""
import time

import numpy as np

from ..core.waiting import RELAXED_SLEEP_S

#: the shortest and longest sleep between polls of collectives in flight
#: while the caller computes (seconds)
MIN_SLEEP_S, MAX_SLEEP_S = 2e-5, 1e-3
#: the sleep is at most this share of the time the bytes in flight still need
SLEEP_SHARE = 1 / 8


def now(fn):
    """Run ``fn()`` now: what a collective that waits for its requests does
    where one in flight would call :meth:`InFlight.then`."""
    fn()


def start(progress, transport, items, wait):
    """For an all-reduce of ``items`` (numpy arrays) over ``transport``
    executing on ``progress``'s thread: an :class:`InFlight` (registered
    with ``progress``, with ``wait``, the collective's own) when its data
    phase may leave its requests in flight: pipelining on, a transport that
    :meth:`~commlib.transport.base.Transport.defers` them, and no memory
    shared with a collective in flight (else None: it runs whole, after
    them)."""
    if not progress.may_defer() or not transport.defers(items[0]):
        return None
    flight = InFlight(wait, holds=items)
    earlier = progress.in_flight()
    if earlier and any(overlap(flight.spans(), f.spans()) for f in earlier):
        return None
    progress.defer(flight)
    return flight


class InFlight:
    """One started collective: its ``parts`` (objects with ``test()``, True
    once complete and raising on failure, and ``abandon()``), in the order
    started, and the callables to run once every part completed, in order.
    ``wait``: the collective's own :class:`~commlib.core.waiting.Wait`
    (deadline, peers); ``nbytes``: the bytes it reduces; ``holds``: the
    arrays whose memory it reads or writes until it completes."""

    __slots__ = ("wait", "parts", "after", "nbytes", "holds", "started", "_spans")

    def __init__(self, wait, holds=()):
        self.wait = wait
        self.parts, self.after = [], []
        self.nbytes = 0
        self.holds = holds
        self.started = time.perf_counter()
        self._spans = None

    def add(self, part):
        self.parts.append(part)

    def then(self, fn):
        """Run ``fn()`` once every part completed (after the earlier ones)."""
        self.after.append(fn)

    def pending(self):
        return bool(self.parts)

    def test(self):
        """Whether every part completed (tested in order); raises a part's failure."""
        parts = self.parts
        while parts:
            if not parts[0].test():
                return False
            parts.pop(0)
        return True

    def finish(self):
        """Run what was left for after the requests."""
        after, self.after = self.after, []
        for fn in after:
            fn()

    def abandon(self):
        """Give up: the parts stay alive inside MPI (see
        :data:`commlib.transport.mpi.ABANDONED`), nothing more is written."""
        parts, self.parts, self.after = self.parts, [], []
        for part in parts:
            part.abandon()

    def spans(self):
        """Byte ranges ``[lo, hi)`` of :attr:`holds` (an int64 array (n, 2))."""
        if self._spans is None:
            self._spans = spans(self.holds)
        return self._spans


def spans(arrays):
    """Byte ranges ``[lo, hi)`` of the non-empty ones of ``arrays``
    (C-contiguous numpy arrays), as an int64 array (n, 2)."""
    out = [(a.__array_interface__["data"][0], a.nbytes) for a in arrays if a.nbytes]
    out = np.array(out, np.int64).reshape(-1, 2)
    out[:, 1] += out[:, 0]
    return out


def overlap(a, b):
    """Whether any range of ``a`` meets any of ``b`` (arrays of ``spans``)."""
    if not len(a) or not len(b):
        return False
    b = b[np.argsort(b[:, 0])]
    ends = np.maximum.accumulate(b[:, 1])
    # for each range of a: the ranges of b starting before its end; the
    # furthest end among them must not pass its start
    before = np.searchsorted(b[:, 0], a[:, 1], side="left")
    has = before > 0
    return bool((ends[before[has] - 1] > a[has, 0]).any())


class Pacer:
    """How long a progress thread sleeps between polls of the collectives in
    flight while its caller computes: up to :data:`SLEEP_SHARE` of the time
    their bytes still need at the rate measured so far, between
    :data:`MIN_SLEEP_S` and :data:`MAX_SLEEP_S`. The rate is each
    completed collective's bytes over its service time (from when it started
    or the one before it completed, whichever came later)."""

    __slots__ = ("_seconds_per_byte", "_last_done")

    def __init__(self):
        self._seconds_per_byte = None
        self._last_done = 0.0

    def completed(self, started, nbytes):
        """A collective of ``nbytes`` started at ``started`` (``time.perf_counter()``) completed now."""
        now = time.perf_counter()
        busy = now - max(started, self._last_done)
        self._last_done = now
        if nbytes > 0 and busy > 0:
            rate = busy / nbytes
            old = self._seconds_per_byte
            self._seconds_per_byte = rate if old is None else 0.75 * old + 0.25 * rate

    def longest_sleep(self, nbytes):
        """The longest sleep between polls with ``nbytes`` in flight (seconds)."""
        if self._seconds_per_byte is None:      # as a relaxed wait's
            return RELAXED_SLEEP_S[1]
        return min(MAX_SLEEP_S, max(MIN_SLEEP_S, SLEEP_SHARE * nbytes * self._seconds_per_byte))
