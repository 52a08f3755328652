"""``python -m commlib.launch``: real multi-rank runs (the mpiexec path on CPU),
failure and signal handling (which rank is named when one dies, each distinct
traceback once, the ``[rank] `` output prefix), argument checks, the status
records and the choice of the rank to blame, and the forked-worker path's
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
import threading
import time
from collections import namedtuple

import pytest

from commlib import NcclId, launch
from commlib.launch import cli as launch_cli, processes as launch_processes
from commlib.startup.bootstrap import launcher_env
from commlib.errors import ArgumentError, BackendUnavailableError
from mpirun import ROOT, assert_each_rank, run_bounded

FAKE_ID = "ab" * 128  # parses as an NcclId; never reaches NCCL in these tests
#: ``ended``: time.time() when the launcher had exited
Result = namedtuple("Result", "returncode stdout stderr seconds ended")


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _bounded(cmd, timeout, env=None, cwd=None):
    """run_bounded with this file's environment, also timing the run."""
    start = time.monotonic()
    proc = run_bounded(cmd, timeout, env=_env(env), cwd=cwd)
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start,
                  time.time())


def run_launcher(*args, backend="mpi", timeout=60, env=None):
    """``python -m commlib.launch --backend BACKEND args`` (default: the mpiexec
    path, also on GPU machines)."""
    return _bounded([sys.executable, "-m", "commlib.launch", "--backend", backend,
                     *map(str, args)], timeout, env)


def write(path, *parts):
    """Write the dedented ``parts`` (Python source) to ``path``."""
    path.write_text("".join(textwrap.dedent(p) for p in parts))
    return path


def said(stderr):
    """The launcher's own messages (not the ranks', which come prefixed)."""
    return re.findall(r"^commlib\.launch: (.*)$", stderr, re.MULTILINE)


def named_ranks(stderr):
    """Every rank number the launcher's messages name."""
    return {int(r) for line in said(stderr)
            for r in re.findall(r"\branks? ((?:\d+, )*\d+)", line) for r in r.split(", ")}


def alive(pid):
    """Whether ``pid`` runs (zombies count as ended)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def job_processes(pid_dir):
    """The pids of the processes whose environment holds ``PID_DIR=pid_dir``:
    everything a launcher given it started (mpiexec, its proxies, the ranks'
    supervisors, the ranks), whether or not a rank got to record its pid."""
    wanted = b"\0PID_DIR=%s\0" % str(pid_dir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/environ" % entry, "rb") as f:
                    if wanted in b"\0" + f.read() + b"\0":
                        found.append(int(entry))
            except OSError:                 # gone, or not ours to read
                continue
    return found


def assert_all_ended(pid_dir, timeout=10.0, recorded=True):
    """Every worker that recorded its pid in ``pid_dir`` (``recorded``: at
    least one did), and every other process of the job, has ended."""
    pids = [int(p.read_text()) for p in pid_dir.glob("*.pid") if p.read_text()]
    assert pids or not recorded, "no worker recorded its pid"
    deadline = time.monotonic() + timeout
    while (any(alive(p) for p in pids + job_processes(pid_dir))
           and time.monotonic() < deadline):
        time.sleep(0.1)
    assert not [p for p in pids + job_processes(pid_dir) if alive(p)], "workers still running"


# a worker that records its pid in $PID_DIR/<rank>.pid (rank from any launcher);
# failing() records, in $PID_DIR/failing.time, when the rank is about to fail
PID_PRELUDE = """
    import os, sys, time
    RANK = int(os.environ.get("COMMLIB_RANK", os.environ.get("PMI_RANK", "0")))
    with open(os.path.join(os.environ["PID_DIR"], "%d.pid" % RANK), "w") as f:
        f.write(str(os.getpid()))

    def failing():
        with open(os.path.join(os.environ["PID_DIR"], "failing.time"), "w") as f:
            f.write(repr(time.time()))
"""
#: seconds from a rank's failure to the launcher's exit: ending the job after a
#: failure takes SETTLE_S and at most --grace (5 s); the job's start, however
#: long a busy machine makes it, is not counted
ENDED_WITHIN_S = 8


def seconds_after_failure(res, pid_dir):
    """Seconds from the moment a rank called failing() to the launcher's exit."""
    return res.ended - float((pid_dir / "failing.time").read_text())


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
    assert sorted(res.stdout.splitlines()) == \
        ["[%d] hello rank %d of %d ok" % (r, r, n) for r in range(n)], res.stdout
    assert not said(res.stderr), res.stderr


