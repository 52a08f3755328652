"""One gradient all-reduce of ResNet-50 on one GPU: commlib against PyTorch.

    python benchmarks/gpu_step.py                      # GPU if cupy sees one, else CPU
    python benchmarks/gpu_step.py --out results/       # also write results/gpu_step.json
    python benchmarks/gpu_step.py --device cpu         # commlib on numpy only (no torch)

The ResNet-50 gradient list (161 float32 arrays, benchmarks/workloads/
resnet50.json, filled with fresh normal random values) is all-reduced at
world size 1, three ways, each by commlib and by the PyTorch equivalent in
the same process on the same GPU:

* dense: ``comm.all_reduce(grads, op="avg")`` over NCCL (commlib's default
  buckets) against ``torch.distributed`` NCCL all-reduces of the same
  buckets, flattened as DDP does (``torch.cat`` into a bucket buffer,
  ``all_reduce``, divide, copy back with ``torch._foreach_copy_``);
* fp16: ``compression="fp16"`` against DDP's ``fp16_compress_hook`` called
  on those bucket buffers through a minimal GradBucket stand-in (the hook's
  own code: cast, divide, ``all_reduce``, cast back); if the hook cannot be
  called, its steps written out (the row's note says which ran);
* topk-1%: ``compression=TopK(0.01)`` (per bucket, error feedback) against
  the usual per-tensor compressor with error feedback (GRACE's TopK with
  residual memory): ``torch.topk`` of ``|grad + residual|``, ``all_gather``
  of values and indices, ``index_add_`` into zeros.

Per variant: device time (CUDA events on the stream around the call, with a
spin kernel queued ahead so that launching overlaps GPU time; median of the
repeats), host time (``time.perf_counter`` around the Python call, GPU idle
before it; median), their commlib / torch ratios, whether commlib's call
waited for the GPU before returning, and the physical limit: one read and
one write of the whole list at the device-to-device copy bandwidth measured
in the same run. Every commlib result is checked once against a host
reference (dense: the input; fp16: its float16 round trip; top-K: the
largest-magnitude entries of gradient + residual per bucket, over two calls);
a wrong result shows FAIL and makes the exit status 1. The torch results
are checked the same way (their own column). Each comparison is guarded: a
failure is reported in its row and the others still run; a watch dog prints
what was measured and exits if the whole run exceeds ``--time-limit``.

Without a GPU (``--device cpu``) commlib's part runs on numpy arrays
(``Communicator.single()``, or ``--cpu-comm mpi`` for an MPI singleton),
"device" time is the call's wall time, and the torch part is skipped with
the reason printed. ``--profile N`` adds cProfile's view of N calls per
commlib variant: the functions that cost most host time per call.
"""
import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_spin  # noqa: E402

WORKLOADS = ROOT / "benchmarks" / "workloads"
VARIANTS = ("dense", "fp16", "topk-1%")
TOPK_RATIO = 0.01
HOST_TARGET_US = 150.0          # commlib's host time per compressed call at world size 1
COLUMNS = ("variant", "commlib device ms", "torch device ms", "device commlib/torch",
           "commlib host ms", "torch host ms", "host commlib/torch", "limit ms",
           "commlib waits for GPU", "commlib check", "torch check", "notes")



def log(*parts):
    print("[gpu_step %6.1f s]" % (time.monotonic() - START), *parts, flush=True)


def short(exc):
    text = "%s: %s" % (type(exc).__name__, exc)
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


START = time.monotonic()


# ------------------------------------------------------------------ results

class Results:
    """Everything measured so far (the watch dog prints it on a timeout)."""

    def __init__(self, args):
        self.config = {k: v for k, v in vars(args).items()}
        self.env = {}
        self.rows = {v: {"variant": v, "commlib": {}, "torch": {}, "notes": []}
                     for v in VARIANTS}
        self.host_target = {}
        self.limit = {}
        self.profile = {}
        self.errors = []
        self.section = "start"
        self.lock = threading.Lock()

    def note(self, variant, text):
        self.rows[variant]["notes"].append(text)

    def error(self, where, exc):
        text = "%s: %s" % (where, short(exc))
        self.errors.append({"where": where, "error": short(exc),
                            "traceback": traceback.format_exc()})
        log("ERROR", text)
        return text

    def as_json(self):
        return {"config": self.config, "env": self.env, "limit": self.limit,
                "rows": [self.rows[v] for v in VARIANTS], "host_target": self.host_target,
                "goals": goals(self),
                "profile": self.profile, "errors": self.errors,
                "table": table_rows(self), "seconds": time.monotonic() - START}


def fmt_ms(value):
    if value is None:
        return "-"
    return "%.3f" % value if value < 10 else "%.1f" % value


def fmt_ratio(a, b):
    if a is None or b is None or b <= 0:
        return "-"
    return "%.2f" % (a / b)


