"""Checks of the point-to-point, rooted, all-to-all, object and split calls,
run inside MPI jobs (imported by the ranks of tests/collective/test_p2p.py).

Inputs are regenerated on every rank from seeds (``values(rank, ...)``), so
each rank computes what it must receive with numpy; where mpi4py has the
call, its result on the same inputs is compared too. A failed check raises
AssertionError, which aborts the job.
"""
import os
import sys

import numpy as np
from mpi4py import MPI

import commlib
from commlib import P2POp, errors

WORLD = MPI.COMM_WORLD
DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]
LENGTHS = [0, 1, 7, 300_001]        # 300k float32: above the shared-memory threshold


def values(rank, dtype, n, salt=0):
    """Rank ``rank``'s input of ``n`` elements (the same on every rank that asks)."""
    rng = np.random.default_rng(1000 * rank + 7 * n + salt)
    return rng.integers(0, 100, size=n).astype(dtype)


def check_p2p(comm):
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    for dtype in DTYPES:
        for length in LENGTHS:
            # a ring: every rank sends to the next and receives from the previous
            out = np.full(length, 255, dtype)
            comm.batch_send_recv([P2POp("send", values(r, dtype, length), nxt),
                                  P2POp("recv", out, prv)])
            assert np.array_equal(out, values(prv, dtype, length)), (dtype, length)
    # shaped arrays, blocking pairs (even ranks send first)
    shape = (3, 5, 7)
    a = values(r, "float32", 105).reshape(shape)
    got = np.zeros(shape, np.float32)
    if n > 1 and r % 2 == 0 and r + 1 < n:
        comm.send(a, r + 1)
        assert comm.recv(got, r + 1) is got
        assert np.array_equal(got, values(r + 1, "float32", 105).reshape(shape))
    elif n > 1 and r % 2 == 1:
        comm.recv(got, r - 1)
        assert np.array_equal(got, values(r - 1, "float32", 105).reshape(shape))
        comm.send(a, r - 1)
    # every pair at once, two messages each way, receives before sends
    ops, outs = [], {}
    for q in range(n):
        for k in range(2):
            outs[q, k] = np.empty(11 + k, np.int64)
            ops.append(P2POp("recv", outs[q, k], q))
    for q in range(n):
        for k in range(2):
            ops.append(P2POp("send", values(r, "int64", 11 + k, salt=q), q))
    comm.batch_send_recv(ops)
    for (q, k), got in outs.items():
        assert np.array_equal(got, values(q, "int64", 11 + k, salt=r)), (q, k)
    # asynchronous: a Work each, ring as one batch
    out = np.empty(9, np.float64)
    work = comm.batch_send_recv([P2POp("recv", out, prv), P2POp("send", values(r, "float64", 9),
                                                               nxt)], async_op=True)
    assert work.wait() is None and np.array_equal(out, values(prv, "float64", 9))
    # mpi4py's Sendrecv on the same inputs: the same result
    theirs = np.empty(7, np.int32)
    WORLD.Sendrecv(values(r, "int32", 7), dest=nxt, recvbuf=theirs, source=prv)
    mine = np.empty(7, np.int32)
    comm.batch_send_recv([P2POp("send", values(r, "int32", 7), nxt), P2POp("recv", mine, prv)])
    assert np.array_equal(mine, theirs)