def test_output_lines_are_prefixed_with_the_rank(tmp_path):
    """Unbuffered prints write a line in pieces; each line still comes out
    whole, once prefixed, on stdout and stderr."""
    script = write(tmp_path / "job.py", """
        import sys, time
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.rank
        for i in range(3):
            print("out", rank, "line", i)                    # several writes per line
            print("err", rank, "line", i, file=sys.stderr)
            MPI.COMM_WORLD.Barrier()
        print("no newline from", rank, end="")
    """)
    res = run_launcher("-n", 3, script, timeout=30, env={"PYTHONUNBUFFERED": "1"})
    assert res.returncode == 0, res.stderr
    for stream, tag in ((res.stdout, "out"), (res.stderr, "err")):
        lines = sorted(line for line in stream.splitlines() if " line " in line)
        assert lines == sorted("[%d] %s %d line %d" % (r, tag, r, i)
                               for r in range(3) for i in range(3)), stream
    assert sorted(re.findall(r"^.*no newline.*$", res.stdout, re.MULTILINE)) == \
        ["[%d] no newline from %d" % (r, r) for r in range(3)], res.stdout


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
            failing()
            %s
        comm.all_reduce(np.ones(4))
        print("rank %%d finished" %% comm.rank, flush=True)
    """ % how)
    res = run_launcher("-n", 2, script, timeout=30, env={"PID_DIR": str(tmp_path)})
    assert res.returncode == code, res.stderr
    assert said(res.stderr)[-1].startswith("rank 1 failed with exit code %d" % code), \
        res.stderr
    assert set(re.findall(r"\branks? (\d+)", said(res.stderr)[-1])) == {"1"}, res.stderr
    # rank 0, waiting in all_reduce, may have raised too: then blaming rank 1
    assert said(res.stderr).count("rank 1 raised:") == (1 if "raise" in how else 0), res.stderr
    assert "RuntimeError: rank one breaks" in res.stderr or "raise" not in how
    if "rank 0 raised:" in said(res.stderr):
        assert "PeerError: rank 0: rank 1 " in res.stderr, res.stderr
    assert "finished" not in res.stdout
    assert seconds_after_failure(res, tmp_path) < ENDED_WITHIN_S, res
    assert_all_ended(tmp_path)


# ranks wait for the victim in an mpi4py Ibarrier/Test loop or a commlib barrier
KILLED_RANK = """
    import signal
    VICTIM = int(sys.argv[1])
    if sys.argv[2] == "mpi4py":
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()              # every rank is inside MPI
        if RANK == VICTIM:
            %s
        req = MPI.COMM_WORLD.Ibarrier()
        while not req.Test():
            time.sleep(0.01)
    else:
        import commlib
        comm = commlib.init()
        comm.barrier()
        if RANK == VICTIM:
            %s
        comm.barrier()
    print("rank %%d passed" %% RANK, flush=True)
