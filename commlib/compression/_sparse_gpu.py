"""The sparsifiers' work on cupy buckets (see :mod:`._sparse`): the launch
sequences before and after the exchange of a bucket's records, each
replayed as a CUDA graph once it repeats (:mod:`commlib.ops.graphs`), and
the plan of a call's buckets reduced together (:class:`Together`, for
``Sparsifier.reduce_all``)."""
import itertools

import numpy as np

from ..ops import graphs, records
from ..ops.arrays import array_module, zero
from ..ops.cast import cast
from ..ops.sparse import scatter_add
from . import _payload
from ._flat import accumulators, buffer, copy_in, counters, flat_of, identity, scatter, views


def record_parts(record, slots):
    """``(header, indices, values)``: views of a record of ``slots``
    entries (:mod:`._payload`), the values as float32."""
    return (record[:_payload.HEADER], record[_payload.HEADER:_payload.HEADER + slots],
            record[_payload.HEADER + slots:].view(np.float32))


def encode(strategy, arrays, at, residual, flat, acc, slots, workspace):
    """cupy buckets of a :class:`~._sparse.Sparsifier` ``strategy``: the
    arrays copied into ``flat`` (one of them: its view), ``acc = residual
    + flat`` with NaN and +-inf set to 0 and counted into the record's
    header (one kernel, no host synchronisation), then this rank's
    selection from it and its record: ``(record, indices, values)``, where
    a strategy that ``select_into`` the record's own parts saves the
    copies. The
    record of a bucket whose count is fixed is kept between calls.

    The launches up to the selection (all of them with
    ``select_into``) are a fixed sequence per bucket and buffer
    addresses: replayed as a CUDA graph (:mod:`commlib.ops.graphs`)
    keyed by ``at``, the arrays' addresses (:func:`._flat.identity`),
    and which buffer is the residual."""
    xp = array_module(acc)
    if slots is None:
        record = header = buffer(workspace, "header", xp, _payload.HEADER, np.int32)
        indices = values = None
    else:
        record = buffer(workspace, "record", xp, _payload.HEADER + 2 * slots, np.int32)
        header, indices, values = views(workspace, "record parts", record,
                                        lambda r: record_parts(r, slots))

    def issue():
        select_launches(strategy, arrays, flat, residual, acc, header, slots, indices, values,
                        workspace)

    # within the bucket's state only the arrays and which of its two
    # buffers is the residual change (its other buffers are made once)
    key = ("select", at, acc.data.ptr, slots)
    graphs.replay(workspace.setdefault("graphs", {}), key, issue)
    if workspace["selects into"]:
        return record, indices, values
    indices, values = strategy.select(acc)
    return _payload.encode(xp, indices, values, header[1], slots), indices, values


def select_launches(strategy, arrays, flat, residual, acc, header, slots, indices, values,
                    workspace):
    """cupy buckets: the launches of :func:`encode` up to the
    selection: the arrays copied into ``flat``, ``acc = residual +
    flat`` counted into ``header``, and, when the count is fixed
    (``slots``), the selection written into ``indices`` and ``values``
    if the ``strategy`` selects into them (``select_into``); records the answer as
    ``workspace["selects into"]`` and returns it."""
    copy_in(arrays, flat)
    records.accumulate_finite(residual, flat, acc, header, slots or 0)
    workspace["selects into"] = selects = slots is not None and bool(
        strategy.select_into(acc, indices, values))
    return selects


def sum_launches(arrays, flat, indices, values, counts, scale, acc, residual, sent, bad):
    """cupy buckets: the launches of :func:`finish`: ``flat``
    = the sum of the entries times ``scale``, copied into the arrays,
    and what was ``sent`` taken off ``acc`` when there is a
    ``residual``; ``bad``: the kernels' three kept counters (sum,
    residual, scale)."""
    bad_sum, bad_residual, scaled = bad
    zero(flat)
    scatter_add(flat, indices, values, segments=counts, bad=bad_sum)
    if scale is not None:
        cast(flat, np.float32, scale=scale, out=flat, nonfinite=scaled)
    if residual is not None:
        scatter_add(acc, *sent, alpha=-1.0, bad=bad_residual)
    scatter(flat, arrays)


