"""Small helpers shared by the kernel wrappers."""
import numpy as np


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