"""


@pytest.mark.parametrize("victim, waiting", [(0, "mpi4py"), (1, "mpi4py"), (2, "mpi4py"),
                                             (1, "commlib")])
def test_rank_killed_by_sigkill_is_named(tmp_path, victim, waiting):
    """mpiexec SIGKILLs the other ranks within a millisecond; the victim's
    supervisor records the death first, so it, and only it, is named."""
    kill = "failing(); os.kill(os.getpid(), signal.SIGKILL)"
    script = write(tmp_path / "job.py", PID_PRELUDE, KILLED_RANK % (kill, kill))
    res = run_launcher("-n", 3, script, victim, waiting, timeout=30,
                       env={"PID_DIR": str(tmp_path)})
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert said(res.stderr)[-1] == "rank %d was killed by SIGKILL; all workers ended" % victim, \
        res.stderr
    if waiting == "commlib":
        # survivors waiting in commlib may see the death first: they blame the victim
        raised = [int(r) for line in said(res.stderr)
                  for r in re.findall(r"(\d+)", line.partition(" raised:")[0])
                  if line.endswith(" raised:")]
        assert victim not in raised, res.stderr
        if raised:     # each distinct traceback once: a PeerError naming the victim
            assert "PeerError: rank " in res.stderr, res.stderr
            assert "rank %d (pid " % victim in res.stderr, res.stderr
    else:
        assert named_ranks(res.stderr) == {victim}, res.stderr
    assert "passed" not in res.stdout
    assert seconds_after_failure(res, tmp_path) < ENDED_WITHIN_S, res
    assert_all_ended(tmp_path)


@pytest.mark.parametrize("victim, code, status", [(1, 0, 1), (2, 5, 5)])
def test_rank_calling_os_exit_is_named(tmp_path, victim, code, status):
    """os._exit(0) of one rank makes mpiexec itself exit 0; the launcher does not."""
    script = write(tmp_path / "job.py", PID_PRELUDE,
                   KILLED_RANK % (("os._exit(%d)" % code,) * 2))
    res = run_launcher("-n", 3, script, victim, "mpi4py", timeout=30,
                       env={"PID_DIR": str(tmp_path)})
    assert res.returncode == status, res.stderr
    assert said(res.stderr)[-1].startswith(
        "rank %d exited with status %d without finishing its script" % (victim, code)), \
        res.stderr
    assert named_ranks(res.stderr) == {victim}, res.stderr
    assert "passed" not in res.stdout
    assert_all_ended(tmp_path)


def test_the_same_error_on_every_rank_is_printed_once(tmp_path):
    script = write(tmp_path / "job.py", """
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.rank
        MPI.COMM_WORLD.Barrier()
        raise RuntimeError("rank %d: same problem" % rank)
    """)
    res = run_launcher("-n", 3, script, timeout=30)
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
    assert "ranks 0, 1, 2 raised:" in said(res.stderr), res.stderr
    tb = res.stderr.split("commlib.launch: ranks 0, 1, 2 raised:\n", 1)[1]
    assert re.match(r"Traceback \(most recent call last\):\n(.*\n)*?"
                    r"RuntimeError: rank 0: same problem\n", tb), res.stderr
    assert re.match(r"rank \d failed with exit code 1 \(RuntimeError: rank \d: same problem\)",
                    said(res.stderr)[-1]), res.stderr


def test_different_errors_are_printed_separately(tmp_path):
    script = write(tmp_path / "job.py", """
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.rank
        MPI.COMM_WORLD.Barrier()
        if rank == 1:
            raise KeyError("rank %d: second problem" % rank)
        raise ValueError("rank %d: first problem" % rank)
    """)
    res = run_launcher("-n", 3, script, timeout=30)
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 2, res.stderr
    assert {"ranks 0, 2 raised:", "rank 1 raised:"} <= set(said(res.stderr)), res.stderr
    assert res.stderr.count("ValueError: rank 0: first problem\n") == 1, res.stderr
    assert res.stderr.count("KeyError: 'rank 1: second problem'\n") == 1, res.stderr
    assert "first problem" not in res.stderr.split("commlib.launch: rank 1 raised:")[1] \
        .split("commlib.launch:")[0], res.stderr


def test_a_stalled_rank_is_blamed_not_the_rank_that_gave_up_on_it(tmp_path):
    """Rank 1 stalls (blocks forever) while rank 0 waits for it in an
    all-reduce; rank 0's watch dog gives up first, with a
    CollectiveTimeoutError blaming rank 1: the last line blames rank 1."""
    script = write(tmp_path / "job.py", PID_PRELUDE, """
        import threading
        import numpy as np
        import commlib
        comm = commlib.init(timeout=1)
        if comm.rank == 1:
            threading.Event().wait()          # stalls
        comm.all_reduce(np.ones(4))
    """)
    res = run_launcher("-n", 2, script, timeout=30, env={"PID_DIR": str(tmp_path)})
    assert res.returncode == 1, res.stderr
    assert said(res.stderr)[-1].startswith(
        "rank 1 is at fault: rank 0 failed blaming it (CollectiveTimeoutError: rank 0: "
        "all_reduce #1 did not complete before its deadline"), res.stderr
    assert said(res.stderr)[-1].endswith("; all workers ended"), res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
    assert_all_ended(tmp_path)


def test_rank_failing_before_mpi_starts_ends_the_job(tmp_path):
    """A rank that dies before MPI_Init: mpiexec alone would wait forever."""
    script = write(tmp_path / "job.py", PID_PRELUDE, """
        if RANK == 2:
            failing()
            sys.exit(4)
        import commlib
        commlib.init().barrier()
    """)
    res = run_launcher("-n", 3, "--grace", 1, script, timeout=30,
                       env={"PID_DIR": str(tmp_path)})
    assert res.returncode == 4, res.stderr
    assert "rank 2 failed with exit code 4" in res.stderr
    assert seconds_after_failure(res, tmp_path) < ENDED_WITHIN_S, res
    assert_all_ended(tmp_path)


def test_timeout_ends_the_job(tmp_path):
    script = write(tmp_path / "job.py", PID_PRELUDE, "time.sleep(120)\n")
    res = run_launcher("-n", 2, "--timeout", 2, script, timeout=30,
                       env={"PID_DIR": str(tmp_path)})
    assert res.returncode == launch.EXIT_TIMEOUT, res.stderr
    assert "timed out after 2 s" in res.stderr
    assert res.seconds < 12, res.seconds
    # on a busy machine the 2 s may run out before a rank got to record its
    # pid: every process of the job has ended all the same
    assert_all_ended(tmp_path, recorded=False)


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


def test_supervisor_forwards_sigterm_to_its_rank(tmp_path):
    """SIGTERM to the process mpiexec started (the rank's supervisor) reaches
    the rank process once; the rank handles it and finishes normally."""
    script = write(tmp_path / "job.py", PID_PRELUDE, """
        import signal
        got = []
        signal.signal(signal.SIGTERM, lambda *a: got.append(1))
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        print("rank %d got SIGTERM %d times" % (RANK, len(got)), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, *MPI_LAUNCHER, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env({"PID_DIR": str(tmp_path)}), start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len([p for p in tmp_path.glob("*.pid") if p.read_text()]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
            time.sleep(0.1)
        for pid_file in tmp_path.glob("*.pid"):
            with open("/proc/%s/stat" % pid_file.read_text()) as f:
                supervisor = int(f.read().rsplit(")", 1)[1].split()[1])
            os.kill(supervisor, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    assert sorted(out.splitlines()) == ["[%d] rank %d got SIGTERM 1 times" % (r, r)
                                        for r in range(2)], out


MPI_LAUNCHER = ["-m", "commlib.launch", "--backend", "mpi", "-n", "2"]
# the workers start inside supervise(), its signal handlers already installed
FORKED_LAUNCHER = ["-c", "import sys; from commlib import launch; sys.exit(launch.supervise("
                         "lambda: launch.ForkedWorkers.start([sys.executable, sys.argv[1]], 2, %r)))"
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
        from commlib.startup.bootstrap import launcher_env
        assert launcher_env() is None
        print("size", commlib.init().size)
    """)
    res = run_launcher("-n", 1, script, timeout=30,
                       env={"COMMLIB_NCCL_ID": FAKE_ID, "COMMLIB_RANK": "0", "COMMLIB_SIZE": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[0] size 1"


# -- arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["-n", "2", "--mpiexec", "{missing}", "{script}"],
     "error: --mpiexec '{missing}': expected an mpiexec: an executable file, or a program on "
     "PATH (no such file)"),
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
    assert message.format(missing=tmp_path / "missing.py") in res.stderr, res.stderr
    assert "ran" not in res.stdout and "Traceback" not in res.stderr


def test_a_bad_variable_is_one_line_and_status_2(tmp_path):
    script = write(tmp_path / "ok.py", "print('ran')\n")
    res = run_launcher("-n", 2, script, timeout=30, env={"COMMLIB_ABORT_ON_ERROR": "abc"})
    assert res.returncode == 2, res
    assert res.stderr == ("commlib.launch: error: invalid environment variable: "
                          "COMMLIB_ABORT_ON_ERROR='abc': expected 1/true/yes/on or "
                          "0/false/no/off\n"), res.stderr
    assert "ran" not in res.stdout
    # COMMLIB_MPIEXEC is checked where it is read, before anything starts (the
    # launcher prints the error as above: see test_bad_arguments' --mpiexec)
    with pytest.raises(ArgumentError, match=re.escape(
            "COMMLIB_MPIEXEC='abc': expected an mpiexec: an executable file, or a program on "
            "PATH (no such file)")):
        launch.MpiJob.start(str(script), [], 2, base_env=dict(os.environ, COMMLIB_MPIEXEC="abc"))


def test_an_mpiexec_that_starts_nothing_is_not_a_success(tmp_path):
    """/bin/true as mpiexec exits 0 without starting a rank: an error naming
    the ranks that never reported."""
    script = write(tmp_path / "ok.py", "print('ran')\n")
    res = run_launcher("-n", 2, "--mpiexec", "/bin/true", script, timeout=30)
    assert res.returncode == launch.EXIT_WRONG_SIZE, res
    assert said(res.stderr) == [
        "ranks 0, 1 of 2 never ran or never reported finishing, although /bin/true exited "
        "with status 0: /bin/true did not start the ranks as the launcher asked (it is not an "
        "mpiexec, or it sets none of COMMLIB_RANK, PMI_RANK, OMPI_COMM_WORLD_RANK, "
        "MV2_COMM_WORLD_RANK, PMIX_RANK, SLURM_PROCID)"], res.stderr


@pytest.mark.skipif(launch_cli.gpu_status()[0] is None, reason="NCCL is usable here")
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
    monkeypatch.setattr(launch_cli, "gpu_status", lambda: status)
    if isinstance(expected, str):
        assert launch.choose_backend(requested, n) == expected
    else:
        with pytest.raises(expected):
            launch.choose_backend(requested, n)


# -- status records and whom to blame ----------------------------------------------------

def rec(rank, kind, when, **fields):
    return launch.Record(rank, kind, when, **fields)


@pytest.mark.parametrize("records, rank", [
    # the earliest death, whatever its rank
    ([rec(2, "died", 1.0, signal=9), rec(0, "died", 2.0, signal=9)], 2),
    ([rec(0, "done", 0.5), rec(1, "died", 1.0, code=0), rec(2, "failed", 1.5, code=1)], 1),
    # a rank named by another's culprits, even when it died later
    ([rec(0, "failed", 1.0, code=1, exception="PeerError", culprits=(1,)),
      rec(2, "failed", 1.5, code=1, exception="RuntimeError"),
      rec(1, "died", 2.0, signal=9)], 1),
    # a failure blaming others comes after one that did not
    ([rec(0, "failed", 1.0, code=1, exception="PeerError", culprits=(5,)),
      rec(2, "died", 2.0, code=3)], 2),
    # ended on request: never blamed
    ([rec(1, "died", 0.5, signal=15, requested=15),
      rec(2, "failed", 1.0, code=1, exception="PeerError", culprits=(1,))], 2),
    ([rec(0, "done", 1.0), rec(1, "died", 2.0, signal=15, requested=15)], None),
    ([], None),
])
def test_blame(records, rank):
    found = launch.blame(records)
    assert (found and found.rank) == rank
    assert launch.blame(list(reversed(records))) == found


@pytest.mark.parametrize("records, line, status", [
    # ranks that gave up on rank 2 (it stalled: no record of its own) blame it
    ([rec(0, "failed", 1.0, code=1, exception="CollectiveTimeoutError", culprits=(2,),
          message="rank 0: late\nmore"),
      rec(1, "failed", 1.5, code=1, exception="PeerError", culprits=(2,)),
      rec(2, "died", 2.0, signal=15, requested=15)],
     "rank 2 is at fault: ranks 0, 1 failed blaming it (CollectiveTimeoutError: rank 0: late)", 1),
    ([rec(0, "failed", 1.0, code=7, exception="PeerError", culprits=(1, 3))],
     "ranks 1, 3 are at fault: rank 0 failed blaming them (PeerError)", 7),
    # a culprit with a failure of its own is described itself
    ([rec(0, "failed", 1.0, code=1, exception="PeerError", culprits=(1,)),
      rec(1, "died", 2.0, signal=9)], "rank 1 was killed by SIGKILL", 137),
    # bad input on rank 1: every rank's error blames rank 1, rank 1's too
    ([rec(1, "failed", 1.0, code=1, exception="ConsistencyError", culprits=(1,), message="m"),
      rec(0, "failed", 1.1, code=1, exception="ConsistencyError", culprits=(1,))],
     "rank 1 failed with exit code 1 (ConsistencyError blaming rank 1: m)", 1),
    ([rec(0, "done", 1.0)], None, None),
])
def test_verdict_never_blames_a_rank_for_giving_up(records, line, status):
    assert launch.verdict(records) == (None if line is None else (line, status))


@pytest.mark.parametrize("record, text, status", [
    (rec(1, "died", 0, signal=9), "rank 1 was killed by SIGKILL", 137),
    (rec(0, "died", 0, code=0), "rank 0 exited with status 0 without finishing its script", 1),
    (rec(3, "died", 0, code=7, finished=True), "rank 3 exited with status 7 after its script "
                                                "finished", 7),
    (rec(2, "failed", 0, code=3), "rank 2 failed with exit code 3", 3),
    (rec(2, "failed", 0, code=1, exception="PeerError", message="rank 2: gone\nmore",
         culprits=(0, 1)), "rank 2 failed with exit code 1 (PeerError blaming ranks 0, 1: "
                           "rank 2: gone)", 1),
])
def test_record_describe_and_exit_status(record, text, status):
    assert record.describe().startswith(text)
    assert record.exit_status() == status


def test_records_round_trip_through_the_status_dir(tmp_path):
    written = [rec(1, "failed", 2.5, code=1, exception="PeerError", message="m",
                   culprits=(2,), traceback="Traceback...\n"),
               rec(0, "done", 1.5), rec(2, "died", 3.5, signal=9, requested=None)]
    for r in written:
        assert launch.write_record(str(tmp_path), r)
    (tmp_path / "failed.7").write_text("{not json")  # being written: left out
    assert launch.read_records(str(tmp_path)) == sorted(written, key=lambda r: r.time)
    assert not launch.write_record(str(tmp_path / "missing"), written[0])


def test_distinct_tracebacks_ignore_only_the_rank_number():
    def tb(rank, message):
        return rec(rank, "failed", rank, code=1, exception="E",
                   traceback="Traceback:\n  rank %d here\nE: %s\n" % (rank, message))
    records = [tb(2, "rank 2: same"), tb(0, "rank 0: same"), tb(1, "rank 1: other"),
               tb(3, "rank 31: same"), rec(4, "failed", 9, code=3), rec(5, "done", 9)]
    found = launch.distinct_tracebacks(records)
    assert [ranks for ranks, _ in found] == [[0, 2], [1], [3]]
    assert found[0][1] == "Traceback:\n  rank 0 here\nE: rank 0: same\n"


def read_until(fd, ending, timeout=30.0):
    """Bytes read from ``fd`` until they end with ``ending`` (fails after ``timeout`` s)."""
    import select
    got, deadline = b"", time.monotonic() + timeout
    while not got.endswith(ending):
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], "no %r in %r" % (ending, got)
        got += os.read(fd, 65536)
    return got


def test_relay_passes_whole_lines_with_the_prefix(monkeypatch):
    """Lines come out whole, each once prefixed, whatever pieces they are
    written in; a line left unfinished is passed on as it is after
    PARTIAL_LINE_S: the test waits until it came out (no sleep guesses how
    long that takes), then finishes it."""
    monkeypatch.setattr(launch_processes, "PARTIAL_LINE_S", 0.3)
    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    relay = threading.Thread(target=launch_processes.relay, args=(src_r, dst_w, b"[3] "))
    relay.start()
    for part in (b"ab", b"c\n", b"d\r", b"\nbar 1\rbar 2\r", b"\n", b"x\ny\r\nlast"):
        os.write(src_w, part)
    got = read_until(dst_r, b"[3] last")             # passed on unfinished
    os.write(src_w, b" rest\nno newline")
    os.close(src_w)
    relay.join(30)
    os.close(dst_w)
    with os.fdopen(dst_r, "rb") as f:
        assert got + f.read() == (b"[3] abc\n[3] d\r\n[3] bar 1\r[3] bar 2\r\n[3] x\n[3] y\r\n"
                                  b"[3] last rest\n[3] no newline\n")


def test_the_supervisor_does_not_load_mpi():
    """The process mpiexec starts must not initialise MPI (importing
    mpi4py.MPI would): its child's MPI_Init uses mpiexec's connection."""
    code = ("import sys, commlib.launch\n"
            "assert 'mpi4py.MPI' not in sys.modules, sorted(sys.modules)\n")
    res = _bounded([sys.executable, "-c", code], 60)
    assert res.returncode == 0, res.stderr


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


def run_forked(script, n, timeout=30, env=None, partial_line_s=None):
    """The launcher's forked-worker supervision of ``script`` with FAKE_ID
    (``partial_line_s``: the relays' PARTIAL_LINE_S, when given)."""
    code = ("import sys\nfrom commlib import launch\n"
            "from commlib.launch import processes\n"
            "processes.PARTIAL_LINE_S = %r or processes.PARTIAL_LINE_S\n"
            "job = launch.ForkedWorkers.start([sys.executable, %r], %d, %r)\n"
            "sys.exit(launch.supervise(job, timeout=20, grace=2))\n"
            % (partial_line_s, str(script), n, FAKE_ID))
    return _bounded([sys.executable, "-c", code], timeout, env)


def test_forked_workers_get_their_rank_environment(tmp_path):
    script = write(tmp_path / "job.py", """
        import os
        from commlib.startup.bootstrap import launcher_env
        nid, rank, size, local_rank, local_size = launcher_env()
        # one write per line: the three workers share the pipe
        os.write(1, ("worker %s %d %d %d %d\\n" % (str(nid)[:8], rank, size, local_rank,
                                                   local_size)).encode())
    """)
    res = run_forked(script, 3)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == \
        ["[%d] worker abababab %d 3 %d 3" % (r, r, r) for r in range(3)], res.stdout


def test_forked_worker_output_is_prefixed_line_by_line(tmp_path):
    script = write(tmp_path / "job.py", """
        import os, sys, time
        rank = int(os.environ["COMMLIB_RANK"])
        for i in range(3):
            for part in ("out %d " % rank, "line %d\\n" % i):   # one line, two writes
                os.write(1, part.encode())
                time.sleep(0.01)
            print("err", rank, "line", i, file=sys.stderr, flush=True)
    """)
    # a worker the machine's load holds up between its two writes for longer
    # than PARTIAL_LINE_S would have its line passed on in two parts: not here
    res = run_forked(script, 3, partial_line_s=60)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == \
        sorted("[%d] out %d line %d" % (r, r, i) for r in range(3) for i in range(3)), res.stdout
    assert sorted(res.stderr.splitlines()) == \
        sorted("[%d] err %d line %d" % (r, r, i) for r in range(3) for i in range(3)), res.stderr


def run_forked_wrapped(script, n, *args, timeout=30):
    """ForkedWorkers.start_script (the launcher's NCCL path: the --_rank
    wrapper and a status directory) with FAKE_ID."""
    code = ("import sys\nfrom commlib import launch\n"
            "job = launch.ForkedWorkers.start_script(%r, %r, %d, %r)\n"
            "sys.exit(launch.supervise(job, timeout=20, grace=2))\n"
            % (str(script), [str(a) for a in args], n, FAKE_ID))
    return _bounded([sys.executable, "-c", code], timeout)


FORKED_ENDINGS = """
    import os, sys, time
    rank = int(os.environ["COMMLIB_RANK"])
    print("rank", rank, "started", flush=True)
    how = sys.argv[1]
    if how == "same_error":
        raise RuntimeError("rank %d: same problem" % rank)
    if how == "os_exit" and rank == 1:
        os._exit(0)
    if how == "os_exit":
        time.sleep(60)
"""


@pytest.mark.parametrize("how", ["finish", "same_error", "os_exit"])
def test_forked_workers_under_the_rank_wrapper(tmp_path, how):
    script = write(tmp_path / "job.py", FORKED_ENDINGS)
    res = run_forked_wrapped(script, 3, how)
    assert sorted(line for line in res.stdout.splitlines() if "started" in line) == \
        ["[%d] rank %d started" % (r, r) for r in range(3)], res.stdout
    if how == "finish":
        assert res.returncode == 0, res.stderr
        assert not said(res.stderr), res.stderr
    elif how == "same_error":
        assert res.returncode == 1, res.stderr
        assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
        assert "ranks 0, 1, 2 raised:" in said(res.stderr), res.stderr
        assert "RuntimeError: rank 0: same problem\n" in res.stderr
    else:
        assert res.returncode == 1, res.stderr
        assert said(res.stderr)[-1].startswith(
            "rank 1 exited with status 0 without finishing its script"), res.stderr
        assert named_ranks(res.stderr) == {1}, res.stderr


def test_forked_worker_failure_ends_the_others(tmp_path):
    script = write(tmp_path / "job.py", PID_PRELUDE, """
        if RANK == 1:
            failing()
            sys.exit(5)
        time.sleep(120)
    """)
    res = run_forked(script, 3, env={"PID_DIR": str(tmp_path)})
    assert res.returncode == 5, res.stderr
    assert "commlib.launch: rank 1 failed with exit code 5" in res.stderr
    assert seconds_after_failure(res, tmp_path) < ENDED_WITHIN_S, res
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
    if launch_cli.gpu_status()[0] is not None:
        pytest.skip("NCCL is not usable: %s" % launch_cli.gpu_status()[0])
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
    assert_each_rank(res.stdout, r"\[(?P<rank>\d+)\] gpu rank (?P=rank) ok", n)