def finish(bucket, at, flat, indices, values, counts, acc, residual, sent, fixed):
    """cupy buckets, once every rank's entries are checked: ``flat`` =
    the sum of every rank's (``indices``, ``values``) pairs (``counts``
    per rank, in rank order: the same bits on every rank) times the
    bucket's scale, copied into the arrays, and what was ``sent`` taken
    off ``acc`` when there is a ``residual``. A bucket whose every rank
    sends a ``fixed`` count, selected into its record (so that what was
    ``sent`` is the record's own parts), sums from buffers kept between
    calls: these launches are replayed as a CUDA graph (:mod:`commlib.ops.graphs`)
    keyed by ``at`` (the arrays' addresses), the residual's buffer, the
    counts and the scale."""
    arrays, workspace, scale = bucket.arrays, bucket.state, bucket.scale
    xp = array_module(flat)
    # 0-d counters the kernels write and nobody reads (the entries were
    # checked): kept, so that the launches allocate nothing
    _, (bad_sum, bad_residual, scaled) = counters(workspace, "sum counters", xp, 3,
                                                  zero=True)

    def issue():
        sum_launches(arrays, flat, indices, values, counts, scale, acc, residual, sent,
                     (bad_sum, bad_residual, scaled))

    if not fixed:       # the entries are new arrays at every call
        issue()
        return
    key = ("sum", at, acc.data.ptr, tuple(counts),
           None if scale is None else float(scale))
    graphs.replay(workspace.setdefault("graphs", {}), key, issue)


class Part:
    """One bucket of a :class:`Together` plan."""
    __slots__ = ("state", "at", "n", "slots", "flat", "record", "header", "indices", "values",
                 "entries", "exchange", "reads", "reads_at", "bad")


