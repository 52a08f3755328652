"""MPI transport (mpi4py): numpy buffers, and cupy buffers staged through host
memory unless the MPI library is CUDA-aware.

Without a deadline every collective is the plain blocking MPI call; with one
(the watch dog) it is the non-blocking form, polled with ``Test`` until done
or the deadline passes. Reductions of float16 and
bfloat16, which MPI lacks, use user-defined operators computed with numpy.
Large all-reduces are split into ``chunk_bytes`` pieces, which keeps each
piece cache-resident. When every rank is on one node, all-reduces of
numpy buffers of at least ``SHM_MIN_BYTES`` go through
:class:`~commlib.transport.shm.SharedMemoryReducer` (one shared window, two
synchronisations per ``SHM_WINDOW_BYTES`` piece) instead of MPI's message
path, and fused buckets are reduced there straight from their arrays.
"""
import os

import numpy as np

from ..errors import BackendUnavailableError, CollectiveTimeoutError
from ..ops._arrays import is_cupy
from ..ops.cast import numpy_cast_into
from .base import Transport

_MPI = None


def mpi():
    """The ``mpi4py.MPI`` module, imported on first use."""
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise BackendUnavailableError(
                "commlib: mpi4py is not installed; install commlib with the 'mpi' extra "
                "(pip install 'commlib[mpi]')") from exc
        _MPI = MPI
    return _MPI


#: set to 0 to keep single-node all-reduces on MPI's own path
ENV_SHM = "COMMLIB_SHM"
#: stores into the shared-memory window: auto (measured), plain or streaming
ENV_SHM_STORES = "COMMLIB_SHM_STORES"
#: smallest all-reduce (bytes) sent through the shared-memory reducer; below
#: it MPI's latency is lower (benchmarks/allreduce.py)
SHM_MIN_BYTES = 64 << 10
#: bytes reduced per round in the shared-memory reducer (its slot size):
#: pieces of 1-2 MiB stay cache-resident and were fastest from 4 to 64 MiB
SHM_WINDOW_BYTES = 2 << 20

_NATIVE = {"float32": "FLOAT", "float64": "DOUBLE", "int32": "INT32_T",
           "int64": "INT64_T", "uint8": "UINT8_T"}
_NATIVE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "prod": "PROD"}
_UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
_NAMES = {"Allreduce": "all_reduce", "Bcast": "broadcast", "Reduce": "reduce",
          "Allgather": "all_gather", "Allgatherv": "all_gatherv",
          "Reduce_scatter_block": "reduce_scatter", "Barrier": "barrier"}
_types = {}     # numpy dtype -> MPI datatype
_ops = {}       # (numpy dtype, op name) -> MPI.Op


def _user_op(dtype, op, fmt=None):
    """An MPI.Op reducing 16-bit floats with the numpy ufunc for ``op``;
    ``fmt="bfloat16"``: uint16 bit patterns, widened to float32 and rounded
    back to nearest even (the cast kernels' numpy twin)."""
    ufunc = _UFUNCS[op]

    def reduce(inbuf, inoutbuf, datatype):
        a = np.frombuffer(inbuf, dtype=dtype)
        b = np.frombuffer(inoutbuf, dtype=dtype)
        if fmt is None:
            ufunc(b, a, out=b)
            return
        wide_a, wide_b = np.empty(a.size, np.float32), np.empty(b.size, np.float32)
        numpy_cast_into(a, wide_a)
        numpy_cast_into(b, wide_b)
        with np.errstate(all="ignore"):
            ufunc(wide_b, wide_a, out=wide_b)
        numpy_cast_into(wide_b, b)

    return mpi().Op.Create(reduce, commute=True)


def _mpi_type(dtype):
    """MPI datatype of a numpy dtype (16-bit floats travel as UINT16_T)."""
    found = _types.get(dtype)
    if found is None:
        name = _NATIVE.get(dtype.name)
        found = _types[dtype] = getattr(mpi(), name) if name else mpi().UINT16_T
    return found


def _mpi_op(dtype, op, fmt=None):
    """MPI reduction operator for ``op`` on ``dtype`` (user-defined for 16-bit
    floats, and for bfloat16 held as uint16, ``fmt="bfloat16"``)."""
    key = (dtype, op, fmt)
    found = _ops.get(key)
    if found is None:
        native = fmt is None and dtype.name in _NATIVE
        found = _ops[key] = (getattr(mpi(), _NATIVE_OPS[op]) if native
                             else _user_op(dtype, op, fmt))
    return found


def _cuda_aware():
    MPI = mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query else False
    except Exception:
        return False


