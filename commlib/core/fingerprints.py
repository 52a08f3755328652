"""The cross-rank consistency check: fingerprints of calls and settings, and
the error every rank raises when they differ.

A call's fingerprint is two int64 words: a digest of its arrays' layout
(dtypes and shapes, in order) and a digest of the collective and its
parameters (op, root, division, compression and its settings, barrier
timeout). Both are cached, so a repeated call costs two dictionary look-ups
(a repeated gradient list keeps its layout digest with its fusion plan). The
status board (:mod:`commlib.faults.board`) compares them before every collective.
The sequence number is not hashed: ranks compare fingerprints of their
n-th collective with each other.
"""
import hashlib
import operator

from ..errors import ConsistencyError, rank_name, ranks_name

#: codes of the collectives, as published on the status board
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gatherv",
               "reduce_scatter", "barrier", "send", "recv", "send_recv", "scatter", "gather",
               "all_to_all", "all_to_allv", "broadcast_object", "all_gather_object", "split")
#: the calls between pairs of ranks: not numbered (every rank counts the
#: collectives alike), they happen after the collective before them
POINT_TO_POINT = ("send", "recv", "send_recv")
CODES = {name: code for code, name in enumerate(COLLECTIVES)}
#: names of the parameters in each collective's parameter tuple (after its name)
PARAMETERS = {"all_reduce": ("op", "average", "root", "compression", "agree", "state"),
              "reduce": ("op", "average", "root", "compression", "agree", "state"),
              "broadcast": ("root",), "all_gather": (), "all_gatherv": ("dtype",),
              "reduce_scatter": ("op",), "barrier": ("timeout",), "scatter": ("root",),
              "gather": ("root",), "all_to_all": (), "all_to_allv": ("dtype", "counts"),
              "broadcast_object": ("root",), "all_gather_object": (), "split": ()}
_CACHE_LIMIT = 1024
_layouts = {}
_params = {}


def label(code, seq):
    """``all_reduce #12`` for collective ``code`` with sequence number
    ``seq``; ``send after collective #11`` for a call between two ranks
    (:data:`POINT_TO_POINT`), whose ``seq`` is the next collective's."""
    name = COLLECTIVES[code] if 0 <= code < len(COLLECTIVES) else "collective"
    if name in POINT_TO_POINT:
        return "%s after collective #%d" % (name, seq - 1)
    return "%s #%d" % (name, seq)


def _int64(data):
    value = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
    return -2 if value == -1 else value        # -1 marks a rejected call on the board


def _cached(table, key, make):
    found = table.get(key)
    if found is None:
        if len(table) >= _CACHE_LIMIT:
            table.clear()
        found = table[key] = _int64(make(key))
    return found


def layout_digest(arrays):
    """int64 digest of the arrays' dtypes and shapes, in order."""
    key = tuple(zip(map(operator.attrgetter("dtype"), arrays),
                    map(operator.attrgetter("shape"), arrays)))
    return _cached(_layouts, key, lambda k: repr([(dt.str, shape) for dt, shape in k]).encode())


def params_digest(params):
    """int64 digest of a call's parameters: a tuple of plain values."""
    return _cached(_params, params, lambda k: repr(k).encode())


def describe(params, arrays, kind=None):
    """Short text of one call (``params``: the collective's name and its
    parameters, see :data:`PARAMETERS`; ``kind``: the arrays' kind, when it
    is compared), e.g. ``all_reduce(op=sum, average=False) 3 arrays:
    float32(4, 5) ...`` or ``... 3 cupy arrays: ...``."""
    name = params[0]
    shown = ", ".join("%s=%s" % (key, value) for key, value in zip(PARAMETERS[name], params[1:])
                      if value is not None)
    shapes = " ".join("%s%s" % (a.dtype, tuple(a.shape)) for a in arrays[:4])
    more = " ..." if len(arrays) > 4 else ""
    return "%s(%s) %d %sarrays: %s%s" % (name, shown, len(arrays),
                                         "" if kind is None else kind + " ", shapes, more)


def disagreement(rank, seq, code, rows, error_digest, world=None):
    """The ConsistencyError of collective ``seq`` for ``rows`` (per rank: the
    fingerprint and the text it published; a fingerprint equal to
    ``error_digest`` marks a rank that rejected its own arguments), naming
    the ranks by their world ranks too where ``world`` says them (see
    :func:`commlib.errors.rank_name`)."""
    rejected = [r for r, (digest, _) in enumerate(rows) if digest == error_digest]
    where = label(code, seq)
    if rejected:
        lines = ["%s rejected its arguments: %s" % (rank_name(r, world),
                                                    rows[r][1].removeprefix("ERROR "))
                 for r in rejected]
        return ConsistencyError("%s: %s was not run:\n  %s"
                                % (rank_name(rank, world), where, "\n  ".join(lines)), culprits=rejected)
    groups = {}
    for r, (digest, text) in enumerate(rows):
        groups.setdefault(digest, []).append(r)
    ordered = sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))
    lines = ["%s: %s" % (ranks_name(ranks, world), rows[ranks[0]][1]) for ranks in ordered]
    culprits = [r for ranks in ordered[1:] for r in ranks]
    return ConsistencyError("%s: ranks disagree on %s:\n  %s"
                            % (rank_name(rank, world), where, "\n  ".join(lines)), culprits=culprits)


def compare_settings(rank, records):
    """Raise ConsistencyError unless every rank's settings (``records``:
    per rank a dict) are the same; names the ranks and the settings."""
    differ = sorted({key for record in records for key in record
                     if any(other.get(key) != record.get(key) for other in records)})
    if not differ:
        return
    lines = []
    for key in differ:
        values = {}
        for r, record in enumerate(records):
            values.setdefault(repr(record.get(key)), []).append(r)
        lines.append("%s: %s" % (key, ", ".join("ranks %s: %s" % (ranks, value)
                                              for value, ranks in values.items())))
    raise ConsistencyError("rank %d: ranks made their communicators with different "
                           "settings (every rank must use the same):\n  %s"
                           % (rank, "\n  ".join(lines)))
