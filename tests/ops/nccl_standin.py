"""A stand-in for ``cupy.cuda.nccl`` on the host build's cupy
(tests/ops/cuda_host_build.py: ``HostCupy(..., nccl=True)``,
``write_cupy_package(..., nccl=True)``), so that commlib's NCCL transport
runs at several ranks on the CPU.

It follows NCCL's contract, not only its names:

- Ranks are processes of one machine. ``NcclCommunicator(ndev, commId,
  rank)`` maps a segment of shared memory whose name derives from the ID
  (made exclusively, mode 0600; a file planted under the name by another
  user is refused: commlib.startup.shared_segment), waits (bounded) until
  all ``ndev`` ranks joined, and refuses two ranks on one device as NCCL
  does (NcclError NCCL_ERROR_INVALID_USAGE, "Duplicate GPU detected",
  on every rank). The name is removed once every rank has mapped it.
- A call checks its arguments at once (NcclError INVALID_ARGUMENT, saying
  which) and returns; the work is enqueued on the given stream and runs on
  the communicator's worker thread (the stand-in's GPU), in call order,
  after the work the stream holds: the stream's ``synchronize``, an event
  recorded after the call and any device work issued after it on that
  stream wait for it (``HostCupy.enqueue``/``settle``). The inputs are read
  when the work runs and the outputs written only once every peer's part
  has arrived, so in-place calls work and an aborted call writes nothing.
- Between ``groupStart()`` and ``groupEnd()`` calls are only recorded;
  ``groupEnd`` issues them as one piece of work whose transfers progress
  together (a send and a receive between two ranks in one group cannot
  deadlock).
- Each pair of ranks has a one-chunk channel in each direction; every
  collective sends its full arguments (kind, call number, count, type,
  operator, root) to every peer, which compares them with its own:
  mismatched calls, undefined in NCCL, fail loudly (INVALID_USAGE, naming
  both ranks and what differs) on the rank that sees it, and its peers
  then fail with NCCL_ERROR_REMOTE_ERROR. Calls of count 0 do nothing, as
  in NCCL.
- Reductions go in rank order (rank 0's value, then rank 1's, ...), in the
  type itself, so every rank gets the same bits; float16 and bfloat16
  round at each step.
- ``abort()`` stops this rank's work (nothing is written after it returns)
  and marks the rank aborted: peers waiting on it fail with
  NCCL_ERROR_REMOTE_ERROR, reported by ``check_async_error()``, as is a
  peer that failed, destroyed its communicator or whose process ended.
  As NCCL's kernels, work that failed (and the work after it) stays
  unfinished on its stream until the communicator is aborted or destroyed.
  After ``abort()`` or ``destroy()`` the handle is NULL, as cupy's: every
  call raises INVALID_ARGUMENT. A communicator with an asynchronous error
  refuses new calls (INVALID_ARGUMENT, with the error), as NCCL does.
- Every wait is bounded by COMMLIB_NCCL_STANDIN_LIMIT_S seconds (default
  120): past it the work fails with NCCL_ERROR_SYSTEM_ERROR saying whom it
  waited for.
- ``comm.fail_at(k, status)`` (stand-in only) makes this rank's call number
  k (0-based, calls of count 0 not counted) fail asynchronously with
  ``status`` when it runs, before it writes anything; ``comm.stall_at(k)``
  makes it hang (take no part) until the communicator is aborted.

What it cannot show: NCCL's speed, its algorithms (ring, tree) and their
reduction order, its topology (NVLink, PCIe, network), several nodes.
"""
import ctypes
import hashlib
import os
import secrets
import threading
import time
import types

import numpy as np

from commlib.core.liveness import alive
from commlib.startup import shared_segment

# ncclDataType_t, ncclRedOp_t (as cupy.cuda.nccl names them)
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

# ncclResult_t
SUCCESS, UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR = 0, 1, 2, 3
INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR, IN_PROGRESS = 4, 5, 6, 7
_NAMES = {0: "NCCL_ERROR_SUCCESS", 1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
          2: "NCCL_ERROR_SYSTEM_ERROR", 3: "NCCL_ERROR_INTERNAL_ERROR",
          4: "NCCL_ERROR_INVALID_ARGUMENT", 5: "NCCL_ERROR_INVALID_USAGE",
          6: "NCCL_ERROR_REMOTE_ERROR", 7: "NCCL_ERROR_IN_PROGRESS"}
