"""``python -m commlib.launch``: real multi-rank runs (the mpiexec path on CPU),
failure and signal handling, argument checks, and the forked-worker path's
environment and supervision with a stand-in NCCL ID.

Every launcher runs in its own session under a hard timeout that kills the
whole process group, so a hang fails the test in seconds.
"""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple

import pytest

from commlib import NcclId, launch
from commlib.bootstrap import launcher_env
from commlib.errors import ArgumentError, BackendUnavailableError
from mpirun import ROOT, run_bounded

FAKE_ID = "ab" * 128  # parses as an NcclId; never reaches NCCL in these tests
Result = namedtuple("Result", "returncode stdout stderr seconds")


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _bounded(cmd, timeout, env=None, cwd=None):
    """run_bounded with this file's environment, also timing the run."""
    start = time.monotonic()
    proc = run_bounded(cmd, timeout, env=_env(env), cwd=cwd)
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def run_launcher(*args, backend="mpi", timeout=60, env=None):
    """``python -m commlib.launch --backend BACKEND args`` (default: the mpiexec
    path, also on GPU machines)."""
    return _bounded([sys.executable, "-m", "commlib.launch", "--backend", backend,
                     *map(str, args)], timeout, env)


def write(path, *parts):
    """Write the dedented ``parts`` (Python source) to ``path``."""
    path.write_text("".join(textwrap.dedent(p) for p in parts))
    return path


def alive(pid):
    """Whether ``pid`` runs (zombies count as ended)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def assert_all_ended(pid_dir, timeout=10.0):
    pids = [int(p.read_text()) for p in pid_dir.glob("*.pid") if p.read_text()]
    assert pids, "no worker recorded its pid"
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "workers still running"


# a worker that records its pid in $PID_DIR/<rank>.pid (rank from any launcher)
PID_PRELUDE = """
    import os, sys, time
    RANK = int(os.environ.get("COMMLIB_RANK", os.environ.get("PMI_RANK", "0")))
    with open(os.path.join(os.environ["PID_DIR"], "%d.pid" % RANK), "w") as f:
        f.write(str(os.getpid()))
