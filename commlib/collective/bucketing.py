"""Fusion of many arrays into few collectives.

A :class:`BucketPlan` is the layout for one list of arrays: arrays of at
least ``bucket_bytes`` are reduced in place one by one (no copy); smaller
ones are packed, in list order and grouped by dtype, into flat buckets of at
most ``bucket_bytes`` (a bucket that would hold a single array is not made:
that array is reduced in place too). The plan depends only on the (dtype, size) sequence,
so it is hashable, cached, and identical on every rank that passes the same
shapes — later compression stages key their per-bucket state (error-feedback
residuals) on ``(plan.key, bucket index)``.

Arrays that already lie back to back in one buffer (see :func:`flat_arrays`)
are reduced where they lie, with no copy at all.

A training loop usually passes the same gradient arrays every step.
:class:`FusionCache` recognises such a list by the identity of its arrays and
keeps a :class:`PreparedList` for it: the plan, bucket buffers and views, so
a repeated call skips the per-array checks and planning. An entry is dropped
as soon as any of its arrays is garbage-collected (weak references), so the
cache never keeps user arrays alive nor mistakes a new array for an old one.
"""
import collections
import functools
import operator
from typing import NamedTuple, Tuple

import numpy as np

from ..core import dtypes, fingerprints
from ..core.caches import IdentityCache
from ..ops import graphs, native, hostcopy
from ..ops import cast as _cast
from ..ops import pack as _pack
from ..ops.arrays import address, array_module

#: default bucket size per transport, in bytes (see benchmarks/allreduce.py)
DEFAULT_BUCKET_BYTES = {"mpi": 1 << 20, "shm": 1 << 20, "nccl": 25 << 20, "local": 25 << 20,
                        "threads": 1 << 20}


def default_bucket_bytes(transport_name):
    """The default bucket cap of the transport named ``transport_name``
    (:data:`DEFAULT_BUCKET_BYTES`; MPI's for a transport of another name)."""
    return DEFAULT_BUCKET_BYTES.get(transport_name, DEFAULT_BUCKET_BYTES["mpi"])


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
        if size == 0:
            continue
        if size * dt.itemsize >= bucket_bytes:
            direct.append(i)
            continue
        indices, total = open_buckets.get(dt, ((), 0))
        if (total + size) * dt.itemsize > bucket_bytes:
            buckets.append(Bucket(dt, indices, total))
            indices, total = (), 0
        open_buckets[dt] = (indices + (i,), total + size)
    for dt, (indices, total) in open_buckets.items():
        buckets.append(Bucket(dt, indices, total))
    # a bucket of one array gains nothing from a copy: reduce it in place
    direct += [b.indices[0] for b in buckets if len(b.indices) == 1]
    buckets = sorted((b for b in buckets if len(b.indices) > 1), key=lambda b: b.indices[0])
    return BucketPlan((layout, bucket_bytes), tuple(sorted(direct)), tuple(buckets))


def span(arrays, xp):
    """A 1-D view of the memory that ``arrays`` (same dtype, C-contiguous)
    fill back to back inside one common base array, or None (also when
    the base is no array: memory of ``numpy.frombuffer`` or ``from_dlpack``)."""
    base = arrays[0].base
    if (not isinstance(base, xp.ndarray) or not base.flags.c_contiguous
            or any(a.base is not base for a in arrays)):
        return None
    start = end = address(arrays[0])
    for a in arrays:
        if address(a) != end:
            return None
        end += a.nbytes
    origin = address(base)
    if start < origin or end > origin + base.nbytes:
        return None
    raw = base.reshape(-1).view(xp.uint8)[start - origin:end - origin]
    return raw.view(arrays[0].dtype)


def flat_arrays(shapes, dtype="float32", xp=np):
    """Arrays of ``shapes`` that are consecutive views of one flat buffer.

    Gradients allocated this way are fused without any copy: a bucket of
    them is reduced where it lies (like PyTorch DDP's
    ``gradient_as_bucket_view``).

    Args:
        shapes: a sequence of shapes (tuples, or ints for 1-D arrays).
        dtype: the arrays' dtype (default ``"float32"``).
        xp: the array module, numpy (default) or cupy.

    Returns:
        A list of zero-filled arrays of ``dtype``, one per shape, in order,
        each a view of its consecutive part of one buffer.

    Raises:
        TypeError, ValueError: from ``xp`` for a ``dtype`` it does not
            understand or a negative shape (no check of its own).
    """
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    flat = xp.zeros(sum(sizes), dtype=dtype)
    out, offset = [], 0
    for shape, size in zip(shapes, sizes):
        out.append(flat[offset:offset + size].reshape(shape))
        offset += size
    return out


