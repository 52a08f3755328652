"""The collectives a :class:`~commlib.Communicator` offers, as methods of
:class:`CollectiveCalls`, its base class: each one names its collective and
its arguments and hands them to :func:`commlib.progress.issuing.issue`
(inline, or queued with ``async_op=True``), which runs the collective's
steps (:mod:`commlib.collective.collectives`) on the communicator's
:class:`~commlib.collective.session.Session`.

Every collective may raise, besides the errors each method names:
ArgumentError or ArrayTypeError (bad arguments, naming the rank and the
argument; with the consistency check on, the other ranks raise
ConsistencyError naming that rank), CollectiveTimeoutError (the watch dog's
deadline passed, naming the ranks that had not arrived), PeerError (a peer
left or died), TransportError (the MPI or NCCL library failed) and
ClosedError (closed, or left unusable by an earlier failure).
"""
from functools import partial

from . import collectives
from ..progress import issuing


class CollectiveCalls:
    """The collective methods of a communicator over ``session`` (a
    :class:`~commlib.collective.session.Session`).

    Args:
        session: the communicator's Session, made by a factory of
            :class:`~commlib.Communicator`.
    """

    def __init__(self, session):
        self._session = session

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
        run = partial(collectives.reduce, name="all_reduce", arrays=arrays, root=None, op=op,
                      division=division, compression=compression, state=state, agree=agree)
        return issuing.issue(self._session, "all_reduce", run, async_op=async_op, arrays=arrays)

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
        run = partial(collectives.broadcast, arrays=arrays, root=root)
        return issuing.issue(self._session, "broadcast", run, arrays=arrays)

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
        run = partial(collectives.reduce, name="reduce", arrays=arrays, root=root, op=op,
                      division=division)
        return issuing.issue(self._session, "reduce", run, arrays=arrays)

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
        run = partial(collectives.all_gather, given=array)
        return issuing.issue(self._session, "all_gather", run, arrays=array)

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
        run = partial(collectives.reduce_scatter, given=array, op=op)
        return issuing.issue(self._session, "reduce_scatter", run, arrays=array)

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
        run = partial(collectives.all_gatherv, given=array)
        return issuing.issue(self._session, "all_gatherv", run, arrays=array)

    def barrier(self, timeout=None):
        """Block until every rank has called barrier.

        Args:
            timeout: seconds, replacing the watch dog's deadline for this
                call (every rank passes the same), or None.

        Raises:
            ArgumentError: ``timeout`` is not a positive number or None.
        """
        run = partial(collectives.barrier, timeout=timeout)
        return issuing.issue(self._session, "barrier", run)
