"""The interface every transport implements.

All buffers are 1-D, C-contiguous arrays of one supported dtype. ``op`` is
one of ``"sum"``, ``"max"``, ``"min"``, ``"prod"`` (averaging is done above,
by scaling). ``deadline`` is an absolute ``time.monotonic()`` value or None
(wait forever); a collective that misses it raises
:class:`~commlib.errors.CollectiveTimeoutError` and leaves the transport
unusable.
"""
import time

from ..errors import ClosedError, CollectiveTimeoutError


class Transport:
    """Base class: rank/size bookkeeping, deadline polling, closing."""

    name = "?"

    def __init__(self, rank, size):
        self.rank = rank
        self.size = size
        self._broken = None

    # -- collectives (in place unless a recv buffer is given) ---------------
    def all_reduce(self, buf, op, deadline=None, fmt=None):
        """Reduce ``buf`` in place over all ranks. ``fmt="bfloat16"``: ``buf``
        is uint16 holding bfloat16 bit patterns (cupy has no bfloat16 dtype)."""
        raise NotImplementedError

    def all_reduce_staged(self, buf, op, scale, pack, unpack, deadline=None, parts=None):
        """All-reduce a fused bucket: ``pack()`` fills ``buf`` (the bucket's
        1-D buffer) from the arrays, ``unpack(scale)`` copies ``buf`` back
        into them times ``scale`` (float or None).

        ``parts``, when given, is the tuple of numpy arrays whose
        concatenation the bucket is. This default packs, all-reduces ``buf``
        and unpacks (the scale fused into the unpack); a transport that
        reduces in its own memory (a shared-memory window) may instead copy
        the parts there and back, never touching ``buf``.
        """
        pack()
        self.all_reduce(buf, op, deadline)
        unpack(scale)

    def broadcast(self, buf, root, deadline=None):
        raise NotImplementedError

    def reduce(self, buf, root, op, deadline=None):
        """Reduce into ``buf`` on ``root``; other ranks' ``buf`` is unchanged."""
        raise NotImplementedError

    def all_gather(self, sendbuf, recvbuf, deadline=None):
        """``recvbuf`` (size * len(sendbuf)) receives every rank's sendbuf in rank order."""
        raise NotImplementedError

    def all_gatherv(self, sendbuf, recvbuf, counts, deadline=None):
        """Like all_gather with ``counts[r]`` elements from rank r."""
        raise NotImplementedError

    def reduce_scatter(self, sendbuf, recvbuf, op, deadline=None):
        """``recvbuf`` gets this rank's len(sendbuf)/size block of the reduction."""
        raise NotImplementedError

    def barrier(self, deadline=None):
        raise NotImplementedError

    def close(self):
        self._broken = "closed"

    # -- helpers -------------------------------------------------------------
    def check_usable(self):
        if self._broken is not None:
            raise ClosedError("%s transport of rank %d is unusable: %s"
                              % (self.name, self.rank, self._broken))

    def poll_until(self, done, deadline, what, on_timeout=None, spin=False):
        """Call ``done()`` until it returns True or ``deadline`` passes.

        ``spin=True`` polls back to back (for transports that only make
        progress inside the poll, like MPI's shared-memory path); otherwise
        sleeps with a backoff capped at 1 ms between polls. On timeout marks
        the transport broken, calls ``on_timeout()`` and raises.
        """
        pause = 0.0
        while not done():
            if time.monotonic() >= deadline:
                self._broken = "%s timed out" % what
                if on_timeout is not None:
                    on_timeout()
                raise CollectiveTimeoutError(
                    "rank %d: %s did not complete before its deadline; a peer may have "
                    "died, hung, or not called it (the communicator is now unusable)"
                    % (self.rank, what))
            if spin:
                continue
            if pause:
                time.sleep(pause)
            pause = min(1e-3, pause * 2 or 1e-6)
