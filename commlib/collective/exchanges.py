"""Rooted and all-to-all collectives, objects and splitting: the steps
behind :meth:`Communicator.scatter <commlib.Communicator.scatter>`,
``gather``, ``all_to_all``, ``all_to_allv``, ``broadcast_object``,
``all_gather_object`` and ``split``.

Each takes the steps of every collective (:mod:`commlib.collective.collectives`):
its arguments are checked and compared with every rank's call
(:meth:`Session.begin <commlib.collective.session.Session.begin>`) before
any data moves, then the data moves inside the data phase. Scatter,
gather and both all-to-alls move their blocks through one call of the
transport, :meth:`~commlib.transport.base.Transport.all_to_allv` (a
scatter is an all-to-all whose root alone sends, a gather one whose root
alone receives), into buffers of commlib's own: the caller's arrays are
written only once the exchange completed.
"""
import pickle

import numpy as np

from .. import interop
from ..core import dtypes
from ..errors import ArgumentError, ConsistencyError
from ..ops.arrays import array_module
from ..transport.base import Transport, offsets
from . import p2p, validation
from .collectives import one_array


def _counts(session, at, n):
    """Counts of one block of ``n`` elements for rank ``at`` alone."""
    return [n if r == at else 0 for r in range(session.size)]


def _empty(kind, session, n, dtype):
    if kind == "cupy":
        import cupy
        with cupy.cuda.Device(session.device):
            return cupy.empty(n, dtype)
    return np.empty(n, dtype)


def scatter(session, given, root):
    """See :meth:`commlib.Communicator.scatter`."""
    rank = session.rank
    mine = rank == root

    def checks():
        validation.check_root(root, session.size, rank)
        if not mine:
            return None, (), None, None, None
        if not isinstance(given, (list, tuple)) or len(given) != session.size:
            raise ArgumentError("rank %d: scatter: the root's arrays must be a list of %d "
                                "arrays (one per rank), got %s" % (
                                    rank, session.size, "a list of %d" % len(given)
                                    if isinstance(given, (list, tuple))
                                    else type(given).__name__))
        items = validation.as_list(given, "arrays", rank)[0]
        kind = validation.check_arrays(items, rank=rank, device=session.device,
                                       writeable=False)
        first = items[0]
        for i, a in enumerate(items):
            if a.shape != first.shape or a.dtype != first.dtype:
                raise ArgumentError("rank %d: scatter: arrays[%d] is %s%s but arrays[0] is "
                                    "%s%s; every rank's block has one dtype and shape"
                                    % (rank, i, a.dtype, a.shape, first.dtype, first.shape))
            if a.ndim > p2p.MAX_DIMS:
                raise ArgumentError("rank %d: scatter: arrays[%d] has more than %d dimensions"
                                    % (rank, i, p2p.MAX_DIMS))
        return kind, (), None, items, p2p.header(first, kind, None)

    wait, (_, _, _, items, head) = session.begin("scatter", ("scatter", root), checks)
    with session.data_phase():
        # the root tells the others the blocks' kind, dtype and shape
        if not mine:
            head = np.empty(p2p.HEADER_WORDS, np.int64)
        session.transport("numpy").broadcast(head, root, wait, owned=True)
        kind, dtype, shape = _block(head)
        n = int(np.prod(shape, dtype=np.int64))
        send = _empty(kind, session, n * session.size if mine else 0, dtype)
        if mine and n:
            for r, a in enumerate(items):
                send[r * n:(r + 1) * n] = a.reshape(-1)
            session.stats.bytes_sent += send.nbytes
        out = _empty(kind, session, n, dtype)
        session.transport(kind).all_to_allv(send, [n if mine else 0] * session.size, out,
                                            _counts(session, root, n), wait)
    out = out.reshape(shape)
    return interop.like(given[0], out) if mine else out


def _block(head):
    """(kind, dtype, shape) of a header (see :mod:`commlib.collective.p2p`)."""
    kind = p2p.ARRAY_KINDS[int(head[1])]
    name = dtypes.SUPPORTED[int(head[2])]
    if name == "bfloat16":
        import ml_dtypes        # a bfloat16 numpy array was given: it is installed
        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(name)
    return kind, dtype, tuple(int(s) for s in head[4:4 + int(head[3])])


def gather(session, given, root):
    """See :meth:`commlib.Communicator.gather`."""
    rank = session.rank
    mine = rank == root

    def checks():
        validation.check_root(root, session.size, rank)
        kind, items = one_array(session, "gather", given)
        return kind, items, None

    wait, (kind, (array,), _) = session.begin("gather", ("gather", root), checks)
    xp = array_module(array)
    n = array.size
    out = xp.empty((session.size if mine else 0,) + tuple(array.shape), array.dtype)
    send = xp.ascontiguousarray(array).reshape(-1)
    session.stats.bytes_sent += send.nbytes
    with session.data_phase():
        session.transport(kind).all_to_allv(send, _counts(session, root, n), out.reshape(-1),
                                            [n if mine else 0] * session.size, wait)
    return interop.like(given, out) if mine else None


