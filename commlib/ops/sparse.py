"""Scatter-add of sparse (index, value) sets into a dense float32 array.

``scatter_add(dense, indices, values)`` performs
``dense[indices[i]] += alpha * values[i]`` in place. The sets typically come
from several ranks (an all-gather-v of top-K results): ``segments`` gives the
per-rank entry counts. Indices are unique within a segment but may repeat
across segments; segments are applied one after another, so the result is
bit-identical from run to run. The error-feedback residual update is the
same call with ``alpha=-1``. Out-of-range indices are never written and are
counted in the returned ``bad``, which callers must check.

With cupy input all segments are one launch of ``kernels/sparse.cu``
(which keeps the segments' order where indices repeat); numpy input runs the
numpy twin.
"""
import numpy as np

from ..errors import ArgumentError
from .arrays import is_cupy
from .selection import check_length, check_same_kind, check_vector

_BLOCK = 256


def _segment_counts(segments, total):
    if segments is None:
        return (total,)
    if type(segments) in (list, tuple) and all(type(c) is int and c >= 0 for c in segments):
        if sum(segments) != total:  # the common case: a short list of ints, checked as is
            raise ArgumentError("segments: counts sum to %d, but indices holds %d entries"
                                % (sum(segments), total))
        return tuple(segments)
    if is_cupy(segments):
        segments = segments.get()
    seg = np.asarray(segments)
    if seg.ndim != 1 or (seg.size and seg.dtype.kind not in "iu"):
        raise ArgumentError("segments: expected a 1-D sequence of integers, got %r"
                            % (segments,))
    if seg.size and seg.min() < 0:
        raise ArgumentError("segments: counts must be >= 0")
    if int(seg.sum()) != total:
        raise ArgumentError("segments: counts sum to %d, but indices holds %d entries"
                            % (int(seg.sum()), total))
    return tuple(int(c) for c in seg)


def scatter_add(dense, indices, values, *, alpha=1.0, segments=None, bad=None):
    """``dense[indices[i]] += alpha * values[i]``, in place, segment by segment.

    dense: 1-D contiguous float32 array (numpy or cupy, like the others).
    indices: 1-D int32; -1 is padding and skipped, any other index outside
    ``[0, len(dense))`` is counted and never written. values: 1-D float32,
    same length as indices. alpha: scale, rounded to float32; the product is
    rounded before the add. segments: per-segment entry counts summing to
    ``len(indices)`` (host sequence; a cupy array is copied to the host);
    None means one segment. Indices must be unique within a segment:
    duplicates inside one segment make the result order-dependent on the GPU.
    bad: optional 0-d int64 array of dense's kind to write the count below
    into (saves allocating one; a call whose launches are captured into a
    graph must pass it); default a new one.

    Returns ``bad``: a 0-d int64 array (a device array for cupy input)
    counting the out-of-range indices, which were skipped. A non-zero count
    means a malformed set: check it, or validate the sets before the call
    (the compression strategies validate every received set first, see
    ``commlib.compression._payload``, and never pass a bad index).
    """
    check_vector(dense, "dense", np.float32)
    check_vector(indices, "indices", np.int32)
    check_vector(values, "values", np.float32)
    check_same_kind(dense=dense, indices=indices, values=values)
    if indices.size != values.size:
        raise ArgumentError("values: length %d differs from indices' %d"
                            % (values.size, indices.size))
    check_length(indices.size, "indices")
    counts = _segment_counts(segments, indices.size)
    alpha = np.float32(alpha)
    if bad is not None:
        check_same_kind(dense=dense, bad=bad)
        if bad.shape != () or bad.dtype != np.int64:
            raise ArgumentError("bad: expected a 0-d int64 array, got shape %s dtype %s"
                                % (bad.shape, bad.dtype))
    if is_cupy(dense):
        return _scatter_add_cuda(dense, indices, values, alpha, counts, bad)
    count = _scatter_add_numpy(dense, indices, values, alpha)
    if bad is None:
        return count
    bad[...] = count
    return bad


def _scatter_add_numpy(dense, indices, values, alpha):
    # Entries are applied in order, which is segment order.
    n = dense.size
    ok = (indices >= 0) & (indices < n)
    bad = int(np.count_nonzero((indices != -1) & ~ok))
    with np.errstate(over="ignore", invalid="ignore"):
        np.add.at(dense, indices[ok], alpha * values[ok])
    return np.array(bad, dtype=np.int64)


ITEM = 4 * _BLOCK  # entries per work item of kernels/sparse.cu (kItem)


def _scatter_add_cuda(dense, indices, values, alpha, counts, bad):
    import cupy
    from . import _launch, _loader
    with dense.device:
        if bad is None:
            bad = cupy.empty((), dtype=cupy.int64)
        _launch.memset0(bad)
        device = dense.device.id
        p = _launch.plan(("scatter_add", device, counts, _loader.get_function),
                         lambda: _scatter_plan(counts))
        if p is not None:
            kernel, grid, table, nseg = p
            ws = _launch.workspace(device, "scatter_add", 3, cupy.uint32, zeroed=True)
            kernel(grid, (_BLOCK,), (dense, np.int64(dense.size), indices, values, table, nseg,
                                     alpha, bad, ws))
    return bad


def _scatter_plan(counts):
    """(kernel, grid, device segment table, nseg) of kernels/sparse.cu for
    these segment counts (empty segments dropped), or None with no entries."""
    import cupy
    from ._loader import get_function, persistent_grid
    starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))[:-1]
    keep = [i for i, c in enumerate(counts) if c]
    if not keep:
        return None
    count = np.array([counts[i] for i in keep], np.int64)
    start = starts[keep].astype(np.int64)
    first = np.concatenate(([0], np.cumsum(-(-count // ITEM)))).astype(np.int64)
    table = cupy.asarray(np.concatenate((first, start, count)))
    kernel = get_function("sparse.cu", "scatter_add")
    return kernel, persistent_grid(int(first[-1]), kernel, _BLOCK), table, np.int64(len(keep))
