"""How a collective waits for its peers: one bounded wait.

The communicator hands every transport call (and every compression
strategy) a :class:`Wait` instead of a bare deadline: the collective's
deadline (``time.monotonic()`` seconds, or None for none), its sequence
number and code, and the status board to watch. :func:`until` is the one
waiting loop of the library: it calls a step (an MPI request's test, a
compiled spin on words in shared memory, a look at the status board) until
the step has an answer and, every :data:`CHECK_EVERY_S` seconds, lets
:meth:`Wait.check` raise when the deadline passed or a peer left or died
(Python runs signal handlers between steps, so Ctrl-C ends a wait). How
often it looks and whether it sleeps in between depends on the thread
(:func:`set_relaxed`, :func:`set_background`) and on whether the node's
ranks share cores (:func:`set_cores_shared`), never on the step.
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
#: where the node's cores are shared (set_cores_shared), polls that yield the
#: core (sched_yield, Open MPI's mpi_yield_when_idle) between the spins and
#: the sleeps: a peer waiting for this core runs at once, where a sleep ends
#: only at the scheduler's next chance (4 ranks on 2 cores: 4 KiB
#: all-reduces 1.3-1.8 ms with sleeps alone, 0.5 ms; benchmarks/README.md)
CROWDED_YIELDS = 1000
_thread = threading.local()
#: every wait sleeps between polls (see set_cores_shared)
_cores_shared = False


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


def set_cores_shared(shared):
    """From now on, when ``shared``, make every wait of this process sleep
    between polls with backoff (:class:`Backoff`), as a relaxed thread's
    do, ``pace="spin"`` too (its peers follow within microseconds only
    while each has a core): the node runs more ranks than they have cores,
    and a rank that spins takes the core of the rank it waits for. False
    changes nothing (the communicators of a process each say, and one node
    crowded is enough); ``COMMLIB_WAIT`` chooses
    (:func:`commlib.settings.waits_sleep`)."""
    global _cores_shared
    _cores_shared = _cores_shared or bool(shared)


def cores_shared():
    """Whether the waits of this process sleep between polls (see :func:`set_cores_shared`)."""
    return _cores_shared


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
    calls, then ``yields`` calls that yield the core, then sleeps from
    ``RELAXED_SLEEP_S[0]`` doubling to ``[1]`` seconds (or longer while
    the thread's background says so, see :func:`set_background`); none
    either (and back to the shortest) while the thread is not relaxed
    (:func:`relaxed`: the caller's thread waits for this work), unless it
    sleeps ``always``."""

    __slots__ = ("_calls", "_sleep", "_spins")

    def __init__(self, yields=0):
        self._calls, self._sleep = 0, RELAXED_SLEEP_S[0]
        self._spins = RELAXED_SPINS + yields

    def pause(self, always=False):
        self._calls += 1
        if self._calls <= RELAXED_SPINS:
            return
        if not (always or relaxed()):
            self._sleep = RELAXED_SLEEP_S[0]
            return
        if self._calls <= self._spins:
            os.sched_yield()
            return
        longest = RELAXED_SLEEP_S[1]
        stretch = getattr(_thread, "longest_sleep", None)
        if stretch is not None:
            longest = max(longest, stretch())
        time.sleep(min(self._sleep, longest))
        self._sleep = min(self._sleep * 2, longest)


class Wait:
    """What a transport needs to wait inside collective ``seq`` (code
    ``what``, see :data:`commlib.core.fingerprints.COLLECTIVES`) of rank ``rank``:
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
        have arrived, if any); the status board also says once, after a
        while, whom this rank waits for (see
        :meth:`~commlib.faults.board.StatusBoard.check_waiting`)."""
        board = self.board
        if board is not None:
            board.check_waiting(self, late)
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            raise self.timeout(late)

    def timeout(self, late=None):
        """The CollectiveTimeoutError of this collective (marks this rank gone)."""
        board = self.board
        if board is not None:
            if late is None and hasattr(board, "late_for"):
                late = board.late_for(self.seq)
            return board.give_up(self.seq, self.what, CollectiveTimeoutError,
                                 board.timeout_text(self.seq, self.what, late), late or ())
        from .fingerprints import label
        return CollectiveTimeoutError(
            "rank %d: %s did not complete before its deadline; a peer may have died, hung or "
            "not called it" % (self.rank, label(self.what, self.seq)), culprits=late or ())


