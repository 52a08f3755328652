"""benchmarks/gpu_step.py without a GPU: the commlib half on numpy arrays.

A smoke run (``--device cpu``) must print one row per variant with commlib's
results checked ("ok"), the torch half skipped with its reason, the host-time
summary and the JSON file. The checks themselves must catch wrong results:
planted errors in a dense, fp16 and top-K result are reported as FAIL.
Timings are never asserted.
"""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_step.py"
VARIANTS = ["dense", "fp16", "topk-1%"]


def load_module():
    spec = importlib.util.spec_from_file_location("gpu_step_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_table(stdout):
    """The markdown table whose first column is "variant" -> list of dicts."""
    lines = stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| variant |"))
    body = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        body.append([c.strip() for c in ln.strip().strip("|").split("|")])
    header = body[0]
    return [dict(zip(header, cells)) for cells in body[2:]]


def test_gpu_step_cpu_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--repeats", "2", "--warmup", "1",
         "--profile", "1", "--no-init-probe", "--time-limit", "150", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=180, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "torch comparison skipped: --device cpu" in out
    rows = parse_table(out)
    assert [r["variant"] for r in rows] == VARIANTS
    for r in rows:
        assert r["commlib check"] == "ok", r
        assert r["torch check"] == "skipped", r
        for column in ("commlib device ms", "commlib host ms", "limit ms"):
            assert float(r[column]) > 0, (column, r)
        assert r["torch device ms"] == "-" and r["device commlib/torch"] == "-"
    assert "commlib host time per all_reduce call: resnet50, 161 arrays" in out
    assert out.count("[target <= 150 us:") == 2          # fp16 and top-K

    data = json.loads((tmp_path / "gpu_step.json").read_text())
    assert data["env"]["device"] == "cpu"
    assert data["env"]["commlib_backend"] == "local"
    assert data["env"]["buckets"] == 5                     # 25 MiB buckets of ResNet-50
    assert data["errors"] == []
    for row in data["rows"]:
        assert len(row["commlib"]["host_samples_ms"]) == 2
        assert row["commlib"]["check"] == "ok"
    assert set(data["host_target"]["us"]) == set(VARIANTS)
    assert set(data["host_target"]["issue_us"]) == set(VARIANTS)
    assert all(us > 0 for us in data["host_target"]["issue_us"].values())
    assert out.count("(async_op=True: ") == len(VARIANTS)
    assert set(data["profile"]) == set(VARIANTS)
    assert all(p["top"] and p["total_us"] > 0 for p in data["profile"].values())


def test_checks_catch_wrong_results():
    gs = load_module()
    rng = np.random.default_rng(3)
    shapes = [(7, 5), (300,), (4, 4, 4), (1000,)]
    grads = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    assert gs.check_equal([g.copy() for g in grads], grads) == "ok"
    wrong = [g.copy() for g in grads]
    wrong[2][1, 2, 3] += 1e-3
    assert gs.check_equal(wrong, grads).startswith("FAIL (1 of 4 arrays differ; array 2: 1")
    half = [g.astype(np.float16).astype(np.float32) for g in grads]
    assert gs.check_equal(grads, half).startswith("FAIL")      # float32 is not the round trip

    units = [(0, 1), (2,), (3,)]
    k_for = lambda n: max(1, math.ceil(0.01 * n))  # noqa: E731

    def topk(accs):
        outs = [np.zeros_like(a) for a in accs]
        for unit in units:
            flat = np.concatenate([accs[i].reshape(-1) for i in unit])
            keep = np.argsort(-np.abs(flat), kind="stable")[:k_for(flat.size)]
            sel = np.zeros(flat.size, bool)
            sel[keep] = True
            at = 0
            for i in unit:
                n = accs[i].size
                outs[i].reshape(-1)[sel[at:at + n]] = accs[i].reshape(-1)[sel[at:at + n]]
                at += n
        return outs

    outs = topk(grads)
    verdict, residual = gs.check_topk(outs, grads, units, k_for)
    assert verdict == "ok"
    assert all(np.array_equal(r + o, g) for r, o, g in zip(residual, outs, grads))
    # one sent entry replaced by a smaller one that was left out
    bad = [o.copy() for o in outs]
    flat = bad[3].reshape(-1)
    big = int(np.flatnonzero(flat)[0])
    small = int(np.argmin(np.abs(grads[3].reshape(-1))))
    flat[big], flat[small] = 0, grads[3].reshape(-1)[small]
    assert gs.check_topk(bad, grads, units, k_for)[0].startswith("FAIL (unit 2: an entry")
    # a sent value that is not gradient + residual
    bad = [o.copy() for o in outs]
    bad[3].reshape(-1)[np.flatnonzero(bad[3])[0]] *= 2
    assert "differ" in gs.check_topk(bad, grads, units, k_for)[0]
    # one entry too many
    bad = [o.copy() for o in outs]
    extra = int(np.flatnonzero(bad[1] == 0)[0])
    bad[1].reshape(-1)[extra] = grads[1].reshape(-1)[extra]
    assert "entries sent, expected" in gs.check_topk(bad, grads, units, k_for)[0]
