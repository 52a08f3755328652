"""Top-K sparsification with error feedback (SINGA's sparse update with
``topK=True, corr=True``; Deep Gradient Compression).

For each float32 bucket of N values, every rank sends only the
``k = max(1, ceil(ratio * N))`` entries of largest magnitude, as (index,
value) pairs: 8k bytes (plus a 16-byte header) instead of 4N. The ranks'
pairs are all-gathered, validated (every rank must send exactly k valid,
distinct indices) and summed into a dense result that every rank computes
identically (rank order, ``commlib.ops.sparse.scatter_add``). With error
feedback (the default) what a rank did not send is kept as a residual and
added to its next gradient of the same bucket, so no update is lost, only
delayed. NaN and +-inf are never sent: ``nonfinite="raise"`` (the default)
raises NonFiniteError on every rank and leaves arrays and residuals as they
were, ``"warn"`` drops them (their residual becomes 0) and warns; see
:class:`~commlib.compression._sparse.Sparsifier`. Selection is the top-K
kernel (``kernels/topk.cu``) on GPUs and its compiled host twin on CPUs
(``commlib/ops/hostselect.py``): ties go to the lowest index.
"""
import math

import numpy as np

from ..errors import ArgumentError
from ..ops import hostselect
from ..ops.topk import topk
from .nonfinite import check_mode
from ._sparse import Sparsifier


class TopK(Sparsifier):
    """Send the ``ratio`` largest-magnitude fraction of each float32 bucket;
    ``nonfinite``: ``"raise"`` or ``"warn"``."""

    def __init__(self, ratio=0.01, error_feedback=True, nonfinite="raise"):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ArgumentError("TopK: ratio must be a number in (0, 1], got %r" % (ratio,))
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)
        self.nonfinite = check_mode(nonfinite, "TopK")
        self.name = "topk(ratio=%r,error_feedback=%s,nonfinite=%r)" % (
            self.ratio, self.error_feedback, self.nonfinite)

    def k_for(self, size):
        """Entries sent from a bucket of ``size`` values."""
        return min(size, max(1, math.ceil(self.ratio * size)))

    def count_for(self, size):
        return self.k_for(size)

    def select(self, acc):
        if type(acc) is np.ndarray:
            return hostselect.topk(acc, self.k_for(acc.size))
        return topk(acc, self.k_for(acc.size))

    def accumulate_and_select(self, residual, flat, acc):
        if type(self).select is not TopK.select:     # a subclass selects its own way
            return super().accumulate_and_select(residual, flat, acc)
        # one compiled pass: the sum, its non-finite entries and the candidates
        return hostselect.topk_accumulate(residual, flat, acc, self.k_for(flat.size))
