"""Host casts between float32, float16 and bfloat16 (uint16 bits) in one C
loop (``commlib/native/hostcast.c``: F16C and AVX2 where the CPU has them,
portable C elsewhere), bit for bit the numpy twin
:func:`commlib.ops.cast.numpy_cast_into`, which runs instead when the
compiled loops are unavailable or an array does not qualify (not an exact,
C-contiguous, aligned, native-order numpy array, sizes that differ, or
memory shared other than by the very same array).

:func:`reduce_into` is the float16/bfloat16 reduction of the MPI
transport's user-defined operators: both sides widened to float32, the
numpy ufunc's operation there (max/min as numpy's float32
``maximum``/``minimum``: NaN wins, ties give the second operand), rounded
back to nearest even with the canonical NaN.
"""
import numpy as np

from ..core.dtypes import UFUNCS
from . import native
from .cast import format_of, numpy_cast_into

_OPS = {"sum": 1, "prod": 2, "max": 3, "min": 4}
_EXPONENT = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}
PORTABLE, AVX2 = 0, 1


def compiled(name):
    """The compiled loop ``name`` of ``commlib._hostloops``, or None (not
    built, turned off, or a build older than this module)."""
    return getattr(native.module(), name, None)


def cast_into(x, out, scale=np.float32(1), accumulate=False, streaming=False):
    """``numpy_cast_into(x, out, scale, accumulate)``, compiled: write ``x``
    times ``scale`` (np.float32), cast to ``out``'s format (added to
    ``out`` when ``accumulate``), into ``out``; returns the number of
    non-finite values written (int). ``x``, ``out``: numpy arrays of one
    size with dtypes float32, float16 or uint16 (bfloat16). ``streaming``:
    write ``out`` with non-temporal stores where the compiled loop can
    (memory another process reads next), the same values."""
    loop = compiled("cast")
    if loop is not None:
        scale = np.float32(scale)
        count = loop(x, out, None if scale == 1 else float(scale), 1 if accumulate else 0,
                     streaming)
        if count >= 0:
            return count
    return numpy_cast_into(x, out, scale, accumulate)


def reduce_into(a, b, op):
    """``b = op(b, a)`` elementwise, for float16, bfloat16 (``ml_dtypes``)
    or uint16 (bfloat16 bits) numpy arrays ``a`` and ``b`` of one dtype and
    size (see the module docstring); ``op``: ``"sum"``, ``"prod"``,
    ``"max"`` or ``"min"``."""
    if a.dtype.name == "bfloat16":          # ml_dtypes: the same bits as uint16
        a, b = a.view(np.uint16), b.view(np.uint16)
    loop = compiled("cast")
    if loop is not None and a.dtype == b.dtype and loop(a, b, None, _OPS[op]) >= 0:
        return
    numpy_reduce_into(a, b, op)


def numpy_reduce_into(a, b, op):
    """numpy twin of :func:`reduce_into`."""
    wide_a, wide_b = np.empty(a.size, np.float32), np.empty(b.size, np.float32)
    numpy_cast_into(a, wide_a)
    numpy_cast_into(b, wide_b)
    with np.errstate(all="ignore"):
        UFUNCS[op](wide_b, wide_a, out=wide_b)
    numpy_cast_into(wide_b, b)


def count_nonfinite(a, fmt):
    """The number of inf and NaN in numpy array ``a`` holding format
    ``fmt`` (``"float32"``, ``"float16"``, ``"bfloat16"``: uint16 bits)."""
    loop = compiled("count_nonfinite")
    if loop is not None and format_of(a.dtype) == fmt:
        count = loop(a)
        if count >= 0:
            return count
    exponent = _EXPONENT[fmt]
    bits = a.view(np.uint32 if fmt == "float32" else np.uint16)
    return int(np.count_nonzero((bits & exponent) == exponent))


def level(choose=None):
    """The compiled cast's code path: :data:`AVX2` (AVX2 and F16C) or
    :data:`PORTABLE` (the CPU's best unless chosen); ``choose`` sets it to
    at most ``choose`` (for tests; ``level(AVX2)`` restores the best). None
    without the compiled loops."""
    loop = compiled("cast_level")
    if loop is None:
        return None
    return loop(-1 if choose is None else int(choose))

