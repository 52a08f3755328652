"""Threshold sparsification with error feedback (SINGA's sparse update with
``topK=False, corr=True``).

Every rank sends the entries of each float32 bucket whose magnitude exceeds
``threshold``, as (index, value) pairs; how many differs from rank to rank,
so the record headers (counts) are all-gathered first and the pairs by count
(all-gather-v), validated, then summed into a dense result every rank
computes identically. With error feedback (the default) the entries not sent
are kept as a residual and added to the next gradient of the same bucket, so
small values accumulate until they cross the threshold. NaN and +-inf are
never sent: ``nonfinite="raise"`` (the default) raises NonFiniteError on
every rank (before the pairs travel) and leaves arrays and residuals as they
were, ``"warn"`` drops them (their residual becomes 0) and warns; see
:class:`~commlib.compression._sparse.Sparsifier`. Selection is the one-pass
compaction kernel (``kernels/threshold.cu``) on GPUs and its compiled host
twin on CPUs (``commlib/ops/hostselect.py``). A threshold too low for the
data sends nearly everything (twice the bytes of a dense all-reduce).
"""
import numpy as np

from ..errors import ArgumentError
from ..ops import hostselect
from ..ops.threshold import threshold
from .nonfinite import check_mode
from ._sparse import Sparsifier


class Threshold(Sparsifier):
    """Send the entries of each float32 bucket with ``|value| > threshold``.

    How many differs from rank to rank (headers, then the entries by count,
    all-gather-v); ``sum`` and ``avg`` only (see
    :class:`~commlib.compression._sparse.Sparsifier`).

    Args:
        threshold: a finite number >= 0; entries of larger magnitude are
            sent.
        error_feedback: keep what was not sent as a residual added to the
            next gradient of the same bucket (default True).
        nonfinite: ``"raise"`` (default) or ``"warn"``.

    Raises:
        ArgumentError: ``threshold`` is not a finite number >= 0 (a bool is
            not one), or ``nonfinite`` is neither ``"raise"`` nor ``"warn"``.
    """

    def __init__(self, threshold, error_feedback=True, nonfinite="raise"):
        if (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                or not 0 <= threshold < float("inf")):
            raise ArgumentError("Threshold: threshold must be a finite number >= 0, got %r"
                                % (threshold,))
        self.threshold = float(threshold)
        self.error_feedback = bool(error_feedback)
        self.nonfinite = check_mode(nonfinite, "Threshold")
        self.name = "threshold(%r,error_feedback=%s,nonfinite=%r)" % (
            self.threshold, self.error_feedback, self.nonfinite)

    def select(self, acc):
        """The entries of ``acc`` with ``|value| > threshold``, ascending.

        On GPUs this reads the count to the host (a synchronisation).

        Args:
            acc: 1-D float32 numpy or cupy array (finite); not modified.

        Returns:
            ``(indices, values)``: int32 indices and their float32 values
            (see :meth:`~commlib.compression._sparse.Sparsifier.select`).
        """
        if type(acc) is np.ndarray:
            return hostselect.threshold(acc, self.threshold)
        indices, values, count = threshold(acc, self.threshold)
        count = int(count)                   # the record's size: a host sync on GPUs
        return indices[:count], values[:count]

    def accumulate_and_select(self, residual, flat, acc):
        """numpy buckets: :meth:`Sparsifier.accumulate_and_select
        <commlib.compression._sparse.Sparsifier.accumulate_and_select>` (same
        arguments and result) in one compiled pass; a subclass that
        overrides :meth:`select` gets the base class's two steps instead."""
        if type(self).select is not Threshold.select:   # a subclass selects its own way
            return super().accumulate_and_select(residual, flat, acc)
        # one compiled pass: the sum, its non-finite entries and the selection
        return hostselect.threshold_accumulate(residual, flat, acc, self.threshold)
