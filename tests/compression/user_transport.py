"""A transport written outside commlib, against its documented interface
only (commlib.transport.base.Transport): blocking mpi4py collectives on
numpy buffers (no deadline: the wait is not watched)."""
import numpy as np
from mpi4py import MPI

from commlib.transport.base import Transport, scale_in_place
from commlib.core.waiting import FOREVER

OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


class BlockingMpi(Transport):
    """Every collective one blocking MPI call over ``comm`` (an mpi4py
    communicator); results go through a buffer of its own first."""

    name = "user-mpi"

    def __init__(self, comm):
        super().__init__(comm.Get_rank(), comm.Get_size())
        self.comm = comm
        self.calls = 0

    def _count(self):
        self.check_usable()
        self.calls += 1

    def all_reduce(self, buf, op, wait=FOREVER, fmt=None, owned=False, scale=None):
        self._count()
        out = np.empty_like(buf)
        self.comm.Allreduce(buf, out, op=OPS[op])
        buf[...] = out
        scale_in_place(buf, scale)

    def broadcast(self, buf, root, wait=FOREVER, owned=False):
        self._count()
        out = buf.copy()
        self.comm.Bcast(out, root=root)
        buf[...] = out

    def reduce(self, buf, root, op, wait=FOREVER, owned=False):
        self._count()
        out = np.empty_like(buf)
        self.comm.Reduce(buf, out, op=OPS[op], root=root)
        if self.rank == root:
            buf[...] = out

    def all_gather(self, sendbuf, recvbuf, wait=FOREVER):
        self._count()
        self.comm.Allgather(sendbuf, recvbuf)

    def all_gatherv(self, sendbuf, recvbuf, counts, wait=FOREVER):
        self._count()
        self.comm.Allgatherv(sendbuf, [recvbuf, list(counts)])

    def reduce_scatter(self, sendbuf, recvbuf, op, wait=FOREVER):
        self._count()
        self.comm.Reduce_scatter_block(sendbuf, recvbuf, op=OPS[op])

    def barrier(self, wait=FOREVER):
        self._count()
        self.comm.Barrier()

    def close(self):
        super().close()
