"""How a collective waits for its peers.

The communicator hands every transport call (and every compression
strategy) a :class:`Wait` instead of a bare deadline: the collective's
deadline (``time.monotonic()`` seconds, or None for none), its sequence
number and code, and the status board to watch. :func:`poll` is the one
polling loop of the library: it calls ``done()`` back to back and, every
:data:`commlib.faults.board.SLICE_S` seconds, lets :meth:`Wait.check` raise when the
deadline passed or a peer left or died (Python runs signal handlers between
polls too, so Ctrl-C ends a wait).
"""
import os
import threading
import time

from .. import trace
from ..errors import CollectiveTimeoutError

#: seconds between checks of the deadline and the peers while polling, and
#: the longest a compiled wait spins before Python gets control back
CHECK_EVERY_S = 0.02
_POLLS_PER_CLOCK = 64
_SPINS = 2000             # polls of a word before each further poll yields the CPU
#: relaxed waits: polls back to back before sleeping, the first and the
#: longest sleep between polls (seconds)
RELAXED_SPINS = 32
RELAXED_SLEEP_S = (2e-5, 1e-4)
_thread = threading.local()


def set_relaxed(when):
    """Make this thread's waits relaxed while ``when()`` returns True
    (``when``: a callable, or a bool for always / never): after a few polls
    they sleep between polls, with backoff, instead of spinning, so a
    progress thread leaves the CPU (and the GIL) to the thread computing."""
    _thread.relaxed = when if callable(when) else bool(when).__bool__


def relaxed():
    """Whether this thread's waits are relaxed now (see :func:`set_relaxed`)."""
    when = getattr(_thread, "relaxed", None)
    return when is not None and when()


def set_background(poll, longest_sleep=None):
    """Make this thread's waits call ``poll()`` between their polls (None:
    stop): a progress thread with collectives in flight keeps them moving
    while it waits for its peers to enter the next one. ``poll`` may raise;
    the wait then raises it. ``longest_sleep()``: how long a relaxed wait
    may sleep between polls now (seconds), when longer than its own limit
    (with bytes in flight, a late wake-up leaves the link busy)."""
    _thread.background = poll
    _thread.longest_sleep = longest_sleep if poll is not None else None


def background():
    """This thread's background poll (see :func:`set_background`), or None."""
    return getattr(_thread, "background", None)


class Backoff:
    """Sleeps of a relaxed wait: none for the first :data:`RELAXED_SPINS`
    calls, then from ``RELAXED_SLEEP_S[0]`` doubling to ``[1]`` seconds
    (or longer while the thread's background says so, see
    :func:`set_background`); none either (and back to the shortest) while
    the thread is not relaxed (:func:`relaxed`: the caller's thread waits
    for this work)."""

    __slots__ = ("_calls", "_sleep")

    def __init__(self):
        self._calls, self._sleep = 0, RELAXED_SLEEP_S[0]

    def pause(self):
        self._calls += 1
        if self._calls <= RELAXED_SPINS:
            return
        if not relaxed():
            self._sleep = RELAXED_SLEEP_S[0]
            return
        longest = RELAXED_SLEEP_S[1]
        stretch = getattr(_thread, "longest_sleep", None)
        if stretch is not None:
            longest = max(longest, stretch())
        time.sleep(min(self._sleep, longest))
        self._sleep = min(self._sleep * 2, longest)


class Wait:
    """What a transport needs to wait inside collective ``seq`` (code
    ``what``, see :data:`commlib.collective.consistency.COLLECTIVES`) of rank ``rank``:
    the collective's ``deadline`` (``time.monotonic()`` seconds, or None)
    and the status ``board`` to watch for peers that leave. One per
    collective, made when it begins, never changed."""

    __slots__ = ("deadline", "seq", "what", "board", "rank")

    def __init__(self, deadline=None, seq=0, what=0, board=None, rank=0):
        self.deadline, self.seq, self.what = deadline, seq, what
        self.board, self.rank = board, rank

    def check(self, late=None):
        """Raise PeerError when a peer left or died, CollectiveTimeoutError
        when the deadline passed (naming ``late``: the ranks known not to
        have arrived, if any)."""
        board = self.board
        if board is not None:
            board.check_peers(self.seq, self.what)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise self.timeout(late)

    def timeout(self, late=None):
        """The CollectiveTimeoutError of this collective (marks this rank gone)."""
        board = self.board
        if board is not None:
            if late is None and hasattr(board, "not_arrived"):
                late = board.not_arrived(self.seq)
            return board.give_up(self.seq, self.what, CollectiveTimeoutError,
                                 board.timeout_text(self.seq, self.what, late), late or ())
        from ..collective.consistency import label
        return CollectiveTimeoutError(
            "rank %d: %s did not complete before its deadline; a peer may have died, hung or "
            "not called it" % (self.rank, label(self.what, self.seq)), culprits=late or ())


