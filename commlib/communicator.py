"""The :class:`Communicator`: the one object a training loop talks to.

It owns the transports (MPI, NCCL or both), checks arguments before any
communication, fuses lists of arrays into buckets, applies averaging, and
optionally runs the consistency check and the watch dog (a deadline on every
collective).

Integer rule: ``op="avg"`` and ``division=True`` need floating dtypes and
raise :class:`~commlib.errors.ArrayTypeError` on integer arrays (no silent
truncation); use ``op="sum"`` and divide yourself.
"""
import os
import sys
import time

import numpy as np

from . import bucketing, consistency, validation
from . import compression as _compression
from ._cuda import available as _gpu_available, nccl_unavailable_reason
from .bootstrap import NcclId
from .errors import (ArgumentError, BackendUnavailableError, ClosedError, CommlibError,
                     ConsistencyError)
from .ops._arrays import array_module
from .transport.mpi import MpiTransport, mpi

ENV_CHECK = "COMMLIB_CHECK"
ENV_WATCHDOG_ENABLE = "COMMLIB_WATCHDOG_ENABLE"
ENV_WATCHDOG_TIMEOUT = "COMMLIB_WATCHDOG_TIMEOUT"
ENV_ABORT_ON_ERROR = "COMMLIB_ABORT_ON_ERROR"
DEFAULT_WATCHDOG_TIMEOUT = 60.0


def _env_flag(name):
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def _default_timeout():
    if not _env_flag(ENV_WATCHDOG_ENABLE):
        return None
    value = os.environ.get(ENV_WATCHDOG_TIMEOUT, str(DEFAULT_WATCHDOG_TIMEOUT))
    try:
        return float(value)
    except ValueError:
        raise ArgumentError("%s=%r is not a number of seconds" % (ENV_WATCHDOG_TIMEOUT, value)) from None


def _check_timeout(timeout, what="timeout"):
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ArgumentError("%s must be a positive number of seconds or None, got %r"
                            % (what, timeout))
    return float(timeout)


def _gpu_count():
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def _default_device(local_rank):
    return local_rank % _gpu_count()


_abort_hook_installed = False
_ABORT_DRAIN_S = 0.25   # seconds between printing the traceback and MPI_Abort


def _install_abort_hook():
    """Make an uncaught exception on one rank end the whole MPI job
    (``MPI_Abort``) instead of leaving its peers blocked forever."""
    global _abort_hook_installed
    if _abort_hook_installed or not _env_flag_default_on(ENV_ABORT_ON_ERROR):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        time.sleep(_ABORT_DRAIN_S)   # mpiexec drops output still in its pipes at an abort
        mpi().COMM_WORLD.Abort(1)

    sys.excepthook = hook
    _abort_hook_installed = True


def _env_flag_default_on(name):
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


