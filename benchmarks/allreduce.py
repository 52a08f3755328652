"""All-reduce benchmark: commlib against two hand-written mpi4py baselines.

    mpiexec -n 2 python benchmarks/allreduce.py [--cases ...] [--safety] [--json out.json]

Every case is timed three ways in the same run, interleaved repeat by repeat:
``commlib`` (``Communicator.all_reduce`` on the list, default settings),
``per-tensor`` (one ``Allreduce(IN_PLACE)`` per array) and ``flat`` (one
``Allreduce`` over a pre-packed buffer of the same total size; packing is not
timed, so this is the lower bound). ``--safety`` adds the same commlib call
with the consistency check off (``check=False``) and with the check and the
watch dog off (``timeout=math.inf`` too), and the cost of each in percent.
See benchmarks/README.md for how to read the table.
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # prefer the checkout's commlib
import commlib  # noqa: E402

WORKLOADS = HERE / "workloads"
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
DEFAULT_SIZES = [4 * 2**10 * 4**k for k in range(9)]  # 4 KiB ... 256 MiB
SMALL_CASE = "1000x256"
#: the same list allocated as consecutive views of one buffer (commlib.flat_arrays)
VIEWS_CASE = SMALL_CASE + "-views"
METHODS = ("commlib", "per-tensor", "flat", "no-check", "no-check-no-watchdog")
DTYPE = np.float32


def parse_bytes(text):
    """'4096', '4K', '16MiB', '1G' -> bytes (binary units)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text[-1] in "KMG" else ""
    return int(float(text[:len(text) - len(unit)]) * UNITS[unit])


def human(nbytes):
    """4096 -> '4KiB', 437928960 -> '417.6MiB'."""
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit]:
            return "%.4g%siB" % (nbytes / UNITS[unit], unit)
    return "%dB" % nbytes


def case_names():
    return ["flat", SMALL_CASE, VIEWS_CASE] + sorted(p.stem for p in WORKLOADS.glob("*.json"))


def case_bytes(shapes):
    return sum(int(np.prod(s)) for s in shapes) * DTYPE().itemsize


