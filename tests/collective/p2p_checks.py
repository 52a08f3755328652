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


def host(a):
    """``a`` as a numpy array (a cupy array copied to the host, after the
    work on it)."""
    return a if a is None or type(a) is np.ndarray else a.get()


def check_p2p(comm, xp=np):
    """Every check on arrays of ``xp`` (numpy, or cupy: the same calls over
    the communicator's cupy transport)."""
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    for dtype in DTYPES:
        for length in LENGTHS:
            # a ring: every rank sends to the next and receives from the previous
            out = xp.full(length, 255, dtype)
            comm.batch_send_recv([P2POp("send", xp.asarray(values(r, dtype, length)), nxt),
                                  P2POp("recv", out, prv)])
            assert np.array_equal(host(out), values(prv, dtype, length)), (dtype, length)
    # shaped arrays, blocking pairs (even ranks send first)
    shape = (3, 5, 7)
    a = xp.asarray(values(r, "float32", 105).reshape(shape))
    got = xp.zeros(shape, np.float32)
    if n > 1 and r % 2 == 0 and r + 1 < n:
        comm.send(a, r + 1)
        assert comm.recv(got, r + 1) is got
        assert np.array_equal(host(got), values(r + 1, "float32", 105).reshape(shape))
    elif n > 1 and r % 2 == 1:
        comm.recv(got, r - 1)
        assert np.array_equal(host(got), values(r - 1, "float32", 105).reshape(shape))
        comm.send(a, r - 1)
    # the order docs/api.md gives for blocking calls: a ring, even ranks
    # send first, odd ranks receive first (at odd sizes too)
    if n > 1:
        got = xp.empty(13, np.float64)
        mine = xp.asarray(values(r, "float64", 13, salt=3))
        calls = [lambda: comm.send(mine, nxt), lambda: comm.recv(got, prv)]
        for call in calls if r % 2 == 0 else calls[::-1]:
            call()
        assert np.array_equal(host(got), values(prv, "float64", 13, salt=3))
    # every pair at once, two messages each way, receives before sends
    ops, outs = [], {}
    for q in range(n):
        for k in range(2):
            outs[q, k] = xp.empty(11 + k, np.int64)
            ops.append(P2POp("recv", outs[q, k], q))
    for q in range(n):
        for k in range(2):
            ops.append(P2POp("send", xp.asarray(values(r, "int64", 11 + k, salt=q)), q))
    comm.batch_send_recv(ops)
    for (q, k), got in outs.items():
        assert np.array_equal(host(got), values(q, "int64", 11 + k, salt=r)), (q, k)
    # asynchronous: a Work each, ring as one batch; a send and a recv too
    out = xp.empty(9, np.float64)
    work = comm.batch_send_recv([P2POp("recv", out, prv),
                                 P2POp("send", xp.asarray(values(r, "float64", 9)), nxt)],
                                async_op=True)
    assert work.wait() is None and np.array_equal(host(out), values(prv, "float64", 9))
    if n > 1:               # odd ranks receive first, even ranks send first
        out = xp.empty(6, np.int32)
        mine = xp.asarray(values(r, "int32", 6))
        calls = [lambda: comm.recv(out, prv, async_op=True),
                 lambda: comm.send(mine, nxt, async_op=True)]
        works = [call() for call in (calls if r % 2 else calls[::-1])]
        for w in works[::-1]:
            w.wait()
        assert np.array_equal(host(out), values(prv, "int32", 6))
    # mpi4py's Sendrecv on the same inputs: the same result
    theirs = np.empty(7, np.int32)
    WORLD.Sendrecv(values(r, "int32", 7), dest=nxt, recvbuf=theirs, source=prv)
    mine = xp.empty(7, np.int32)
    comm.batch_send_recv([P2POp("send", xp.asarray(values(r, "int32", 7)), nxt),
                          P2POp("recv", mine, prv)])
    assert np.array_equal(host(mine), theirs)


