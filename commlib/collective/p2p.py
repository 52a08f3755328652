"""Point-to-point calls: :meth:`Communicator.send <commlib.Communicator.send>`,
:meth:`~commlib.Communicator.recv` and
:meth:`~commlib.Communicator.batch_send_recv`, one code path.

A call between two ranks takes the steps of a collective, with the pair
in place of the whole communicator:

1. **check**: the ops' arguments (a bad peer, or ops that are no
   :class:`P2POp`, raise at once on this rank: there is no peer to tell).
2. **agree, pair by pair** (the consistency check, on by default): each
   rank sends each peer a header per message, 512 bytes: the array's kind,
   dtype and shape, or that this rank rejected its arguments and why, and
   receives the peer's header of the same message (a send's header meets
   the peer's receive's, the n-th between two ranks with the n-th). Both
   ranks of a pair compare the same two headers, so both decide alike: a
   pair that disagrees moves nothing and both raise ConsistencyError naming
   both ranks and both arrays; a rank that rejected its arguments raises
   its own error, its peers ConsistencyError naming it. Each pair decides
   alone (no rank waits on a pair it is not part of): the other pairs of a
   batch complete before the error is raised. No data moves before the
   headers agreed, so a send waits for its receive: blocking sends in a
   cycle end at the deadline (CollectiveTimeoutError naming the peer each
   rank waited for), never in a hang. Without the check no header goes and
   a send may complete before its receive is posted (MPI's standard mode).
3. **move the data**, inside the data phase (a failure leaves the
   communicator unusable): every message of the batch issued together over
   the transport of the arrays' kind (:meth:`Transport.send_recv
   <commlib.transport.base.Transport.send_recv>`) under one bounded wait;
   each receive lands in a buffer of commlib's own and is copied into the
   caller's array only once every message completed.

Point-to-point calls are not numbered: every rank counts the collectives
alike, and a pair's calls happen between two of them. Their wait
(:class:`PairWait`) watches only the peers: a peer that left or died ends
it with PeerError, the deadline with CollectiveTimeoutError naming the
peers not heard from.
"""
import numpy as np

from ..core import dtypes
from ..core.fingerprints import label
from ..core.waiting import Wait
from ..faults.board import GAVE_UP, GONE, REASON, STRIDE
from ..errors import (ArgumentError, ArrayTypeError, CollectiveTimeoutError, CommlibError,
                      ConsistencyError)
from ..ops.arrays import array_module
from ..transport.base import TAG_DATA, TAG_RECV_HEADER, TAG_SEND_HEADER
from . import validation

KINDS = ("send", "recv")
#: a header: int64 words (status, kind, dtype, ndim, shape...), then text
HEADER_WORDS, MAX_DIMS = 64, 32
_TEXT_AT = (4 + MAX_DIMS) * 8
OK, REJECTED = 1, 2
ARRAY_KINDS = ("numpy", "cupy")


class P2POp:
    """One message of :meth:`Communicator.batch_send_recv
    <commlib.Communicator.batch_send_recv>`: ``P2POp("send", array, peer)``
    sends ``array`` to rank ``peer``, ``P2POp("recv", array, peer)``
    receives into ``array`` from rank ``peer`` (torch's ``P2POp(dist.isend,
    tensor, peer)``)."""

    __slots__ = ("kind", "array", "peer")

    def __init__(self, kind, array, peer):
        self.kind, self.array, self.peer = kind, array, peer

    def __repr__(self):
        return "P2POp(%r, %s, %r)" % (self.kind, type(self.array).__name__, self.peer)


class PairWait(Wait):
    """The :class:`~commlib.core.waiting.Wait` of a point-to-point call: it
    watches only ``peers`` (a rank that closed after its last collective
    while this pair still exchanges is no reason to stop), and its timeout
    names the peers not heard from."""

    __slots__ = ("peers", "call")

    def __init__(self, deadline, seq, what, board, rank, peers, call):
        super().__init__(deadline, seq, what, board, rank)
        self.peers, self.call = tuple(peers), call

    def check(self, late=None):
        watched = self.peers if late is None else late
        words = getattr(self.board, "words", None)
        if words is not None:
            # a peer that closed or exited after the last collective may
            # have done its part first (its messages still arrive): only
            # the deadline ends a wait for it, naming it
            watched = [r for r in watched if not words[r * STRIDE + GONE]
                       or words[r * STRIDE + REASON] == GAVE_UP]
        super().check(watched)

    def timeout(self, late=None):
        late = list(late or self.peers)
        board = self.board
        state = getattr(board, "state_of", None)
        name = getattr(board, "name", lambda r: "rank %d" % r)
        who = "; ".join("%s (%s)" % (name(r), state(r)) if state else name(r) for r in late)
        text = "%s (%s) did not complete before its deadline: waiting for %s" % (
            label(self.what, self.seq), self.call, who)
        if board is not None:
            return board.give_up(self.seq, self.what, CollectiveTimeoutError, text, late)
        return CollectiveTimeoutError("rank %d: %s" % (self.rank, text), culprits=late)


