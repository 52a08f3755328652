"""Compressed all-reduce benchmark: time and bytes on the wire of each
``commlib.compression`` strategy against the uncompressed all-reduce,
measured in the same run.

    mpiexec -n 2 python benchmarks/compression.py                 # mnist_cnn, resnet50
    mpiexec -n 2 python benchmarks/compression.py --cases bert_base --repeats 3
    mpiexec -n 2 python benchmarks/compression.py --device gpu    # cupy arrays (NCCL)

Every repeat gives each rank fresh random gradients (not timed), then times
one ``all_reduce(grads, op="avg", compression=...)`` (the slowest rank's
time); strategies take turns within a repeat. "wire bytes" is what one rank
hands to the transport's collectives per call (its own payload: the float16
buckets, the index/value pairs, the partial windows), summed over buckets;
"of dense" compares it with the uncompressed payload. "error" is the
largest absolute difference from the exact average in the last repeat,
relative to the largest magnitude of the average (error feedback makes a
single step of top-K or threshold far from exact by design; it is the
accumulated updates that match). With ``--split``, one more traced call per
strategy (after the timed ones) gives rank 0's time inside the transports
("exchange": the collectives, waiting for the peers included) and the rest
of the call ("local": casting, selection, sums, error feedback, copies):
the cost of compressing shown apart from the exchange.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # prefer the checkout's commlib
import commlib  # noqa: E402
from commlib.compression import BF16, FP16, Partial, Threshold, TopK  # noqa: E402
from commlib.ops import hostcast, hostselect  # noqa: E402

WORKLOADS = HERE / "workloads"
STRATEGIES = {"none": None, "fp16": FP16(), "bf16": BF16(), "topk-1%": TopK(0.01),
              "topk-0.1%": TopK(0.001),
              "threshold-2.5": Threshold(2.5), "partial-10%": Partial(0.1)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="mnist_cnn,resnet50",
                   help="comma list of %s" % ", ".join(sorted(x.stem for x in WORKLOADS.glob("*.json"))))
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma list of %s (default: all)" % ", ".join(STRATEGIES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--split", action="store_true",
                   help="also trace one call per strategy: time in the transports against "
                        "the rest (see the module docstring)")
    p.add_argument("--twins", action="store_true",
                   help="also time every strategy with its numpy twins instead of the "
                        "compiled host loops (casts, selection), on its own communicator")
    args = p.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    args.strategies = [s for s in args.strategies.split(",") if s]
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown or args.repeats < 1:
        p.error("unknown strategies %s or --repeats < 1" % sorted(unknown))
    return args


@contextlib.contextmanager
def numpy_twins(on):
    """With ``on``, the compression loops take their numpy twins (the
    compiled casts and selections look unavailable)."""
    if not on:
        yield
        return
    saved = hostcast.compiled
    hostcast.compiled = hostselect.compiled = lambda name: None
    try:
        yield
    finally:
        hostcast.compiled = hostselect.compiled = saved


def split_call(comm, run_comm, arrays, strategy):
    """(exchange ms, local ms) of one all-reduce of ``arrays`` on rank 0:
    the time of its transport calls, and the rest of the collective (see
    the module docstring), from a trace of that one call."""
    folder = tempfile.mkdtemp(prefix="commlib-split-") if comm.rank == 0 else None
    folder = MPI.COMM_WORLD.bcast(folder, root=0)
    MPI.COMM_WORLD.Barrier()
    with commlib.trace(os.path.join(folder, "t.json")):
        run_comm.all_reduce(arrays, op="avg", compression=strategy)
    MPI.COMM_WORLD.Barrier()
    if comm.rank != 0:
        return None, None
    path = os.path.join(folder, "t.rank0.json")
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    os.rmdir(folder)
    whole = max(e["dur"] for e in events if e.get("cat") == "collective")
    inside = sum(e["dur"] for e in events if e.get("cat") == "transport")
    return inside / 1e3, (whole - inside) / 1e3


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    backend = "mpi" if args.device == "cpu" else None
    comm = commlib.Communicator.from_mpi(backend=backend)
    xp = np
    if args.device == "gpu":
        import cupy as xp
        xp.cuda.Device(comm.device).use()
    # (strategy, with numpy twins) -> its communicator (its stats count the wire bytes)
    runs = {(name, False): comm for name in args.strategies}
    comms = [comm]          # in the same order on every rank
    if args.twins:
        comms.append(commlib.Communicator.from_mpi(backend=backend))
        runs.update({(name, True): comms[1] for name in args.strategies if name != "none"})
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say("# compressed all-reduce, %d ranks, backend %s, %s, op=avg, median of %d; time = "
        "slowest rank" % (comm.size, comm.backend, args.device, args.repeats))
    rows = []
    for case in args.cases:
        shapes = [tuple(s) for s in json.loads((WORKLOADS / (case + ".json")).read_text())["shapes"]]
        grads = {run: [xp.zeros(s, np.float32) for s in shapes] for run in runs}
        times = {run: [] for run in runs}
        wire = {}
        for rep in range(args.repeats + 1):            # the first is a warm-up
            rng = np.random.default_rng([rep, comm.rank])
            fresh = [rng.standard_normal(s).astype(np.float32) for s in shapes]
            exact = [sum(world.allgather(f)) / comm.size for f in fresh]
            for run, run_comm in runs.items():
                for g, f in zip(grads[run], fresh):
                    g[...] = xp.asarray(f)
                world.Barrier()
                run_comm.stats.reset()
                start = time.perf_counter()
                with numpy_twins(run[1]):
                    run_comm.all_reduce(grads[run], op="avg", compression=STRATEGIES[run[0]])
                if xp is not np:
                    xp.cuda.Device().synchronize()
                elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
                if rep:
                    times[run].append(elapsed)
                wire[run] = run_comm.stats.bytes_sent
        scale = max(float(np.abs(e).max()) for e in exact)
        dense = wire.get(("none", False))
        split = {run: split_call(comm, run_comm, grads[run], STRATEGIES[run[0]])
                 if args.split else (None, None) for run, run_comm in runs.items()}
        for run in runs:
            host = [g if xp is np else g.get() for g in grads[run]]
            error = max(float(np.abs(h - e).max()) for h, e in zip(host, exact)) / scale
            rows.append({"case": case, "strategy": run[0] + (" (numpy twins)" if run[1] else ""),
                         "ms": statistics.median(times[run]) * 1e3,
                         "wire_bytes": wire[run], "of_dense": wire[run] / dense
                         if dense else None, "error": error,
                         "exchange_ms": split[run][0], "local_ms": split[run][1]})
    base = {r["case"]: r["ms"] for r in rows if r["strategy"] == "none"}
    split = " exchange ms | local ms |" if args.split else ""
    say("| case | strategy | ms | vs none |%s wire bytes per rank | of dense | error |" % split)
    say("| --- | --- | --- | --- |%s --- | --- | --- |" % (" --- | --- |" if args.split else ""))
    for r in rows:
        vs = r["ms"] / base[r["case"]] if r["case"] in base else None
        parts = (" %.3g | %.3g |" % (r["exchange_ms"], r["local_ms"])
                 if args.split and comm.rank == 0 else "")
        say("| %s | %s | %.3g | %s |%s %d | %s | %.2g |"
            % (r["case"], r["strategy"], r["ms"], "-" if vs is None else "%.2f" % vs, parts,
               r["wire_bytes"], "-" if r["of_dense"] is None else "%.3f" % r["of_dense"],
               r["error"]))
    if comm.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    for c in comms:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
