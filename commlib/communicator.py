"""The :class:`Communicator`: the one object a training loop talks to.

Its factories make the parts (:mod:`commlib.startup.bootstrap`); each
collective method names its call and hands it to :meth:`Communicator._issue`,
which runs it inline (or queues it, ``async_op=True``) as one of the
functions of :mod:`commlib.collective.collectives`, whose steps are those of
every call: check and agree, plan, move the data, finish. A call's path to
the transport is written down in ``docs/internals.md``. Every collective is
safe:

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

Every collective may raise, besides the errors each method names:
ArgumentError or ArrayTypeError (bad arguments, naming the rank and the
argument; with the consistency check on, the other ranks raise
ConsistencyError naming that rank), CollectiveTimeoutError (the watch dog's
deadline passed, naming the ranks that had not arrived), PeerError (a peer
left or died), TransportError (the MPI or NCCL library failed) and
ClosedError (closed, or left unusable by an earlier failure).

Integer rule: ``op="avg"`` and ``division=True`` need floating dtypes and
raise :class:`~commlib.errors.ArrayTypeError` on integer arrays (no silent
truncation); use ``op="sum"`` and divide yourself.
"""
import math
import time

from . import settings, trace
from .collective import collectives, exchanges, p2p
from .collective.session import Session
from .errors import ArgumentError
from .faults import board as _board
from .startup import bootstrap
from .transport.nccl import NcclSplit


