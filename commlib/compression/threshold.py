"""Threshold sparsification with error feedback (SINGA's sparse update with
``topK=False, corr=True``).

Every rank sends the entries of each float32 bucket whose magnitude exceeds
``threshold``, as (index, value) pairs; how many differs from rank to rank,
so the counts are all-gathered first and the pairs by count (all-gather-v),
then summed into a dense result every rank computes identically. With error
feedback (the default) the entries not sent are kept as a residual and added
to the next gradient of the same bucket, so small values accumulate until
they cross the threshold. Selection is the one-pass compaction kernel
(``kernels/threshold.cu``) on GPUs and its numpy twin on CPUs; NaN is never
selected. A threshold too low for the data sends nearly everything (twice
the bytes of a dense all-reduce).
"""
from ..errors import ArgumentError
from ..ops.threshold import threshold
from ._sparse import Sparsifier


class Threshold(Sparsifier):
    """Send the entries of each float32 bucket with ``|value| > threshold``."""

    same_count = False

    def __init__(self, threshold, error_feedback=True):
        if (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                or not 0 <= threshold < float("inf")):
            raise ArgumentError("Threshold: threshold must be a finite number >= 0, got %r"
                                % (threshold,))
        self.threshold = float(threshold)
        self.error_feedback = bool(error_feedback)
        self.name = "threshold(%r,error_feedback=%s)" % (self.threshold, self.error_feedback)

    def select(self, flat, residual):
        acc = flat
        if residual is not None:
            residual += flat                 # residual + gradient
            acc = residual
        indices, values, count = threshold(acc, self.threshold)
        count = int(count)
        indices, values = indices[:count], values[:count]
        if residual is not None:
            residual[indices] = 0            # sent: no longer owed
        return indices, values
