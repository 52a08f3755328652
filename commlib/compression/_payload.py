"""The records the sparsifying strategies exchange, and their validation.

Every rank's selection travels as one int32 record: a header of
:data:`HEADER` words ``[entries, nonfinite, problem, detail]``, then its
``entries`` indices and the bit patterns of its float32 values. The header
carries what every rank needs to decide alike: the sender's count of
non-finite values and, when its selection was malformed (not 1-D int32
indices and float32 values of one length), a problem code; its entries are
then not used.

Every rank validates the same gathered bytes before anything is written, so
a bad payload raises :class:`~commlib.errors.PayloadError` on every rank,
naming the senders: an entry count that is negative, exceeds the bucket or
differs from the count every rank must send; an index outside ``[0, n)``
other than the padding ``-1`` with value 0; an index repeated within one
rank's set; a non-finite value.
"""
import numpy as np

from ..errors import PayloadError
from ..ops import graphs, records
from ..ops.arrays import array_module, is_cupy
from ..ops.records import HEADER
from ..ops.selection import MAX_LEN
from ._flat import buffer


# problem codes of a malformed selection: 1 / 3: indices / values not a 1-D
# array of the bucket's kind; 2 / 4: wrong dtype (detail: the dtype's char);
# 5: lengths differ (detail: the number of values)
_ARRAYS = {1: ("indices", np.dtype(np.int32)), 3: ("values", np.dtype(np.float32))}
_LENGTHS = 5


def _problem(xp, indices, values):
    """``(code, detail)`` of what is wrong with a selection, ``(0, 0)`` if nothing."""
    for (code, (_, dtype)), a in zip(_ARRAYS.items(), (indices, values)):
        if not (isinstance(a, np.ndarray) or is_cupy(a)) or array_module(a) is not xp \
                or a.ndim != 1:
            return code, 0
        if a.dtype != dtype:
            return code + 1, ord(a.dtype.char)
    if indices.size != values.size:
        return _LENGTHS, min(values.size, MAX_LEN)
    return 0, 0


def _problem_text(code, detail, entries):
    if code == _LENGTHS:
        return "%d indices but %d values" % (entries, detail)
    what, dtype = _ARRAYS[code - (code % 2 == 0)]
    if code % 2:
        return "%s that are not a 1-D array like the bucket" % what
    try:
        got = np.dtype(chr(detail)).name
    except (TypeError, ValueError):
        got = "code %d" % detail
    return "%s of dtype %s (expected %s)" % (what, got, dtype.name)


def encode(xp, indices, values, nonfinite, slots=None):
    """This rank's record: a 1-D int32 ``xp`` array of ``HEADER + 2 *
    slots`` words (``slots`` defaults to the number of entries); entries
    beyond ``slots`` are cut, missing ones are zeros (the header tells).

    indices, values: the selection (checked here, not trusted).
    nonfinite: this rank's non-finite count (int, or 0-d array on the device).
    """
    problem, detail = _problem(xp, indices, values)
    entries = min(int(getattr(indices, "size", 0)), MAX_LEN)
    slots = entries if slots is None else slots
    record = xp.empty(HEADER + 2 * slots, dtype=np.int32)
    on_device = is_cupy(nonfinite)
    # the header in one copy (and the device's count in one more), not a
    # write per word
    header = np.array([entries, 0 if on_device else nonfinite, problem, detail], np.int32)
    if xp is np:
        record[:HEADER] = header
    else:
        record[:HEADER].set(header)
    if on_device:
        record[1] = nonfinite
    m = 0 if problem else min(entries, slots)
    if m:
        record[HEADER:HEADER + m] = indices[:m]
        record[HEADER + slots:HEADER + slots + m] = values[:m].view(np.int32)
    if m < slots:          # missing entries are zeros
        record[HEADER + m:HEADER + slots] = 0
        record[HEADER + slots + m:] = 0
    return record


def check_headers(headers, n, slots=None):
    """Problems of the gathered headers (host int array, one row per rank),
    as ``{rank: text}``. ``n``: the bucket's length; ``slots``: the number
    of entries every rank must send, or None when counts vary."""
    found = {}
    for r, (entries, nonfinite, problem, detail) in enumerate(np.asarray(headers).tolist()):
        if problem:
            found[r] = "sent %s" % _problem_text(problem, detail, entries)
        elif not 0 <= entries <= n:
            found[r] = "sent an entry count of %d outside [0, %d]" % (entries, n)
        elif slots is not None and entries != slots:
            found[r] = "sent %d entries where every rank sends %d" % (entries, slots)
        elif not 0 <= nonfinite <= n:
            found[r] = "sent a non-finite count of %d outside [0, %d]" % (nonfinite, n)
    return found