def check_exchanges(comm, xp=np):
    """Scatter, gather, both all-to-alls, objects and split on arrays of
    ``xp`` (numpy or cupy), against numpy and mpi4py."""
    r, n = comm.rank, comm.size
    for length in (0, 1, 7, 300_001):
        for root in range(n):
            blocks = [values(q, "float32", length, salt=root) for q in range(n)] \
                if r == root else None
            got = comm.scatter(None if blocks is None else [xp.asarray(b) for b in blocks],
                               root=root)
            assert type(got) is xp.ndarray, type(got)
            got = host(got)
            assert np.array_equal(got, values(r, "float32", length, salt=root))
            ref = np.empty(length, np.float32)
            WORLD.Scatter(np.concatenate(blocks) if r == root else None, ref, root=root)
            assert np.array_equal(got, ref)
            gathered = host(comm.gather(xp.asarray(values(r, "int32", length, salt=root)),
                                        root=root))
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
        mine = values(r, "float64", n * length, salt=5).reshape(n, length)
        send = xp.asarray(mine)
        recv = xp.empty_like(send)
        assert comm.all_to_all(send, recv) is recv
        want = np.stack([values(q, "float64", n * length, salt=5).reshape(n, length)[r]
                         for q in range(n)])
        assert np.array_equal(host(recv), want)
        ref = np.empty_like(mine)
        WORLD.Alltoall(mine, ref)
        assert np.array_equal(host(recv), ref)
        comm.all_to_all(send, send)
        assert np.array_equal(host(send), want)
    # all_to_allv: odd, empty and large blocks; counts exchanged, then given
    def counts_of(q):
        return [((q * 7 + p * 3) % 5) * (1 if (q + p) % 3 else 60_001) for p in range(n)]
    counts = counts_of(r)
    data = values(r, "int64", sum(counts), salt=9)
    got, got_counts = comm.all_to_allv(xp.asarray(data), counts)
    assert type(got) is xp.ndarray, type(got)
    got = host(got)
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
    again, _ = comm.all_to_allv(xp.asarray(data), counts, expected)
    assert np.array_equal(host(again), got)
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
    x = xp.asarray(np.array([r], np.float64))
    sub.all_reduce(x)
    assert host(x)[0] == sum(members)
    sub.close()
    none = comm.split(None if r == 0 else 1)
    assert (none is None) == (r == 0)
    if none is not None:
        assert none.size == n - 1 and none.rank == r - 1
        y = xp.ones(3, np.int32)
        none.all_reduce(y)
        assert (host(y) == n - 1).all()
        none.close()


