"""Partial synchronisation (SINGA's ``backward_and_partial_update``).

Each rank updates its parameters locally; then, instead of averaging all of
them, each call reduces only one window of each float32 bucket and leaves
the rest as it is on each rank. The windows take turns: a bucket of N
values is cut into ``ceil(1 / fraction)`` consecutive windows of
``ceil(fraction * N)`` values (the last may be shorter), and call c reduces
window ``c mod`` their number, so every value is synchronised once every
``ceil(1 / fraction)`` calls at ``fraction`` of the bytes per call. Meant for
parameters (``comm.all_reduce(params, op="avg", compression=Partial(0.1))``)
rather than gradients. Every rank must make the same sequence of calls.
"""
import math

import numpy as np

from ..errors import ArgumentError
from . import _flat
from .base import Compression


class Partial(Compression):
    """Reduce a rotating ``fraction`` of each float32 bucket per call."""

    def __init__(self, fraction=0.1):
        if (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                or not 0 < fraction <= 1):
            raise ArgumentError("Partial: fraction must be a number in (0, 1], got %r"
                                % (fraction,))
        self.fraction = float(fraction)
        self.name = "partial(fraction=%r)" % self.fraction

    def applies_to(self, dtype):
        return dtype == np.float32

    def window(self, size, call):
        """``(start, stop)`` of the window that call number ``call`` (0, 1,
        ...) reduces in a bucket of ``size`` values."""
        width = max(1, math.ceil(self.fraction * size))
        start = (call % math.ceil(size / width)) * width
        return start, min(size, start + width)

    def reduce(self, transport, arrays, op, scale, wait, workspace):
        call = workspace.get("calls", 0)
        workspace["calls"] = call + 1
        flat = _flat.gather(arrays, workspace)
        start, stop = self.window(flat.size, call)
        piece = flat[start:stop]
        transport.all_reduce(piece, op, wait)
        if scale is not None:
            piece *= np.float32(scale)
        _flat.scatter(flat, arrays)