def _getter(indices):
    """A C-level picker: ``_getter(ix)(items)`` is the sequence (tuple, or a
    list slice when ``ix`` is a run of consecutive indices) of ``items[i]``."""
    first, last = indices[0], indices[-1]
    if last - first == len(indices) - 1:     # consecutive (indices are increasing)
        return operator.itemgetter(slice(first, last + 1))
    return operator.itemgetter(*indices)


def label_of(index, where):
    """A unit's name in a trace: its bucket index, or ``"direct N"``."""
    return index if index is not None else "direct %d" % where[1]


class Split:
    """The units of a list (see :attr:`PreparedList.units`) that a
    compression strategy compresses (``compressed``: ``(where, index,
    buffer or None, state)``, its state from :meth:`PreparedList.workspace`),
    with the state of them all together (``together``), their bytes, their
    names in a trace (``labels``, see :func:`label_of`), and the other units
    (``rest``)."""

    __slots__ = ("compressed", "together", "nbytes", "rest", "labels", "_arrays")

    def buckets(self, items):
        """``(arrays, state)`` of each compressed unit of ``items``: a
        bucket's arrays (its buffer alone when they lie back to back in it),
        or the array reduced in place itself (not a new flat view of it at
        every call: a strategy's plan recognises arrays by their identity)."""
        arrays = self._arrays
        return [(arrays(items, index, buf) if index is not None else (items[where[1]],), state)
                for where, index, buf, state in self.compressed]


