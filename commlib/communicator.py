"""The :class:`Communicator`: the one object a training loop talks to.

A thin facade: its factories make the parts (:mod:`commlib.startup.bootstrap`), its
methods check how they are called and hand the collective to
:mod:`commlib.progress.issuing` (inline, or queued for ``async_op=True``), which runs
the steps of :mod:`commlib.collective.collectives` on the communicator's
:class:`~commlib.collective.session.Session` (transports, status board, caches). Every
collective is safe:

* **Consistency check** (on by default): before each collective the ranks
  compare fingerprints of their calls on the status board
  (:mod:`commlib.faults.board`); a mismatch, or arguments one rank rejected, raise
  on every rank before any data moves, and the communicator stays usable.
* **Watch dog** (on by default, :data:`commlib.settings.DEFAULT_TIMEOUT`):
  every collective has a deadline; a rank that waits past it raises
  :class:`~commlib.errors.CollectiveTimeoutError` naming the ranks that had
  not arrived. A rank that left (closed, exited, failed) or died ends its
  peers' waits at once with :class:`~commlib.errors.PeerError`.
* **No write after an error**: a collective that fails leaves the
  communicator unusable and never writes into the caller's arrays after
  raising (see docs/failures.md for what they hold).

Integer rule: ``op="avg"`` and ``division=True`` need floating dtypes and
raise :class:`~commlib.errors.ArrayTypeError` on integer arrays (no silent
truncation); use ``op="sum"`` and divide yourself.
"""
from .faults import board as _board
from .startup import bootstrap
from .collective import collectives
from .progress import issuing
from .collective.session import Session


