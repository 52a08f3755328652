"""MPI transport (mpi4py): numpy buffers, and cupy buffers staged through host
memory unless the MPI library is CUDA-aware.

Every collective is issued in its non-blocking form and tested
(:func:`commlib.core.waiting.until`) until done, so every rank uses the same form,
a deadline can end the wait, a peer that leaves is noticed, and Ctrl-C
interrupts it. A request given up on (deadline, a peer left, an interrupt)
stays alive inside MPI: its buffers are kept referenced for the life of the
process (:data:`ABANDONED`) and the transport becomes unusable. For that
reason the caller's arrays are never handed to MPI to write into: in-place
collectives run on the transport's own staging buffer, ``chunk_bytes`` at a
time, and copy each piece back only once it completed (``owned=True``
skips the staging for commlib's own buffers). Reductions of float16 and
bfloat16, which MPI lacks, use user-defined operators computed with numpy.
Errors MPI reports become :class:`~commlib.errors.TransportError`.

``all_reduce`` can also start its requests and return at once, handing
them to the collective's :class:`~commlib.progress.inflight.InFlight` (``defer=``)
together with the copies left for after them, each piece then staged in a
buffer of its own (see :mod:`commlib.progress.inflight`).
(On one node the communicator puts
:class:`~commlib.transport.shm.SharedMemoryTransport` in front of this
transport for numpy arrays.)
"""
import atexit
import ctypes
import threading
from functools import partial

import numpy as np

from ..core import waiting
from ..errors import BackendUnavailableError, TransportError
from ..progress.inflight import now
from ..ops import hostcast
from ..ops.arrays import array_module, is_cupy
from .base import Transport, scale_in_place

_MPI = None


def mpi():
    """The ``mpi4py.MPI`` module, imported on first use."""
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise BackendUnavailableError(
                "commlib: mpi4py is not installed, so only single-process communicators "
                "(size 1) are available; for several processes install mpi4py and an MPI, "
                "e.g. from the commlib source tree: pip install '.[mpi]'") from exc
        _MPI = MPI
        atexit.register(_free_ops)
    return _MPI



_NATIVE = {"float32": "FLOAT", "float64": "DOUBLE", "int32": "INT32_T",
           "int64": "INT64_T", "uint8": "UINT8_T"}
_NATIVE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "prod": "PROD"}
_NAMES = {"Iallreduce": "all_reduce", "Ibcast": "broadcast", "Ireduce": "reduce",
          "Iallgather": "all_gather", "Iallgatherv": "all_gatherv",
          "Ireduce_scatter_block": "reduce_scatter", "Ibarrier": "barrier",
          "Isend": "send/recv"}
_types = {}     # numpy dtype -> MPI datatype
_ops = {}       # (numpy dtype, op name) -> MPI.Op
#: (request, buffers) of collectives given up on: MPI may still complete
#: them, so their memory must never be freed or reused, not even while the
#: interpreter shuts down before MPI_Finalize (each entry holds one
#: reference that is never released)
ABANDONED = []


def _member(comm):
    """A communicator made by ``Comm.Split``, or None for MPI's null one."""
    return None if comm == mpi().COMM_NULL else comm


def _free_ops():
    """Free the user-defined MPI operators (at exit, before MPI_Finalize)."""
    MPI = _MPI
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    for op in _ops.values():
        if not op.is_predefined:
            op.Free()
    _ops.clear()


def _user_op(dtype, op, fmt=None):
    """An MPI.Op reducing 16-bit floats (float16, or uint16 bit patterns of
    bfloat16 with ``fmt="bfloat16"``): both sides widened to float32, ``op``
    there, rounded back to nearest even with the canonical NaN, in one
    compiled loop (:func:`commlib.ops.hostcast.reduce_into`)."""

    def reduce(inbuf, inoutbuf, datatype):
        hostcast.reduce_into(np.frombuffer(inbuf, dtype=dtype),
                             np.frombuffer(inoutbuf, dtype=dtype), op)

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


