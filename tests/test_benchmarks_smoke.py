"""Smoke run of benchmarks/allreduce.py at 2 ranks with tiny cases.

Checks that the table is printed, parses, and reports correct results;
never asserts on timings.
"""
import json
import re

import pytest

from mpirun import ROOT, run_mpi

SCRIPT = ROOT / "benchmarks" / "allreduce.py"
NUMERIC = ["bytes", "tensors", "commlib ms", "per-tensor ms", "flat ms",
           "commlib algbw GB/s", "busbw GB/s", "commlib / best baseline"]


def parse_table(stdout):
    """Markdown table in ``stdout`` -> list of {column title: cell}."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    split = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    header, body = split[0], split[2:]
    return [dict(zip(header, cells)) for cells in body]


def test_allreduce_benchmark_smoke(tmp_path):
    out = tmp_path / "results.json"
    args = ["--cases", "flat,mnist_cnn,1000x256", "--sizes", "4K,64K",
            "--repeats", "2", "--warmup", "1", "--max-bytes", "4M", "--safety",
            "--json", str(out)]
    code = "import runpy; runpy.run_path(%r, run_name='__main__')" % str(SCRIPT)
    proc = run_mpi(2, code, timeout=120, args=args)

    rows = parse_table(proc.stdout)
    assert [r["case"] for r in rows] == ["flat-4KiB", "flat-64KiB", "mnist_cnn", "1000x256"]
    assert [int(r["bytes"]) for r in rows] == [4096, 65536, 431080 * 4, 1024000]
    assert [int(r["tensors"]) for r in rows] == [1, 1, 8, 1000]
    for row in rows:
        assert row["check"] == "ok", row
        for column in NUMERIC:
            assert float(row[column]) > 0, (column, row)

        # the costs are the columns' ratios (printed to 0.1 %, from unrounded times)
        commlib, bare, neither = (float(row[c]) for c in (
            "commlib ms", "no check ms", "no check, no watch dog ms"))
        assert abs((commlib / bare - 1) * 100 - float(row["check cost %"])) < 1.0, row
        assert abs((bare / neither - 1) * 100 - float(row["watch dog cost %"])) < 1.0, row

    results = json.loads(out.read_text())
    assert results["config"]["ranks"] == 2
    assert [r["case"] for r in results["results"]] == [r["case"] for r in rows]
    assert all(len(r["samples_ms"]["commlib"]) == 2 for r in results["results"])


def test_compression_benchmark_smoke(tmp_path):
    """benchmarks/compression.py at 2 ranks on the MNIST CNN's gradients: every
    strategy reported, payloads as the strategies define them, each call's
    time in the transports apart from its own work."""
    out = tmp_path / "compression.json"
    script = ROOT / "benchmarks" / "compression.py"
    code = "import runpy; runpy.run_path(%r, run_name='__main__')" % str(script)
    proc = run_mpi(2, code, timeout=120, args=["--cases", "mnist_cnn", "--repeats", "1",
                                                "--split", "--json", str(out)])
    rows = {r["strategy"]: r for r in parse_table(proc.stdout)}
    assert set(rows) == {"none", "fp16", "bf16", "topk-1%", "topk-0.1%", "threshold-2.5",
                         "partial-10%"}
    dense = 431080 * 4
    assert int(rows["none"]["wire bytes per rank"]) == dense
    assert int(rows["fp16"]["wire bytes per rank"]) == dense // 2
    assert int(rows["bf16"]["wire bytes per rank"]) == dense // 2
    assert float(rows["none"]["error"]) == 0 and float(rows["fp16"]["error"]) < 1e-3
    for name in ("topk-1%", "topk-0.1%", "partial-10%"):
        assert float(rows[name]["of dense"]) < 0.15, rows[name]
    # every strategy's call spends time in the transports and some of its own
    assert all(float(r["exchange ms"]) > 0 and float(r["local ms"]) > 0 for r in rows.values())
    assert len(json.loads(out.read_text())) == len(rows)


def test_shared_memory_probe_smoke():
    script = ROOT / "benchmarks" / "shm_probe.py"
    code = "import runpy; runpy.run_path(%r, run_name='__main__')" % str(script)
    proc = run_mpi(2, code, timeout=60, args=["--bytes", "65536", "--rounds", "3"])
    rows = {r["stores"]: r for r in parse_table(proc.stdout)}
    assert set(rows) == {"plain", "streaming"}
    assert all(float(v) > 0 for r in rows.values() for k, v in r.items() if k != "stores")
    # the verdict line is the table's plain write-after-read over the reference
    found = re.search(r"reference: a write nobody else reads: ([\d.]+) us; plain "
                      r"write-after-read is ([\d.]+)x that", proc.stdout)
    assert found, proc.stdout
    reference, ratio = float(found.group(1)), float(found.group(2))
    plain = float(rows["plain"]["write after the other read"])
    assert abs(plain / reference - ratio) <= 0.05 * ratio + 0.1, (plain, reference, ratio)


def test_p2p_benchmark_smoke(tmp_path):
    """benchmarks/p2p.py at 2 ranks, tiny sizes, one repeat: every call
    beside mpi4py's, results checked, the memory-copy bound beside them."""
    out = tmp_path / "p2p.json"
    script = ROOT / "benchmarks" / "p2p.py"
    code = "import runpy; runpy.run_path(%r, run_name='__main__')" % str(script)
    proc = run_mpi(2, code, timeout=120, args=["--sizes", "4K,64K", "--repeats", "1",
                                                "--warmup", "1", "--json", str(out)])
    rows = parse_table(proc.stdout)
    assert [(r["call"], int(r["bytes"])) for r in rows] == [
        (call, size) for call in ("send_recv", "all_to_all", "scatter", "gather")
        for size in (4096, 65536)]
    for row in rows:
        assert row["check"] == "ok" and row["ranks"] == "2", row
        ours, theirs = float(row["commlib ms"]), float(row["mpi4py ms"])
        assert ours > 0 and theirs > 0 and float(row["copy ms"]) > 0, row
        # the ratio and the bandwidth are the columns' (printed rounded)
        assert abs(ours / theirs - float(row["commlib / mpi4py"])) <= 0.01 * ours / theirs + 0.01
        gbs = int(row["bytes"]) / (ours * 1e-3) / 1e9
        assert abs(gbs - float(row["commlib GB/s"])) <= 0.01 * gbs + 1e-3, row
    results = json.loads(out.read_text())
    assert [r["call"] for r in results["results"]] == [r["call"] for r in rows]
    assert all(len(r["samples_ms"]["commlib"]) == 1 for r in results["results"])


def test_host_loops_benchmark_smoke():
    """benchmarks/host_loops.py on an odd length: every loop timed and its
    output checked against the numpy twins, bit for bit."""
    import subprocess
    import sys

    from commlib.ops import native
    if not native.available():
        pytest.skip("the compiled host loops are not built")
    script = ROOT / "benchmarks" / "host_loops.py"
    proc = subprocess.run([sys.executable, str(script), "--elements", "1003", "--repeats", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = parse_table(proc.stdout)
    assert len(rows) == 11 and rows[0]["loop"] == "numpy float32 copy", rows
    assert [r["loop"] for r in rows if "4 ranks" in r["loop"]] == [
        "reduce_share float32, 4 ranks", "reduce_share float16, own share cast inside, 4 ranks",
        "reduce_share bfloat16, own share cast inside, 4 ranks"]
    for row in rows:
        assert row["check"] == "ok" and float(row["ns per element"]) > 0, row
