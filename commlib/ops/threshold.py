"""Threshold selection: the indices and values of every element with |x| > t.

``threshold(x, t)`` compacts all qualifying elements of a 1-D float32 array
in ascending index order. With cupy input it is one pass of
``kernels/threshold.cu`` (ordered compaction with decoupled look-back), one
launch and nothing else (its workspace, kept per stream, is left zeroed by
the kernel itself), and never synchronizes with the host; numpy input runs
the numpy twin.
"""
import numpy as np

from ..errors import ArgumentError
from .arrays import is_cupy
from .selection import (BLOCK, INF_KEY, check_count, check_length, check_vector, grid_for,
                        magnitude_keys, supers_of, tiles_of)

def threshold_key(t):
    """Magnitude key of the largest float32 <= t, so |x| > t is exact."""
    try:
        t = float(t)
    except (TypeError, ValueError):
        raise ArgumentError("t: expected a real number, got %r" % (t,)) from None
    if not t >= 0.0:
        raise ArgumentError("t: expected a non-negative number, got %r" % t)
    with np.errstate(over="ignore"):
        t32 = np.float32(t)
    if float(t32) > t:
        t32 = np.nextafter(t32, np.float32(0))
    return int(np.abs(t32).view(np.uint32))


_TKEYS = {}  # (type, t) -> key, for recent plain-number thresholds


def threshold(x, t, *, capacity=None):
    """All elements of ``x`` with ``|x| > t``, in ascending index order.

    x: 1-D contiguous float32 array (numpy or cupy). t: non-negative real
    (compared exactly against the float32 values; NaN is never selected).
    capacity: length of the outputs (default ``len(x)``); when more than
    ``capacity`` elements qualify only the first ``capacity`` are written.

    Returns ``(indices, values, count)``: int32 and float32 arrays of length
    ``capacity`` (entries past ``count`` are unspecified) and a 0-d int64
    array holding the number of qualifying elements (a device array for
    cupy input; reading it synchronizes).
    """
    check_vector(x, "x", np.float32)
    n = x.size
    check_length(n, "x")
    try:
        tkey = _TKEYS.get((type(t), t))
    except TypeError:  # an unhashable t
        tkey = None
    if tkey is None:
        tkey = threshold_key(t)
        if type(t) in (float, int):
            if len(_TKEYS) > 64:
                _TKEYS.clear()
            _TKEYS[(type(t), t)] = tkey
    capacity = n if capacity is None else check_count(capacity, "capacity")
    if is_cupy(x):
        return _threshold_cuda(x, tkey, capacity)
    return _threshold_numpy(x, tkey, capacity)


def _threshold_numpy(x, tkey, capacity):
    keys = magnitude_keys(x)
    hit = np.flatnonzero((keys > tkey) & (keys <= INF_KEY))
    m = min(hit.size, capacity)
    indices = np.zeros(capacity, np.int32)
    values = np.zeros(capacity, np.float32)
    indices[:m] = hit[:m]
    values[:m] = x[hit[:m]]
    return indices, values, np.array(hit.size, dtype=np.int64)


def _threshold_cuda(x, tkey, capacity):
    import cupy
    from . import _launch, _loader
    n = x.size
    with x.device:
        indices = cupy.empty(capacity, dtype=cupy.int32)
        values = cupy.empty(capacity, dtype=cupy.float32)
        if n == 0:
            return indices, values, cupy.zeros((), dtype=cupy.int64)
        count = cupy.empty((), dtype=cupy.int64)
        off = (x.data.ptr % 16) // 4
        device = x.device.id
        kernel, grid, words, n64, off32 = _launch.plan(
            ("threshold", device, n, off, _loader.get_function), lambda: _plan(n, off))
        # threshold_select leaves its workspace zeroed: zero-filled once, then shared
        # by the launches of this stream (which run in order)
        ws = _launch.workspace(device, "threshold", words, cupy.uint64, zeroed=True)
        kernel(grid, _BLOCK_DIM, (x, n64, off32, _T32[tkey] if tkey in _T32 else _t32(tkey),
                                  ws, indices, values, np.int64(capacity), count))
    return indices, values, count


_BLOCK_DIM = (BLOCK,)
_T32 = {}  # threshold key -> float32 argument (a few recent ones)


def _t32(tkey):
    if len(_T32) > 64:
        _T32.clear()
    v = _T32[tkey] = np.uint32(tkey).view(np.float32)
    return v


def _plan(n, off):
    """(kernel, grid, workspace words, n, off) of one call shape (current device)."""
    from ._loader import get_function
    kernel = get_function("threshold.cu", "threshold_select")
    return (kernel, grid_for(supers_of(n, off), kernel), tiles_of(n, off) + 1, np.int64(n),
            np.int32(off))