class _Started:
    """A started request of a deferred collective (an InFlight part)."""

    __slots__ = ("transport", "name", "request", "keep")

    def __init__(self, transport, name, request, keep):
        self.transport, self.name, self.request, self.keep = transport, name, request, keep

    def test(self):
        """Whether the request completed; raises TransportError when MPI reports an error."""
        MPI = mpi()
        try:
            return self.request.Test()
        except MPI.Exception as exc:
            self.abandon()
            raise self.transport._error(self.name, exc) from None

    def abandon(self):
        self.transport.abandon(self.request, self.keep, self.name, "in flight")


class MpiTransport(Transport):
    """Collectives over an ``mpi4py`` communicator.

    ``mpi_comm`` is used as given (the communicator duplicates it) and freed
    by :meth:`close`; ``chunk_bytes`` caps one message and the staging
    buffer.
    """

    name = "mpi"

    def __init__(self, mpi_comm, chunk_bytes=4 << 20):
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size())
        self.comm = mpi_comm
        self.chunk_bytes = int(chunk_bytes)
        self.cuda_aware = _cuda_aware()
        self._staging = {}        # array module -> uint8 buffer of chunk_bytes
        self._spares = []         # numpy uint8 buffers of chunk_bytes for deferred pieces

    # -- staging -------------------------------------------------------------

    def thread_safe(self):
        """Only where MPI provides ``MPI_THREAD_MULTIPLE``."""
        MPI = mpi()
        return MPI.Query_thread() >= MPI.THREAD_MULTIPLE
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

    def _stage(self, piece):
        """This transport's staging buffer as an array like ``piece``."""
        xp = array_module(piece)
        found = self._staging.get(xp)
        if found is None or found.nbytes < piece.nbytes:
            found = self._staging[xp] = xp.empty(max(self.chunk_bytes, piece.nbytes), np.uint8)
        return found[:piece.nbytes].view(piece.dtype)

    def _copy_out(self, stage, piece, scale, spare=None):
        """``piece[...] = stage`` times ``scale`` (None: 1); ``spare``: the
        buffer under ``stage`` when it was a deferred piece's own, free again."""
        if scale is None:
            piece[...] = stage
        else:
            array_module(piece).multiply(stage, scale, out=piece)
        if spare is not None:
            self._spares.append(spare)

    def _pieces(self, buf, owned, writes=True, copy_in=True, scale=None, defer=None):
        """Yield ``(out, piece)`` for consecutive pieces of ``buf`` of at
        most ``chunk_bytes``; the caller runs its collective on each, the
        result going to ``out``: the piece itself when ``owned`` (or
        ``writes`` is False), else a staging buffer, filled with the piece
        first if ``copy_in``, and copied back times ``scale`` (None: 1) when
        the caller asks for the next piece, so a collective that fails (the
        caller's loop raises) never writes into ``buf``. ``defer`` (an
        InFlight): the caller only starts the requests, and the copies back
        wait until every request of the collective completed; each piece
        then has a staging buffer of its own."""
        after = now if defer is None else defer.then
        step = max(1, self.chunk_bytes // max(1, buf.itemsize))
        for start in range(0, buf.size, step):
            piece = buf[start:start + step] if buf.size > step else buf
            if owned or not writes:
                yield piece, piece
                if writes and scale is not None:
                    after(partial(scale_in_place, piece, scale))
                continue
            spare = None
            if defer is None:
                stage = self._stage(piece)
            else:               # numpy; pieces are at most chunk_bytes
                spare = self._spares.pop() if self._spares else np.empty(self.chunk_bytes,
                                                                         np.uint8)
                stage = spare[:piece.nbytes].view(piece.dtype)
            if copy_in:
                stage[...] = piece
            yield stage, piece
            after(partial(self._copy_out, stage, piece, scale, spare))

    def _spec(self, buf):
        return [buf, buf.size, _mpi_type(buf.dtype)]

    def _call(self, name, wait, *args, defer=None, **kwargs):
        """Start the non-blocking MPI collective ``name`` (e.g.
        ``"Iallreduce"``) and poll it until done, or with ``defer`` (an
        InFlight) hand it over; on any failure keep the request and its
        buffers alive forever and make the transport unusable."""
        self.check_usable()
        MPI = mpi()
        try:
            request = getattr(self.comm, name)(*args, **kwargs)
        except MPI.Exception as exc:
            self.fail("MPI error in %s" % _NAMES[name])
            raise self._error(name, exc) from None
        if defer is not None:
            defer.add(_Started(self, name, request, args))
            return
        try:
            waiting.until(lambda _: request.Test() or None, wait)
        except BaseException as exc:
            self.abandon(request, args, name, type(exc).__name__)
            if isinstance(exc, MPI.Exception):
                raise self._error(name, exc) from None
            raise

    def abandon(self, request, buffers, name, why):
        """Give up on ``request`` of collective ``name``: it and its
        ``buffers`` stay alive (:data:`ABANDONED`), and this transport
        becomes unusable."""
        entry = (request, buffers)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(entry))
        ABANDONED.append(entry)
        self.fail("%s was given up on (%s)" % (_NAMES[name], why))

    def _error(self, name, exc):
        text = exc.Get_error_string() if hasattr(exc, "Get_error_string") else str(exc)
        hint = ("; the ranks may have passed different sizes or dtypes (the consistency "
                "check, on by default, names them before any data moves)")
        return TransportError("rank %d: MPI reported an error in %s: %s%s"
                              % (self.rank, _NAMES[name], text.strip(), hint))

    # -- collectives ---------------------------------------------------------
    def defers(self, buf):
        """numpy buffers: their requests can stay in flight."""
        return type(buf) is np.ndarray

    def all_reduce(self, buf, op, wait=waiting.FOREVER, fmt=None, owned=False, scale=None,
                   defer=None):
        """See :meth:`Transport.all_reduce`; with ``defer`` (numpy buffers
        only) the requests are started and handed over, and the call
        returns at once."""
        h = self._host(buf)
        if defer is not None and h is not buf:
            raise ValueError("a deferred all_reduce takes host buffers only")
        mop, mtype = _mpi_op(h.dtype, op, fmt), _mpi_type(h.dtype)
        IN_PLACE = mpi().IN_PLACE
        for out, piece in self._pieces(h, owned or h is not buf, copy_in=False, scale=scale,
                                       defer=defer):
            # a staged piece is sent from where it lies
            self._call("Iallreduce", wait, IN_PLACE if out is piece else [piece, mtype],
                       [out, mtype], mop, defer=defer)
        self._write_back(buf, h)

    def broadcast(self, buf, root, wait=waiting.FOREVER, owned=False):
        h = self._host(buf)
        for out, _ in self._pieces(h, owned or h is not buf, writes=self.rank != root):
            self._call("Ibcast", wait, self._spec(out), root=root)
        if self.rank != root:
            self._write_back(buf, h)

    def reduce(self, buf, root, op, wait=waiting.FOREVER, owned=False):
        MPI = mpi()
        h = self._host(buf)
        mop = _mpi_op(h.dtype, op)
        for out, _ in self._pieces(h, owned or h is not buf, writes=self.rank == root):
            if self.rank == root:
                self._call("Ireduce", wait, MPI.IN_PLACE, self._spec(out), mop, root=root)
            else:
                self._call("Ireduce", wait, self._spec(out), None, mop, root=root)
        if self.rank == root:
            self._write_back(buf, h)

    def all_gather(self, sendbuf, recvbuf, wait=waiting.FOREVER):
        s, r = self._host(sendbuf), self._host(recvbuf)
        self._call("Iallgather", wait, self._spec(s), [r, s.size, _mpi_type(r.dtype)])
        self._write_back(recvbuf, r)

    def all_gatherv(self, sendbuf, recvbuf, counts, wait=waiting.FOREVER):
        counts = [int(c) for c in counts]
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(int).tolist()
        s, r = self._host(sendbuf), self._host(recvbuf)
        self._call("Iallgatherv", wait, self._spec(s),
                   [r, counts, displs, _mpi_type(r.dtype)])
        self._write_back(recvbuf, r)

    def reduce_scatter(self, sendbuf, recvbuf, op, wait=waiting.FOREVER):
        s, r = self._host(sendbuf), self._host(recvbuf)
        self._call("Ireduce_scatter_block", wait, [s, r.size, _mpi_type(s.dtype)],
                   self._spec(r), _mpi_op(s.dtype, op))
        self._write_back(recvbuf, r)

    def barrier(self, wait=waiting.FOREVER):
        self._call("Ibarrier", wait)

    def send_recv(self, ops, wait=waiting.FOREVER):
        """See :meth:`Transport.send_recv`: ``Isend``/``Irecv`` of every
        message, then ``Testall`` in the one bounded wait; cupy buffers
        staged through host memory unless the MPI is CUDA-aware."""
        self.check_usable()
        MPI = mpi()
        staged = [(kind, buf, self._host(buf), peer, tag) for kind, buf, peer, tag in ops]
        requests = []
        try:
            for kind, _, h, peer, tag in staged:
                start = self.comm.Isend if kind == "send" else self.comm.Irecv
                requests.append(start(self._spec(h), peer, tag))
        except MPI.Exception as exc:
            self.abandon(requests, staged, "Isend", "not started")
            raise self._error("Isend", exc) from None
        try:
            waiting.until(lambda _: MPI.Request.Testall(requests) or None, wait)
        except BaseException as exc:
            self.abandon(requests, staged, "Isend", type(exc).__name__)
            if isinstance(exc, MPI.Exception):
                raise self._error("Isend", exc) from None
            raise
        for kind, buf, h, _, _ in staged:
            if kind == "recv":
                self._write_back(buf, h)

    def split(self, color, key, table, wait=waiting.FOREVER):
        """The mpi4py communicator of the ranks of ``color``
        (``Comm.Split``; None for a rank of no colour). Every rank has just
        taken part in the exchange of ``table``, so MPI's split finds them
        all, unless one dies or stops in between. MPI has no non-blocking
        split: where MPI takes calls from several threads it runs on a
        thread of its own, bounded by ``wait`` (a rank that died: PeerError;
        the deadline: CollectiveTimeoutError); a split given up on stays
        blocked inside MPI, and this transport becomes unusable. Elsewhere
        it blocks this thread."""
        MPI = mpi()
        self.check_usable()
        colour = MPI.UNDEFINED if color is None else color
        if not self.thread_safe():
            return _member(self.comm.Split(colour, key))
        made, done = [], threading.Event()

        def run():
            try:
                made.append(self.comm.Split(colour, key))
            except MPI.Exception as exc:
                made.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="commlib-mpi-split").start()
        try:
            # each step blocks on the event for its slice (no CPU), woken
            # the moment the split returns
            waiting.until(lambda slice_s: made if done.wait(slice_s) else None, wait,
                          pace="spin")
        except BaseException as exc:
            self.fail("split was given up on (%s)" % type(exc).__name__)
            raise
        if isinstance(made[0], MPI.Exception):
            self.fail("MPI error in split")
            raise TransportError("rank %d: MPI reported an error in split: %s"
                                 % (self.rank, made[0].Get_error_string().strip()))
        return _member(made[0])

    def close(self):
        """Free the MPI communicator: local (MPICH frees a communicator
        without waiting for the others, and after pending requests
        complete)."""
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.Free()
            except Exception:
                pass
        super().close()
