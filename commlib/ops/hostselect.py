"""The sparse strategies' host loops in C (``commlib/native/hostselect.c``):
top-K, threshold compaction, scatter-add and the residual accumulation,
bit for bit the numpy twins in :mod:`commlib.ops.topk`,
:mod:`commlib.ops.threshold`, :mod:`commlib.ops.sparse` (and
:func:`commlib.compression.nonfinite.drop`), which run instead when the
compiled loops are unavailable or an array does not qualify (not an exact,
1-D, C-contiguous, aligned, native-order numpy array); they also raise the
argument errors.
"""
import numpy as np

from . import sparse as _sparse
from . import threshold as _threshold
from . import topk as _topk
from .selection import check_count
from .hostcast import compiled


def _plain(*arrays):
    return all(a is None or (type(a) is np.ndarray and a.ndim == 1) for a in arrays)


def topk(x, k, *, residual=None):
    """:func:`commlib.ops.topk.topk` (same arguments, results and
    residual update) for numpy arrays."""
    loop = compiled("topk")
    if loop is not None and _plain(x, residual):
        kk = min(check_count(k, "k"), x.size)
        indices, values = np.empty(kk, np.int32), np.empty(kk, np.float32)
        if loop(x, residual, kk, indices, values) >= 0:
            return indices, values
    return _topk.topk(x, k, residual=residual)


def topk_accumulate(residual, x, acc, k):
    """:func:`accumulate_finite` then :func:`topk` of ``acc``, in one
    compiled pass where it can: returns ``(nonfinite, indices, values)``;
    ``acc`` holds ``residual + x`` with its non-finite sums 0."""
    loop = compiled("topk_accumulate")
    if loop is not None and _plain(residual, x, acc):
        kk = min(check_count(k, "k"), x.size)
        indices, values = np.empty(kk, np.int32), np.empty(kk, np.float32)
        nonfinite = loop(residual, x, acc, kk, indices, values)
        if nonfinite >= 0:
            return nonfinite, indices, values
    nonfinite = accumulate_finite(residual, x, acc)
    return (nonfinite,) + tuple(topk(acc, k))


def threshold(x, t):
    """``(indices, values)`` of every element of ``x`` with ``|x| > t``,
    ascending: :func:`commlib.ops.threshold.threshold`'s entries cut to its
    count (int32 and float32 arrays of that length)."""
    loop = compiled("threshold")
    if loop is not None and _plain(x):
        tkey = _threshold.threshold_key(t)
        indices, values = np.empty(x.size, np.int32), np.empty(x.size, np.float32)
        found = loop(None, x, None, tkey, indices, values)
        if found != -1:
            return indices[:found[0]], values[:found[0]]
    indices, values, count = _threshold.threshold(x, t)
    return indices[:int(count)], values[:int(count)]


def threshold_accumulate(residual, x, acc, t):
    """:func:`accumulate_finite` then :func:`threshold` of ``acc``, in one
    compiled pass: returns ``(nonfinite, indices, values)``."""
    loop = compiled("threshold")
    if loop is not None and _plain(residual, x, acc):
        tkey = _threshold.threshold_key(t)
        indices, values = np.empty(x.size, np.int32), np.empty(x.size, np.float32)
        found = loop(residual, x, acc, tkey, indices, values)
        if found != -1:
            return found[1], indices[:found[0]], values[:found[0]]
    nonfinite = accumulate_finite(residual, x, acc)
    return (nonfinite,) + tuple(threshold(acc, t))


def scatter_add(dense, indices, values, *, alpha=1.0, segments=None):
    """:func:`commlib.ops.sparse.scatter_add` for numpy arrays; returns
    ``bad``, a 0-d int64 array."""
    loop = compiled("scatter")
    if loop is not None and _plain(dense, indices, values) \
            and (segments is None or sum(int(c) for c in segments) == indices.size):
        bad = loop(dense, indices, values, float(np.float32(alpha)), False)
        if bad >= 0:
            return np.array(bad, dtype=np.int64)
    return _sparse.scatter_add(dense, indices, values, alpha=alpha, segments=segments)


def sparse_sum(dense, indices, values, scale=None, segments=None):
    """``dense[...] = 0``, then :func:`scatter_add` of every segment, then
    ``dense *= np.float32(scale)`` unless ``scale`` is None, in one compiled
    call (the multiply only where entries landed, which gives the same bits
    for a scale that is not negative); returns ``bad`` as scatter_add."""
    loop = compiled("scatter")
    if loop is not None and _plain(dense, indices, values) \
            and (segments is None or sum(int(c) for c in segments) == indices.size):
        bad = loop(dense, indices, values,
                   None if scale is None else float(np.float32(scale)), True)
        if bad >= 0:
            return np.array(bad, dtype=np.int64)
    dense[...] = 0
    bad = scatter_add(dense, indices, values, segments=segments)
    if scale is not None:
        dense *= np.float32(scale)
    return bad


def accumulate_finite(residual, x, acc):
    """``acc = residual + x`` (``acc = x`` when ``residual`` is None), then
    its NaN and +-inf entries set to 0; returns how many (int). float32
    numpy arrays of one length; ``acc`` is neither of the others."""
    loop = compiled("accumulate_finite")
    if loop is not None and _plain(residual, x, acc):
        count = loop(residual, x, acc)
        if count >= 0:
            return count
    with np.errstate(over="ignore", invalid="ignore"):
        if residual is None:
            acc[...] = x
        else:
            np.add(residual, x, out=acc)
    bad = ~np.isfinite(acc)
    count = int(np.count_nonzero(bad))
    if count:
        acc[bad] = 0
    return count
