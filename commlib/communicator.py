"""The :class:`Communicator`: the one object a training loop talks to.

It owns the transports (MPI, NCCL or none for a single process) and the
status board, checks arguments before any communication, fuses lists of
arrays into buckets, applies averaging, and keeps every collective safe:

* **Consistency check** (on by default): before each collective the ranks
  compare fingerprints of their calls on the status board
  (:mod:`commlib.board`); a mismatch, or arguments one rank rejected, raise
  on every rank before any data moves, and the communicator stays usable.
* **Watch dog** (on by default, :data:`commlib.settings.DEFAULT_TIMEOUT`):
  every collective has a deadline; a rank that waits past it raises
  :class:`~commlib.errors.CollectiveTimeoutError` naming the ranks that had
  not arrived. A rank that left (closed, exited, failed) or died ends its
  peers' waits at once with :class:`~commlib.errors.PeerError`.
* **No write after an error**: a collective that fails leaves the
  communicator unusable and never writes into the caller's arrays after
  raising (see the README's "Failures" section for what they hold).

Integer rule: ``op="avg"`` and ``division=True`` need floating dtypes and
raise :class:`~commlib.errors.ArrayTypeError` on integer arrays (no silent
truncation); use ``op="sum"`` and divide yourself.
"""
import time
import weakref
from functools import partial

import numpy as np

from . import board as _board
from . import bootstrap, bucketing, consistency, lifetime, settings, validation
from . import compression as _compression
from .compression.base import Bucket
from .errors import (ArgumentError, ClosedError, CommlibError, ConsistencyError,
                     NonFiniteError, PayloadError)
from .ops._arrays import array_module, is_cupy
from .inflight import InFlight, now, overlap
from .reduce_state import ReduceState
from .stats import CommStats, CountingTransport
from .waiting import Wait, background, relaxed
from .work import GpuOrder, Progress

#: errors a collective raises alike on every rank, after which it stays usable
_AGREED = (NonFiniteError, PayloadError)