def _structure(rank, size, name, ops):
    """``[(kind, array, peer)]`` of ``ops``; raises ArgumentError on this
    rank for what no header can carry (no P2POp, unknown kind, bad peer)."""
    if not isinstance(ops, (list, tuple)):
        raise ArgumentError("rank %d: %s takes a list of commlib.P2POp, got %s"
                            % (rank, name, type(ops).__name__))
    found = []
    for i, op in enumerate(ops):
        if not isinstance(op, P2POp):
            raise ArgumentError("rank %d: %s: ops[%d] is a %s, expected a commlib.P2POp"
                                % (rank, name, i, type(op).__name__))
        if op.kind not in KINDS:
            raise ArgumentError("rank %d: %s: ops[%d].kind must be 'send' or 'recv', got %r"
                                % (rank, name, i, op.kind))
        peer = op.peer
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) \
                or not 0 <= peer < size:
            raise ArgumentError("rank %d: %s: the peer of ops[%d] (%s) must be a rank, an int "
                                "with 0 <= peer < %d, got %r"
                                % (rank, name, i, op.kind, size, peer))
        found.append((op.kind, op.array, int(peer)))
    return found


def _where(name, i, kind, peer):
    """How an argument error names an op: ``send(array) to rank 1`` or
    ``batch_send_recv: ops[2] (recv from rank 0)``."""
    towards = "to" if kind == "send" else "from"
    if name == "send_recv":
        return validation.Whole("batch_send_recv: ops[%d] (%s %s rank %d)"
                                % (i, kind, towards, peer))
    return validation.Whole("%s(array) %s rank %d" % (kind, towards, peer))


def _arrays(session, name, ops):
    """The ops' arrays as numpy or cupy arrays, checked (receives writeable,
    of memory of their own), and their kind."""
    natives, kind = [], None
    for i, (op_kind, array, peer) in enumerate(ops):
        what = _where(name, i, op_kind, peer)
        recv = op_kind == "recv"
        if isinstance(array, (list, tuple)):
            raise ArgumentError("rank %d: %s takes one array, got a %s"
                                % (session.rank, what, type(array).__name__))
        item = validation.as_list(array, what, session.rank, writeable=recv)[0]
        mine = validation.check_arrays(item, rank=session.rank, device=session.device,
                                       writeable=recv, what=what)
        if kind is not None and mine != kind:
            raise ArrayTypeError("rank %d: %s is a %s array but the batch's first is a %s "
                                 "array; one batch takes arrays of one kind"
                                 % (session.rank, what, mine, kind))
        kind = mine
        natives.append(item[0])
        if item[0].ndim > MAX_DIMS:
            raise ArgumentError("rank %d: %s has %d dimensions; point-to-point calls take at "
                                "most %d" % (session.rank, what, item[0].ndim, MAX_DIMS))
    recvs = [i for i, op in enumerate(ops) if op[0] == "recv"]
    if len(recvs) > 1:
        shared = validation.first_overlap([natives[i] for i in recvs])
        if shared is not None:
            i, j = recvs[shared[0]], recvs[shared[1]]
            raise ArgumentError("rank %d: batch_send_recv: ops[%d] and ops[%d] receive into "
                                "the same memory; every receive needs memory of its own"
                                % (session.rank, j, i))
    return natives, kind


def header(array, kind, error):
    """This rank's header of one message (see the module docstring)."""
    words = np.zeros(HEADER_WORDS, np.int64)
    if error is not None:
        words[0] = REJECTED
        text = str(error).encode("utf-8", "replace")[:HEADER_WORDS * 8 - _TEXT_AT - 1]
        words.view(np.uint8)[_TEXT_AT:_TEXT_AT + len(text)] = np.frombuffer(text, np.uint8)
        return words
    words[:4] = OK, ARRAY_KINDS.index(kind), dtypes.SUPPORTED.index(array.dtype.name), \
        array.ndim
    words[4:4 + array.ndim] = array.shape
    return words


