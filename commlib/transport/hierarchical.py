"""The hierarchical transport: all-reduce over shared memory within each
node and over MPI only between ranks of different nodes.

For a job of several nodes with the same number ``L > 1`` of ranks each,
an all-reduce of a numpy buffer of at least
:data:`~commlib.transport.shm.MIN_BYTES` goes, one window (16 MiB, or
2 MiB where the node's shared memory lacks room: :data:`WINDOWS`) after
the other, in three steps:

1. reduce-scatter within the node (shared memory): each rank copies the
   window into its slot, the node's ranks synchronise, and local rank ``r``
   reduces elements ``[r*N//L, (r+1)*N//L)`` of every slot, in local rank
   order, into the node's result region (its *share*);
2. all-reduce of the share across nodes: among the ranks of the same local
   rank (one per node, an MPI communicator split by local rank, ordered by
   world rank), MPI's ``Iallreduce`` of a private copy of the share, copied
   back into the result region (times ``scale``) once it completed;
3. all-gather within the node: the ranks synchronise again and every rank
   copies the whole result region into its buffer.

Each element is therefore ``op`` of the nodes' partial results, each of
which is its node's ranks reduced in local rank order; the order in which
MPI combines the nodes' partial results is MPI's. Every rank copies the
same bytes out of its node's result region, and MPI gives the ranks of
one local rank the same bytes (MPICH's all-reduce algorithms do), so every
rank of the job gets a bit-identical result, run after run. It is not in general bit-identical
to the flat path (one ``MPI_Allreduce`` over every rank), whose order of
summation is MPICH's own: for floating-point sums the two may differ in
the last bits (integers, max and min are exact either way). At 2 nodes
of 2 ranks both compute ``(x0 + x1) + (x2 + x3)`` and agreed bit for bit
where compared (MPICH 4, float32 and float64 sums), which is MPICH's
choice of algorithm, not a promise. float16 and
bfloat16 (``fmt="bfloat16"``) round every step to their format, as the
other transports do.

Only its ``L``-th share of every window leaves a rank for other nodes, so
a node sends, per all-reduce, what MPI's all-reduce among the nodes sends
for one buffer: at two nodes the buffer once each way, the least any
all-reduce can (benchmarks/README.md, ``hierarchical.py``).

Everything else -- smaller buffers, cupy arrays, the other collectives --
goes through ``fallback``, the MPI transport over every rank.

Failures: both waits within the node and the MPI exchange take the
collective's :class:`~commlib.core.waiting.Wait`; the caller's buffer is
written only after the second synchronisation, which no rank passes
before every rank of its node finished its exchange, so a failed
all-reduce leaves it untouched. The exchange runs on the transport's own
memory, never the shared segment's, so a request given up on (kept alive
inside MPI, :data:`commlib.transport.mpi.ABANDONED`) never touches memory
that is unmapped later. A rank that fails or comes late leaves its
node's peers waiting until the deadline, then raising
:class:`~commlib.errors.CollectiveTimeoutError` that names it (by world
rank) as not arrived; ranks of other nodes, waiting in MPI, name no one.
"""
import numpy as np

from .mpi import MpiTransport
from .shm import WINDOW_BYTES, SharedMemoryTransport


#: window sizes (bytes) in order of preference: each window makes one
#: exchange across nodes per rank, whose latency larger windows amortise
#: (ResNet-50's gradients at 2 nodes x 2 ranks over 1 Gbit/s: 3.1 s per
#: all-reduce with 2 MiB windows, 1.8 s with 16 MiB; benchmarks/README.md);
#: the smaller where the node's shared memory (``(L + 1)`` windows) has no room
WINDOWS = (16 << 20, WINDOW_BYTES)


class HierarchicalTransport(SharedMemoryTransport):
    """All-reduces of numpy buffers of at least
    :data:`~commlib.transport.shm.MIN_BYTES` within the node through
    shared memory and across nodes through MPI, the rest through
    ``fallback`` (the MPI transport over every rank).

    ``node``: the mpi4py communicator of this node's ranks (all the job's
    nodes have as many); ``across``: the mpi4py communicator of the ranks
    with this rank's local rank, one per node, in world rank order;
    ``memory``: a zero-filled uint8 numpy array of
    :meth:`bytes_needed` ``(len(node), window_bytes)`` bytes shared by the
    node's ranks; ``window_bytes``: bytes reduced per round (one of
    :data:`WINDOWS`).
    The transport owns both communicators and frees them on :meth:`close`.
    The constructor is collective over ``node`` (the store probe).
    """

    name = "hierarchical"

    def __init__(self, fallback, node, across, memory, stores="auto",
                 window_bytes=WINDOWS[0]):
        super().__init__(fallback, memory, stores, node=node, window_bytes=window_bytes,
                         result_bytes=None)
        self.node = node
        self.across = MpiTransport(across, chunk_bytes=window_bytes)
        self.across.rank = fallback.rank     # its errors name this rank by its world rank
        self._private = None                 # the share's copy that MPI reduces

    @staticmethod
    def bytes_needed(size, window_bytes=WINDOWS[0]):
        """Bytes of shared memory for ``size`` ranks and windows of
        ``window_bytes`` (a result region of one window: nothing is cast
        on the way here)."""
        return SharedMemoryTransport.bytes_needed(size, window_bytes, None)

    def casts(self, parts):
        """Never: the caller casts into a wire (cast on the way is within a node only)."""
        return False

    def _share_copy(self, share):
        """This transport's private buffer as an array like ``share``."""
        if self._private is None or self._private.nbytes < share.nbytes:
            self._private = np.empty(self.reducer.capacity_bytes, np.uint8)
        return self._private[:share.nbytes].view(share.dtype)

    def _steps(self, op, scale, wait, fmt=None):
        """No scale for the reducer, and between its synchronisations this
        rank's share of each window all-reduced across nodes (and scaled):
        reduce-scatter within the node, the share across nodes, all-gather
        within the node."""

        def across_nodes(share):
            private = self._share_copy(share)
            private[...] = share
            self.across.all_reduce(private, op, wait, fmt, owned=True, scale=scale)
            share[...] = private

        return None, across_nodes

    def check_usable(self):
        super().check_usable()
        self.across.check_usable()

    def close(self):
        """Drop the shared memory's views, free the node's and the
        across-nodes communicators (local)."""
        self.across.close()
        node, self.node = self.node, None
        if node is not None:
            try:
                node.Free()
            except Exception:
                pass
        super().close()


def usable(local_sizes):
    """Whether a job whose nodes hold ``local_sizes`` ranks each (every
    rank's ``local_size``) takes the hierarchical transport: more than one
    node, more than one rank on each, the same number on every node."""
    sizes = set(local_sizes)
    return len(sizes) == 1 and 1 < sizes.pop() < len(local_sizes)