def check_entries(indices, values, counts, n, summary=None):
    """Problems of the gathered entries as ``{rank: text}``: the ranks' sets
    back to back (``indices`` int32, ``values`` float32, numpy or cupy),
    ``counts`` entries each (host ints), for a bucket of ``n`` values.

    Index range, padding and finite values are checked on the arrays'
    device, and so are duplicates while each set ascends up to its trailing
    padding (as top-K and threshold select; other orders are sorted): one
    host read (none when ``summary``, the host ints of
    :func:`entry_summary`, was read already), two after a sort. Problems are
    described from a host copy.
    """
    xp = array_module(indices)
    if not indices.size:
        return {}
    if summary is None:
        summary = entry_summary(indices, values, counts, n)
        summary = summary if xp is np else summary.get()
    n_bad, n_unordered = (int(v) for v in summary)
    if not n_bad and n_unordered:
        # one key per entry, by rank then index; padding maps to n
        pad = (indices == -1) & (values == 0)
        rank_of = xp.repeat(xp.arange(len(counts), dtype=np.int64), [int(c) for c in counts])
        keys = xp.sort(rank_of * (n + 1) + xp.where(pad, n, indices.astype(np.int64)))
        n_bad = int(xp.count_nonzero((keys[1:] == keys[:-1]) & (keys[1:] % (n + 1) != n)))
    if not n_bad:
        return {}
    if xp is not np:
        indices, values = indices.get(), values.get()
    return _describe_entries(indices, values, counts, n)


def entry_summary(indices, values, counts, n):
    """``[bad, unordered]`` (int64, on the arrays' device, not read): how
    many entries are bad (an index outside ``[0, n)`` other than the padding
    ``-1`` with value 0, or a non-finite value) and how many follow an entry
    of their rank's set out of ascending order (see :func:`check_entries`),
    counted by :func:`commlib.ops.records.split_records`. ``counts``: each
    rank's number of entries (host ints)."""
    xp = array_module(indices)
    m = indices.size
    starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))[:-1].tolist()
    summary = xp.empty(2, dtype=np.int64)
    records.split_records(xp.concatenate((indices, values.view(np.int32))),
                          [(s, m + s, c) for s, c in zip(starts, counts)], n,
                          xp.empty(m, dtype=np.int32), xp.empty(m, dtype=np.float32), summary)
    return summary


def _describe_entries(indices, values, counts, n):
    """:func:`check_entries`'s problems from numpy arrays, rank by rank."""
    found = {}
    start = 0
    for r, c in enumerate(counts):
        idx, val = indices[start:start + c].astype(np.int64), values[start:start + c]
        start += c
        pad = (idx == -1) & (val == 0)
        out = ((idx < 0) | (idx >= n)) & ~pad
        texts = []
        if out.any():
            at = np.flatnonzero(out)
            j = at[0]
            texts.append("padding index -1 with value %r" % float(val[j]) if idx[j] == -1
                         else "index %d outside [0, %d)" % (idx[j], n))
            if at.size > 1:
                texts[-1] += " (and %d more bad indices)" % (at.size - 1)
        nonfinite = np.flatnonzero(~np.isfinite(val))
        if nonfinite.size:
            texts.append("the non-finite value %r at index %d"
                         % (float(val[nonfinite[0]]), idx[nonfinite[0]]))
        seen, times = np.unique(idx[~pad & ~out], return_counts=True)
        if (times > 1).any():
            texts.append("index %d %d times" % (seen[times > 1][0], times[times > 1][0]))
        if texts:
            found[r] = "sent " + ", ".join(texts)
    return found


def fail(context, found, tail):
    """PayloadError for the problems ``found`` (``{rank: text}``):
    ``"<context>: rank 1 sent ...; rank 3 sent ... <tail>"``, blaming those
    ranks."""
    text = "; ".join("rank %d %s" % item for item in sorted(found.items()))
    return PayloadError("%s: %s %s" % (context, text, tail), culprits=sorted(found))


