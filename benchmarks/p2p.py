"""Point-to-point, all-to-all, scatter and gather: commlib beside mpi4py.

    mpiexec -n 2 python benchmarks/p2p.py [--calls ...] [--sizes ...] [--json out.json]
    mpiexec -n 4 python benchmarks/p2p.py --calls all_to_all

Every case is timed two ways in the same run, interleaved repeat by repeat
(round-robin): ``commlib`` (the Communicator's call, default settings: the
consistency check and the watch dog on) and ``mpi4py`` (the same call on
the buffer interface: ``Send``/``Recv``, ``Alltoall``, ``Scatter``,
``Gather``). A sample is one call after a barrier, the slowest rank's time;
the table gives the median of the repeats. ``copy ms`` is the memory-copy
bound: one copy of the case's bytes in this rank's memory (``dst[...] =
src``, timed the same way), what any transport within a node pays at least
once. See benchmarks/README.md.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # prefer the checkout's commlib
import commlib  # noqa: E402
from allreduce import human, parse_bytes, table  # noqa: E402

CALLS = ("send_recv", "all_to_all", "scatter", "gather")
#: default sizes: send/recv 4 KiB ... 64 MiB, the others 1 ... 64 MiB (powers of 4)
DEFAULT_SIZES = {"send_recv": [4 * 2**10 * 4**k for k in range(8)]}
DEFAULT_SIZES.update({c: [2**20 * 4**k for k in range(4)] for c in CALLS[1:]})
DTYPE = np.float32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", default=",".join(CALLS),
                   help="comma list of: %s (default: all)" % ", ".join(CALLS))
    p.add_argument("--sizes", default=None,
                   help="comma list of bytes per case, e.g. 4K,1M,64MiB (default: 4 KiB to "
                        "64 MiB for send_recv, 1 to 64 MiB for the others, powers of 4)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per case (default: 20 below 16 MiB, else 7)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls per method first (>= 1; the last one is checked)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="numpy arrays (commlib over shared memory / MPI), or cupy arrays "
                        "(commlib over NCCL; mpi4py only where MPI is CUDA-aware)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.calls = [c for c in args.calls.split(",") if c]
    unknown = set(args.calls) - set(CALLS)
    if unknown:
        p.error("unknown call(s): %s" % ", ".join(sorted(unknown)))
    args.sizes = [parse_bytes(s) for s in args.sizes.split(",")] if args.sizes else None
    if args.warmup < 1 or (args.repeats is not None and args.repeats < 1):
        p.error("--warmup and --repeats must be >= 1")
    return args


class Context:
    def __init__(self, device):
        self.mpi = MPI.COMM_WORLD.Dup()
        self.rank, self.size = self.mpi.rank, self.mpi.size
        self.comm = commlib.Communicator.from_mpi(backend="mpi" if device == "cpu" else None)
        self.xp = np
        if device == "gpu":
            import cupy
            cupy.cuda.Device(self.comm.device).use()
            self.xp = cupy
        query = getattr(MPI, "Query_cuda_support", lambda: False)
        self.baselines = device == "cpu" or bool(query())

    def sync(self):
        if self.xp is not np:
            self.xp.cuda.Device().synchronize()

    def close(self):
        self.comm.close()
        self.mpi.Free()


def methods(ctx, call, nbytes):
    """({method: zero-argument call}, check, buffer): the commlib and
    mpi4py calls of one case on fresh buffers, and ``check(method)``:
    whether that method's last call left the right result on this rank."""
    xp, comm, mpi, r, n = ctx.xp, ctx.comm, ctx.mpi, ctx.rank, ctx.size
    count = nbytes // DTYPE().itemsize
    found = {}
    if call == "send_recv":         # pairs (0, 1), (2, 3), ...: the even rank sends
        peer = r ^ 1 if (r ^ 1) < n else None
        src = xp.full(count, r + 1, DTYPE)
        dst = xp.zeros(count, DTYPE)
        sends = peer is not None and r % 2 == 0
        ours = (lambda: comm.send(src, peer)) if sends else (lambda: comm.recv(dst, peer))
        theirs = (lambda: mpi.Send(src, dest=peer)) if sends else \
            (lambda: mpi.Recv(dst, source=peer))
        if peer is None:
            ours = theirs = (lambda: None)
        found.update(commlib=ours, mpi4py=theirs)
        return found, lambda m: peer is None or sends or bool((dst == peer + 1).all()), dst
    block = count // n
    if call == "all_to_all":
        src = xp.empty(block * n, DTYPE)
        for q in range(n):
            src[q * block:(q + 1) * block] = r * n + q
        dst = xp.zeros(block * n, DTYPE)
        found.update(commlib=lambda: comm.all_to_all(src, dst),
                     mpi4py=lambda: mpi.Alltoall(src, dst))
        want = np.repeat(np.arange(n, dtype=DTYPE) * n + r, block)
        return found, lambda m: bool((dst == xp.asarray(want)).all()), dst
    if call == "scatter":
        src = xp.repeat(xp.arange(n, dtype=DTYPE), block) if r == 0 else None
        blocks = [src[q * block:(q + 1) * block] for q in range(n)] if r == 0 else None
        dst = xp.zeros(block, DTYPE)
        out = [dst]

        def ours():
            out[0] = comm.scatter(blocks, root=0)
        found.update(commlib=ours, mpi4py=lambda: mpi.Scatter(src, dst, root=0))
        return found, lambda m: bool(((out[0] if m == "commlib" else dst) == r).all()), dst
    src = xp.full(block, r, DTYPE)                     # gather
    dst = xp.zeros(block * n, DTYPE) if r == 0 else None
    out = [dst]

    def ours():
        out[0] = comm.gather(src, root=0)
    found.update(commlib=ours, mpi4py=lambda: mpi.Gather(src, dst, root=0))
    want = np.repeat(np.arange(n, dtype=DTYPE), block)
    return found, lambda m: r != 0 or bool(
        ((out[0] if m == "commlib" else dst).reshape(-1) == xp.asarray(want)).all()), src


