"""Run a Python snippet under ``mpiexec -n N`` with a hard time bound.

With MPICH, a rank that exits early leaves its peers blocked forever, so
every multi-process test goes through :func:`run_mpi`, which kills the whole
job after ``timeout`` seconds and fails the test with the job's output.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpiexec(required=True):
    """Path of mpiexec (next to this Python first); None if missing and not
    ``required``."""
    exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) \
        or shutil.which("mpiexec")
    if exe is None and required:
        pytest.fail("mpiexec not found: install commlib with the 'mpi' extra")
    return exe


def run_bounded(cmd, timeout, env=None, cwd=None):
    """Run ``cmd`` in a new session with ``env`` (a full environment or
    None); on timeout kill the whole session (mpiexec and every rank) and
    fail the test with its output. Returns the CompletedProcess."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail("%s timed out after %ss\nstdout:\n%s\nstderr:\n%s"
                    % (" ".join(cmd), timeout, out, err))
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_mpi(n, code, timeout=60, env=None, args=(), expect_fail=False):
    """Run ``code`` (Python source) on ``n`` ranks; returns the CompletedProcess.

    Fails the test when the job times out, or when its exit status is not
    what ``expect_fail`` says.
    """
    script = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / (
        "commlib_mpi_%d_%d.py" % (os.getpid(), abs(hash(code))))
    script.write_text(textwrap.dedent(code))
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    launcher = mpiexec(required=n > 1)
    # one rank without mpiexec runs as an MPI singleton
    cmd = ([launcher, "-n", str(n)] if launcher else []) + [sys.executable, str(script), *args]
    try:
        proc = run_bounded(cmd, timeout, env=full_env)
    finally:
        script.unlink(missing_ok=True)
    failed = proc.returncode != 0
    if failed != expect_fail:
        pytest.fail("mpiexec -n %d exited %d\nstdout:\n%s\nstderr:\n%s"
                    % (n, proc.returncode, proc.stdout, proc.stderr))
    return proc