def table_rows(res):
    out = []
    limit = res.limit.get("ms")
    for v in VARIANTS:
        row = res.rows[v]
        c, t = row["commlib"], row["torch"]
        cd, td = c.get("device_ms"), t.get("device_ms")
        ch, th = c.get("host_ms"), t.get("host_ms")
        waits = c.get("waits_for_gpu")
        out.append({
            "variant": v,
            "commlib device ms": fmt_ms(cd), "torch device ms": fmt_ms(td),
            "device commlib/torch": fmt_ratio(cd, td),
            "commlib host ms": fmt_ms(ch), "torch host ms": fmt_ms(th),
            "host commlib/torch": fmt_ratio(ch, th),
            "limit ms": fmt_ms(limit),
            "commlib waits for GPU": "-" if waits is None else ("yes" if waits else "no"),
            "commlib check": c.get("check", "not run"),
            "torch check": t.get("check", "not run"),
            "notes": "; ".join(row["notes"]) or "-",
        })
    return out


def goals(res):
    """The run's goals, each ``{"name", "target", "value", "status"}``:
    commlib faster than torch in device and in host time, per variant, and
    the compressed variants' host time per call within HOST_TARGET_US. A
    goal is PASS or FAIL only where it was measured on a GPU (cupy arrays;
    the host goal over NCCL), else n/a; a failed check is a FAIL."""
    out = []
    on_gpu = res.env.get("device") == "gpu"
    nccl = res.host_target.get("transport") == "nccl"

    def goal(name, target, value, ok, measured):
        status = "n/a" if not measured or ok is None else ("PASS" if ok else "FAIL")
        out.append({"name": name, "target": target, "value": value, "status": status})

    for v in VARIANTS:
        c, t = res.rows[v]["commlib"], res.rows[v]["torch"]
        checked = c.get("check") == "ok" and t.get("check") == "ok"
        for what in ("device", "host"):
            a, b = c.get(what + "_ms"), t.get(what + "_ms")
            ratio = None if a is None or b is None or b <= 0 else a / b
            goal("%s %s commlib/torch" % (v, what), "< 1", ratio,
                 None if ratio is None else ratio < 1 and checked, on_gpu)
        if v != "dense":
            us = res.host_target.get("us", {}).get(v)
            goal("%s host us per call" % v, "<= %g us" % HOST_TARGET_US, us,
                 None if us is None else us <= HOST_TARGET_US and c.get("check") == "ok",
                 on_gpu and nccl)
    return out


def print_goals(res):
    print()
    for g in goals(res):
        value = "-" if g["value"] is None else "%.3f" % g["value"]
        print("goal %-32s %-10s %12s  %s" % (g["name"], g["target"], value, g["status"]))


def print_table(res):
    rows = table_rows(res)
    print()
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(str(r[c]).replace("|", "/") for c in COLUMNS) + " |")
    print()
    if res.limit:
        print("limit: one read + one write of %.1f MB at %.0f GB/s (copy bandwidth measured "
              "in this run: %s)" % (res.limit["bytes"] / 1e6, res.limit.get("gbps", 0),
                                    res.limit.get("how", "?")))
    ht = res.host_target
    if ht:
        print()
        print("=" * 78)
        print("commlib host time per all_reduce call: %s, %d arrays, %s buckets, world size 1, "
              "transport %s" % (ht.get("workload"), ht.get("arrays", 0), ht.get("buckets", "?"),
                                ht.get("transport")))
        if ht.get("transport") != "nccl":
            print("  (not NCCL: the data work runs inside the call, so these are not comparable "
                  "with the target, which is for cupy arrays over NCCL)")
        for v in VARIANTS:
            us = ht.get("us", {}).get(v)
            if us is None:
                print("  %-8s  not measured" % v)
                continue
            verdict = ""
            if v != "dense":
                verdict = ("  [target <= %.0f us: %s]"
                           % (HOST_TARGET_US, "met" if us <= HOST_TARGET_US else "MISSED"))
            issued = ht.get("issue_us", {}).get(v)
            print("  %-8s  %9.1f us%s%s" % (v, us, verdict, "" if issued is None else
                                            "  (async_op=True: %.1f us in the caller's thread)"
                                            % issued))
        print("=" * 78)
    if res.errors:
        print()
        print("errors (%d):" % len(res.errors))
        for e in res.errors:
            print("  - %s: %s" % (e["where"], e["error"]))


def write_json(res, out_dir):
    if not out_dir:
        return
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "gpu_step.json").write_text(json.dumps(res.as_json(), indent=1, default=str))
    log("wrote", path / "gpu_step.json")


def start_watchdog(res, args):
    """After ``--time-limit`` seconds: print what was measured, write the
    JSON, dump the stacks, and exit with status 3."""
    def fire():
        with res.lock:
            res.errors.append({"where": "watch dog", "error": "run exceeded %.0f s in section %r"
                               % (args.time_limit, res.section), "traceback": ""})
            print("\nWATCH DOG: the run exceeded %.0f s (section %r); results so far:"
                  % (args.time_limit, res.section), flush=True)
            try:
                print_table(res)
                write_json(res, args.out)
            finally:
                import faulthandler
                faulthandler.dump_traceback(all_threads=True)
                sys.stdout.flush()
                os._exit(3)
    timer = threading.Timer(args.time_limit, fire)
    timer.daemon = True
    timer.start()
    return timer


