"""The status board: where each rank of a communicator stands, in memory
shared by the ranks of one node.

Every rank owns one line of :data:`LINE_BYTES` bytes. Its int64 words:

==========  ==================================================================
``ENTERED``  sequence number of the last collective the rank entered (0: none)
``GONE``     0 while the rank takes part; else the first sequence number it
             will never complete (it closed the communicator, exited, dropped
             it, or gave up on a collective after an error)
``PID``      its process id
``REASON``   why it left (:data:`REASONS`); the text area says more
``TEXT_SEQ`` the sequence number the call text describes (mismatch reports)
``BLAME``    1 + the first rank it blamed when it gave up (0: none)
``SEEN``     when it last looked at the board while waiting
             (``time.monotonic_ns()``), and ``SEEN_SEQ`` in which collective:
             the data phase's progress; a rank that everyone waits for and
             that no longer looks is the one that stalled
``SLOT``     two slots of four words, one per parity of the sequence number:
             the call's fingerprint (two words), the collective's code
             (:data:`commlib.core.fingerprints.COLLECTIVES`) and when it was entered
             (``time.monotonic_ns()``)
==========  ==================================================================

then two UTF-8 texts: the call text (what the rank called, or why it
rejected its arguments, written when fingerprints differ) and the reason
text (why it left). A zero-filled line is a rank that has entered nothing
and has not left.

Entering collective ``s`` (:meth:`StatusBoard.enter`) writes the slot of
``s``'s parity, then ``ENTERED = s`` (release order), and waits until every
rank has entered ``s``; then every rank compares every rank's fingerprint.
No rank can write that slot again before every rank has entered ``s + 1``,
so the comparison is stable. Equal fingerprints (the usual case) cost one
pass over the other ranks' lines. Otherwise every rank writes a description
of its call (or its argument error) into its text area, publishes
``TEXT_SEQ = s``, waits for the others' and raises the same
:class:`~commlib.errors.ConsistencyError` (or its own argument error): no
data has moved, so the communicator stays usable.

While a rank waits (here, or in a transport that calls :meth:`check_peers`)
it gives up with :class:`~commlib.errors.PeerError` when a rank it waits for
has left (``0 < GONE <= s``) or its process no longer exists, and with
:class:`~commlib.errors.CollectiveTimeoutError` at the deadline, naming the
ranks that had not arrived and what each last entered. Either way it marks
itself gone at ``s`` so that its peers learn of it too. The waits spin in C
without the GIL (:mod:`commlib.ops.native`) and come back to Python every
:data:`SLICE_S` seconds, so signal handlers (Ctrl-C) run.
"""
import collections
import os
import sys
import time

import numpy as np

from ..core import fingerprints
from ..core.liveness import alive
from ..core import waiting
from ..errors import CollectiveTimeoutError, PeerError, rank_name, ranks_text
from ..ops import native

LINE_BYTES = 1024
STRIDE = LINE_BYTES // 8
ENTERED, GONE, PID, REASON, TEXT_SEQ, BLAME, SEEN, SEEN_SEQ = 0, 1, 2, 3, 4, 5, 6, 7
SLOT = 8                    # two slots: digest0, digest1, collective code, monotonic ns
SLOT_WORDS = 4
TEXT = 16 * 8               # byte offset of the call text in a line
TEXT_BYTES = (LINE_BYTES - TEXT) // 2
REASON_TEXT = TEXT + TEXT_BYTES
#: seconds a wait spends in C before Python checks signals, deadline and peers
SLICE_S = waiting.CHECK_EVERY_S
#: the fingerprint a rank publishes when it rejected its own arguments
ERROR_DIGEST = (-1, -1)
#: seconds without a look at the board after which a rank that entered a
#: collective and has not left is taken to have stalled inside it (a waiting
#: rank looks every commlib.core.waiting.CHECK_EVERY_S)
STALE_S = 0.25

CLOSED, EXITED, GAVE_UP, CLOSED_ON_EXCEPTION, DROPPED = 1, 2, 3, 4, 5
#: seconds a rank that met uneven numbers of steps waits for the other ranks'
#: counts to settle before it names the ranks to blame
SETTLE_S = 5.0
REASONS = {CLOSED: "closed the communicator", EXITED: "exited",
           GAVE_UP: "gave up", CLOSED_ON_EXCEPTION: "left after an exception",
           DROPPED: "dropped the communicator without close() (its script ended, or the last "
                    "reference went away)"}


