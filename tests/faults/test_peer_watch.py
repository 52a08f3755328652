"""The board of ranks that share no memory (commlib.faults.board_exchange,
commlib.faults.peer_watch), three ranks as threads of this process over
the thread transport: each rank's line reaches the others' copies over its
TCP connections, a rank whose connections end without a goodbye is named
dead (each rank in turn, rank 0 too), one that said goodbye is not, a
connection without the job's token is refused, and when one rank cannot
connect every rank goes on without the copies. The jobs across real nodes
are in tests/transport/test_nodes.py."""
import os
import socket
import threading
import time

import numpy as np
import pytest

from commlib.core.fingerprints import CODES
from commlib.core.waiting import Wait, until
from commlib.errors import CollectiveTimeoutError, PeerError
from commlib.faults import board, peer_watch
from commlib.faults.board_exchange import ExchangeBoard
from commlib.transport.threads import ThreadGroup, ThreadTransport

N = 3
ALL_REDUCE = CODES["all_reduce"]
BOUND_S = 10.0          # the longest a line may take to arrive (a busy machine)


def boards(size=N, **kwargs):
    """``size`` ExchangeBoards over one ThreadGroup, made at once (making
    them is collective)."""
    group = ThreadGroup(size)
    made, errors = [None] * size, []

    def make(rank):
        try:
            made[rank] = ExchangeBoard(ThreadTransport(group, rank), rank, size, **kwargs)
        except BaseException as exc:        # reported below
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and all(b is not None for b in made), (errors, made)
    return made


def close_all(made):
    for b in made:
        b.close_watch()


def eventually(look, what):
    """Wait (bounded) until ``look()`` is true."""
    end = time.monotonic() + BOUND_S
    while not look():
        assert time.monotonic() < end, "not within %s s: %s" % (BOUND_S, what)
        time.sleep(0.002)


def test_a_line_reaches_every_copy_on_the_receivers_clock():
    made = boards()
    try:
        rank1 = made[1]
        rank1.arrive(7)
        assert made[0].not_arrived(7) == [0, 1, 2]      # nothing sent yet
        waiting = Wait(None, 7, ALL_REDUCE, rank1, 1)
        for r in (0, 2):           # its wait's checks send heartbeats
            eventually(lambda: rank1.check_waiting(waiting) or
                       made[r].not_arrived(7) == [0, 2], "rank 1 entered #7, seen by %d" % r)
            assert made[r].late_for(7) == [0, 2]
        # entered with a fingerprint: what and when, on rank 0's clock
        at = board.SLOT + (8 & 1) * board.SLOT_WORDS
        rank1._mine[at:at + 4] = (1, 2, ALL_REDUCE, time.monotonic_ns())
        rank1.arrive(8)
        # a heartbeat while waiting: seen; silence: stalled after STALE_S
        waiting = Wait(None, 8, ALL_REDUCE, rank1, 1)
        eventually(lambda: rank1.check_waiting(waiting) or
                   made[0].state_of(1).startswith("last entered all_reduce #8"), "the heartbeat")
        state = made[0].state_of(1)
        assert state.startswith("last entered all_reduce #8 0.") and \
            ", last seen waiting in it 0." in state, state
        eventually(lambda: made[0].stalled(8) == [1], "rank 1 stalled")
        # leaving: the reason, the text and the blame travel
        rank1.leave(7, board.GAVE_UP, "all_reduce #8: gave up", blame=(2,))
        for r in (0, 2):
            eventually(lambda: made[r].state_of(1).startswith("gave up in collective #8"),
                       "rank 1 gave up, seen by %d" % r)
        with pytest.raises(PeerError) as got:
            made[0].check_peers(8, ALL_REDUCE)
        assert got.value.culprits == (2,), got.value     # the blame passes on
        assert str(got.value).startswith("rank 0: rank 1 gave up in collective #8 "
                                         "(all_reduce #8: gave up)"), got.value
    finally:
        close_all(made)