def check_exchanges(comm):
    r, n = comm.rank, comm.size
    for length in (0, 1, 7, 300_001):
        for root in range(n):
            blocks = [values(q, "float32", length, salt=root) for q in range(n)] \
                if r == root else None
            got = comm.scatter(blocks, root=root)
            assert np.array_equal(got, values(r, "float32", length, salt=root))
            ref = np.empty(length, np.float32)
            WORLD.Scatter(np.concatenate(blocks) if r == root else None, ref, root=root)
            assert np.array_equal(got, ref)
            gathered = comm.gather(values(r, "int32", length, salt=root), root=root)
            if r == root:
                want = np.stack([values(q, "int32", length, salt=root) for q in range(n)])
                assert gathered.shape == (n, length) and np.array_equal(gathered, want)
                ref = np.empty((n, length), np.int32)
            else:
                assert gathered is None
                ref = None
            WORLD.Gather(values(r, "int32", length, salt=root), ref, root=root)
            if r == root:
                assert np.array_equal(gathered, ref)
        # all_to_all against numpy and mpi4py's Alltoall; in place too
        send = values(r, "float64", n * length, salt=5).reshape(n, length)
        recv = np.empty_like(send)
        assert comm.all_to_all(send, recv) is recv
        want = np.stack([values(q, "float64", n * length, salt=5).reshape(n, length)[r]
                         for q in range(n)])
        assert np.array_equal(recv, want)
        ref = np.empty_like(send)
        WORLD.Alltoall(send, ref)
        assert np.array_equal(recv, ref)
        comm.all_to_all(send, send)
        assert np.array_equal(send, want)
    # all_to_allv: odd, empty and large blocks; counts exchanged, then given
    def counts_of(q):
        return [((q * 7 + p * 3) % 5) * (1 if (q + p) % 3 else 60_001) for p in range(n)]
    counts = counts_of(r)
    data = values(r, "int64", sum(counts), salt=9)
    got, got_counts = comm.all_to_allv(data, counts)
    expected = [counts_of(q)[r] for q in range(n)]
    assert got_counts.tolist() == expected and got_counts.dtype == np.int64
    pieces = []
    for q in range(n):
        theirs = counts_of(q)
        start = sum(theirs[:r])
        pieces.append(values(q, "int64", sum(theirs), salt=9)[start:start + theirs[r]])
    assert np.array_equal(got, np.concatenate(pieces))
    ref = np.empty(sum(expected), np.int64)
    WORLD.Alltoallv([data, counts], [ref, expected])
    assert np.array_equal(got, ref)
    again, _ = comm.all_to_allv(data, counts, expected)
    assert np.array_equal(again, got)
    # objects, against mpi4py's pickled bcast / allgather
    for root in range(n):
        obj = {"from": r, "list": list(range(r + 3)), "text": "x" * (r * 1000)}
        got = comm.broadcast_object(obj, root=root)
        assert got == WORLD.bcast(obj, root=root)
        assert (got is obj) == (r == root)
    gathered = comm.all_gather_object(("rank", r, np.arange(r)))
    assert [g[1] for g in gathered] == [q for q in range(n)]
    assert all(np.array_equal(g[2], np.arange(q)) for q, g in enumerate(gathered))
    # split: halves ordered by a reversed key, and a rank of no colour
    sub = comm.split(r % 2, key=-r)
    members = [q for q in range(n) if q % 2 == r % 2][::-1]
    assert (sub.rank, sub.size) == (members.index(r), len(members))
    x = np.array([r], np.float64)
    sub.all_reduce(x)
    assert x[0] == sum(members)
    sub.close()
    none = comm.split(None if r == 0 else 1)
    assert (none is None) == (r == 0)
    if none is not None:
        assert none.size == n - 1 and none.rank == r - 1
        none.barrier()
        none.close()


