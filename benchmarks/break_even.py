"""Where compression pays: dense against every ``commlib.compression``
strategy on real gradient lists, over shared memory and over TCP links
shaped to 10 and 1 Gbit/s per rank (``shaped_link.py``), 2 ranks.

    python benchmarks/break_even.py                          # the whole table (< 5 min idle)
    python benchmarks/break_even.py --cases resnet50 --links shm,10gbit
    python benchmarks/break_even.py --json out.json --repeats 7

Columns, per case, link and strategy:

* **step ms**: median over repeats of one ``all_reduce(grads, op="avg",
  compression=...)`` of the whole list, the slowest rank's time (each rank's
  gradients are copied in fresh before each call, not timed);
* **wire bytes per rank**: what one rank hands to the transport per call;
* **compute ms**: the same call on a single-process communicator with the
  MPI transport's 1 MiB buckets: the casts, selections, scatters and
  payload checks alone, no communication (median, measured in this process,
  not under the shaped link);
* **vs dense**: dense step ms over this strategy's, same link, same run
  (above 1: faster than dense).

Gradients are standard normal float32 (seeded by rank; the same values
are copied in before every call). The threshold is 2.576, the two-sided
1 % quantile of the unit normal, without error feedback, so every call
sends about 1 % of the entries (with error feedback the residual of the
same gradients would grow every call and so would the count; the wire bytes
column shows what travelled). Top-K keeps its error feedback (its count is
fixed). Links:
``shm`` is the normal commlib path (its shared-memory transport), the
shaped ones run the job in a network namespace (needs root; otherwise
those rows are skipped with a note). Each strategy runs in a block of
repeats on its own communicator (its buffers freed before the next), after
two warm-up calls; the machine's noise hits blocks differently, so compare
within one run and repeat runs.
"""
import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # prefer the checkout's commlib
sys.path.insert(0, str(HERE))
import commlib  # noqa: E402
from commlib.compression import BF16, FP16, Partial, Threshold, TopK  # noqa: E402

WORKLOADS = HERE / "workloads"
THRESHOLD = 2.576
STRATEGIES = {"none": None, "fp16": FP16(), "bf16": BF16(), "topk-1%": TopK(0.01),
              "topk-0.1%": TopK(0.001),
              "threshold-1%": Threshold(THRESHOLD, error_feedback=False),
              "partial-10%": Partial(0.1)}
LINKS = ("shm", "10gbit", "1gbit")
# repeats per link when not given (BERT dense at 1 Gbit: about 3.5 s a call)
REPEATS = {"shm": 5, "10gbit": 5, "1gbit": 3}
BUCKET_BYTES = 1 << 20     # the MPI transport's default, for the compute column
# untimed calls first: the error-feedback buffers swap roles every call, so
# the second call is the first to find both of them in memory (page faults)
WARMUP = 2


def shapes_of(case):
    return [tuple(s) for s in json.loads((WORKLOADS / (case + ".json")).read_text())["shapes"]]


def gradients(shapes, rank):
    rng = np.random.default_rng([7, rank])
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


def median_ms(samples):
    return statistics.median(samples) * 1e3


# ------------------------------------------------------------------ the MPI job

