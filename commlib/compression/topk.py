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
    """Send the ``ratio`` largest-magnitude fraction of each float32 bucket.

    Every rank sends exactly :meth:`k_for` entries per bucket; ``sum`` and
    ``avg`` only (see :class:`~commlib.compression._sparse.Sparsifier`).

    Args:
        ratio: the fraction of each bucket sent, a number in (0, 1]
            (default 0.01).
        error_feedback: keep what was not sent as a residual added to the
            next gradient of the same bucket (default True).
        nonfinite: ``"raise"`` (default) or ``"warn"``.

    Raises:
        ArgumentError: ``ratio`` is not a number in (0, 1] (a bool is not
            one), or ``nonfinite`` is neither ``"raise"`` nor ``"warn"``.
    """

    def __init__(self, ratio=0.01, error_feedback=True, nonfinite="raise"):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ArgumentError("TopK: ratio must be a number in (0, 1], got %r" % (ratio,))
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)
        self.nonfinite = check_mode(nonfinite, "TopK")
        self.name = "topk(ratio=%r,error_feedback=%s,nonfinite=%r)" % (
            self.ratio, self.error_feedback, self.nonfinite)

    def k_for(self, size):
        """Entries sent from a bucket.

        Args:
            size: the bucket's number of values.

        Returns:
            ``min(size, max(1, ceil(ratio * size)))``: k for a bucket of
            ``size`` values (0 for an empty one).
        """
        return min(size, max(1, math.ceil(self.ratio * size)))

    def count_for(self, size):
        """How many entries every rank sends: :meth:`k_for`.

        Args:
            size: the bucket's number of values.

        Returns:
            ``k_for(size)``; a rank that sends another number raises
            PayloadError on every rank.
        """
        return self.k_for(size)

    def select(self, acc):
        """The :meth:`k_for` entries of ``acc`` of largest magnitude.

        Ties go to the lowest index.

        Args:
            acc: 1-D float32 numpy or cupy array (finite); not modified.

        Returns:
            ``(indices, values)``: int32 indices and their float32 values
            (see :meth:`~commlib.compression._sparse.Sparsifier.select`).
        """
        if type(acc) is np.ndarray:
            return hostselect.topk(acc, self.k_for(acc.size))
        return topk(acc, self.k_for(acc.size))

    def select_into(self, acc, indices, values):
        """cupy buckets: :meth:`select` written into ``indices`` and
        ``values`` (parts of the record that travels; see
        :meth:`Sparsifier.select_into
        <commlib.compression._sparse.Sparsifier.select_into>`).

        Returns:
            True when written; False for a subclass that overrides
            :meth:`select`, or arrays not of :meth:`k_for` elements.
        """
        if type(self).select is not TopK.select or indices.size != self.k_for(acc.size):
            return False
        topk(acc, indices.size, out=(indices, values))
        return True

    def accumulate_and_select(self, residual, flat, acc):
        """numpy buckets: :meth:`Sparsifier.accumulate_and_select
        <commlib.compression._sparse.Sparsifier.accumulate_and_select>` (same
        arguments and result) in one compiled pass; a subclass that
        overrides :meth:`select` gets the base class's two steps instead."""
        if type(self).select is not TopK.select:     # a subclass selects its own way
            return super().accumulate_and_select(residual, flat, acc)
        # one compiled pass: the sum, its non-finite entries and the candidates
        return hostselect.topk_accumulate(residual, flat, acc, self.k_for(flat.size))
