"""Batched pack / unpack: many arrays <-> one flat bucket.

``pack(arrays, out)`` copies each array, flattened, into consecutive slices
of the 1-D ``out``; ``unpack(buf, arrays)`` copies the slices back. With cupy
inputs this is one launch of ``kernels/pack.cu`` per distinct array dtype (a
cached table of device pointers and offsets), not one copy per array.
Optional ``scale`` multiplies while copying and a different bucket dtype
casts (e.g. float32 gradients into a float16 bucket). Optional ``unless``,
a 0-d int64 array, guards the copy: when it holds a non-zero value nothing
is written. On a GPU the kernel reads it, so a count computed on the device
(of NaN and inf in a reduced result, say) decides without a host read.

Three modes, chosen by :func:`commlib.ops.cast.copy_mode` the same way on both paths:

* ``"raw"``: every dtype equals the bucket's, no scale, no accumulate, no
  counting: an exact copy (any dtype, integers included).
* ``"cast"``: all dtypes are float32 / float16 / uint16 (read as bfloat16
  bits): the arithmetic, rounding and canonical NaNs of
  :func:`commlib.ops.cast.cast`, bit for bit on both paths.
* ``"generic"``: anything else (float64, integers with a scale, ...): numpy
  casting rules, computed per array.
"""
import numpy as np

from ..errors import ArgumentError, ArrayTypeError
from .arrays import is_cupy
from .cast import check_counter, check_scale, copy_mode, numpy_cast_into


def offsets_of(arrays):
    """int64 element offsets: ``offsets[i]`` is where array i starts; the
    last entry is the total length."""
    sizes = [a.size for a in arrays]
    return np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))


def pack(arrays, out, scale=None, *, nonfinite=None, unless=None):
    """Copy ``arrays`` (flattened, in order) into the 1-D ``out``.

    arrays: sequence of numpy (or cupy, with a cupy ``out``) arrays.
    out: 1-D array holding at least ``sum(a.size)`` elements; elements past
        that are left untouched.
    scale: float or None; multiplies every value.
    nonfinite: optional 0-d int64 array (same kind as ``out``); the number of
        non-finite values written is added to it.
    unless: optional 0-d int64 array (same kind as ``out``): when it is not
        0, nothing is written or counted.
    Returns ``out``.
    """
    arrays = list(arrays)
    if is_cupy(out):
        from ._pack_cuda import pack_cuda
        return pack_cuda(arrays, out, scale, nonfinite=nonfinite, unless=unless)
    total = _check_numpy(arrays, out, "out")
    counter = check_counter(nonfinite, False)
    if check_counter(unless, False, "unless") is not None and unless:
        return out
    dst = out[:total]
    mode = copy_mode([a.dtype for a in arrays], out.dtype, scale, False, counter is not None)
    if mode == "raw":
        if arrays:
            np.concatenate(arrays, axis=None, out=dst)
        return out
    if mode == "cast":
        scale32 = np.float32(1) if scale is None else check_scale(scale)
        if all(a.dtype == out.dtype for a in arrays):
            if arrays:
                np.concatenate(arrays, axis=None, out=dst)
            count = numpy_cast_into(dst, dst, scale32)
        else:
            count = 0
            for a, lo, hi in _slices(arrays):
                count += numpy_cast_into(a, dst[lo:hi], scale32)
    else:
        if arrays:
            np.concatenate(arrays, axis=None, out=dst,
                           casting="same_kind" if scale is None else "unsafe")
        if scale is not None and total:
            np.multiply(dst, scale, out=dst, casting="unsafe")
        count = _count_nonfinite(dst) if counter is not None else 0
    if counter is not None:
        counter += count
    return out


def unpack(buf, arrays, scale=None, accumulate=False, *, nonfinite=None, unless=None):
    """Copy consecutive slices of the 1-D ``buf`` back into ``arrays``.

    scale: float or None; multiplies while copying.
    accumulate: add into the arrays instead of overwriting them.
    nonfinite: optional 0-d int64 array (same kind as ``buf``); the number of
        non-finite values written is added to it.
    unless: optional 0-d int64 array (same kind as ``buf``): when it is not
        0, nothing is written or counted.
    Returns ``arrays``.
    """
    if is_cupy(buf):
        from ._pack_cuda import unpack_cuda
        return unpack_cuda(buf, arrays, scale, accumulate, nonfinite=nonfinite, unless=unless)
    arrays_list = list(arrays)
    _check_numpy(arrays_list, buf, "buf")
    counter = check_counter(nonfinite, False)
    if check_counter(unless, False, "unless") is not None and unless:
        return arrays
    mode = copy_mode([a.dtype for a in arrays_list], buf.dtype, scale, accumulate,
                     counter is not None)
    scale32 = None
    if mode == "cast":
        scale32 = np.float32(1) if scale is None else check_scale(scale)
    count = 0
    for a, lo, hi in _slices(arrays_list):
        src = buf[lo:hi]
        if mode == "raw":
            np.copyto(a, src.reshape(a.shape))
        elif mode == "cast":
            if a.flags.c_contiguous:
                count += numpy_cast_into(src, a, scale32, accumulate)
            else:
                tmp = np.ascontiguousarray(a) if accumulate else np.empty(a.shape, a.dtype)
                count += numpy_cast_into(src, tmp, scale32, accumulate)
                np.copyto(a, tmp)
        else:
            src = src.reshape(a.shape)
            if scale is not None:
                src = src * scale
            if accumulate:
                np.add(a, src, out=a, casting="unsafe")
            else:
                np.copyto(a, src, casting="unsafe")
            if counter is not None:
                count += _count_nonfinite(a)
    if counter is not None:
        counter += count
    return arrays


def bound(direction, arrays, buf, scale=None):
    """For cupy arrays: ``pack(arrays, buf, scale)`` (``direction="pack"``)
    or ``unpack(buf, arrays, scale)`` (``"unpack"``) as a callable of no
    arguments that repeats it, checked and planned once (the launches
    alone at each call). ``arrays`` and ``buf`` must keep their memory
    while it is used. Its ``launches_only`` attribute says whether a call
    is kernel launches alone, which a CUDA graph may capture."""
    if not is_cupy(buf):
        raise ArrayTypeError("buf: expected a cupy array, got %s" % type(buf).__name__)
    from ._pack_cuda import bind
    return bind(direction, arrays, buf, scale)


def _slices(arrays):
    """(array, start, stop) of each non-empty array in the bucket."""
    lo = 0
    for a in arrays:
        n = a.size
        if n:
            yield a, lo, lo + n
        lo += n


def _check_numpy(arrays, bucket, what):
    """Total element count after checking a numpy bucket and its arrays."""
    if not isinstance(bucket, np.ndarray):
        raise ArrayTypeError("%s: expected a numpy or cupy array, got %s"
                             % (what, type(bucket).__name__))
    if bucket.ndim != 1:
        raise ArgumentError("%s: expected a 1-D bucket, got shape %s" % (what, bucket.shape))
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise ArrayTypeError("arrays[%d]: expected a numpy array (the bucket is numpy), "
                                 "got %s" % (i, type(a).__name__))
    total = sum(a.size for a in arrays)
    if bucket.size < total:
        raise ArgumentError("%s: expected at least %d elements (the arrays' total), got %d"
                            % (what, total, bucket.size))
    return total


def _count_nonfinite(a):
    if a.dtype.kind not in "fc":
        return 0
    return int(a.size - np.count_nonzero(np.isfinite(a)))
