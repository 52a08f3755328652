"""Where the ranks of a communicator stand, and whether they live, when they
share no memory (several nodes): a copy of the status board in each rank's
own memory, kept up to date over a TCP connection between every two ranks.

Why TCP connections of commlib's own rather than MPI's: MPICH over TCP
(ch4, ofi or ucx) does not report a peer whose process ended as an error of
the requests that wait for it (they stay pending until the deadline) and
may not report it at all; a TCP connection of the peer's own process is
closed by the peer's kernel when the process ends however it ends
(``os._exit``, a signal, a crash), so the other end reads its end within
milliseconds. Kernel keep-alives (:data:`KEEPALIVE`) cover a node that
disappears without closing anything.

Each rank writes its line of the board (:mod:`commlib.faults.board`: what
it entered, whether and why it left, whom it blamed, when it last looked
while waiting) into its copy as the shared-memory board does, and
:meth:`PeerWatch.publish` sends the line to every peer, which writes it
into its copy (a thread of each rank reads the connections as data
arrives). A line goes out when the rank leaves, and while it waits in a
collective, every :data:`BEAT_S` seconds at most (its heartbeat, see
:meth:`ExchangeBoard.check_waiting
<commlib.faults.board_exchange.ExchangeBoard.check_waiting>`): a
collective that completes within milliseconds sends nothing. So every method of :class:`~commlib.faults.board.StatusBoard`
that reads the other ranks' lines works across nodes; times in a received
line are moved onto the receiver's clock (the frame says when it was
sent), and process ids are cleared (they mean nothing on another node; a
rank's death is its connection ending, :meth:`PeerWatch.dead`).

A connection that ends after the peer's goodbye (:meth:`PeerWatch.close`,
when its communicator is released) is a rank that left; one that ends
without it is a rank that died.

Setting up (:meth:`PeerWatch.start`) is collective: every rank listens on a
port of its own, the ranks all-gather their addresses (every IPv4 address
of every interface, loopback last) over the communicator's transport, each
rank connects to every lower rank and proves with that rank's random token
that it belongs to the job. A rank that cannot reach a peer within
:data:`SETUP_S` says so on stderr, and every rank then goes on without a
watch (the consistency check alone, as before), all alike.
"""
import fcntl
import json
import os
import queue
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
import weakref

import numpy as np

from ..errors import ranks_text
from .board import ENTERED, GONE, LINE_BYTES, PID, SEEN, SLOT, SLOT_WORDS, STRIDE

#: seconds the set-up may take (connecting to every peer)
SETUP_S = 30.0
#: seconds one connection attempt to one address may take
CONNECT_S = 5.0
#: the shortest time between two heartbeats of a waiting rank (seconds)
BEAT_S = 0.05
#: TCP keep-alive: idle seconds, seconds between probes, probes
KEEPALIVE = (5, 1, 5)
CARD_BYTES = 1024
_TOKEN = 16
_HELLO = struct.Struct("=16sq")          # the token of the rank connected to, own rank
_ACK = b"commlib."
_HEAD = struct.Struct("=qq")             # kind, time sent (ns, sender's monotonic clock)
LINE, BYE = 1, 2
FRAME_BYTES = _HEAD.size + LINE_BYTES
_SIOCGIFADDR = 0x8915
#: the words of a line holding times (``time.monotonic_ns()`` of their writer)
_CLOCK_WORDS = (SEEN, SLOT + 3, SLOT + SLOT_WORDS + 3)


#: the watches of this process, for a child made by fork (see _drop_in_child)
_WATCHES = weakref.WeakSet()


def _after_fork_in_child():
    for watch in list(_WATCHES):
        watch._drop_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def addresses():
    """This machine's IPv4 addresses, one per interface that has one,
    loopback last."""
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue            # no IPv4 address
            found.append(socket.inet_ntoa(raw[20:24]))
    finally:
        probe.close()
    found = sorted(set(found), key=lambda a: (a.startswith("127."), found.index(a)))
    return found or ["127.0.0.1"]


def _keepalive(sock):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, every, count = KEEPALIVE
    for option, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", every),
                          ("TCP_KEEPCNT", count)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class SetupFailed(Exception):
    """This rank could not connect to a peer (the text says which, and why)."""