class Exchange:
    """What :func:`send` queued: ``gathered`` (every rank's record, or
    header when counts vary; back to back, 1-D), the entries' ``indices``
    and ``values`` (every rank's, back to back; None when counts vary) and
    ``reads``, the one integer array :func:`receive` needs on the host:
    the headers and the entries' summary (:func:`entry_summary`) together,
    as int64, or the headers alone when counts vary."""

    __slots__ = ("gathered", "indices", "values", "reads")

    def __init__(self, gathered, indices, values, reads):
        self.gathered, self.indices, self.values, self.reads = gathered, indices, values, reads


def send(bucket, record, slots, n):
    """The first half of the exchange of every rank's :func:`encode` record
    over ``bucket`` (a :class:`~commlib.compression.base.Bucket`), which
    reads nothing back from a GPU: all-gathers the whole records (``slots``,
    the number of entries in every record, not None: one all-gather) and
    splits them into the entries and the headers with the entries' check
    (``n``: the bucket's length; one launch of
    :func:`commlib.ops.records.split_records`, into buffers kept in the
    bucket's state), or all-gathers only their headers (``slots`` None:
    counts vary). Returns the :class:`Exchange` that :func:`receive` takes."""
    xp = array_module(record)
    ranks, state = bucket.size, bucket.state
    width = HEADER if slots is None else HEADER + 2 * slots
    gathered = buffer(state, "gathered", xp, ranks * width, np.int32)
    bucket.all_gather(record if slots is not None else record[:HEADER], gathered)
    if slots is None:
        return Exchange(gathered, None, None, gathered)
    indices = buffer(state, "entries", xp, ranks * slots, np.int32)
    values = buffer(state, "entry values", xp, ranks * slots, np.float32)
    # every rank must send ``slots`` entries (the headers tell, checked by
    # receive): the entries' check is queued before the headers are read,
    # and both come to the host in one read
    reads = buffer(state, "reads", xp, ranks * HEADER + 2, np.int64)

    def split():
        records.split_records(gathered, [(r * width + HEADER, r * width + HEADER + slots, slots)
                                         for r in range(ranks)], n, indices, values, reads,
                              header_stride=width)
    if xp is np:
        split()
    else:       # one launch, the same at every call: a graph saves its checks
        graphs.replay(state.setdefault("graphs", {}), ("split", gathered.data.ptr, width, n),
                      split)
    return Exchange(gathered, indices, values, reads)


def receive(bucket, record, exchange, host, slots, n, context, tail, on_headers):
    """The second half of the exchange (``exchange`` from :func:`send` with
    these ``record``, ``slots`` and ``n``; ``host``: the host copy of its
    ``reads``): checks the headers, then, when counts vary, all-gathers-v
    the entries by count, and checks the entries.

    ``on_headers(nonfinite)`` runs with every rank's non-finite count (host
    ints) once the headers are valid, before any entries are checked; it
    may raise.

    Returns ``(indices, values, counts)``: every rank's entries back to back
    in rank order (int32 / float32 arrays of the record's kind) and each
    rank's number of entries. Raises PayloadError (``context``: who and
    where; ``tail``: what was left alone) on every rank when any record is
    malformed.
    """
    xp = array_module(record)
    summary = None
    host = np.asarray(host)
    if slots is not None:
        headers = host[:bucket.size * HEADER].reshape(bucket.size, HEADER)
        summary = host[bucket.size * HEADER:]
        indices, values = exchange.indices, exchange.values
    else:
        headers = host.reshape(bucket.size, HEADER)
    found = check_headers(headers, n, slots)
    if found:
        raise fail(context, found, tail)
    on_headers([int(c) for c in headers[:, 1]])
    counts = [int(c) for c in headers[:, 0]]
    if slots is None:
        both = xp.empty(2 * sum(counts), dtype=np.int32)
        if both.size:
            bucket.all_gatherv(record[HEADER:], both, [2 * c for c in counts])
        starts = np.concatenate(([0], np.cumsum([2 * c for c in counts]))).tolist()
        indices = xp.empty(sum(counts), dtype=np.int32)
        values = xp.empty(sum(counts), dtype=np.float32)
        summary = xp.empty(2, dtype=np.int64)
        records.split_records(both, [(s, s + c, c) for s, c in zip(starts, counts)], n,
                              indices, values, summary)
        summary = summary if xp is np else summary.get()
    found = check_entries(indices, values, counts, n, summary)
    if found:
        raise fail(context, found, tail)
    return indices, values, counts
