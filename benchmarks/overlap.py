"""Overlap benchmark: a synthetic training step shaped like ResNet-50, with
the gradient all-reduce overlapped with the backward pass
(:class:`commlib.BackwardReducer`) and without (compute everything, then one
``all_reduce``).

    mpiexec -n 2 python benchmarks/overlap.py [--workload resnet50] [--repeats 7]
    python benchmarks/overlap.py --links local,10gbit,1gbit      # all of them, one command

The step: for every layer, last to first, a compute stand-in whose cost is
proportional to the layer's parameter count (``np.sin`` over a scratch
array of ``f`` times the layer's size, on the calling thread; numpy drops
the GIL inside), then the layer's gradient is written and, with overlap,
``reducer.ready(i)``. ``f`` is calibrated at the start so that the whole
backward pass takes ``--compute-ratio`` (default 1) times the measured
all-reduce time, the same on every rank. Timed in the same run,
interleaved repeat by repeat, each the slowest rank's time, median of
``--repeats``:

* compute only (no communication), communication only (``all_reduce`` of
  the gradients, fused), and max(compute, comm): the best overlap can do;
* the step without overlap (compute, then ``all_reduce``) and with it;
* ``compute in step``: the time the backward pass itself took inside the
  overlapped step: how much the progress thread slows the compute;
* how many buckets had completed when the backward pass ended;
* the CPU time of each variant per rank (``time.process_time()``, every
  thread of the process; the busiest rank): where the ranks fill every
  core, one each, a step takes about that long at least;
* the baselines: the same overlapped step written with bare mpi4py, no
  commlib (:class:`BareOverlap`: one thread, each bucket's ``Iallreduce``
  in place as soon as it is ready, polled with the same sleeps, then
  scaled), one bucket in flight at a time as in commlib, and up to four,
  so the table tells what the machine allows from what commlib adds.

``--compute sleep`` replaces the computation by sleeps of the same
shape: the CPU is free during the backward pass, as with a GPU (and as
the transports' CPU work needs, on a machine whose cores the computation
fills).

``--links`` runs the rank program once per link: ``local`` (this machine's
transports: shared memory between the ranks) and rates such as ``1gbit``
through ``benchmarks/shaped_link.py`` (MPI over TCP through a rate-limited
loopback, commlib's shared memory off; needs root), and prints one table
per link.
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "workloads"


def layers(workload):
    spec = json.loads((WORKLOADS / ("%s.json" % workload)).read_text())
    return [tuple(s) for s in spec["shapes"]], np.dtype(spec.get("dtype", "float32"))


class Backward:
    """The compute stand-in of one backward pass over ``grads``: layer i
    costs ``np.sin`` over ``factor * grads[i].size`` doubles (``mode="sin"``:
    the CPU computes) or a sleep of ``factor * grads[i].size`` ns
    (``mode="sleep"``: the CPU waits, as for a GPU kernel)."""

    def __init__(self, grads, rank, mode="sin"):
        self.grads, self.rank, self.mode = grads, rank, mode
        self.sizes = [g.size for g in grads]
        self.scratch = np.random.default_rng(rank).random(max(self.sizes) + 1)
        self.out = np.empty_like(self.scratch)
        self.factor = 1.0

    def layer(self, i):
        if self.mode == "sleep":
            time.sleep(self.sizes[i] * self.factor * 1e-9)
            self.grads[i].fill(self.rank + 1 + i % 7)
            return
        todo = int(self.sizes[i] * self.factor)
        step = self.scratch.size
        while todo > 0:
            n = min(todo, step)
            np.sin(self.scratch[:n], out=self.out[:n])
            todo -= n
        self.grads[i].fill(self.rank + 1 + i % 7)

    def run(self, after_layer=None):
        """The whole pass, last layer first; returns its seconds."""
        start = time.perf_counter()
        for i in range(len(self.grads) - 1, -1, -1):
            self.layer(i)
            if after_layer is not None:
                after_layer(i)
        return time.perf_counter() - start


class BareOverlap:
    """The overlapped step with bare mpi4py on ``world`` (a duplicate):
    bucket ``k`` of ``buckets`` (index lists into the flat-array views
    ``grads``) is ``Iallreduce``-d in place on a thread of its own as soon
    as :meth:`ready` completed it, in bucket order, at most ``depth`` at a
    time; the thread polls the oldest with ``Test``, with commlib's relaxed
    sleeps while the caller computes and back to back once it waits; then
    scales it by 1/size."""

    def __init__(self, world, grads, buckets, depth=1):
        import threading
        self.world, self.buckets = world, buckets
        base = grads[0]
        while base.base is not None:
            base = base.base
        start = base.__array_interface__["data"][0]
        self.views = []
        for b in buckets:
            first, last = grads[b[0]], grads[b[-1]]
            lo = (first.__array_interface__["data"][0] - start) // first.itemsize
            hi = (last.__array_interface__["data"][0] - start) // last.itemsize + last.size
            view = base.reshape(-1).view(first.dtype)[lo:hi]
            assert view.size == sum(grads[j].size for j in b), "buckets must be contiguous"
            self.views.append(view)
        self.bucket_of = {j: k for k, b in enumerate(buckets) for j in b}
        self.depth = depth
        self._queue, self._cond = collections.deque(), threading.Condition()
        self._waiting, self._done = False, 0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        from mpi4py import MPI
        from commlib.core.waiting import RELAXED_SLEEP_S, RELAXED_SPINS
        scale = 1.0 / self.world.Get_size()
        flight = collections.deque()            # (bucket, request), oldest first
        while True:
            with self._cond:
                while not self._queue and not flight:
                    self._cond.wait()
                while self._queue and len(flight) < self.depth:
                    k = self._queue.popleft()
                    if k is None:
                        return
                    flight.append((k, self.world.Iallreduce(MPI.IN_PLACE, self.views[k])))
            k, request = flight[0]
            polls, sleep = 0, RELAXED_SLEEP_S[0]
            while not request.Test():
                if self._queue and len(flight) < self.depth:
                    break                       # start the next bucket first
                polls += 1
                if polls > RELAXED_SPINS and not self._waiting:
                    time.sleep(sleep)
                    sleep = min(2 * sleep, RELAXED_SLEEP_S[1])
            else:
                flight.popleft()
                self.views[k] *= scale
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()

    def step(self, backward):
        """One overlapped step; returns the backward pass's seconds."""
        missing = [len(b) for b in self.buckets]
        started = [0]
        self._done = 0

        def ready(i):
            missing[self.bucket_of[i]] -= 1
            while started[0] < len(self.buckets) and missing[started[0]] == 0:
                with self._cond:
                    self._queue.append(started[0])
                    self._cond.notify_all()
                started[0] += 1

        took = backward.run(ready)
        self._waiting = True
        with self._cond:
            while self._done < len(self.buckets):
                self._cond.wait()
        self._waiting = False
        return took

    def close(self):
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()