def worker(args):
    """One rank of the timed job: every case and strategy, rows as JSON to
    ``args.out`` (rank 0)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rows = []
    for case in args.cases:
        shapes = shapes_of(case)
        fresh = gradients(shapes, world.rank)
        grads = [np.empty(s, np.float32) for s in shapes]
        for name in args.strategies:
            comm = commlib.Communicator.from_mpi(backend="mpi")
            times = []
            for rep in range(WARMUP + args.repeats):
                for g, f in zip(grads, fresh):
                    np.copyto(g, f)
                world.Barrier()
                comm.stats.reset()
                start = time.perf_counter()
                comm.all_reduce(grads, op="avg", compression=STRATEGIES[name])
                elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
                if rep >= WARMUP:
                    times.append(elapsed)
            rows.append({"case": case, "strategy": name, "times": times,
                         "wire_bytes": comm.stats.bytes_sent, "backend": comm.backend})
            comm.close()
            del comm
            gc.collect()
    if world.rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    return 0


def run_job(link, args, repeats, timeout):
    """Rows of one 2-rank job over ``link``; raises ShapedLinkUnavailable
    for a shaped link this machine cannot make, RuntimeError when the job
    fails."""
    import shaped_link
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [mpiexec, "-n", "2", sys.executable, str(Path(__file__).resolve()), "--worker",
               "--cases", ",".join(args.cases), "--strategies", ",".join(args.strategies),
               "--repeats", str(repeats), "--out", str(out)]
        if link == "shm":
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            code, output = proc.returncode, proc.stdout + proc.stderr
        else:
            run = shaped_link.run_shaped(cmd, link, timeout=timeout, capture=True)
            code, output = run.returncode, run.stdout + run.stderr
        if code or not out.exists():
            raise RuntimeError("the %s job failed (exit %d):\n%s" % (link, code, output[-4000:]))
        return json.loads(out.read_text())


# ------------------------------------------------------------------ compute alone

def compute_times(args):
    """{(case, strategy): median ms} of the call on one process (no
    communication), 1 MiB buckets."""
    found = {}
    for case in args.cases:
        shapes = shapes_of(case)
        fresh = gradients(shapes, 0)
        grads = [np.empty(s, np.float32) for s in shapes]
        for name in args.strategies:
            comm = commlib.Communicator.single(bucket_bytes=BUCKET_BYTES)
            samples = []
            for rep in range(WARMUP + args.compute_repeats):
                for g, f in zip(grads, fresh):
                    np.copyto(g, f)
                start = time.perf_counter()
                comm.all_reduce(grads, op="avg", compression=STRATEGIES[name])
                if rep >= WARMUP:
                    samples.append(time.perf_counter() - start)
            found[case, name] = median_ms(samples)
            comm.close()
            del comm
            gc.collect()
    return found


# ------------------------------------------------------------------ the table

def table(rows, compute):
    """The markdown lines of the table."""
    out = ["| case | link | strategy | step ms | wire bytes per rank | compute ms | vs dense |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    dense = {(r["case"], r["link"]): r["ms"] for r in rows if r["strategy"] == "none"}
    for r in rows:
        base = dense.get((r["case"], r["link"]))
        c = compute.get((r["case"], r["strategy"]))
        out.append("| %s | %s | %s | %.3g | %d | %s | %s |"
                   % (r["case"], r["link"], r["strategy"], r["ms"], r["wire_bytes"],
                      "-" if c is None else "%.3g" % c,
                      "-" if base is None else "%.2f" % (base / r["ms"])))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="resnet50,bert_base")
    p.add_argument("--links", default=",".join(LINKS),
                   help="comma list of shm and shaped rates (10gbit, 1gbit, 500mbit, ...)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per strategy (default: 5, 3 at 1gbit and below)")
    p.add_argument("--compute-repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds per link's job")
    p.add_argument("--json", default="break_even.json", help="where the results go")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for attr in ("cases", "links", "strategies"):
        setattr(args, attr, [x for x in getattr(args, attr).split(",") if x])
    unknown = set(args.strategies) - set(STRATEGIES)
    missing = [c for c in args.cases if not (WORKLOADS / (c + ".json")).exists()]
    if unknown or missing:
        p.error("unknown strategies %s or cases %s" % (sorted(unknown), missing))
    if (args.repeats is not None and args.repeats < 1) or args.compute_repeats < 1:
        p.error("--repeats and --compute-repeats must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        args.repeats = args.repeats or 1
        return worker(args)
    import shaped_link
    started = time.perf_counter()
    print("# break-even, 2 ranks, op=avg, %s; step = median, slowest rank"
          % ", ".join(args.cases), flush=True)
    compute = compute_times(args)
    rows, notes = [], []
    for link in args.links:
        repeats = args.repeats or (REPEATS["1gbit"] if link != "shm"
                                   and shaped_link.parse_rate(link) <= 10**9
                                   else REPEATS.get(link, REPEATS["10gbit"]))
        try:
            found = run_job(link, args, repeats, args.timeout)
        except shaped_link.ShapedLinkUnavailable as e:
            notes.append("note: %s skipped: %s" % (link, e))
            continue
        for r in found:
            r.update(link=link, ms=median_ms(r["times"]), repeats=repeats,
                     compute_ms=compute.get((r["case"], r["strategy"])))
            rows.append(r)
        print("# %s done (%.0f s so far)" % (link, time.perf_counter() - started), flush=True)
    for line in table(rows, compute) + notes:
        print(line)
    Path(args.json).write_text(json.dumps(
        {"cases": args.cases, "links": args.links, "threshold": THRESHOLD,
         "bucket_bytes_compute": BUCKET_BYTES, "rows": rows,
         "seconds": time.perf_counter() - started}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