def describe(words):
    """``float32(3, 4)``, ``cupy float32(3, 4)``, or the rejection's text."""
    if words[0] == REJECTED:
        raw = bytes(words.view(np.uint8)[_TEXT_AT:]).split(b"\0", 1)[0]
        return "rejected its arguments: %s" % raw.decode("utf-8", "replace")
    kind = "" if words[1] == 0 else ARRAY_KINDS[int(words[1])] + " "
    shape = tuple(int(n) for n in words[4:4 + int(words[3])])
    return "%s%s%s" % (kind, dtypes.SUPPORTED[int(words[2])], shape)


def send_recv(session, name, given, result=None):
    """The point-to-point call ``name`` (``"send"``, ``"recv"`` or
    ``"send_recv"``, a batch) of ``given``, a list of P2POp (see the
    module docstring). Returns ``result``."""
    rank = session.rank
    ops = _structure(rank, session.size, name, given)
    peers = sorted({peer for _, _, peer in ops})
    call = "; ".join("%s %s %s" % (kind, "to" if kind == "send" else "from", session.name(peer))
                     for kind, _, peer in ops[:4]) + ("; ..." if len(ops) > 4 else "")
    wait = session.begin_pair(name, peers, call)
    error = natives = kind = None
    try:
        natives, kind = _arrays(session, name, ops)
    except CommlibError as exc:
        error = exc
    if not session.check:
        if error is not None:
            raise error
        agreed, disagreements = [True] * len(ops), []
    else:
        agreed, disagreements = _agree(session, ops, natives, kind, error, wait)
        if error is not None:
            raise error
    _move(session, ops, natives, kind, agreed, wait)
    if disagreements:
        culprits = sorted({r for pair in disagreements for r in pair[0]})
        raise ConsistencyError("%s: %s was not run for %d of its %d message(s):\n  %s"
                               % (session.name(rank), label(wait.what, wait.seq), len(disagreements),
                                  len(ops), "\n  ".join(text for _, text in disagreements)),
                               culprits=culprits)
    return result


def _agree(session, ops, natives, kind, error, wait):
    """Exchange the headers of ``ops`` with their peers; returns (per op
    whether its pair agreed, ``[(ranks, text)]`` of the pairs that did not)."""
    rank = session.rank
    mine = [header(None if error else natives[i], kind, error) for i in range(len(ops))]
    theirs = [np.empty(HEADER_WORDS, np.int64) for _ in ops]
    messages = []
    for (op_kind, _, peer), out, got in zip(ops, mine, theirs):
        sent, heard = ((TAG_SEND_HEADER, TAG_RECV_HEADER) if op_kind == "send"
                       else (TAG_RECV_HEADER, TAG_SEND_HEADER))
        messages += [("send", out, peer, sent), ("recv", got, peer, heard)]
    with session.data_phase():
        session.transport("numpy").send_recv(messages, wait)
    agreed, disagreements = [], []
    for (op_kind, _, peer), out, got in zip(ops, mine, theirs):
        same = out[0] == OK and got[0] == OK and np.array_equal(out, got)
        agreed.append(same)
        if same or out[0] == REJECTED:
            continue            # this rank raises its own error
        sender, receiver = (rank, peer) if op_kind == "send" else (peer, rank)
        by = {rank: describe(out), peer: describe(got)}
        name = session.name
        text = "%s sends %s to %s, which receives %s" % (
            name(sender), by[sender], name(receiver), by[receiver])
        if got[0] == REJECTED:
            text = "%s %s (its %s %s %s)" % (
                name(peer), by[peer], "recv" if op_kind == "send" else "send",
                "from" if op_kind == "send" else "to", name(rank))
        disagreements.append(((peer,) if got[0] == REJECTED else (sender, receiver), text))
    return agreed, disagreements


def _move(session, ops, natives, kind, agreed, wait):
    """Every agreed message of ``ops`` over the transport of ``kind``; the
    received ones copied into their arrays once all completed."""
    messages, landed = [], []
    for (op_kind, _, peer), array, go in zip(ops, natives, agreed):
        if not go or not array.size:
            continue
        xp = array_module(array)
        if op_kind == "send":
            flat = xp.ascontiguousarray(array).reshape(-1)
            session.stats.bytes_sent += flat.nbytes
            messages.append(("send", flat, peer, TAG_DATA))
        else:
            buf = xp.empty(array.size, array.dtype)
            messages.append(("recv", buf, peer, TAG_DATA))
            landed.append((array, buf))
    if not messages:
        return
    with session.data_phase():
        session.transport(kind).send_recv(messages, wait)
    for array, buf in landed:
        array[...] = buf.reshape(array.shape)
