"""The consistency check when the ranks share no memory (several nodes).

:class:`ExchangeBoard` is the status board (:class:`commlib.faults.board.StatusBoard`)
of ranks that share no memory. Before each collective the ranks all-gather
their fingerprints (four int64 per rank) over the transport, and the texts
of their calls only when the fingerprints differ. Where the ranks stand
and whether they live comes from a copy of the board in each rank's own
memory that a :class:`~commlib.faults.peer_watch.PeerWatch` keeps up to date
over TCP connections between the ranks: so, as on one node, a rank that
died (its connection ended without a goodbye) or gave up is noticed within
milliseconds and named (PeerError), and at a deadline the ranks that had
not arrived, or that entered and stopped looking (stalled), are named
(CollectiveTimeoutError); a rank that merely gave up passes the blame on.
Closing waits, on the copy, until every rank left after the same
collective (uneven numbers of steps blame the minority).

Without a watch (a rank could not connect to a peer; every rank then goes
without, see :meth:`PeerWatch.start <commlib.faults.peer_watch.PeerWatch.start>`)
only the exchange remains: closing is one more exchange, so a rank that
closes while another enters a collective makes both raise, and a deadline
names nobody.
"""
import time

import numpy as np

from ..core import fingerprints
from .board import (CLOSED, ENTERED, ERROR_DIGEST, EXITED, GONE, LINE_BYTES, SEEN, SEEN_SEQ,
                    SETTLE_S, SLOT, SLOT_WORDS, TEXT_BYTES, StatusBoard, steps_text, uneven_culprits)
from .peer_watch import PeerWatch
from ..errors import PeerError
from ..core.waiting import Wait

#: the collective code a closing rank publishes
CLOSE = -1