@pytest.mark.parametrize("dead", range(N))
def test_a_rank_whose_connections_end_without_a_goodbye_is_named_dead(dead):
    made = boards()
    try:
        gone = made[dead]
        gone.watch.close(goodbye=False)        # as the kernel does when a process ends
        for r in range(N):
            if r == dead:
                continue
            wait = Wait(time.monotonic() + BOUND_S, 3, ALL_REDUCE, made[r], r)
            start = time.monotonic()
            with pytest.raises(PeerError) as got:
                until(lambda _: None, wait)
            assert got.value.culprits == (dead,), got.value
            assert str(got.value) == (
                "rank %d: rank %d (pid %d on %s) died while this rank waits in all_reduce #3"
                % (r, dead, os.getpid(), socket.gethostname())), got.value
            assert time.monotonic() - start < BOUND_S
    finally:
        close_all(made)


def test_a_rank_that_said_goodbye_is_not_dead():
    made = boards()
    try:
        made[2].leave(4, board.CLOSED)
        made[2].close_watch()
        for r in (0, 1):
            eventually(lambda: 2 not in made[r].watch._socks, "rank 2's connection ends")
            assert not made[r].died(2)
            assert made[r].state_of(2) == "closed the communicator after collective #4"
    finally:
        close_all(made)


def test_closing_waits_for_every_rank():
    made = boards()
    try:
        for b in made[:2]:
            b.leave(4, board.CLOSED)
        done = []
        waiters = [threading.Thread(target=lambda b=b: done.append(b.wait_left(4, None)))
                   for b in made[:2]]
        for t in waiters:
            t.start()
        made[2].leave(4, board.CLOSED)
        made[2].wait_left(4, time.monotonic() + BOUND_S)
        for t in waiters:
            t.join(BOUND_S)
        assert done == [None, None]
        assert [b.watch for b in made] == [None] * N       # closed after closing
    finally:
        close_all(made)


def test_closing_without_the_others_times_out_naming_them():
    made = boards()
    try:
        made[0].leave(2, board.CLOSED)
        with pytest.raises(CollectiveTimeoutError) as got:
            made[0].wait_left(2, time.monotonic() + 0.3)
        assert got.value.culprits == (1, 2), got.value
    finally:
        close_all(made)


def test_a_connection_without_the_jobs_token_is_refused():
    """Rank 0's watch, its thread running, before rank 1 connected: a hello
    with another token is closed unanswered, rank 1's own is answered."""
    watch = peer_watch.PeerWatch(0, 2, np.zeros(2 * board.LINE_BYTES, np.uint8))
    watch._thread = threading.Thread(target=watch._run, daemon=True)
    watch._thread.start()
    port = watch.listener.getsockname()[1]
    try:
        for token, answer in ((bytes(16), b""), (watch.token, b"commlib.")):
            sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
            sock.sendall(peer_watch._HELLO.pack(token, 1))
            got = b""
            while len(got) < 8:
                more = sock.recv(8 - len(got))
                if not more:
                    break
                got += more
            assert got == answer, (token, got)
            sock.close()
    finally:
        watch.close(goodbye=False)


def test_a_rank_that_cannot_connect_makes_every_rank_go_without(monkeypatch, capfd):
    dial = peer_watch.PeerWatch._dial

    def refuse(self, peer, deadline):
        if self.rank == 2:
            raise peer_watch.SetupFailed("could not connect to rank %d (planted)" % peer)
        return dial(self, peer, deadline)

    monkeypatch.setattr(peer_watch.PeerWatch, "_dial", refuse)
    monkeypatch.setattr(peer_watch, "SETUP_S", 1.0)    # the others wait for rank 2 that long
    made = boards()
    assert [b.watch for b in made] == [None] * N
    err = capfd.readouterr().err
    assert "commlib: rank 2: could not connect to rank 0 (planted); the ranks go on without " \
           "watching each other" in err, err
    # the deadline names nobody then
    assert made[0].late_for(1) == [] and made[0].not_arrived(1) == []
    text = made[0].timeout_text(1, ALL_REDUCE, None)
    assert "not known across nodes" in text, text
    np.testing.assert_array_equal(made[0]._lines[1], 0)


