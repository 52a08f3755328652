"""The transport of a communicator of one process, which needs no MPI: every
collective's result is this rank's own data (gathers copy it into the
receive buffer; everything else leaves the buffer as it is)."""
from ..core import waiting
from .base import Transport, scale_in_place
from .threads import Mailbox


class LocalTransport(Transport):
    """Collectives of a single rank (``size == 1``), numpy or cupy buffers."""

    name = "local"

    def __init__(self):
        super().__init__(0, 1)
        self._mail = Mailbox()

    def all_reduce(self, buf, op, wait=waiting.FOREVER, fmt=None, owned=False, scale=None):
        self.check_usable()
        scale_in_place(buf, scale)

    def broadcast(self, buf, root, wait=waiting.FOREVER, owned=False):
        self.check_usable()

    def reduce(self, buf, root, op, wait=waiting.FOREVER, owned=False):
        self.check_usable()

    def all_gather(self, sendbuf, recvbuf, wait=waiting.FOREVER):
        self.check_usable()
        recvbuf[...] = sendbuf

    def all_gatherv(self, sendbuf, recvbuf, counts, wait=waiting.FOREVER):
        self.check_usable()
        recvbuf[...] = sendbuf

    def reduce_scatter(self, sendbuf, recvbuf, op, wait=waiting.FOREVER):
        self.check_usable()
        recvbuf[...] = sendbuf

    def barrier(self, wait=waiting.FOREVER):
        self.check_usable()

    def send_recv(self, ops, wait=waiting.FOREVER):
        """Messages to this rank itself: a receive with no send before it
        waits until the deadline."""
        self.check_usable()
        self._mail.exchange(0, ops, wait)
