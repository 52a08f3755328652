"""Point-to-point, scatter/gather, all-to-all, objects and split: against
numpy and mpi4py in MPI jobs of 1 to 4 ranks (one job per size checking
every case), on thread ranks, and their faults with the faulty rank varied."""
import threading

import numpy as np
import pytest

import commlib
from commlib import P2POp, errors
from inprocess import communicators, run_ranks
from mpirun import assert_each_rank, ranks_saying, run_mpi


def run_checks(n, which):
    code = "import sys, p2p_checks\np2p_checks.main(sys.argv[1])\n"
    proc = run_mpi(n, code, timeout=120, args=[which])
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", n)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_p2p_scatter_gather_all_to_all_objects_split(n):
    """At 4 ranks also a 2x2 grid, and the errors of split communicators
    naming ranks by their world ranks too."""
    run_checks(n, "p2p,exchanges" + (",grid,names" if n == 4 else ""))


def run_faults(n, which, bad, **kwargs):
    code = "import sys, p2p_checks\np2p_checks.faults(sys.argv[1], sys.argv[2])\n"
    return run_mpi(n, code, timeout=60, args=[which, str(bad)], **kwargs)


@pytest.mark.parametrize("n,bad", [(2, 0), (3, 2)])
def test_mismatches_raise_on_every_rank_naming_the_culprit(n, bad):
    proc = run_faults(n, "mismatch", bad)
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", n)


@pytest.mark.parametrize("n,bad", [(2, -1), (3, 0)])
def test_blocking_sends_end_at_the_deadline_naming_the_peer(n, bad):
    """bad=-1: two ranks send to each other (a cycle); else rank ``bad``
    never calls and its peers' receives time out naming it. Then rank
    ``bad`` (the last after the cycle) calls neither all_to_all nor split:
    its peers' calls time out naming it."""
    proc = run_faults(n, "deadline", bad)
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) deadline ok", n)


@pytest.mark.parametrize("bad", [0, 2])
def test_a_peer_that_dies_ends_split_receives_all_to_all_and_its_sub_communicator(bad):
    """Rank ``bad`` dies inside a split, after the colours were exchanged
    (its peers' split is MPI's, which blocks: bounded all the same)."""
    proc = run_faults(3, "death", bad, expect_fail=True, survivors=True)
    assert sorted(ranks_saying(proc.stdout, r"rank (?P<rank>\d+) death ok")) == \
        [r for r in range(3) if r != bad], proc.stdout + proc.stderr


# -- thread ranks ----------------------------------------------------------------------
def exchange_everything(comm):
    r, n = comm.rank, comm.size
    out = np.zeros((2, 3), np.float32)
    comm.batch_send_recv([P2POp("send", np.full((2, 3), r, np.float32), (r + 1) % n),
                          P2POp("recv", out, (r - 1) % n)])
    assert (out == (r - 1) % n).all()
    blocks = [np.full(5, 10 * q + 1, np.int64) for q in range(n)] if r == n - 1 else None
    assert (comm.scatter(blocks, root=n - 1) == 10 * r + 1).all()
    gathered = comm.gather(np.full(3, r, np.uint8), root=0)
    assert (gathered == np.arange(n, dtype=np.uint8)[:, None]).all() if r == 0 \
        else gathered is None
    send = np.arange(2 * n, dtype=np.float64) + 100 * r
    comm.all_to_all(send, send)
    assert send.tolist() == [float(2 * r + k + 100 * q) for q in range(n) for k in range(2)]
    counts = [(r + q) % 3 for q in range(n)]
    got, got_counts = comm.all_to_allv(np.arange(sum(counts), dtype=np.int32), counts)
    assert got_counts.tolist() == [(q + r) % 3 for q in range(n)]
    assert comm.broadcast_object({"root": r}, root=0) == {"root": 0}
    assert comm.all_gather_object(r * "x") == [q * "x" for q in range(n)]
    sub = comm.split(r % 2, key=-r)
    x = np.array([r], np.float32)
    sub.all_reduce(x)
    result = (sub.rank, sub.size, float(x[0]))
    sub.close()
    return result


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_thread_ranks(n):
    results = run_ranks(n, exchange_everything, timeout=30)
    for r, (rank, size, total) in enumerate(results):
        members = [q for q in range(n) if q % 2 == r % 2][::-1]
        assert (rank, size, total) == (members.index(r), len(members), sum(members))


