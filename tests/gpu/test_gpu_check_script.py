"""scripts/gpu_check.sh on a machine without a GPU: its syntax, a dry run in
which every GPU stage reports SKIPPED and the exit status stays 0, a
failing stage that makes it exit 1, and a run end to end with a stand-in
GPU (an interpreter that says it has one, stub commands) in which every
stage must start and pass, and a 2-rank example that saw 1 worker fails."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
GPU_STAGES = ["build", "nvrtc", "pytest-gpu", "benchmark", "gpu-step", "gpu-step-16",
              "sanitizer", "streams", "large-n", "p2p", "example"]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(args, env=None, timeout=120):
    full = dict(os.environ, PYTHON=sys.executable)
    full.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


def test_syntax():
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_dry_run_skips_every_gpu_stage(tmp_path):
    # the output folder from $OUT (the device machine's); the other tests name it
    res = _run(["--dry-run"], env={"OUT": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert list(status) == ["env", "mpi-world"] + GPU_STAGES
    assert status["env"] == "PASS" and status["mpi-world"] == "PASS", status
    assert all(status[s].startswith("SKIPPED: no GPU") for s in GPU_STAGES), status
    assert summary["failed"] is False and summary["targets"] == []
    text = (tmp_path / "summary.txt").read_text()
    assert "overall: PASS" in text and text.count("SKIPPED: no GPU") == len(GPU_STAGES)


def test_a_failed_stage_fails_the_run_and_the_rest_still_runs(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *platform*) exit 7;; esac\nexec %s \"$@\"\n"
                    % sys.executable)
    fake.chmod(0o755)
    res = _run(["--dry-run", str(tmp_path / "o")], env={"PYTHON": str(fake)})
    assert res.returncode == 1, res.stdout + res.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert status["env"] == "FAIL (exit 7)" and summary["failed"] is True
    assert all(status[s].startswith("SKIPPED") for s in GPU_STAGES)
    assert "overall: FAIL" in (tmp_path / "o" / "summary.txt").read_text()


STUB_PYTHON = """#!/bin/bash
# a stand-in interpreter on a stand-in GPU machine: logs every call; says it
# has a GPU; fakes the GPU stages' programs; runs the rest with the real one
echo "python $*" >> "$STUB_LOG"
case "$*" in
    *unavailable_reason*) echo ""; exit 0 ;;
    "-m pytest"*)
        for a in "$@"; do case $a in --junitxml=*) xml=${a#--junitxml=} ;; esac; done
        echo '<testsuites><testsuite tests="3" skipped="0"/></testsuites>' > "$xml"
        exit 0 ;;
    "-m commlib.launch"*)
        prev=""; for a in "$@"; do [ "$prev" = --json ] && json=$a; prev=$a; done
        echo "{\\"workers\\": ${STUB_WORKERS:-2}, \\"identical\\": true}" > "$json"
        exit 0 ;;
    "benchmarks/kernels.py"*|"benchmarks/gpu_step.py"*)
        prev=""; for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
        case "$1" in
            *kernels.py) echo '{"rows": [{"name": "goal: topk device us", "N": 25000000,
                "target": "<= 50 us", "status": "FAIL"}]}' > "$out/kernels.json" ;;
            *) echo '{"goals": [{"name": "fp16 host us per call", "target": "<= 150 us",
                "value": 120.5, "status": "PASS"}]}' > "$out/gpu_step.json" ;;
        esac
        exit 0 ;;
    "tests/gpu/gpu_checks.py"*|"setup.py"*)
        exit 0 ;;
esac
exec "$REAL_PYTHON" "$@"
"""

STUB_SANITIZER = """#!/bin/bash
echo "compute-sanitizer $*" >> "$STUB_LOG"
while [ "${1#-}" != "$1" ]; do shift 2; done
exec "$@"
"""


def _stand_in_gpu(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", STUB_PYTHON), ("compute-sanitizer", STUB_SANITIZER),
                       ("nvidia-smi", "#!/bin/sh\necho 'stand-in GPU'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    full = {"PYTHON": str(bin_dir / "python"), "REAL_PYTHON": sys.executable,
            "STUB_LOG": str(log), "PATH": "%s:%s" % (bin_dir, os.environ["PATH"])}
    full.update(env)
    res = _run([str(tmp_path / "out")], env=full, timeout=300)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    return res, {s["stage"]: s["status"] for s in summary["stages"]}, log.read_text()


def test_every_stage_starts_and_passes_with_a_stand_in_gpu(tmp_path):
    res, status, calls = _stand_in_gpu(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(status) == ["env", "mpi-world"] + GPU_STAGES
    assert all(v == "PASS" for v in status.values()), status
    for expected in ("python setup.py -q build_ext --inplace",
                     "python -m pytest -m gpu", "python tests/gpu/gpu_checks.py compile",
                     "python benchmarks/kernels.py", "python benchmarks/gpu_step.py",
                     "python tests/gpu/gpu_checks.py streams",
                     "python tests/gpu/gpu_checks.py large", "python -m commlib.info --run 2",
                     "python tests/gpu/gpu_checks.py p2p",
                     "compute-sanitizer --tool memcheck", "compute-sanitizer --tool racecheck",
                     "compute-sanitizer --tool synccheck",
                     "python tests/gpu/gpu_checks.py small-quick"):
        assert expected in calls, (expected, calls)
    assert re.search(r"python -m commlib.launch -n 2 .*examples/mnist_train.py --device gpu",
                     calls), calls
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "overall: PASS" in text
    # both benchmarks' goals are summarised; a missed one does not fail the run
    targets = json.loads((tmp_path / "out" / "summary.json").read_text())["targets"]
    assert [(t["name"], t["status"]) for t in targets] == [
        ("goal: topk device us", "FAIL"), ("gpu_step fp16 host us per call", "PASS"),
        ("gpu_step 16 buckets fp16 host us per call", "PASS")], targets
    assert "--bucket-bytes 6553600" in calls, calls
    assert re.search(r"target gpu_step fp16 host us per call .*<= 150 us +PASS", text), text


def test_the_example_stage_fails_when_the_job_saw_one_worker(tmp_path):
    res, status, _ = _stand_in_gpu(tmp_path, STUB_WORKERS="1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert status["example"] == "FAIL (exit 6)", status
    assert all(v == "PASS" for k, v in status.items() if k != "example"), status
