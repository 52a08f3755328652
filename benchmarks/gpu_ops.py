"""What one all_reduce asks of the GPU's driver, per strategy: a count of
the operations commlib's host thread issues (kernel launches, CUDA graph
launches, other cupy operations, copies, allocations, memsets, host reads),
per call and per bucket. On a GPU each costs the calling thread a few microseconds (a cupy
launch about 5, a memset or allocation 1-3, a read waits for the GPU), so
these counts are what the host time of a compressed call is made of.

    python benchmarks/gpu_ops.py --host-build      # build the stand-in cupy, run on it
    python benchmarks/gpu_ops.py --json out.json

Counted on the cooperative host build's stand-in cupy
(tests/ops/cuda_host_build.py), which runs every kernel of kernels/ on the
CPU and logs launches and host reads; this script also counts the
stand-in's other cupy calls. Counts do not depend on sizes: the list is
small (40 float32 arrays, 179K values, in 6 buckets), at world size 1
(``Communicator.single``; the collective itself is not counted), after 5
warm-up calls.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("launches", "graphs", "cupy ops", "copies", "allocations", "memsets", "reads")


def counting(cupy):
    """Wrap the stand-in's entry points; returns the Counter they fill."""
    host = cupy._host
    counts = collections.Counter()
    g = cupy.__dict__
    plain = g["__getattr__"]

    def getattr_(name):
        f = plain(name)
        if not callable(f) or isinstance(f, type):
            return f

        def op(*a, **k):
            counts["cupy ops"] += 1
            return f(*a, **k)
        return op
    g["__getattr__"] = getattr_
    for name in ("empty", "zeros"):
        def alloc(*a, _f=g[name], **k):
            counts["allocations"] += 1
            return _f(*a, **k)
        g[name] = alloc
    nd = cupy.ndarray

    def ufunc(self, *a, _f=nd.__array_ufunc__, **kw):
        counts["cupy ops"] += 1
        return _f(self, *a, **kw)
    nd.__array_ufunc__ = ufunc
    for name in ("__setitem__", "set", "astype", "copy", "fill"):
        def method(self, *a, _f=getattr(nd, name), **k):
            counts["copies"] += 1
            return _f(self, *a, **k)
        setattr(nd, name, method)
    memset = cupy.cuda.runtime.memsetAsync

    def memset_(*a, **k):
        counts["memsets"] += 1
        return memset(*a, **k)
    cupy.cuda.runtime.memsetAsync = memset_
    counts.host = host
    return counts


