"""NCCL transport (cupy.cuda.nccl): cupy buffers on this rank's GPU; numpy
buffers are staged through device memory.

Collectives are enqueued on the current cupy stream and return without a
host synchronisation (stream order makes the result visible to later work on
that stream). With a deadline, the call records an event and hands it to
:class:`NcclWatch`, a daemon thread that polls the events in flight and
NCCL's asynchronous error (``check_async_error()``): when a collective
misses its deadline (CollectiveTimeoutError), a peer leaves the status
board (PeerError) or NCCL reports an error (TransportError, with NCCL's
text), it aborts the NCCL communicator so no kernel stays blocked, and the
transport's next call raises that error. ``barrier`` waits on the host.
An aborted collective may leave partial sums in the arrays it was writing;
nothing writes into them after the abort.
"""
import collections
import contextlib
import threading
import time

import numpy as np

from ..core import waiting
from ..core.gpu import nccl_module
from ..core.fingerprints import label
from ..errors import BackendUnavailableError, CommlibError, TransportError
from ..ops.arrays import is_cupy
from .base import Transport, scale_in_place


class NcclWatch:
    """Watches the collectives of one NCCL communicator in flight: a daemon
    thread that polls their events every ``every`` seconds and aborts the
    communicator when one is late or a peer left (``wait.board``)."""

    def __init__(self, transport, every=0.05):
        self.transport, self.every = transport, every
        self.failure = None
        self._pending = []          # (event, the collective's Wait)
        self._lock = threading.Lock()
        self._thread = None

    def add(self, event, wait):
        with self._lock:
            self._pending.append((event, wait))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="commlib-nccl-watch")
                self._thread.start()

    def check(self):
        """Raise the failure the thread found, if any."""
        if self.failure is not None:
            raise self.failure

    def _run(self):
        while self.failure is None and not self.transport.broken:
            time.sleep(self.every)
            with self._lock:
                pending = list(self._pending)
            for event, wait in pending:
                try:
                    if event.done:
                        with self._lock:
                            self._pending.remove((event, wait))
                        continue
                    self.transport.comm.check_async_error()
                    wait.check()
                except CommlibError as exc:      # a deadline passed, a peer left
                    self._fail(exc)
                    return
                except Exception as exc:        # NCCL's asynchronous error
                    self._fail(TransportError(
                        "rank %d: NCCL reported an error in %s: %s"
                        % (wait.rank, label(wait.what, wait.seq), exc)))
                    return

    def _fail(self, exc):
        self.failure = exc
        self.transport.fail(str(exc))
        try:
            self.transport.comm.abort()
        except Exception:
            pass

#: names of cupy.cuda.nccl's ncclDataType_t and ncclRedOp_t constants
_DTYPE_NAMES = {"uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "int64": "NCCL_INT64",
                "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
                "bfloat16": "NCCL_BFLOAT16"}
_OP_NAMES = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "max": "NCCL_MAX", "min": "NCCL_MIN"}
_DTYPES, _OPS = {}, {}
NCCL_ID_BYTES = 128      # filled from cupy.cuda.nccl when the first transport is made
_codes = {}     # numpy dtype -> ncclDataType_t (dtype.name is slow to compute)


def _load_codes(nccl):
    """NCCL's data type and operator codes, from cupy's constants (bfloat16
    is ncclBfloat16 = 9 where this cupy does not name it)."""
    if not _DTYPES:
        for name, constant in _DTYPE_NAMES.items():
            found = getattr(nccl, constant, None)
            if found is not None or name == "bfloat16":
                _DTYPES[name] = 9 if found is None else found
        _OPS.update({name: getattr(nccl, constant) for name, constant in _OP_NAMES.items()})


def _code(dtype):
    found = _codes.get(dtype)
    if found is None:
        found = _codes[dtype] = _DTYPES[dtype.name]
    return found


class NcclSplit(collections.namedtuple("NcclSplit", "nccl_id rank size")):
    """What :meth:`NcclTransport.split` makes for one colour: the 128 bytes
    of the new NCCL communicator's unique ID (made by the colour's lowest
    rank), and this rank's place in it and its size."""


