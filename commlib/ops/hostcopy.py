"""Batched host copies: many numpy arrays <-> one flat numpy buffer, in one
call from Python (a C loop of ``memcpy``, ``commlib/native/hostcopy.c``),
instead of one numpy copy per array.

The C code reads each array's data pointer, shape, dtype and flags at the
time of the call and checks them all (exact ``numpy.ndarray``, the expected
dtype, C-contiguous, writeable when written, total size within the flat
buffer) before copying anything; any mismatch copies nothing and returns
False, and the caller takes its numpy path. Without the compiled library
(see :mod:`commlib.ops.native`) :func:`available` is False.
:func:`gather_any` and :func:`scatter_any` take that path themselves (numpy
or cupy arrays).
"""
import numpy as np

from ..errors import BackendUnavailableError
from . import native
from .arrays import array_module

available = native.available
unavailable_reason = native.unavailable_reason


def gather(arrays, out, skip=None, streaming=False, to_arrays=0):
    """Copy ``arrays`` (a tuple or list of C-contiguous numpy arrays of one
    dtype) into ``out`` (a writeable C-contiguous numpy array of that dtype,
    at least their total size) back to back, as
    ``np.concatenate(arrays, axis=None)`` would. ``skip=(begin, end)``
    leaves elements [begin, end) of ``out`` unwritten. ``streaming=True``
    writes ``out`` with non-temporal stores (for shared memory another core
    reads next; see ``commlib/native/streaming.h``). Returns True, or False
    with nothing copied when an array does not qualify or they do not fit.
    Raises :class:`~commlib.errors.ArrayTypeError` when ``out`` is not a
    writeable C-contiguous numpy array, BackendUnavailableError without the
    compiled loops. ``to_arrays=1`` copies the other way (:func:`scatter`)."""
    ext = native.module()
    if ext is None:
        raise BackendUnavailableError(native.unavailable_reason())
    itemsize = arrays[0].dtype.itemsize if arrays and type(arrays[0]) is np.ndarray else 1
    begin, end = (0, 0) if skip is None else skip
    return ext.copy(arrays, out, itemsize, to_arrays, begin * itemsize, end * itemsize,
                    streaming) >= 0


def scatter(src, arrays, skip=None):
    """The reverse of :func:`gather`: consecutive pieces of ``src`` go into
    the (writeable) arrays, except elements [begin, end) of ``skip``.
    Returns True, or False with nothing copied."""
    return gather(arrays, src, skip, False, 1)


def gather_any(arrays, out):
    """The arrays back to back into ``out`` whatever they are: :func:`gather`
    where the compiled loop takes them, else one concatenate of numpy or
    cupy (``out``'s kind)."""
    xp = array_module(out)
    if xp is np and available() and gather(arrays, out):
        return
    xp.concatenate([a.reshape(-1) for a in arrays], out=out[:sum(a.size for a in arrays)])


def scatter_any(src, arrays):
    """The reverse of :func:`gather_any`: :func:`scatter` where the compiled
    loop takes the arrays, else one copy per array (numpy or cupy)."""
    if type(src) is np.ndarray and available() and scatter(src, arrays):
        return
    offset = 0
    for a in arrays:
        a[...] = src[offset:offset + a.size].reshape(a.shape)
        offset += a.size