def timed(ctx, call):
    """One call after a barrier: seconds, the slowest rank's."""
    ctx.sync()
    ctx.mpi.Barrier()
    start = time.perf_counter()
    call()
    ctx.sync()
    return ctx.mpi.allreduce(time.perf_counter() - start, op=MPI.MAX)


def run_case(ctx, call, nbytes, repeats, warmup):
    """Warm up and check both methods, then time them round-robin (and the
    memory-copy bound beside them)."""
    found, check, _ = methods(ctx, call, nbytes)
    if not ctx.baselines:
        del found["mpi4py"]
    failed = []
    for method, run in found.items():
        for _ in range(warmup):
            timed(ctx, run)
        ok = check(method)
        if not ctx.mpi.allreduce(ok, op=MPI.LAND):
            failed.append(method)
    copy_src = ctx.xp.ones(nbytes // DTYPE().itemsize, DTYPE)
    copy_dst = ctx.xp.empty_like(copy_src)

    def copy():
        copy_dst[...] = copy_src
    found["copy"] = copy
    order = list(found)
    samples = {m: [] for m in order}
    for k in range(repeats):
        for method in order[k % len(order):] + order[:k % len(order)]:
            samples[method].append(timed(ctx, found[method]))
    median = {m: statistics.median(s) for m, s in samples.items()}
    row = {"call": call, "ranks": ctx.size, "bytes": nbytes, "repeats": repeats,
           "check": "FAIL:" + "+".join(failed) if failed else "ok",
           "samples_ms": {m: [t * 1e3 for t in s] for m, s in samples.items()}}
    row["commlib_ms"] = median["commlib"] * 1e3
    row["mpi4py_ms"] = median["mpi4py"] * 1e3 if "mpi4py" in median else None
    row["copy_ms"] = median["copy"] * 1e3
    row["gbs"] = nbytes / median["commlib"] / 1e9
    row["ratio"] = median["commlib"] / median["mpi4py"] if "mpi4py" in median else None
    return row


COLUMNS = [("call", "call", "%s"), ("ranks", "ranks", "%d"), ("bytes", "bytes", "%d"),
           ("commlib_ms", "commlib ms", "%.4g"), ("mpi4py_ms", "mpi4py ms", "%.4g"),
           ("ratio", "commlib / mpi4py", "%.2f"), ("gbs", "commlib GB/s", "%.3g"),
           ("copy_ms", "copy ms", "%.4g"), ("check", "check", "%s")]


def main(argv=None):
    args = parse_args(argv)
    ctx = Context(args.device)
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    config = {"ranks": ctx.size, "backend": ctx.comm.backend, "device": args.device,
              "check": ctx.comm.check, "timeout": ctx.comm.timeout, "warmup": args.warmup,
              "dtype": np.dtype(DTYPE).name}
    say("# point-to-point and all-to-all, %(ranks)d ranks, backend %(backend)s, device "
        "%(device)s, consistency check %(check)s, watch dog %(timeout)s s, %(dtype)s" % config)
    say("# time per call: the slowest rank's, median of the repeats (round-robin); bytes: "
        "the message (send_recv), each rank's send buffer (all_to_all), the root's buffer "
        "(scatter, gather); GB/s = 1e9 bytes/s; copy ms: one copy of the bytes in memory",
        flush=True)
    rows, notes = [], []
    if not ctx.baselines:
        notes.append("mpi4py skipped: MPI is not CUDA-aware")
    for call in args.calls:
        for nbytes in args.sizes or DEFAULT_SIZES[call]:
            nbytes -= nbytes % (DTYPE().itemsize * ctx.size)
            repeats = args.repeats or (20 if nbytes < 16 * 2**20 else 7)
            rows.append(run_case(ctx, call, nbytes, repeats, args.warmup))
            if rows[-1]["check"] != "ok":
                notes.append("%s %s: wrong result (%s)" % (call, human(nbytes),
                                                            rows[-1]["check"]))
    say(table(rows, COLUMNS))
    for note in notes:
        say("note: " + note)
    if ctx.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"config": config, "notes": notes,
                                               "results": rows}, indent=1))
    ctx.close()
    return 1 if any(row["check"] != "ok" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