class NcclTransport(Transport):
    """Collectives over a ``cupy.cuda.nccl.NcclCommunicator``.

    ``nccl_id`` is a :class:`~commlib.startup.bootstrap.NcclId`; ``device`` the GPU
    ordinal this rank uses. Construction is collective: every rank must
    create its transport with the same ID.
    """

    name = "nccl"

    def __init__(self, nccl_id, rank, size, device):
        super().__init__(rank, size)
        import cupy
        self._cupy = cupy
        nccl = nccl_module()
        _load_codes(nccl)
        self.device = int(device)
        with cupy.cuda.Device(self.device):
            try:
                try:
                    self.comm = nccl.NcclCommunicator(size, nccl_id.for_cupy(), rank)
                except TypeError:       # CuPy versions that take the ID as bytes
                    self.comm = nccl.NcclCommunicator(size, nccl_id.data, rank)
            except nccl.NcclError as exc:
                if "INVALID_USAGE" not in str(exc).upper().replace(" ", "_"):
                    raise
                raise BackendUnavailableError(
                    "rank %d: NCCL refused the communicator (%s): the usual cause is two "
                    "ranks on one GPU (this rank uses GPU %d); NCCL takes one rank per GPU. "
                    "Start at most one rank per GPU, or use the MPI transport for several "
                    "ranks per GPU (Communicator.from_mpi(backend='mpi'); commlib.launch "
                    "picks it when there are more ranks than GPUs)"
                    % (rank, exc, self.device)) from exc
        self.watch = NcclWatch(self)
        #: (event, buffers): buffers kept alive until the work before the event ran
        self._held = collections.deque()
        self._staged = []       # device copies of numpy buffers of the call being made

    @contextlib.contextmanager
    def _device(self, buf, writeback):
        """Yield a device buffer for ``buf``; copy results back after. A
        numpy ``buf`` is staged in a device copy, held (see :meth:`_finish`)
        until the work reading it has run."""
        with self._cupy.cuda.Device(self.device):
            if is_cupy(buf):
                yield buf
                return
            dev = self._cupy.asarray(buf)
            self._staged.append(dev)
            yield dev
            if writeback:
                dev.get(out=buf)

    def _stream(self):
        return self._cupy.cuda.get_current_stream()

    def check_usable(self):
        self.watch.check()
        super().check_usable()

    def _finish(self, wait, hold=()):
        """The collective just enqueued: hand it to the watch (when it has a
        deadline or peers to watch), and keep the buffers it reads that
        nobody else holds (``hold``, and the staged copies of numpy
        buffers) referenced until it has run; returns at once."""
        hold = list(hold) + self._staged
        self._staged = []
        held = self._held
        while held and held[0][0].done:
            held.popleft()
        watched = wait.deadline is not None or wait.board is not None
        if not (hold or watched):
            return
        event = self._stream().record()
        if hold:
            held.append((event, hold))
        if watched:
            self.watch.add(event, wait)

    # -- collectives ---------------------------------------------------------
    def all_reduce(self, buf, op, wait=waiting.FOREVER, fmt=None, owned=False, scale=None):
        self.check_usable()
        with self._device(buf, True) as d:
            dtype = _code(d.dtype) if fmt is None else _DTYPES[fmt]
            self.comm.allReduce(d.data.ptr, d.data.ptr, d.size, dtype, _OPS[op],
                                self._stream().ptr)
            scale_in_place(d, scale)
            self._finish(wait)

    def broadcast(self, buf, root, wait=waiting.FOREVER, owned=False):
        self.check_usable()
        with self._device(buf, self.rank != root) as d:
            self.comm.broadcast(d.data.ptr, d.data.ptr, d.size, _code(d.dtype),
                                root, self._stream().ptr)
            self._finish(wait)

    def reduce(self, buf, root, op, wait=waiting.FOREVER, owned=False):
        self.check_usable()
        with self._device(buf, self.rank == root) as d:
            self.comm.reduce(d.data.ptr, d.data.ptr, d.size, _code(d.dtype),
                             _OPS[op], root, self._stream().ptr)
            self._finish(wait)

    def all_gather(self, sendbuf, recvbuf, wait=waiting.FOREVER):
        self.check_usable()
        with self._device(sendbuf, False) as s, self._device(recvbuf, True) as r:
            self.comm.allGather(s.data.ptr, r.data.ptr, s.size, _code(s.dtype),
                                self._stream().ptr)
            self._finish(wait)

    def all_gatherv(self, sendbuf, recvbuf, counts, wait=waiting.FOREVER):
        """Grouped broadcasts, one per rank (NCCL has no all-gather-v)."""
        self.check_usable()
        nccl = nccl_module()
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
            self._finish(wait)

    def reduce_scatter(self, sendbuf, recvbuf, op, wait=waiting.FOREVER):
        self.check_usable()
        with self._device(sendbuf, False) as s, self._device(recvbuf, True) as r:
            self.comm.reduceScatter(s.data.ptr, r.data.ptr, r.size, _code(s.dtype),
                                    _OPS[op], self._stream().ptr)
            self._finish(wait)

    def send_recv(self, ops, wait=waiting.FOREVER):
        """See :meth:`Transport.send_recv`: one NCCL group of ``send`` and
        ``recv`` calls on the current stream (NCCL has no tags: messages
        between two ranks match in the order they are issued)."""
        self.check_usable()
        nccl = nccl_module()
        with contextlib.ExitStack() as stack:
            bufs = [stack.enter_context(self._device(buf, kind == "recv"))
                    for kind, buf, _, _ in ops]
            stream = self._stream().ptr
            nccl.groupStart()
            try:
                for (kind, _, peer, _), d in zip(ops, bufs):
                    if kind == "send":
                        self.comm.send(d.data.ptr, d.size, _code(d.dtype), peer, stream)
                    else:
                        self.comm.recv(d.data.ptr, d.size, _code(d.dtype), peer, stream)
            finally:
                nccl.groupEnd()
            self._finish(wait, bufs)

    def split(self, color, key, table, wait=waiting.FOREVER):
        """A :class:`NcclSplit` for the ranks of ``color``, ordered by
        ``(key, rank)`` (None for a rank of no colour): the lowest rank of
        each colour asks NCCL for a unique ID and every rank's 128 bytes go
        to every rank in one all-gather over this communicator, so each
        rank finds its colour's. The new communicator is made from that ID
        (:meth:`commlib.Communicator.from_nccl_id`)."""
        self.check_usable()
        members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(table)
                                        if c == color)] if color is not None else []
        mine = np.zeros(NCCL_ID_BYTES, np.uint8)
        if members and min(members) == self.rank:
            raw = nccl_module().get_unique_id()
            mine[:] = np.frombuffer(bytes(b & 0xFF for b in raw), np.uint8)
        ids = np.empty(NCCL_ID_BYTES * self.size, np.uint8)
        self.all_gather(mine, ids, wait)
        if color is None:
            return None
        lowest = min(members)
        return NcclSplit(bytes(ids[lowest * NCCL_ID_BYTES:(lowest + 1) * NCCL_ID_BYTES]),
                         members.index(self.rank), len(members))

    def barrier(self, wait=waiting.FOREVER):
        """An all-reduce of one byte, waited for on the host."""
        self.check_usable()
        with self._cupy.cuda.Device(self.device):
            one = self._cupy.zeros(1, dtype=self._cupy.uint8)
            self.comm.allReduce(one.data.ptr, one.data.ptr, 1, _DTYPES["uint8"], _OPS["sum"],
                                self._stream().ptr)
            self._finish(wait)
            event = self._stream().record()
            waiting.until(lambda _: self.watch.check() or event.done or None, wait)

    def close(self):
        """Destroy the NCCL communicator (abort it after a failure)."""
        if self._broken is None:
            self.comm.destroy()
        else:
            try:
                self.comm.abort()
            except Exception:
                pass
        super().close()