def check_grid(comm, xp=np):
    """A 2x2 grid: rows (data parallel) and columns (model parallel) with
    collectives on both interleaved (one row's all-reduce in flight while
    the column's runs), a point-to-point call in a row and objects in a
    column; arrays of ``xp`` (numpy or cupy)."""
    r = comm.rank
    row, col = comm.split(r // 2), comm.split(r % 2)
    assert (row.rank, row.size, col.rank, col.size) == (r % 2, 2, r // 2, 2)
    for step in range(3):
        a = xp.asarray(np.array([r + step], np.float32))
        b = xp.full(200_000, r * step, np.float32)
        work = row.all_reduce(a, async_op=True)
        col.all_reduce(b)
        work.wait()
        assert host(a)[0] == 2 * (r // 2) * 2 + 1 + 2 * step, a
        assert (host(b) == step * (2 * (r % 2) + 2)).all()
        got = xp.empty(3, np.float32)
        row.batch_send_recv([P2POp("send", xp.full(3, r, np.float32), 1 - row.rank),
                             P2POp("recv", got, 1 - row.rank)])
        assert (host(got) == (r ^ 1)).all()
        assert col.all_gather_object(r) == [r % 2, r % 2 + 2]
    row.close()
    col.close()


def check_names(comm):
    """At 4 ranks: errors in a split communicator name each rank by its
    rank there and its world rank, in the status board's messages (a
    mismatch, a deadline) and the pair check's (a mismatch, a deadline).
    Halves by parity, ordered by a reversed key: [2, 0] and [3, 1], so
    world rank 0 is rank 1 of its half and world rank 3 rank 0 of its
    half; those two misbehave."""
    r = comm.rank
    short = commlib.Communicator.from_mpi(timeout=1.5)
    sub = short.split(r % 2, key=-r)
    members = [2, 0] if r % 2 == 0 else [3, 1]
    bad = members.index(0 if r % 2 == 0 else 3)
    other = 1 - bad

    def name(g):
        return "rank %d (world rank %d)" % (g, members[g])

    me = sub.rank
    assert me == members.index(r)
    # the board: a mismatch names both groups of ranks by both numbers
    exc = expect(errors.ConsistencyError, [
        "%s: ranks disagree on all_reduce #1" % name(me),
        "ranks [%d] (world ranks [%d]): all_reduce" % (bad, members[bad]),
        "ranks [%d] (world ranks [%d]): all_reduce" % (other, members[other])],
        lambda: sub.all_reduce(np.zeros(3 if me == bad else 4)))
    # the pair check: a receive of another dtype, both named by both numbers
    keep = np.full(4, 7.0)
    exc = expect(errors.ConsistencyError, [
        "%s sends float32(4,) to %s, which receives float64(4,)" % (name(bad), name(other))],
        lambda: sub.send(np.zeros(4, np.float32), other) if me == bad else
        sub.recv(keep, bad))
    assert list(exc.culprits) == [0, 1] and (keep == 7.0).all()
    # the pair's deadline: the misbehaving rank never sends
    if me == other:
        exc = expect(errors.CollectiveTimeoutError, [
            "%s: recv after collective #1 (recv from %s) did not complete before its "
            "deadline: waiting for %s (" % (name(other), name(bad), name(bad))],
            lambda: sub.recv(keep, bad))
        assert list(exc.culprits) == [bad]
    WORLD.Barrier()         # the misbehaving ranks stay until their peers gave up
    sub._session.abandon(2, "")
    # the board's deadline: the misbehaving rank does not call
    sub = short.split(r % 2, key=-r)
    if me == other:
        exc = expect(errors.CollectiveTimeoutError, [
            "%s: all_reduce #1 did not complete before its deadline: waiting for %s (has not "
            "entered any collective)" % (name(other), name(bad))],
            lambda: sub.all_reduce(np.zeros(4)))
        assert list(exc.culprits) == [bad]
    WORLD.Barrier()
    sub._session.abandon(2, "")
    short.close()


def main(which):
    comm = commlib.Communicator.from_mpi()
    checks = {"p2p": check_p2p, "exchanges": check_exchanges, "grid": check_grid,
              "names": check_names}
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
    # split with a bad colour, then a bad key: every rank raises naming it
    for bad_args, what in (({"color": -1}, "color"), ({"color": 0, "key": "first"}, "key")):
        exc = expect(errors.ArgumentError if r == bad else errors.ConsistencyError,
                     ["rank %d: split: %s must be" % (bad, what)],
                     lambda: comm.split(**(bad_args if r == bad else {"color": 0})))
        if r != bad:
            assert "rank %d rejected its arguments" % bad in str(exc), exc
            assert list(exc.culprits) == [bad], exc.culprits
    # split where rank ``bad`` calls all_gather_object: every rank raises
    exc = expect(errors.ConsistencyError, ["split", "all_gather_object"],
                 lambda: comm.all_gather_object(r) if r == bad else comm.split(0))
    assert exc.culprits and (n == 2 or list(exc.culprits) == [bad]), exc.culprits
    # still usable
    x = np.ones(2)
    comm.all_reduce(x)
    assert (x == n).all()


def check_deadline(comm, bad):
    """Blocking sends in a cycle (2 ranks: each sends to the other) end at
    the deadline: every rank raises, naming the peer it waited for; rank
    ``bad`` alone does not call: its peer names it. Then a rank (``bad``,
    or the last one after the cycle) calls neither all_to_all nor split:
    the others' calls end at the deadline naming it."""
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
    short._session.abandon(2, "")
    absent = bad if bad >= 0 else n - 1
    for what, call in (("all_to_all", lambda c: c.all_to_all(np.zeros(n), np.zeros(n))),
                       ("split", lambda c: c.split(r % 2))):
        short = commlib.Communicator.from_mpi(timeout=1.0)
        if r != absent:
            exc = expect(errors.CollectiveTimeoutError, [
                "rank %d: %s #1 did not complete before its deadline: waiting for rank %d "
                "(has not entered any collective)" % (r, what, absent)], lambda: call(short))
            assert list(exc.culprits) == [absent], exc.culprits
        WORLD.Barrier()         # the absent rank stays until its peers gave up
        short._session.abandon(2, "")
    print("rank %d deadline ok" % r, flush=True)


def expect_any(fn):
    try:
        fn()
    except (errors.CollectiveTimeoutError, errors.PeerError) as exc:
        return exc
    raise AssertionError("no CollectiveTimeoutError or PeerError")


def check_death(comm, bad):
    """Rank ``bad`` dies inside a split, after the colours were exchanged:
    the others' split raises PeerError naming it; then, while its peer
    waits to receive from it and the others wait in an all_to_all, each
    raises PeerError naming it; and a communicator split off before, which
    holds it, names it by its rank there and its world rank."""
    r, n = comm.rank, comm.size
    sub = comm.split(0, key=-r)             # every rank, in reverse: bad is n-1-bad there
    other = commlib.Communicator.from_mpi()
    if r == bad:
        # the colours are exchanged, then this rank dies making the split
        other._session.routes["numpy"].split = lambda *args: os._exit(3)
    exc = expect(errors.PeerError, ["rank %d" % bad], lambda: other.split(r % 2))
    assert r != bad
    assert list(exc.culprits) == [bad], exc.culprits
    peer = (bad + 1) % n
    if r == peer:
        exc = expect(errors.PeerError, ["rank %d" % bad], lambda: comm.recv(np.zeros(3), bad))
    else:
        exc = expect(errors.PeerError, ["rank %d" % bad],
                     lambda: comm.all_to_all(np.zeros(n), np.zeros(n)))
    assert bad in exc.culprits, exc.culprits
    exc = expect(errors.PeerError, ["rank %d (world rank %d)" % (n - 1 - bad, bad)],
                 lambda: sub.all_reduce(np.ones(2)))
    assert list(exc.culprits) == [n - 1 - bad], exc.culprits
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