def test_a_shape_mismatch_on_thread_ranks_names_both_and_writes_nothing():
    def body(comm):
        keep = np.full(4, 5.0)
        try:
            if comm.rank == 0:
                comm.send(np.zeros((2, 2)), 1)
            else:
                comm.recv(keep, 0)
        except errors.ConsistencyError as exc:
            assert (keep == 5.0).all()
            comm.barrier()              # still usable
            return str(exc), exc.culprits
    for text, culprits in run_ranks(2, body, timeout=30):
        assert "rank 0 sends float64(2, 2) to rank 1, which receives float64(4,)" in text
        assert list(culprits) == [0, 1]


@pytest.mark.parametrize("first", ["send", "isend"])
def test_two_ranks_that_send_first_end_at_the_deadline_on_thread_ranks(first):
    """The order docs/api.md warns of: both ranks send (blocking, or
    asynchronously) to each other, then receive. Blocking: the first to
    give up raises CollectiveTimeoutError naming its peer, the peer
    PeerError saying it gave up. Asynchronous: each receive waits behind
    its own rank's send; the send's Work raises CollectiveTimeoutError or
    PeerError, the receive ClosedError citing it."""
    comms = communicators(2, timeout=0.5)
    found = [None, None]

    def body(r):
        out = np.zeros(3)
        try:
            if first == "send":
                comms[r].send(np.full(3, float(r)), 1 - r)
            else:
                work = comms[r].send(np.full(3, float(r)), 1 - r, async_op=True)
                with pytest.raises(errors.ClosedError, match="did not complete before its "
                                   "deadline|gave up"):
                    comms[r].recv(out, 1 - r)
                work.wait()
        except (errors.CollectiveTimeoutError, errors.PeerError) as exc:
            found[r] = exc
    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert sorted(type(e).__name__ for e in found) in (
        ["CollectiveTimeoutError", "PeerError"], ["CollectiveTimeoutError"] * 2), found
    for r, exc in enumerate(found):
        if isinstance(exc, errors.CollectiveTimeoutError):
            assert "(send to rank %d) did not complete before its deadline: waiting for " \
                   "rank %d" % (1 - r, 1 - r) in str(exc) and list(exc.culprits) == [1 - r]
        else:       # the peer's error passed on: it blamed this rank
            assert "rank %d gave up" % (1 - r) in str(exc) and list(exc.culprits) == [r]
    for c in comms:
        c.close()


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_rejected_receive_on_thread_ranks_is_named_on_the_sender(culprit):
    """The receiving rank rejects its read-only array (ArrayTypeError); the
    sender raises ConsistencyError quoting that error whole and blaming the
    receiver alone; both stay usable."""
    other = 1 - culprit
    own = ("rank %d: recv(array) from rank %d is read-only; in-place collectives write "
           "their result into it" % (culprit, other))

    def body(comm):
        try:
            if comm.rank == culprit:
                ro = np.zeros(3)
                ro.setflags(write=False)
                comm.recv(ro, other)
            else:
                comm.send(np.zeros(3), culprit)
        except errors.CommlibError as exc:
            comm.barrier()
            return type(exc), str(exc), tuple(exc.culprits)

    results = run_ranks(2, body, timeout=30)
    assert results[culprit] == (errors.ArrayTypeError, own, ())
    assert results[other] == (
        errors.ConsistencyError, "rank %d: send after collective #0 was not run for 1 of its 1 "
        "message(s):\n  rank %d rejected its arguments: %s (its recv from rank %d)"
        % (other, culprit, own, other), (culprit,))


@pytest.mark.parametrize("root", [0, 2])
def test_a_scatter_root_without_one_array_per_rank_on_thread_ranks(root):
    """The root raises ArgumentError saying what it passed; every other
    rank ConsistencyError quoting it and blaming the root."""
    n = 3
    given = [([np.zeros(2)] * 2, "a list of 2"), (np.zeros((3, 2)), "ndarray")]

    def body(comm):
        out = []
        for arrays, _ in given:
            try:
                comm.scatter(arrays if comm.rank == root else None, root=root)
            except errors.CommlibError as exc:
                out.append((type(exc), str(exc), tuple(exc.culprits)))
        return out

    results = run_ranks(n, body, timeout=30)
    for seq, (_, what) in enumerate(given, 1):
        own = ("rank %d: scatter: the root's arrays must be a list of %d arrays (one per "
               "rank), got %s" % (root, n, what))
        for r in range(n):
            want = (errors.ArgumentError, own, ()) if r == root else (
                errors.ConsistencyError, "rank %d: scatter #%d was not run:\n  rank %d "
                "rejected its arguments: %s" % (r, seq, root, own), (root,))
            assert results[r][seq - 1] == want, (r, results[r][seq - 1])


