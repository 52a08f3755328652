"""Averaging a DistributedOptimizer's gradients over the ranks: one
:class:`~commlib.overlap.BackwardReducer` per compression strategy, whose
buckets ``grad_ready`` may start early and ``step`` finishes, each bucket's
all-reduce carrying the update's values that every rank must pass alike
(``agree=``, compared by the communicator's consistency check)."""
import numpy as np

from ..errors import ArgumentError
from ..overlap import BackwardReducer


def check_averaging(overlap, bucket_bytes, rank):
    """ArgumentError unless ``overlap`` is True, False or ``"auto"`` and
    ``bucket_bytes`` None or an int >= 1."""
    if not (isinstance(overlap, (bool, np.bool_)) or overlap == "auto"):
        raise ArgumentError("rank %d: overlap must be True, False or 'auto', got %r"
                            % (rank, overlap))
    if bucket_bytes is not None and (
            isinstance(bucket_bytes, (bool, np.bool_))
            or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1):
        raise ArgumentError("rank %d: bucket_bytes must be None or an int >= 1, got %r"
                            % (rank, bucket_bytes))


class GradientAveraging:
    """The reducers of ``grads``, made at first use.

    Args:
        comm: the communicator.
        grads: the gradient arrays averaged in place.
        meter: the :class:`~commlib.optim.metering.CommMeter` timing the
            collectives.
        bucket_bytes: the buckets' size (None: the transport's).
        overlap: True, False or ``"auto"`` (as the optimizer's).
    """

    def __init__(self, comm, grads, meter, *, bucket_bytes, overlap):
        self.comm, self.grads, self.meter = comm, grads, meter
        self.bucket_bytes, self.overlap = bucket_bytes, overlap
        self.reducers = {}          # strategy name -> BackwardReducer of grads

    def reducer_for(self, strategy):
        """The reducer that averages with ``strategy`` (None: plain)."""
        name = None if strategy is None else strategy.name
        found = self.reducers.get(name)
        if found is None:
            found = self.reducers[name] = BackwardReducer(
                self.comm, self.grads, bucket_bytes=self.bucket_bytes, op="avg",
                compression=strategy, overlap=self.overlap or False)
        return found

    def start(self, i, strategy, agree):
        """``grads[i]`` is final: its bucket may start (see
        :meth:`BackwardReducer.ready <commlib.overlap.BackwardReducer.ready>`),
        its all-reduce carrying ``agree`` (a tuple of plain values)."""
        reducer = self.reducer_for(strategy)
        reducer.agree = agree
        self.meter.timed(reducer.ready, i)

    def average(self, strategy, agree):
        """Average the gradients with ``strategy``, finishing the buckets
        :meth:`start` started; those it starts carry ``agree``."""
        reducer = self.reducer_for(strategy)
        reducer.agree = agree
        self.meter.timed(reducer.wait)
