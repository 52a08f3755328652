"""Run a command whose MPI ranks talk over TCP through a rate-limited link.

    python benchmarks/shaped_link.py --rate 1gbit -- mpiexec -n 2 python benchmarks/x.py
    python benchmarks/shaped_link.py --rate 10gbit --check     # measure the link first

The command runs inside a private network namespace (``commlib-<pid>``)
whose loopback device is shaped with a token bucket (``tc qdisc ... tbf``),
with MPICH kept off shared memory (``MPIR_CVAR_NOLOCAL=1``) and on its OFI
netmod with libfabric's TCP provider over ``lo``, and with commlib's own
shared-memory transport off (``COMMLIB_SHM=0``). The namespace is deleted
afterwards, also on errors, timeouts and Ctrl-C. Needs root (or
CAP_NET_ADMIN/CAP_SYS_ADMIN), ``ip`` and ``tc`` (Debian/Ubuntu: iproute2);
where they are missing it exits with status 2 and says why.

The rate is per rank: every byte between ranks passes lo's one queue, so
the bucket is given ``rate * ranks``, which is what ``ranks`` nodes with one
``rate`` link each carry when all of them send at once (ring all-reduce,
all-gather). A rank sending alone gets more than ``rate``. lo's MTU is set
to 9000 (a data-centre jumbo frame; ``--mtu 1500`` for the Ethernet
default); the bucket's burst is the larger of 64 KiB and 1 ms at the
bucket's rate. No propagation delay is added.

As a module: ``run_shaped(cmd, "1gbit")`` returns a :class:`ShapedRun`
(exit status, output, bytes lo carried, seconds); :func:`check_link`
measures a 64 MiB all-reduce through the link against the theoretical time.
"""
import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass

#: MPICH (PyPI wheel, ch4 with the ofi and ucx netmods) and libfabric settings
#: that send everything between the ranks over TCP through lo; commlib's
#: shared-memory transport off
TCP_ENV = {
    "MPIR_CVAR_NOLOCAL": "1",        # no shared memory between ranks of a node
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "lo",
    "COMMLIB_SHM": "0",
}
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
MiB = 1 << 20


class ShapedLinkUnavailable(RuntimeError):
    """This machine cannot make a shaped namespace (no root, no ip/tc, no tbf)."""


@dataclass
class ShapedRun:
    """What :func:`run_shaped` saw: the command's exit status, its output
    (None unless captured), the bytes lo carried and the wall seconds."""
    returncode: int
    stdout: str
    stderr: str
    lo_bytes: int
    seconds: float


