"""This rank's share of a shared-memory all-reduce, computed in one C call
straight from the caller's arrays (``commlib/native/hostreduce.c``).

In :class:`~commlib.transport.shm.SharedMemoryReducer` rank r reduces
elements ``[lo, hi)`` of every rank's slot. Its own contribution to that
range never needs to pass through its slot: :func:`reduce_share` reads it
from the arrays, and writes the result both to the shared result region and
back into the arrays, so rank r neither packs nor unpacks its own share.
Results are bit-identical to the numpy ufunc reduction in rank order; for
float16 and bfloat16 (bfloat16 as ``ml_dtypes`` arrays, or uint16 bits with
``fmt="bfloat16"``) to :func:`commlib.ops.hostcast.reduce_into` in rank
order (each step widened to float32 and rounded back to nearest even).
"""

import numpy as np

from ..errors import CommlibError
from . import native

_TYPES = {"float32": 0, "float64": 1, "int32": 2, "int64": 3, "uint8": 4, "float16": 5,
          "bfloat16": 6}
#: the type code of uint16 bits of bfloat16 (``fmt="bfloat16"``)
BFLOAT16_BITS = 6
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}
_codes = {}             # numpy dtype -> type code, or -1 (dtype.name is slow)


def _type_code(dtype, fmt=None):
    if fmt is not None:
        return BFLOAT16_BITS if fmt == "bfloat16" and dtype == np.uint16 else -1
    code = _codes.get(dtype)
    if code is None:
        code = _codes[dtype] = _TYPES.get(dtype.name, -1) if dtype.isnative else -1
    return code


def supports(dtype, op, fmt=None):
    """Whether :func:`reduce_share` takes ``dtype`` (numpy dtype) holding
    ``fmt`` (None, or ``"bfloat16"`` for uint16 bits) and ``op``, and the
    compiled module is available."""
    return _type_code(dtype, fmt) >= 0 and op in _OPS and native.available()


def reduce_share(parts, slots, rank, result, begin, end, op, scale=None, streaming=False,
                 fmt=None, cast_own=None):
    """Reduce elements ``[begin, end)`` of a bucket over all ranks.

    ``parts``: this rank's arrays (tuple or list of C-contiguous writeable
    numpy arrays of one dtype) whose concatenation is its contribution;
    ``slots``: tuple of every rank's flat buffer of that dtype (entry
    ``rank``, this rank's, is not read); ``result``: flat writeable numpy
    buffer of that dtype. Each element becomes the rank-order reduction with
    ``op`` (``"sum"``, ``"prod"``, ``"max"``, ``"min"``), times ``scale``
    (float, floating dtypes only) if given, and is written to ``result``
    (with non-temporal stores when ``streaming``: see
    ``commlib/native/streaming.h``) and into ``parts``. ``fmt``:
    ``"bfloat16"`` when the arrays are uint16 bits of bfloat16.

    ``cast_own``: None, or (float16 and bfloat16 results only) a float
    scale: ``parts`` are then aligned float32 arrays, read only, whose
    values times ``cast_own`` are rounded to the result's format (as
    :func:`commlib.ops.hostcast.cast_into` would into this rank's slot)
    before they take part: the half-precision wire's own share, never cast
    into shared memory. Returns ``(sent, found)``: the NaN and inf that
    rounding gave, and those in the reduced elements; None without
    ``cast_own``.

    Raises :class:`~commlib.errors.CommlibError` when an argument does not
    qualify (nothing is written then).
    """
    dtype = result.dtype
    ext = native.module()
    done = -1
    if ext is not None:
        size = dtype.itemsize
        done = ext.reduce_share(parts, slots, rank, result, size, _type_code(dtype, fmt),
                                _OPS.get(op, -1), begin * size, end * size,
                                None if scale is None else float(scale), streaming,
                                None if cast_own is None else float(cast_own))
    if type(done) is tuple:
        return done
    if done < 0:
        raise CommlibError("commlib: reduce_share got arrays that are not C-contiguous "
                           "%s numpy arrays of %s covering elements [%d, %d), or an "
                           "unsupported dtype/op (%s, %r)"
                           % ("writeable" if cast_own is None else "aligned float32 (cast to)",
                              dtype, begin, end, dtype, op))
    return None