def calibrate(world, backward, target_s, slowest, rounds=3):
    """Set ``backward.factor`` so that the pass takes ``target_s`` seconds
    (the slowest rank's median of 3), correcting ``rounds`` times for the
    part that does not scale with the factor (per-layer overhead, the
    sleeps' granularity); the same factor on every rank."""
    from mpi4py import MPI
    backward.factor = 1.0
    for _ in range(rounds):
        took = statistics.median(slowest(backward.run)[0] for _ in range(3))
        backward.factor = world.allreduce(backward.factor * target_s / took, op=MPI.MAX)
    return backward.factor


def rank_program(args):
    from mpi4py import MPI
    sys.path.insert(0, str(HERE.parent))          # prefer the checkout's commlib
    import commlib
    world = MPI.COMM_WORLD
    comm = commlib.init()
    shapes, dtype = layers(args.workload)
    grads = commlib.flat_arrays(shapes, dtype)
    backward = Backward(grads, comm.rank, args.compute)
    # the overlapped step always starts buckets early; what overlap="auto"
    # would choose here is reported beside it
    reducer = commlib.BackwardReducer(comm, grads, bucket_bytes=args.bucket_bytes,
                                      overlap=True)
    auto_overlaps = commlib.overlap.early_start_pays(comm, grads)
    bare = BareOverlap(world.Dup(), grads, reducer.buckets)
    bare4 = BareOverlap(world.Dup(), grads, reducer.buckets, depth=4)

    def slowest(fn):
        world.Barrier()
        start = time.perf_counter()
        extra = fn()
        return world.allreduce(time.perf_counter() - start, op=MPI.MAX), extra

    def comm_only():
        comm.all_reduce(grads, op="avg")

    def no_overlap():
        took = backward.run()
        comm.all_reduce(grads, op="avg")
        return took

    def overlap():
        took = backward.run(reducer.ready)
        finished = sum(work.done() for work in reducer._works)
        reducer.wait()
        return took, finished

    for _ in range(2):                            # warm up: plans, buffers, threads
        slowest(comm_only)
        slowest(overlap)
        slowest(lambda: bare.step(backward))
        slowest(lambda: bare4.step(backward))
    comm_s = statistics.median(slowest(comm_only)[0] for _ in range(3))
    factor = calibrate(world, backward, args.compute_ratio * comm_s, slowest)
    variants = {"compute": backward.run, "comm": comm_only, "no_overlap": no_overlap,
                "overlap": overlap, "bare_overlap": lambda: bare.step(backward),
                "bare_overlap_4": lambda: bare4.step(backward)}
    times = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    inside, finished = [], []
    deadline = time.monotonic() + args.budget_s
    for k in range(args.repeats):
        for name, fn in variants.items():
            used = time.process_time()
            seconds, extra = slowest(fn)
            times[name].append(seconds)
            cpu[name].append(world.allreduce(time.process_time() - used, op=MPI.MAX))
            if name == "overlap":
                inside.append(world.allreduce(extra[0], op=MPI.MAX))
                finished.append(world.allreduce(extra[1], op=MPI.MIN))
        if k >= 2 and world.allreduce(time.monotonic() > deadline, op=MPI.LOR):
            break
    med = {name: statistics.median(t) for name, t in times.items()}
    best = max(med["compute"], med["comm"])
    result = {"workload": args.workload, "ranks": comm.size, "backend": comm.backend,
              "compute": args.compute,
              "buckets": len(reducer.buckets), "bucket_bytes": reducer.bucket_bytes,
              "auto_overlaps": bool(auto_overlaps),
              "bytes": int(sum(g.nbytes for g in grads)), "compute_factor": factor,
              "repeats": len(times["compute"]), "link": os.environ.get("OVERLAP_LINK", "local"),
              "ms": {name: 1e3 * v for name, v in med.items()},
              "ms_max": 1e3 * best, "ms_compute_in_overlap": 1e3 * statistics.median(inside),
              "buckets_done_after_compute": statistics.median(finished),
              "range_ms": {name: [1e3 * min(t), 1e3 * max(t)] for name, t in times.items()},
              "cpu_ms": {name: 1e3 * statistics.median(t) for name, t in cpu.items()}}
    result["overlap_to_max"] = med["overlap"] / best
    result["no_overlap_to_max"] = med["no_overlap"] / best
    result["bare_overlap_to_max"] = med["bare_overlap"] / best
    result["bare_overlap_4_to_max"] = med["bare_overlap_4"] / best
    bare.close()
    bare4.close()
    comm.close()
    if comm.rank == 0:
        print("OVERLAP " + json.dumps(result), flush=True)
        print(table(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


def table(r):
    ms = r["ms"]
    rows = [("compute only", ms["compute"]), ("communication only", ms["comm"]),
            ("max(compute, comm)", r["ms_max"]), ("step without overlap", ms["no_overlap"]),
            ("step with overlap", ms["overlap"]),
            ("compute inside the overlapped step", r["ms_compute_in_overlap"]),
            ("step with overlap, bare mpi4py (baseline)", ms["bare_overlap"]),
            ("step with overlap, bare mpi4py, 4 buckets in flight", ms["bare_overlap_4"])]
    lines = ["%s, %d ranks, %s link, backend %s, compute %s, %d buckets of <= %d bytes, "
             "%.0f MB, median of %d (slowest rank)"
             % (r["workload"], r["ranks"], r["link"], r["backend"], r["compute"], r["buckets"],
                r["bucket_bytes"], r["bytes"] / 1e6, r["repeats"]),
             "", "| time | ms |", "| --- | --- |"]
    lines += ["| %s | %.1f |" % row for row in rows]
    cpu = r["cpu_ms"]
    lines += ["| CPU time per rank (all threads, busiest rank): compute only / overlap / "
              "bare mpi4py | %.1f / %.1f / %.1f |"
              % (cpu["compute"], cpu["overlap"], cpu["bare_overlap"])]
    lines += ["| overlap=\"auto\" would start buckets early here | %s |"
              % ("yes" if r.get("auto_overlaps") else "no (no spare cores)")]
    lines += ["| buckets complete when the backward pass ended | %g of %d |"
              % (r["buckets_done_after_compute"], r["buckets"]),
              "| overlap / max | %.2f |" % r["overlap_to_max"],
              "| bare mpi4py overlap / max | %.2f |" % r["bare_overlap_to_max"],
              "| bare mpi4py, 4 in flight / max | %.2f |" % r["bare_overlap_4_to_max"],
              "| no overlap / max | %.2f |" % r["no_overlap_to_max"]]
    return "\n".join(lines)


def drive(args, rest):
    """Run the rank program once per link; print each table."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    cmd = [mpiexec, "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve())] + rest
    sys.path.insert(0, str(HERE))
    for link in args.links.split(","):
        env = dict(os.environ, OVERLAP_LINK=link)
        if link == "local":
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=args.link_timeout_s)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        else:
            from shaped_link import ShapedLinkUnavailable, run_shaped
            try:
                found = run_shaped(cmd, link, env=env, capture=True,
                                   timeout=args.link_timeout_s)
            except ShapedLinkUnavailable as exc:
                print("## %s link: not measured: %s\n" % (link, exc), flush=True)
                continue
            code, out, err = found.returncode, found.stdout, found.stderr
        tables = [line for line in (out or "").splitlines() if not line.startswith("OVERLAP ")]
        print("## %s link\n\n%s\n" % (link, "\n".join(tables).strip()), flush=True)
        if code != 0:
            print("(exit status %d)\n%s" % (code, (err or "")[-2000:]), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="resnet50")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget-s", type=float, default=40.0,
                        help="stop repeating after this many seconds (at least 3 repeats)")
    parser.add_argument("--bucket-bytes", type=int, default=None)
    parser.add_argument("--compute", choices=("sin", "sleep"), default="sin",
                        help="the compute stand-in: np.sin on the CPU, or a sleep (a GPU's "
                             "kernel: the CPU is free)")
    parser.add_argument("--compute-ratio", type=float, default=1.0,
                        help="backward compute time / all-reduce time")
    parser.add_argument("--json", default=None)
    parser.add_argument("--links", default=None,
                        help="comma-separated: local and/or rates (1gbit, 10gbit, ...)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--link-timeout-s", type=float, default=150.0)
    args, rest = parser.parse_known_args()
    if args.links:
        passed = [a for a in sys.argv[1:] if a not in ("--links", args.links)
                  and not a.startswith("--links=")]
        drive(args, passed)
    else:
        rank_program(args)


if __name__ == "__main__":
    main()
