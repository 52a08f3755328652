"""What tracing (commlib.trace) costs on a ResNet-50-shaped step, at 2 ranks.

    python benchmarks/trace_overhead.py --base /tmp/trace-base --runs 6

The step is benchmarks/overlap.py's: the backward pass's compute stand-in
(``np.sin`` over ``--factor`` times each layer's size, the same in every
job, so that jobs compare) with each
layer's gradient handed to a :class:`commlib.BackwardReducer` as it is
written, then ``reducer.wait()``; ``all_reduce`` is the 97.5 MiB gradient
list alone. Each time is the slowest rank's, median of ``--repeats``.

* (a) tracing off, this checkout against ``--base`` (a checkout of the code
  before tracing existed, with its compiled host loops): whole jobs
  alternate, old, new, old, new, ...; the table gives the median of the
  jobs' medians;
* (b) tracing on against off, interleaved repeat by repeat in the same job
  of this checkout, which of the two goes first alternating (the files are
  written after each timed repeat, outside the timing).

Without ``--base`` only (b) runs. Under mpiexec (``--rank-program``) it is
the rank program and prints one ``TRACE_OVERHEAD {json}`` line.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rank_program(args):
    sys.path[:0] = [args.commlib, str(HERE)]
    from mpi4py import MPI
    import commlib
    from overlap import Backward, layers
    world = MPI.COMM_WORLD
    comm = commlib.init()
    grads = commlib.flat_arrays(*layers("resnet50"))
    backward = Backward(grads, comm.rank)
    reducer = commlib.BackwardReducer(comm, grads, overlap=True)
    traced = args.trace_dir and hasattr(commlib, "trace")

    def slowest(fn):
        world.Barrier()
        start = time.perf_counter()
        fn()
        return world.allreduce(time.perf_counter() - start, op=MPI.MAX)

    def step():
        backward.run(reducer.ready)
        reducer.wait()

    def comm_only():
        comm.all_reduce(grads, op="avg")

    def timed(name, fn, on):
        if on:
            commlib.trace(os.path.join(args.trace_dir, "overhead.json"))
        times.setdefault(name + (" on" if on else " off"), []).append(slowest(fn))
        if on:
            commlib.trace(None)

    backward.factor = args.factor
    for _ in range(2):
        slowest(step)
        slowest(comm_only)
    times = {}
    for k in range(args.repeats):
        for name, fn in (("step", step), ("all_reduce", comm_only)):
            for on in ((False, True) if k % 2 == 0 else (True, False))[:1 + bool(traced)]:
                timed(name, fn, on and traced)
    comm.close()
    if comm.rank == 0:
        print("TRACE_OVERHEAD " + json.dumps(
            {k: 1e3 * statistics.median(v) for k, v in times.items()}), flush=True)


def job(checkout, args, trace_dir=None):
    """One mpiexec job of the rank program importing commlib from ``checkout``."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", "2", sys.executable,
           __file__, "--rank-program", "--commlib", str(checkout),
           "--repeats", str(args.repeats), "--factor", str(args.factor)] + (["--trace-dir", trace_dir] if trace_dir else [])
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("TRACE_OVERHEAD ")][0]
    return json.loads(line.split(" ", 1)[1])


def table(rows):
    lines = ["| comparison | step | baseline ms | ms | ratio |", "| --- | --- | --- | --- | --- |"]
    for what, name, base, new in rows:
        lines.append("| %s | %s | %.1f | %.1f | %.4f |" % (what, name, base, new, new / base))
    return "\n".join(lines)


def drive(args):
    new = HERE.parent
    old_runs, new_runs = [], []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.runs):
            if args.base:
                old_runs.append(job(args.base, args))
            new_runs.append(job(new, args, trace_dir=folder))
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    rows = []
    for name in ("step", "all_reduce"):
        if old_runs:
            rows.append(("(a) off: before tracing -> this checkout", name,
                         med(old_runs, name + " off"), med(new_runs, name + " off")))
        rows.append(("(b) this checkout: off -> on", name, med(new_runs, name + " off"),
                     med(new_runs, name + " on")))
    print("2 ranks, ResNet-50 gradients (97.5 MiB), %d jobs x %d repeats, median of the "
          "jobs' medians (slowest rank)\n" % (args.runs, args.repeats))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"old": old_runs, "new": new_runs}, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=None,
                        help="a checkout of commlib before tracing, for comparison (a)")
    parser.add_argument("--runs", type=int, default=6, help="jobs per checkout, alternating")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats per job")
    parser.add_argument("--factor", type=float, default=0.3,
                        help="compute per gradient element (np.sin calls over factor x size)")
    parser.add_argument("--json", default=None, help="write every job's medians here")
    parser.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--commlib", default=str(HERE.parent), help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_program:
        rank_program(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
