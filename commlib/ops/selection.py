"""What the selection and sparse kernels share (their CUDA side is
``kernels/select_common.cuh``): argument checks for 1-D float vectors, the
tiling of ``kernels/{topk,threshold,sparse}.cu`` and magnitude keys.
"""
import operator

import numpy as np

from ..errors import ArgumentError, ArrayTypeError, DeviceMismatchError
from .arrays import is_cupy

INF_KEY = 0x7F800000   # magnitude keys above this belong to NaN
MAX_LEN = 2 ** 31 - 1  # indices are int32
TILE = 4096            # elements per tile of the selection kernels
BLOCK = 256            # threads per block of the selection kernels
SUPER_TILES = 8        # tiles per super-tile of the one-look-back-per-super-tile compactions


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


def check_count(value, name):
    """``value`` as an int; raise unless it is an integer >= 0."""
    try:
        value = operator.index(value)
    except TypeError:
        raise ArgumentError("%s: expected an integer, got %r" % (name, value)) from None
    if value < 0:
        raise ArgumentError("%s: expected >= 0, got %d" % (name, value))
    return value


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


def supers_of(n, off):
    return (tiles_of(n, off) + SUPER_TILES - 1) // SUPER_TILES


def grid_for(tiles, kernel):
    """Persistent grid of ``kernel``: one block per tile, at most the blocks
    of BLOCK threads that are resident at once."""
    from ._loader import persistent_grid
    return persistent_grid(tiles, kernel, BLOCK)