@pytest.mark.parametrize("culprit", [0, 2])
def test_bad_roots_and_colours_on_thread_ranks(culprit):
    """A root out of range or no int, passed by every rank to the rooted
    calls, and a peer out of range raise ArgumentError on every rank; a negative colour passed by
    one rank to split raises ArgumentError there and ConsistencyError
    blaming it on the others."""
    n = 3
    calls = [(lambda comm: comm.broadcast_object(1, root=n), "root=3 is out of range for a "
              "communicator of size 3 (expected 0 <= root < 3)"),
             (lambda comm: comm.gather(np.zeros(2), root=-1), "root=-1 is out of range for a "
              "communicator of size 3 (expected 0 <= root < 3)"),
             (lambda comm: comm.scatter(None, root=True), "root must be an int, got True"),
             (lambda comm: comm.send(np.zeros(2), n), "send: the peer of ops[0] (send) must "
              "be a rank, an int with 0 <= peer < 3, got 3"),
             (lambda comm: comm.recv(np.zeros(2), -1), "recv: the peer of ops[0] (recv) must "
              "be a rank, an int with 0 <= peer < 3, got -1")]

    def body(comm):
        out = []
        for call, _ in calls:
            with pytest.raises(errors.ArgumentError) as info:
                call(comm)
            out.append(str(info.value))
        try:
            comm.split(-1 if comm.rank == culprit else 0)
        except errors.CommlibError as exc:
            out.append((type(exc), str(exc), tuple(exc.culprits)))
        return out

    results = run_ranks(n, body, timeout=30)
    own = "rank %d: split: color must be an int >= 0 or None, got -1" % culprit
    for r in range(n):
        assert results[r][:-1] == ["rank %d: %s" % (r, text) for _, text in calls]
        assert results[r][-1] == ((errors.ArgumentError, own, ()) if r == culprit else (
            errors.ConsistencyError, "rank %d: split #4 was not run:\n  rank %d rejected its "
            "arguments: %s" % (r, culprit, own), (culprit,)))


@pytest.mark.parametrize("ops, call", [
    (1, "send to rank 0"),
    (4, "send to rank 0; recv from rank 0; send to rank 0; recv from rank 0"),
    (5, "send to rank 0; recv from rank 0; send to rank 0; recv from rank 0; ...")])
def test_a_send_nobody_receives_times_out_on_thread_ranks(ops, call):
    """The error names the call's first four messages (then "...") and the
    peer waited for."""
    comms = communicators(2, timeout=0.5)
    batch = [P2POp("send" if i % 2 == 0 else "recv", np.zeros(2), 0) for i in range(ops)]
    found = []
    thread = threading.Thread(target=lambda: found.append(
        pytest.raises(errors.CollectiveTimeoutError, comms[1].batch_send_recv, batch)
        if ops > 1 else pytest.raises(errors.CollectiveTimeoutError, comms[1].send,
                                      np.zeros(2), 0)))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    text = str(found[0].value)
    assert "after collective #0 (%s) did not complete before its deadline: waiting for rank 0" \
        % call in text, text
    assert list(found[0].value.culprits) == [0]


def test_single_process_calls():
    comm = commlib.Communicator.single(timeout=0.5)
    a, b = np.arange(4.0), np.zeros(4)
    comm.batch_send_recv([P2POp("send", a, 0), P2POp("recv", b, 0)])
    assert (b == a).all()
    assert (comm.scatter([a], 0) == a).all() and (comm.gather(a, 0)[0] == a).all()
    assert comm.all_to_allv(a, [4])[1].tolist() == [4]
    assert comm.broadcast_object([1], 0) == [1] and comm.all_gather_object(2) == [2]
    assert comm.split(None) is None and comm.split(3).size == 1
    with pytest.raises(errors.CollectiveTimeoutError, match="send to rank 0"):
        comm.send(a, 0)
