"""The consistency check when the ranks share no memory (several nodes).

:class:`ExchangeBoard` offers the part of :class:`commlib.faults.board.StatusBoard`
that a collective exchange can give: before each collective the ranks
all-gather their fingerprints (four int64 per rank) over the transport, and
the texts of their calls only when the fingerprints differ. Closing is one
more exchange, so a rank that closes while another enters a collective
(uneven number of steps) makes both raise. What an exchange cannot give:
naming the ranks that have not arrived when a deadline passes, or noticing
a rank that left without closing before the deadline.
"""
import time

import numpy as np

from ..core import fingerprints
from .board import ERROR_DIGEST, TEXT_BYTES, steps_text, uneven_culprits
from ..errors import PeerError, rank_name
from ..core.waiting import Wait

#: the collective code a closing rank publishes
CLOSE = -1


class ExchangeBoard:
    """Fingerprint exchange over ``transport`` (any transport whose
    ``all_gather`` takes numpy buffers) between ``size`` ranks."""

    gone_words = (None, 1)
    warn_after = None
    #: as :attr:`StatusBoard.world <commlib.faults.board.StatusBoard.world>`
    world = None

    def __init__(self, transport, rank, size):
        self.transport, self.rank, self.size = transport, rank, size

    def _gather(self, values, dtype, seq, what, deadline):
        mine = np.asarray(values, dtype=dtype)
        out = np.empty(self.size * mine.size, dtype=dtype)
        self.transport.all_gather(mine, out, Wait(deadline, seq, what, None, self.rank))
        return out.reshape(self.size, -1)

    def enter(self, wait, digest, error=None, describe=None):
        """As :meth:`StatusBoard.enter <commlib.faults.board.StatusBoard.enter>`."""
        seq, what, deadline = wait.seq, wait.what, wait.deadline
        d0, d1 = ERROR_DIGEST if error is not None else digest
        rows = self._gather([seq, what, d0, d1], np.int64, seq, what, deadline)
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
        texts = self._gather(raw, np.uint8, seq, what, deadline)
        table = [(tuple(rows[r, 2:]), bytes(texts[r]).split(b"\0", 1)[0].decode(
            "utf-8", "replace")) for r in range(self.size)]
        failure = fingerprints.disagreement(self.rank, seq, what, table,
                                           error_digest=ERROR_DIGEST, world=self.world)
        if error is not None:
            raise error
        raise failure

    def arrive(self, seq):
        """The consistency check is off: nothing is exchanged (the ranks'
        arrival is not known across nodes)."""

    def check_peers(self, seq, what, ranks=None):
        """Nothing to watch without shared memory."""

    def check_waiting(self, wait, late=None):
        """Between the steps of a wait: raise CollectiveTimeoutError once
        ``wait``'s deadline passed (no peers to watch without shared
        memory)."""
        if wait.deadline is not None and time.monotonic() >= wait.deadline:
            raise wait.timeout(late)

    def timeout_text(self, seq, what, late):
        return ("%s did not complete before its deadline (which ranks had not arrived is not "
                "known across nodes)" % fingerprints.label(what, seq))

    def name(self, r):
        """As :meth:`StatusBoard.name <commlib.faults.board.StatusBoard.name>`."""
        return rank_name(r, self.world)

    def give_up(self, seq, what, kind, text, culprits):
        return kind("%s: %s" % (self.name(self.rank), text), culprits=culprits)

    def leave(self, completed, reason, text="", blame=()):
        """Nothing to publish without shared memory (closing exchanges); the
        signature is the status board's."""

    def wait_left(self, completed, deadline):
        """The closing exchange: every rank must close after collective
        ``completed``; a rank that entered a collective instead makes this
        rank raise PeerError (and that rank too)."""
        rows = self._gather([completed + 1, CLOSE, 0, 0], np.int64, completed + 1, 0, deadline)
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
