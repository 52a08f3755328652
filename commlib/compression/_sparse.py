"""What the sparsifying strategies (top-K, threshold) share: their base
class, which exchanges (index, value) sets and sums them."""
import numpy as np

from ..errors import ArgumentError
from ..ops import hostselect
from ..ops.arrays import array_module
from ..ops.sparse import scatter_add
from . import _payload
from . import nonfinite as _nonfinite
from ._flat import buffer, describe, gather, scatter
from .base import Compression


class Sparsifier(Compression):
    """A strategy that sends (index, value) pairs of float32 buckets and sums
    them (``sum`` and ``avg`` only), with optional error feedback.

    Per call and bucket of ``n`` values, each rank forms ``acc`` = its
    residual + the bucket (the bucket alone without error feedback), sets
    acc's NaN and +-inf entries to 0 and counts them (a finite sum that
    overflows counts too), and sends ``select(acc)`` with that count. The
    ranks' records are all-gathered and validated (:mod:`._payload`), then
    summed rank by rank in rank order (so every rank computes the same bits)
    into the bucket, times ``scale`` if given; the new residual is ``acc``
    less what was sent. ``nonfinite`` (:mod:`._nonfinite`): with
    ``"raise"``, a non-zero count on any rank raises NonFiniteError on every
    rank; with ``"warn"`` the dropped entries are not sent, their residual
    is 0, and every rank warns. On any error nothing is written: the arrays
    and residuals stay as they were.

    Subclasses set ``error_feedback``, ``nonfinite`` and ``name``, and define
    :meth:`select` and, when every rank sends as many entries,
    :meth:`count_for`.
    """

    error_feedback = True
    nonfinite = "raise"

    def applies_to(self, dtype):
        return dtype == np.float32

    def check(self, op, rank):
        if op not in ("sum", "avg"):
            raise ArgumentError("rank %d: compression %s sums; op=%r is not supported "
                                "(use 'sum' or 'avg')" % (rank, self.name, op))

    def count_for(self, size):
        """The number of entries every rank sends from a bucket of ``size``
        values, or None when it varies by rank (the default)."""
        return None

    def select(self, acc):
        """``(indices, values)`` to send from ``acc`` (1-D float32, finite;
        not to be modified): int32 indices in ``[0, len(acc))`` (or the
        padding -1 with value 0), unique, preferably ascending (else the
        duplicate check sorts), and float32 values of the same length."""
        raise NotImplementedError

    def accumulate_and_select(self, residual, flat, acc):
        """numpy buckets: ``acc = residual + flat`` (``flat`` alone when
        ``residual`` is None) with its NaN and +-inf set to 0, then
        :meth:`select`; returns ``(non-finite count, indices, values)``.
        A subclass may fuse the two."""
        nonfinite = hostselect.accumulate_finite(residual, flat, acc)
        return (nonfinite,) + tuple(self.select(acc))

    def reduce(self, bucket):
        arrays, scale, workspace = bucket.arrays, bucket.scale, bucket.state
        flat = gather(arrays, workspace)
        xp, n = array_module(flat), flat.size
        acc = buffer(workspace, "acc", xp, n, np.float32)
        residual = None
        if self.error_feedback:
            residual = buffer(workspace, "residual", xp, n, np.float32, zero=True)
        if xp is np:                 # compiled passes
            nonfinite, indices, values = self.accumulate_and_select(residual, flat, acc)
        else:
            if residual is None:
                acc[...] = flat
            else:
                xp.add(residual, flat, out=acc)
            nonfinite = _nonfinite.drop(acc)
            indices, values = self.select(acc)
        slots = self.count_for(n)
        record = _payload.encode(xp, indices, values, nonfinite, slots)
        context = "rank %d: compression %s" % (bucket.rank, self.name)
        where = describe(n, len(arrays))
        dropped = []

        def on_headers(counts):
            if any(counts) and self.nonfinite == "raise":
                raise _nonfinite.error(
                    "%s: NaN or inf in the gradient%s of %s, in %s; nothing was written: "
                    "arrays and residuals are unchanged"
                    % (context, " + residual" if residual is not None else "",
                       _nonfinite.ranks(counts), where), counts)
            dropped[:] = counts

        all_indices, all_values, counts = _payload.exchange(
            bucket, record, slots, n, context,
            "in %s; nothing was written: arrays and residuals are unchanged" % where,
            on_headers)
        if xp is np:
            hostselect.sparse_sum(flat, all_indices, all_values, scale, counts)
        else:
            flat[...] = 0
            scatter_add(flat, all_indices, all_values, segments=counts)
            if scale is not None:
                flat *= np.float32(scale)
        if residual is not None:    # what was sent is no longer owed
            add = hostselect.scatter_add if xp is np else scatter_add
            add(acc, indices, values, alpha=-1.0)
            workspace["residual"], workspace["acc"] = acc, residual
        scatter(flat, arrays)
        if any(dropped):
            _nonfinite.warn("%s: dropped NaN and inf of %s, in %s: not sent%s"
                            % (context, _nonfinite.ranks(dropped), where,
                               ", residual set to 0" if residual is not None else ""))