def check_grid(comm):
    """A 2x2 grid: rows (data parallel) and columns (model parallel) with
    collectives on both interleaved, and a point-to-point call in a row."""
    r = comm.rank
    row, col = comm.split(r // 2), comm.split(r % 2)
    assert (row.rank, row.size, col.rank, col.size) == (r % 2, 2, r // 2, 2)
    for step in range(3):
        a = np.array([r + step], np.float32)
        b = np.full(200_000, r * step, np.float32)
        row.all_reduce(a)
        col.all_reduce(b)
        assert a[0] == 2 * (r // 2) * 2 + 1 + 2 * step, a
        assert (b == step * (2 * (r % 2) + 2)).all()
        got = np.empty(3, np.float32)
        row.batch_send_recv([P2POp("send", np.full(3, r, np.float32), 1 - row.rank),
                             P2POp("recv", got, 1 - row.rank)])
        assert (got == (r ^ 1)).all()
        assert col.all_gather_object(r) == [r % 2, r % 2 + 2]
    row.close()
    col.close()


def main(which):
    comm = commlib.Communicator.from_mpi()
    checks = {"p2p": check_p2p, "exchanges": check_exchanges, "grid": check_grid}
    for name in which.split(","):
        checks[name](comm)
    comm.close()
    print("rank %d ok" % comm.rank)


def expect(kind, fragments, fn):
    """Call ``fn``; assert it raises exactly ``kind`` holding every fragment."""
    try:
        fn()
    except errors.CommlibError as exc:
        assert type(exc) is kind, "%s raised, not %s: %s" % (type(exc).__name__,
                                                              kind.__name__, exc)
        for fragment in fragments:
            assert fragment in str(exc), "%r not in %r" % (fragment, str(exc))
        return exc
    raise AssertionError("%s was not raised" % kind.__name__)


def check_mismatches(comm, bad):
    """Rank ``bad`` passes what its peers do not expect; every rank raises,
    naming the culprit, nothing is written, and the communicator stays
    usable."""
    r, n = comm.rank, comm.size
    peer = (bad + 1) % n
    keep = np.full(4, 7.0)
    # a receive of another dtype: both ranks of the pair, both arrays named
    if r == bad:
        expect(errors.ConsistencyError, ["rank %d sends float32(4,) to rank %d, which receives "
                                         "float64(4,)" % (bad, peer)],
               lambda: comm.send(np.zeros(4, np.float32), peer))
    elif r == peer:
        expect(errors.ConsistencyError, ["rank %d sends float32(4,)" % bad, "float64(4,)"],
               lambda: comm.recv(keep, bad))
        assert (keep == 7.0).all()
    # a rejected receive (read-only) named on the sender
    ro = np.zeros(3)
    ro.setflags(write=False)
    if r == bad:
        expect(errors.ArrayTypeError, ["rank %d" % bad, "read-only"],
               lambda: comm.recv(ro, peer))
    elif r == peer:
        expect(errors.ConsistencyError, ["rank %d rejected its arguments" % bad, "read-only"],
               lambda: comm.send(np.zeros(3), bad))
    # a bad peer: on that rank only, before anything is sent
    if r == bad:
        expect(errors.ArgumentError, ["rank %d" % bad, "0 <= peer < %d" % n, "got %d" % n],
               lambda: comm.send(np.zeros(3), n))
    # all_to_all of another size: every rank raises, naming the culprit
    size = 3 * n if r == bad else 2 * n
    exc = expect(errors.ConsistencyError, ["all_to_all"],
                 lambda: comm.all_to_all(np.zeros(size), np.zeros(size)))
    # two ranks that differ: either may be the odd one; more: the minority
    assert exc.culprits and (n == 2 or list(exc.culprits) == [bad]), exc.culprits
    assert "ranks [%d]" % bad in str(exc), exc
    # all_to_allv with given counts that disagree on the pair (bad -> peer)
    counts = [1] * n
    expects = [1] * n
    if r == peer:
        expects[bad] = 2
    if n > 1:
        if r in (bad, peer) and bad != peer:
            expect(errors.ConsistencyError, ["rank %d sends 1 elements to rank %d, which "
                                             "expects 2" % (bad, peer)],
                   lambda: comm.all_to_allv(np.arange(n, dtype=np.float32), counts, expects))
        else:
            got, _ = comm.all_to_allv(np.arange(n, dtype=np.float32), counts, expects)
            assert got.tolist() == [float(r)] * n
    # split with a bad colour: every rank raises
    expect(errors.ArgumentError if r == bad else errors.ConsistencyError,
           ["color" if r == bad else "rank %d rejected its arguments" % bad],
           lambda: comm.split(-1 if r == bad else 0))
    # still usable
    x = np.ones(2)
    comm.all_reduce(x)
    assert (x == n).all()


def check_deadline(comm, bad):
    """Blocking sends in a cycle (2 ranks: each sends to the other) end at
    the deadline: every rank raises, naming the peer it waited for; rank
    ``bad`` alone does not call: its peer names it."""
    r, n = comm.rank, comm.size
    short = commlib.Communicator.from_mpi(timeout=1.0)
    if n == 2 and bad < 0:
        exc = expect_any(lambda: short.send(np.zeros(5), 1 - r))
        # the first to give up names its peer; the other learns it gave up
        assert "send after collective #0 (send to rank %d) did not complete before its " \
               "deadline: waiting for rank %d" % (1 - r, 1 - r) in str(exc) or \
               "rank %d gave up" % (1 - r) in str(exc), exc
        assert list(exc.culprits) in ([1 - r], [r]), exc.culprits
    elif r != bad:
        peer = bad
        exc = expect_any(lambda: short.recv(np.zeros(5), peer))
        assert isinstance(exc, errors.CollectiveTimeoutError), exc
        assert "recv after collective #0 (recv from rank %d) did not complete before its " \
               "deadline: waiting for rank %d" % (bad, bad) in str(exc), exc
        assert list(exc.culprits) == [bad], exc.culprits
    WORLD.Barrier()             # rank ``bad`` stays until its peers gave up
    print("rank %d deadline ok" % r, flush=True)
    short._session.abandon(2, "")


def expect_any(fn):
    try:
        fn()
    except (errors.CollectiveTimeoutError, errors.PeerError) as exc:
        return exc
    raise AssertionError("no CollectiveTimeoutError or PeerError")


def check_death(comm, bad):
    """Rank ``bad`` dies while its peer waits to receive from it and the
    others wait in an all_to_all: each raises PeerError naming it."""
    r = comm.rank
    if r == bad:
        os._exit(3)
    peer = (bad + 1) % comm.size
    if r == peer:
        exc = expect(errors.PeerError, ["rank %d" % bad], lambda: comm.recv(np.zeros(3), bad))
    else:
        exc = expect(errors.PeerError, ["rank %d" % bad],
                     lambda: comm.all_to_all(np.zeros(comm.size), np.zeros(comm.size)))
    assert bad in exc.culprits, exc.culprits
    print("rank %d death ok" % r, flush=True)
    os._exit(0)


def faults(which, bad):
    comm = commlib.Communicator.from_mpi()
    bad = int(bad)
    if which == "mismatch":
        check_mismatches(comm, bad)
        comm.close()
        print("rank %d ok" % comm.rank)
    elif which == "deadline":
        check_deadline(comm, bad)
    elif which == "death":
        check_death(comm, bad)