def parse_rate(rate):
    """``rate`` ("10gbit", "500mbit", or bits/s as a number) in bits/s (int).
    tc's byte units ("bps", "mbps") are refused: they read as bits too easily."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        bits = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(rate).lower())
        if not m or m.group(2) not in _UNITS and m.group(2) != "":
            raise ValueError("rate %r: expected a number with bit, kbit, mbit, gbit or "
                             "tbit (bits per second, SI)" % (rate,))
        bits = float(m.group(1)) * _UNITS.get(m.group(2), 1)
    if not 1000 <= bits < 1e15:
        raise ValueError("rate %r: expected 1kbit to 1000tbit" % (rate,))
    return int(bits)


def _ip(*args, netns=None, check=True):
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise ShapedLinkUnavailable("`%s` failed (exit %d): %s"
                                    % (" ".join(cmd), proc.returncode, proc.stderr.strip()))
    return proc


def _lo_bytes(netns):
    """Bytes lo transmitted so far in ``netns``."""
    for line in _ip("cat", "/proc/net/dev", netns=netns).stdout.splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    return 0


def make_namespace(name, rate, ranks=2, mtu=9000):
    """Create namespace ``name`` with lo up (MTU ``mtu``) and shaped to
    ``rate * ranks`` bits/s; an empty namespace of that name left by a killed
    run is replaced. Raises ShapedLinkUnavailable with the reason."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ShapedLinkUnavailable("`%s` not found (install iproute2)" % tool)
    bucket = parse_rate(rate) * ranks
    burst = max(64 * 1024, bucket // 8 // 1000, mtu + 1024)
    _remove_leftover(name)
    _ip("ip", "netns", "add", name)
    try:
        _ip("ip", "link", "set", "lo", "mtu", str(mtu), "up", netns=name)
        _ip("tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "%dbit" % bucket,
            "burst", str(burst), "latency", "200ms", netns=name)
    except BaseException:
        delete_namespace(name)
        raise


def _remove_leftover(name):
    """Delete namespace ``name`` if a killed run left it behind: names carry
    the maker's pid, so one that exists with no process in it belongs to a
    dead process whose pid came round again. One with processes in it is
    refused (ShapedLinkUnavailable naming them), not taken over."""
    if not namespace_exists(name):
        return
    pids = _ip("ip", "netns", "pids", name).stdout.split()
    if pids:
        raise ShapedLinkUnavailable("namespace %s already exists and processes %s run in it"
                                    % (name, ", ".join(pids)))
    delete_namespace(name)


def delete_namespace(name):
    """Delete namespace ``name`` (no error if it is gone)."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def namespace_exists(name):
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return any(line.split()[0] == name for line in proc.stdout.splitlines() if line.split())


def run_shaped(cmd, rate, ranks=2, mtu=9000, env=None, timeout=None, capture=False):
    """Run ``cmd`` (a list) in a fresh namespace shaped to ``rate`` per rank
    (see the module docstring), with :data:`TCP_ENV` over ``env`` (default:
    this process's environment). ``timeout`` seconds (None: none) ends the
    command's whole process group; so does Ctrl-C. The namespace is always
    deleted. Returns a :class:`ShapedRun` (returncode -9 after a timeout).
    Raises ShapedLinkUnavailable where no namespace can be made."""
    name = "commlib-%d" % os.getpid()
    full_env = dict(os.environ if env is None else env)
    full_env.update(TCP_ENV)
    make_namespace(name, rate, ranks, mtu)
    proc = None
    try:
        before = _lo_bytes(name)
        pipe = subprocess.PIPE if capture else None
        start = time.perf_counter()
        with _interrupts_held():
            proc = subprocess.Popen(["ip", "netns", "exec", name] + [str(c) for c in cmd],
                                    env=full_env, stdout=pipe, stderr=pipe, text=True,
                                    start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            proc.returncode = -signal.SIGKILL
        elapsed = time.perf_counter() - start
        return ShapedRun(proc.returncode, out, err, _lo_bytes(name) - before, elapsed)
    finally:
        if proc is not None and proc.poll() is None:   # Ctrl-C or another error
            _kill_group(proc)
            proc.wait()
        delete_namespace(name)


_INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _interrupts_held():
    """Hold Ctrl-C and SIGTERM back in the body (which makes a child): one
    that arrived while the child was being made would leave it running,
    unknown to the cleanup and holding the caller's pipes. Held back, it
    acts (KeyboardInterrupt, or the handler the caller had) when the body is
    done, the child known.

    The signals are held by Python handlers that only note them, not by a
    signal mask: a mask holds them back from this thread alone, and the
    kernel then hands a process-directed signal to another thread, after
    which Python raises in this one anywhere. Only the main thread receives
    Python's signals, and only it can change handlers: elsewhere nothing is
    held, and nothing needs to be. Ignored signals stay ignored. The child
    gets the default handlers back at ``exec``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted = []
    previous = {}
    for sig in _INTERRUPTS:
        handler = signal.getsignal(sig)
        if handler not in (signal.SIG_IGN, None):
            previous[sig] = signal.signal(sig, lambda number, frame: noted.append(number))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(noted):           # each held signal acts once, in order
            signal.raise_signal(sig)


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_BANDWIDTH_PROGRAM = """
import sys, time
import numpy as np
from mpi4py import MPI
world = MPI.COMM_WORLD
a = np.ones(int(sys.argv[1]) // 4, np.float32)
b = np.empty_like(a)
best = float("inf")
for _ in range(int(sys.argv[2])):
    world.Barrier()
    t = time.perf_counter()
    world.Allreduce(a, b)
    best = min(best, world.allreduce(time.perf_counter() - t, op=MPI.MAX))
assert b[0] == world.size
if world.rank == 0:
    print("seconds", best)
"""


def check_link(rate, nbytes=64 * MiB, ranks=2, repeats=3, mtu=9000, timeout=120):
    """Time an ``nbytes`` float32 Allreduce at ``ranks`` ranks through a
    link shaped to ``rate``; returns (fastest seconds, theoretical seconds,
    bytes lo carried). Theory: a ring all-reduce sends ``2(n-1)/n * nbytes``
    from every rank, at ``rate`` each."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(_BANDWIDTH_PROGRAM))
    try:
        run = run_shaped([mpiexec, "-n", ranks, sys.executable, f.name, nbytes, repeats],
                         rate, ranks=ranks, mtu=mtu, timeout=timeout, capture=True)
    finally:
        os.unlink(f.name)
    if run.returncode:
        raise RuntimeError("bandwidth check failed (exit %d):\n%s%s"
                           % (run.returncode, run.stdout, run.stderr))
    measured = float(run.stdout.split("seconds")[1].split()[0])
    theory = 2 * (ranks - 1) / ranks * nbytes * 8 / parse_rate(rate)
    return measured, theory, run.lo_bytes


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --rate RATE [options] [--check] [-- command ...]")
    p.add_argument("--rate", required=True, help="per-rank link rate: 10gbit, 1gbit, 500mbit")
    p.add_argument("--ranks", type=int, default=2, help="ranks sharing lo (default 2)")
    p.add_argument("--mtu", type=int, default=9000, help="lo's MTU (default 9000)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the command is killed")
    p.add_argument("--check", action="store_true",
                   help="first time a 64 MiB all-reduce through the link against theory")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command and not args.check:
        p.error("give a command after -- (or --check)")
    try:
        parse_rate(args.rate)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.check:
            measured, theory, carried = check_link(args.rate, ranks=args.ranks, mtu=args.mtu)
            print("shaped_link: 64 MiB all-reduce at %d ranks, %s per rank: %.3f s "
                  "(theory %.3f s, %.2fx), lo carried %d bytes"
                  % (args.ranks, args.rate, measured, theory, measured / theory, carried),
                  file=sys.stderr)
        if not args.command:
            return 0
        run = run_shaped(args.command, args.rate, ranks=args.ranks, mtu=args.mtu,
                         timeout=args.timeout)
    except ShapedLinkUnavailable as e:
        print("shaped_link: cannot shape a link here: %s" % e, file=sys.stderr)
        return 2
    print("shaped_link: %s per rank, %d ranks: lo carried %d bytes in %.2f s"
          % (args.rate, args.ranks, run.lo_bytes, run.seconds), file=sys.stderr)
    return run.returncode if run.returncode >= 0 else 128 - run.returncode


if __name__ == "__main__":
    sys.exit(main())