class Communicator:
    """Data-parallel collectives over NCCL (cupy arrays) and/or MPI.

    Build one with :func:`commlib.init`, :meth:`from_mpi`,
    :meth:`from_nccl_id` or :meth:`single`. Options (every rank must pass
    the same; checked when the communicator is made): ``bucket_bytes`` caps
    a fused bucket (default per transport, see :mod:`commlib.bucketing`);
    ``check`` (default True, or ``COMMLIB_CHECK``) compares every call across
    ranks before it runs; ``timeout`` (seconds; default 600, or
    ``COMMLIB_WATCHDOG_TIMEOUT``; ``math.inf`` or
    ``COMMLIB_WATCHDOG_ENABLE=0`` for none) is the watch dog's deadline per
    collective.
    """

    def __init__(self, *, rank, size, local_rank, local_size, routes, transports=None,
                 device=None, board=None, segment=None, bucket_bytes=None, check=None,
                 timeout=None):
        """The factories (:meth:`from_mpi`, :meth:`from_nccl_id`,
        :meth:`single`, :meth:`from_transport`) make communicators; this
        takes their parts. ``routes``: ``{"numpy": transport, "cupy":
        transport}``, the :class:`~commlib.transport.base.Transport` that
        carries arrays of each kind; ``transports``: every transport the
        communicator owns, fails and closes (default: those of ``routes``);
        ``board``: the status board of the consistency check and the watch
        dog (None: no check); ``segment``: shared memory to close last."""
        options = bootstrap.check_options(bucket_bytes, check, timeout)
        if not isinstance(routes, dict) or set(routes) != {"numpy", "cupy"}:
            raise ArgumentError("Communicator: routes must be a dict with the keys 'numpy' and "
                                "'cupy', got %r" % (routes,))
        self._rank, self._size = rank, size
        self._local_rank, self._local_size = local_rank, local_size
        self._device = device
        #: array kind -> the transport that carries it
        self._routes = dict(routes)
        #: every transport, the one in front of another first
        self._transports = list(transports or dict.fromkeys(routes.values()))
        self._stats = CommStats()
        #: what collectives call: each transport behind a front counting its bytes
        self._counted = {id(t): CountingTransport(t, self._stats) for t in self._transports}
        self._progress = None     # the queue of asynchronous collectives, made on first use
        self._side = None         # the side stream of asynchronous GPU collectives
        #: run asynchronous collectives on a thread (None: decide, see _threaded())
        self.async_threaded = None
        #: asynchronous all-reduces over MPI in flight at once (see commlib.inflight)
        self.async_depth = settings.async_depth()
        self._bucket_bytes = options["bucket_bytes"]
        self._check = options["check"]
        self._timeout = options["timeout"]
        self._board, self._segment = board, segment
        self._fusion = bucketing.FusionCache()
        self._workspaces = {}     # compression state, see _workspace()
        self._seq = 0             # collectives entered
        self._failure = None      # the error that left the communicator unusable
        self._closed = False
        self._lifetime = lifetime.Registration(abandon=self._abandon_on_exception,
                                               close=self._close_at_exit)
        if board is not None:
            board.warn_after = settings.stall_warning()
        self._relaxed_board = self._sleeping_board(board)
        if size > 1:
            self._lifetime.open()

    # -- construction (see commlib.bootstrap) ----------------------------------
    @classmethod
    def from_mpi(cls, mpi_comm=None, device=None, *, backend=None, **options):
        """Bootstrap over MPI: every rank of ``mpi_comm`` (default
        ``MPI.COMM_WORLD``) calls this (collective).

        ``backend=None`` uses NCCL for cupy arrays when cupy, NCCL and a GPU
        are usable on every rank (rank 0 makes the NCCL ID and broadcasts it
        over MPI), and MPI otherwise; ``"mpi"`` or ``"nccl"`` forces one.
        ``device`` is the GPU ordinal (default: local rank modulo the GPU
        count). A rank that cannot make its communicator, or settings that
        differ between ranks, raise on every rank.

        Raises:
            LaunchError: the launcher said N ranks (``PMI_SIZE``,
                ``OMPI_COMM_WORLD_SIZE``, ...; see
                :func:`commlib.mpi_library.check_world_size`) but
                ``MPI.COMM_WORLD`` has another size; raised before any
                communication, on every process.
        """
        return cls(**bootstrap.parts_from_mpi(mpi_comm, device, backend, options), **options)

    @classmethod
    def from_nccl_id(cls, nccl_id, rank, size, device=None, *, local_rank=None,
                     local_size=None, **options):
        """Bootstrap from an NCCL ID shared by a parent process (no MPI).

        Every one of the ``size`` processes calls this with the same
        ``nccl_id`` and its own ``rank``. ``device`` defaults to
        ``local_rank`` (default ``rank``) modulo the GPU count. Processes on
        one node share a status board in memory named after the ID.
        """
        return cls(**bootstrap.parts_from_nccl_id(nccl_id, rank, size, device, local_rank,
                                                  local_size, options), **options)

    @classmethod
    def from_transport(cls, transport, *, cupy_transport=None, local_rank=None,
                       local_size=None, device=None, **options):
        """A communicator over a transport of the caller's own.

        Args:
            transport: a :class:`commlib.transport.base.Transport` (one
                method per collective); carries numpy arrays, and cupy
                arrays unless ``cupy_transport`` is given.
            cupy_transport: a transport for cupy arrays, or None.
            local_rank, local_size: this rank among the ranks of its node
                (default: the transport's rank and size).
            device: the GPU of cupy arrays, or None.
            options: ``bucket_bytes``, ``check``, ``timeout``, as for every
                factory; the consistency check exchanges fingerprints over
                ``transport``.

        Raises:
            ArgumentError: an option, or ``transport`` is not a Transport.
        """
        return cls(**bootstrap.parts_from_transport(transport, cupy_transport, local_rank,
                                                    local_size, device), **options)

    @classmethod
    def single(cls, device=None, **options):
        """A communicator of one process that needs no MPI: every collective
        is local (what :func:`commlib.init` gives without mpi4py)."""
        return cls(**bootstrap.parts_single(device), **options)

    # -- properties --------------------------------------------------------------
    rank = property(lambda self: self._rank, doc="this process's rank, 0 <= rank < size")
    size = property(lambda self: self._size, doc="number of ranks")
    local_rank = property(lambda self: self._local_rank, doc="rank among this node's ranks")
    local_size = property(lambda self: self._local_size, doc="number of ranks on this node")
    device = property(lambda self: self._device, doc="GPU ordinal, or None without a GPU")

    @property
    def backend(self):
        """The transport of cupy arrays: ``"nccl"``, ``"mpi"``, ``"local"``
        for a single process without MPI, or another transport's name."""
        return self._routes["cupy"].name

    @property
    def check(self):
        """Whether the consistency check runs before each collective."""
        return self._check

    @property
    def timeout(self):
        """The watch dog's deadline per collective, in seconds (None: off)."""
        return self._timeout

    @property
    def bucket_bytes(self):
        """The ``bucket_bytes`` option (None: each transport's default)."""
        return self._bucket_bytes

    def bucket_bytes_for(self, kind):
        """The fusion bucket cap, in bytes, for arrays of ``kind`` (``"numpy"``
        or ``"cupy"``): the ``bucket_bytes`` option, else the default of the
        transport that carries them (:data:`commlib.bucketing.DEFAULT_BUCKET_BYTES`)."""
        return self._bucket_bytes_for(self._transport(kind))

    def transport_for(self, kind):
        """The name of the transport that carries arrays of ``kind``
        (``"numpy"`` or ``"cupy"``): ``"shm"``, ``"mpi"``, ``"nccl"`` or
        ``"local"``."""
        return self._transport(kind).name

    @property
    def stats(self):
        """This rank's :class:`commlib.CommStats`: bytes handed to the
        transports, collectives entered, seconds blocked in them."""
        return self._stats

    # -- plumbing ------------------------------------------------------------------
    def _transport(self, kind):
        """The transport for arrays of ``kind`` (see ``routes``), behind its
        byte counter."""
        return self._counted[id(self._routes[kind])]

    def _bucket_bytes_for(self, transport):
        return self._bucket_bytes or bucketing.default_bucket_bytes(transport.name)

    def _usable(self, name):
        if self._closed:
            raise ClosedError("rank %d: %s called after close()" % (self._rank, name))
        if self._failure is not None:
            raise ClosedError("rank %d: %s called on a communicator left unusable by an "
                              "earlier failure: %s" % (self._rank, name, self._failure),
                              culprits=getattr(self._failure, "culprits", ()))

    def _issue(self, name, run, args, async_op=False, arrays=None):
        """Execute collective ``name`` (``run(*args)``, on ``arrays``): inline
        when nothing is queued, else after the queued ones; ``async_op``:
        queue it and return its Work."""
        if async_op is not True and async_op is not False:
            raise ArgumentError("rank %d: %s: async_op must be True or False, got %r"
                                % (self._rank, name, async_op))
        progress = self._progress
        if not async_op and (progress is None or progress.idle()):
            start = time.perf_counter()
            try:
                return run(*args)
            finally:
                self._stats.add_blocked(time.perf_counter() - start)
        self._usable(name)
        if progress is None:
            progress = self._progress = self._start_progress()
        gpu = self._gpu_order(arrays)
        call = (lambda: run(*args)) if gpu is None else (lambda: gpu.run(lambda: run(*args)))
        work = progress.submit(call, arrays, gpu)
        return work if async_op else work.wait()

    def _start_progress(self):
        me = weakref.ref(self)

        def fail(exc):          # Ctrl-C in a wait, or a collective failing in flight
            comm = me()
            if comm is not None and comm._failure is None:
                comm._fail(exc)

        gone = ClosedError("rank %d: the communicator is gone" % self._rank)
        return Progress(self._stats, self._threaded(), fail,
                        name="commlib-progress-rank%d" % self._rank, depth=self.async_depth,
                        on_error=fail, failed=lambda: getattr(me(), "_failure", gone))

    def _threaded(self):
        """Whether asynchronous collectives run on a progress thread: unless
        :attr:`async_threaded` says otherwise, when there is no MPI
        transport or MPI provides ``MPI_THREAD_MULTIPLE`` (else they run
        deferred, when waited for)."""
        if self.async_threaded is not None:
            return bool(self.async_threaded)
        return all(t.thread_safe() for t in self._transports)

    def _gpu_order(self, arrays):
        """A GpuOrder when ``arrays`` (an array or a list) hold cupy arrays."""
        items = arrays if isinstance(arrays, (list, tuple)) else [arrays]
        if self._device is None or arrays is None or not any(is_cupy(a) for a in items):
            return None
        import cupy
        if self._side is None:
            with cupy.cuda.Device(self._device):
                self._side = cupy.cuda.Stream(non_blocking=True)
        return GpuOrder(cupy, self._device, self._side)

    def _begin(self, name, params, checks, layout=lambda: ([], None), timeout=None):
        """Start collective ``name``: run ``checks()`` (returns the array
        kind; raises CommlibError for bad arguments), then, when the check is
        on, compare the call with every rank: ``params`` (tuple of the call's
        parameters) and ``layout()`` (the list of arrays whose dtypes and
        shapes must match, and its PreparedList or None). ``timeout``
        replaces the watch dog's deadline. Returns (kind, wait) or raises,
        on every rank alike when the check is on."""
        self._usable(name)
        self._stats.add_collective()
        error = kind = None
        try:
            kind = checks()
        except CommlibError as exc:
            error = exc
        seq = self._seq = self._seq + 1
        timeout = self._timeout if timeout is None else timeout
        wait = Wait(None if timeout is None else time.monotonic() + timeout, seq,
                    consistency.CODES[name], self._board, self._rank)
        board = self._board if self._relaxed_board is None or not (
            relaxed() or background() is not None) else self._relaxed_board
        if board is not None and not self._check:
            board.arrive(seq)
        elif board is not None:
            digest = arrays = None
            if error is None:
                arrays, prepared = layout()
                digest = (prepared.digest if prepared is not None else
                          consistency.layout_digest(arrays), consistency.params_digest(params))
            try:
                board.enter(seq, wait.what, digest, wait.deadline, error,
                            lambda: consistency.describe(params, arrays))
            except (CommlibError, KeyboardInterrupt) as exc:
                if exc is not error and not isinstance(exc, ConsistencyError):
                    self._fail(exc)
                raise
        if error is not None:
            raise error
        return kind, wait

    @staticmethod
    def _sleeping_board(board):
        """For the progress thread: a second view of the same status board
        whose compiled waits sleep between short spins
        (:class:`commlib.waiting.SleepingWaits`; without the compiled loops
        the Python waits sleep on a relaxed thread anyway); None when there
        is no status board."""
        if not isinstance(board, _board.StatusBoard):
            return None
        twin = _board.StatusBoard(board.memory, board.rank, board.size, sleeping=True)
        twin.warn_after = board.warn_after
        return twin

    def _fail(self, exc):
        """A collective failed: the communicator is unusable from now on and
        its peers learn that this rank gave up."""
        if self._failure is None:
            self._failure = exc
            if self._board is not None:
                text = "%s: %s" % (type(exc).__name__, exc) if str(exc) else type(exc).__name__
                self._board.leave(self._seq - 1, _board.GAVE_UP, text,
                                  blame=getattr(exc, "culprits", ()))
            for transport in self._transports:
                transport.fail("%s: %s" % (type(exc).__name__, exc))

    def _run(self, step, *args, deferred=False):
        """The data phase of a collective: any failure but an agreed one
        leaves the communicator unusable. Unless it is ``deferred`` (its
        requests left in flight, see :meth:`_in_flight`), the collectives
        in flight complete first."""
        progress = self._progress
        if not deferred and progress is not None and progress.may_defer() \
                and progress.in_flight():
            progress.complete_flight()
        try:
            return step(*args)
        except _AGREED:
            raise
        except BaseException as exc:
            self._fail(exc)
            raise

    def _array_checks(self, arrays, writeable=True, floating=False):
        return validation.check_arrays(arrays, rank=self._rank, device=self._device,
                                       writeable=writeable, floating=floating)

    def _one_array(self, name, array):
        if isinstance(array, (list, tuple)):
            raise ArgumentError("rank %d: %s takes one array, got a %s"
                                % (self._rank, name, type(array).__name__))
        return validation.as_list(array, name, self._rank)[0]

    def _fused_checks(self, items, prepared, writeable, floating):
        """Array checks for a fused collective; a list already prepared with
        checks at least this strict skips them."""
        if (prepared is not None and (prepared.writeable or not writeable)
                and (prepared.floating or not floating)):
            return prepared.kind
        return self._array_checks(items, writeable=writeable, floating=floating)

    def _fused(self, items, kind, key, prepared, writeable, step, compressed=None, state=None):
        """Run ``step(transport, flat_buffer, bucket_index_or_None, prepared)``
        for every bucket and every in-place array of the list. With
        ``compressed = (strategy, op, scale, wait)``, a bucket or array
        the compression strategy applies to goes to the strategy instead;
        ``state`` (a :class:`~commlib.reduce_state.ReduceState` or None)
        holds the list's plan and compression state instead of the
        communicator's own tables."""
        transport = self._transport(kind)
        if prepared is None:
            plan = bucketing.plan_for(items, self._bucket_bytes_for(transport))
            fusion = self._fusion if state is None else state.fusion
            prepared = fusion.prepare(key, items, plan, kind, writeable)
            prepared.digest = consistency.layout_digest(items)
        tables = self._workspaces if state is None else state.workspaces
        for i, buf in prepared.buckets():
            self._unit(transport, items, prepared, i, i, buf, step, compressed, tables)
        for position, flat in zip(prepared.plan.direct, prepared.direct(items)):
            self._unit(transport, items, prepared, ("direct", position), None, flat, step,
                       compressed, tables)

    def _unit(self, transport, items, prepared, where, i, buf, step, compressed, tables):
        """One bucket (``i``) or in-place array (``i`` None) of a fused
        collective; ``where`` names it within the plan for the compression
        state, kept in ``tables``."""
        strategy = compressed[0] if compressed else None
        if strategy is not None and strategy.applies_to(buf.dtype):
            strategy.reduce(Bucket(transport, prepared.arrays(items, i, buf), *compressed[1:],
                                   state=self._workspace(prepared, strategy, where, tables)))
        else:
            step(transport, buf, i, prepared)

    @staticmethod
    def _workspace(prepared, strategy, where, tables):
        """The dict a compression strategy keeps for one bucket (``where``)
        of one list layout (``prepared.plan.key``) in ``tables`` (the
        communicator's, or a ReduceState's): it lasts as long as they do, so
        error-feedback residuals carry over between calls with arrays of the
        same shapes. It is keyed by the strategy's settings (its ``name``),
        not the object: a new object with the same settings continues where
        the last one stopped, on every rank alike. The layout's table is
        looked up once per prepared list (hashing a layout of many arrays is
        not free)."""
        if prepared.workspaces is None:
            prepared.workspaces = tables.setdefault(prepared.plan.key, {})
        key = (strategy.name, where)
        found = prepared.workspaces.get(key)
        if found is None:
            found = prepared.workspaces[key] = {}
        return found

    # -- collectives -----------------------------------------------------------------
    def all_reduce(self, arrays, op="sum", division=False, compression=None, async_op=False,
                   state=None):
        """Reduce ``arrays`` (one array or a list) over all ranks, in place.

        ``op``: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``;
        ``division=True`` divides the sum by ``size`` (same as ``"avg"``).
        ``compression``: None, ``"fp16"`` or ``"bf16"`` (float32 arrays
        travel as float16 / bfloat16, see :mod:`commlib.compression.half`) or a
        :class:`~commlib.compression.Compression`. Returns ``arrays``; with
        ``async_op=True`` a :class:`commlib.Work` at once, whose ``wait()``
        returns them (see :mod:`commlib.work`): the arrays belong to it
        until then, and every error, argument errors included, raises from
        ``wait()``. ``state``: a :class:`commlib.ReduceState` the caller
        owns, holding this list's fusion plan and compression state instead
        of the communicator's tables (kept per list layout, so lists of the
        same shapes would share residuals); every rank passes one of the
        same name.
        """
        return self._issue("all_reduce", self._reduce, ("all_reduce", arrays, None, op,
                                                        division, compression, state),
                           async_op, arrays)

    def broadcast(self, arrays, root=0):
        """Copy ``arrays`` of rank ``root`` into every rank's ``arrays``, in place.
        Returns ``arrays``."""
        return self._issue("broadcast", self._broadcast, (arrays, root), arrays=arrays)

    def _broadcast(self, arrays, root):
        is_root = self._rank == root
        items, key, prepared = [], None, None

        def checks():
            nonlocal items, key, prepared
            items = validation.as_list(arrays, rank=self._rank)[0]
            key, prepared = self._fusion.lookup(items)
            validation.check_root(root, self._size, self._rank)
            return self._fused_checks(items, prepared, not is_root, False)

        kind, wait = self._begin("broadcast", ("broadcast", root), checks,
                                 lambda: (items, prepared))
        if kind is None:
            return arrays

        def step(transport, buf, i, prepared):
            if i is not None and is_root:
                prepared.pack(items, i)
            transport.broadcast(buf, root, wait, owned=i is not None)
            if i is not None and not is_root:
                prepared.unpack(items, i)

        self._run(self._fused, items, kind, key, prepared, not is_root, step)
        return arrays

    def reduce(self, arrays, root=0, op="sum", division=False):
        """Reduce ``arrays`` into rank ``root``'s arrays, in place; other
        ranks' arrays are left unchanged. Returns ``arrays``."""
        return self._issue("reduce", self._reduce, ("reduce", arrays, root, op, division),
                           arrays=arrays)

    def _reduce(self, name, arrays, root, op, division, compression=None, state=None):
        """all_reduce (``root=None``: every rank receives) or reduce to ``root``;
        ``state``: see :meth:`_fused` (compared between ranks like the call's
        parameters)."""
        averaging = op == "avg" or (division is True and op == "sum")
        receives = root is None or self._rank == root
        items, key, prepared, strategy = [], None, None, None
        fusion = state.fusion if isinstance(state, ReduceState) else self._fusion

        def checks():
            nonlocal items, key, prepared, strategy
            if state is not None and not isinstance(state, ReduceState):
                raise ArgumentError("rank %d: %s: state must be a commlib.ReduceState or "
                                    "None, got %s" % (self._rank, name, type(state).__name__))
            items = validation.as_list(arrays, rank=self._rank)[0]
            key, prepared = fusion.lookup(items)
            if root is not None:
                validation.check_root(root, self._size, self._rank)
            validation.check_op(op, division, self._rank)
            strategy = _compression.resolve(compression, self._rank)
            if strategy is not None:
                strategy.check("sum" if op == "avg" else op, self._rank)
            return self._fused_checks(items, prepared, receives, averaging)

        reduce_op = "sum" if op == "avg" else op
        params = (name, reduce_op, averaging, root,
                  None if compression is None else getattr(compression, "name", compression))
        if isinstance(state, ReduceState):
            params += (state.name,)
        kind, wait = self._begin(name, params, checks, lambda: (items, prepared))
        if kind is None:
            return arrays
        scale = 1.0 / self._size if averaging else None
        flight = None
        if root is None and strategy is None:
            flight = self._in_flight(kind, items, wait)
        after = now if flight is None else flight.then

        def step(transport, buf, i, prepared):
            if i is not None and root is None and transport.reduces_parts(buf):
                transport.all_reduce_parts(prepared.arrays(items, i, buf), buf, reduce_op,
                                           scale, wait)
                return
            if i is not None:
                prepared.pack(items, i)
            owned = i is not None and not prepared.zero_copy(i)
            # the user's own memory is scaled by the transport as it writes the
            # result; a packed bucket, as it is copied out
            scaled = root is None and not owned
            if root is None and flight is not None:
                transport.all_reduce(buf, reduce_op, wait, owned=owned,
                                     scale=scale if scaled else None, defer=flight)
            elif root is None:
                transport.all_reduce(buf, reduce_op, wait, owned=owned,
                                     scale=scale if scaled else None)
            else:
                transport.reduce(buf, root, reduce_op, wait, owned=owned)
            if flight is not None:
                flight.nbytes += buf.nbytes
            if receives and i is not None and not (scaled and prepared.zero_copy(i)):
                after(partial(prepared.unpack, items, i, None if scaled else scale))
            elif receives and scale is not None and not scaled:
                buf *= scale

        self._run(self._fused, items, kind, key, prepared, receives, step,
                  (strategy, reduce_op, scale, wait) if strategy else None, state,
                  deferred=flight is not None)
        return arrays

    def _in_flight(self, kind, items, wait):
        """For an all-reduce of ``items`` executing on the progress thread:
        an InFlight (registered with the progress thread, with a Wait of its
        own) when its data phase may leave its requests in flight: numpy
        arrays over the MPI transport, pipelining on, and no memory shared
        with a collective in flight (else None: it runs whole, after them)."""
        progress = self._progress
        if (kind != "numpy" or progress is None or not progress.may_defer()
                or not items or not self._transport(kind).defers(items[0])):
            return None
        flight = InFlight(wait, holds=items)
        earlier = progress.in_flight()
        if earlier and any(overlap(flight.spans(), f.spans()) for f in earlier):
            return None
        progress.defer(flight)
        return flight

    def all_gather(self, array):
        """Every rank's ``array``, stacked: a new array of shape
        ``(size, *array.shape)``, same kind and dtype."""
        return self._issue("all_gather", self._all_gather, (array,), arrays=array)

    def _all_gather(self, array):
        def checks():
            self._one_array("all_gather", array)
            return self._array_checks([array], writeable=False)

        kind, wait = self._begin("all_gather", ("all_gather",), checks, lambda: ([array], None))
        xp = array_module(array)
        out = xp.empty((self._size,) + tuple(array.shape), dtype=array.dtype)
        if self._size == 1:
            out[0] = array
        elif array.size:
            send = xp.ascontiguousarray(array).reshape(-1)
            self._run(self._transport(kind).all_gather, send, out.reshape(-1), wait)
        return out

    def reduce_scatter(self, array, op="sum"):
        """Reduce ``array`` (flattened) over all ranks and return this rank's
        block: a new 1-D array of ``array.size // size`` elements (block r
        goes to rank r). ``array.size`` must be a multiple of ``size``."""
        return self._issue("reduce_scatter", self._reduce_scatter, (array, op), arrays=array)

    def _reduce_scatter(self, array, op):
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

        kind, wait = self._begin("reduce_scatter", ("reduce_scatter", op), checks,
                                 lambda: ([array], None))
        xp = array_module(array)
        out = xp.empty(array.size // self._size, dtype=array.dtype)
        if self._size == 1:
            out[...] = array.reshape(-1)
        elif out.size:
            send = xp.ascontiguousarray(array).reshape(-1)
            self._run(self._transport(kind).reduce_scatter, send, out,
                      "sum" if averaging else op, wait)
        if averaging:
            out *= 1.0 / self._size
        return out

    def all_gatherv(self, array):
        """Every rank's 1-D ``array`` (lengths may differ), concatenated in
        rank order. Returns ``(values, counts)``: a new 1-D array and the
        int64 numpy array of per-rank lengths."""
        return self._issue("all_gatherv", self._all_gatherv, (array,), arrays=array)

    def _all_gatherv(self, array):
        def checks():
            self._one_array("all_gatherv", array)
            kind = self._array_checks([array], writeable=False)
            if array.ndim != 1:
                raise ArgumentError("rank %d: all_gatherv takes a 1-D array, got shape %s"
                                    % (self._rank, tuple(array.shape)))
            return kind

        dtype = getattr(array, "dtype", None)
        kind, wait = self._begin("all_gatherv", ("all_gatherv", str(dtype)), checks)
        xp = array_module(array)
        if self._size == 1:
            return xp.array(array, copy=True), np.array([array.size], dtype=np.int64)
        counts = np.empty(self._size, dtype=np.int64)
        host = self._transport("numpy")
        self._run(host.all_gather, np.array([array.size], dtype=np.int64), counts, wait)
        out = xp.empty(int(counts.sum()), dtype=array.dtype)
        if out.size:
            self._run(self._transport(kind).all_gatherv, xp.ascontiguousarray(array), out,
                      counts, wait)
        return out, counts

    def barrier(self, timeout=None):
        """Block until every rank has called barrier. ``timeout`` (seconds)
        replaces the watch dog's deadline for this call; every rank must
        pass the same."""
        return self._issue("barrier", self._barrier, (timeout,))

    def _barrier(self, timeout):
        own = None
        if timeout is not None:
            try:
                own = settings.seconds(timeout, "timeout")
            except ArgumentError as exc:
                own = exc

        def checks():
            if isinstance(own, ArgumentError):
                raise ArgumentError("rank %d: barrier: %s" % (self._rank, own))

        _, wait = self._begin("barrier", ("barrier", timeout), checks,
                              timeout=own if isinstance(own, float) else None)
        if self._size > 1:
            self._run(self._transport("numpy").barrier, wait)

    # -- lifetime -----------------------------------------------------------------------
    def close(self):
        """Release the communicator; later calls raise ClosedError. Idempotent.

        Every rank must close after the same number of collectives: ``close``
        waits (up to the watch dog's deadline) until every rank has closed,
        and raises PeerError when a rank is still calling collectives
        (uneven number of steps; that rank raises too) or left otherwise.
        It never calls a blocking MPI function, and releases this rank's
        resources whatever happens.
        """
        self._close(_board.CLOSED)

    def _close(self, reason):
        if self._closed:
            return
        try:
            if self._progress is not None:
                self._progress.drain()        # outstanding asynchronous collectives
            board, failed = self._board, self._failure is not None
            if board is not None and not failed:
                board.leave(self._seq, reason)
                deadline = None if self._timeout is None else time.monotonic() + self._timeout
                board.wait_left(self._seq, deadline)
        finally:
            self._release()

    def _abandon_on_exception(self, text):
        self._abandon(_board.CLOSED_ON_EXCEPTION, text)

    def _close_at_exit(self):
        self._close(_board.EXITED)

    def _abandon(self, reason, text):
        """Leave without waiting for anyone (an exception is on its way up)."""
        if self._closed:
            return
        if self._board is not None:
            self._board.leave(self._seq, reason, text)
        self._release()

    def _release(self):
        """Free this rank's resources; never waits for the other ranks."""
        self._closed = True
        self._lifetime.closed()
        if not self._quiesce():
            return        # a collective still runs on the progress thread: keep its memory
        self._fusion.clear()
        for transport in self._transports:
            transport.close()
        if self._segment is not None:
            self._board = None
            self._segment.close()
            self._segment = None

    def _quiesce(self):
        """End the progress thread: queued collectives fail with ClosedError,
        the one executing is interrupted (as by Ctrl-C). Returns whether it
        is idle (it stops within milliseconds, its waits return to Python
        often)."""
        progress = self._progress
        if progress is None:
            return True
        progress.stop()
        progress.cancel_queued(ClosedError("rank %d: the communicator was closed before this "
                                           "collective started" % self._rank))
        return progress.interrupt()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if value is None:
            self.close()
        else:
            self._abandon(_board.CLOSED_ON_EXCEPTION, "%s: %s" % (kind.__name__, value))

    def __del__(self):
        try:
            self._abandon(_board.DROPPED, "")
        except Exception:
            pass

    def __repr__(self):
        return ("<commlib.Communicator rank=%d size=%d backend=%s device=%s%s>"
                % (self._rank, self._size, self.backend, self._device,
                   " closed" if self._closed else ""))
