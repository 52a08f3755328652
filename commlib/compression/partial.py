"""Partial synchronisation (SINGA's ``backward_and_partial_update``).

Each rank updates its parameters locally; then, instead of averaging all of
them, each call reduces only one window of each float32 bucket and leaves
the rest as it is on each rank. The windows take turns: a bucket of N
values is cut into consecutive windows of ``w = ceil(fraction * N)`` values
(the last may be shorter), ``ceil(N / w)`` of them, and call c reduces
window ``c mod ceil(N / w)``, so every value is synchronised once every
``ceil(N / ceil(fraction * N))`` calls (:meth:`Partial.period`; at most
``ceil(1 / fraction)``, fewer when rounding the width up leaves fewer
windows: fraction 0.45 of 10 values gives windows of 5, a period of 2) at
about ``fraction`` of the bytes per call. Meant for
parameters (``comm.all_reduce(params, op="avg", compression=Partial(0.1))``)
rather than gradients. Every rank must make the same sequence of calls.
"""
import math

import numpy as np

from ..errors import ArgumentError
from . import _flat
from .base import Compression


class Partial(Compression):
    """Reduce a rotating ``fraction`` of each float32 bucket per call.

    Call c reduces window ``c mod period`` of each bucket (see the module
    docstring, :meth:`window` and :meth:`period`) and leaves the rest as it
    is on each rank; the call count lives in the bucket's state. It
    refuses no op; other dtypes than float32 are not compressed.

    Args:
        fraction: the share of each bucket reduced per call, a number in
            (0, 1] (default 0.1).

    Raises:
        ArgumentError: ``fraction`` is not a number in (0, 1] (a bool is
            not one).
    """

    def __init__(self, fraction=0.1):
        if (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                or not 0 < fraction <= 1):
            raise ArgumentError("Partial: fraction must be a number in (0, 1], got %r"
                                % (fraction,))
        self.fraction = float(fraction)
        self.name = "partial(fraction=%r)" % self.fraction

    def applies_to(self, dtype):
        """Whether arrays of ``dtype`` are compressed.

        Args:
            dtype: a numpy/cupy dtype.

        Returns:
            True for float32 only.
        """
        return dtype == np.float32

    def period(self, size):
        """How many calls it takes to synchronise every value of a bucket once.

        Args:
            size: the bucket's number of values.

        Returns:
            ``ceil(size / ceil(fraction * size))`` (the number of windows;
            at most ``ceil(1 / fraction)``), or 1 for an empty bucket.
        """
        width = max(1, math.ceil(self.fraction * size))
        return math.ceil(size / width) if size else 1

    def window(self, size, call):
        """The window that one call reduces.

        Windows are ``w = max(1, ceil(fraction * size))`` values wide (the
        last may be shorter) and take turns.

        Args:
            size: the bucket's number of values.
            call: the call number, 0, 1, ...

        Returns:
            ``(start, stop)``: the window that call number ``call`` reduces
            in a bucket of ``size`` values, window ``call mod
            period(size)``.
        """
        width = max(1, math.ceil(self.fraction * size))
        start = (call % self.period(size)) * width
        return start, min(size, start + width)

    def reduce(self, bucket):
        """All-reduce this call's window of the bucket, in place.

        The window is reduced with ``bucket.op`` and multiplied by
        ``bucket.scale`` when not None; the other values keep each rank's
        own. Every rank must make the same sequence of calls.

        Args:
            bucket: the :class:`~commlib.compression.base.Bucket` (float32
                arrays); ``bucket.state`` counts its calls.

        Raises:
            CollectiveTimeoutError, PeerError, TransportError, ClosedError:
                from the bucket's communication (see
                :meth:`~commlib.compression.base.Bucket.all_reduce`).
        """
        workspace = bucket.state
        call = workspace.get("calls", 0)
        workspace["calls"] = call + 1
        flat = _flat.gather(bucket.arrays, workspace)
        start, stop = self.window(flat.size, call)
        piece = flat[start:stop]
        bucket.all_reduce(piece)
        if bucket.scale is not None:
            piece *= np.float32(bucket.scale)
        _flat.scatter(flat, bucket.arrays)