class PeerWatch:
    """The connections of rank ``rank`` of ``size`` to its peers, and the
    thread that writes what they send into ``memory`` (the uint8 numpy
    array under the board's lines: ``size * LINE_BYTES`` bytes). Made by
    :meth:`start`."""

    def __init__(self, rank, size, memory, on_death=None):
        self.rank, self.size = rank, size
        self.lines = memory.view(np.int64).reshape(size, STRIDE)
        self.on_death = on_death
        self.token = secrets.token_bytes(_TOKEN)
        self.cards = [None] * size
        self._socks = {}                   # peer -> connected socket
        self._bye = set()                  # peers that said goodbye
        self._dead = {}                    # peer -> why its connection ended
        self._partial = {}                 # peer -> bytes of a frame not sent yet
        self._latest = {}                  # peer -> the newest frame, waiting behind it
        self._lock = threading.Lock()
        self._new = queue.Queue()          # sockets for the thread to watch
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._beat = 0.0
        self._thread = None
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("0.0.0.0", 0))
        self.listener.listen(max(8, size))
        _WATCHES.add(self)

    def _drop_in_child(self):
        """In a child made by fork: close this process's copies of the
        sockets (without a goodbye or a shutdown, which would end the
        parent's connections), so that the parent's death still ends its
        connections (the child has no thread to read them)."""
        self._stop, self._thread = True, None
        for sock in list(self._socks.values()) + [self.listener, self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
        self._socks = {}

    # -- setting up ------------------------------------------------------------------------
    @classmethod
    def start(cls, rank, size, memory, all_gather, on_death=None, setup_s=None):
        """Connect rank ``rank`` to every other rank (collective);
        ``all_gather(mine, out)`` gathers a uint8 numpy array of every
        rank (a transport's, bounded). Returns the watch, or None on every
        rank when any rank could not connect (it printed why). ``setup_s``:
        seconds the connecting may take (default :data:`SETUP_S`)."""
        setup_s = SETUP_S if setup_s is None else setup_s
        watch = cls(rank, size, memory, on_death)
        try:
            card = json.dumps({"addresses": addresses(), "port": watch.listener.getsockname()[1],
                               "token": watch.token.hex(), "host": socket.gethostname(),
                               "pid": os.getpid()}).encode()[:CARD_BYTES]
            mine = np.zeros(CARD_BYTES, np.uint8)
            mine[:len(card)] = np.frombuffer(card, np.uint8)
            out = np.zeros(size * CARD_BYTES, np.uint8)
            all_gather(mine, out)
            for r in range(size):
                raw = bytes(out[r * CARD_BYTES:(r + 1) * CARD_BYTES]).rstrip(b"\0")
                watch.cards[r] = json.loads(raw.decode())
            failure = None
            watch._thread = threading.Thread(target=watch._run, daemon=True,
                                             name="commlib-peer-watch-rank%d" % rank)
            watch._thread.start()
            try:
                watch._connect(time.monotonic() + setup_s)
            except SetupFailed as exc:
                failure = str(exc)
            ok = np.array([failure is None], np.uint8)
            everyone = np.zeros(size, np.uint8)
            all_gather(ok, everyone)
        except BaseException:
            watch.close(goodbye=False)
            raise
        if failure is not None:
            print("commlib: rank %d: %s; the ranks go on without watching each other (a "
                  "rank that dies or stalls is noticed only at the deadline)"
                  % (rank, failure), file=sys.stderr, flush=True)
        if not everyone.all():
            watch.close(goodbye=False)
            return None
        return watch

    def _connect(self, deadline):
        """Connect to every lower rank; wait until every higher rank has
        connected here (the thread accepts them)."""
        for peer in range(self.rank):
            sock = self._dial(peer, deadline)
            with self._lock:
                self._socks[peer] = sock
            self._new.put((peer, sock))
            self._wake()
        while True:
            with self._lock:
                missing = [p for p in range(self.rank + 1, self.size) if p not in self._socks]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise SetupFailed("no connection from %s in time" % ranks_text(missing))
            time.sleep(0.005)

    def _dial(self, peer, deadline):
        card, why = self.cards[peer], []
        for address in card["addresses"]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.settimeout(min(CONNECT_S, left))
                sock.connect((address, card["port"]))
                sock.sendall(_HELLO.pack(bytes.fromhex(card["token"]), self.rank))
                got = b""
                while len(got) < len(_ACK):
                    more = sock.recv(len(_ACK) - len(got))
                    if not more:
                        raise ConnectionError("closed before answering")
                    got += more
                if got != _ACK:
                    raise ConnectionError("not a peer of this job")
            except OSError as exc:
                sock.close()
                why.append("%s:%d: %s" % (address, card["port"], exc))
                continue
            _keepalive(sock)
            sock.setblocking(False)
            return sock
        raise SetupFailed("could not connect to rank %d (%s, pid %d): %s"
                          % (peer, card["host"], card["pid"], "; ".join(why) or "no time left"))

    # -- the thread ------------------------------------------------------------------------
    def _wake(self):
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _run(self):
        sel = self._sel
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ, ("accept", None, None))
        sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None, None))
        while not self._stop:
            for key, _ in sel.select(BEAT_S):
                kind, peer, buf = key.data
                try:
                    if kind == "accept":
                        self._accept()
                    elif kind == "wake":
                        self._wake_r.recv(4096)
                    elif kind == "hello":
                        self._hello(key.fileobj, buf)
                    else:
                        self._receive(key.fileobj, peer, buf)
                except OSError:
                    pass
                except Exception as exc:       # a bug: say so, keep watching
                    print("commlib: rank %d: the peer watch: %s: %s"
                          % (self.rank, type(exc).__name__, exc), file=sys.stderr, flush=True)
            while not self._new.empty():
                peer, sock = self._new.get()
                sel.register(sock, selectors.EVENT_READ, ("frames", peer, bytearray()))
            self._flush()

    def _accept(self):
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, ("hello", None, bytearray()))

    def _hello(self, sock, buf):
        data = sock.recv(_HELLO.size - len(buf))
        buf += data
        if data and len(buf) < _HELLO.size:
            return
        self._sel.unregister(sock)
        token, peer = _HELLO.unpack(bytes(buf)) if len(buf) == _HELLO.size else (b"", -1)
        with self._lock:
            known = peer in self._socks
        if token != self.token or not self.rank < peer < self.size or known:
            sock.close()            # not a rank of this job
            return
        sock.setblocking(True)
        sock.sendall(_ACK)
        _keepalive(sock)
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, ("frames", peer, bytearray()))
        with self._lock:
            self._socks[peer] = sock

    def _receive(self, sock, peer, buf):
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            data, why = b"", str(exc)
        else:
            why = "its connection was closed"
        if not data:
            self._ended(sock, peer, why)
            return
        buf += data
        whole = len(buf) // FRAME_BYTES * FRAME_BYTES
        for at in range(0, whole, FRAME_BYTES):
            self._apply(peer, buf[at:at + FRAME_BYTES])
        del buf[:whole]

    def _apply(self, peer, frame):
        kind, sent = _HEAD.unpack_from(frame)
        if kind == BYE:
            self._bye.add(peer)
            return
        line = np.frombuffer(frame, np.int64, STRIDE, _HEAD.size).copy()
        shift = time.monotonic_ns() - sent       # onto this rank's clock
        for word in _CLOCK_WORDS:
            if line[word]:
                line[word] += shift
        line[PID] = 0
        mirror = self.lines[peer]
        # what it entered only grows (the copy may know more: see
        # ExchangeBoard._entered); once gone, gone
        entered, gone = max(line[ENTERED], mirror[ENTERED]), line[GONE] or mirror[GONE]
        line[ENTERED], line[GONE] = mirror[ENTERED], mirror[GONE]
        mirror[:] = line                   # the rest first, then what it entered, then
        mirror[ENTERED] = entered          # whether it left, as the shared board's order
        mirror[GONE] = gone

    def _ended(self, sock, peer, why):
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        with self._lock:
            self._socks.pop(peer, None)
            if peer in self._bye or self._stop:
                return
            self._dead[peer] = why
        if self.on_death is not None:
            try:
                self.on_death(peer)
            except Exception as exc:            # never end the thread
                print("commlib: rank %d: %s" % (self.rank, exc), file=sys.stderr, flush=True)

    # -- sending ---------------------------------------------------------------------------
    def publish(self, kind=LINE):
        """Send this rank's line (``kind=LINE``) or goodbye (``BYE``) to
        every peer; never blocks: a peer that does not read gets the newest
        line once it does (a line replaces the lines before it)."""
        frame = _HEAD.pack(kind, time.monotonic_ns()) + self.lines[self.rank].tobytes()
        self._beat = time.monotonic()
        with self._lock:
            for peer in self._socks:
                if self._partial.get(peer):
                    self._latest[peer] = frame
                else:
                    self._partial[peer] = frame
            self._flush_locked()

    def beat(self):
        """Publish this rank's line unless it was sent in the last
        :data:`BEAT_S` seconds (a waiting rank's heartbeat)."""
        if time.monotonic() - self._beat >= BEAT_S:
            self.publish()

    def _flush(self):
        with self._lock:
            self._flush_locked()

    def _flush_locked(self):
        for peer, sock in self._socks.items():
            while self._partial.get(peer):
                data = self._partial[peer]
                try:
                    sent = sock.send(data)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    self._partial.pop(peer, None)
                    self._latest.pop(peer, None)
                    break
                self._partial[peer] = data[sent:]
                if not self._partial[peer]:
                    self._partial[peer] = self._latest.pop(peer, b"")

    # -- what it knows ---------------------------------------------------------------------
    def dead(self, peer):
        """Whether ``peer``'s connection ended without its goodbye."""
        return peer in self._dead

    def anyone_dead(self):
        """Whether any peer's connection ended without its goodbye."""
        return bool(self._dead)

    def who(self, peer, name=None):
        """``rank 2 (pid 4242 on node1)``; ``name`` in place of ``rank 2``."""
        card = self.cards[peer]
        return "%s (pid %d on %s)" % (name or "rank %d" % peer, card["pid"], card["host"])

    def close(self, goodbye=True):
        """Say goodbye to every peer (``goodbye``), stop the thread and close
        the connections; waits at most a second."""
        if goodbye and self._thread is not None:
            self.publish(BYE)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                with self._lock:
                    if not any(self._partial.values()):
                        break
                time.sleep(0.005)
        self._stop = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)
        with self._lock:
            socks = list(self._socks.values())
            self._socks.clear()
        for sock in socks + [self.listener, self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
        try:
            self._sel.close()
        except (OSError, RuntimeError):
            pass
