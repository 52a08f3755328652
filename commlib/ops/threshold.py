"""Threshold selection: the indices and values of every element with |x| > t.

``threshold(x, t)`` compacts all qualifying elements of a 1-D float32 array
in ascending index order. With cupy input it is one pass of
``kernels/threshold.cu`` (ordered compaction with decoupled look-back), one
launch and nothing else (its workspace, kept per stream, is left zeroed by
the kernel itself), and never synchronizes with the host; numpy input runs
the numpy twin.
"""
import collections

import numpy as np

from ..errors import ArgumentError
from ._arrays import is_cupy
from ._select import (BLOCK, INF_KEY, check_count, check_length, check_vector, grid_for,
                      magnitude_keys, misalignment, supers_of, tiles_of)

def _threshold_key(t):
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
    tkey = _threshold_key(t)
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
    from ._loader import get_function
    n = x.size
    with x.device:
        indices = cupy.empty(capacity, dtype=cupy.int32)
        values = cupy.empty(capacity, dtype=cupy.float32)
        if n == 0:
            return indices, values, cupy.zeros((), dtype=cupy.int64)
        count = cupy.empty((), dtype=cupy.int64)
        off = misalignment(x)
        tiles = tiles_of(n, off)
        ws = _workspace(x.device.id, tiles + 1)
        kernel = get_function("threshold.cu", "threshold_select")
        t32 = np.uint32(tkey).view(np.float32)
        kernel(grid_for(supers_of(n, off), kernel), (BLOCK,),
               (x, np.int64(n), np.int32(off), t32, ws, indices, values,
                np.int64(capacity), count))
    return indices, values, count


WORKSPACES = 16  # (device, stream) pairs whose workspace is kept
_workspaces = collections.OrderedDict()  # (device, stream ptr) -> (stream, uint64 array)


def _workspace(device_id, words):
    """A zero-filled uint64 workspace of at least ``words`` words for the
    current stream: threshold_select leaves it zeroed, so launches on one
    stream (which run in order) share it; other streams get their own. The
    stream object is held so its handle is not reused while it is cached."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    key = (device_id, getattr(stream, "ptr", 0))
    hit = _workspaces.get(key)
    if hit is not None and hit[1].size >= words:
        _workspaces.move_to_end(key)
        return hit[1]
    ws = cupy.zeros(max(words, 2 * hit[1].size if hit else 0), dtype=cupy.uint64)
    _workspaces[key] = (stream, ws)
    _workspaces.move_to_end(key)
    while len(_workspaces) > WORKSPACES:
        _workspaces.popitem(last=False)
    return ws
