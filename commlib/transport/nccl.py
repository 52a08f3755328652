"""NCCL transport (cupy.cuda.nccl): cupy buffers on this rank's GPU; numpy
buffers are staged through device memory.

Collectives are enqueued on the current cupy stream and return without a
host synchronisation (stream order makes the result visible to later work on
that stream). With a deadline, the call records an event and polls it,
checking ``check_async_error()``; on timeout the NCCL communicator is
aborted so no rank stays blocked in a kernel.
"""
import contextlib

from ..bootstrap import _nccl
from ..ops._arrays import is_cupy
from .base import Transport

# ncclDataType_t and ncclRedOp_t values (stable across NCCL 2.x)
_DTYPES = {"uint8": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7,
           "float64": 8, "bfloat16": 9}
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}
_codes = {}     # numpy dtype -> ncclDataType_t (dtype.name is slow to compute)


def _code(dtype):
    found = _codes.get(dtype)
    if found is None:
        found = _codes[dtype] = _DTYPES[dtype.name]
    return found


class NcclTransport(Transport):
    """Collectives over a ``cupy.cuda.nccl.NcclCommunicator``.

    ``nccl_id`` is a :class:`~commlib.bootstrap.NcclId`; ``device`` the GPU
    ordinal this rank uses. Construction is collective: every rank must
    create its transport with the same ID.
    """

    name = "nccl"

    def __init__(self, nccl_id, rank, size, device):
        super().__init__(rank, size)
        import cupy
        self._cupy = cupy
        nccl = _nccl()
        self.device = int(device)
        with cupy.cuda.Device(self.device):
            try:
                self.comm = nccl.NcclCommunicator(size, nccl_id.for_cupy(), rank)
            except TypeError:       # CuPy versions that take the ID as bytes
                self.comm = nccl.NcclCommunicator(size, nccl_id.data, rank)

    @contextlib.contextmanager
    def _device(self, buf, writeback):
        """Yield a device buffer for ``buf``; copy results back after."""
        with self._cupy.cuda.Device(self.device):
            if is_cupy(buf):
                yield buf
                return
            dev = self._cupy.asarray(buf)
            yield dev
            if writeback:
                dev.get(out=buf)

    def _stream(self):
        return self._cupy.cuda.get_current_stream()

    def _finish(self, deadline, what):
        """Without a deadline return at once; with one, wait for the stream."""
        if deadline is None:
            return
        event = self._stream().record()
        self.poll_until(lambda: self._check() and event.done, deadline, what,
                        on_timeout=self.comm.abort)

    def _check(self):
        self.comm.check_async_error()
        return True

    # -- collectives ---------------------------------------------------------
    def all_reduce(self, buf, op, deadline=None, fmt=None):
        self.check_usable()
        with self._device(buf, True) as d:
            dtype = _code(d.dtype) if fmt is None else _DTYPES[fmt]
            self.comm.allReduce(d.data.ptr, d.data.ptr, d.size, dtype, _OPS[op],
                                self._stream().ptr)
            self._finish(deadline, "all_reduce")

    def broadcast(self, buf, root, deadline=None):
        self.check_usable()
        with self._device(buf, self.rank != root) as d:
            self.comm.broadcast(d.data.ptr, d.data.ptr, d.size, _code(d.dtype),
                                root, self._stream().ptr)
            self._finish(deadline, "broadcast")

    def reduce(self, buf, root, op, deadline=None):
        self.check_usable()
        with self._device(buf, self.rank == root) as d:
            self.comm.reduce(d.data.ptr, d.data.ptr, d.size, _code(d.dtype),
                             _OPS[op], root, self._stream().ptr)
            self._finish(deadline, "reduce")

    def all_gather(self, sendbuf, recvbuf, deadline=None):
        self.check_usable()
        with self._device(sendbuf, False) as s, self._device(recvbuf, True) as r:
            self.comm.allGather(s.data.ptr, r.data.ptr, s.size, _code(s.dtype),
                                self._stream().ptr)
            self._finish(deadline, "all_gather")

    def all_gatherv(self, sendbuf, recvbuf, counts, deadline=None):
        """Grouped broadcasts, one per rank (NCCL has no all-gather-v)."""
        self.check_usable()
        nccl = _nccl()
        with self._device(sendbuf, False) as s, self._device(recvbuf, True) as r:
            dtype, stream = _code(s.dtype), self._stream().ptr
            nccl.groupStart()
            offset = 0
            for root, count in enumerate(counts):
                count = int(count)
                if count:
                    src = s.data.ptr if root == self.rank else r.data.ptr
                    dst = r[offset:offset + count].data.ptr
                    self.comm.broadcast(src, dst, count, dtype, root, stream)
                offset += count
            nccl.groupEnd()
            self._finish(deadline, "all_gatherv")

    def reduce_scatter(self, sendbuf, recvbuf, op, deadline=None):
        self.check_usable()
        with self._device(sendbuf, False) as s, self._device(recvbuf, True) as r:
            self.comm.reduceScatter(s.data.ptr, r.data.ptr, r.size, _code(s.dtype),
                                    _OPS[op], self._stream().ptr)
            self._finish(deadline, "reduce_scatter")

    def barrier(self, deadline=None):
        """An all-reduce of one byte, waited for on the host."""
        self.check_usable()
        with self._cupy.cuda.Device(self.device):
            one = self._cupy.zeros(1, dtype=self._cupy.uint8)
            self.comm.allReduce(one.data.ptr, one.data.ptr, 1, _DTYPES["uint8"], _OPS["sum"],
                                self._stream().ptr)
            if deadline is None:
                self._stream().synchronize()
            else:
                self._finish(deadline, "barrier")

    def close(self):
        if self._broken is None:
            self.comm.destroy()
        super().close()