#: a Wait with no deadline and nothing to watch
FOREVER = Wait()


def until(step, wait, late=None, pace="auto"):
    """Call ``step(slice_s)`` until it returns something other than None,
    and return that: the one bounded wait of the library.

    ``step`` looks once, or spins (in C, without the GIL) for up to
    ``slice_s`` seconds, and returns None while the wait goes on; it may
    raise. Between its calls the thread's :func:`background` poll runs; a
    relaxed thread (:func:`relaxed`, ``pace="auto"``), every thread where
    the cores are shared (:func:`set_cores_shared`; a thread that is not
    relaxed yields its core :data:`CROWDED_YIELDS` times first) and a wait
    of ``pace="sleep"`` sleep between them with backoff (:class:`Backoff`),
    and its steps get no slice (one look each), as they do while there is a
    background poll; and every :data:`CHECK_EVERY_S` seconds, after a
    step without an answer, ``wait.check(late())`` raises when ``wait``'s
    deadline passed or a peer left or died (``late``: a callable naming the ranks known not to have
    arrived, or None). While tracing, a wait that did not find its answer
    at once is a ``wait for peers`` event of ``wait.rank`` (none for
    :data:`FOREVER`, which has no rank).

    Args:
        step: a callable of one float, the seconds it may spin.
        wait: the collective's :class:`Wait`.
        late: None, or a callable returning the ranks that have not arrived.
        pace: ``"auto"`` (as the thread is), ``"sleep"`` (a wait nobody
            hurries, such as ``close``'s) or ``"spin"`` (never sleeps, full
            slices, unless the cores are shared: the peers are known to
            follow within microseconds, as in the shared-memory reducer's
            synchronisations).

    Returns:
        What ``step`` returned.

    Raises:
        CollectiveTimeoutError, PeerError: from :meth:`Wait.check`.
        Whatever ``step`` or the background poll raises.
    """
    result = step(0.0)
    if result is not None:
        return result
    start = trace.now() if trace.ON and wait is not FOREVER else 0.0
    clock = time.monotonic
    poll = background()
    always = pace == "sleep" or _cores_shared
    # a wait the caller's thread sits in yields its core first on shared cores
    yields = CROWDED_YIELDS if _cores_shared and pace != "sleep" and not relaxed() else 0
    backoff = Backoff(yields) if always or (pace == "auto" and relaxed()) else None
    slice_s = 0.0 if backoff is not None or (poll is not None and pace == "auto") \
        else CHECK_EVERY_S
    next_check = clock() + CHECK_EVERY_S
    steps = 0
    while True:
        steps += 1
        if poll is not None:
            poll()
        if backoff is not None:
            backoff.pause(always)
        result = step(slice_s)
        if result is not None:
            if start:
                trace.peer_wait(wait.rank, start)
            return result
        # after the step: an answer of its own (an MPI error too) comes
        # before news of the peers that arrived in the meantime
        if (slice_s or backoff is not None or steps % _POLLS_PER_CLOCK == 0) \
                and clock() >= next_check:
            wait.check(None if late is None else late())
            next_check = clock() + CHECK_EVERY_S


def spin_py(words, target, gone, seq, rank, slice_s):
    """Python twin of the compiled wait (``commlib/native/flag_wait.c``):
    ``words`` and ``gone`` are per-rank numpy views (``gone`` may be None).
    Returns 0 when every other rank's word reached ``target``, -2 - r when
    rank r left (``0 < gone[r] <= seq``), -1 once ``slice_s`` seconds
    passed (after one look when it is 0); yields the CPU between looks
    after a while, as the compiled wait does."""
    end = time.monotonic() + slice_s
    polls = 0
    for r in range(len(words)):
        while r != rank and words[r] < target:
            if gone is not None and 0 < gone[r] <= seq:
                return -2 - r
            polls += 1
            if polls > _SPINS or slice_s <= 0:
                if time.monotonic() >= end:
                    return -1
                os.sched_yield()
    return 0