def all_to_all(session, send, recv):
    """See :meth:`commlib.Communicator.all_to_all`."""
    rank, size = session.rank, session.size

    def checks():
        kind, (s,) = one_array(session, "all_to_all", send)
        if isinstance(recv, (list, tuple)):
            raise ArgumentError("rank %d: all_to_all takes one recv array, got a %s"
                                % (rank, type(recv).__name__))
        items = validation.as_list(recv, "recv", rank, writeable=True)[0]
        other = validation.check_arrays(items, rank=rank, device=session.device,
                                        writeable=True, what="recv")
        r = items[0]
        if other != kind:
            raise ArgumentError("rank %d: all_to_all: send is a %s array, recv a %s array"
                                % (rank, kind, other))
        if s.size % size:
            raise ArgumentError("rank %d: all_to_all needs send.size divisible by size=%d; "
                                "got send.size=%d (shape %s)" % (rank, size, s.size,
                                                                 tuple(s.shape)))
        if r.size != s.size or r.dtype != s.dtype:
            raise ArgumentError("rank %d: all_to_all: recv (%s%s) must have send's dtype and "
                                "size (%s%s)" % (rank, r.dtype, tuple(r.shape), s.dtype,
                                                 tuple(s.shape)))
        return kind, [s, r], None

    wait, (kind, (s, r), _) = session.begin("all_to_all", ("all_to_all",), checks)
    xp = array_module(s)
    n = s.size // size
    out = xp.empty(s.size, s.dtype)
    flat = xp.ascontiguousarray(s).reshape(-1)
    session.stats.bytes_sent += flat.nbytes
    with session.data_phase():
        session.transport(kind).all_to_allv(flat, [n] * size, out, [n] * size, wait)
    r[...] = out.reshape(r.shape)
    return recv


def _count_list(counts, what, rank, size, total=None):
    """``counts`` as a list of ``size`` non-negative ints (summing to
    ``total`` when given)."""
    try:
        values = [int(c) for c in counts]
        ok = len(values) == size and all(
            float(c) == v and v >= 0 for c, v in zip(counts, values))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ArgumentError("rank %d: all_to_allv: %s must be %d non-negative ints (one per "
                            "rank), got %r" % (rank, what, size, counts))
    if total is not None and sum(values) != total:
        raise ArgumentError("rank %d: all_to_allv: %s sum to %d but the array has %d elements"
                            % (rank, what, sum(values), total))
    return values


def all_to_allv(session, given, send_counts, recv_counts):
    """See :meth:`commlib.Communicator.all_to_allv`."""
    rank, size = session.rank, session.size

    def checks():
        kind, items = one_array(session, "all_to_allv", given)
        if items[0].ndim != 1:
            raise ArgumentError("rank %d: all_to_allv takes a 1-D array, got shape %s"
                                % (rank, tuple(items[0].shape)))
        sends = _count_list(send_counts, "send_counts", rank, size, items[0].size)
        recvs = None if recv_counts is None else _count_list(recv_counts, "recv_counts",
                                                             rank, size)
        return kind, (), None, items[0], sends, recvs

    wait, (kind, _, _, array, sends, recvs) = session.begin(
        "all_to_allv", ("all_to_allv", str(interop.dtype_name(given)), recv_counts is None),
        checks)
    xp = array_module(array)
    wrong, given_sends, sends = [], sends, list(sends)
    with session.data_phase():
        if recvs is None or session.check:
            # per pair: what this rank sends it and what it expects from it
            mine = np.array([sends, recvs or [0] * size], np.int64).T.copy().reshape(-1)
            heard = np.empty(2 * size, np.int64)
            session.transport("numpy").all_to_allv(mine, [2] * size, heard, [2] * size, wait)
            theirs_send, theirs_recv = heard[0::2].tolist(), heard[1::2].tolist()
            if recvs is None:
                recvs = theirs_send
            else:       # both ranks of a pair see both counts: both skip it alike
                for r in range(size):
                    if recvs[r] != theirs_send[r]:
                        wrong.append("rank %d sends %d elements to rank %d, which expects %d"
                                     % (r, theirs_send[r], rank, recvs[r]))
                        recvs[r] = 0
                    if sends[r] != theirs_recv[r]:
                        wrong.append("rank %d sends %d elements to rank %d, which expects %d"
                                     % (rank, sends[r], r, theirs_recv[r]))
                        sends[r] = 0
        out = xp.empty(sum(recvs), array.dtype)
        flat = _kept(xp.ascontiguousarray(array), given_sends, sends)
        session.stats.bytes_sent += flat.nbytes
        session.transport(kind).all_to_allv(flat, sends, out, recvs, wait)
    if wrong:
        raise ConsistencyError("rank %d: all_to_allv: the counts of %d pair(s) disagree; "
                               "they moved nothing:\n  %s" % (rank, len(wrong), "\n  ".join(wrong)))
    return interop.like(given, out), np.array(recvs, dtype=np.int64)