_STRINGS = {0: "no error",
            1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
            2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
            3: "internal error - please report this issue to the NCCL developers",
            4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
            5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
            6: "remote process exited or there was a network error",
            7: "NCCL operation in progress"}

_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
           6: np.float16, 7: np.float32, 8: np.float64, 9: np.uint16}
_OP_NAMES = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
VERSION = 22000                      # what get_version() says (NCCL 2.20.0)

CHUNK = 256 << 10                    # bytes a channel carries at a time
_RANK_WORDS = 64                     # per rank: pid, device + 1, state, reason
_HDR_WORDS = 16                      # per channel: posted, taken, descriptor
_REASON_BYTES = (_RANK_WORDS - 8) * 8
OK, ABORTED, FAILED, DESTROYED = 0, 1, 2, 3
_STATE_TEXT = {ABORTED: "aborted its communicator", FAILED: "failed",
               DESTROYED: "destroyed its communicator"}
# kinds of work, in a channel's descriptor
_KINDS = {"allReduce": 1, "reduce": 2, "broadcast": 3, "allGather": 4, "reduceScatter": 5,
          "send": 6}
_FIELDS = ("kind", "call", "count", "datatype", "op", "root")


def limit_s():
    """The bound of every wait of the stand-in (COMMLIB_NCCL_STANDIN_LIMIT_S)."""
    return float(os.environ.get("COMMLIB_NCCL_STANDIN_LIMIT_S", 120))


class NcclError(RuntimeError):
    """cupy's NcclError: ``status`` (ncclResult_t) and its text; the stand-in
    adds what it knows (``detail``) after NCCL's text."""

    def __init__(self, status, detail=None):
        self.status = int(status)
        self.detail = detail
        text = "%s: %s" % (_NAMES.get(self.status, "NCCL_ERROR_%d" % self.status),
                           _STRINGS.get(self.status, "unknown result code"))
        super().__init__(text if detail is None else "%s: %s" % (text, detail))

    def __reduce__(self):
        return (type(self), (self.status, self.detail))


def _view(ptr, nbytes):
    """The ``nbytes`` at address ``ptr`` as a writeable uint8 numpy array."""
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), np.uint8)


def _bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x):
    """float32 to bfloat16 bits, to nearest even; NaN stays NaN (quiet)."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def reduce_in_rank_order(values, datatype, op, nranks):
    """NCCL's reduction of ``values`` (one array per rank, in rank order) as
    the stand-in does it: left to right, in the type (bfloat16: uint16 bits,
    each step rounded), ``avg`` the sum divided by ``nranks``."""
    name = _OP_NAMES[op]
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
          "min": np.minimum}[name]
    if datatype == NCCL_BFLOAT16:
        acc = values[0]
        for v in values[1:]:
            acc = _f32_to_bf16(fn(_bf16_to_f32(acc), _bf16_to_f32(v)))
        if name == "avg":
            acc = _f32_to_bf16(_bf16_to_f32(acc) / np.float32(nranks))
        return acc
    with np.errstate(all="ignore"):
        acc = values[0].copy()
        for v in values[1:]:
            fn(acc, v, out=acc)
        if name == "avg":
            if acc.dtype.kind == "f":
                acc /= acc.dtype.type(nranks)
            else:
                acc //= nranks
    return acc


class _Op:
    """One call: what it sends to and receives from each peer, and what it
    writes at the end (``finish``)."""

    def __init__(self, name, call, count, datatype, op, root, peer=None):
        self.name, self.call, self.count = name, call, count
        self.datatype, self.op, self.root, self.peer = datatype, op, root, peer
        self.sends = []       # (peer, descriptor, bytes): filled by start()
        self.recvs = {}       # peer -> (descriptor, bytes received so far)
        self.start = self.finish = None

    def descriptor(self):
        return (_KINDS["send" if self.name == "recv" else self.name], self.call, self.count,
                self.datatype, -1 if self.op is None else self.op,
                -1 if self.root is None else self.root)

    def label(self):
        return "%s #%d" % (self.name, self.call)


class _Launch:
    """Work of one call or one group, as the host build's streams see it."""

    def __init__(self, comm, ops, streams):
        self.comm, self.ops, self.streams = comm, ops, streams
        self.finished = threading.Event()
        self.deps = []
        self.what = "NCCL %s on rank %d" % (", ".join(o.label() for o in ops), comm._rank)