class Communicator:
    """Data-parallel collectives over NCCL (cupy arrays) and/or MPI.

    Build one with :func:`commlib.init`, :meth:`from_mpi`,
    :meth:`from_nccl_id`, :meth:`single` or :meth:`from_transport`. Options
    (every rank must pass the same; checked when the communicator is made):
    ``bucket_bytes`` caps a fused bucket (default per transport, see
    :mod:`commlib.collective.bucketing`); ``check`` (default True, or
    ``COMMLIB_CHECK``) compares every call across ranks before it runs;
    ``timeout`` (seconds; default 600, or ``COMMLIB_WATCHDOG_TIMEOUT``;
    ``math.inf`` or ``COMMLIB_WATCHDOG_ENABLE=0`` for none) is the watch
    dog's deadline per collective. The constructor takes a factory's parts
    (see :class:`~commlib.collective.session.Session`).
    """

    def __init__(self, **parts_and_options):
        self._session = Session(**parts_and_options)

    # -- construction (see commlib.startup.bootstrap) ----------------------------------
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
                :func:`commlib.startup.mpi_library.check_world_size`) but
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
        """A communicator over ``transport``, a
        :class:`commlib.transport.base.Transport` of the caller's own (one
        method per collective), which carries numpy arrays, and cupy arrays
        unless ``cupy_transport`` is given; ``local_rank``/``local_size``
        default to its rank and size; the consistency check exchanges
        fingerprints over it. Raises ArgumentError for a bad option or a
        ``transport`` that is not a Transport."""
        return cls(**bootstrap.parts_from_transport(transport, cupy_transport, local_rank,
                                                    local_size, device), **options)

    @classmethod
    def single(cls, device=None, **options):
        """A communicator of one process that needs no MPI: every collective
        is local (what :func:`commlib.init` gives without mpi4py)."""
        return cls(**bootstrap.parts_single(device), **options)

    # -- properties --------------------------------------------------------------
    rank = property(lambda self: self._session.rank, doc="this process's rank")
    size = property(lambda self: self._session.size, doc="number of ranks")
    local_rank = property(lambda self: self._session.local_rank,
                          doc="rank among this node's ranks")
    local_size = property(lambda self: self._session.local_size,
                          doc="number of ranks on this node")
    device = property(lambda self: self._session.device,
                      doc="GPU ordinal, or None without a GPU")
    check = property(lambda self: self._session.check,
                     doc="whether the consistency check runs before each collective")
    timeout = property(lambda self: self._session.timeout,
                       doc="the watch dog's deadline per collective, seconds (None: off)")
    stats = property(lambda self: self._session.stats,
                     doc="this rank's commlib.CommStats: bytes handed to the transports, "
                         "collectives entered, seconds blocked in them")
    bucket_bytes = property(lambda self: self._session.bucket_bytes,
                            doc="the bucket_bytes option (None: each transport's default)")

    @property
    def backend(self):
        """The transport of cupy arrays: ``"nccl"``, ``"mpi"``, ``"local"``
        for a single process without MPI, or another transport's name."""
        return self._session.routes["cupy"].name

    @property
    def async_threaded(self):
        """Whether asynchronous collectives run on a progress thread (None:
        decided by the transports, see :func:`commlib.progress.issuing.threaded`);
        settable before the first asynchronous collective."""
        return self._session.async_threaded

    @async_threaded.setter
    def async_threaded(self, value):
        self._session.async_threaded = value

    def bucket_bytes_for(self, kind):
        """The fusion bucket cap, in bytes, for arrays of ``kind``
        (``"numpy"`` or ``"cupy"``): the ``bucket_bytes`` option, else the
        default of the transport that carries them."""
        session = self._session
        return session.bucket_bytes_for(session.transport(kind))

    def transport_for(self, kind):
        """The name of the transport that carries arrays of ``kind``
        (``"numpy"`` or ``"cupy"``): ``"shm"``, ``"mpi"``, ``"nccl"``,
        ``"local"``, or a transport of one's own's."""
        return self._session.transport(kind).name

    # -- collectives -----------------------------------------------------------------
    def all_reduce(self, arrays, op="sum", division=False, compression=None, async_op=False,
                   state=None):
        """Reduce ``arrays`` (one array or a list) over all ranks, in place.

        ``op``: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``;
        ``division=True`` divides the sum by ``size`` (same as ``"avg"``).
        ``compression``: None, ``"fp16"`` or ``"bf16"`` (float32 arrays
        travel as float16 / bfloat16, see :mod:`commlib.compression.half`) or
        a :class:`~commlib.compression.Compression`. Returns ``arrays``; with
        ``async_op=True`` a :class:`commlib.Work` at once, whose ``wait()``
        returns them (see :mod:`commlib.progress.work`): the arrays belong to it until
        then, and every error, argument errors included, raises from
        ``wait()``. ``state``: a :class:`commlib.ReduceState` the caller
        owns, holding this list's fusion plan and compression state instead
        of the communicator's per-layout tables; every rank passes one of
        the same name.
        """
        return issuing.issue(self._session, "all_reduce", collectives.reduce,
                             ("all_reduce", arrays, None, op, division, compression, state),
                             async_op, arrays)

    def broadcast(self, arrays, root=0):
        """Copy ``arrays`` of rank ``root`` into every rank's ``arrays``, in
        place. Returns ``arrays``."""
        return issuing.issue(self._session, "broadcast", collectives.broadcast,
                             (arrays, root), arrays=arrays)

    def reduce(self, arrays, root=0, op="sum", division=False):
        """Reduce ``arrays`` into rank ``root``'s arrays, in place; other
        ranks' arrays are left unchanged. Returns ``arrays``."""
        return issuing.issue(self._session, "reduce", collectives.reduce,
                             ("reduce", arrays, root, op, division), arrays=arrays)

    def all_gather(self, array):
        """Every rank's ``array``, stacked: a new array of shape
        ``(size, *array.shape)``, same kind and dtype."""
        return issuing.issue(self._session, "all_gather", collectives.all_gather, (array,),
                             arrays=array)

    def reduce_scatter(self, array, op="sum"):
        """Reduce ``array`` (flattened) over all ranks and return this rank's
        block: a new 1-D array of ``array.size // size`` elements (block r
        goes to rank r). ``array.size`` must be a multiple of ``size``."""
        return issuing.issue(self._session, "reduce_scatter", collectives.reduce_scatter,
                             (array, op), arrays=array)

    def all_gatherv(self, array):
        """Every rank's 1-D ``array`` (lengths may differ), concatenated in
        rank order. Returns ``(values, counts)``: a new 1-D array and the
        int64 numpy array of per-rank lengths."""
        return issuing.issue(self._session, "all_gatherv", collectives.all_gatherv, (array,),
                             arrays=array)

    def barrier(self, timeout=None):
        """Block until every rank has called barrier. ``timeout`` (seconds)
        replaces the watch dog's deadline for this call; every rank must
        pass the same."""
        return issuing.issue(self._session, "barrier", collectives.barrier, (timeout,))

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
        self._session.close(_board.CLOSED)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if value is None:
            self.close()
        else:
            self._session.abandon(_board.CLOSED_ON_EXCEPTION, "%s: %s" % (kind.__name__, value))

    def __del__(self):
        try:
            self._session.abandon(_board.DROPPED, "")
        except Exception:
            pass

    def __repr__(self):
        session = self._session
        return ("<commlib.Communicator rank=%d size=%d backend=%s device=%s%s>"
                % (session.rank, session.size, self.backend, session.device,
                   " closed" if session.closed else ""))