class PreparedList:
    """A plan bound to one list of arrays, with its own bucket buffers.

    ``kind`` is ``"numpy"`` or ``"cupy"``. Its :attr:`units` are its
    buckets, then the arrays reduced in place (``plan.direct``).
    """

    def __init__(self, arrays, plan, kind, writeable):
        xp = array_module(arrays[0])
        self.plan, self.kind = plan, kind
        #: whether the arrays passed the writeable/contiguous checks
        self.writeable = writeable
        #: whether every array has a floating dtype (averaging allowed)
        self.floating = all(dtypes.is_floating(dt) for dt, _ in plan.key[0])
        self._pick = [_getter(b.indices) for b in plan.buckets]
        # a bucket whose arrays already lie back to back in one buffer is
        # reduced where it lies (zero copy); the others get a buffer of their own
        spans = [span(pick(arrays), xp) for pick in self._pick]
        self._zero_copy = [span is not None for span in spans]
        self._buffers = [span if span is not None else xp.empty(b.size, dtype=b.dtype)
                         for span, b in zip(spans, plan.buckets)]
        self._views = []          # numpy: per bucket, a view of the buffer per array
        # cupy: (bucket, "pack"/"unpack", scale) -> the copy's launches, checked
        # and planned once (ops.pack.bound): the list's arrays are these very
        # objects whenever this PreparedList is used
        self._bound = {}
        # cupy: the copies of several buckets issued together (copy_many),
        # per (direction, bucket indices, scale, units scaled in place), and
        # their CUDA graphs
        self._many = {}
        self._graphs = {}
        self._counter = None     # the in-place scalings' count of NaN and inf, unread
        #: the communicator's compression state for this plan's layout
        self.workspaces = None
        #: per compression strategy's name, the :class:`Split` of the units
        #: it compresses (see :meth:`split`): worked out once per list
        self.by_strategy = {}
        #: ``(where, index, buffer or None)`` of each unit: the buckets
        #: (``where`` and ``index`` the bucket's index, its buffer), then
        #: the arrays reduced in place (``where`` ``("direct", position in
        #: the list)``, ``index`` and buffer None)
        self.units = ([(i, i, buf) for i, buf in enumerate(self._buffers)]
                      + [(("direct", position), None, None) for position in plan.direct])
        self._copied = {}         # see copied()
        #: the consistency check's digest of the arrays' dtypes and shapes
        self.digest = fingerprints.layout_digest(arrays)
        # numpy: one C call per bucket copies every array (see ops/hostcopy.py)
        self._hostcopy = kind == "numpy" and hostcopy.available()
        if kind == "numpy":
            for buf, pick in zip(self._buffers, self._pick):
                views, offset = [], 0
                for a in pick(arrays):
                    views.append(buf[offset:offset + a.size].reshape(a.shape))
                    offset += a.size
                self._views.append(tuple(views))

    def buckets(self):
        """Indices 0..n-1 of the buckets, with their flat buffers."""
        return enumerate(self._buffers)

    def zero_copy(self, i):
        """Whether bucket ``i``'s buffer is the arrays' own memory."""
        return self._zero_copy[i]

    def pack(self, items, i):
        """Copy bucket ``i``'s arrays of ``items`` into the bucket's buffer;
        returns the buffer."""
        buf = self._buffers[i]
        if self._zero_copy[i]:
            return buf
        if self.kind != "numpy":
            self._copy(items, i, "pack", None)()
            return buf
        picked = self._pick[i](items)
        if not (self._hostcopy and hostcopy.gather(picked, buf)):
            np.concatenate(picked, axis=None, out=buf)
        return buf

    def unpack(self, items, i, scale=None):
        """Copy the reduced bucket ``i`` back into its arrays of ``items``,
        times ``scale``."""
        buf = self._buffers[i]
        if self._zero_copy[i]:
            if scale is not None:
                buf *= scale
            return
        if self.kind != "numpy":
            self._copy(items, i, "unpack", scale)()
            return
        picked = self._pick[i](items)
        if scale is not None:
            buf *= scale
        if self._hostcopy and hostcopy.scatter(buf, picked):
            return
        for dst, view in zip(picked, self._views[i]):
            dst[...] = view

    def _copy(self, items, i, direction, scale):
        """The bound pack or unpack of cupy bucket ``i`` (see ``_bound``)."""
        key = (i, direction, scale)
        copy = self._bound.get(key)
        if copy is None:
            copy = self._bound[key] = _pack.bound(direction, self._pick[i](items),
                                                  self._buffers[i], scale)
        return copy

    def flat(self, items, where):
        """The 1-D buffer of unit ``where`` (see
        :attr:`units`): bucket ``where``'s
        buffer, or the flat view of the array ``("direct", position)`` of
        ``items`` reduced in place."""
        return items[where[1]].reshape(-1) if isinstance(where, tuple) else self._buffers[where]

    def sized(self, where, buf):
        """``(dtype, bytes)`` of unit ``where``: those of its bucket's
        buffer ``buf``, or of the array's ``(dtype, size)`` entry in the
        plan's layout (``buf`` None)."""
        if buf is not None:
            return buf.dtype, buf.nbytes
        dtype, size = self.plan.key[0][where[1]]
        return dtype, dtype.itemsize * size

    def float32_in_place(self, units):
        """Of ``units`` (``(where, index, buffer or None)``, see
        :attr:`units`), the ``where`` of
        each float32 one whose memory is the user's own (a zero-copy
        bucket, an array reduced in place), as a tuple."""
        return tuple(where for where, i, buf in units
                     if (i is None or self._zero_copy[i])
                     and self.sized(where, buf)[0] == np.float32)

    def copied(self, units, transport=None):
        """The indices of the buckets among ``units`` (:attr:`units`, or a
        :class:`Split`'s ``rest``) whose data go through their own buffer
        (a tuple): every bucket not reduced where its arrays lie (see
        :meth:`zero_copy`), but those ``transport`` (an all-reduce's; None
        for other collectives) reduces from the arrays themselves
        (``reduces_parts``). Worked out once per list of units and transport."""
        key = (id(units), None if transport is None else transport.name)
        found = self._copied.get(key)
        if found is None:
            found = self._copied[key] = tuple(
                i for _, i, buf in units if i is not None and not self._zero_copy[i]
                and not (transport is not None and transport.reduces_parts(buf)))
        return found

    def unpacking(self, items, indices, scale, in_place=()):
        """A callable that unpacks the buckets ``indices`` of ``items``
        times ``scale`` (and scales the cupy units ``in_place``), see
        :meth:`copy_many`."""
        return functools.partial(self.copy_many, items, indices, "unpack", scale, in_place)

    def copy_many(self, items, indices, direction, scale=None, in_place=()):
        """Pack (``direction="pack"``) the buckets ``indices`` (a tuple of
        buckets with buffers of their own, see :meth:`zero_copy`) of
        ``items``, or unpack them times ``scale`` (``"unpack"``). numpy:
        one compiled copy per bucket. cupy: also scale the float32 units
        ``in_place`` (:meth:`float32_in_place`) where they lie; every copy
        is one launch sequence, replayed as a CUDA graph once it repeats
        (:mod:`commlib.ops.graphs`; the arrays and buffers are this list's
        own, so the key is the arguments); copies that are not kernel
        launches alone (numpy's casting rules) are issued directly."""
        if self.kind == "numpy":
            for i in indices:
                if direction == "pack":
                    self.pack(items, i)
                else:
                    self.unpack(items, i, scale)
            return
        key = (direction, indices, scale, in_place)
        many = self._many.get(key)
        if many is None:
            copies = [self._copy(items, i, direction, scale) for i in indices]
            captured = tuple(c for c in copies if c.launches_only) + tuple(
                self._scaling(items, where, scale) for where in in_place)
            direct = tuple(c for c in copies if not c.launches_only)

            def issue():
                for copy in captured:
                    copy()
            many = self._many[key] = (issue if captured else None, direct)
        issue, direct = many
        if issue is not None:
            graphs.replay(self._graphs, key, issue)
        for copy in direct:
            copy()

    def _scaling(self, items, where, scale):
        """cupy: a callable multiplying the float32 unit ``where`` (a
        zero-copy bucket's index or ``("direct", position)``) by ``scale``
        where it lies, one launch of the cast kernel (the rounding of a
        transport's ``scale``: float32 times float32), counting into a kept
        counter nobody reads, so that it allocates nothing."""
        flat = self.flat(items, where)
        if self._counter is None:
            with flat.device:
                self._counter = array_module(flat).zeros((), np.int64)
        return functools.partial(_cast.cast, flat, np.float32, scale=scale, out=flat,
                                 nonfinite=self._counter)

    def split(self, strategy, tables):
        """The :class:`Split` of this list's units for ``strategy`` (its
        ``applies_to``), made once per strategy name; the units' states
        live in ``tables`` (see :meth:`workspace`)."""
        split = self.by_strategy.get(strategy.name)
        if split is None:
            split = self.by_strategy[strategy.name] = Split()
            sized = [self.sized(where, buf) for where, _, buf in self.units]
            applies = [strategy.applies_to(dt) for dt, _ in sized]
            split.compressed = [(where, index, buf, self.workspace(strategy, where, tables))
                                for (where, index, buf), yes in zip(self.units, applies) if yes]
            split.rest = [u for u, yes in zip(self.units, applies) if not yes]
            split.together = self.workspace(strategy, "together", tables)
            split.nbytes = sum(n for (_, n), yes in zip(sized, applies) if yes)
            split.labels = [label_of(index, where) for where, index, _, _ in split.compressed]
            split._arrays = self.arrays
        return split

    def workspace(self, strategy, where, tables):
        """The dict a compression strategy keeps for one unit (``where``;
        ``"together"`` for all of them) of this list's layout (its plan's
        key) in ``tables`` (the communicator's, or a ReduceState's): it
        lasts as long as they do, so error-feedback residuals carry over
        between calls with arrays of the same shapes. It is keyed by the
        strategy's settings (its ``name``), not the object: a new object
        with the same settings continues where the last one stopped, on
        every rank alike."""
        if self.workspaces is None:
            self.workspaces = tables.setdefault(self.plan.key, {})
        return self.workspaces.setdefault((strategy.name, where), {})

    def arrays(self, items, i, buf):
        """The arrays of bucket ``i`` of ``items`` (a list slice or tuple; the
        bucket's own buffer alone when they lie back to back in it), or
        ``(buf,)`` for an array reduced in place (``i`` None, ``buf`` its
        flat view): what a transport or compression strategy may reduce
        where it lies."""
        if i is None or self._zero_copy[i]:
            return (buf,)
        return self._pick[i](items)



