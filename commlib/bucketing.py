"""Fusion of many arrays into few collectives.

A :class:`BucketPlan` is the layout for one list of arrays: arrays of at
least ``bucket_bytes`` are reduced in place one by one (no copy); smaller
ones are packed, in list order and grouped by dtype, into flat buckets of at
most ``bucket_bytes``. The plan depends only on the (dtype, size) sequence,
so it is hashable, cached, and identical on every rank that passes the same
shapes — later compression stages key their per-bucket state (error-feedback
residuals) on ``(plan.key, bucket index)``.
"""
import functools
import operator
from typing import NamedTuple, Tuple

from .ops import pack as _pack

#: default bucket size per transport, in bytes (see benchmarks/allreduce.py)
DEFAULT_BUCKET_BYTES = {"mpi": 1 << 20, "nccl": 25 << 20}


class Bucket(NamedTuple):
    """Arrays ``indices`` (into the caller's list) packed back to back."""
    dtype: object      # numpy dtype
    indices: Tuple[int, ...]
    size: int          # elements in the bucket


class BucketPlan(NamedTuple):
    key: tuple         # ((dtype, size), ...) of the list, and bucket_bytes
    direct: Tuple[int, ...]   # arrays reduced in place, in list order
    buckets: Tuple[Bucket, ...]


def plan_for(arrays, bucket_bytes):
    """The (cached) :class:`BucketPlan` for a list of arrays."""
    dts = map(operator.attrgetter("dtype"), arrays)
    sizes = map(operator.attrgetter("size"), arrays)
    return _plan(tuple(zip(dts, sizes)), int(bucket_bytes))


@functools.lru_cache(maxsize=64)
def _plan(layout, bucket_bytes):
    direct = []
    open_buckets = {}      # dtype -> (indices, size)
    buckets = []
    for i, (dt, size) in enumerate(layout):
        itemsize = dt.itemsize
        if size == 0:
            continue
        if size * itemsize >= bucket_bytes:
            direct.append(i)
            continue
        indices, total = open_buckets.get(dt, ((), 0))
        if (total + size) * itemsize > bucket_bytes:
            buckets.append(Bucket(dt, indices, total))
            indices, total = (), 0
        open_buckets[dt] = (indices + (i,), total + size)
    for dt, (indices, total) in open_buckets.items():
        buckets.append(Bucket(dt, indices, total))
    buckets.sort(key=lambda b: b.indices[0])
    return BucketPlan((layout, bucket_bytes), tuple(direct), tuple(buckets))


class Scratch:
    """Reusable flat buffers, one per (array module, dtype), grown on demand."""

    def __init__(self):
        self._buffers = {}

    def get(self, xp, dtype, size):
        """A 1-D ``xp`` array of ``size`` elements of ``dtype`` (contents undefined)."""
        key = (xp.__name__, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.size < size:
            buf = xp.empty(max(size, 1), dtype=dtype)
            self._buffers[key] = buf
        return buf[:size]

    def clear(self):
        self._buffers.clear()


def pack(arrays, indices, out):
    """Pack ``arrays[i] for i in indices`` into ``out``; returns ``out``."""
    return _pack.pack([arrays[i] for i in indices], out)


def unpack(buf, arrays, indices, scale=None):
    """Copy ``buf`` back into ``arrays[i] for i in indices``, times ``scale``."""
    _pack.unpack(buf, [arrays[i] for i in indices], scale=scale)
