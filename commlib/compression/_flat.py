"""A bucket of arrays as one flat vector, for the compression strategies,
and the buffers they keep between calls."""
import itertools

import numpy as np

from ..core.caches import IdentityCache
from ..ops import hostcast, hostcopy
from ..ops import pack as _pack
from ..ops.arrays import address, array_module


def buffer(workspace, name, xp, size, dtype, zero=False):
    """``workspace[name]``: a 1-D array of ``size`` ``dtype`` elements
    (zero-filled when first made, if ``zero``), kept between calls."""
    found = workspace.get(name)
    if found is None or found.size != size or type(found) is not xp.ndarray:
        found = workspace[name] = (xp.zeros if zero else xp.empty)(size, dtype=dtype)
    return found


def views(workspace, name, array, make):
    """``make(array)`` (views of ``array``, a tuple), kept in ``workspace``
    under ``name`` while ``array`` is the same object: a steady call makes
    no new views (each costs microseconds on a GPU array)."""
    found = workspace.get(name)
    if found is None or found[0] is not array:
        found = workspace[name] = (array, make(array))
    return found[1]


def accumulators(workspace, xp, size, error_feedback):
    """A sparsifier's ``(acc, residual)`` for a bucket of ``size`` values,
    kept in ``workspace`` (:func:`buffer`): the float32 sum it selects from,
    and the residual (zero-filled when first made; None without
    ``error_feedback``). The two swap at every call with error feedback."""
    acc = buffer(workspace, "acc", xp, size, np.float32)
    residual = None
    if error_feedback:
        residual = buffer(workspace, "residual", xp, size, np.float32, zero=True)
    return acc, residual


def counters(workspace, name, xp, count, zero=False):
    """``count`` 0-d int64 counters for kernels to write, views of one
    :func:`buffer` ``workspace[name]`` (its views kept, see :func:`views`),
    and that buffer: ``(buffer, (counter, ...))``."""
    words = buffer(workspace, name, xp, count, np.int64, zero=zero)
    return words, views(workspace, name + " parts", words,
                        lambda w: tuple(w[i:i + 1].reshape(()) for i in range(count)))


def identity(arrays, workspace):
    """``(addresses, size)``: the arrays' addresses (a tuple; part of the
    keys of a bucket's CUDA graphs) and their total number of elements,
    worked out once per list of array objects (an :class:`IdentityCache` in
    ``workspace``, which drops a list when one of its arrays dies), so that
    a steady call does no per-array Python work."""
    cache = workspace.get("identity")
    if cache is None:
        cache = workspace["identity"] = IdentityCache(4)
    key = IdentityCache.key(arrays)
    found = cache.get(key)
    if found is None:
        found = (tuple(address(a) for a in arrays), sum(a.size for a in arrays))
        cache.put(key, arrays, found)
    return found


def plan_of(buckets, state, make):
    """The plan ``make(buckets)`` of a call's buckets reduced together (see
    :meth:`~commlib.compression.base.Compression.reduce_all`), kept in
    ``state`` (an :class:`IdentityCache` of 4, recognising the list by the
    identity of the buckets' arrays, which a plan must not hold), or None
    when ``make`` declines (its answer is kept too)."""
    arrays = list(itertools.chain.from_iterable(b.arrays for b in buckets))
    cache = state.get("together")
    if cache is None:
        cache = state["together"] = IdentityCache(4)
    key = IdentityCache.key(arrays, (len(buckets), buckets[0].size))
    plan = cache.get(key)
    if plan is None:
        plan = make(buckets) or False
        cache.put(key, arrays, plan)
    return plan or None


def gather(arrays, workspace):
    """The bucket as one float32 vector: the single array's flat view, or
    its arrays copied back to back into ``workspace["flat"]`` (numpy: the
    compiled copy loop; cupy: one launch of the batched pack kernel, not a
    copy per array)."""
    flat = flat_of(arrays, workspace)
    copy_in(arrays, flat)
    return flat


def flat_of(arrays, workspace, size=None):
    """:func:`gather`'s vector without the copy: the single array (1-D as
    it is, else its flat view), or ``workspace["flat"]`` (for
    :func:`copy_in`). ``size``: the arrays' total number of elements when
    known (see :func:`identity`)."""
    if len(arrays) == 1:
        return arrays[0] if arrays[0].ndim == 1 else arrays[0].reshape(-1)
    if size is None:
        size = identity(arrays, workspace)[1]
    return buffer(workspace, "flat", array_module(arrays[0]), size, np.float32)


def copy_in(arrays, flat):
    """Copy the arrays back to back into ``flat`` (:func:`flat_of`'s
    vector; nothing to do for a single array, whose view it is)."""
    if len(arrays) <= 1:
        return
    if type(flat) is np.ndarray:
        hostcopy.gather_any(arrays, flat)
    else:
        _pack.pack(arrays, flat)


def scatter(flat, arrays):
    """Copy ``flat`` back into the arrays (nothing to do for a single array,
    whose flat view it is): numpy through the compiled copy loop, cupy in
    one launch of the batched unpack kernel."""
    if len(arrays) <= 1:
        return
    if type(flat) is np.ndarray:
        hostcopy.scatter_any(flat, arrays)
    else:
        _pack.unpack(flat, arrays)


#: arrays of fewer elements than this on average are cast through one flat
#: copy of the bucket (one C call each way), larger ones one by one
SMALL_ARRAYS = 4096


def cast_parts(arrays, wire, workspace, scale=np.float32(1), into_wire=True):
    """Cast numpy ``arrays`` into their consecutive parts of the 1-D ``wire``
    (times ``scale``, np.float32), or back when not ``into_wire``, with
    :func:`commlib.ops.hostcast.cast_into`; returns the non-finite values
    written. Each array is cast straight from (or into) its own memory,
    unless they are many small ones: then through ``workspace["flat"]``
    (one gather or scatter and one cast, fewer calls from Python)."""
    if len(arrays) > 1 and wire.size < SMALL_ARRAYS * len(arrays):
        if into_wire:
            return hostcast.cast_into(gather(arrays, workspace), wire, scale)
        flat = buffer(workspace, "flat", np, wire.size, np.float32)
        count = hostcast.cast_into(wire, flat)
        scatter(flat, arrays)
        return count
    count, at = 0, 0
    for a in arrays:
        part = wire[at:at + a.size]
        at += a.size
        if into_wire:
            count += hostcast.cast_into(a.reshape(-1), part, scale)
        elif a.flags.c_contiguous:
            count += hostcast.cast_into(part, a.reshape(-1))
        else:
            wide = np.empty(a.size, a.dtype)
            count += hostcast.cast_into(part, wide)
            a[...] = wide.reshape(a.shape)
    return count


def describe(size, count):
    """``"a bucket of <size> float32 values (<count> arrays)"``, for messages."""
    return "a bucket of %d float32 values (%d array%s)" % (size, count,
                                                            "" if count == 1 else "s")
