"""The interface every transport implements.

All buffers are 1-D, C-contiguous arrays of one supported dtype. ``op`` is
one of ``"sum"``, ``"max"``, ``"min"``, ``"prod"`` (averaging is done above,
by scaling). ``wait`` is a :class:`commlib.core.waiting.Wait` (the collective's
deadline and the peers to watch; :data:`commlib.core.waiting.FOREVER` by
default). A collective that fails (deadline, a peer left, the library
reported an error, an interrupt) raises and leaves the transport unusable;
it never writes into a caller's buffer after raising.

Buffers a collective writes into are the caller's arrays (``all_reduce``,
``broadcast``, ``reduce``) unless ``owned=True`` says they are commlib's
own memory that nobody reads after a failure; a transport whose
collectives can outlive a failure (MPI's non-blocking calls) reduces the
caller's arrays in its own staging memory and copies the result out only on
success. Receive buffers of ``all_gather``, ``all_gatherv``,
``reduce_scatter``, ``send_recv`` and ``all_to_allv`` are always commlib's
own.

Point-to-point messages (:meth:`Transport.send_recv`) carry a ``tag``: a
receive takes the oldest message from its peer with its tag, so messages
of one tag between two ranks arrive in the order they were sent, and the
tags keep the communicator's own messages (:data:`TAG_SEND_HEADER`,
:data:`TAG_RECV_HEADER`, :data:`TAG_COLLECTIVE`) apart from the data of
the caller's sends (:data:`TAG_DATA`).
"""
import numpy as np

from ..errors import ClosedError
from ..core.waiting import FOREVER

#: tags of point-to-point messages: the caller's data, the headers that
#: describe a send and a receive to the peer, and the messages of the
#: collectives built from them (all_to_allv, scatter, gather)
TAG_DATA, TAG_SEND_HEADER, TAG_RECV_HEADER, TAG_COLLECTIVE = 1, 2, 3, 4


