"""Intra-node all-reduce through one MPI shared-memory window.

When every rank of a communicator lives on one node, :class:`SharedMemoryReducer`
all-reduces a numpy buffer of at most ``capacity_bytes`` without MPI's
message path: each rank copies its buffer into its own slot of the window,
the ranks synchronise, rank r reduces elements ``[r*N//n, (r+1)*N//n)`` of
all slots (in rank order) into a shared result region, the ranks synchronise
again, and every rank copies the whole result region out. Every rank reads
the same result bytes, so results are bit-identical across ranks, and each
element is ``op(...op(op(x0, x1), x2)..., x(n-1))`` in rank order, computed
with the numpy ufunc in the buffer's dtype (deterministic from run to run).

Reuse needs no extra synchronisation: a rank starts writing its slot for
call k+1 only after the second synchronisation of call k, when every reduction
that reads the slots is done; and the result region of call k+1 is written
only after the first synchronisation of call k+1, which every rank reaches
only once it has copied out the result of call k.

:meth:`SharedMemoryReducer.all_reduce_staged` lets the caller pack its
arrays straight into the slot and unpack them straight from the result, so a
fused bucket is copied once each way, not twice.

Synchronisation (``sync``): ``"flags"`` spins on one monotonically increasing
sequence number per rank in the window (x86-64 only, where stores become
visible in program order); ``"barrier"`` is ``MPI_Barrier`` on the node
communicator. ``"auto"`` picks flags on x86-64. With a ``deadline`` the
waits give up with :class:`~commlib.errors.CollectiveTimeoutError` (the watch
dog), as MPI's path does.
"""
import os
import platform
import time

import numpy as np

from ..errors import ArgumentError, ArrayTypeError, CollectiveTimeoutError

_UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8")
_LINE = 64                # bytes between two ranks' sequence numbers
_ALIGN = 4096             # alignment of slots and the result region, bytes
_SPINS = 2000             # polls before each poll also yields the CPU


_supported_cache = {}


def _supported(dtype):
    """Whether ``dtype`` is reduced here (cached: ``dtype.name`` is slow)."""
    found = _supported_cache.get(dtype)
    if found is None:
        found = _supported_cache[dtype] = dtype.name in _DTYPES
    return found


def _round_up(x, to):
    return (x + to - 1) // to * to


