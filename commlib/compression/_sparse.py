"""What the sparsifying strategies (top-K, threshold) share: their base
class and the exchange of (index, value) sets and their sum."""
import numpy as np

from ..errors import ArgumentError
from ..ops._arrays import array_module
from ..ops.sparse import scatter_add
from ._flat import buffer, gather, scatter
from .base import Compression


class Sparsifier(Compression):
    """A strategy that sends (index, value) pairs of float32 buckets and sums
    them (``sum`` and ``avg`` only), with optional error feedback.

    Subclasses set ``error_feedback`` and ``same_count`` (whether every rank
    sends as many pairs) and define :meth:`select`.
    """

    error_feedback = True
    same_count = True

    def applies_to(self, dtype):
        return dtype == np.float32

    def check(self, op, rank):
        if op not in ("sum", "avg"):
            raise ArgumentError("rank %d: compression %s sums; op=%r is not supported "
                                "(use 'sum' or 'avg')" % (rank, self.name, op))

    def select(self, flat, residual):
        """(int32 indices, float32 values) to send from ``flat`` (1-D
        float32); with a ``residual`` (error feedback: same length, kept
        between calls) select from ``residual + flat`` and leave in
        ``residual`` what was not sent."""
        raise NotImplementedError

    def reduce(self, transport, arrays, op, scale, deadline, workspace):
        flat = gather(arrays, workspace)
        residual = None
        if self.error_feedback:
            residual = buffer(workspace, "residual", array_module(flat), flat.size,
                              np.float32, zero=True)
        indices, values = self.select(flat, residual)
        exchange_and_sum(transport, indices, values, flat, scale, deadline, self.same_count)
        scatter(flat, arrays)


def exchange_and_sum(transport, indices, values, out, scale, deadline, same_count):
    """All-gather every rank's ``(indices, values)`` (int32 / float32, same
    length) and write their sum into ``out`` (float32, zeroed first), rank by
    rank in rank order (so every rank computes the same bits), times
    ``scale`` if given. ``same_count``: every rank sends as many entries as
    this one (one all-gather); otherwise the counts are exchanged first and
    the sets all-gathered by count (all-gather-v).

    Each rank's set travels as one int32 record ``indices ++ bits(values)``.
    """
    xp = array_module(out)
    n, c = transport.size, indices.size
    record = xp.concatenate([indices, values.view(np.int32)])
    if same_count:
        counts = [c] * n
        gathered = xp.empty(2 * c * n, dtype=np.int32)
        if c:
            transport.all_gather(record, gathered, deadline)
    else:
        found = xp.empty(n, dtype=np.int64)
        transport.all_gather(xp.full(1, c, dtype=np.int64), found, deadline)
        counts = [int(k) for k in (found if xp is np else found.get())]
        gathered = xp.empty(2 * sum(counts), dtype=np.int32)
        if gathered.size:
            transport.all_gatherv(record, gathered, [2 * k for k in counts], deadline)
    starts = np.concatenate(([0], np.cumsum([2 * k for k in counts])))
    all_indices = xp.concatenate([gathered[s:s + k] for s, k in zip(starts, counts)])
    all_values = xp.concatenate([gathered[s + k:s + 2 * k] for s, k in zip(starts, counts)])
    out[...] = 0
    scatter_add(out, all_indices, all_values.view(np.float32), segments=counts)
    if scale is not None:
        out *= np.float32(scale)