def offsets(counts):
    """Start of each block of ``counts`` elements laid end to end."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64).tolist() \
        if len(counts) else []


def scale_in_place(buf, scale):
    """``buf *= scale`` unless ``scale`` is None (the rounding of every
    transport's ``all_reduce(..., scale=)``)."""
    if scale is not None:
        buf *= scale


class Transport:
    """Base class: rank/size bookkeeping, the unusable state, closing."""

    name = "?"

    def __init__(self, rank, size):
        self.rank = rank
        self.size = size
        self._broken = None

    # -- collectives (in place unless a recv buffer is given) ---------------
    def all_reduce(self, buf, op, wait=FOREVER, fmt=None, owned=False, scale=None, defer=None):
        """Reduce ``buf`` in place over all ranks, then multiply it by
        ``scale`` (a float, or None: no scaling; floating ``buf`` without
        ``fmt`` only). ``fmt="bfloat16"``: ``buf`` is uint16 holding bfloat16
        bit patterns (cupy has no bfloat16 dtype). ``defer``: None, or the
        collective's :class:`commlib.progress.inflight.InFlight`, given only to a
        transport whose :meth:`defers` says so: it starts its requests,
        hands them and the work left for after them to ``defer`` and returns
        without waiting."""
        raise NotImplementedError

    def defers(self, buf):
        """Whether :meth:`all_reduce` of a buffer like ``buf`` can leave its
        requests in flight (``defer=``)."""
        return False

    def reduces_parts(self, buf):
        """Whether :meth:`all_reduce_parts` takes a fused bucket like ``buf``
        (its 1-D buffer); the caller packs and unpacks otherwise."""
        return False

    def all_reduce_parts(self, parts, buf, op, scale, wait=FOREVER):
        """All-reduce, in place, the concatenation of ``parts`` (the arrays
        of a fused bucket, whose packed form would be ``buf``) times
        ``scale`` (float or None), reading and writing the arrays where they
        lie. Only where :meth:`reduces_parts` says so."""
        raise NotImplementedError

    def casts(self, parts):
        """Whether :meth:`all_reduce_cast` takes the float32 arrays
        ``parts`` (the default: never; the caller then casts into a wire of
        its own and calls :meth:`all_reduce`). The answer depends only on
        what every rank has alike (the arrays' kind, dtype and sizes)."""
        return False

    def all_reduce_cast(self, parts, fmt, op, scale, guarded, wait=FOREVER):
        """All-reduce the float32 arrays ``parts`` in the half format ``fmt``
        (``"float16"`` or ``"bfloat16"``), casting on the way: each rank's
        values times ``scale`` (float or None) rounded to ``fmt``, reduced
        with ``op`` in that format (as :meth:`all_reduce` reduces a wire of
        it), and cast back into ``parts`` unless ``guarded`` and the result
        holds NaN or inf (then nothing is written). Only where
        :meth:`casts` says so. Returns ``(sent, found)``: the NaN and inf
        this rank sent and those in the reduced result."""
        raise NotImplementedError

    def broadcast(self, buf, root, wait=FOREVER, owned=False):
        raise NotImplementedError

    def reduce(self, buf, root, op, wait=FOREVER, owned=False):
        """Reduce into ``buf`` on ``root``; other ranks' ``buf`` is unchanged."""
        raise NotImplementedError

    def all_gather(self, sendbuf, recvbuf, wait=FOREVER):
        """``recvbuf`` (size * len(sendbuf)) receives every rank's sendbuf in rank order."""
        raise NotImplementedError

    def all_gatherv(self, sendbuf, recvbuf, counts, wait=FOREVER):
        """Like all_gather with ``counts[r]`` elements from rank r."""
        raise NotImplementedError

    def reduce_scatter(self, sendbuf, recvbuf, op, wait=FOREVER):
        """``recvbuf`` gets this rank's len(sendbuf)/size block of the reduction."""
        raise NotImplementedError

    def barrier(self, wait=FOREVER):
        raise NotImplementedError

    def send_recv(self, ops, wait=FOREVER):
        """Issue every message of ``ops`` together and wait until all
        completed: a list of ``(kind, buf, peer, tag)``, ``kind`` being
        ``"send"`` (``buf`` goes to rank ``peer``) or ``"recv"`` (``buf``,
        commlib's own, receives the oldest message of ``tag`` from
        ``peer``, which must have its size and dtype). A send may complete
        before its receive is posted (buffered), as MPI's standard mode."""
        raise NotImplementedError

    def all_to_allv(self, sendbuf, sendcounts, recvbuf, recvcounts, wait=FOREVER):
        """Block r of ``sendbuf`` (``sendcounts[r]`` elements, blocks end to
        end) goes to rank r; ``recvbuf`` (commlib's own) receives rank r's
        block for this rank, ``recvcounts[r]`` elements, in rank order.
        Every rank's ``sendcounts[r]`` must be rank r's ``recvcounts`` of
        it. The default: this rank's own block copied, the others as
        messages of :meth:`send_recv` (none for an empty block)."""
        sends, recvs = offsets(sendcounts), offsets(recvcounts)
        ops = []
        for r in range(self.size):
            if r == self.rank:
                continue
            if sendcounts[r]:
                ops.append(("send", sendbuf[sends[r]:sends[r] + sendcounts[r]], r,
                            TAG_COLLECTIVE))
            if recvcounts[r]:
                ops.append(("recv", recvbuf[recvs[r]:recvs[r] + recvcounts[r]], r,
                            TAG_COLLECTIVE))
        if ops:
            self.send_recv(ops, wait)
        else:
            self.check_usable()
        mine = self.rank
        recvbuf[recvs[mine]:recvs[mine] + recvcounts[mine]] = \
            sendbuf[sends[mine]:sends[mine] + sendcounts[mine]]

    def split(self, color, key, table, wait=FOREVER):
        """What a communicator of the ranks of ``color`` is made from
        (collective over every rank of this transport, each passing the
        agreed ``table``: per rank its ``(color, key)``; ``color`` None: in
        none): a transport's own answer, which
        :meth:`commlib.Communicator.split` turns into a communicator, or
        None where the transport cannot split (the default)."""
        return None

    def thread_safe(self):
        """Whether collectives may run on another thread than the one that
        made the transport (a progress thread); else asynchronous
        collectives run when waited for."""
        return True

    def close(self):
        """Release this rank's resources without waiting for the others."""
        self._broken = self._broken or "closed"

    # -- helpers -------------------------------------------------------------
    @property
    def broken(self):
        """Why the transport is unusable (a text), or None while it is usable."""
        return self._broken

    def check_usable(self):
        if self._broken is not None:
            raise ClosedError("rank %d: the %s transport is unusable: %s"
                              % (self.rank, self.name, self._broken))

    def fail(self, reason):
        """Mark the transport unusable (a collective failed: ``reason``)."""
        if self._broken is None:
            self._broken = reason