class _Group(threading.local):
    depth = 0
    calls = None


def make_module(host):
    """The ``cupy.cuda.nccl`` stand-in of ``host`` (a HostCupy)."""
    group = _Group()

    def groupStart():
        if group.depth == 0:
            group.calls = []
        group.depth += 1

    def groupEnd():
        if group.depth == 0:
            raise NcclError(INVALID_USAGE, "groupEnd without groupStart")
        group.depth -= 1
        if group.depth:
            return
        calls, group.calls = group.calls, None
        by_comm = {}
        for comm, op, stream in calls:
            by_comm.setdefault(id(comm), (comm, []))[1].append((op, stream))
        for comm, items in by_comm.values():
            comm._submit([op for op, _ in items], [s for _, s in items])

    class NcclCommunicator(_Communicator):
        _host = host
        _group = group

    mod = types.ModuleType("cupy.cuda.nccl")
    mod.__doc__ = __doc__
    mod.__dict__.update({k: v for k, v in globals().items()
                         if k.startswith("NCCL_") and isinstance(v, int)})
    mod.__dict__.update(
        available=True, NcclError=NcclError, NcclCommunicator=NcclCommunicator,
        groupStart=groupStart, groupEnd=groupEnd, get_version=lambda: VERSION,
        get_build_version=lambda: VERSION,
        get_unique_id=lambda: tuple(b - 256 if b > 127 else b for b in secrets.token_bytes(128)))
    return mod


def _segment_name(comm_id, nranks):
    data = bytes(b & 0xFF for b in comm_id)
    return "%sncclsi-%s-%d" % (shared_segment.PREFIX, hashlib.sha256(data).hexdigest()[:24],
                               nranks)


