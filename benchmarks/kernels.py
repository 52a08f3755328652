"""Kernel benchmarks: commlib's CUDA kernels (without a GPU: their numpy twins)
against the built-ins a user would otherwise call.

    python benchmarks/kernels.py                       # GPU if cupy sees one, else CPU
    python benchmarks/kernels.py --out results/        # also write results/kernels.json
    python benchmarks/kernels.py --device cpu --sizes 1M --repeats 3

GPU timing: CUDA events around one call, the L2 cache flushed before each
repeat (a memset of twice its size) and a timed spin kernel queued ahead of
the call so the host-side Python work of launching it overlaps GPU time (the
"host us" column reports that work separately); the table shows the median of
the repeats. CPU timing: perf_counter around one call, a 64 MiB buffer written
before each repeat. GB/s counts the bytes an operation must read plus write
once; "% copy" compares it with a device-to-device copy moving as many bytes,
measured in the same run. Every operation's result is checked once; a wrong
result shows FAIL in the check column and makes the exit status 1. On a GPU,
"topk pass NAME" rows give the time of each top-K kernel (k = 1 %).
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_spin  # noqa: E402

from commlib.ops.cast import cast  # noqa: E402
from commlib.ops.pack import pack, unpack  # noqa: E402

RANKS = 4                                  # sparse accumulate: ranks gathered
FRACTIONS = (0.001, 0.01, 0.1)            # k / N for top-K and threshold
COPY_FRACTION = {"cast": 0.8, "pack": 0.8, "threshold": 0.85}
TOPK_SPEEDUP = {"torch.topk": 12.0, "cupy.argpartition": 40.0}
SPARSE_MAX_US = 25.0                       # at TARGET_N; faster than the baseline at every N
TOPK_MAX_US = 50.0                         # top-K device time at TARGET_N, k = 1 %
TOPK_SPREAD = 1.5                          # k = 0.1 % and 10 %: at most this times the 1 % time
HOST_MAX_US = 10.0                         # host time of every operation at TARGET_N
TARGET_N = 25_000_000                      # size the top-K and sparse targets refer to


# ---------------------------------------------------------------- timing

class GpuBench:
    """CUDA-event timing on the current device."""
    kind = "gpu"

    def __init__(self):
        import cupy
        self.xp = cupy
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props.get("name", b"?")
        self.device = name.decode() if isinstance(name, bytes) else str(name)
        self.l2_bytes = int(props.get("l2CacheSize", 0)) or (64 << 20)
        self._flush = cupy.empty(2 * self.l2_bytes, dtype=cupy.uint8)
        self._spin = gpu_spin.spin_kernel(cupy)
        self._copy_ms = {}

    def rng(self, seed):
        return self.xp.random.default_rng(seed)

    def measure(self, fn, repeats, warmup=2):
        """(samples in ms, median host-side microseconds per call)."""
        cupy = self.xp
        for _ in range(warmup):
            fn()
        cupy.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        cupy.cuda.get_current_stream().synchronize()
        spin_ns = np.int64(min(20e6, max(50e3, 3e9 * host)))
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        samples, hosts = [], []
        for _ in range(repeats):
            self._flush.fill(0)
            self._spin((1,), (1,), (spin_ns,))
            start.record()
            t0 = time.perf_counter()
            fn()
            hosts.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, end))
        return samples, 1e6 * statistics.median(hosts)

    def copy_ms(self, nbytes, repeats):
        """Median ms of a device-to-device copy of ``nbytes // 2`` bytes (it
        reads and writes ``nbytes`` in all)."""
        half = max(1, nbytes // 2)
        if half not in self._copy_ms:
            src = self.xp.ones(half, dtype=self.xp.uint8)
            dst = self.xp.empty_like(src)
            samples, _ = self.measure(lambda: dst.data.copy_from_device_async(src.data, half),
                                      repeats)
            self._copy_ms[half] = statistics.median(samples)
        return self._copy_ms[half]

    def host(self, a):
        return self.xp.asnumpy(a)


class CpuBench:
    """perf_counter timing of the numpy twins."""
    kind = "cpu"

    def __init__(self):
        import platform
        self.xp = np
        self.device = platform.processor() or platform.machine()
        self._flush = np.empty(64 << 20, dtype=np.uint8)
        self._copy_ms = {}

    def rng(self, seed):
        return np.random.default_rng(seed)

    def measure(self, fn, repeats, warmup=1):
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            self._flush.fill(1)
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
        return samples, 1e3 * statistics.median(samples)

    def copy_ms(self, nbytes, repeats):
        half = max(1, nbytes // 2)
        if half not in self._copy_ms:
            src = np.ones(half, dtype=np.uint8)
            dst = np.empty_like(src)
            samples, _ = self.measure(lambda: np.copyto(dst, src), repeats)
            self._copy_ms[half] = statistics.median(samples)
        return self._copy_ms[half]

    def host(self, a):
        return np.asarray(a)


# ---------------------------------------------------------------- cases

class Case:
    """One operation of commlib (``fn``) and what to compare it with.

    nbytes: bytes it must read plus write once. baselines: list of
    (name, callable). target: ("copy", fraction) | ("speedup", {baseline:
    factor}) | ("max_us", us) | None. check: callable -> bool, run once.
    """

    def __init__(self, name, n, k, fn, nbytes, baselines=(), target=None, check=None):
        self.name, self.n, self.k, self.fn, self.nbytes = name, n, k, fn, nbytes
        self.baselines, self.target, self.check = list(baselines), target, check


def bits_equal(bench, a, b):
    a, b = bench.host(a), bench.host(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def cast_cases(bench, n):
    xp = bench.xp
    x = bench.rng(1).standard_normal(n, dtype=np.float32)
    h16 = xp.empty(n, xp.float16)
    b16 = xp.empty(n, xp.uint16)
    counter = xp.zeros((), np.int64)
    acc0 = bench.rng(2).standard_normal(n, dtype=np.float32)
    acc = acc0.copy()
    half = np.float32(0.5)

    def check_f16():
        cast(x, "float16", out=h16)
        return bits_equal(bench, h16, x.astype(xp.float16))

    def check_bf16():
        cast(x, "bfloat16", scale=half, out=b16)
        m = min(n, 1 << 20)
        want, _ = cast(bench.host(x[-m:]), "bfloat16", scale=half)
        return bits_equal(bench, b16[-m:], want)

    def check_acc():
        cast(x, "float16", out=h16)
        mine = acc0.copy()
        cast(h16, "float32", scale=half, out=mine, accumulate=True)
        return bits_equal(bench, mine, acc0 + h16.astype(xp.float32) * half)

    def builtin_acc():
        xp.add(acc, h16.astype(xp.float32) * half, out=acc)

    return [
        Case("cast f32->f16", n, None,
             lambda: cast(x, "float16", out=h16, nonfinite=counter), 6 * n,
             [("astype(float16)", lambda: x.astype(xp.float16))],
             ("copy", COPY_FRACTION["cast"]), check_f16),
        Case("cast f32->bf16 x0.5", n, None,
             lambda: cast(x, "bfloat16", scale=half, out=b16, nonfinite=counter), 6 * n,
             [], ("copy", COPY_FRACTION["cast"]), check_bf16),
        Case("cast f16->f32 x0.5 +=", n, None,
             lambda: cast(h16, "float32", scale=half, out=acc, accumulate=True,
                          nonfinite=counter), 10 * n,
             [("+= astype(float32) * s", builtin_acc)], ("copy", COPY_FRACTION["cast"]),
             check_acc),
    ]


def pack_cases(bench, scale=1):
    """The pack cases on ResNet-50's arrays (161), each ``1/scale`` of its
    size (flat then) when ``scale`` is not 1."""
    xp = bench.xp
    shapes = json.loads((ROOT / "tests/data/resnet50.json").read_text())["shapes"]
    if scale != 1:
        shapes = [(max(1, int(np.prod(s)) // scale),) for s in shapes]
    rng = bench.rng(3)
    arrays = [rng.standard_normal(int(np.prod(s)), dtype=np.float32).reshape(s) for s in shapes]
    n = sum(a.size for a in arrays)
    b32 = xp.empty(n, xp.float32)
    b16 = xp.empty(n, xp.float16)
    s = np.float32(0.125)

    def concat32():
        xp.concatenate([a.ravel() for a in arrays], out=b32)

    def concat16():
        b16[...] = (xp.concatenate([a.ravel() for a in arrays]) * s).astype(xp.float16)

    def unpack_builtin():
        lo = 0
        for a in arrays:
            a += b16[lo:lo + a.size].reshape(a.shape).astype(xp.float32) * s
            lo += a.size

    def check_pack32():
        pack(arrays, b32)
        return bits_equal(bench, b32, xp.concatenate([a.ravel() for a in arrays]))

    def check_pack16():
        pack(arrays, b16, s)
        want = (xp.concatenate([a.ravel() for a in arrays]) * s).astype(xp.float16)
        return bits_equal(bench, b16, want)

    def check_unpack():
        pack(arrays, b16, s)
        mine = [a.copy() for a in arrays[:12]]
        unpack(b16[:sum(a.size for a in mine)], mine, s, accumulate=True)
        lo, ok = 0, True
        for a, m in zip(arrays, mine):
            ok &= bits_equal(bench, m, a + b16[lo:lo + a.size].reshape(a.shape)
                             .astype(xp.float32) * s)
            lo += a.size
        return ok

    label = "%d arrays" % len(arrays)
    return [
        Case("pack resnet50 f32->f32 (%s)" % label, n, None, lambda: pack(arrays, b32), 8 * n,
             [("concatenate(out=)", concat32)], ("copy", COPY_FRACTION["pack"]), check_pack32),
        Case("pack resnet50 f32->f16 x0.125", n, None, lambda: pack(arrays, b16, s), 6 * n,
             [("concatenate * s astype", concat16)], ("copy", COPY_FRACTION["pack"]),
             check_pack16),
        Case("unpack resnet50 f16->f32 x0.125 +=", n, None,
             lambda: unpack(b16, arrays, s, accumulate=True), 10 * n,
             [("per-array += astype * s", unpack_builtin)], ("copy", COPY_FRACTION["pack"]),
             check_unpack),
    ]


def _optional(module, name):
    try:
        mod = __import__("commlib.ops." + module, fromlist=[name])
        return getattr(mod, name)
    except (ImportError, AttributeError):
        return None


def _torch_for(bench):
    if bench.kind != "gpu":
        return None
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def select_cases(bench, n):
    xp = bench.xp
    x = bench.rng(4).standard_normal(n, dtype=np.float32)
    topk = _optional("topk", "topk")
    threshold = _optional("threshold", "threshold")
    torch = _torch_for(bench)
    cases = []
    for frac in FRACTIONS:
        k = max(1, int(n * frac))

        def argpartition(k=k):
            idx = xp.argpartition(xp.abs(x), n - k)[n - k:]
            return idx, x[idx]

        baselines = [("%s.argpartition" % ("cupy" if bench.kind == "gpu" else "np"),
                      argpartition)]
        if torch is not None:
            tx = torch.from_dlpack(x)

            def torch_topk(k=k, tx=tx):
                idx = torch.topk(tx.abs(), k, sorted=False).indices
                return idx, tx[idx]
            baselines.append(("torch.topk", torch_topk))

        def check_topk(k=k):
            idx, vals = topk(x, k)
            got = np.sort(np.abs(bench.host(vals)))
            want = np.sort(np.abs(bench.host(argpartition(k)[1])))
            hidx = bench.host(idx)
            return (np.array_equal(got, want) and np.all(np.diff(hidx) > 0)
                    and np.array_equal(bench.host(x)[hidx], bench.host(vals)))

        cases.append(Case("topk", n, k, (lambda k=k: topk(x, k)) if topk else None, 4 * n,
                          baselines, ("speedup", TOPK_SPEEDUP), check_topk))

        t = statistics.NormalDist().inv_cdf(1 - frac / 2)      # P(|x| > t) = frac

        def nonzero(t=t):
            idx = xp.nonzero(xp.abs(x) > t)[0]
            return idx, x[idx]

        def check_threshold(t=t, k=k):
            idx, vals, count = threshold(x, t, capacity=2 * k)
            widx, wvals = nonzero(t)
            c = int(count)
            return c == widx.size and bits_equal(bench, idx[:c], widx.astype(np.int32)) \
                and bits_equal(bench, vals[:c], wvals)

        cases.append(Case("threshold", n, k,
                          (lambda t=t, k=k: threshold(x, t, capacity=2 * k)) if threshold
                          else None, 4 * n + 8 * k,
                          [("nonzero(|x| > t)", nonzero)], ("copy", COPY_FRACTION["threshold"]),
                          check_threshold))
    return cases


def sparse_case(bench, n):
    xp = bench.xp
    scatter_add = _optional("sparse", "scatter_add")
    k = max(1, n // 100)
    rng = np.random.default_rng(5)
    idx, vals = [], []
    for _ in range(RANKS):
        pool = np.unique(rng.integers(0, n, int(k * 1.05) + 16))
        idx.append(np.sort(rng.choice(pool, size=min(k, pool.size), replace=False)))
        vals.append(rng.standard_normal(idx[-1].size).astype(np.float32))
    segments = [i.size for i in idx]
    indices = xp.asarray(np.concatenate(idx).astype(np.int32))
    values = xp.asarray(np.concatenate(vals))
    dense = xp.zeros(n, xp.float32)
    if bench.kind == "gpu":
        import cupyx

        def builtin():
            cupyx.scatter_add(dense, indices, values)
        name = "cupyx.scatter_add"
    else:
        def builtin():
            np.add.at(dense, indices, values)
        name = "np.add.at"

    def check():
        mine = xp.zeros(n, xp.float32)
        bad = scatter_add(mine, indices, values, segments=segments)
        want = np.zeros(n, np.float32)
        np.add.at(want, bench.host(indices), bench.host(values))
        return int(bad) == 0 and np.allclose(bench.host(mine), want, rtol=1e-5, atol=1e-6)

    fn = (lambda: scatter_add(dense, indices, values, segments=segments)) if scatter_add \
        else None
    nbytes = 8 * int(indices.size) + 8 * int(indices.size)     # read pairs, update dense
    return Case("sparse accumulate %dx1%%" % RANKS, n, int(indices.size), fn, nbytes,
                [(name, builtin)], ("max_us", SPARSE_MAX_US), check)


def topk_pass_rows(bench, n, repeats):
    """Rows of the time each top-K kernel takes (k = 1 % of ``n``, GPU only):
    CUDA events around every launch of ``topk`` (the L2 flushed before each
    call), medians over ``repeats`` calls; a pass whose predecessor settled
    the selection shows the few microseconds of an early return."""
    topk = _optional("topk", "topk")
    if bench.kind != "gpu" or topk is None:
        return []
    from commlib.ops import _loader
    cupy = bench.xp
    x = bench.rng(4).standard_normal(n, dtype=np.float32)
    k = max(1, n // 100)
    times = {}
    real = _loader.get_function

    def timed(source, name, *args):
        fn = real(source, name, *args)

        def launch(grid, block, kargs, **kw):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn(grid, block, kargs, **kw)
            end.record()
            times.setdefault(name, []).append((start, end))
        # grids are sized from the kernel's registers and shared memory
        launch.attributes = getattr(fn, "attributes", None)
        return launch

    topk(x, k)                                   # compiled, warm
    _loader.get_function = timed
    try:
        for _ in range(repeats):
            bench._flush.fill(0)
            topk(x, k)
        cupy.cuda.get_current_stream().synchronize()
    finally:
        _loader.get_function = real
    rows = []
    for name, events in times.items():
        ms = statistics.median(cupy.cuda.get_elapsed_time(a, b) for a, b in events)
        rows.append({"name": "topk pass " + name, "N": n, "k": k, "bytes": 4 * n, "ms": ms,
                     "gbps": 4 * n / ms / 1e6 if ms > 0 else None, "check": "-"})
    return rows


# ---------------------------------------------------------------- running

def run_case(bench, case, repeats):
    """Rows (dicts) for one case: one per baseline (or one without)."""
    base = {"name": case.name, "N": case.n, "k": case.k, "bytes": case.nbytes}
    if case.fn is None:
        return [dict(base, status="n/a", check="n/a")]
    try:
        check = "ok" if case.check is None or case.check() else "FAIL"
    except Exception as exc:                        # report, keep benchmarking
        check = "error: %s" % exc
    samples, host_us = bench.measure(case.fn, repeats)
    ms = statistics.median(samples)
    copy_ms = bench.copy_ms(case.nbytes, repeats)
    row = dict(base, ms=ms, host_us=host_us, samples_ms=samples,
               gbps=case.nbytes / ms / 1e6, copy_gbps=case.nbytes / copy_ms / 1e6,
               copy_fraction=copy_ms / ms, check=check)
    rows = []
    for bname, bfn in case.baselines or [(None, None)]:
        r = dict(row, baseline=bname)
        if bfn is not None:
            try:
                bsamples, _ = bench.measure(bfn, repeats)
                r.update(baseline_ms=statistics.median(bsamples), baseline_samples_ms=bsamples)
                r["speedup"] = r["baseline_ms"] / ms
            except Exception as exc:
                r["baseline_error"] = str(exc)
        r["target"], r["status"] = judge(bench, case, r)
        rows.append(r)
    return rows


def judge(bench, case, r):
    """(target text, PASS/FAIL/n/a) of a row; targets are for the GPU."""
    t = case.target
    if t is None:
        return "", ""
    if t[0] == "copy":
        text, ok = ">= %d%% copy" % round(100 * t[1]), r["copy_fraction"] >= t[1]
    elif t[0] == "speedup":
        factor = t[1].get(r.get("baseline") or "", None)
        if factor is None or case.n != TARGET_N or case.k != TARGET_N // 100:
            return "", ""
        if "speedup" not in r:
            return ">= %gx" % factor, "n/a"
        text, ok = ">= %gx" % factor, r["speedup"] >= factor
    else:
        faster = r.get("speedup", 0) > 1.0
        if case.n != TARGET_N:
            text, ok = "> baseline", faster
        else:
            text, ok = "< %g us, > baseline" % t[1], r["ms"] * 1e3 < t[1] and faster
    if bench.kind != "gpu":
        return text, "n/a"
    if r.get("check") != "ok":
        return text, "FAIL"
    return text, "PASS" if ok else "FAIL"


def goal_rows(bench, rows):
    """Rows of the goals that span rows or columns (GPU: PASS/FAIL, else
    n/a; a goal whose rows are missing: n/a): top-K of TARGET_N at k = 1 %
    within TOPK_MAX_US, k = 0.1 % and 10 % within TOPK_SPREAD times that,
    and every commlib operation at TARGET_N within HOST_MAX_US of host time
    (the ``host us`` column)."""
    mine = {}
    for r in rows:
        if r.get("N") == TARGET_N and r.get("ms") is not None and "baseline" in r:
            mine.setdefault((r["name"], r.get("k")), r)      # one per operation
    out = []

    def goal(name, k, value, text, ok, unit):
        status = "n/a" if bench.kind != "gpu" or ok is None else ("PASS" if ok else "FAIL")
        out.append({"name": "goal: " + name, "N": TARGET_N, "k": k, "value": value,
                    "unit": unit, "target": text, "status": status, "check": "-"})

    k1 = TARGET_N // 100
    one = mine.get(("topk", k1))
    us = None if one is None else 1e3 * one["ms"]
    goal("topk device us", k1, us, "<= %g us" % TOPK_MAX_US,
         None if us is None else us <= TOPK_MAX_US, "us")
    for frac in FRACTIONS:
        k = max(1, int(TARGET_N * frac))
        if k == k1:
            continue
        other = mine.get(("topk", k))
        ratio = None if one is None or other is None else other["ms"] / one["ms"]
        goal("topk k=%g%% / k=1%%" % (100 * frac), k, ratio, "<= %gx" % TOPK_SPREAD,
             None if ratio is None else ratio <= TOPK_SPREAD, "x")
    for (name, k), r in mine.items():
        host = r.get("host_us")
        goal("host us of %s" % name, k, host, "<= %g us" % HOST_MAX_US,
             None if host is None else host <= HOST_MAX_US, "us")
    return out


COLUMNS = ["name", "N", "k", "ms", "host us", "GB/s", "% copy", "baseline", "baseline ms",
           "speedup", "target", "result", "check"]


def fmt_row(r):
    def num(key, f):
        return f % r[key] if key in r and r[key] is not None else "-"
    if r["name"].startswith("goal: "):
        value = "-" if r.get("value") is None else "%.2f %s" % (r["value"], r["unit"])
        return [r["name"], str(r["N"]), str(r["k"]) if r.get("k") else "-", value] \
            + ["-"] * 6 + [r["target"], r["status"], "-"]
    return [r["name"], str(r["N"]), str(r["k"]) if r.get("k") else "-", num("ms", "%.4f"),
            num("host_us", "%.0f"), num("gbps", "%.1f"),
            "%.0f%%" % (100 * r["copy_fraction"]) if "copy_fraction" in r else "-",
            r.get("baseline") or "-",
            num("baseline_ms", "%.4f") if "baseline_error" not in r else "error",
            num("speedup", "%.2fx"), r.get("target") or "-", r.get("status") or "-",
            r.get("check", "-")]


def print_table(rows, out=sys.stdout):
    out.write("| " + " | ".join(COLUMNS) + " |\n")
    out.write("|" + "|".join("---" for _ in COLUMNS) + "|\n")
    for r in rows:
        out.write("| " + " | ".join(fmt_row(r)) + " |\n")
    out.flush()


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def pick_bench(device):
    if device in ("auto", "gpu"):
        from commlib.core import gpu
        if gpu.available():
            return GpuBench()
        if device == "gpu":
            raise SystemExit("--device gpu: " + gpu.unavailable_reason())
    return CpuBench()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    ap.add_argument("--sizes", help="comma-separated N (K/M/G suffixes); "
                    "default 1M,25M,100M on a GPU, 1M,25M on the CPU")
    ap.add_argument("--repeats", type=int, help="timed repeats (default 20 on a GPU; on the "
                    "CPU 5, or 3 from 10M elements)")
    ap.add_argument("--no-pack", action="store_true", help="skip the resnet50 pack cases")
    ap.add_argument("--pack-scale", type=int, default=1,
                    help="the resnet50 pack cases' arrays at 1/this of their sizes (default 1)")
    ap.add_argument("--out", help="directory to write kernels.json into")
    ap.add_argument("--only", help="comma-separated groups to run: cast, select (top-K, "
                    "threshold and top-K passes), sparse, pack (default: all)")
    args = ap.parse_args(argv)
    bench = pick_bench(args.device)
    sizes = [parse_size(s) for s in (args.sizes or ("1M,25M,100M" if bench.kind == "gpu"
                                                    else "1M,25M")).split(",")]
    print("# commlib kernels on %s (%s)\n" % (bench.device, bench.kind))
    rows = []

    out = Path(args.out) if args.out else None

    def save():                      # after every group, so a cut-short run keeps results
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "kernels.json").write_text(json.dumps(
                {"device": bench.device, "kind": bench.kind, "sizes": sizes, "rows": rows},
                indent=1, default=_jsonable))

    def run(cases, n):
        reps = args.repeats or (20 if bench.kind == "gpu" else (3 if n >= 10 ** 7 else 5))
        for case in cases:
            for r in run_case(bench, case, reps):
                rows.append(r)
                print("  " + " | ".join(fmt_row(r)), file=sys.stderr, flush=True)
        save()

    groups = set((args.only or "cast,select,sparse,pack").split(","))
    unknown = groups - {"cast", "select", "sparse", "pack"}
    if unknown:
        ap.error("--only: unknown group(s) %s" % ", ".join(sorted(unknown)))
    for n in sizes:
        ms = bench.copy_ms(8 * n, args.repeats or 10)
        rows.append({"name": "copy (reference)", "N": n, "k": None, "bytes": 8 * n, "ms": ms,
                     "gbps": 8 * n / ms / 1e6, "copy_fraction": 1.0, "check": "-"})
        if "cast" in groups:
            run(cast_cases(bench, n), n)
        if "select" in groups:
            run(select_cases(bench, n), n)
            for r in topk_pass_rows(bench, n, args.repeats or 20):
                rows.append(r)
                print("  " + " | ".join(fmt_row(r)), file=sys.stderr, flush=True)
        if "sparse" in groups:
            run([sparse_case(bench, n)], n)
        _free(bench)
    if not args.no_pack and "pack" in groups:
        run(pack_cases(bench, args.pack_scale), TARGET_N // args.pack_scale)
    rows.extend(goal_rows(bench, rows))
    print_table(rows)
    failed = [r for r in rows if str(r.get("check", "")).startswith(("FAIL", "error"))]
    if out is not None:
        save()
        print("\nwrote %s" % (out / "kernels.json"))
    if failed:
        print("\nresult check failed for: %s" % ", ".join(
            "%s N=%s k=%s" % (r["name"], r["N"], r["k"]) for r in failed))
        return 1
    return 0


def _free(bench):
    if bench.kind == "gpu":
        bench.xp.get_default_memory_pool().free_all_blocks()


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return None if math.isnan(o) else float(o)
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
