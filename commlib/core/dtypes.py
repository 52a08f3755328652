"""The element types commlib's collectives accept.

bfloat16 arrays are recognised by their dtype name (``ml_dtypes.bfloat16``
for numpy); the CUDA kernels also take bfloat16 as uint16 bit patterns.
"""
import numpy as np

#: dtype names accepted by every collective, in documentation order.
SUPPORTED = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8")

#: names whose ``avg`` / ``division=True`` is defined (floating point).
FLOATING = ("float16", "bfloat16", "float32", "float64")

#: reduction operators, as accepted by the ``op=`` argument.
OPS = ("sum", "avg", "max", "min", "prod")

#: what each reduction a transport performs means, as a numpy ufunc
#: (averaging is "sum" and a scale, applied above the transports)
UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}

_supported = {}


def supported_fast(dtype):
    """:func:`is_supported` for a numpy dtype object, cached (``dtype.name``
    is slow to compute in a per-call path)."""
    found = _supported.get(dtype)
    if found is None:
        found = _supported[dtype] = is_supported(dtype)
    return found


def name_of(dtype):
    """Canonical name of a numpy/cupy dtype (``"float32"``, ``"bfloat16"``)."""
    return np.dtype(dtype).name


def is_supported(dtype):
    """A supported element type in the machine's byte order (MPI and NCCL
    reduce native numbers only)."""
    dtype = np.dtype(dtype)
    return dtype.name in SUPPORTED and dtype.isnative


def is_floating(dtype):
    return name_of(dtype) in FLOATING
