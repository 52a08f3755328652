"""This rank's share of a shared-memory all-reduce, computed in one C call
straight from the caller's arrays (``commlib/native/hostreduce.c``).

In :class:`~commlib.transport.shm.SharedMemoryReducer` rank r reduces
elements ``[lo, hi)`` of every rank's slot. Its own contribution to that
range never needs to pass through its slot: :func:`reduce_share` reads it
from the arrays, and writes the result both to the shared result region and
back into the arrays, so rank r neither packs nor unpacks its own share.
Results are bit-identical to the numpy ufunc reduction in rank order.
"""

from ..errors import CommlibError
from . import native

_TYPES = {"float32": 0, "float64": 1, "int32": 2, "int64": 3, "uint8": 4}
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}
_codes = {}             # numpy dtype -> type code, or -1 (dtype.name is slow)


def _type_code(dtype):
    code = _codes.get(dtype)
    if code is None:
        code = _codes[dtype] = _TYPES.get(dtype.name, -1) if dtype.isnative else -1
    return code


def supports(dtype, op):
    """Whether :func:`reduce_share` takes ``dtype`` (numpy dtype) and ``op``
    and the compiled module is available. float16 and bfloat16 are not
    taken (numpy reduces them)."""
    return _type_code(dtype) >= 0 and op in _OPS and native.available()


def reduce_share(parts, slots, rank, result, begin, end, op, scale=None, streaming=False):
    """Reduce elements ``[begin, end)`` of a bucket over all ranks.

    ``parts``: this rank's arrays (tuple or list of C-contiguous writeable
    numpy arrays of one dtype) whose concatenation is its contribution;
    ``slots``: tuple of every rank's flat buffer of that dtype (entry
    ``rank``, this rank's, is not read); ``result``: flat writeable numpy
    buffer of that dtype. Each element becomes the rank-order reduction with
    ``op`` (``"sum"``, ``"prod"``, ``"max"``, ``"min"``), times ``scale``
    (float, floating dtypes only) if given, and is written to ``result``
    (with non-temporal stores when ``streaming``: see
    ``commlib/native/streaming.h``) and into ``parts``. Raises
    :class:`~commlib.errors.CommlibError` when an argument does not qualify
    (nothing is written then).
    """
    dtype = result.dtype
    ext = native.module()
    done = -1
    if ext is not None:
        size = dtype.itemsize
        done = ext.reduce_share(parts, slots, rank, result, size, _type_code(dtype),
                                _OPS.get(op, -1), begin * size, end * size,
                                None if scale is None else float(scale), streaming)
    if done < 0:
        raise CommlibError("commlib: reduce_share got arrays that are not C-contiguous "
                           "writeable numpy arrays of %s covering elements [%d, %d), or an "
                           "unsupported dtype/op (%s, %r)" % (dtype, begin, end, dtype, op))