def _same_items(a, b):
    """Whether lists/tuples ``a`` and ``b`` hold the very same objects in order
    (one C loop when the compiled host loops are available)."""
    ext = native.module()
    if ext is not None:
        return ext.same_items(a, b)
    return len(a) == len(b) and all(map(operator.is_, a, b))


class FusionCache:
    """PreparedLists of recently used lists, recognised by their arrays'
    identity (an :class:`~commlib.core.caches.IdentityCache`).

    An entry is made the second time the same list is seen among the last
    ``max_entries`` lists prepared (a list used once costs nothing extra;
    lists used in turn, two models' gradients say, are each kept) and
    dropped when any of its arrays dies. The entry
    hit last is also remembered with its arrays, so the next call with the
    very same arrays is recognised by one identity scan (in C: 0.4 us for
    1,000 arrays, against 13 us in Python), without building a key. That
    reference is let go at the first call that passes other arrays (or at
    ``clear()``): a loop that makes new gradient arrays every step never has
    more than one extra list kept alive, and only until its next call.
    """

    def __init__(self, max_entries=8):
        self._entries = IdentityCache(max_entries)
        self._seen = collections.OrderedDict()   # keys of the last lists prepared
        self._max_seen = max_entries
        self._recent = None     # (tuple of arrays, PreparedList) of the last hit

    def lookup(self, items):
        """(key, PreparedList or None) for the list ``items``."""
        recent = self._recent
        if recent is not None:
            arrays, prepared = recent
            if _same_items(items, arrays):
                return None, prepared
            self._recent = None
        key = IdentityCache.key(items)
        prepared = self._entries.get(key)
        if prepared is not None:
            self._recent = (tuple(items), prepared)
        return key, prepared

    def prepare(self, key, items, plan, kind, writeable):
        """A PreparedList for ``items``; remembered if ``key`` repeats."""
        prepared = PreparedList(items, plan, kind, writeable)
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > self._max_seen:
                self._seen.popitem(last=False)
            return prepared
        self._entries.put(key, items, prepared)
        return prepared

    def clear(self):
        self._entries.clear()
        self._seen.clear()
        self._recent = None