@pytest.mark.parametrize("short", [0, 2])
def test_ranks_that_find_a_peer_closed_as_they_enter_settle_at_once(short):
    """Rank ``short`` closes after collective #4 while the others enter #5
    and, finding it gone before any heartbeat of theirs went out, settle
    the counts at the same moment: each publishes its own first, so both
    blame ``short`` alone at once (not each itself with it after
    SETTLE_S, for want of the other's count)."""
    made = boards()
    try:
        made[short].arrive(4)
        made[short].leave(4, board.CLOSED)
        others = [r for r in range(N) if r != short]
        for r in others:
            made[r].arrive(5)                 # entered #5: not sent yet
            eventually(lambda: made[r].state_of(short).startswith("closed the communicator"),
                       "rank %d closed, seen by %d" % (short, r))
        got, start = {}, time.monotonic()

        def settle(r):
            try:
                made[r].check_peers(5, ALL_REDUCE)
            except PeerError as exc:
                got[r] = (exc, time.monotonic() - start)

        threads = [threading.Thread(target=settle, args=(r,)) for r in others]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S + board.SETTLE_S)
        assert sorted(got) == others, got
        for r, (exc, seconds) in got.items():
            assert exc.culprits == (short,), (r, exc)
            assert "uneven number of steps: rank %d entered 4 collectives" % short in str(exc), exc
            assert seconds < board.SETTLE_S, (r, seconds)
    finally:
        close_all(made)


def test_addresses_are_this_machines_ipv4_ones_loopback_last():
    """Against ``ip -4 -o addr``: the (first) address of every interface
    that has one, once, the loopback ones last."""
    import shutil
    import subprocess
    if shutil.which("ip") is None:
        pytest.skip("no ip command to list the interfaces' addresses")
    listed = subprocess.run(["ip", "-4", "-o", "addr", "show"], stdout=subprocess.PIPE,
                            text=True, timeout=30, check=True).stdout.split("\n")
    first = {}
    for line in listed:
        if " inet " in line:
            words = line.split()
            first.setdefault(words[1], words[3].split("/")[0])
    want = set(first.values())
    found = peer_watch.addresses()
    assert sorted(found) == sorted(want) and len(found) == len(set(found))
    loopback = [a.startswith("127.") for a in found]
    assert loopback == sorted(loopback), found


def test_connections_keep_alive_without_delay():
    """The TCP options of the copies' connections: keep-alive probes after
    KEEPALIVE's idle seconds, every so many seconds, so many times; no
    Nagle delay."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        peer_watch._keepalive(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"),
                                 peer_watch.KEEPALIVE):
            if hasattr(socket, option):
                assert sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, option)) == value
    finally:
        sock.close()


def test_a_slots_digest_arrives_as_written_and_its_time_on_the_receivers_clock():
    """Of a line's words, only the times move onto the receiver's clock
    (later than the sender's: the transit is in it); the digests and the
    collective's code arrive as written."""
    made = boards()
    try:
        rank1 = made[1]
        at = board.SLOT + board.SLOT_WORDS          # the slot of odd collectives
        written = time.monotonic_ns()
        rank1._mine[at:at + 4] = (111, 222, ALL_REDUCE, written)
        rank1.arrive(9)
        waiting = Wait(None, 9, ALL_REDUCE, rank1, 1)
        for r in (0, 2):
            eventually(lambda: rank1.check_waiting(waiting) or
                       made[r].not_arrived(9) == [0, 2], "rank 1 entered #9, seen by %d" % r)
            copy = made[r]._lines[1]
            assert (int(copy[at]), int(copy[at + 1]), int(copy[at + 2])) == (111, 222, ALL_REDUCE)
            assert int(copy[at + 3]) > written, (r, int(copy[at + 3]) - written)
    finally:
        close_all(made)