"""


# -- real runs on the mpiexec path -------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_workers_all_reduce(tmp_path, n):
    write(tmp_path / "helper.py", "GREETING = 'hello'\n")
    script = write(tmp_path / "job.py", """
        import sys
        import numpy as np
        import commlib
        from helper import GREETING            # the script's directory is on sys.path

        assert __name__ == "__main__"
        assert sys.argv[1:] == ["--tag", "x y", "-n", "7"], sys.argv
        comm = commlib.init()
        total = np.full(5, comm.rank + 1.0)
        mean = total.copy()
        assert comm.all_reduce(total) is total
        comm.all_reduce([mean], division=True)
        size = comm.size
        assert np.array_equal(total, np.full(5, size * (size + 1) / 2)), total
        assert np.allclose(mean, (size + 1) / 2), mean
        print("%s rank %d of %d ok" % (GREETING, comm.rank, size), flush=True)
        comm.close()
    """)
    res = run_launcher("-n", n, "--", script, "--tag", "x y", "-n", "7")
    assert res.returncode == 0, res.stderr
    found = sorted(re.findall(r"hello rank \d+ of \d+ ok", res.stdout))
    assert found == sorted("hello rank %d of %d ok" % (r, n) for r in range(n)), res.stdout


@pytest.mark.parametrize("how, code", [
    ("raise RuntimeError('rank one breaks')", 1),
    ("sys.exit(3)", 3),
])
def test_failing_rank_ends_the_job(tmp_path, how, code):
    """Rank 1 fails while rank 0 waits in a collective for it."""
    script = write(tmp_path / "job.py", PID_PRELUDE, """
        import numpy as np
        import commlib
        comm = commlib.init()
        if comm.rank == 1:
            %s
        comm.all_reduce(np.ones(4))
        print("rank %%d finished" %% comm.rank, flush=True)
    """ % how)
    res = run_launcher("-n", 2, script, timeout=30, env={"PID_DIR": str(tmp_path)})
    assert res.returncode == code, res.stderr
    assert "commlib.launch: rank 1 failed with exit code %d" % code in res.stderr, \
        res.stderr
    assert "finished" not in res.stdout
    assert res.seconds < 10, res.seconds
    assert_all_ended(tmp_path)


def test_rank_failing_before_mpi_starts_ends_the_job(tmp_path):
    """A rank that dies before MPI_Init: mpiexec alone would wait forever."""
    script = write(tmp_path / "job.py", PID_PRELUDE, """
        if RANK == 2:
            sys.exit(4)
        import commlib
        commlib.init().barrier()
    """)
    res = run_launcher("-n", 3, "--grace", 1, script, timeout=30,
                       env={"PID_DIR": str(tmp_path)})
    assert res.returncode == 4, res.stderr
    assert "rank 2 failed with exit code 4" in res.stderr
    assert res.seconds < 10, res.seconds
    assert_all_ended(tmp_path)


def test_timeout_ends_the_job(tmp_path):
    script = write(tmp_path / "job.py", PID_PRELUDE, "time.sleep(120)\n")
    res = run_launcher("-n", 2, "--timeout", 2, script, timeout=30,
                       env={"PID_DIR": str(tmp_path)})
    assert res.returncode == launch.EXIT_TIMEOUT, res.stderr
    assert "timed out after 2 s" in res.stderr
    assert res.seconds < 12, res.seconds
    assert_all_ended(tmp_path)


def signal_launcher(tmp_path, sig, launcher_args):
    """Start a launcher of 2 sleeping workers, send it ``sig`` once both run;
    returns (exit status, stderr)."""
    script = write(tmp_path / "job.py", PID_PRELUDE, "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, *launcher_args, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env({"PID_DIR": str(tmp_path), "TMPDIR": str(tmp_path)}),
                            start_new_session=True)  # TMPDIR: a killed launcher's status dir
    try:
        deadline = time.monotonic() + 30
        while len([p for p in tmp_path.glob("*.pid") if p.read_text()]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, err


MPI_LAUNCHER = ["-m", "commlib.launch", "--backend", "mpi", "-n", "2"]
FORKED_LAUNCHER = ["-c", "import sys; from commlib import launch; sys.exit(launch.supervise("
                         "launch.ForkedWorkers.start([sys.executable, sys.argv[1]], 2, %r)))"
                   % FAKE_ID]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("launcher", [MPI_LAUNCHER, FORKED_LAUNCHER], ids=["mpi", "forked"])
def test_signal_to_launcher_ends_workers(tmp_path, sig, launcher):
    status, err = signal_launcher(tmp_path, sig, launcher)
    assert status == 128 + sig, err
    assert "received %s" % sig.name in err
    assert_all_ended(tmp_path)


@pytest.mark.parametrize("launcher", [MPI_LAUNCHER, FORKED_LAUNCHER], ids=["mpi", "forked"])
def test_killed_launcher_takes_its_workers_along(tmp_path, launcher):
    status, _ = signal_launcher(tmp_path, signal.SIGKILL, launcher)
    assert status == -signal.SIGKILL
    assert_all_ended(tmp_path)


def test_exported_launch_variables_do_not_leak_into_mpi_workers(tmp_path):
    script = write(tmp_path / "job.py", """
        import commlib
        from commlib.bootstrap import launcher_env
        assert launcher_env() is None
        print("size", commlib.init().size)
    """)
    res = run_launcher("-n", 1, script, timeout=30,
                       env={"COMMLIB_NCCL_ID": FAKE_ID, "COMMLIB_RANK": "0", "COMMLIB_SIZE": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "size 1"


# -- arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["-n", "0", "{script}"], "must be >= 1"),
    (["-n", "two", "{script}"], "expected an integer"),
    (["{script}"], "required: -n/--nprocs"),
    (["-n", "2"], "required"),
    (["-n", "2", "{missing}"], "does not exist"),
    (["-n", "2", "{tmp}"], "is not a file"),
    (["-n", "2", "--timeout", "-1", "{script}"], "--timeout: must be a finite number"),
    (["-n", "2", "--timeout", "0", "{script}"], "--timeout: must be a finite number"),
    (["-n", "2", "--grace", "x", "{script}"], "--grace: expected seconds"),
    (["-n", "2", "--backend", "gloo", "{script}"], "invalid choice: 'gloo'"),
])
def test_bad_arguments(tmp_path, args, message):
    script = write(tmp_path / "ok.py", "print('ran')\n")
    args = [a.format(script=script, missing=tmp_path / "missing.py", tmp=tmp_path)
            for a in args]
    res = run_launcher(*args, timeout=30)
    assert res.returncode == 2, res
    assert message in res.stderr, res.stderr
    assert "ran" not in res.stdout


@pytest.mark.skipif(launch._gpu_status()[0] is None, reason="NCCL is usable here")
def test_forced_nccl_without_gpu_is_refused(tmp_path):
    script = write(tmp_path / "ok.py", "print('ran')\n")
    res = run_launcher("-n", 1, script, backend="nccl", timeout=30)
    assert res.returncode == 2
    assert "--backend nccl: NCCL is not usable here" in res.stderr


@pytest.mark.parametrize("status, requested, n, expected", [
    ((None, 4), "auto", 4, "nccl"),
    ((None, 4), "auto", 5, "mpi"),
    (("no CUDA device visible", 0), "auto", 1, "mpi"),
    ((None, 4), "mpi", 2, "mpi"),
    ((None, 2), "nccl", 2, "nccl"),
    ((None, 2), "nccl", 3, ArgumentError),
    (("cupy is not importable", 0), "nccl", 1, BackendUnavailableError),
    ((None, 2), "gloo", 1, ArgumentError),
])
def test_choose_backend(monkeypatch, status, requested, n, expected):
    monkeypatch.setattr(launch, "_gpu_status", lambda: status)
    if isinstance(expected, str):
        assert launch.choose_backend(requested, n) == expected
    else:
        with pytest.raises(expected):
            launch.choose_backend(requested, n)


# -- the forked-worker (NCCL) path, without a GPU ----------------------------------------

def test_worker_env_round_trips_through_bootstrap():
    base = {"PATH": "/bin", "COMMLIB_RANK": "9", "COMMLIB_LOCAL_SIZE": "9",
            "CUDA_VISIBLE_DEVICES": "3,1"}
    env = launch.worker_env(base, FAKE_ID, 2, 4)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1" and env["PATH"] == "/bin"
    assert (env["COMMLIB_NCCL_ID"], env["COMMLIB_RANK"], env["COMMLIB_SIZE"],
            env["COMMLIB_LOCAL_RANK"], env["COMMLIB_LOCAL_SIZE"]) == (FAKE_ID, "2", "4", "2", "4")
    assert launcher_env(env) == (NcclId.from_hex(FAKE_ID), 2, 4, 2, 4)
    assert base["COMMLIB_RANK"] == "9", "the launcher's environment was modified"
    assert int(env["OMP_NUM_THREADS"]) >= 1
    chosen = launch.worker_env(dict(base, OMP_NUM_THREADS="7"), FAKE_ID, 0, 4)
    assert chosen["OMP_NUM_THREADS"] == "7"
    assert "OMP_NUM_THREADS" not in launch.worker_env(base, FAKE_ID, 0, 1)
    local = launch.worker_env(base, FAKE_ID, 5, 8, local_rank=1, local_size=4)
    assert launcher_env(local)[1:] == (5, 8, 1, 4)
    for rank, size in ((4, 4), (-1, 2)):
        with pytest.raises(ArgumentError):
            launch.worker_env(base, FAKE_ID, rank, size)


def run_forked(script, n, timeout=30, env=None):
    """The launcher's forked-worker supervision of ``script`` with FAKE_ID."""
    code = ("import sys\nfrom commlib import launch\n"
            "job = launch.ForkedWorkers.start([sys.executable, %r], %d, %r)\n"
            "sys.exit(launch.supervise(job, timeout=20, grace=2))\n" % (str(script), n, FAKE_ID))
    return _bounded([sys.executable, "-c", code], timeout, env)