def _kept(flat, given, sends):
    """``flat`` without the blocks whose count a disagreement zeroed
    (``given``: the counts as passed, ``sends``: as kept)."""
    if given == sends:
        return flat
    at = offsets(given)
    return array_module(flat).concatenate(
        [flat[at[r]:at[r] + sends[r]] for r in range(len(sends))])


# -- objects ------------------------------------------------------------------------------
def _pickled(obj, rank, name):
    try:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    except Exception as exc:     # what pickling raises varies with the object
        raise ArgumentError("rank %d: %s: the object could not be pickled: %s: %s"
                            % (rank, name, type(exc).__name__, exc)) from exc


def _unpickled(data, rank, source, name):
    try:
        return pickle.loads(data.tobytes())
    except Exception as exc:
        raise ArgumentError("rank %d: %s: rank %d's object could not be unpickled here: %s: %s"
                            % (rank, name, source, type(exc).__name__, exc)) from exc


def broadcast_object(session, obj, root):
    """See :meth:`commlib.Communicator.broadcast_object`."""
    rank = session.rank

    def checks():
        validation.check_root(root, session.size, rank)
        return None, (), None, _pickled(obj, rank, "broadcast_object") if rank == root \
            else None

    wait, (_, _, _, data) = session.begin("broadcast_object", ("broadcast_object", root),
                                          checks)
    if session.size == 1:
        return obj
    transport = session.transport("numpy")
    with session.data_phase():
        length = np.array([0 if data is None else data.size], np.int64)
        transport.broadcast(length, root, wait, owned=True)
        buf = data.copy() if rank == root else np.empty(int(length[0]), np.uint8)
        session.stats.bytes_sent += buf.nbytes if rank == root else 0
        transport.broadcast(buf, root, wait, owned=True)
    return obj if rank == root else _unpickled(buf, rank, root, "broadcast_object")


def all_gather_object(session, obj):
    """See :meth:`commlib.Communicator.all_gather_object`."""
    rank = session.rank

    def checks():
        return None, (), None, _pickled(obj, rank, "all_gather_object")

    wait, (_, _, _, data) = session.begin("all_gather_object", ("all_gather_object",), checks)
    if session.size == 1:
        return [_unpickled(data, rank, rank, "all_gather_object")]
    transport = session.transport("numpy")
    counts = np.empty(session.size, np.int64)
    with session.data_phase():
        transport.all_gather(np.array([data.size], np.int64), counts, wait)
        out = np.empty(int(counts.sum()), np.uint8)
        session.stats.bytes_sent += data.nbytes
        transport.all_gatherv(data, out, counts, wait)
    starts = np.concatenate(([0], np.cumsum(counts))).tolist()
    return [_unpickled(out[starts[r]:starts[r + 1]], rank, r, "all_gather_object")
            for r in range(session.size)]


# -- split --------------------------------------------------------------------------------
def _int_or_none(value, what, rank, minimum=None):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
            minimum is not None and value < minimum):
        raise ArgumentError("rank %d: split: %s must be %s or None, got %r"
                            % (rank, what, "an int >= %d" % minimum if minimum is not None
                               else "an int", value))
    return int(value)


def split(session, color, key):
    """See :meth:`commlib.Communicator.split`. Returns ``(table, made)``:
    every rank's ``(color, key)`` and what the transport made for this
    rank's colour (see :meth:`Transport.split
    <commlib.transport.base.Transport.split>`), or None for no colour."""
    rank = session.rank
    transport = session.routes["numpy"]

    def checks():
        c = _int_or_none(color, "color", rank, minimum=0)
        k = _int_or_none(key, "key", rank)
        if session.size > 1 and type(transport).split is Transport.split:
            raise ArgumentError("rank %d: split: the %s transport of this communicator cannot "
                                "split it" % (rank, transport.name))
        return None, (), None, c, rank if k is None else k

    wait, (_, _, _, c, k) = session.begin("split", ("split",), checks)
    if session.size == 1:
        return [(c, k)], None if c is None else "single"
    mine = np.array([c is not None, c or 0, k], np.int64)
    rows = np.empty(3 * session.size, np.int64)
    with session.data_phase():
        session.transport("numpy").all_gather(mine, rows, wait)
        table = [(int(row[1]) if row[0] else None, int(row[2]))
                 for row in rows.reshape(session.size, 3)]
        made = transport.split(c, k, table, wait)
    return table, made