class Together:
    """What ``Sparsifier.reduce_all`` keeps for one list of arrays:
    per bucket a :class:`Part` (its arrays' addresses and length, its
    flat buffer when it has several arrays, its record in the shared
    buffer, its entries and reads), the shared record, gathered and read
    buffers, where every header word lies in the reads, and the launch
    sequences' CUDA graphs. It holds none of the arrays (the cache it is
    kept in drops it when one dies); the residuals stay in the buckets'
    states, where ``Sparsifier.reduce`` finds them too."""

    @classmethod
    def make(cls, strategy, buckets):
        """The plan for ``buckets``, or None when a bucket's count varies."""
        sizes = [identity(b.arrays, b.state) for b in buckets]
        slots = [strategy.count_for(n) for _, n in sizes]
        if None in slots:
            return None
        self = cls()
        xp, ranks = array_module(buckets[0].arrays[0]), buckets[0].size
        widths = [_payload.HEADER + 2 * k for k in slots]
        self.width = sum(widths)
        self.records = xp.zeros(self.width, np.int32)
        self.gathered = xp.empty(ranks * self.width, np.int32)
        per = ranks * _payload.HEADER + 2
        self.reads = xp.zeros(len(buckets) * per, np.int64)
        self.parts, self.pairs, self.graphs, self.selects = [], {}, {}, False
        at = 0
        for i, (b, (addresses, n), k, width) in enumerate(zip(buckets, sizes, slots, widths)):
            part = Part()
            part.state, part.at, part.n, part.slots = b.state, addresses, n, k
            part.flat = flat_of(b.arrays, b.state, n) if len(b.arrays) > 1 else None
            part.record = self.records[at:at + width]
            part.header, part.indices, part.values = record_parts(part.record, k)
            # rank r's record of this bucket starts at r * width + at of
            # the gathered buffer: the entries' check reads it from there
            part.entries = (xp.empty(ranks * k, np.int32), xp.empty(ranks * k, np.float32),
                            self.gathered[at:], [(r * self.width + _payload.HEADER,
                                                  r * self.width + _payload.HEADER + k, k)
                                                 for r in range(ranks)])
            part.reads_at = i * per
            part.reads = self.reads[i * per:(i + 1) * per]
            part.exchange = _payload.Exchange(None, part.entries[0], part.entries[1],
                                              part.reads)
            part.bad = counters(b.state, "sum counters", xp, 3, zero=True)[1]
            self.parts.append(part)
            at += width
        # the reads when all is well: per bucket, every rank's header is
        # [slots, 0 non-finite, 0 problem, 0], and both checks count 0
        self.expected = np.zeros((len(buckets), per), np.int64)
        self.expected[:, :ranks * _payload.HEADER:_payload.HEADER] = np.array(slots)[:, None]
        self.expected = self.expected.reshape(-1)
        self.counts = [[k] * ranks for k in slots]
        return self

    def flats(self, buckets):
        """Every bucket's flat vector at this call: its buffer, or its one
        array (1-D as it is, else a flat view)."""
        return [p.flat if p.flat is not None else flat_of(b.arrays, p.state)
                for p, b in zip(self.parts, buckets)]

    def buffers(self, strategy):
        """Every bucket's ``(acc, residual)`` (residual None without error
        feedback; the two swap at every call with it) and a key naming
        them: made in the buckets' states when missing or not fit."""
        pairs = [(p.state.get("acc"), p.state.get("residual")) for p in self.parts]
        key = tuple(map(id, itertools.chain.from_iterable(pairs)))
        if key not in self.pairs:
            xp = array_module(self.records)
            pairs = [accumulators(p.state, xp, p.n, strategy.error_feedback)
                     for p in self.parts]
            key = tuple(map(id, itertools.chain.from_iterable(pairs)))
            if len(self.pairs) >= 4:     # and the graphs keyed by the ids let go
                self.pairs.clear()
                self.graphs.clear()
            # the buffers held here keep their ids unique while the key is used
            self.pairs[key] = pairs
        return self.pairs[key], key

    def select(self, strategy, buckets):
        """Every bucket's selection into its record. Returns the call's
        ``(flats, sent, buffers)``: :meth:`flats`, what each bucket sent
        (the record's parts, or the arrays the strategy's ``select`` made)
        and :meth:`buffers`' answer."""
        flats = self.flats(buckets)
        pairs, key = buffers = self.buffers(strategy)
        made = {}

        def issue():
            for i, (p, b, flat, (acc, residual)) in enumerate(zip(self.parts, buckets, flats,
                                                                  pairs)):
                if not select_launches(strategy, b.arrays, flat, residual, acc, p.header,
                                       p.slots, p.indices, p.values, b.state):
                    indices, values = strategy.select(acc)
                    p.record[...] = _payload.encode(array_module(acc), indices, values,
                                                    p.header[1], p.slots)
                    made[i] = (indices, values)

        if self.selects:
            graphs.replay(self.graphs, ("select", key), issue)
        else:
            issue()
        # replayed, the selections are into the records (select_into's
        # answer is the same at every call); a selection made anew runs the
        # sums directly too, from then on
        self.selects = not made
        return flats, [made.get(i, (p.indices, p.values)) for i, p in enumerate(self.parts)], \
            buffers

    def split(self):
        """Every bucket's entries and header words out of the gathered
        records, checked (:func:`commlib.ops.records.split_records`)."""
        def issue():
            for p in self.parts:
                indices, values, src, layout = p.entries
                records.split_records(src, layout, p.n, indices, values, p.reads,
                                      header_stride=self.width)
        graphs.replay(self.graphs, ("split",), issue)

    def as_expected(self, host):
        """Whether every rank's header of every bucket says a full record,
        nothing non-finite, no problem, and no entry failed its check: the
        reads as :attr:`expected` has them."""
        return bool(np.array_equal(host, self.expected))

    def sum(self, strategy, buckets, call):
        """Every bucket's sum, times the scale, residual update and copy
        into its arrays, then the residuals' swap (``call``:
        :meth:`select`'s answer)."""
        flats, sent, (pairs, key) = call
        scale = buckets[0].scale

        def issue():
            for p, b, flat, (acc, residual), own, counts in zip(
                    self.parts, buckets, flats, pairs, sent, self.counts):
                sum_launches(b.arrays, flat, p.entries[0], p.entries[1], counts, scale, acc,
                             residual, own, p.bad)
        if self.selects:
            graphs.replay(self.graphs, ("sum", key, None if scale is None else float(scale)),
                          issue)
        else:
            issue()
        if strategy.error_feedback:
            for b, (acc, residual) in zip(buckets, pairs):
                b.state["residual"], b.state["acc"] = acc, residual
