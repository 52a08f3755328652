"""The goals the GPU benchmarks judge (benchmarks/kernels.py's goal rows,
benchmarks/gpu_step.py's goals), on made-up measurements: each PASS or FAIL
by its threshold on a GPU, n/a without one or without its measurement."""
import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location("bench_" + name, BENCH / (name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kernels():
    return _load("kernels")


@pytest.fixture(scope="module")
def gpu_step():
    saved = list(sys.argv)
    try:
        return _load("gpu_step")
    finally:
        sys.argv[:] = saved


def _row(name, k, ms, host_us, baseline="b"):
    return {"name": name, "N": 25_000_000, "k": k, "ms": ms, "host_us": host_us,
            "baseline": baseline}


def _kernel_goals(kernels, kind, rows):
    bench = argparse.Namespace(kind=kind)
    return {(g["name"], g["k"]): (g["status"], g["value"]) for g in kernels.goal_rows(bench, rows)}


def test_kernel_goals(kernels):
    n = kernels.TARGET_N
    rows = [_row("topk", n // 1000, 0.070, 9.0), _row("topk", n // 1000, 0.070, 9.0, "torch"),
            _row("topk", n // 100, 0.048, 12.5), _row("topk", n // 10, 0.073, 8.0),
            _row("threshold", n // 100, 0.040, 10.0),
            dict(_row("topk", n // 100, 9.0, 99.0), N=1_000_000),      # another size: ignored
            {"name": "copy (reference)", "N": n, "k": None, "ms": 0.05}]
    got = _kernel_goals(kernels, "gpu", rows)
    assert got == {
        ("goal: topk device us", n // 100): ("PASS", pytest.approx(48.0)),
        ("goal: topk k=0.1% / k=1%", n // 1000): ("PASS", pytest.approx(70 / 48)),
        ("goal: topk k=10% / k=1%", n // 10): ("FAIL", pytest.approx(73 / 48)),
        ("goal: host us of topk", n // 1000): ("PASS", 9.0),
        ("goal: host us of topk", n // 100): ("FAIL", 12.5),
        ("goal: host us of topk", n // 10): ("PASS", 8.0),
        ("goal: host us of threshold", n // 100): ("PASS", 10.0),
    }, got
    assert {s for s, _ in _kernel_goals(kernels, "cpu", rows).values()} == {"n/a"}
    # without the 1 % row, the goals that need it are n/a, not failed
    got = _kernel_goals(kernels, "gpu", [r for r in rows if r.get("k") != n // 100])
    assert got[("goal: topk device us", n // 100)] == ("n/a", None)
    assert got[("goal: topk k=10% / k=1%", n // 10)] == ("n/a", None)
    table = kernels.fmt_row(kernels.goal_rows(argparse.Namespace(kind="gpu"), rows)[0])
    assert table[0] == "goal: topk device us" and table[3] == "48.00 us" \
        and table[-3:] == ["<= 50 us", "PASS", "-"], table


def _results(gpu_step, device, transport, commlib, torch):
    res = gpu_step.Results(argparse.Namespace(device=device))
    res.env["device"] = device
    res.host_target.update({"transport": transport, "us": {}})
    for v in gpu_step.VARIANTS:
        c, t = commlib[v], torch.get(v)
        res.rows[v]["commlib"].update(device_ms=c[0], host_ms=c[1], check=c[2])
        res.host_target["us"][v] = 1e3 * c[1]
        if t is not None:
            res.rows[v]["torch"].update(device_ms=t[0], host_ms=t[1], check="ok")
    return {g["name"]: g["status"] for g in gpu_step.goals(res)}


def test_gpu_step_goals(gpu_step):
    commlib = {"dense": (0.1, 0.3, "ok"), "fp16": (0.5, 0.12, "ok"),
               "topk-1%": (5.0, 0.2, "FAIL (wrong)")}
    torch = {"dense": (0.3, 0.2), "fp16": (0.6, 1.0), "topk-1%": (30.0, 30.0)}
    got = _results(gpu_step, "gpu", "nccl", commlib, torch)
    assert got == {
        "dense device commlib/torch": "PASS", "dense host commlib/torch": "FAIL",
        "fp16 device commlib/torch": "PASS", "fp16 host commlib/torch": "PASS",
        "fp16 host us per call": "PASS",
        # faster, but a wrong result passes nothing
        "topk-1% device commlib/torch": "FAIL", "topk-1% host commlib/torch": "FAIL",
        "topk-1% host us per call": "FAIL",
    }, got
    # no torch: the comparisons are n/a; over MPI the host goal is n/a
    got = _results(gpu_step, "gpu", "mpi", commlib, {})
    assert set(got.values()) == {"n/a"}, got
    assert set(_results(gpu_step, "cpu", "nccl", commlib, torch).values()) == {"n/a"}
