"""Small helpers shared by the kernel wrappers."""
import numpy as np

from ..errors import ArrayTypeError


def is_cupy(a):
    """True when ``a`` is a cupy ndarray (without importing cupy)."""
    return type(a).__module__.split(".")[0] == "cupy"


def array_module(a):
    """numpy or cupy, whichever ``a`` belongs to."""
    if is_cupy(a):
        import cupy
        return cupy
    return np


def address(a):
    """Address of the first byte of a numpy or cupy array."""
    return a.data.ptr if is_cupy(a) else a.__array_interface__["data"][0]


def zero(a):
    """Set the contiguous numpy or cupy array ``a`` to zeros (cupy: one
    memset on the current stream, no kernel)."""
    if not is_cupy(a):
        a.fill(0)
        return
    from . import _launch
    _launch.memset0(a)


def to_host(groups):
    """Host copies of the integer arrays in ``groups`` (a list of tuples of
    numpy or cupy arrays): a list of tuples of numpy arrays of the same
    shapes and dtypes. Every cupy array among them comes over in one
    transfer (so a caller waits for its GPU once); numpy arrays are passed
    through as they are.

    Raises:
        ArrayTypeError: an array is not of an integer dtype (the transfer
            widens them all to int64).
    """
    device = [a for g in groups for a in g if is_cupy(a)]
    for a in (a for g in groups for a in g):
        if a.dtype.kind not in "iub":
            raise ArrayTypeError("to_host: expected integer arrays, got dtype %s" % a.dtype)
    if not device:
        return [tuple(g) for g in groups]
    import cupy
    wide = [a.reshape(-1) if a.dtype == np.int64 else a.reshape(-1).astype(np.int64)
            for a in device]
    host = (wide[0] if len(wide) == 1 else cupy.concatenate(wide)).get()
    parts, start = [], 0
    for a in device:
        parts.append(host[start:start + a.size].astype(a.dtype).reshape(a.shape))
        start += a.size
    copies = iter(parts)
    return [tuple(next(copies) if is_cupy(a) else a for a in g) for g in groups]
