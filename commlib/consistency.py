"""Optional check that every rank calls the same collective the same way.

Before each collective, ranks all-gather a fixed-size record: a digest of
(sequence number, collective, op, root, dtypes, shapes) and a short text
description, or the text of a local argument error. If records differ, every
rank raises :class:`ConsistencyError` naming the ranks in each group instead
of hanging in, or returning garbage from, a mismatched collective.
"""
import hashlib

import numpy as np

from .errors import ConsistencyError

RECORD_BYTES = 512
_DIGEST = 16


def describe(name, arrays, params):
    """Short text of one call: ``all_reduce(op=sum) 3 arrays: float32(4,5) ...``."""
    items = ", ".join("%s=%s" % kv for kv in sorted(params.items()))
    shapes = " ".join("%s%s" % (a.dtype, tuple(a.shape)) for a in arrays[:4])
    more = " ..." if len(arrays) > 4 else ""
    return "%s(%s) %d arrays: %s%s" % (name, items, len(arrays), shapes, more)


def record(seq, name, arrays, params, error=None):
    """The fixed-size uint8 record this rank contributes."""
    h = hashlib.blake2b(digest_size=_DIGEST)
    h.update(repr((seq, name, sorted(params.items()))).encode())
    if error is None:
        h.update(repr([(str(a.dtype), tuple(a.shape)) for a in arrays]).encode())
    text = ("ERROR " + str(error)) if error is not None else describe(name, arrays, params)
    text = ("#%d %s" % (seq, text)).encode()[:RECORD_BYTES - _DIGEST - 1]
    digest = h.digest() if error is None else b"\xff" * _DIGEST
    out = np.zeros(RECORD_BYTES, dtype=np.uint8)
    out[:_DIGEST] = np.frombuffer(digest, dtype=np.uint8)
    out[_DIGEST:_DIGEST + len(text)] = np.frombuffer(text, dtype=np.uint8)
    return out


def compare(gathered, rank):
    """Raise ConsistencyError unless all rows of ``gathered`` (size x RECORD_BYTES) match."""
    rows = [bytes(r) for r in gathered]
    if all(r == rows[0] for r in rows) and rows[0][:_DIGEST] != b"\xff" * _DIGEST:
        return
    groups = {}
    for r, row in enumerate(rows):
        groups.setdefault(row, []).append(r)
    lines = []
    for row, ranks in groups.items():
        text = row[_DIGEST:].rstrip(b"\0").decode(errors="replace")
        lines.append("  ranks %s: %s" % (ranks, text))
    raise ConsistencyError("rank %d: ranks disagree on this collective:\n%s"
                           % (rank, "\n".join(lines)))