class StatusBoard:
    """The board of one communicator over ``memory`` (a writeable uint8
    numpy array of at least ``size * LINE_BYTES`` bytes, zero-filled when
    made, shared by all ``size`` ranks). :meth:`join` before use."""

    def __init__(self, memory, rank, size):
        """A view of the status board in ``memory`` for rank ``rank`` of
        ``size``."""
        self.rank, self.size = rank, size
        self.memory = memory[:size * LINE_BYTES]
        self.words = self.memory.view(np.int64)
        self._lines = self.words.reshape(size, STRIDE)
        self._gone = self.words[GONE:]        # for waits that watch for ranks leaving
        self._mine = self._lines[rank]
        self._ext = native.module()
        self.warn_after = None                # seconds, see check_waiting()
        #: per rank, its rank in the communicator this one was split from,
        #: or None (see :meth:`name`)
        self.world = None

    def name(self, r):
        """How messages name rank ``r``: ``rank 3``, or ``rank 1 (world
        rank 3)`` on the board of a communicator made by ``split``."""
        return rank_name(r, self.world)

    @property
    def gone_words(self):
        """(int64 array, stride): word ``r * stride`` is rank r's ``GONE``."""
        return self._gone, STRIDE

    def join(self):
        """Write this rank's process id (the rest of its line is zero)."""
        self._mine[PID] = os.getpid()

    def everyone_joined(self):
        """Whether every rank has joined this board (ranks on other nodes
        never see it)."""
        return bool((self._lines[:, PID] != 0).all())

    # -- entering a collective -------------------------------------------------
    def enter(self, wait, digest, error=None, describe=None):
        """Enter collective ``wait.seq`` (1, 2, ...; the code ``wait.what``
        of :data:`~commlib.core.fingerprints.COLLECTIVES`; ``wait``: its
        :class:`~commlib.core.waiting.Wait`) with ``digest`` (two int64,
        see :mod:`commlib.core.fingerprints`), and wait for every rank
        to enter it. ``error``: this rank's argument error, or None;
        ``describe()``: text of this call, used only when fingerprints
        differ.

        Returns when every rank entered with the same fingerprint and no
        error. Raises ConsistencyError (or ``error``) when they differ,
        PeerError or CollectiveTimeoutError when a rank left, died or did not
        come (this rank is then marked gone at ``wait.seq``).
        """
        seq, what = wait.seq, wait.what
        d0, d1 = ERROR_DIGEST if error is not None else digest
        slot, publish = (d0, d1, what, time.monotonic_ns()), [True]
        ext = self._ext

        def step(slice_s):
            if ext is not None:
                code = ext.board_enter(self.words, STRIDE, self.size, self.rank, ENTERED, GONE,
                                       SLOT, seq, d0, d1, what, slot[3], publish[0],
                                       wait.deadline, slice_s)
            else:
                code = self._enter_py(seq, slot, publish[0], slice_s)
            publish[0] = False
            return None if code == -1 else code

        code = waiting.until(step, wait, late=lambda: self.not_arrived(seq))
        if code == 0 and error is None:
            return
        if code >= 0:
            return self._disagree(wait, error, describe)
        raise self._left(-2 - code, seq, what)

    def _enter_py(self, seq, slot, publish, slice_s):
        """board_enter's look in Python (no compiled loops; x86-64 order)."""
        at = SLOT + (seq & 1) * SLOT_WORDS
        if publish:
            self._mine[at:at + SLOT_WORDS] = slot
            self._mine[ENTERED] = seq
        code = waiting.spin_py(self._lines[:, ENTERED], seq, self._lines[:, GONE], seq,
                               self.rank, slice_s)
        if code != 0:
            return code
        for r in range(self.size):          # entered, then gave up on this collective
            if r != self.rank and 0 < self._lines[r, GONE] <= seq:
                return -2 - r
        same = (self._lines[:, at:at + 2] == np.array(slot[:2])).all()
        return 0 if same else 1

    def arrive(self, seq):
        """Publish that this rank entered collective ``seq`` without waiting
        (the consistency check is off), for messages about who is late."""
        self._mine[ENTERED] = seq

    def wait_words(self, word, target, wait):
        """Wait until every rank's ``word`` is at least ``target``, watching
        for ranks leaving collective ``wait.seq``."""
        seq, ext = wait.seq, self._ext

        def step(slice_s):
            if ext is not None:
                code = ext.wait_flags(self.words[word:], self.rank, self.size, STRIDE, target,
                                      False, wait.deadline, slice_s, self._gone, STRIDE, seq)
            else:
                code = waiting.spin_py(self._lines[:, word], target, self._lines[:, GONE], seq,
                                       self.rank, slice_s)
            return None if code == -1 else code

        code = waiting.until(step, wait)
        if code <= -2:
            raise self._left(-2 - code, seq, wait.what)

    def _disagree(self, wait, error, describe):
        """Fingerprints differ (or a rank rejected its arguments): exchange
        texts and raise on every rank."""
        seq, what = wait.seq, wait.what
        text = ("ERROR " + str(error)) if error is not None else describe()
        self.write_text(text)
        self._mine[TEXT_SEQ] = seq
        self.wait_words(TEXT_SEQ, seq, wait)
        at = SLOT + (seq & 1) * SLOT_WORDS
        rows = [(tuple(self._lines[r, at:at + 2]), self.read_text(r)) for r in range(self.size)]
        failure = fingerprints.disagreement(self.rank, seq, what, rows,
                                           error_digest=ERROR_DIGEST, world=self.world)
        if error is not None:
            raise error
        raise failure

    # -- watching the others ---------------------------------------------------------
    def check_waiting(self, wait, late=None):
        """Called between the steps of a wait in collective ``wait.seq``
        (see :meth:`Wait.check <commlib.core.waiting.Wait.check>`): raise
        when a rank among ``late`` (the ranks that had not arrived; every
        other rank when None) left or died, or the deadline passed; say once,
        after :attr:`warn_after` seconds, whom this rank waits for."""
        seq, what, deadline = wait.seq, wait.what, wait.deadline
        now_ns = time.monotonic_ns()
        self._mine[SEEN_SEQ], self._mine[SEEN] = seq, now_ns      # this rank still waits
        now = now_ns * 1e-9
        self.check_peers(seq, what, late)
        if deadline is not None and now >= deadline:
            raise wait.timeout(late)
        if self.warn_after is not None and late:
            since = self._mine[SLOT + (seq & 1) * SLOT_WORDS + 3]
            if since and now - since * 1e-9 > self.warn_after:
                self.warn_after = None
                print("commlib: %s has waited %.0f s in %s; %s" % (
                    self.name(self.rank), now - since * 1e-9, fingerprints.label(what, seq),
                    "; ".join(self.where(r) for r in late)), file=sys.stderr, flush=True)

    def check_peers(self, seq, what, ranks=None):
        """Raise PeerError (marking this rank gone at ``seq``) when one of
        ``ranks`` (default: every other rank) left before completing
        collective ``seq`` or its process died. A rank that left or died
        by itself is named before one that gave up because of another (the
        cause first-hand, whichever rank saw it first)."""
        gave_up = None
        for r in range(self.size) if ranks is None else ranks:
            if r == self.rank:
                continue
            if self._left_by_itself(r, seq):
                raise self._left(r, seq, what)
            if 0 < self._lines[r, GONE] <= seq:
                gave_up = r if gave_up is None else gave_up
            elif self.died(r):
                raise self.give_up(seq, what, PeerError,
                                   "%s died while this rank waits in %s"
                                   % (self.who(r), fingerprints.label(what, seq)), (r,))
        if gave_up is not None:
            raise self._left(gave_up, seq, what)

    def died(self, r):
        """Whether rank ``r``'s process ended (it ran on this node: its
        process id is on its line)."""
        pid = int(self._lines[r, PID])
        return bool(pid) and not alive(pid)

    def who(self, r):
        """``rank 2 (pid 4242)``: rank ``r`` in messages about its death."""
        return "%s (pid %d)" % (self.name(r), int(self._lines[r, PID]))

    def not_arrived(self, seq):
        """Ranks that have not entered collective ``seq``."""
        return [r for r in range(self.size) if self._lines[r, ENTERED] < seq]

    def stalled(self, seq):
        """Ranks that entered collective ``seq``, have not left, and have not
        looked at the board for :data:`STALE_S` seconds: every waiting rank
        looks every few milliseconds (see :meth:`check_waiting`), so these
        stopped inside the collective (a stop signal, a hung thread, a long
        pause before their part of the exchange)."""
        now = time.monotonic_ns()
        return [r for r in range(self.size) if r != self.rank
                and self._lines[r, ENTERED] >= seq and not self._lines[r, GONE]
                and now - self._lines[r, SEEN] > STALE_S * 1e9]

    def late_for(self, seq):
        """The ranks a wait in collective ``seq`` is held up by: those that
        have not entered it, else those that stalled inside it."""
        return self.not_arrived(seq) or self.stalled(seq)

    def where(self, r):
        """What rank ``r`` last did, e.g. ``rank 2 last entered barrier #7 3.1 s ago``."""
        return "%s %s" % (self.name(r), self.state_of(r))

    def state_of(self, r):
        """What rank ``r`` last did, without its name: ``last entered
        barrier #7 3.1 s ago, not seen waiting in it since``, ``has not
        entered any collective``, ``gave up in collective #7 (...)``."""
        line = self._lines[r]
        entered = int(line[ENTERED])
        gone = int(line[GONE])
        if gone:
            reason = int(line[REASON])
            if reason == GAVE_UP:
                return "gave up in collective #%d%s" % (gone, self._reason_text(r))
            return "%s after collective #%d%s" % (
                REASONS.get(reason, "left"), gone - 1, self._reason_text(r))
        if not entered:
            return "has not entered any collective"
        at = SLOT + (entered & 1) * SLOT_WORDS
        now = time.monotonic()
        seen = ""
        if line[SEEN_SEQ] == entered and line[SEEN]:
            seen = ", last seen waiting in it %.1f s ago" % (now - line[SEEN] * 1e-9)
        elif line[SEEN_SEQ] < entered:
            seen = ", not seen waiting in it since"
        return "last entered %s %.1f s ago%s" % (
            fingerprints.label(int(line[at + 2]), entered), now - line[at + 3] * 1e-9, seen)

    def _reason_text(self, r):
        text = self.read_text(r, REASON_TEXT)
        return " (%s)" % text if text else ""

    def timeout_text(self, seq, what, late):
        """Text of a timeout in collective ``seq`` naming the ``late`` ranks
        (default: those that have not entered it)."""
        if late is None:
            late = self.late_for(seq)
        if late:
            who = "; ".join("%s (%s)" % (self.name(r), self.state_of(r)) for r in late)
            return ("%s did not complete before its deadline: waiting for %s"
                    % (fingerprints.label(what, seq), who))
        return ("%s did not complete before its deadline; every rank had entered it and was "
                "still waiting in it (a transport that stopped moving?)"
                % fingerprints.label(what, seq))

    def _left(self, r, seq, what):
        """PeerError for rank ``r`` having left before collective ``seq``;
        when ``r`` gave up blaming another rank, the blame passes on. When
        ``r`` closed or exited (uneven numbers of steps), the blame goes to
        the ranks whose number of collectives differs from the majority's
        (see :meth:`uneven_culprits`). When ``r`` gave up and a rank that
        left by itself is on the board too, that rank is named instead (the
        cause first-hand, whichever rank a wait found first)."""
        if self._lines[r, REASON] == GAVE_UP:
            r = next((q for q in range(self.size)
                      if q != self.rank and self._left_by_itself(q, seq)), r)
        reason = int(self._lines[r, REASON])
        uneven = reason in (CLOSED, EXITED, DROPPED)
        if reason == GAVE_UP:       # a rank is never blamed for giving up
            blamed = int(self._lines[r, BLAME]) - 1
            culprits = (blamed,) if blamed >= 0 else ()
        else:
            culprits = (r,)
        hint = ""
        if uneven:
            counts = self.settled_counts(seq, leaving=False)
            culprits = uneven_culprits(counts)
            hint = "; uneven number of steps: %s (every rank must call the same collectives)" \
                % steps_text(counts, culprits, self.rank)
        text = "%s while this rank is in %s%s" % (self.where(r), fingerprints.label(what, seq),
                                                  hint)
        return self.give_up(seq, what, PeerError, text, culprits)

    def _left_by_itself(self, r, seq):
        """Whether rank ``r`` left before completing collective ``seq`` for
        a reason of its own (closed, exited, dropped, raised), not because
        it gave up on another rank."""
        return 0 < self._lines[r, GONE] <= seq and self._lines[r, REASON] != GAVE_UP

    def give_up(self, seq, what, kind, text, culprits):
        """Mark this rank gone at ``seq`` and return ``kind`` (an error class)
        with ``text``, naming ``culprits``."""
        self.leave(seq - 1, GAVE_UP, "%s: %s" % (fingerprints.label(what, seq), text), culprits)
        return kind("%s: %s" % (self.name(self.rank), text), culprits=culprits)

    # -- leaving ---------------------------------------------------------------------
    def leave(self, completed, reason, text="", blame=()):
        """Publish that this rank completes no collective after number
        ``completed``, for ``reason`` (:data:`REASONS`), with ``text`` and
        the ranks it ``blame``s. A rank leaves once; later calls keep the
        first reason."""
        if self._mine[GONE]:
            return
        self.write_text(text, REASON_TEXT)
        self._mine[BLAME] = blame[0] + 1 if blame else 0
        self._mine[REASON] = reason
        self._mine[GONE] = completed + 1

    def wait_left(self, completed, deadline):
        """After :meth:`leave` (closing after collective ``completed``), wait
        until every rank has left after the same collective. Raises
        PeerError when a rank entered a later collective (uneven number of
        steps: this rank stopped early), left earlier or died, and
        CollectiveTimeoutError at the deadline naming the ranks still busy."""
        def step(_):
            busy = []
            for r in range(self.size):
                line = self._lines[r]
                gone, entered = int(line[GONE]), int(line[ENTERED])   # one read each
                if r == self.rank or gone == completed + 1 and entered <= completed:
                    continue
                if entered > completed:
                    counts = self.settled_counts(completed, leaving=True)
                    culprits = uneven_culprits(counts)
                    raise PeerError(
                        "%s: this rank left after collective #%d but %s: uneven number "
                        "of steps: %s (every rank must call the same collectives)"
                        % (self.name(self.rank), completed, self.where(r),
                           steps_text(counts, culprits, self.rank)), culprits=culprits)
                if gone:
                    raise PeerError("%s: %s; this rank left after collective #%d"
                                    % (self.name(self.rank), self.where(r), completed),
                                    culprits=(r,))
                if self.died(r):
                    raise PeerError("%s: %s died before closing"
                                    % (self.name(self.rank), self.who(r)), culprits=(r,))
                busy.append(r)
            if not busy:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    "%s: closing after collective #%d timed out waiting for %s"
                    % (self.name(self.rank), completed, "; ".join(self.where(r) for r in busy)),
                    culprits=busy)
            return None

        waiting.until(step, waiting.Wait(rank=self.rank), pace="sleep")

    def settled_counts(self, mine, leaving, wait_s=SETTLE_S):
        """{rank: collectives it entered} once each rank's count is known
        (it left, died, entered a collective after ``mine``, or, while this
        rank waits inside collective ``mine`` (``leaving`` False), entered
        ``mine`` too), or after ``wait_s`` seconds: ranks still on their way
        are left out. This rank counts ``mine``."""
        end = time.monotonic() + wait_s

        def step(_):
            counts, pending = {self.rank: mine}, False
            for r in range(self.size):
                if r == self.rank:
                    continue
                line = self._lines[r]
                gone, entered = int(line[GONE]), int(line[ENTERED])   # one read each
                if (gone or entered > mine or (entered == mine and not leaving)
                        or self.died(r)):
                    counts[r] = entered
                else:
                    pending = True
            return counts if not pending or time.monotonic() >= end else None

        return waiting.until(step, waiting.Wait(rank=self.rank), pace="sleep")

    # -- text ------------------------------------------------------------------------
    def write_text(self, text, where=TEXT):
        """Write this rank's call text (``where=TEXT``) or reason text."""
        data = text.encode("utf-8", "replace")[:TEXT_BYTES - 1]
        at = self.rank * LINE_BYTES + where
        self.memory[at:at + TEXT_BYTES] = 0
        self.memory[at:at + len(data)] = np.frombuffer(data, np.uint8)

    def read_text(self, r, where=TEXT):
        """Rank ``r``'s call text (``where=TEXT``) or reason text."""
        at = r * LINE_BYTES + where
        return bytes(self.memory[at:at + TEXT_BYTES]).split(b"\0", 1)[0].decode(
            "utf-8", "replace")


def uneven_culprits(counts):
    """The ranks to blame when ranks called different numbers of collectives
    (``counts``: {rank: collectives entered}): those whose count differs
    from the count most ranks share; every rank in ``counts`` when no count
    is shared by more ranks than any other (two ranks, or a tie)."""
    tally = collections.Counter(counts.values()).most_common()
    if len(tally) > 1 and tally[0][1] == tally[1][1]:
        return tuple(sorted(counts))
    return tuple(sorted(r for r, c in counts.items() if c != tally[0][0]))


def steps_text(counts, culprits, me):
    """E.g. ``rank 1 entered 7 collectives, ranks 0, 2 entered 6``."""
    groups = collections.defaultdict(list)
    for r, c in sorted(counts.items()):
        groups[c].append(r)
    parts = ["%s %d collective%s" % (ranks_text(g) + " entered", c, "s" if c != 1 else "")
             for c, g in sorted(groups.items(), key=lambda item: (item[1][0] not in culprits,
                                                                   item[1][0]))]
    blamed = "this rank" if tuple(culprits) == (me,) else ranks_text(culprits)
    return "%s; blaming %s" % (", ".join(parts), blamed)
