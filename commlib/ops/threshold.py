"""Threshold selection: the indices and values of every element with |x| > t.

``threshold(x, t)`` compacts all qualifying elements of a 1-D float32 array
in ascending index order. With cupy input it is one pass of
``kernels/threshold.cu`` (ordered compaction with decoupled look-back) and
never synchronizes with the host; numpy input runs the numpy twin.

The argument checks shared by the selection and sparse kernels live here.
"""
import operator

import numpy as np

from ..errors import ArgumentError, ArrayTypeError, DeviceMismatchError
from ._arrays import is_cupy

INF_KEY = 0x7F800000   # magnitude keys above this belong to NaN
MAX_LEN = 2 ** 31 - 1  # indices are int32
TILE = 4096            # elements per tile of the selection kernels
BLOCK = 256            # threads per block of the selection kernels


def check_vector(a, name, dtype):
    """Raise unless ``a`` is a contiguous 1-D numpy or cupy array of ``dtype``."""
    dtype = np.dtype(dtype)
    if not (isinstance(a, np.ndarray) or is_cupy(a)):
        raise ArrayTypeError("%s: expected a numpy or cupy array, got %s"
                             % (name, type(a).__name__))
    if a.dtype != dtype:
        raise ArrayTypeError("%s: expected dtype %s, got %s" % (name, dtype.name, a.dtype))
    if a.ndim != 1:
        raise ArgumentError("%s: expected a 1-D array, got shape %s" % (name, tuple(a.shape)))
    if not a.flags.c_contiguous:
        raise ArrayTypeError("%s: expected a contiguous array" % name)
    if is_cupy(a) and a.data.ptr % dtype.itemsize:
        raise ArrayTypeError("%s: data is not aligned to its %d-byte elements"
                             % (name, dtype.itemsize))


def check_same_kind(**arrays):
    """Raise unless the arrays are all numpy, or all cupy on one device."""
    items = [(n, a) for n, a in arrays.items() if a is not None]
    kinds = {n: is_cupy(a) for n, a in items}
    if len(set(kinds.values())) > 1:
        desc = ", ".join("%s is %s" % (n, "cupy" if c else "numpy") for n, c in kinds.items())
        raise ArrayTypeError("arrays must be all numpy or all cupy: " + desc)
    if items and kinds[items[0][0]]:
        devices = {n: a.device.id for n, a in items}
        if len(set(devices.values())) > 1:
            raise DeviceMismatchError("arrays live on different GPUs: %s" % devices)


def check_length(n, name):
    if n > MAX_LEN:
        raise ArgumentError("%s: %d elements exceed the int32 index range" % (name, n))


def magnitude_keys(x):
    """uint32 keys ordered like |x| (sign bit cleared); NaN keys exceed INF_KEY."""
    return x.view(np.uint32) & np.uint32(0x7FFFFFFF)


def misalignment(a):
    """Elements between a cupy array's start and the previous 16-byte boundary."""
    return (a.data.ptr % 16) // 4


def tiles_of(n, off):
    return (n + off + TILE - 1) // TILE


def grid_for(tiles, blocks_per_sm):
    """Persistent grid: at most ``blocks_per_sm`` blocks per SM, one per tile."""
    from ._loader import sm_count
    return max(1, min(tiles, sm_count() * blocks_per_sm))


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
    if capacity is None:
        capacity = n
    else:
        try:
            capacity = operator.index(capacity)
        except TypeError:
            raise ArgumentError("capacity: expected an integer, got %r" % (capacity,)) from None
        if capacity < 0:
            raise ArgumentError("capacity: expected >= 0, got %d" % capacity)
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
        ws = cupy.zeros(tiles + 1, dtype=cupy.uint64)
        kernel = get_function("threshold.cu", "threshold_select")
        t32 = np.uint32(tkey).view(np.float32)
        kernel((grid_for(tiles, 4),), (BLOCK,),
               (x, np.int64(n), np.int32(off), t32, ws, indices, values,
                np.int64(capacity), count))
    return indices, values, count