def build_cases(names, sizes):
    """[(case name, list of shapes)] for the requested case names."""
    cases = []
    for name in names:
        if name == "flat":
            cases += [("flat-" + human(s), [(s // DTYPE().itemsize,)]) for s in sizes]
        elif name in (SMALL_CASE, VIEWS_CASE):
            cases.append((name, [(256,)] * 1000))
        else:
            spec = json.loads((WORKLOADS / (name + ".json")).read_text())
            cases.append((name, [tuple(s) for s in spec["shapes"]]))
    return cases


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="flat,resnet50,bert_base," + SMALL_CASE,
                   help="comma list of: %s (default: %%(default)s)"
                        % ", ".join(case_names()))
    p.add_argument("--sizes", default=None,
                   help="comma list of flat buffer sizes, e.g. 4K,1M,64MiB "
                        "(default: 4 KiB to 256 MiB, powers of 4)")
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("512M"),
                   help="skip cases larger than this (default: 512MiB)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per case (default: 20 below 16 MiB, else 7)")
    p.add_argument("--calls", type=int, default=1,
                   help="back-to-back calls per timed sample; times are per call "
                        "(default 1)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls per method before timing (>= 1; the last "
                        "one is checked for correctness)")
    p.add_argument("--bucket-bytes", type=parse_bytes, default=None,
                   help="commlib bucket size (default: commlib's default)")
    p.add_argument("--compression", default=None, choices=("fp16",),
                   help="commlib's compression= (the baselines stay uncompressed)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="numpy arrays over MPI, or cupy arrays (commlib uses NCCL)")
    p.add_argument("--safety", action="store_true",
                   help="also time commlib without the consistency check, and without the "
                        "check and the watch dog, and report their costs")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = set(args.cases) - set(case_names())
    if unknown:
        p.error("unknown case(s): %s" % ", ".join(sorted(unknown)))
    args.sizes = ([parse_bytes(s) for s in args.sizes.split(",")]
                  if args.sizes else DEFAULT_SIZES)
    if args.warmup < 1 or args.calls < 1 or (args.repeats is not None and args.repeats < 1):
        p.error("--warmup, --calls and --repeats must be >= 1")
    return args


class Context:
    """What every measurement needs: array module, both communicators, sync."""

    def __init__(self, args):
        self.mpi = MPI.COMM_WORLD.Dup()  # baselines, barriers and timing
        self.rank, self.size = self.mpi.rank, self.mpi.size
        self.comm = commlib.Communicator.from_mpi(
            backend="mpi" if args.device == "cpu" else None, bucket_bytes=args.bucket_bytes)
        self.compression = args.compression
        self.bare = {}
        if args.safety:        # the same call without the check, and without the watch dog too
            for name, options in (("no-check", {"check": False}),
                                  ("no-check-no-watchdog", {"check": False,
                                                            "timeout": math.inf})):
                self.bare[name] = commlib.Communicator.from_mpi(
                    backend="mpi" if args.device == "cpu" else None,
                    bucket_bytes=args.bucket_bytes, **options)
        self.xp = np
        if args.device == "gpu":
            import cupy
            cupy.cuda.Device(self.comm.device).use()
            self.xp = cupy
        query = getattr(MPI, "Query_cuda_support", lambda: False)
        self.baselines = args.device == "cpu" or bool(query())
        self.bucket_bytes = (args.bucket_bytes or
                             commlib.collective.bucketing.DEFAULT_BUCKET_BYTES[self.comm.backend])

    def sync(self):
        if self.xp is not np:
            self.xp.cuda.Device().synchronize()

    def close(self):
        for comm in [self.comm, *self.bare.values()]:
            comm.close()
        self.mpi.Free()


def make_methods(ctx, shapes, views=False):
    """{method: (buffers it reduces, zero-argument call)}; ``views``
    allocates the arrays as consecutive views of one buffer."""
    if views:
        arrays = commlib.flat_arrays(shapes, DTYPE, xp=ctx.xp)
    else:
        arrays = [ctx.xp.empty(s, DTYPE) for s in shapes]
    methods = {"commlib": (arrays, lambda: ctx.comm.all_reduce(arrays,
                                                              compression=ctx.compression))}
    for name, comm in ctx.bare.items():
        methods[name] = (arrays, lambda comm=comm: comm.all_reduce(
            arrays, compression=ctx.compression))
    if ctx.baselines:
        flat = ctx.xp.empty(sum(a.size for a in arrays), DTYPE)

        def per_tensor():
            for a in arrays:
                ctx.mpi.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

        methods["per-tensor"] = (arrays, per_tensor)
        methods["flat"] = ([flat], lambda: ctx.mpi.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM))
    return methods


def timed(ctx, buffers, call, calls=1):
    """Fill with rank + 1, barrier, run ``call`` ``calls`` times back to back;
    seconds per call, max over ranks."""
    for b in buffers:
        b.fill(ctx.rank + 1)
    ctx.sync()
    ctx.mpi.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    ctx.sync()
    return ctx.mpi.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


def correct(ctx, buffers):
    """True on every rank when every rank holds sum(rank + 1) = n(n+1)/2."""
    expected = ctx.size * (ctx.size + 1) / 2
    ok = all(bool((b == expected).all()) for b in buffers)
    return ctx.mpi.allreduce(ok, op=MPI.LAND)


def run_case(ctx, name, shapes, repeats, warmup, calls=1):
    """Warm up and check each method (one call each, then the result is
    checked), then time them round-robin, ``calls`` calls per sample."""
    methods = make_methods(ctx, shapes, views=name == VIEWS_CASE)
    failed = []
    for method, (buffers, call) in methods.items():
        for _ in range(warmup):
            timed(ctx, buffers, call)
        if not correct(ctx, buffers):
            failed.append(method)
    order = list(methods)
    samples = {m: [] for m in order}
    for r in range(repeats):
        for method in order[r % len(order):] + order[:r % len(order)]:
            samples[method].append(timed(ctx, *methods[method], calls=calls))
    nbytes = case_bytes(shapes)
    median = {m: statistics.median(s) for m, s in samples.items()}
    row = {"case": name, "bytes": nbytes, "tensors": len(shapes), "repeats": repeats,
           "check": "FAIL:" + "+".join(failed) if failed else "ok",
           "samples_ms": {m: [t * 1e3 for t in s] for m, s in samples.items()}}
    for m in METHODS:
        row[m.replace("-", "_") + "_ms"] = median[m] * 1e3 if m in median else None
    algbw = nbytes / median["commlib"] / 1e9 if not failed else None
    row["algbw_gbs"] = algbw
    row["busbw_gbs"] = None if algbw is None else algbw * 2 * (ctx.size - 1) / ctx.size
    best = min((median[m] for m in ("per-tensor", "flat") if m in median), default=None)
    row["ratio"] = median["commlib"] / best if best and not failed else None
    bare = [median.get("no-check"), median.get("no-check-no-watchdog")]
    row["check_cost"] = (median["commlib"] / bare[0] - 1) * 100 if bare[0] else None
    row["watchdog_cost"] = (bare[0] / bare[1] - 1) * 100 if bare[1] else None
    return row


COLUMNS = [("case", "case", "%s"), ("bytes", "bytes", "%d"), ("tensors", "tensors", "%d"),
           ("commlib_ms", "commlib ms", "%.4g"), ("per_tensor_ms", "per-tensor ms", "%.4g"),
           ("flat_ms", "flat ms", "%.4g"), ("algbw_gbs", "commlib algbw GB/s", "%.3g"),
           ("busbw_gbs", "busbw GB/s", "%.3g"), ("ratio", "commlib / best baseline", "%.2f"),
           ("check", "check", "%s")]
SAFETY_COLUMNS = [("no_check_ms", "no check ms", "%.4g"),
                  ("no_check_no_watchdog_ms", "no check, no watch dog ms", "%.4g"),
                  ("check_cost", "check cost %", "%+.1f"),
                  ("watchdog_cost", "watch dog cost %", "%+.1f")]


def table(rows, columns=COLUMNS):
    """Markdown table of ``rows``; missing values print as '-'."""
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |",
             "|" + "|".join(" --- " for _ in columns) + "|"]
    for row in rows:
        cells = ["-" if row[key] is None else fmt % row[key] for key, _, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    ctx = Context(args)
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    config = {"ranks": ctx.size, "backend": ctx.comm.backend, "device": args.device,
              "bucket_bytes": ctx.bucket_bytes, "check": ctx.comm.check,
              "timeout": ctx.comm.timeout,
              "compression": args.compression,
              "dtype": np.dtype(DTYPE).name, "warmup": args.warmup, "calls": args.calls}
    say("# all-reduce, %(ranks)d ranks, backend %(backend)s, device %(device)s, "
        "bucket_bytes %(bucket_bytes)d, consistency check %(check)s, watch dog %(timeout)s s, "
        "%(dtype)s, "
        "compression %(compression)s" % config)
    say("# time per call: max over ranks, median of the repeats (%d back-to-back calls "
        "each); GB/s = 1e9 bytes/s; busbw = algbw * 2(n-1)/n" % args.calls, flush=True)
    notes, rows = [], []
    if not ctx.baselines:
        notes.append("baselines skipped: MPI is not CUDA-aware")
    for name, shapes in build_cases(args.cases, args.sizes):
        nbytes = case_bytes(shapes)
        if nbytes > args.max_bytes:
            notes.append("skipped %s: %s > --max-bytes %s"
                         % (name, human(nbytes), human(args.max_bytes)))
            continue
        repeats = args.repeats or (20 if nbytes < 16 * 2**20 else 7)
        rows.append(run_case(ctx, name, shapes, repeats, args.warmup, args.calls))
    say(table(rows, COLUMNS + SAFETY_COLUMNS if ctx.bare else COLUMNS))
    for note in notes:
        say("note: " + note)
    if ctx.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(
            {"config": config, "notes": notes, "results": rows}, indent=1))
    ctx.close()
    return 1 if any(row["check"] != "ok" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