# ------------------------------------------------------------------ clocks

class CpuClock:
    """numpy: the call's wall time is its "device" time too."""
    kind = "cpu"

    def sync(self):
        pass

    def measure(self, fn, prepare, repeats, warmup):
        for _ in range(warmup):
            prepare()
            fn()
        samples = []
        for _ in range(repeats):
            prepare()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        ms = [1e3 * s for s in samples]
        return {"device_ms": statistics.median(ms), "host_ms": statistics.median(ms),
                "step_ms": statistics.median(ms), "device_samples_ms": ms,
                "host_samples_ms": ms, "waits_for_gpu": None}

    def copy_limit(self, nbytes, repeats):
        src = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.empty_like(src)
        r = self.measure(lambda: np.copyto(dst, src), lambda: None, max(5, repeats // 2), 1)
        return r["device_ms"], "numpy copyto of one %.1f MB buffer" % (src.nbytes / 1e6)


class GpuClock:
    """CUDA events (cupy) on the current stream; a spin kernel queued ahead
    of each timed call so that the host's launching overlaps GPU time."""
    kind = "gpu"

    def __init__(self, cupy):
        self.cupy = cupy
        self.spin = None
        self.spin_error = None
        try:
            spin = gpu_spin.spin_kernel(cupy)
            spin((1,), (1,), (np.int64(1000),))
            cupy.cuda.runtime.deviceSynchronize()
            self.spin = spin
        except Exception as exc:        # no NVRTC: device times then include launch gaps
            self.spin_error = short(exc)

    def sync(self):
        self.cupy.cuda.runtime.deviceSynchronize()

    def measure(self, fn, prepare, repeats, warmup):
        cupy = self.cupy
        for _ in range(warmup):
            prepare()
            fn()
        self.sync()
        prepare()
        self.sync()
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        self.sync()
        spin_ns = int(min(60e6, max(100e3, 2e9 * first)))
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        device, spun_host = [], []
        for _ in range(repeats):
            prepare()
            self.sync()
            if self.spin is not None:
                self.spin((1,), (1,), (np.int64(spin_ns),))
            start.record()
            t0 = time.perf_counter()
            fn()
            spun_host.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            device.append(cupy.cuda.get_elapsed_time(start, end))
        host, step = [], []
        for _ in range(repeats):
            prepare()
            self.sync()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            self.sync()
            t2 = time.perf_counter()
            host.append(1e3 * (t1 - t0))
            step.append(1e3 * (t2 - t0))
        spun, idle = 1e3 * statistics.median(spun_host), statistics.median(host)
        return {"device_ms": statistics.median(device), "host_ms": idle,
                "step_ms": statistics.median(step), "device_samples_ms": device,
                "host_samples_ms": host, "host_under_spin_ms": spun, "spin_ms": spin_ns / 1e6,
                # a call that waits for the GPU takes longer behind the spin kernel than
                # with the GPU idle (by about the spin's length)
                "waits_for_gpu": (spun - idle >= 0.5 * spin_ns / 1e6) if self.spin is not None
                else None}

    def copy_limit(self, nbytes, repeats):
        cupy = self.cupy
        src = cupy.ones(nbytes // 4, dtype=cupy.float32)
        dst = cupy.empty_like(src)
        r = self.measure(lambda: dst.data.copy_from_device_async(src.data, src.nbytes),
                         lambda: None, max(10, repeats), 2)
        del src, dst
        return r["device_ms"], "cupy device-to-device copy of one %.1f MB buffer" % (
            nbytes / 1e6)


# ------------------------------------------------------------------ data

def issue_ms(clock, issue, prepare, repeats):
    """Median milliseconds of ``issue()`` alone, the GPU idle before each
    call: what an asynchronous call (``issue`` returns its Work, waited for
    after the clock stops) costs the caller's thread."""
    times = []
    for _ in range(repeats):
        prepare()
        clock.sync()
        t0 = time.perf_counter()
        work = issue()
        times.append(1e3 * (time.perf_counter() - t0))
        work.wait()
        clock.sync()
    return statistics.median(times)


def load_shapes(name):
    spec = json.loads((WORKLOADS / (name + ".json")).read_text())
    return [tuple(int(d) for d in s) for s in spec["shapes"]]


def host_values(shapes, seed):
    """One flat float32 host array of fresh normal values for ``shapes``."""
    total = sum(int(np.prod(s)) for s in shapes)
    return np.random.default_rng(seed).standard_normal(total, dtype=np.float32)


def split(flat, shapes):
    out, at = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(flat[at:at + n].reshape(s))
        at += n
    return out


class Grads:
    """The gradient list (separate arrays, as a training loop allocates
    them) and a pristine copy to restore before every timed call."""

    def __init__(self, xp, shapes, host_flat):
        self.xp, self.shapes = xp, shapes
        self.pristine_flat = xp.asarray(host_flat)
        self.pristine = split(self.pristine_flat, shapes)
        self.arrays = [xp.empty(s, dtype=np.float32) for s in shapes]
        self.restore()

    def restore(self, source=None):
        source = self.pristine if source is None else source
        for a, s in zip(self.arrays, source):
            self.xp.copyto(a, s)

    def host(self):
        """The arrays' values, as host numpy arrays (one per array)."""
        if self.xp is np:
            return [a.copy() for a in self.arrays]
        return [a.get() for a in self.arrays]


# ------------------------------------------------------------------ checks

def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def check_equal(outs, wants):
    """"ok" when every output has the bits of its reference, else FAIL with counts."""
    bad = [i for i, (o, w) in enumerate(zip(outs, wants)) if not same_bits(o, w)]
    if not bad:
        return "ok"
    i = bad[0]
    diff = int(np.count_nonzero(outs[i].view(np.uint32) != wants[i].view(np.uint32)))
    return "FAIL (%d of %d arrays differ; array %d: %d values)" % (len(bad), len(outs), i, diff)


def check_topk(outs, accs, units, k_for):
    """Top-K per unit (a tuple of array indices fused into one selection):
    the output's non-zero entries are exactly ``k_for(n)`` entries of the
    accumulated ``accs`` (gradient + residual), none smaller in magnitude
    than any entry left out, and the rest of the output is 0. Returns
    ("ok" or "FAIL ...", residual arrays = accs - outs)."""
    problems = []
    for u, unit in enumerate(units):
        out = np.concatenate([outs[i].reshape(-1) for i in unit])
        acc = np.concatenate([accs[i].reshape(-1) for i in unit])
        k = k_for(acc.size)
        sent = out != 0
        count = int(np.count_nonzero(sent))
        if count != k:
            problems.append("unit %d: %d entries sent, expected %d" % (u, count, k))
            continue
        if not same_bits(out[sent], acc[sent]):
            problems.append("unit %d: sent values differ from gradient + residual" % u)
            continue
        if count < acc.size and np.abs(acc[sent]).min() < np.abs(acc[~sent]).max():
            problems.append("unit %d: an entry left out is larger than one sent" % u)
    residual = [a - o for a, o in zip(accs, outs)]
    if problems:
        return "FAIL (%s)" % "; ".join(problems[:3]), residual
    return "ok", residual


# ------------------------------------------------------------------ commlib

def make_communicator(args, gpu, res):
    import commlib
    options = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
    if not gpu:
        if args.cpu_comm == "mpi":
            return commlib.Communicator.from_mpi(backend="mpi", **options), "from_mpi(backend='mpi')"
        return commlib.Communicator.single(**options), "Communicator.single()"
    try:
        comm = commlib.Communicator.from_nccl_id(commlib.NcclId(), 0, 1, device=0, **options)
        return comm, "from_nccl_id(NcclId(), 0, 1)"
    except Exception as exc:
        why = res.error("commlib: from_nccl_id", exc)
    comm = commlib.Communicator.single(device=0, **options)
    for v in VARIANTS:
        res.note(v, "commlib NOT over NCCL (%s); Communicator.single(device=0)" % why)
    return comm, "Communicator.single(device=0) after from_nccl_id failed"


def bucket_units(comm, arrays, args):
    """commlib's fusion units for ``arrays``: the buckets' index tuples and
    the arrays reduced in place, from commlib's bucket plan, and the bucket
    size used."""
    from commlib.collective import bucketing
    bucket_bytes = args.bucket_bytes or bucketing.DEFAULT_BUCKET_BYTES.get(comm.backend,
                                                                           25 << 20)
    plan = bucketing.plan_for(arrays, bucket_bytes)
    units = [tuple(b.indices) for b in plan.buckets] + [(i,) for i in plan.direct]
    return units, bucket_bytes, len(plan.buckets), len(plan.direct)


def k_of(strategy):
    def k_for(n):
        try:
            return int(strategy.k_for(n))
        except Exception:
            return min(n, max(1, math.ceil(TOPK_RATIO * n)))
    return k_for


def commlib_variant(name):
    from commlib.compression import TopK
    return {"dense": None, "fp16": "fp16", "topk-1%": TopK(TOPK_RATIO)}[name]


def commlib_check(name, comm, grads, units, second_flat, strategy):
    """Run the first call(s) of ``name`` on fresh gradients and check them."""
    xp = grads.xp
    pristine = split(np.asarray(grads.pristine_flat if xp is np else grads.pristine_flat.get()),
                     grads.shapes)
    grads.restore()
    comm.all_reduce(grads.arrays, op="avg", compression=strategy)
    outs = grads.host()
    if name == "dense":
        return check_equal(outs, pristine)
    if name == "fp16":
        return check_equal(outs, [p.astype(np.float16).astype(np.float32) for p in pristine])
    # top-K: two calls, the second on new gradients plus the first's residual
    first, residual = check_topk(outs, pristine, units, k_of(strategy))
    if first != "ok":
        return "call 1: " + first
    second = split(second_flat, grads.shapes)
    grads.restore([xp.asarray(s) for s in second])
    comm.all_reduce(grads.arrays, op="avg", compression=strategy)
    outs = grads.host()
    accs = [s + r for s, r in zip(second, residual)]
    verdict, _ = check_topk(outs, accs, units, k_of(strategy))
    return "ok" if verdict == "ok" else "call 2: " + verdict


# ------------------------------------------------------------------ torch

class TorchSide:
    """The PyTorch baselines on the same gradients (torch tensors of their own)."""

    def __init__(self, torch, dist, shapes, host_flat, units, res):
        self.torch, self.dist, self.res = torch, dist, res
        self.shapes = shapes
        dev = torch.device("cuda", 0)
        self.pristine_flat = torch.from_numpy(host_flat).to(dev)
        self.pristine = [p.view(-1) for p in split(self.pristine_flat, shapes)]
        self.grads = [torch.empty(s, dtype=torch.float32, device=dev) for s in shapes]
        self.flat_views = [g.view(-1) for g in self.grads]
        self.world = dist.get_world_size()
        # the buckets: the same arrays as commlib's, packed in the same order
        self.buckets = []
        for unit in units:
            views = [self.flat_views[i] for i in unit]
            sizes = [v.numel() for v in views]
            buf = torch.empty(sum(sizes), dtype=torch.float32, device=dev)
            self.buckets.append((views, buf, list(buf.split(sizes))))
        self.foreach = self._has_foreach_copy()
        self.hook, self.hook_how = self._fp16_hook()
        # top-K: per tensor, its k, residual and gather buffers
        self.topk_state = []
        for v in self.flat_views:
            k = min(v.numel(), max(1, math.ceil(TOPK_RATIO * v.numel())))
            self.topk_state.append((
                k, torch.zeros_like(v),
                torch.empty(self.world * k, dtype=torch.int64, device=dev),
                torch.empty(self.world * k, dtype=torch.float32, device=dev)))
        self.restore()

    def _has_foreach_copy(self):
        torch = self.torch
        try:
            a, b = torch.zeros(3, device="cuda"), torch.ones(3, device="cuda")
            torch._foreach_copy_([a], [b])
            return bool(a.sum().item() == 3)
        except Exception:
            return False

    def _fp16_hook(self):
        try:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import \
                fp16_compress_hook
            return fp16_compress_hook, "DDP fp16_compress_hook on a GradBucket stand-in"
        except Exception as exc:
            return None, "fp16_compress_hook not importable (%s): its steps inline" % short(exc)

    def restore(self):
        if self.foreach:
            self.torch._foreach_copy_(self.flat_views, self.pristine)
        else:
            for g, p in zip(self.flat_views, self.pristine):
                g.copy_(p)

    def _copy_out(self, views, parts):
        if self.foreach:
            self.torch._foreach_copy_(views, parts)
        else:
            for v, p in zip(views, parts):
                v.copy_(p)

    def dense(self):
        torch, dist = self.torch, self.dist
        for views, buf, parts in self.buckets:
            torch.cat(views, out=buf)
            dist.all_reduce(buf)
            buf.div_(self.world)
            self._copy_out(views, parts)

    def fp16(self):
        torch, dist = self.torch, self.dist
        futures = []
        for i, (views, buf, parts) in enumerate(self.buckets):
            torch.cat(views, out=buf)
            if self.hook is not None:
                futures.append(self.hook(None, _GradBucket(i, buf, i == len(self.buckets) - 1,
                                                           views)))
            else:       # the hook's steps: cast, divide, all-reduce, cast back
                half = buf.to(torch.float16).div_(self.world)
                dist.all_reduce(half)
                buf.copy_(half)
        for fut in futures:
            fut.wait()
        for views, buf, parts in self.buckets:
            self._copy_out(views, parts)

    def topk(self):
        torch, dist = self.torch, self.dist
        for g, (k, residual, all_idx, all_val) in zip(self.flat_views, self.topk_state):
            g.add_(residual)                           # compensate: gradient + residual
            _, idx = torch.topk(g.abs(), k, sorted=False)
            val = g.gather(0, idx)
            residual.copy_(g).index_fill_(0, idx, 0)   # what is not sent stays behind
            dist.all_gather_into_tensor(all_idx, idx)
            dist.all_gather_into_tensor(all_val, val)
            g.zero_().index_add_(0, all_idx, all_val).div_(self.world)

    def reset_topk(self):
        for _, residual, _, _ in self.topk_state:
            residual.zero_()

    def host(self):
        return [g.cpu().numpy() for g in self.grads]


class _GradBucket:
    """What ``fp16_compress_hook`` reads of DDP's GradBucket."""

    def __init__(self, index, buf, last, views):
        self._index, self._buf, self._last, self._views = index, buf, last, views

    def index(self):
        return self._index

    def buffer(self):
        return self._buf

    def is_last(self):
        return self._last

    def gradients(self):
        return list(self._views)

    def parameters(self):
        return []

    def set_buffer(self, buf):
        self._buf.copy_(buf)


def init_torch(res):
    """(torch, dist) with a world-size-1 NCCL process group, or raises."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    if dist.is_initialized():
        return torch, dist
    try:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        res.env["torch_init"] = "HashStore"
    except Exception as exc:
        res.error("torch: init_process_group(store=HashStore())", exc)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=0,
                                world_size=1)
        res.env["torch_init"] = "tcp://127.0.0.1:%d" % port
    return torch, dist


def torch_stream_context(torch, cupy):
    """A context making cupy's current stream torch's (events and the spin
    kernel then sit on the stream torch's work is on)."""
    import contextlib
    ptr = torch.cuda.current_stream().cuda_stream
    if ptr == cupy.cuda.get_current_stream().ptr:
        return contextlib.nullcontext(), ptr
    return cupy.cuda.ExternalStream(ptr), ptr


# ------------------------------------------------------------------ profile

def profile_calls(fn, prepare, calls, top):
    """cProfile of ``calls`` calls of ``fn`` (``prepare`` between, not
    profiled): the ``top`` functions by own time, per call."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    for _ in range(calls):
        prepare()
        prof.enable()
        fn()
        prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    total = 0.0
    for (path, line, func), (cc, nc, tt, ct, _) in stats.stats.items():
        total += tt
        where = "%s:%d" % (os.path.relpath(path, ROOT) if path.startswith(str(ROOT)) else
                           os.path.basename(path), line)
        rows.append({"function": func, "where": where, "calls_per_call": nc / calls,
                     "own_us": 1e6 * tt / calls, "cumulative_us": 1e6 * ct / calls})
    rows.sort(key=lambda r: -r["own_us"])
    return {"calls": calls, "total_us": 1e6 * total / calls, "top": rows[:top]}


def print_profile(res):
    for v, p in res.profile.items():
        if "error" in p:
            print("\nprofile %s: %s" % (v, p["error"]))
            continue
        print("\nprofile %s: %.0f us of Python per call (cProfile, %d calls; own time)"
              % (v, p["total_us"], p["calls"]))
        print("| own us/call | cumulative us/call | calls/call | function |")
        print("|---|---|---|---|")
        for r in p["top"]:
            print("| %.1f | %.1f | %.0f | %s (%s) |" % (r["own_us"], r["cumulative_us"],
                                                      r["calls_per_call"], r["function"],
                                                      r["where"]))


# ------------------------------------------------------------------ main

def environment(res, gpu, cupy, torch):
    env = res.env
    env.update({"python": sys.version.split()[0], "numpy": np.__version__,
                "machine": platform.machine(), "host": platform.node()})
    try:
        env["commlib_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
            text=True, timeout=5).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "commlib"],
            capture_output=True, text=True, timeout=5).stdout.split("\n")
        env["commlib_uncommitted_files"] = len([ln for ln in changed if ln.strip()])
    except Exception:
        pass
    try:
        import mpi4py
        env["mpi4py"] = mpi4py.__version__
    except Exception as exc:
        env["mpi4py"] = "not importable (%s)" % short(exc)
    if cupy is not None:
        try:
            env["cupy"] = cupy.__version__
            props = cupy.cuda.runtime.getDeviceProperties(0)
            name = props.get("name", b"?")
            env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
            env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        except Exception as exc:
            env["cupy_error"] = short(exc)
        try:
            from cupy.cuda import nccl
            env["cupy_nccl"] = nccl.get_version()
        except Exception as exc:
            env["cupy_nccl"] = "unavailable (%s)" % short(exc)
    if torch is not None:
        try:
            env["torch"] = torch.__version__
            env["torch_cuda"] = torch.version.cuda
            env["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:
            env["torch_error"] = short(exc)
    try:
        from commlib.core import gpu
        env["commlib_nccl_unavailable"] = gpu.nccl_unavailable_reason() if gpu else "cpu run"
    except Exception as exc:
        env["commlib_nccl_unavailable"] = short(exc)


def init_probe(res, timeout):
    """Does ``commlib.init()`` work in a plain process (no mpiexec)? Run in a
    child so that an MPI singleton that cannot start cannot end this run."""
    code = ("import sys; sys.path.insert(0, %r); import commlib; c = commlib.init(); "
            "print('INIT', c.backend, c.size, c.device); c.close()" % str(ROOT))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("INIT")]
        if proc.returncode == 0 and found:
            res.env["commlib_init"] = found[-1][5:]
        else:
            tail = " ".join((proc.stderr or proc.stdout).split()[-40:])
            res.env["commlib_init"] = "failed (exit %d): %s" % (proc.returncode, tail)
    except subprocess.TimeoutExpired:
        res.env["commlib_init"] = "did not return within %.0f s" % timeout
    except Exception as exc:
        res.env["commlib_init"] = "probe failed: %s" % short(exc)
    log("commlib.init() in a fresh process:", res.env["commlib_init"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="gpu: cupy arrays, NCCL, and the torch comparison; cpu: numpy arrays, "
                        "commlib only (default: gpu when cupy sees a GPU)")
    p.add_argument("--workload", default="resnet50",
                   help="gradient list from benchmarks/workloads/ (default: resnet50)")
    p.add_argument("--repeats", type=int, default=30, help="timed repeats (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="commlib's bucket_bytes, and the torch buckets' size "
                        "(default: commlib's default for the transport)")
    p.add_argument("--cpu-comm", choices=("single", "mpi"), default="single",
                   help="--device cpu: Communicator.single() or an MPI singleton")
    p.add_argument("--no-torch", action="store_true", help="skip the torch comparison")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also cProfile N calls of each commlib variant (default 0: off)")
    p.add_argument("--profile-top", type=int, default=12)
    p.add_argument("--no-init-probe", action="store_true",
                   help="skip trying commlib.init() in a child process")
    p.add_argument("--time-limit", type=float, default=85.0,
                   help="seconds before the watch dog prints what it has and exits "
                        "(default 85)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for gpu_step.json")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    res = Results(args)
    start_watchdog(res, args)
    shapes = load_shapes(args.workload)
    nbytes = 4 * sum(int(np.prod(s)) for s in shapes)
    log("%s: %d arrays, %.1f MB" % (args.workload, len(shapes), nbytes / 1e6))

    # torch first (when asked): it loads its own CUDA and NCCL libraries
    torch = cupy = None
    torch_skip = None
    gpu = args.device == "gpu"
    if args.device == "auto":
        try:
            from commlib.core import gpu
            gpu = gpu.available()
            if not gpu:
                torch_skip = "no GPU (%s)" % gpu.unavailable_reason()
        except Exception as exc:
            torch_skip = "no GPU (%s)" % short(exc)
    if not gpu:
        torch_skip = torch_skip or "--device cpu: the torch comparison needs a GPU"
    elif args.no_torch:
        torch_skip = "--no-torch"
    else:
        try:
            import torch
            if not torch.cuda.is_available():
                torch_skip, torch = "torch sees no CUDA device", None
        except Exception as exc:
            torch_skip = "torch not importable: %s" % short(exc)
            torch = None
    if gpu:
        import cupy
        cupy.cuda.Device(0).use()
    xp = cupy if gpu else np
    environment(res, gpu, cupy, torch)
    res.env["device"] = "gpu" if gpu else "cpu"
    log("environment:", json.dumps(res.env, default=str))
    if torch_skip:
        print("torch comparison skipped: %s" % torch_skip, flush=True)
        res.env["torch_skipped"] = torch_skip
        for v in VARIANTS:
            res.rows[v]["torch"]["check"] = "skipped"

    clock = GpuClock(cupy) if gpu else CpuClock()
    if gpu and clock.spin is None:
        res.env["spin_kernel"] = "unavailable (%s): device times include launch gaps" % (
            clock.spin_error)

    # the physical limit: one read and one write of the list
    res.section = "copy limit"
    try:
        ms, how = clock.copy_limit(nbytes, args.repeats)
        res.limit = {"bytes": nbytes, "ms": ms, "gbps": 2 * nbytes / ms / 1e6, "how": how}
        log("limit: %.3f ms (%.0f GB/s)" % (ms, res.limit["gbps"]))
    except Exception as exc:
        res.error("copy limit", exc)

    host_flat = host_values(shapes, args.seed)
    second_flat = host_values(shapes, args.seed + 1)

    # commlib
    res.section = "commlib setup"
    comm = grads = units = None
    try:
        comm, how = make_communicator(args, gpu, res)
        grads = Grads(xp, shapes, host_flat)
        units, bucket_bytes, n_buckets, n_direct = bucket_units(comm, grads.arrays, args)
        res.env.update({"commlib_comm": how, "commlib_backend": comm.backend,
                        "bucket_bytes": bucket_bytes, "buckets": n_buckets,
                        "in_place_arrays": n_direct})
        res.host_target.update({"workload": args.workload, "arrays": len(shapes),
                                "buckets": "%d (+%d in place)" % (n_buckets, n_direct)
                                if n_direct else n_buckets,
                                "transport": comm.backend, "us": {}, "issue_us": {}})
        log("commlib: %s, backend %s, %d buckets of <= %d bytes, %d arrays in place"
            % (how, comm.backend, n_buckets, bucket_bytes, n_direct))
    except Exception as exc:
        text = res.error("commlib setup", exc)
        for v in VARIANTS:
            res.rows[v]["commlib"]["check"] = "not run: " + text

    # torch
    side = None
    stream_ctx = None
    if torch is not None and units is not None:
        res.section = "torch setup"
        try:
            torch, dist = init_torch(res)
            side = TorchSide(torch, dist, shapes, host_flat, units, res)
            stream_ctx, ptr = torch_stream_context(torch, cupy)
            res.env["torch_stream"] = ptr
            res.env["torch_fp16"] = side.hook_how
            res.env["torch_foreach_copy"] = side.foreach
        except Exception as exc:
            text = res.error("torch setup", exc)
            side = None
            for v in VARIANTS:
                res.rows[v]["torch"]["check"] = "not run: " + text

    for v in VARIANTS:
        if comm is not None and grads is not None:
            res.section = "commlib " + v
            row = res.rows[v]["commlib"]
            try:
                strategy = commlib_variant(v)
                row["check"] = commlib_check(v, comm, grads, units, second_flat, strategy)
                before = comm.stats.snapshot() if hasattr(comm.stats, "snapshot") else None

                def call(strategy=strategy):
                    comm.all_reduce(grads.arrays, op="avg", compression=strategy)

                call()
                if before is not None:
                    after = comm.stats.snapshot()
                    try:
                        row["bytes_sent_per_call"] = after["bytes_sent"] - before["bytes_sent"]
                    except Exception:
                        pass
                row.update(clock.measure(call, grads.restore, args.repeats, args.warmup))
                res.host_target["us"][v] = 1e3 * row["host_ms"]
                log("commlib %-8s device %.3f ms, host %.3f ms, check %s"
                    % (v, row["device_ms"], row["host_ms"], row["check"]))
            except Exception as exc:
                text = res.error("commlib " + v, exc)
                row.setdefault("check", "error")
                res.note(v, "commlib: " + text)
            try:
                row["issue_ms"] = issue_ms(clock, lambda strategy=strategy: comm.all_reduce(
                    grads.arrays, op="avg", compression=strategy, async_op=True),
                    grads.restore, args.repeats)
                res.host_target["issue_us"][v] = 1e3 * row["issue_ms"]
            except Exception as exc:
                res.note(v, "commlib async_op=True: " + res.error("commlib %s async" % v, exc))
        if side is not None:
            res.section = "torch " + v
            row = res.rows[v]["torch"]
            try:
                fn = {"dense": side.dense, "fp16": side.fp16, "topk-1%": side.topk}[v]
                with stream_ctx:
                    row["check"] = torch_check(v, side, host_flat, units)
                    row.update(clock.measure(fn, side.restore, args.repeats, args.warmup))
                if v == "fp16":
                    res.note(v, "torch: " + side.hook_how)
                if v == "topk-1%":
                    res.note(v, "torch per tensor (k = ceil(1 % of each tensor))")
                log("torch   %-8s device %.3f ms, host %.3f ms, check %s"
                    % (v, row["device_ms"], row["host_ms"], row["check"]))
            except Exception as exc:
                text = res.error("torch " + v, exc)
                row.setdefault("check", "error")
                res.note(v, "torch: " + text)

    if args.profile and comm is not None and grads is not None:
        for v in VARIANTS:
            res.section = "profile " + v
            try:
                strategy = commlib_variant(v)
                res.profile[v] = profile_calls(
                    lambda: comm.all_reduce(grads.arrays, op="avg", compression=strategy),
                    lambda: (grads.restore(), clock.sync()), args.profile, args.profile_top)
            except Exception as exc:
                res.profile[v] = {"error": res.error("profile " + v, exc)}

    if not args.no_init_probe:
        res.section = "init probe"
        init_probe(res, 20.0)

    res.section = "close"
    for what, close in (("commlib close", lambda: comm is not None and comm.close()),
                        ("torch close", lambda: side is not None and
                         side.dist.destroy_process_group())):
        try:
            close()
        except Exception as exc:
            res.error(what, exc)

    res.section = "report"
    with res.lock:
        print_profile(res)
        print_table(res)
        print_goals(res)
        write_json(res, args.out)
    failed = any(str(res.rows[v][side_]["check"]).startswith("FAIL")
                 for v in VARIANTS for side_ in ("commlib", "torch"))
    log("done in %.1f s%s" % (time.monotonic() - START, "; a check FAILED" if failed else ""))
    sys.stdout.flush()
    os._exit(1 if failed else 0)


def torch_check(name, side, host_flat, units):
    """Check the torch baseline's first call(s) on fresh gradients."""
    pristine = split(host_flat, side.shapes)
    side.restore()
    if name == "dense":
        side.dense()
        return check_equal(side.host(), pristine)
    if name == "fp16":
        side.fp16()
        return check_equal(side.host(), [p.astype(np.float16).astype(np.float32)
                                         for p in pristine])
    side.reset_topk()
    side.topk()
    per_tensor = [(i,) for i in range(len(side.shapes))]
    verdict, _ = check_topk(side.host(), pristine, per_tensor,
                            lambda n: min(n, max(1, math.ceil(TOPK_RATIO * n))))
    side.reset_topk()
    return verdict


if __name__ == "__main__":
    main()
