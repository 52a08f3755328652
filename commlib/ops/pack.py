"""Batched pack / unpack: many arrays <-> one flat bucket.

``pack(arrays, out)`` copies each (contiguous) array, flattened, into
consecutive slices of the 1-D ``out``; ``unpack(buf, arrays)`` copies the
slices back. With cupy inputs this is one launch of ``kernels/pack.cu``
(a table of device pointers and offsets), not one copy per array. Optional
``scale`` multiplies while copying and a different ``out`` dtype casts
(e.g. float32 gradients into a float16 bucket).
"""
import numpy as np

from ._arrays import is_cupy


def offsets_of(arrays):
    """int64 element offsets: ``offsets[i]`` is where array i starts; the
    last entry is the total length."""
    sizes = [a.size for a in arrays]
    return np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))


def pack(arrays, out, scale=None):
    """Copy ``arrays`` (flattened, in order) into the 1-D ``out``.

    ``out`` must hold at least ``sum(a.size)`` elements; elements past that
    are left untouched. ``scale`` (float or None) multiplies every value.
    Returns ``out``.
    """
    total = sum(a.size for a in arrays)
    dst = out[:total]
    if is_cupy(out):
        from ._pack_cuda import pack_cuda
        return pack_cuda(arrays, out, scale)
    if arrays:
        np.concatenate(arrays, axis=None, out=dst, casting="same_kind"
                       if scale is None else "unsafe")
    if scale is not None and total:
        np.multiply(dst, scale, out=dst, casting="unsafe")
    return out


def unpack(buf, arrays, scale=None, accumulate=False):
    """Copy consecutive slices of the 1-D ``buf`` back into ``arrays``.

    ``scale`` multiplies while copying; ``accumulate=True`` adds into the
    arrays instead of overwriting them. Returns ``arrays``.
    """
    if is_cupy(buf):
        from ._pack_cuda import unpack_cuda
        return unpack_cuda(buf, arrays, scale, accumulate)
    offset = 0
    for a in arrays:
        n = a.size
        src = buf[offset:offset + n].reshape(a.shape)
        offset += n
        if scale is not None:
            src = src * scale
        if accumulate:
            np.add(a, src, out=a, casting="unsafe")
        else:
            np.copyto(a, src, casting="unsafe")
    return arrays
