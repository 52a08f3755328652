"""The :class:`Communicator`: the one object a training loop talks to.

A thin facade: its factories make the parts (:mod:`commlib.startup.bootstrap`), its
collective methods (:class:`~commlib.collective.calls.CollectiveCalls`, its
base class) name the call and hand it to
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
from .collective.calls import CollectiveCalls
from .collective.session import Session


class Communicator(CollectiveCalls):
    """Data-parallel collectives over NCCL (cupy arrays) and/or MPI.

    Build one with :func:`commlib.init`, :meth:`from_mpi`,
    :meth:`from_nccl_id`, :meth:`single` or :meth:`from_transport`; the
    constructor takes a factory's parts (see
    :class:`~commlib.collective.session.Session`). Arrays are numpy or cupy
    arrays, or any framework's that speak DLPack (:mod:`commlib.interop`).

    Args:
        bucket_bytes: cap of a fused bucket (default per transport, see
            :mod:`commlib.collective.bucketing`).
        check: compare every call across ranks before it runs (default
            True, or ``COMMLIB_CHECK``).
        timeout: the watch dog's deadline per collective, seconds (default
            600, or ``COMMLIB_WATCHDOG_TIMEOUT``; ``math.inf`` or
            ``COMMLIB_WATCHDOG_ENABLE=0`` for none). Every rank passes the
            same options; they are checked when the communicator is made.

    The collectives (``all_reduce``, ``broadcast``, ``reduce``,
    ``all_gather``, ``reduce_scatter``, ``all_gatherv``, ``barrier``) are
    the methods of its base class,
    :class:`~commlib.collective.calls.CollectiveCalls`, where the errors
    every collective may raise are listed.
    """

    def __init__(self, **parts_and_options):
        super().__init__(Session(**parts_and_options))

    # -- construction (see commlib.startup.bootstrap) ----------------------------------
    @classmethod
    def from_mpi(cls, mpi_comm=None, device=None, *, backend=None, **options):
        """Bootstrap over MPI, collectively on every rank of ``mpi_comm``.

        Args:
            mpi_comm: an mpi4py communicator (default ``MPI.COMM_WORLD``).
            device: GPU ordinal (default: local rank modulo the GPU count).
            backend: None: NCCL for cupy arrays when cupy, NCCL and a GPU are
                usable on every rank (rank 0 makes the NCCL ID and broadcasts
                it over MPI), else MPI; ``"mpi"`` or ``"nccl"`` forces one.
            **options: ``bucket_bytes``, ``check``, ``timeout`` (see the class).

        Returns:
            The Communicator of this rank.

        Raises:
            LaunchError: the launcher said N ranks (``PMI_SIZE``,
                ``OMPI_COMM_WORLD_SIZE``, ...; see
                :func:`commlib.startup.mpi_library.check_world_size`) but
                ``MPI.COMM_WORLD`` has another size; before any
                communication, on every process.
            ArgumentError, BackendUnavailableError: bad options, settings
                that differ between ranks, or a rank that cannot make its
                communicator: raised on every rank.
        """
        return cls(**bootstrap.parts_from_mpi(mpi_comm, device, backend, options), **options)

    @classmethod
    def from_nccl_id(cls, nccl_id, rank, size, device=None, *, local_rank=None,
                     local_size=None, **options):
        """Bootstrap from an NCCL ID shared by a parent process (no MPI).

        Args:
            nccl_id: the :class:`commlib.NcclId` every process was given.
            rank, size: this process's rank and the number of processes.
            device: GPU ordinal (default ``local_rank`` modulo the GPU count).
            local_rank, local_size: place among this node's processes
                (default ``rank`` and ``size``); they share a status board
                in memory named after the ID.
            **options: ``bucket_bytes``, ``check``, ``timeout`` (see the class).

        Returns:
            The Communicator of this rank.

        Raises:
            ArgumentError: bad rank, size or options.
            BackendUnavailableError: cupy, NCCL or the GPU are not usable.
        """
        return cls(**bootstrap.parts_from_nccl_id(nccl_id, rank, size, device, local_rank,
                                                  local_size, options), **options)

    @classmethod
    def from_transport(cls, transport, *, cupy_transport=None, local_rank=None,
                       local_size=None, device=None, **options):
        """A communicator over a :class:`commlib.transport.base.Transport`
        of the caller's own (one method per collective).

        Args:
            transport: carries numpy arrays, cupy arrays too unless
                ``cupy_transport`` is given, and the consistency check's
                fingerprints.
            cupy_transport: a Transport for cupy arrays, or None.
            local_rank, local_size: default the transport's rank and size.
            device: GPU ordinal, or None.
            **options: ``bucket_bytes``, ``check``, ``timeout`` (see the class).

        Returns:
            The Communicator of this rank.

        Raises:
            ArgumentError: a bad option, or a ``transport`` that is not a
                Transport.
        """
        return cls(**bootstrap.parts_from_transport(transport, cupy_transport, local_rank,
                                                    local_size, device), **options)

    @classmethod
    def single(cls, device=None, **options):
        """A communicator of one process that needs no MPI: every collective
        is local (what :func:`commlib.init` gives without mpi4py).

        Args:
            device: GPU ordinal for cupy arrays, or None.
            **options: ``bucket_bytes``, ``check``, ``timeout`` (see the class).

        Returns:
            The Communicator (rank 0 of 1).
        """
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
        """The fusion bucket cap for arrays of ``kind``.

        Args:
            kind: ``"numpy"`` or ``"cupy"``.

        Returns:
            Bytes: the ``bucket_bytes`` option, else the default of the
            transport that carries arrays of ``kind``.
        """
        session = self._session
        return session.bucket_bytes_for(session.transport(kind))

    def transport_for(self, kind):
        """The transport that carries arrays of ``kind``.

        Args:
            kind: ``"numpy"`` or ``"cupy"``.

        Returns:
            Its name: ``"shm"``, ``"mpi"``, ``"nccl"``, ``"local"``,
            ``"threads"``, or a transport of one's own's.
        """
        return self._session.transport(kind).name

    # -- lifetime -----------------------------------------------------------------------
    def close(self):
        """Release the communicator; later calls raise ClosedError. Idempotent.

        Every rank must close after the same number of collectives: ``close``
        waits (up to the watch dog's deadline) until every rank has closed.
        It never calls a blocking MPI function, and releases this rank's
        resources whatever happens.

        Raises:
            PeerError: a rank is still calling collectives (uneven number of
                steps; the ranks whose count differs from the majority's are
                named, and raise too) or left otherwise.
            CollectiveTimeoutError: a rank neither closed nor left before
                the deadline.
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