def measure(warmup=5):
    import cupy
    import commlib
    from commlib.collective import bucketing
    from commlib.compression import TopK, Threshold
    counts = counting(cupy)
    host = counts.host
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(100, 9000, 40)]
    arrays = [cupy.asarray(rng.standard_normal(s).astype(np.float32)) for s in sizes]
    bucket_bytes = 4 * (sum(sizes) // 5 + 1)
    plan = bucketing.plan_for(arrays, bucket_bytes)
    units = len(plan.buckets) + len(plan.direct)
    comm = commlib.Communicator.single(device=0, bucket_bytes=bucket_bytes)
    rows = []
    for name, strategy in (("dense", None), ("fp16", "fp16"), ("topk 1%", TopK(0.01)),
                           ("threshold", Threshold(2.5))):
        for _ in range(warmup):
            comm.all_reduce(arrays, op="avg", compression=strategy)
        counts.clear()
        launches, reads = len(host.launches), len(host.reads)
        graphs, replayed = host.graph_launches, host.replayed
        comm.all_reduce(arrays, op="avg", compression=strategy)
        row = {k: counts[k] for k in KINDS}
        # kernels run by a graph launch are the graph's one operation
        row["launches"] = len(host.launches) - launches - (host.replayed - replayed)
        row["graphs"] = host.graph_launches - graphs
        row["reads"] = len(host.reads) - reads
        row.update(strategy=name, arrays=len(arrays), units=units,
                   kernels=dict(collections.Counter(n for n, *_ in host.launches[launches:])))
        row["total"] = sum(row[k] for k in KINDS)
        rows.append(row)
    comm.close()
    return rows


def python_time(repeats=60, scale=1000, layouts=(None, 16)):
    """commlib's own Python per ``all_reduce``: the median wall time of a
    call with every kernel launch and graph launch of the stand-in made
    free (they do nothing; the buffers hold the last real call's values, so
    the checks pass), which is the host time a call would take if issuing
    work to the GPU cost nothing. The list has ResNet-50's layout (161
    arrays, each ``1/scale`` of its size) at world size 1, in each of
    ``layouts``: None for buckets of ``25 MiB / scale`` (as many buckets as
    the real list in 25 MiB ones), a number for buckets of about that many;
    each strategy with its launches replayed as CUDA graphs and without
    (``COMMLIB_CUDA_GRAPHS=0``), each on a communicator of its own, dense
    in the same run as the baseline, the variants of each column
    interleaved call by call. Returns rows of microseconds."""
    import gc
    import time
    import cupy
    import commlib
    from commlib.collective import bucketing
    from commlib.compression import TopK
    shapes = json.loads((ROOT / "tests" / "data" / "resnet50.json").read_text())["shapes"]
    sizes = [max(1, int(np.prod(s)) // scale) for s in shapes]
    rng = np.random.default_rng(1)
    arrays = [cupy.asarray(rng.standard_normal(n).astype(np.float32)) for n in sizes]
    variants = []      # (row, "graphs" or "no graphs", communicator, strategy)
    rows = []
    for layout in layouts:
        bucket_bytes = (25 << 20) // scale if layout is None else -(-4 * sum(sizes) // layout)
        plan = bucketing.plan_for(arrays, bucket_bytes)
        for name, strategy in (("dense", None), ("fp16", "fp16"), ("topk 1%", TopK(0.01))):
            rows.append({"strategy": name, "arrays": len(arrays), "repeats": repeats,
                         "units": len(plan.buckets) + len(plan.direct)})
            for graphs in ("1", "0"):
                os.environ["COMMLIB_CUDA_GRAPHS"] = graphs   # read when a key is new
                comm = commlib.Communicator.single(device=0, bucket_bytes=bucket_bytes)
                # steady from the fifth call with graphs (error feedback's two
                # buffers: each key runs directly, then is captured), the second without
                for _ in range(4 if graphs == "1" else 2):
                    comm.all_reduce(arrays, op="avg", compression=strategy)
                variants.append((rows[-1], "graphs" if graphs == "1" else "no graphs", comm,
                                 strategy))
    free = (cupy.RawKernel.__call__, cupy.cuda.Graph.launch, cupy._host.kernels.launch)
    cupy.RawKernel.__call__ = lambda self, *a, **k: None
    cupy.cuda.Graph.launch = lambda self, stream=None: None
    cupy._host.kernels.launch = lambda *a, **k: None
    times = collections.defaultdict(list)
    gc.collect()
    gc.disable()
    try:
        # the variants of a column interleaved, so that drift hits them
        # alike; the columns one after the other, so that the stand-in's
        # heavy work without graphs does not evict the caches of the calls
        # with them
        for column in ("graphs", "no graphs"):
            os.environ["COMMLIB_CUDA_GRAPHS"] = "1" if column == "graphs" else "0"
            mine = [(i, v) for i, v in enumerate(variants) if v[1] == column]
            for _ in range(repeats):
                for i, (row, _, comm, strategy) in mine:
                    t = time.perf_counter()
                    comm.all_reduce(arrays, op="avg", compression=strategy)
                    times[i].append(time.perf_counter() - t)
    finally:
        gc.enable()
        os.environ.pop("COMMLIB_CUDA_GRAPHS", None)
        cupy.RawKernel.__call__, cupy.cuda.Graph.launch, cupy._host.kernels.launch = free
    for i, (row, column, comm, strategy) in enumerate(variants):
        row[column] = 1e6 * float(np.median(times[i]))
        comm.close()
    return rows


def print_python_time(rows):
    print("commlib's Python per all_reduce call, launches free (the ResNet-50 layout, "
          "%d arrays, world size 1; median of %d calls, this CPU):"
          % (rows[0]["arrays"], rows[0]["repeats"]))
    print("| strategy | buckets | us per call, graphs | us per call, no graphs "
          "| us per bucket, graphs | graphs / dense |")
    print("|---|---|---|---|---|---|")
    dense = None
    for r in rows:
        if r["strategy"] == "dense":
            dense = r["graphs"]
        print("| %s | %d | %.0f | %.0f | %.1f | %.2f |" % (
            r["strategy"], r["units"], r["graphs"], r["no graphs"], r["graphs"] / r["units"],
            r["graphs"] / dense))


def print_table(rows):
    cols = ["strategy", "units"] + list(KINDS) + ["total", "per unit"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join([r["strategy"], str(r["units"])] + [str(r[k]) for k in KINDS]
                                + [str(r["total"]), "%.1f" % (r["total"] / r["units"])]) + " |")
    print()
    for r in rows:
        print("%-9s kernels: %s" % (r["strategy"], ", ".join(
            "%s x%d" % kv for kv in sorted(r["kernels"].items()))))


def rerun_on_the_host_build(argv):
    """Build the stand-in cupy package and run this script again with it."""
    import tempfile
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "ops"), str(ROOT)]
    import cuda_host_build
    work = tempfile.mkdtemp(prefix="gpu-ops-")
    cuda_host_build.write_cupy_package(work, cuda_host_build.build())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([work, str(ROOT)]))
    env.pop("COMMLIB_HOST_KERNELS_LENIENT", None)
    return subprocess.call([sys.executable, __file__] + argv, env=env)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-build", action="store_true",
                    help="build the cooperative host build's stand-in cupy and run on it")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--time-repeats", type=int, default=60,
                    help="calls timed per variant (default 60)")
    ap.add_argument("--time-scale", type=int, default=1000,
                    help="the timed list's arrays are ResNet-50's divided by this (default 1000)")
    ap.add_argument("--no-time", action="store_true",
                    help="count operations only (no Python timing)")
    args = ap.parse_args(argv)
    if args.host_build:
        return rerun_on_the_host_build([a for a in argv if a != "--host-build"])
    import cupy
    if not hasattr(cupy, "_host"):
        raise SystemExit("gpu_ops.py counts on the host build's stand-in cupy: "
                         "run it with --host-build")
    rows = measure()
    print_table(rows)
    timed = [] if args.no_time else python_time(args.time_repeats, scale=args.time_scale)
    if timed:
        print()
        print_python_time(timed)
    if args.json:
        Path(args.json).write_text(json.dumps({"operations": rows, "python": timed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