class Communicator:
    """Data-parallel collectives over NCCL (cupy arrays) and/or MPI.

    Build one with :func:`commlib.init`, :meth:`from_mpi`,
    :meth:`from_nccl_id`, :meth:`single` or :meth:`from_transport`; the
    constructor takes a factory's parts and the resolved options
    (:func:`commlib.settings.options`; see
    :class:`~commlib.collective.session.Session`). Arrays are numpy or cupy
    arrays, or any framework's that speak DLPack (:mod:`commlib.interop`).

    Options (the factories' ``**options``, the same on every rank, checked
    when the communicator is made):
        bucket_bytes: cap of a fused bucket (default per transport, see
            :mod:`commlib.collective.bucketing`).
        check: compare every call across ranks before it runs (default
            True, or ``COMMLIB_CHECK``).
        timeout: the watch dog's deadline per collective, seconds (default
            600, or ``COMMLIB_WATCHDOG_TIMEOUT``; ``math.inf`` or
            ``COMMLIB_WATCHDOG_ENABLE=0`` for none).
    """

    def __init__(self, *, options, **parts):
        self._session = Session(options=options, **parts)

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
        return cls(**bootstrap.parts_from_mpi(mpi_comm, device, backend, options))

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
                                                  local_size, settings.options(rank, **options)))

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
        options = settings.options(getattr(transport, "rank", None), **options)
        return cls(options=options, **bootstrap.parts_from_transport(
            transport, cupy_transport, local_rank, local_size, device))

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
        options = settings.options(0, **options)
        return cls(options=options, **bootstrap.parts_single(device))

    # -- the collectives ------------------------------------------------------------------
    def all_reduce(self, arrays, op="sum", division=False, compression=None, async_op=False,
                   state=None, agree=None):
        """Reduce ``arrays`` over all ranks, in place.

        Args:
            arrays: one array or a list (numpy, cupy, or any DLPack array).
            op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``.
            division: True divides the sum by ``size`` (same as ``"avg"``).
            compression: None, ``"fp16"`` or ``"bf16"`` (float32 arrays
                travel as float16 / bfloat16, see
                :mod:`commlib.compression.half`) or a
                :class:`~commlib.compression.Compression`.
            async_op: True returns a :class:`commlib.Work` at once; the
                arrays belong to it until its ``wait()``, which returns them
                and raises every error, argument errors included.
            state: a :class:`commlib.ReduceState` the caller owns, holding
                this list's fusion plan and compression state instead of the
                communicator's per-layout tables; every rank passes one of
                the same name.
            agree: None, or a tuple of values every rank must pass alike
                (e.g. a training step's hyperparameters: ``(("lr", 0.1),)``):
                the consistency check compares them with the call's other
                parameters, at no cost on the wire, and names the ranks and
                values when they differ (not compared with ``check=False``).
                Plain values only: str, int, float, bool, None and tuples
                of them.

        Returns:
            ``arrays`` (a Work with ``async_op=True``).

        Raises:
            ArrayTypeError: ``"avg"`` or ``division=True`` on integer arrays
                (no silent truncation: use ``"sum"`` and divide yourself).
            NonFiniteError: a compression's non-finite check, on every rank
                alike (the communicator stays usable).
            PayloadError: a rank's compressed payload was malformed, on
                every rank alike (the communicator stays usable).
        """
        return self._issue("all_reduce", arrays, async_op, collectives.reduce, arrays, None,
                           op, division, compression, state, agree)

    def broadcast(self, arrays, root=0):
        """Copy rank ``root``'s ``arrays`` into every rank's, in place.

        Args:
            arrays: one array or a list, of the same shapes on every rank.
            root: the rank whose arrays are sent.

        Returns:
            ``arrays``.

        Raises:
            ArgumentError: ``root`` is not a rank (``0 <= root < size``).
        """
        return self._issue("broadcast", arrays, False, collectives.broadcast, arrays, root)

    def reduce(self, arrays, root=0, op="sum", division=False):
        """Reduce ``arrays`` into rank ``root``'s arrays, in place; other
        ranks' arrays are left unchanged.

        Args:
            arrays: one array or a list.
            root: the rank that receives the result.
            op, division: as in :meth:`all_reduce`.

        Returns:
            ``arrays``.

        Raises:
            ArgumentError: ``root`` is not a rank, or ``op`` is unknown.
            ArrayTypeError: ``"avg"`` or ``division=True`` on integer arrays.
        """
        return self._issue("reduce", arrays, False, collectives.reduce, arrays, root, op,
                           division, None, None, None)

    def all_gather(self, array):
        """Every rank's ``array``, stacked.

        Args:
            array: one array, of the same shape and dtype on every rank.

        Returns:
            A new array of shape ``(size, *array.shape)``, of ``array``'s
            kind and dtype (a framework's array comes back as its type).

        Raises:
            ConsistencyError: (consistency check on) the ranks' shapes or
                dtypes differ.
        """
        return self._issue("all_gather", array, False, collectives.all_gather, array)

    def reduce_scatter(self, array, op="sum"):
        """Reduce ``array`` (flattened) over all ranks and return this
        rank's block (block r goes to rank r).

        Args:
            array: one array whose ``size`` is a multiple of ``size``.
            op: as in :meth:`all_reduce`.

        Returns:
            A new 1-D array of ``array.size // size`` elements.

        Raises:
            ArgumentError: ``array.size`` is not a multiple of ``size``, or
                ``op`` is unknown.
        """
        return self._issue("reduce_scatter", array, False, collectives.reduce_scatter, array,
                           op)

    def all_gatherv(self, array):
        """Every rank's 1-D ``array`` (lengths may differ), concatenated in
        rank order.

        Args:
            array: a 1-D array, of one dtype on every rank.

        Returns:
            ``(values, counts)``: a new 1-D array and the int64 numpy array
            of per-rank lengths.

        Raises:
            ArgumentError: ``array`` is not 1-D.
        """
        return self._issue("all_gatherv", array, False, collectives.all_gatherv, array)

    def barrier(self, timeout=None):
        """Block until every rank has called barrier.

        Args:
            timeout: seconds, replacing the watch dog's deadline for this
                call (every rank passes the same), or None.

        Raises:
            ArgumentError: ``timeout`` is not a positive number or None.
        """
        return self._issue("barrier", None, False, collectives.barrier, timeout)

    def scatter(self, arrays, root=0):
        """Rank ``root``'s ``arrays[r]`` to rank r.

        Args:
            arrays: on ``root``, a list of ``size`` arrays of one kind,
                dtype and shape (read only); ignored on the other ranks
                (pass None), which learn the blocks' dtype and shape from
                the root.
            root: the sending rank.

        Returns:
            A new array: this rank's block (of the root's kind, dtype and
            shape; the root's framework's type on the root).

        Raises:
            ArgumentError: ``root`` is not a rank; on the root, ``arrays``
                is not ``size`` arrays of one dtype and shape (the others
                raise ConsistencyError naming the root).
        """
        return self._issue("scatter", None, False, exchanges.scatter, arrays, root)

    def gather(self, array, root=0):
        """Every rank's ``array``, stacked on ``root``.

        Args:
            array: one array, of the same shape and dtype on every rank.
            root: the receiving rank.

        Returns:
            On ``root`` a new array of shape ``(size, *array.shape)`` (row r
            is rank r's); None on the other ranks.

        Raises:
            ArgumentError: ``root`` is not a rank.
            ConsistencyError: (consistency check on) the ranks' shapes or
                dtypes differ.
        """
        return self._issue("gather", array, False, exchanges.gather, array, root)

    def all_to_all(self, send, recv):
        """Block r of ``send`` (flattened, ``size`` equal blocks) goes to
        rank r; ``recv`` receives rank r's block for this rank as its block
        r, in place (``recv`` may be ``send``).

        Args:
            send: one array whose ``size`` is a multiple of ``size``.
            recv: one writeable C-contiguous array of ``send``'s dtype and
                size (any shape).

        Returns:
            ``recv``.

        Raises:
            ArgumentError: ``send.size`` is not a multiple of ``size``, or
                ``recv`` differs from ``send`` in dtype or size.
            ConsistencyError: (consistency check on) the ranks' shapes or
                dtypes differ.
        """
        return self._issue("all_to_all", [send, recv], False, exchanges.all_to_all, send,
                           recv)

    def all_to_allv(self, array, send_counts, recv_counts=None):
        """Block r of the 1-D ``array`` (``send_counts[r]`` elements, blocks
        end to end) goes to rank r; blocks of any length, empty ones too.

        Args:
            array: a 1-D array, of one dtype on every rank.
            send_counts: ``size`` non-negative ints summing to ``array.size``.
            recv_counts: None (the counts are exchanged first), or the
                ``size`` counts this rank receives; with the consistency
                check on they are exchanged anyway and compared: a pair
                whose counts disagree moves nothing and raises
                ConsistencyError on both of its ranks (after the other
                pairs moved); with ``check=False`` they are trusted and
                save that exchange.

        Returns:
            ``(values, counts)``: a new 1-D array, rank r's block for this
            rank at ``counts[:r].sum()``, and the int64 numpy array of those
            counts.

        Raises:
            ArgumentError: ``array`` is not 1-D, or counts that are not
                ``size`` non-negative ints (``send_counts`` summing to
                ``array.size``).
        """
        return self._issue("all_to_allv", array, False, exchanges.all_to_allv, array,
                           send_counts, recv_counts)

    def broadcast_object(self, obj, root=0):
        """Rank ``root``'s picklable ``obj``, on every rank.

        The object is pickled on the root, its length sent first, and
        unpickled on the others: peers of one job are trusted with pickle
        (unpickling runs code of the sender's choosing), as in
        torch.distributed and mpi4py.

        Args:
            obj: any picklable object on ``root``; ignored elsewhere.
            root: the sending rank.

        Returns:
            ``obj`` on the root, an unpickled copy elsewhere.

        Raises:
            ArgumentError: ``root`` is not a rank, or the root's object
                cannot be pickled (the others raise ConsistencyError naming
                the root), or a rank cannot unpickle it (that rank only).
        """
        return self._issue("broadcast_object", None, False, exchanges.broadcast_object, obj,
                           root)

    def all_gather_object(self, obj):
        """Every rank's picklable ``obj``, in rank order (pickled, the
        lengths exchanged first; peers are trusted with pickle, see
        :meth:`broadcast_object`).

        Returns:
            A list of ``size`` unpickled copies, this rank's included.

        Raises:
            ArgumentError: this rank's object cannot be pickled (the others
                raise ConsistencyError naming it), or a rank's cannot be
                unpickled here.
        """
        return self._issue("all_gather_object", None, False, exchanges.all_gather_object,
                           obj)

    def split(self, color, key=None):
        """A communicator of the ranks that pass the same ``color``,
        collectively on every rank (MPI's ``Comm_split``).

        The colours and keys are exchanged through this communicator first
        (checked, bounded by its watch dog), then the new communicator is
        made over the same transports: MPI's ``Comm.Split`` and
        :meth:`from_mpi` on its result (its own status board, consistency
        check and watch dog, with this communicator's options; with NCCL,
        a new NCCL communicator from an ID its rank 0 makes and broadcasts
        over MPI), a new NCCL communicator for an NCCL-only communicator
        (:meth:`from_nccl_id`; the colour's lowest rank makes the ID, which
        travels over this communicator), new thread groups for thread
        ranks. A 2x2 grid is ``comm.split(rank // 2)`` and
        ``comm.split(rank % 2)``; collectives on both may interleave. The
        new communicator's errors name each rank by its rank there and in
        the first communicator: ``rank 1 (world rank 3)``.

        Args:
            color: an int >= 0, or None for a rank that joins no new
                communicator.
            key: orders the ranks of a colour (ties by this rank); None:
                this rank.

        Returns:
            The new Communicator (close it as any other), or None where
            ``color`` is None.

        Raises:
            ArgumentError: ``color`` or ``key`` is not an int (``color`` not
                ``>= 0``), or the transport cannot split (a transport of
                the caller's own without ``split``).
            ConsistencyError: another rank rejected its arguments, or
                called another collective (naming it).
            CollectiveTimeoutError, PeerError: a rank did not call split
                before the deadline, or left or died, also inside MPI's
                ``Comm.Split`` (see docs/failures.md), naming it.
        """
        table, made = self._issue("split", None, False, exchanges.split, color, key)
        if made is None:
            return None
        session = self._session
        sub = self._made_of(made)
        # the new communicator names its ranks by their rank here too
        # ("rank 1 (world rank 3)"), this one's names passed on
        members = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        sub._session.name_world([session.world_rank(r) for _, r in members])
        return sub

    def _made_of(self, made):
        """The communicator of what the transport's ``split`` made."""
        session = self._session
        options = dict(bucket_bytes=session.bucket_bytes, check=session.check,
                       timeout=math.inf if session.timeout is None else session.timeout)
        if made == "single":
            return Communicator.single(session.device, **options)
        if isinstance(made, NcclSplit):         # an NCCL-only communicator
            return Communicator.from_nccl_id(bootstrap.NcclId(made.nccl_id), made.rank,
                                             made.size, session.device, **options)
        if isinstance(made, tuple):             # thread ranks: (group, rank)
            from .transport.threads import ThreadTransport
            group, rank = made
            board = _board.StatusBoard(group.board_memory, rank, group.size) \
                if group.size > 1 else None
            if board is not None:
                board.join()
            threads = ThreadTransport(group, rank)
            return Communicator(rank=rank, size=group.size, local_rank=rank,
                                local_size=group.size, device=session.device,
                                routes={"numpy": threads, "cupy": threads}, board=board,
                                options=settings.options(rank, **options))
        backend = "nccl" if session.routes["cupy"].name == "nccl" else "mpi"
        try:
            return Communicator.from_mpi(made, session.device, backend=backend, **options)
        finally:
            made.Free()

    # -- point to point --------------------------------------------------------------
    def send(self, array, dst, async_op=False):
        """Send ``array`` to rank ``dst``, which receives it with
        :meth:`recv` (same dtype and shape).

        The consistency check (on by default) exchanges a header with
        ``dst`` first: the send completes only once ``dst`` posted its
        receive, and a receive of another dtype or shape raises
        ConsistencyError on both ranks, naming both, with nothing moved
        (see :mod:`commlib.collective.p2p`). Sending to this rank itself
        needs the receive in the same :meth:`batch_send_recv`.

        Args:
            array: one array (numpy, cupy or DLPack), read only.
            dst: the receiving rank.
            async_op: True returns a :class:`commlib.Work` (run in issue
                order with the other asynchronous calls: a send and a
                receive that must meet in one rank's queue go in one
                :meth:`batch_send_recv`).

        Returns:
            None (a Work with ``async_op=True``).

        Raises:
            ArgumentError: ``dst`` is not a rank (on this rank only: there
                is no peer to tell).
            ConsistencyError: the receive does not match, or ``dst``
                rejected its arguments.
            CollectiveTimeoutError: ``dst`` did not receive before the
                deadline (naming it).
        """
        return self._issue("send", array, async_op, p2p.send_recv, "send",
                           [p2p.P2POp("send", array, dst)])

    def recv(self, array, src, async_op=False):
        """Receive into ``array``, in place, what rank ``src`` sends with
        :meth:`send` (same dtype and shape; see there). ``array`` is
        written only once the message arrived whole.

        Args:
            array: one writeable C-contiguous array.
            src: the sending rank.
            async_op: True returns a :class:`commlib.Work`.

        Returns:
            ``array`` (a Work with ``async_op=True``).

        Raises:
            As :meth:`send`, for ``src``.
        """
        return self._issue("recv", array, async_op, p2p.send_recv, "recv",
                           [p2p.P2POp("recv", array, src)], array)

    def batch_send_recv(self, ops, async_op=False):
        """Issue the sends and receives of ``ops`` together and wait for all
        of them: a ring exchange, a halo exchange, sends and receives to
        and from one peer in any order (torch's ``batch_isend_irecv``).

        Messages between two ranks match in order: the n-th send of rank a
        to rank b with the n-th receive of rank b from rank a. With the
        consistency check, each pair's headers are compared first; a pair
        that disagrees moves nothing and raises ConsistencyError on both of
        its ranks, after the other pairs of the batch completed.

        Args:
            ops: a list of :class:`commlib.P2POp` (``P2POp("send", array,
                peer)``, ``P2POp("recv", array, peer)``), arrays of one kind;
                receiving arrays must not share memory.
            async_op: True returns a :class:`commlib.Work`.

        Returns:
            None (a Work with ``async_op=True``).

        Raises:
            ArgumentError: ``ops`` is no list of P2POp, or a peer is not a
                rank (on this rank only).
            ConsistencyError, CollectiveTimeoutError, PeerError: as in
                :meth:`send`, naming the pairs and ranks.
        """
        arrays = [op.array for op in ops] if isinstance(ops, (list, tuple)) else ops
        return self._issue("send_recv", arrays, async_op, p2p.send_recv, "send_recv", ops)

    def _issue(self, name, arrays, async_op, collective, *args):
        """Run ``collective(session, *args)``, collective ``name`` on
        ``arrays``: inline when nothing is queued (its time counted as
        blocked), else on the progress queue after the queued ones
        (returning its :class:`~commlib.progress.work.Work` with
        ``async_op``, else waiting for it)."""
        session = self._session
        if async_op is not True and async_op is not False:
            raise ArgumentError("rank %d: %s: async_op must be True or False, got %r"
                                % (session.rank, name, async_op))
        if async_op or not session.idle():
            work = session.submit(name, lambda: collective(session, *args), arrays, async_op)
            return work if async_op else work.wait()
        start = time.perf_counter()
        try:
            return collective(session, *args)
        finally:
            end = time.perf_counter()
            session.stats.add_blocked(end - start)
            if trace.ON:
                trace.collective(session.rank, name, start, end, False)

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
        decided by the transports, see
        :meth:`~commlib.collective.session.Session.threaded`); settable
        before the first asynchronous collective."""
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
        return session.bucket_bytes_for(session.routes[kind])

    def transport_for(self, kind):
        """The transport that carries arrays of ``kind``.

        Args:
            kind: ``"numpy"`` or ``"cupy"``.

        Returns:
            Its name: ``"shm"``, ``"mpi"``, ``"nccl"``, ``"local"``,
            ``"threads"``, or a transport of one's own's.
        """
        return self._session.routes[kind].name

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
