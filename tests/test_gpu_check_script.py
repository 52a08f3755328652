"""scripts/gpu_check.sh on a machine without a GPU: its syntax, a dry run in
which every GPU stage reports SKIPPED and the exit status stays 0, and a
failing stage that makes it exit 1."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
GPU_STAGES = ["nvrtc", "pytest-gpu", "benchmark", "sanitizer", "streams", "large-n"]
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
    res = _run(["--dry-run", str(tmp_path)])
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert list(status) == ["env"] + GPU_STAGES
    assert status["env"] == "PASS"
    assert all(status[s].startswith("SKIPPED: no GPU") for s in GPU_STAGES), status
    assert summary["failed"] is False and summary["targets"] == []
    text = (tmp_path / "summary.txt").read_text()
    assert "overall: PASS" in text and text.count("SKIPPED: no GPU") == len(GPU_STAGES)


def test_out_variable_names_the_output_dir(tmp_path):
    res = _run(["--dry-run"], env={"OUT": str(tmp_path / "o")})
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "o" / "summary.json").exists()


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