class ExchangeBoard(StatusBoard):
    """The board of rank ``rank`` of ``size`` ranks that share no memory:
    fingerprints exchanged over ``transport`` (any transport whose
    ``all_gather`` takes numpy buffers), the rest on a copy kept by a
    :class:`~commlib.faults.peer_watch.PeerWatch` (``watch=False``: none).
    Making it is collective. ``on_death(rank)`` is called (on a thread of
    the watch) when a peer's process ends without closing."""

    def __init__(self, transport, rank, size, watch=True, on_death=None):
        super().__init__(np.zeros(size * LINE_BYTES, np.uint8), rank, size)
        self.transport = transport
        self.join()
        self.watch = None
        if watch and size > 1:
            self.watch = PeerWatch.start(rank, size, self.memory, self._setup_gather,
                                         on_death=on_death)
        self._publish()

    def _setup_gather(self, mine, out):
        self.transport.all_gather(mine, out, Wait(time.monotonic() + 60.0, 0, 0, None,
                                                  self.rank))

    def _publish(self):
        if self.watch is not None:
            self.watch.publish()

    def _gather(self, values, dtype, wait):
        mine = np.asarray(values, dtype=dtype)
        out = np.empty(self.size * mine.size, dtype=dtype)
        self.transport.all_gather(mine, out, wait)
        return out.reshape(self.size, -1)

    def enter(self, wait, digest, error=None, describe=None):
        """As :meth:`StatusBoard.enter <commlib.faults.board.StatusBoard.enter>`."""
        seq, what = wait.seq, wait.what
        d0, d1 = ERROR_DIGEST if error is not None else digest
        at = SLOT + (seq & 1) * SLOT_WORDS
        self._mine[at:at + SLOT_WORDS] = (d0, d1, what, time.monotonic_ns())
        self._mine[ENTERED] = seq            # published by the heartbeats of a wait
        if self.watch is None:                 # only the deadline to watch
            wait = Wait(wait.deadline, seq, what, None, self.rank)
        else:
            self.check_peers(seq, what)        # a peer that left or died: no exchange
        rows = self._gather([seq, what, d0, d1], np.int64, wait)
        if self.watch is not None:
            self._entered(seq, rows)
            self.check_peers(seq, what)        # they may have given up after it
        closed = [r for r in range(self.size) if rows[r, 1] == CLOSE]
        if closed:
            r = closed[0]
            counts = {q: int(rows[q, 0]) - (1 if rows[q, 1] == CLOSE else 0)
                      for q in range(self.size)}
            culprits = uneven_culprits(counts)
            raise PeerError("%s: %s closed the communicator after collective #%d while "
                            "this rank is in %s; uneven number of steps: %s (every rank must "
                            "call the same collectives)"
                            % (self.name(self.rank), self.name(r), rows[r, 0] - 1, fingerprints.label(what, seq),
                               steps_text(counts, culprits, self.rank)),
                            culprits=culprits)
        if error is None and (rows[:, 2:] == rows[self.rank, 2:]).all():
            return
        text = ("ERROR " + str(error)) if error is not None else describe()
        raw = np.zeros(TEXT_BYTES, np.uint8)
        data = text.encode("utf-8", "replace")[:TEXT_BYTES - 1]
        raw[:len(data)] = np.frombuffer(data, np.uint8)
        texts = self._gather(raw, np.uint8, wait)
        table = [(tuple(rows[r, 2:]), bytes(texts[r]).split(b"\0", 1)[0].decode(
            "utf-8", "replace")) for r in range(self.size)]
        failure = fingerprints.disagreement(self.rank, seq, what, table,
                                           error_digest=ERROR_DIGEST, world=self.world)
        if error is not None:
            raise error
        raise failure

    def settled_counts(self, mine, leaving, wait_s=SETTLE_S):
        """As :meth:`StatusBoard.settled_counts
        <commlib.faults.board.StatusBoard.settled_counts>`, this rank's line
        published first: a rank that saw a peer gone as it entered a
        collective has sent no heartbeat there, so its count has not
        travelled, and the peers settling at the same moment would each
        wait :data:`~commlib.faults.board.SETTLE_S` for the others' counts,
        then blame themselves with the culprit (a tie of two counts)."""
        self._publish()
        return super().settled_counts(mine, leaving, wait_s)

    def _entered(self, seq, rows):
        """Every rank's fingerprint came: each entered collective ``seq``
        (the copy says so before their lines do, when it completed at
        once), at about this time."""
        behind = self._lines[:, ENTERED] < seq
        behind[self.rank] = False
        if behind.any():
            at = SLOT + (seq & 1) * SLOT_WORDS
            slots = np.empty((self.size, SLOT_WORDS), np.int64)
            slots[:, 0:2], slots[:, 2], slots[:, 3] = rows[:, 2:4], rows[:, 1], \
                time.monotonic_ns()
            self._lines[behind, at:at + SLOT_WORDS] = slots[behind]
            self._lines[behind, ENTERED] = seq

    def arrive(self, seq):
        """Note that this rank entered collective ``seq`` (the consistency
        check is off); its peers learn it from its heartbeats, once it waits."""
        self._mine[ENTERED] = seq

    def check_waiting(self, wait, late=None):
        """As :meth:`StatusBoard.check_waiting
        <commlib.faults.board.StatusBoard.check_waiting>`, after sending
        this rank's line (at most every :data:`~commlib.faults.peer_watch.BEAT_S`
        seconds): the peers learn what it entered and that it still waits.
        A collective that completes within a few milliseconds sends nothing."""
        if self.watch is not None:
            self._mine[SEEN_SEQ], self._mine[SEEN] = wait.seq, time.monotonic_ns()
            self.watch.beat()
        super().check_waiting(wait, late)

    def check_peers(self, seq, what, ranks=None):
        """As :meth:`StatusBoard.check_peers <commlib.faults.board.StatusBoard.check_peers>`;
        nothing to watch without a watch."""
        if self.watch is None:
            return
        gone = self._lines[:, GONE]
        if not self.watch.anyone_dead() and not ((gone > 0) & (gone <= seq)).any():
            return                             # the usual case, in one look
        for r in range(self.size) if ranks is None else ranks:
            # a death first: the peers that saw it too may have given up already
            if r != self.rank and self.died(r) and not self._lines[r, GONE]:
                raise self.give_up(seq, what, PeerError, "%s died while this rank waits in %s"
                                   % (self.who(r), fingerprints.label(what, seq)), (r,))
        super().check_peers(seq, what, ranks)

    def died(self, r):
        """Whether rank ``r``'s connection ended without a goodbye."""
        return self.watch is not None and self.watch.dead(r)

    def who(self, r):
        return self.watch.who(r, self.name(r)) if self.watch is not None else self.name(r)

    def not_arrived(self, seq):
        return super().not_arrived(seq) if self.watch is not None else []

    def stalled(self, seq):
        return super().stalled(seq) if self.watch is not None else []

    def timeout_text(self, seq, what, late):
        if self.watch is not None:
            return super().timeout_text(seq, what, late)
        return ("%s did not complete before its deadline (which ranks had not arrived is not "
                "known across nodes without the ranks' connections)"
                % fingerprints.label(what, seq))

    def leave(self, completed, reason, text="", blame=()):
        """As :meth:`StatusBoard.leave <commlib.faults.board.StatusBoard.leave>`,
        and tell the peers; unless the rank is closing (:meth:`wait_left`
        follows), the watch closes too (it has nothing more to learn)."""
        super().leave(completed, reason, text, blame)
        self._publish()
        if reason not in (CLOSED, EXITED):     # nothing to wait for: no more to say
            self.close_watch()

    def close_watch(self):
        """Say goodbye to the peers and close the connections (the
        communicator is released; its line, left, was published before)."""
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.close()

    def wait_left(self, completed, deadline):
        """The closing: every rank must close after collective
        ``completed``; a rank that entered a collective instead makes this
        rank raise PeerError (and that rank too), naming the minority. With
        the watch, as :meth:`StatusBoard.wait_left
        <commlib.faults.board.StatusBoard.wait_left>` (a rank that died
        before closing is named too); without, one more exchange."""
        if self.watch is not None:
            try:
                return super().wait_left(completed, deadline)
            finally:
                self.close_watch()
        rows = self._gather([completed + 1, CLOSE, 0, 0], np.int64,
                            Wait(deadline, completed + 1, 0, None, self.rank))
        busy = [r for r in range(self.size) if rows[r, 1] != CLOSE]
        if busy:
            r = busy[0]
            # every rank's count is known: closers after ``completed``, the
            # others in the collective they entered
            counts = {q: completed if rows[q, 1] == CLOSE else int(rows[q, 0])
                      for q in range(self.size)}
            culprits = uneven_culprits(counts)
            raise PeerError("%s: this rank closed the communicator after collective #%d "
                            "but %s entered %s: uneven number of steps: %s (every rank "
                            "must call the same collectives)"
                            % (self.name(self.rank), completed, self.name(r), fingerprints.label(int(rows[r, 1]),
                                                                          int(rows[r, 0])),
                               steps_text(counts, culprits, self.rank)),
                            culprits=culprits)