class MpiTransport(Transport):
    """Collectives over an ``mpi4py`` communicator.

    ``mpi_comm`` is used as given (not duplicated here); ``chunk_bytes`` caps
    one all-reduce message.
    """

    name = "mpi"

    def __init__(self, mpi_comm, chunk_bytes=4 << 20):
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size())
        self.comm = mpi_comm
        self.chunk_bytes = int(chunk_bytes)
        self.cuda_aware = _cuda_aware()
        self._shm = None
        if self.size > 1 and os.environ.get(ENV_SHM, "1") != "0":
            from .shm import SharedMemoryReducer
            reducer = SharedMemoryReducer(mpi_comm, capacity_bytes=SHM_WINDOW_BYTES,
                                          stores=os.environ.get(ENV_SHM_STORES, "auto"))
            if reducer.usable:
                self._shm = reducer
            else:
                reducer.close()

    # -- staging -------------------------------------------------------------
    def _host(self, buf):
        """A buffer MPI can use for ``buf``: itself (numpy, or cupy with a
        CUDA-aware MPI, after synchronising the stream) or a host copy."""
        if type(buf) is np.ndarray or not is_cupy(buf):
            return buf
        import cupy
        if self.cuda_aware:
            cupy.cuda.get_current_stream().synchronize()
            return buf
        return cupy.asnumpy(buf)

    @staticmethod
    def _write_back(buf, host):
        """Copy a staged result back into the device buffer."""
        if host is not buf:
            buf.set(host)

    def _spec(self, buf):
        return [buf, buf.size, _mpi_type(buf.dtype)]

    def _call(self, name, deadline, *args, **kwargs):
        """Run the MPI collective ``name`` (e.g. ``"Allreduce"``): blocking
        without a deadline; with one, its non-blocking form (``Iallreduce``)
        polled until the deadline (the watch dog)."""
        self.check_usable()
        if deadline is None:
            getattr(self.comm, name)(*args, **kwargs)
        else:
            request = getattr(self.comm, "I" + name.lower())(*args, **kwargs)
            self.poll_until(request.Test, deadline, _NAMES[name], spin=True)

    # -- collectives ---------------------------------------------------------
    def all_reduce(self, buf, op, deadline=None, fmt=None):
        h = self._host(buf)
        if (self._shm is not None and fmt is None and h.nbytes >= SHM_MIN_BYTES
                and self._shared(self._shm.all_reduce, h, op, deadline=deadline)):
            self._write_back(buf, h)
            return
        mop, mtype = _mpi_op(h.dtype, op, fmt), _mpi_type(h.dtype)
        step = max(1, self.chunk_bytes // h.itemsize)
        for start in range(0, h.size, step):
            piece = h[start:start + step] if h.size > step else h
            self._call("Allreduce", deadline, mpi().IN_PLACE, [piece, mtype], mop)
        self._write_back(buf, h)

    def _shared(self, method, *args, deadline=None):
        """Run a shared-memory reducer ``method``; a timeout there leaves the
        transport unusable, as on MPI's path."""
        self.check_usable()
        try:
            return method(*args, deadline=deadline)
        except CollectiveTimeoutError:
            self._broken = "all_reduce timed out"
            raise

    def all_reduce_staged(self, buf, op, scale, pack, unpack, deadline=None, parts=None):
        """Reduces the parts in the shared-memory window (no pack into
        ``buf``, no unpack from it) when the bucket fits; else the default."""
        if (self._shm is not None and parts is not None and buf.nbytes >= SHM_MIN_BYTES
                and type(buf) is np.ndarray and self._shared(
                    self._shm.all_reduce_parts, parts, buf.size, buf.dtype, op, scale,
                    deadline=deadline)):
            return
        super().all_reduce_staged(buf, op, scale, pack, unpack, deadline)

    def broadcast(self, buf, root, deadline=None):
        h = self._host(buf)
        self._call("Bcast", deadline, self._spec(h), root=root)
        if self.rank != root:
            self._write_back(buf, h)

    def reduce(self, buf, root, op, deadline=None):
        MPI = mpi()
        h = self._host(buf)
        spec, mop = self._spec(h), _mpi_op(h.dtype, op)
        if self.rank == root:
            self._call("Reduce", deadline, MPI.IN_PLACE, spec, mop, root=root)
        else:
            self._call("Reduce", deadline, spec, None, mop, root=root)
        if self.rank == root:
            self._write_back(buf, h)

    def all_gather(self, sendbuf, recvbuf, deadline=None):
        s, r = self._host(sendbuf), self._host(recvbuf)
        self._call("Allgather", deadline, self._spec(s), [r, s.size, _mpi_type(r.dtype)])
        self._write_back(recvbuf, r)

    def all_gatherv(self, sendbuf, recvbuf, counts, deadline=None):
        counts = [int(c) for c in counts]
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(int).tolist()
        s, r = self._host(sendbuf), self._host(recvbuf)
        self._call("Allgatherv", deadline, self._spec(s),
                   [r, counts, displs, _mpi_type(r.dtype)])
        self._write_back(recvbuf, r)

    def reduce_scatter(self, sendbuf, recvbuf, op, deadline=None):
        s, r = self._host(sendbuf), self._host(recvbuf)
        self._call("Reduce_scatter_block", deadline, [s, r.size, _mpi_type(s.dtype)],
                   self._spec(r), _mpi_op(s.dtype, op))
        self._write_back(recvbuf, r)

    def barrier(self, deadline=None):
        self._call("Barrier", deadline)

    def close(self):
        """Free the shared-memory window (collective), unless a collective
        timed out, when peers may never join."""
        if self._shm is not None and self._broken is None:
            self._shm.close()
        self._shm = None
        super().close()
