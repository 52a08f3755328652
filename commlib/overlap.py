"""Overlapping the gradient all-reduce with the backward pass:
:class:`BackwardReducer`, PyTorch DDP's reducer for custom loops.

The backward pass produces gradients from the last layer to the first.
The reducer groups the gradient arrays into buckets of consecutive arrays
taken in that (reverse) order, one dtype per bucket, up to ``bucket_bytes``;
as soon as every array of a bucket is final (:meth:`BackwardReducer.ready`)
and every earlier bucket has started, the bucket's asynchronous all-reduce
starts, so the communication of the last layers runs while the first
layers still compute. Buckets start strictly in bucket order on every rank,
so the ranks issue the same collectives in the same order however their
``ready`` calls interleave.
"""
import itertools
import numbers
import weakref

from . import settings
from .errors import ArgumentError
from .ops.arrays import is_cupy
from .collective.reduce_state import ReduceState

#: communicator -> the count of BackwardReducers made with it (the same on
#: every rank: every rank makes its reducers in the same order)
_serials = weakref.WeakKeyDictionary()


#: the reducer's default bucket size (bytes), at least the transport's own
#: (shared memory and MPI: larger buckets than a fused all-reduce's, since
#: every bucket is a collective of its own; ResNet-50 at 2 ranks over shared
#: memory: 1 MiB buckets 48.5 ms a step, 8 MiB 43.3, ``benchmarks/overlap.py``)
REDUCER_BUCKET_BYTES = 8 << 20
#: the default first bucket's cap (bytes): as PyTorch DDP, the last layers'
#: gradients go out as soon as they are ready
FIRST_BUCKET_BYTES = 1 << 20


def backward_buckets(grads, bucket_bytes, first_bucket_bytes=None):
    """Lists of indices into ``grads`` (arrays with ``dtype`` and ``nbytes``):
    consecutive arrays from the last to the first, a new bucket whenever the
    dtype changes or the next array would take it past ``bucket_bytes``
    (``first_bucket_bytes`` for the first bucket, when given; an array
    larger than that is a bucket of its own). Each bucket's indices are
    ascending, so views of one buffer (:func:`commlib.flat_arrays`) stay
    consecutive and are reduced where they lie."""
    buckets, current, dtype, filled = [], [], None, 0
    for i in range(len(grads) - 1, -1, -1):
        a = grads[i]
        cap = bucket_bytes if buckets or first_bucket_bytes is None else first_bucket_bytes
        if current and (a.dtype != dtype or filled + a.nbytes > cap):
            buckets.append(current[::-1])
            current, filled = [], 0
        current.append(i)
        dtype, filled = a.dtype, filled + a.nbytes
    if current:
        buckets.append(current[::-1])
    return buckets


def early_start_pays(comm, grads):
    """``overlap="auto"``'s choice: whether starting buckets during the
    backward pass can shorten the step. Not when the arrays are numpy
    arrays reduced through shared memory (the reduction is then memory-bound
    CPU work) and every usable core of the node already runs a rank (the
    backward pass of a numpy loop fills it): started early, the reduction
    only competes with the computation for the same cores (ResNet-50 at 2
    ranks on 2 cores: 2-9 % slower, ``benchmarks/overlap.py``)."""
    if not grads or is_cupy(grads[0]) or comm.transport_for("numpy") != "shm":
        return True
    return settings.usable_cores() > comm.local_size