def test_forked_workers_get_their_rank_environment(tmp_path):
    script = write(tmp_path / "job.py", """
        import os
        from commlib.bootstrap import launcher_env
        nid, rank, size, local_rank, local_size = launcher_env()
        # one write per line: the three workers share the pipe
        os.write(1, ("worker %s %d %d %d %d\\n" % (str(nid)[:8], rank, size, local_rank,
                                                   local_size)).encode())
    """)
    res = run_forked(script, 3)
    assert res.returncode == 0, res.stderr
    found = sorted(re.findall(r"worker \w+ \d+ \d+ \d+ \d+", res.stdout))
    assert found == ["worker abababab %d 3 %d 3" % (r, r) for r in range(3)], res.stdout


def test_forked_worker_failure_ends_the_others(tmp_path):
    script = write(tmp_path / "job.py", PID_PRELUDE, """
        if RANK == 1:
            sys.exit(5)
        time.sleep(120)
    """)
    res = run_forked(script, 3, env={"PID_DIR": str(tmp_path)})
    assert res.returncode == 5, res.stderr
    assert "commlib.launch: rank 1 failed with exit code 5" in res.stderr
    assert res.seconds < 10, res.seconds
    assert_all_ended(tmp_path)


def test_forked_worker_killed_by_signal_is_named(tmp_path):
    script = write(tmp_path / "job.py", PID_PRELUDE, """
        import signal
        if RANK == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    """)
    res = run_forked(script, 2, env={"PID_DIR": str(tmp_path)})
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert "rank 0 was killed by SIGKILL" in res.stderr
    assert_all_ended(tmp_path)


# -- on a GPU machine --------------------------------------------------------------------

@pytest.mark.gpu
def test_forked_workers_all_reduce_on_gpu(tmp_path):
    if launch._gpu_status()[0] is not None:
        pytest.skip("NCCL is not usable: %s" % launch._gpu_status()[0])
    script = write(tmp_path / "job.py", """
        import cupy, commlib
        comm = commlib.init()
        assert comm.backend == "nccl" and comm.device == comm.local_rank
        x = cupy.full(1000, comm.rank + 1.0, cupy.float32)
        comm.all_reduce([x], division=True)
        assert float(abs(x - (comm.size + 1) / 2).max()) == 0.0
        print("gpu rank", comm.rank, "ok", flush=True)
    """)
    import cupy
    n = min(2, cupy.cuda.runtime.getDeviceCount())
    res = run_launcher("-n", n, script, backend="nccl", timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("ok") == n
