"""An in-process transport: N ranks as N threads of one process.

It exists to test the communicator's own logic (fusion, averaging, the
consistency check, compression bookkeeping, closing) quickly and without
``mpiexec``; the real transports keep their multi-process tests. Every
collective is a rendezvous of the N threads around a table of their
contributions (:class:`ThreadGroup`); results are computed with numpy in
rank order, as the other transports compute them. The group also holds the
memory of the ranks' status board.
"""
import collections
import threading

import numpy as np

from ..core import waiting
from ..errors import TransportError
from ..faults import board
from ..core.dtypes import UFUNCS
from ..ops import hostcast
from .base import Transport, scale_in_place


class Mailbox:
    """Point-to-point messages between the ranks of one process: a queue
    per ``(source, destination, tag)``; a send posts a copy at once, a
    receive takes the oldest (waiting through
    :func:`commlib.core.waiting.until`)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queues = collections.defaultdict(collections.deque)

    def post(self, key, data):
        with self._cond:
            self._queues[key].append(data)
            self._cond.notify_all()

    def take(self, key, wait, late=None):
        """The oldest message of ``key``, once there is one."""
        cond, queues = self._cond, self._queues

        def step(slice_s):
            with cond:
                if not queues[key] and slice_s:
                    cond.wait(slice_s)
                return queues[key].popleft() if queues[key] else None

        return waiting.until(step, wait, late=late)

    def exchange(self, rank, ops, wait):
        """:meth:`Transport.send_recv` of rank ``rank``'s ``ops``: every
        send posted, then every receive taken in order (a message of
        another size or dtype than its buffer raises TransportError)."""
        for kind, buf, peer, tag in ops:
            if kind == "send":
                self.post((rank, peer, tag), buf.copy())
        for kind, buf, peer, tag in ops:
            if kind == "recv":
                data = self.take((peer, rank, tag), wait, late=lambda: [peer])
                if data.dtype != buf.dtype or data.size != buf.size:
                    raise TransportError(
                        "rank %d: a message of %d %s from rank %d does not fit a receive "
                        "buffer of %d %s" % (rank, data.size, data.dtype, peer, buf.size,
                                             buf.dtype))
                buf[...] = data


class ThreadGroup:
    """``size`` ranks, one thread each, of one process."""

    def __init__(self, size):
        self.size = size
        #: memory of the ranks' status board (zero-filled)
        self.board_memory = np.zeros(size * board.LINE_BYTES, np.uint8)
        self._table = [None] * size
        self._cond = threading.Condition()
        self._arrived = 0          # ranks waiting at the current meeting
        self._meetings = 0         # meetings completed
        #: the point-to-point messages between the ranks
        self.mail = Mailbox()

    def exchange(self, rank, value, wait):
        """Every rank's ``value``, as a list by rank (a rendezvous of all
        ranks; gives up at ``wait``'s deadline, or when a peer left)."""
        self._table[rank] = value
        self._meet(wait)
        values = list(self._table)
        self._meet(wait)          # nobody writes the table before everyone read it
        return values

    def _meet(self, wait):
        """Wait until every rank has come to this meeting, through
        :func:`commlib.core.waiting.until` (the deadline and the status
        board end it); a rank that gives up withdraws."""
        cond = self._cond
        with cond:
            meeting = self._meetings
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived, self._meetings = 0, meeting + 1
                cond.notify_all()
                return

        def step(slice_s):
            with cond:
                if self._meetings == meeting and slice_s:
                    cond.wait(slice_s)
                return True if self._meetings != meeting else None

        try:
            waiting.until(step, wait)
        except BaseException:
            with cond:
                if self._meetings == meeting:
                    self._arrived -= 1
            raise


def _reduce(values, op, fmt=None):
    """``op`` over ``values`` in rank order; 16-bit floats (float16,
    bfloat16, or uint16 bit patterns with ``fmt="bfloat16"``) as the MPI
    transport's operators reduce them (:func:`commlib.ops.hostcast.reduce_into`)."""
    acc = values[0].copy()
    half = fmt is not None or acc.dtype.name in ("float16", "bfloat16")
    with np.errstate(all="ignore"):
        for value in values[1:]:
            if half:
                hostcast.reduce_into(value, acc, op)
            else:
                UFUNCS[op](acc, value, out=acc)
    return acc


class ThreadTransport(Transport):
    """Rank ``rank`` of ``group`` (numpy buffers)."""

    name = "threads"

    def __init__(self, group, rank):
        super().__init__(rank, group.size)
        self.group = group

    def _all(self, buf, wait):
        self.check_usable()
        return self.group.exchange(self.rank, np.array(buf, copy=True), wait)

    def all_reduce(self, buf, op, wait=waiting.FOREVER, fmt=None, owned=False, scale=None):
        buf[...] = _reduce(self._all(buf, wait), op, fmt)
        scale_in_place(buf, scale)

    def broadcast(self, buf, root, wait=waiting.FOREVER, owned=False):
        sent = self._all(buf, wait)[root]
        if self.rank != root:           # the root's buffer may be read-only
            buf[...] = sent

    def reduce(self, buf, root, op, wait=waiting.FOREVER, owned=False):
        result = _reduce(self._all(buf, wait), op)
        if self.rank == root:
            buf[...] = result

    def all_gather(self, sendbuf, recvbuf, wait=waiting.FOREVER):
        recvbuf[...] = np.concatenate(self._all(sendbuf, wait))

    def all_gatherv(self, sendbuf, recvbuf, counts, wait=waiting.FOREVER):
        recvbuf[...] = np.concatenate(self._all(sendbuf, wait))

    def reduce_scatter(self, sendbuf, recvbuf, op, wait=waiting.FOREVER):
        block = recvbuf.size
        recvbuf[...] = _reduce(self._all(sendbuf, wait), op)[self.rank * block:
                                                              (self.rank + 1) * block]

    def barrier(self, wait=waiting.FOREVER):
        self._all(np.zeros(0), wait)

    def send_recv(self, ops, wait=waiting.FOREVER):
        self.check_usable()
        self.group.mail.exchange(self.rank, ops, wait)

    def split(self, color, key, table, wait=waiting.FOREVER):
        """``(group, rank)``: a new :class:`ThreadGroup` of the ranks of
        ``color`` (made by the first of them and handed to the others) and
        this rank's place in it, ordered by ``(key, rank)``; None for no
        colour."""
        self.check_usable()
        members = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        made = ThreadGroup(len(members)) if color is not None and \
            members[0][1] == self.rank else None
        groups = self.group.exchange(self.rank, made, wait)
        if color is None:
            return None
        return groups[members[0][1]], [r for _, r in members].index(self.rank)