class SleepingWaits:
    """The compiled waits of ``ext`` (``commlib._hostloops``: ``board_enter``,
    ``wait_flags``) with the same arguments and results, for a relaxed
    thread or one with a background poll (:func:`background`): each call
    spins only briefly in C at a time (deadline and slice set to zero),
    calls the background poll and sleeps with backoff between (relaxed
    only), until the slice it was given has passed."""

    def __init__(self, ext):
        self._ext = ext

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def board_enter(self, words, stride, nranks, rank, entered_at, gone_at, slot_at, seq,
                    d0, d1, what, when, publishing, deadline, slice_s):
        def once(publishing, deadline, slice_s):
            return self._ext.board_enter(words, stride, nranks, rank, entered_at, gone_at,
                                         slot_at, seq, d0, d1, what, when, publishing,
                                         deadline, slice_s)
        return _in_short_spins(once, publishing, deadline, slice_s)

    def wait_flags(self, flags, rank, nranks, stride, seq, first, deadline, slice_s, gone,
                   gone_stride, board_seq):
        def once(first, deadline, slice_s):
            return self._ext.wait_flags(flags, rank, nranks, stride, seq, first, deadline,
                                        slice_s, gone, gone_stride, board_seq)
        return _in_short_spins(once, first, deadline, slice_s)


def _in_short_spins(once, publish, deadline, slice_s):
    """Call ``once(publish, deadline, slice_s)`` with no deadline and no
    slice (one look in C) until it returns other than -1 or ``slice_s``
    (or the deadline) passed, publishing only the first time; the thread's
    background poll and a backoff sleep between calls."""
    until = time.monotonic() + slice_s
    if deadline is not None:
        until = min(until, deadline)
    backoff, poll = Backoff(), background()
    while True:
        code = once(publish, 0.0, 0.0)
        if code != -1 or time.monotonic() >= until:
            return code
        publish = False
        if poll is not None:
            poll()
        backoff.pause()


#: a Wait with no deadline and nothing to watch
FOREVER = Wait()


def poll(done, wait):
    """Call ``done()`` until it returns True, checking ``wait`` every
    :data:`CHECK_EVERY_S` seconds; relaxed (:func:`relaxed`) with sleeps
    between polls; calling the thread's :func:`background` poll between
    polls. While tracing, a wait that polled is a ``wait for peers`` event."""
    start = trace.now() if trace.ON else 0.0
    clock = time.monotonic
    next_check = clock() + CHECK_EVERY_S
    polls = 0
    backoff = Backoff() if relaxed() else None
    poll = background()
    while not done():
        polls += 1
        if poll is not None:
            poll()
        if backoff is not None:
            backoff.pause()
            if clock() >= next_check:
                wait.check()
                next_check = clock() + CHECK_EVERY_S
        elif polls % _POLLS_PER_CLOCK == 0 and clock() >= next_check:
            wait.check()
            next_check = clock() + CHECK_EVERY_S
    if start and polls:
        trace.peer_wait(wait.rank, start)


def spin_py(words, target, gone, seq, rank, until, may_sleep=True):
    """Python twin of the compiled wait (``commlib/native/flag_wait.c``):
    ``words`` and ``gone`` are per-rank numpy views (``gone`` may be None).
    Returns 0 when every other rank's word reached ``target``, -2 - r when
    rank r left (``0 < gone[r] <= seq``), -1 once ``until`` passed. On a
    relaxed thread (:func:`relaxed`) it sleeps between polls instead of
    yielding, unless ``may_sleep`` is False; it calls the thread's
    :func:`background` poll now and then."""
    polls = 0
    backoff = Backoff() if may_sleep and relaxed() else None
    poll = background()
    for r in range(len(words)):
        while r != rank and words[r] < target:
            if gone is not None and 0 < gone[r] <= seq:
                return -2 - r
            polls += 1
            if poll is not None and polls % _POLLS_PER_CLOCK == 0:
                poll()
            if backoff is not None or polls > _SPINS:
                if backoff is not None:
                    backoff.pause()
                else:
                    os.sched_yield()
                if time.monotonic() >= until:
                    return -1
    return 0


def slice_end(deadline):
    """When a wait's next slice ends: :data:`CHECK_EVERY_S` from now, or the deadline."""
    until = time.monotonic() + CHECK_EVERY_S
    return until if deadline is None else min(until, deadline)