class Communicator:
    """Data-parallel collectives over NCCL (cupy arrays) and/or MPI.

    Build one with :meth:`from_mpi`, :meth:`from_nccl_id` or
    :func:`commlib.init`. ``bucket_bytes`` caps a fused bucket (default per
    transport, see :mod:`commlib.bucketing`); ``check`` turns on the
    consistency check (default: ``COMMLIB_CHECK``); ``timeout`` (seconds) is
    the watch dog's deadline for every collective (default: off, or
    ``COMMLIB_WATCHDOG_TIMEOUT`` when ``COMMLIB_WATCHDOG_ENABLE`` is set).
    """

    def __init__(self, *, rank, size, local_rank, local_size, device=None,
                 mpi_transport=None, nccl_transport=None, bucket_bytes=None,
                 check=None, timeout=None):
        if mpi_transport is None and nccl_transport is None:
            raise ArgumentError("Communicator needs at least one transport")
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or
                                         not isinstance(bucket_bytes, int) or bucket_bytes < 1):
            raise ArgumentError("bucket_bytes must be a positive int (bytes), got %r"
                                % (bucket_bytes,))
        self._rank, self._size = rank, size
        self._local_rank, self._local_size = local_rank, local_size
        self._device = device
        self._mpi, self._nccl = mpi_transport, nccl_transport
        self._bucket_bytes = bucket_bytes
        self._check = _env_flag(ENV_CHECK) if check is None else bool(check)
        self._timeout = _default_timeout() if timeout is None else _check_timeout(timeout)
        self._fusion = bucketing.FusionCache()
        self._workspaces = {}     # compression state, see _workspace()
        self._seq = 0
        self._closed = False

    # -- construction ----------------------------------------------------------
    @classmethod
    def from_mpi(cls, mpi_comm=None, device=None, *, backend=None, **options):
        """Bootstrap over MPI: every rank of ``mpi_comm`` (default
        ``MPI.COMM_WORLD``) calls this.

        ``backend=None`` uses NCCL for cupy arrays when cupy, NCCL and a GPU
        are usable (rank 0 makes the NCCL ID and broadcasts it over MPI), and
        MPI otherwise; ``"mpi"`` or ``"nccl"`` forces one. ``device`` is the
        GPU ordinal (default: local rank modulo the GPU count).
        """
        MPI = mpi()
        if backend not in (None, "mpi", "nccl"):
            raise ArgumentError("backend must be None, 'mpi' or 'nccl', got %r" % (backend,))
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        comm = base.Dup()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank, local_size = local.Get_rank(), local.Get_size()
        local.Free()
        rank, size = comm.Get_rank(), comm.Get_size()
        reason = nccl_unavailable_reason()
        if reason is None and device is None and _gpu_count() < local_size:
            reason = ("%d ranks share this node but it has %d GPU(s); NCCL needs one GPU "
                      "per rank" % (local_size, _gpu_count()))
        if backend == "nccl" and reason is not None:
            raise BackendUnavailableError("rank %d: backend='nccl' but %s" % (rank, reason))
        # NCCL set-up is collective: use it only if every rank can
        use_nccl = backend == "nccl" or (
            backend is None and comm.allreduce(reason is None, op=MPI.LAND))
        if device is None and _gpu_available():
            device = _default_device(local_rank)
        nccl = None
        if use_nccl:
            from .transport.nccl import NcclTransport
            nid = NcclId() if rank == 0 else None
            nid = NcclId(comm.bcast(nid.data if nid is not None else None, root=0))
            nccl = NcclTransport(nid, rank, size, device)
        if size > 1:
            _install_abort_hook()
        return cls(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                   device=device, mpi_transport=MpiTransport(comm), nccl_transport=nccl,
                   **options)

    @classmethod
    def from_nccl_id(cls, nccl_id, rank, size, device=None, *, local_rank=None,
                     local_size=None, **options):
        """Bootstrap from an NCCL ID shared by a parent process (no MPI).

        Every one of the ``size`` processes calls this with the same
        ``nccl_id`` and its own ``rank``. ``device`` defaults to
        ``local_rank`` (default ``rank``) modulo the GPU count.
        """
        if not isinstance(nccl_id, NcclId):
            raise ArgumentError("nccl_id must be a commlib.NcclId, got %s"
                                % type(nccl_id).__name__)
        for name, value in (("rank", rank), ("size", size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ArgumentError("%s must be an int, got %r" % (name, value))
        if size < 1 or not 0 <= rank < size:
            raise ArgumentError("rank=%d, size=%d: expected size >= 1 and 0 <= rank < size"
                                % (rank, size))
        reason = nccl_unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError("rank %d: from_nccl_id needs NCCL: %s" % (rank, reason))
        from .transport.nccl import NcclTransport
        local_rank = rank if local_rank is None else local_rank
        local_size = size if local_size is None else local_size
        if device is None:
            device = _default_device(local_rank)
        return cls(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                   device=device, nccl_transport=NcclTransport(nccl_id, rank, size, device),
                   **options)

    # -- properties --------------------------------------------------------------
    rank = property(lambda self: self._rank, doc="this process's rank, 0 <= rank < size")
    size = property(lambda self: self._size, doc="number of ranks")
    local_rank = property(lambda self: self._local_rank, doc="rank among this node's ranks")
    local_size = property(lambda self: self._local_size, doc="number of ranks on this node")
    device = property(lambda self: self._device, doc="GPU ordinal, or None without a GPU")

    @property
    def backend(self):
        """``"nccl"`` when cupy arrays go over NCCL, else ``"mpi"``."""
        return "nccl" if self._nccl is not None else "mpi"

    @property
    def check(self):
        """Whether the consistency check runs before each collective."""
        return self._check

    @property
    def timeout(self):
        """The watch dog's deadline per collective, in seconds (None: off)."""
        return self._timeout

    # -- plumbing ------------------------------------------------------------------
    def _transport(self, kind):
        if kind == "cupy":
            return self._nccl or self._mpi
        return self._mpi or self._nccl

    def _deadline(self, timeout=None):
        timeout = self._timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    def _bucket_bytes_for(self, transport):
        return self._bucket_bytes or bucketing.DEFAULT_BUCKET_BYTES[transport.name]

    def _begin(self, name, arrays, params, checks):
        """Run ``checks()`` (returns the array kind) and, if on, the
        consistency check; raise on any rank if any rank failed."""
        if self._closed:
            raise ClosedError("rank %d: %s called after close()" % (self._rank, name))
        if not self._check:
            kind = checks()
            self._seq += 1
            return kind
        error = kind = None
        try:
            kind = checks()
        except CommlibError as exc:
            error = exc
        rec = consistency.record(self._seq, name, arrays if error is None else [], params, error)
        gathered = np.empty(self._size * consistency.RECORD_BYTES, dtype=np.uint8)
        self._transport("numpy").all_gather(rec, gathered, self._deadline())
        self._seq += 1
        try:
            consistency.compare(gathered.reshape(self._size, -1), self._rank)
        except ConsistencyError:
            if error is not None:
                raise error from None
            raise
        return kind

    def _array_checks(self, arrays, writeable=True, floating=False):
        return validation.check_arrays(arrays, rank=self._rank, device=self._device,
                                       writeable=writeable, floating=floating)

    def _one_array(self, name, array):
        if isinstance(array, (list, tuple)):
            raise ArgumentError("rank %d: %s takes one array, got a %s"
                                % (self._rank, name, type(array).__name__))

    def _fused_checks(self, items, prepared, writeable, floating):
        """Array checks for a fused collective; a list already prepared with
        checks at least this strict skips them."""
        if (prepared is not None and (prepared.writeable or not writeable)
                and (prepared.floating or not floating)):
            return prepared.kind
        return self._array_checks(items, writeable=writeable, floating=floating)

    def _fused(self, items, kind, key, prepared, writeable, step, compressed=None):
        """Run ``step(transport, flat_buffer, bucket_index_or_None, prepared)``
        for every bucket and every in-place array of the list. With
        ``compressed = (strategy, op, scale, deadline)``, a bucket or array
        the compression strategy applies to goes to the strategy instead."""
        transport = self._transport(kind)
        if prepared is None:
            plan = bucketing.plan_for(items, self._bucket_bytes_for(transport))
            prepared = self._fusion.prepare(key, items, plan, kind, writeable)
        for i, buf in prepared.buckets():
            self._unit(transport, items, prepared, i, i, buf, step, compressed)
        for position, flat in zip(prepared.plan.direct, prepared.direct(items)):
            self._unit(transport, items, prepared, ("direct", position), None, flat, step,
                       compressed)

    def _unit(self, transport, items, prepared, where, i, buf, step, compressed):
        """One bucket (``i``) or in-place array (``i`` None) of a fused
        collective; ``where`` names it within the plan for the compression
        state."""
        strategy = compressed[0] if compressed else None
        if strategy is not None and strategy.applies_to(buf.dtype):
            strategy.reduce(transport, prepared.arrays(items, i, buf), *compressed[1:],
                            workspace=self._workspace(prepared, strategy, where))
        else:
            step(transport, buf, i, prepared)

    def _workspace(self, prepared, strategy, where):
        """The dict a compression strategy keeps for one bucket (``where``)
        of one list layout (``prepared.plan.key``): it lasts as long as the
        communicator, so error-feedback residuals carry over between calls
        with arrays of the same shapes. The layout's table is looked up once
        per prepared list (hashing a layout of many arrays is not free)."""
        if prepared.workspaces is None:
            prepared.workspaces = self._workspaces.setdefault(prepared.plan.key, {})
        found = prepared.workspaces.get((strategy, where))
        if found is None:
            found = prepared.workspaces[(strategy, where)] = {}
        return found

    # -- collectives -----------------------------------------------------------------
    def all_reduce(self, arrays, op="sum", division=False, compression=None):
        """Reduce ``arrays`` (one array or a list) over all ranks, in place.

        ``op``: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``;
        ``division=True`` divides the sum by ``size`` (same as ``"avg"``).
        ``compression``: None, ``"fp16"`` or ``"bf16"`` (float32 arrays
        travel as float16 / bfloat16, see :mod:`commlib.compression.half`) or a
        :class:`~commlib.compression.Compression`. Returns ``arrays``.
        """
        return self._reduce("all_reduce", arrays, None, op, division, compression)

    def broadcast(self, arrays, root=0):
        """Copy ``arrays`` of rank ``root`` into every rank's ``arrays``, in place.
        Returns ``arrays``."""
        items, _ = validation.as_list(arrays)
        key, prepared = self._fusion.lookup(items)
        is_root = self._rank == root

        def checks():
            validation.check_root(root, self._size, self._rank)
            return self._fused_checks(items, prepared, not is_root, False)

        kind = self._begin("broadcast", items, {"root": root}, checks)
        if kind is None:
            return arrays
        deadline = self._deadline()

        def step(transport, buf, i, prepared):
            if i is not None and is_root:
                prepared.pack(items, i)
            transport.broadcast(buf, root, deadline)
            if i is not None and not is_root:
                prepared.unpack(items, i)

        self._fused(items, kind, key, prepared, not is_root, step)
        return arrays

    def reduce(self, arrays, root=0, op="sum", division=False):
        """Reduce ``arrays`` into rank ``root``'s arrays, in place; other
        ranks' arrays are left unchanged. Returns ``arrays``."""
        return self._reduce("reduce", arrays, root, op, division)

    def _reduce(self, name, arrays, root, op, division, compression=None):
        """all_reduce (``root=None``: every rank receives) or reduce to ``root``."""
        items, _ = validation.as_list(arrays)
        averaging = op == "avg" or (division is True and op == "sum")
        receives = root is None or self._rank == root
        key, prepared = self._fusion.lookup(items)
        strategy = None

        def checks():
            nonlocal strategy
            if root is not None:
                validation.check_root(root, self._size, self._rank)
            validation.check_op(op, division, self._rank)
            strategy = _compression.resolve(compression, self._rank)
            if strategy is not None:
                strategy.check(op, self._rank)
            return self._fused_checks(items, prepared, receives, averaging)

        params = {"op": op, "division": division}
        if root is not None:
            params["root"] = root
        if compression is not None:
            params["compression"] = getattr(compression, "name", compression)
        kind = self._begin(name, items, params, checks)
        if kind is None:
            return arrays
        reduce_op = "sum" if op == "avg" else op
        scale = 1.0 / self._size if averaging else None
        deadline = self._deadline()

        def step(transport, buf, i, prepared):
            if i is not None and root is None:
                transport.all_reduce_staged(
                    buf, reduce_op, scale, lambda: prepared.pack(items, i),
                    lambda scale: prepared.unpack(items, i, scale), deadline,
                    prepared.arrays(items, i, buf) if prepared.kind == "numpy" else None)
                return
            if i is not None:
                prepared.pack(items, i)
            if root is None:
                transport.all_reduce(buf, reduce_op, deadline)
            else:
                transport.reduce(buf, root, reduce_op, deadline)
            if receives and i is not None:
                prepared.unpack(items, i, scale)
            elif receives and scale is not None:
                buf *= scale

        self._fused(items, kind, key, prepared, receives, step,
                    (strategy, reduce_op, scale, deadline) if strategy else None)
        return arrays

    def all_gather(self, array):
        """Every rank's ``array``, stacked: a new array of shape
        ``(size, *array.shape)``, same kind and dtype."""
        def checks():
            self._one_array("all_gather", array)
            return self._array_checks([array], writeable=False)

        kind = self._begin("all_gather", [array], {}, checks)
        xp = array_module(array)
        out = xp.empty((self._size,) + tuple(array.shape), dtype=array.dtype)
        if array.size:
            send = xp.ascontiguousarray(array).reshape(-1)
            self._transport(kind).all_gather(send, out.reshape(-1), self._deadline())
        return out

    def reduce_scatter(self, array, op="sum"):
        """Reduce ``array`` (flattened) over all ranks and return this rank's
        block: a new 1-D array of ``array.size // size`` elements (block r
        goes to rank r). ``array.size`` must be a multiple of ``size``."""
        averaging = op == "avg"

        def checks():
            self._one_array("reduce_scatter", array)
            validation.check_op(op, False, self._rank)
            kind = self._array_checks([array], writeable=False, floating=averaging)
            if array.size % self._size:
                raise ArgumentError(
                    "rank %d: reduce_scatter needs array.size divisible by size=%d; got "
                    "array.size=%d (shape %s)" % (self._rank, self._size, array.size,
                                                  tuple(array.shape)))
            return kind

        kind = self._begin("reduce_scatter", [array], {"op": op}, checks)
        xp = array_module(array)
        out = xp.empty(array.size // self._size, dtype=array.dtype)
        if out.size:
            send = xp.ascontiguousarray(array).reshape(-1)
            self._transport(kind).reduce_scatter(send, out, "sum" if averaging else op,
                                                 self._deadline())
            if averaging:
                out *= 1.0 / self._size
        return out

    def all_gatherv(self, array):
        """Every rank's 1-D ``array`` (lengths may differ), concatenated in
        rank order. Returns ``(values, counts)``: a new 1-D array and the
        int64 numpy array of per-rank lengths."""
        def checks():
            kind = self._array_checks([array], writeable=False)
            if array.ndim != 1:
                raise ArgumentError("rank %d: all_gatherv takes a 1-D array, got shape %s"
                                    % (self._rank, tuple(array.shape)))
            return kind

        kind = self._begin("all_gatherv", [array[:0]], {"dtype": str(array.dtype)}, checks)
        counts = np.empty(self._size, dtype=np.int64)
        host = self._transport("numpy")
        host.all_gather(np.array([array.size], dtype=np.int64), counts, self._deadline())
        xp = array_module(array)
        out = xp.empty(int(counts.sum()), dtype=array.dtype)
        if out.size:
            self._transport(kind).all_gatherv(xp.ascontiguousarray(array), out, counts,
                                              self._deadline())
        return out, counts

    def barrier(self, timeout=None):
        """Block until every rank has called barrier. ``timeout`` (seconds)
        overrides the watch dog's deadline for this call."""
        timeout = _check_timeout(timeout)
        self._begin("barrier", [], {}, lambda: None)
        self._transport("numpy").barrier(self._deadline(timeout))

    # -- lifetime -----------------------------------------------------------------------
    def close(self):
        """Release the transports; later calls raise ClosedError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fusion.clear()
        if self._nccl is not None:
            self._nccl.close()
        if self._mpi is not None:
            self._mpi.close()
            try:
                self._mpi.comm.Free()
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return ("<commlib.Communicator rank=%d size=%d backend=%s device=%s%s>"
                % (self._rank, self._size, self.backend, self._device,
                   " closed" if self._closed else ""))