class BackwardReducer:
    """Bucketed asynchronous all-reduce of ``grads`` over ``comm`` during
    the backward pass.

    ``grads``: list of persistent gradient arrays (numpy or cupy, in
    parameter order) that the backward pass writes into each step.
    ``bucket_bytes`` (bytes; default the communicator's ``bucket_bytes``,
    else the larger of :data:`REDUCER_BUCKET_BYTES` and its transport's
    default, see :mod:`commlib.collective.bucketing`, with the first bucket capped at
    :data:`FIRST_BUCKET_BYTES`), ``op`` and
    ``compression`` as for :meth:`Communicator.all_reduce`. ``overlap``:
    True starts each bucket as soon as it is ready; False starts them all
    in :meth:`wait`; ``"auto"`` (default) is True unless
    :func:`early_start_pays` says the early start cannot pay on this node.
    The results are the same bits either way.

    Each step: :meth:`ready` for every index as its gradient becomes final,
    then :meth:`wait`. Results are bit-identical to
    ``comm.all_reduce([grads[j] for j in bucket], op=op, compression=compression)``
    called bucket by bucket, for ``bucket`` in :attr:`buckets`, except that
    every bucket keeps compression state of its own (error-feedback
    residuals, partial windows), where such calls share it between buckets
    of the same shapes. Every rank makes its reducers of a communicator in
    the same order (the consistency check compares them).

    Args:
        comm: the :class:`commlib.Communicator`.
        grads: list (or tuple) of the persistent gradient arrays.
        bucket_bytes: a positive int, or None (default) as above.
        op: as for :meth:`Communicator.all_reduce` (default ``"avg"``);
            not checked here: a bad one raises from :meth:`wait`.
        compression: as for :meth:`Communicator.all_reduce` (default None);
            not checked here: a bad one raises from :meth:`wait`.
        overlap: True, False or ``"auto"`` (default).
        agree: as for :meth:`Communicator.all_reduce` (default None): passed
            as ``agree=`` to each bucket's all-reduce; the attribute
            :attr:`agree` may be changed between steps.

    Raises:
        ArgumentError: ``overlap`` is not True, False or ``"auto"``;
            ``grads`` is not a list or tuple, or holds something that is not
            an array (no ``dtype`` and ``nbytes``); ``bucket_bytes`` is not
            a positive int.
    """

    def __init__(self, comm, grads, bucket_bytes=None, op="avg", compression=None,
                 overlap="auto", agree=None):
        rank = comm.rank
        if overlap not in (True, False, "auto"):
            raise ArgumentError("rank %d: BackwardReducer: overlap must be True, False or "
                                "'auto', got %r" % (rank, overlap))
        if not isinstance(grads, (list, tuple)):
            raise ArgumentError("rank %d: BackwardReducer: grads must be a list of arrays, got "
                                "%s" % (rank, type(grads).__name__))
        for i, a in enumerate(grads):
            if not (hasattr(a, "dtype") and hasattr(a, "nbytes")):
                raise ArgumentError("rank %d: BackwardReducer: grads[%d] is not an array: %s"
                                    % (rank, i, type(a).__name__))
        first_bucket_bytes = None
        if bucket_bytes is None:
            kind = "cupy" if grads and is_cupy(grads[0]) else "numpy"
            bucket_bytes = comm.bucket_bytes or max(
                REDUCER_BUCKET_BYTES, comm.bucket_bytes_for(kind))
            first_bucket_bytes = min(FIRST_BUCKET_BYTES, bucket_bytes)
        elif (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral)
              or bucket_bytes < 1):
            raise ArgumentError("rank %d: BackwardReducer: bucket_bytes must be a positive int "
                                "(bytes), got %r" % (rank, bucket_bytes))
        self.comm, self.grads = comm, list(grads)
        self.op, self.compression = op, compression
        #: values every rank's bucket all-reduces carry (``agree=``)
        self.agree = agree
        self.bucket_bytes = int(bucket_bytes)
        #: whether ready() starts buckets (else wait() starts them all)
        self.overlap = early_start_pays(comm, grads) if overlap == "auto" else bool(overlap)
        self._buckets = backward_buckets(self.grads, self.bucket_bytes, first_bucket_bytes)
        serial = next(_serials.setdefault(comm, itertools.count()))
        #: each bucket's plan and compression state, living as long as the reducer
        self._states = [ReduceState("BackwardReducer %d bucket %d" % (serial, k))
                        for k in range(len(self._buckets))]
        self._lists = [[self.grads[j] for j in b] for b in self._buckets]   # reused each step
        self._bucket_of = [0] * len(self.grads)
        for k, bucket in enumerate(self._buckets):
            for j in bucket:
                self._bucket_of[j] = k
        self._reset()

    @property
    def buckets(self):
        """The buckets, in the order they start: lists of indices into grads
        (ascending within a bucket; the first bucket holds the last arrays)."""
        return [list(b) for b in self._buckets]

    def _reset(self):
        self._is_ready = bytearray(len(self.grads))
        self._missing = [len(b) for b in self._buckets]
        self._works = []

    def ready(self, i):
        """``grads[i]`` holds its final value for this step.

        With :attr:`overlap`, starts every bucket, in order, whose arrays
        are all ready (and every earlier bucket has started); its errors
        raise from :meth:`wait`.

        Args:
            i: the index of the array in ``grads``.

        Raises:
            ArgumentError: ``i`` is not an int in ``[0, len(grads))``, or
                ``ready(i)`` was already called in this step.
            ClosedError: a bucket was to start on a communicator that is
                closed or left unusable by an earlier failure.
        """
        rank = self.comm.rank
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) \
                or not 0 <= i < len(self.grads):
            raise ArgumentError("rank %d: BackwardReducer.ready: index must be an int in "
                                "[0, %d), got %r" % (rank, len(self.grads), i))
        if self._is_ready[i]:
            raise ArgumentError("rank %d: BackwardReducer.ready(%d) called twice in one step"
                                % (rank, i))
        self._is_ready[i] = 1
        self._missing[self._bucket_of[i]] -= 1
        if self.overlap:
            self._start(lambda k: self._missing[k] == 0)

    def _start(self, may_start):
        """Start the next buckets in order while ``may_start(k)``."""
        works = self._works
        while len(works) < len(self._buckets) and may_start(len(works)):
            k = len(works)
            works.append(self.comm.all_reduce(self._lists[k], op=self.op,
                                              compression=self.compression, async_op=True,
                                              state=self._states[k], agree=self.agree))

    def wait(self):
        """Finish the step: start the buckets not started yet, wait for all.

        Starts the buckets not started yet (in order) and waits for every
        one; the reducer is then ready for the next step (every index to be
        made :meth:`ready` again), whether or not a bucket failed.

        Returns:
            ``grads``, reduced in place.

        Raises:
            CommlibError: the first bucket's error, in bucket order (after
                waiting for all of them): what :meth:`Work.wait
                <commlib.Work.wait>` of an all-reduce raises (ArgumentError,
                ConsistencyError, CollectiveTimeoutError, PeerError,
                NonFiniteError, PayloadError, ...).
            ClosedError: a bucket was to start on a communicator that is
                closed or left unusable by an earlier failure.
        """
        self._start(lambda k: True)
        works = self._works
        self._reset()
        error = None
        if works:                 # they complete in order: one wake-up waits for all
            try:
                works[-1].wait()
            except Exception:
                pass              # raised below, in bucket order
        for work in works:
            try:
                work.wait()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return self.grads