class _Communicator:
    """cupy.cuda.nccl.NcclCommunicator (see the module's text)."""

    _host = None
    _group = None

    def __init__(self, ndev, commId, rank):
        if isinstance(commId, (bytes, bytearray)):
            commId = tuple(commId)
        if not isinstance(commId, tuple) or len(commId) != 128:
            raise NcclError(INVALID_ARGUMENT, "commId must be the 128 values of get_unique_id()")
        ndev, rank = int(ndev), int(rank)
        if ndev < 1 or not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT, "rank %d of ndev %d: expected 0 <= rank < ndev"
                            % (rank, ndev))
        self._rank, self._n = rank, ndev
        self._device = self._host.current_device()
        self._open = False
        self._error = None          # the asynchronous error (NcclError)
        self._calls = 0             # calls of count > 0 issued
        self._fail_at = {}          # call -> status (fail_at)
        self._lock = threading.Condition()
        self._queue = []
        self._write_lock = threading.Lock()
        self._aborting = False
        self._p2p_sent, self._p2p_received = [0] * ndev, [0] * ndev
        nbytes = 8 * (ndev * _RANK_WORDS + ndev * ndev * _HDR_WORDS) + ndev * ndev * CHUNK
        try:
            self._segment = shared_segment.SharedSegment(_segment_name(commId, ndev), nbytes,
                                                         exist_ok=True)
        except Exception as exc:
            raise NcclError(SYSTEM_ERROR, "rank %d: %s" % (rank, exc)) from exc
        words = self._segment.array[:8 * ndev * (_RANK_WORDS + ndev * _HDR_WORDS)].view(np.int64)
        self._ranks = words[:ndev * _RANK_WORDS].reshape(ndev, _RANK_WORDS)
        self._headers = words[ndev * _RANK_WORDS:].reshape(ndev, ndev, _HDR_WORDS)
        self._chunks = self._segment.array[words.nbytes:].reshape(ndev, ndev, CHUNK)
        try:
            self._join()
        finally:
            self._segment.unlink()       # every rank mapped it, or this one gave up
        self._open = True
        self._worker = threading.Thread(target=self._run, daemon=True,
                                        name="nccl-standin-%d" % rank)
        self._worker.start()

    def _join(self):
        me = self._ranks[self._rank]
        pid = os.getpid()
        if me[0] not in (0, pid) and alive(int(me[0])):
            raise NcclError(INVALID_USAGE, "rank %d: another process (pid %d) joined as rank %d"
                            % (self._rank, me[0], self._rank))
        me[1] = self._device + 1
        me[0] = pid
        end = time.monotonic() + limit_s()
        pause = 1e-5
        while True:
            missing = [r for r in range(self._n) if self._ranks[r, 0] == 0]
            if not missing:
                break
            if time.monotonic() > end:
                raise NcclError(SYSTEM_ERROR, "rank %d: ranks %s did not join within %g s (did "
                                "every rank pass ndev=%d and the same ID?)"
                                % (self._rank, missing, limit_s(), self._n))
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if me[0] != pid:
            raise NcclError(INVALID_USAGE, "rank %d: another process (pid %d) joined as rank %d"
                            % (self._rank, me[0], self._rank))
        devices = [int(self._ranks[r, 1]) - 1 for r in range(self._n)]
        for r in range(self._n):
            for q in range(r):
                if devices[q] == devices[r]:
                    raise NcclError(INVALID_USAGE, "Duplicate GPU detected : rank %d and rank %d "
                                    "both on CUDA device %d" % (q, r, devices[r]))

    # -- cupy's methods --------------------------------------------------------------
    def device_id(self):
        self._check_open()
        return self._device

    def rank_id(self):
        self._check_open()
        return self._rank

    def size(self):
        self._check_open()
        return self._n

    def check_async_error(self):
        self._check_open()
        if self._error is not None:
            raise self._error

    def fail_at(self, call, status=SYSTEM_ERROR):
        """Stand-in only: this rank's call number ``call`` fails with ``status``
        when it runs (an asynchronous error), before writing anything."""
        self._fail_at[int(call)] = int(status)

    def stall_at(self, call):
        """Stand-in only: this rank's call number ``call`` never takes part (as
        a hung kernel): it waits, sending nothing, until the communicator is
        aborted (or the stand-in's limit passes)."""
        self._fail_at[int(call)] = "stall"

    def abort(self):
        """Stop this rank's work and mark it aborted for its peers; nothing is
        written once this returns. The handle is NULL afterwards."""
        if not self._open:
            return
        self._open = False
        self._aborting = True
        with self._write_lock:              # a result being written is finished first
            self._ranks[self._rank, 2] = ABORTED
        with self._lock:
            self._lock.notify_all()
        self._worker.join(limit_s())

    def destroy(self):
        """Wait for this rank's work (bounded), then free the communicator."""
        if not self._open:
            return
        with self._lock:
            pending = list(self._queue) if self._error is None else []
        from cuda_host_build import wait_all
        try:
            wait_all(pending)
        finally:
            self._open = False
            if self._ranks[self._rank, 2] == OK:
                self._ranks[self._rank, 2] = DESTROYED
            with self._lock:
                self._lock.notify_all()
            self._worker.join(limit_s())

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._call("allReduce", stream, count, datatype, op, None, None,
                   sendbuf, recvbuf, count, count)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        # recvbuf: the root's only
        self._call("reduce", stream, count, datatype, op, root, None,
                   sendbuf, recvbuf, count, count if self._rank == root else 0)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        # sendbuff: the root's only
        self._call("broadcast", stream, count, datatype, None, root, None,
                   sendbuff, recvbuff, count if self._rank == root else 0, count)

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._call("allGather", stream, count, datatype, None, None, None,
                   sendbuf, recvbuf, count, count * self._n)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._call("reduceScatter", stream, recvcount, datatype, op, None, None,
                   sendbuf, recvbuf, recvcount * self._n, recvcount)

    def send(self, sendbuf, count, datatype, peer, stream):
        self._call("send", stream, count, datatype, None, None, peer, sendbuf, 0, count, 0)

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._call("recv", stream, count, datatype, None, None, peer, 0, recvbuf, 0, count)

    # -- issuing ------------------------------------------------------------------------
    def _check_open(self):
        if not self._open:
            raise NcclError(INVALID_ARGUMENT, "rank %d: the communicator is NULL (destroyed or "
                            "aborted)" % self._rank)

    def _call(self, name, stream, count, datatype, op, root, peer, src, dst, n_src, n_dst):
        self._check_open()
        if self._error is not None:
            raise NcclError(INVALID_ARGUMENT, "rank %d: %s on a communicator with an "
                            "asynchronous error (%s)" % (self._rank, name, self._error))
        what = "rank %d: %s" % (self._rank, name)
        count = int(count)
        if count < 0:
            raise NcclError(INVALID_ARGUMENT, "%s: count %d < 0" % (what, count))
        if datatype not in _DTYPES:
            raise NcclError(INVALID_ARGUMENT, "%s: unknown datatype %r" % (what, datatype))
        if op is not None and op not in _OP_NAMES:
            raise NcclError(INVALID_ARGUMENT, "%s: unknown reduction op %r" % (what, op))
        for arg, value in (("root", root), ("peer", peer)):
            if value is not None and not 0 <= int(value) < self._n:
                raise NcclError(INVALID_ARGUMENT, "%s: %s %d is not a rank of %d"
                                % (what, arg, value, self._n))
        size = np.dtype(_DTYPES[datatype]).itemsize
        src, dst = int(src), int(dst)
        if count == 0:
            return
        for arg, ptr, n in (("sendbuff", src, n_src), ("recvbuff", dst, n_dst)):
            if n and not ptr:
                raise NcclError(INVALID_ARGUMENT, "%s: %s is NULL" % (what, arg))
        in_place = {"allGather": src == dst + self._rank * count * size,
                    "reduceScatter": dst == src + self._rank * count * size}.get(name, src == dst)
        if n_src and n_dst and not in_place and \
                src < dst + n_dst * size and dst < src + n_src * size:
            raise NcclError(INVALID_ARGUMENT, "%s: sendbuff and recvbuff overlap but the call is "
                            "not in place" % what)
        call = self._calls if peer is None else None
        if peer is None:
            self._calls += 1
        elif name == "send":
            call = self._p2p_sent[peer]
            self._p2p_sent[peer] += 1
        else:
            call = self._p2p_received[peer]
            self._p2p_received[peer] += 1
        o = _Op(name, call, count, datatype, op, root, peer)
        o.fail = self._fail_at.pop(self._issued(), None)
        o.src_bytes, o.dst_bytes = n_src * size, n_dst * size
        self._plan(o, src, dst, size)
        if self._group.depth:
            self._group.calls.append((self, o, int(stream)))
        else:
            self._submit([o], [int(stream)])

    def _issued(self):
        self._issued_count = getattr(self, "_issued_count", -1) + 1
        return self._issued_count

    def _plan(self, o, src, dst, size):
        """What ``o`` sends to and expects from each peer, and what it writes."""
        n, me, count = self._n, self._rank, o.count
        nbytes = count * size
        dtype = _DTYPES[o.datatype]
        desc = o.descriptor()
        peers = [o.peer] if o.peer is not None else range(n)
        got = {}

        def expect(p, k):
            o.recvs[p] = (desc, k)

        if o.name == "send":
            def start():
                o.sends = [(o.peer, desc, _view(src, nbytes).copy())]
            o.start = start
            o.finish = lambda: None
            return
        if o.name == "recv":
            expect(o.peer, nbytes)
            o.start = lambda: None
            o.finish = lambda: _view(dst, nbytes).__setitem__(
                slice(None), got.get(o.peer, np.zeros(0, np.uint8)))
            o.got = got
            return
        o.got = got
        for p in peers:
            if p == me:
                continue
            k = {"allReduce": nbytes, "allGather": nbytes, "reduceScatter": nbytes,
                 "reduce": nbytes if me == o.root else 0,
                 "broadcast": nbytes if p == o.root else 0}[o.name]
            expect(p, k)

        def start():
            mine = _view(src, o.src_bytes).copy()
            o.mine = mine
            for p in peers:
                if p == me:
                    continue
                if o.name in ("allReduce", "allGather"):
                    data = mine
                elif o.name == "reduceScatter":
                    data = mine[p * nbytes:(p + 1) * nbytes]
                elif o.name == "reduce":
                    data = mine if p == o.root else mine[:0]
                else:
                    data = mine if me == o.root else mine[:0]
                o.sends.append((p, desc, data))
        o.start = start

        def finish():
            def part(r):
                if r == me:
                    x = o.mine
                    if o.name == "reduceScatter":
                        x = x[me * nbytes:(me + 1) * nbytes]
                    return x
                return got[r]
            if o.name in ("allReduce", "reduceScatter") or (o.name == "reduce" and me == o.root):
                result = reduce_in_rank_order([part(r).view(dtype) for r in range(n)],
                                              o.datatype, o.op, n).view(np.uint8)
                _view(dst, nbytes)[:] = result
            elif o.name == "allGather":
                out = _view(dst, nbytes * n)
                for r in range(n):
                    out[r * nbytes:(r + 1) * nbytes] = part(r)
            elif o.name == "broadcast":
                _view(dst, nbytes)[:] = part(o.root)
        o.finish = finish

    def _submit(self, ops, streams):
        self._check_open()
        launch = _Launch(self, ops, streams)
        for s in set(streams):
            launch.deps += self._host._unfinished(s)
        for s in set(streams):
            self._host.enqueue(s, launch)
        with self._lock:
            self._queue.append(launch)
            self._lock.notify_all()

    # -- the worker: the stand-in's GPU -------------------------------------------------
    def _run(self):
        while True:
            with self._lock:
                while not self._queue and self._open:
                    self._lock.wait(0.5)
                if not self._queue:
                    return
                launch = self._queue[0]
            try:
                if self._error is None and not self._aborting:
                    self._execute(launch)
            except NcclError as exc:
                if not self._aborting:
                    self._set_error(exc)
            except Exception as exc:         # a bug of the stand-in: report it, never hang
                self._set_error(NcclError(INTERNAL_ERROR, "rank %d: %s: %r"
                                          % (self._rank, launch.what, exc)))
            if self._error is not None:
                # as NCCL's kernels after an asynchronous error: the work
                # stays unfinished until the communicator is aborted
                end = time.monotonic() + limit_s()
                with self._lock:
                    while self._open and not self._aborting and time.monotonic() < end:
                        self._lock.wait(0.05)
            with self._lock:
                self._queue.pop(0)
            launch.finished.set()

    def _set_error(self, exc):
        if self._error is None:
            self._error = exc
            text = str(exc).encode()[:_REASON_BYTES]
            if self._ranks[self._rank, 2] == OK:
                reason = self._ranks[self._rank, 8:].view(np.uint8)
                reason[:] = 0
                reason[:len(text)] = np.frombuffer(text, np.uint8)
                self._ranks[self._rank, 2] = FAILED

    def _peer_problem(self, peers):
        """Why one of ``peers`` will not take part any more, or None."""
        for p in peers:
            state = int(self._ranks[p, 2])
            if state != OK:
                reason = ""
                if state == FAILED:
                    reason = ": " + bytes(self._ranks[p, 8:].view(np.uint8)).rstrip(b"\0").decode(
                        errors="replace")
                return "rank %d %s%s" % (p, _STATE_TEXT[state], reason)
            if p != self._rank and not alive(int(self._ranks[p, 0])):
                return "rank %d's process (pid %d) has ended" % (p, self._ranks[p, 0])
        return None

    def _execute(self, launch):
        end = time.monotonic() + limit_s()
        for dep in launch.deps:
            while not dep.finished.wait(0.05):
                if self._aborting:
                    return
                if time.monotonic() > end:
                    raise NcclError(SYSTEM_ERROR, "rank %d: %s waited %g s for %s before it on "
                                    "its stream" % (self._rank, launch.what, limit_s(), dep.what))
        for o in launch.ops:
            if o.fail == "stall":
                while not self._aborting and time.monotonic() < end:
                    time.sleep(0.01)
                raise NcclError(SYSTEM_ERROR, "rank %d: %s stalled (injected)"
                                % (self._rank, o.label()))
            if o.fail is not None:
                raise NcclError(o.fail, "rank %d: %s failed (injected)" % (self._rank, o.label()))
            o.start()
        sends, recvs = {}, {}     # peer -> [(op, descriptor, data)] / [(op, descriptor, nbytes)]
        for o in launch.ops:
            for p, desc, data in o.sends:
                sends.setdefault(p, []).append([o, desc, data, 0])
            for p, (desc, k) in o.recvs.items():
                recvs.setdefault(p, []).append([o, desc, k, []])
        me, n_chunks = self._rank, lambda nbytes: max(1, -(-nbytes // CHUNK))
        posted = {p: 0 for p in sends}    # chunks this launch posted to p
        pause, next_look = 1e-5, time.monotonic() + 0.05
        while sends or recvs or any(
                self._headers[me, p, 1] < self._headers[me, p, 0] for p in posted):
            progress = False
            for p in list(sends):
                h = self._headers[me, p]
                if h[0] != h[1]:
                    continue
                o, desc, data, sent = sends[p][0]
                piece = data[sent * CHUNK:(sent + 1) * CHUNK]
                self._chunks[me, p, :piece.size] = piece
                h[2:8] = desc
                h[8], h[9], h[10] = sent, piece.size, data.size
                h[0] += 1
                posted[p] += 1
                progress = True
                sends[p][0][3] = sent + 1
                if sent + 1 == n_chunks(data.size):
                    sends[p].pop(0)
                    if not sends[p]:
                        del sends[p]
            for p in list(recvs):
                h = self._headers[p, me]
                if h[0] == h[1]:
                    continue
                o, desc, k, parts = recvs[p][0]
                theirs = tuple(int(v) for v in h[2:8])
                if theirs != desc or int(h[10]) != k:
                    self._mismatch(o, p, desc, theirs, k, int(h[10]))
                parts.append(self._chunks[p, me, :int(h[9])].copy())
                h[1] += 1
                progress = True
                if len(parts) == n_chunks(k):
                    o.got[p] = np.concatenate(parts) if len(parts) > 1 else parts[0]
                    recvs[p].pop(0)
                    if not recvs[p]:
                        del recvs[p]
            if progress:
                pause = 1e-5
                continue
            if self._aborting:
                return
            now = time.monotonic()
            if now >= next_look:
                next_look = now + 0.05
                waiting_on = set(recvs) | {p for p in posted
                                           if self._headers[me, p, 1] < self._headers[me, p, 0]}
                problem = self._peer_problem(sorted(waiting_on))
                if problem is not None:
                    raise NcclError(REMOTE_ERROR, "rank %d: %s: %s" % (
                        me, ", ".join(o.label() for o in launch.ops), problem))
                if now > end:
                    raise NcclError(SYSTEM_ERROR, "rank %d: %s waited %g s for ranks %s" % (
                        me, ", ".join(o.label() for o in launch.ops), limit_s(),
                        sorted(waiting_on)))
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        with self._write_lock:
            if self._aborting:
                return
            for o in launch.ops:
                o.finish()

    def _mismatch(self, o, peer, mine, theirs, k, their_bytes):
        names = {v: k for k, v in _KINDS.items()}
        diffs = ["%s %s here, %s on rank %d" % (f, names.get(a, a) if f == "kind" else a,
                                                names.get(b, b) if f == "kind" else b, peer)
                 for f, a, b in zip(_FIELDS, mine, theirs) if a != b]
        if not diffs:
            diffs = ["%d bytes expected, rank %d sends %d" % (k, peer, their_bytes)]
        raise NcclError(INVALID_USAGE, "rank %d: %s does not match rank %d's call: %s" % (
            self._rank, o.label(), peer, "; ".join(diffs)))