class SharedMemoryReducer:
    """All-reduce of numpy buffers up to ``capacity_bytes`` over ``comm`` (an
    mpi4py communicator whose ranks share one node).

    The constructor is collective over ``comm``. If the ranks span several
    nodes, :attr:`usable` is False and :meth:`all_reduce` always returns
    False. Memory: ``(size + 1) * capacity_bytes`` bytes of shared memory.
    """

    def __init__(self, comm, capacity_bytes=4 << 20, sync="auto"):
        from .mpi import mpi
        MPI = mpi()
        if int(capacity_bytes) <= 0:
            raise ArgumentError("commlib: capacity_bytes must be positive, got %r"
                                % (capacity_bytes,))
        if sync not in ("auto", "flags", "barrier"):
            raise ArgumentError("commlib: sync must be 'auto', 'flags' or 'barrier', got %r"
                                % (sync,))
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        if sync == "auto":
            sync = "flags" if x86 else "barrier"
        if sync == "flags" and not x86:
            raise ArgumentError("commlib: sync='flags' needs x86-64 memory ordering")
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.capacity_bytes = _round_up(int(capacity_bytes), _ALIGN)
        self.sync = sync
        self._node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.usable = self._node.Get_size() == self.size
        self._win = None
        self._views = {}          # dtype -> (slots, result), arrays of that dtype
        self._seq = 0
        if not self.usable or self.size == 1:
            return
        control = _round_up(self.size * _LINE, _ALIGN)
        total = control + (self.size + 1) * self.capacity_bytes
        self._win = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1,
                                            comm=self._node)
        memory, _ = self._win.Shared_query(0)
        self._mem = np.frombuffer(memory, dtype=np.uint8, count=total)
        self._slots_at = [control + r * self.capacity_bytes for r in range(self.size)]
        self._result_at = control + self.size * self.capacity_bytes
        self._flags = memoryview(self._mem[:control]).cast("q")
        if self.rank == 0:
            self._mem[:control] = 0
        self._node.Barrier()

    # -- synchronisation ---------------------------------------------------------
    def _wait_all(self, seq, deadline):
        """Publish this rank's sequence number ``seq`` and wait until every
        rank has published at least ``seq``, or raise
        CollectiveTimeoutError once ``deadline`` (``time.monotonic()``
        value, or None) has passed."""
        if self.sync == "barrier":
            if deadline is None:
                self._node.Barrier()
                return
            request = self._node.Ibarrier()
            while not request.Test():
                self._check_deadline(deadline)
            return
        flags, stride = self._flags, _LINE // 8
        flags[self.rank * stride] = seq
        for r in range(self.size):
            if r == self.rank:
                continue
            i, polls = r * stride, 0
            while flags[i] < seq:
                polls += 1
                if polls > _SPINS:
                    os.sched_yield()
                    if deadline is not None:
                        self._check_deadline(deadline)

    def _check_deadline(self, deadline):
        if time.monotonic() >= deadline:
            raise CollectiveTimeoutError(
                "rank %d: all_reduce did not complete before its deadline; a peer may "
                "have died, hung, or not called it" % self.rank)

    def _views_for(self, dtype):
        found = self._views.get(dtype)
        if found is None:
            count = self.capacity_bytes // dtype.itemsize
            mem = self._mem
            slots = [mem[at:at + count * dtype.itemsize].view(dtype) for at in self._slots_at]
            at = self._result_at
            found = self._views[dtype] = (slots, mem[at:at + count * dtype.itemsize].view(dtype))
        return found

    # -- the collective ----------------------------------------------------------
    def all_reduce(self, buf, op, deadline=None):
        """Reduce ``buf`` (1-D C-contiguous writeable numpy array) with ``op``
        (``"sum"``, ``"max"``, ``"min"``, ``"prod"``) over all ranks, in place.

        Returns True when done, False (``buf`` untouched, no communication)
        when this reducer cannot take the call: not usable, not a numpy
        array, unsupported dtype or more than ``capacity_bytes`` bytes. Every
        rank must pass the same dtype and length, so all ranks agree.
        """
        if type(buf) is not np.ndarray:
            return False
        if buf.ndim != 1 or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ArrayTypeError("commlib: all_reduce needs a 1-D C-contiguous writeable array")

        def pack(dst):
            dst[...] = buf

        def unpack(src, scale):
            buf[...] = src

        return self.all_reduce_staged(buf.size, buf.dtype, op, None, pack, unpack, deadline)

    def all_reduce_staged(self, count, dtype, op, scale, pack, unpack, deadline=None):
        """All-reduce ``count`` elements of ``dtype`` that ``pack(slot)``
        writes into this rank's slot (a 1-D numpy view); ``unpack(result,
        None)`` then reads the result, already multiplied by ``scale`` (a view
        of shared memory: read it, don't keep it). Returns False, calling
        neither, when the reducer cannot take it (see all_reduce).
        """
        ufunc = _UFUNCS.get(op)
        if ufunc is None:
            raise ArgumentError("commlib: op must be one of %s, got %r" % (sorted(_UFUNCS), op))
        if (not self.usable or not _supported(dtype)
                or count * dtype.itemsize > self.capacity_bytes):
            return False
        if self.size == 1 or count == 0:
            slot = np.empty(count, dtype=dtype)
            pack(slot)
            unpack(slot, scale)
            return True
        if self._win is None:
            raise ArgumentError("commlib: the shared-memory reducer is closed")
        slots, result = self._views_for(dtype)
        n, rank = self.size, self.rank
        lo, hi = count * rank // n, count * (rank + 1) // n
        pack(slots[rank][:count])
        self._seq += 2
        self._wait_all(self._seq - 1, deadline)
        out = result[lo:hi]
        with np.errstate(all="ignore"):      # overflow to inf is silent, as in MPI
            ufunc(slots[0][lo:hi], slots[1][lo:hi], out=out)
            for r in range(2, n):
                ufunc(out, slots[r][lo:hi], out=out)
            if scale is not None:
                out *= scale
        self._wait_all(self._seq, deadline)
        unpack(result[:count], None)      # already scaled
        return True

    def close(self):
        """Free the window (collective over the communicator). Idempotent."""
        if self._win is not None:
            self._flags.release()
            self._views.clear()
            self._mem = None
            self._win.Free()
            self._win = None
        if self._node is not None:
            self._node.Free()
            self._node = None
