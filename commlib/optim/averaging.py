"""Averaging a DistributedOptimizer's gradients over the ranks: one
:class:`~commlib.overlap.BackwardReducer` per compression strategy, whose
buckets ``grad_ready`` may start early and ``step`` finishes."""
import numpy as np

from ..errors import ArgumentError
from ..progress.overlap import BackwardReducer


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

    def start(self, i, strategy):
        """``grads[i]`` is final: its bucket may start (see
        :meth:`BackwardReducer.ready <commlib.overlap.BackwardReducer.ready>`)."""
        self.meter.timed(self.reducer_for(strategy).ready, i)

    def average(self, strategy):
        """Average the gradients with ``strategy``, finishing the buckets
        :meth:`start` started."""
        self.meter.timed(self.reducer_for(strategy).wait)
