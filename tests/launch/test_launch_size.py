"""A job is the size it was launched with: processes whose launcher says N
ranks but whose MPI world has another size raise LaunchError on every
process within seconds; the launcher picks an mpiexec of mpi4py's MPI or
refuses, and ends a job whose ranks report another size; no such job exits 0."""
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from commlib import errors
from commlib.startup import mpi_library
from mpirun import ROOT, run_bounded, run_mpi

PY = sys.executable

INIT = textwrap.dedent("""
    import json, sys, time
    import commlib
    t0 = time.monotonic()
    try:
        comm = commlib.init()
    except commlib.LaunchError as exc:
        print(json.dumps({"error": "LaunchError", "seconds": time.monotonic() - t0,
                          "message": str(exc)}), flush=True)
        sys.exit(3)
    print(json.dumps({"size": comm.size, "rank": comm.rank}), flush=True)
""")


def _env(extra):
    env = dict(os.environ)
    for name, _ in mpi_library.SIZE_VARIABLES:
        env.pop(name, None)
    for name in ("COMMLIB_NCCL_ID", "COMMLIB_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK",
                 "SLURM_PROCID", "SLURM_NTASKS", "COMMLIB_LAUNCH_STATUS_DIR"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _two_plain_processes(variables):
    """Start two plain processes (no launcher) with ``variables`` (a
    function of the rank) at once; their JSON lines and exit codes."""
    procs = [subprocess.Popen([PY, "-c", INIT], env=_env(variables(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process hung instead of raising")
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        results.append((p.returncode, lines[-1] if lines else None, err))
    return results


@pytest.mark.parametrize("size_var,rank_var", [
    ("PMI_SIZE", "PMI_RANK"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("COMMLIB_SIZE", "COMMLIB_RANK"),
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
])
def test_plain_processes_told_two_ranks_raise_on_every_process(size_var, rank_var):
    results = _two_plain_processes(lambda r: {size_var: "2", rank_var: str(r)})
    for rank, (code, line, err) in enumerate(results):
        assert code == 3 and line and line["error"] == "LaunchError", (rank, code, line, err)
        assert line["seconds"] < 5, line
        message = line["message"]
        assert "%s=2" % size_var in message, message
        assert "MPI world has 1 rank" in message, message
        assert "mpi4py loads" in message and "Fix:" in message, message


def test_a_batch_allocation_around_one_process_is_not_a_launch():
    # SLURM_NTASKS is set in a batch script around a single process: not a job step
    results = _two_plain_processes(lambda r: {"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"})
    for code, line, err in results:
        assert code == 0 and line == {"size": 1, "rank": 0}, (code, line, err)


def test_without_mpi4py_a_launched_process_does_not_run_alone(tmp_path):
    # an mpi4py that cannot be imported: a launcher saying 2 ranks is an error
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no mpi4py here')\n")
    env = _env({"COMMLIB_SIZE": "2", "COMMLIB_RANK": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    res = run_bounded([PY, "-c", "import commlib; commlib.init()"], 60, env=env)
    assert res.returncode != 0
    assert "BackendUnavailableError" in res.stderr and "COMMLIB_SIZE=2" in res.stderr, res.stderr
    env = _env({})
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    res = run_bounded([PY, "-c", "import commlib; print(commlib.init().size)"], 60, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "1", res.stderr


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_right_sized_job_still_runs(n):
    proc = run_mpi(n, INIT, timeout=60)
    got = sorted(int(rank) for size, rank in
                 re.findall(r'"size": (\d+), "rank": (\d+)', proc.stdout) if int(size) == n)
    assert got == list(range(n)), proc.stdout


# -- which mpiexec -----------------------------------------------------------------------

HYDRA_VERSION = "HYDRA build details:\n    Version:                                 9.9.9\n"
OPENMPI_VERSION = "mpiexec (OpenRTE) 4.1.6\n\nReport bugs to http://www.open-mpi.org/\n"


def fake_mpiexec(path, version_text):
    """An executable that answers ``--version`` with ``version_text`` and
    otherwise starts ``-n N cmd...`` as N plain processes with hydra's
    PMI_RANK/PMI_SIZE (or Open MPI's variables) set, but no PMI server: a
    foreign mpiexec, as mpi4py's library sees it. SIGTERM ends its ranks."""
    openmpi = "OpenRTE" in version_text
    path.write_text(textwrap.dedent("""\
        #!%s
        import os, signal, subprocess, sys
        if "--version" in sys.argv:
            sys.stdout.write(%r)
            sys.exit(0)
        args = sys.argv[1:]
        while args[0] != "-n":
            args.pop(0)
        n, cmd = int(args[1]), args[2:]
        names = %r
        procs = [subprocess.Popen(cmd, env=dict(os.environ, **{names[0]: str(r),
                                                               names[1]: str(n)}))
                 for r in range(n)]
        def end(signum, frame):        # as a real mpiexec: its ranks end with it
            for p in procs:
                p.kill()
            sys.exit(128 + signum)
        signal.signal(signal.SIGTERM, end)
        signal.signal(signal.SIGINT, end)
        sys.exit(max(p.wait() for p in procs))
        """ % (PY, version_text, ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE") if openmpi
               else ("PMI_RANK", "PMI_SIZE"))))
    path.chmod(0o755)
    return path


def test_family_of_libraries_and_mpiexecs():
    assert mpi_library.library_family("MPICH Version: 5.0.2\n") == "mpich"
    assert mpi_library.library_family("Intel(R) MPI Library 2021.13 for Linux") == "mpich"
    assert mpi_library.library_family("Open MPI v4.1.6, package: Debian OpenMPI") == "openmpi"
    assert mpi_library.library_family("something else") is None
    assert mpi_library.mpiexec_family(HYDRA_VERSION) == "mpich"
    assert mpi_library.mpiexec_family(OPENMPI_VERSION) == "openmpi"
    assert mpi_library.mpiexec_family("mpiexec (Open MPI) 5.0.3") == "openmpi"
    assert mpi_library.mpiexec_family("usage: ...") is None


def test_choose_skips_a_foreign_mpiexec_first_on_path(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    fake_mpiexec(first / "mpiexec", OPENMPI_VERSION)
    fake_mpiexec(second / "mpiexec", HYDRA_VERSION)
    mpich = mpi_library.Library("MPICH Version: 5.0.2", "mpich", None)
    env = {"PATH": "%s:%s" % (first, second)}
    chosen = mpi_library.choose_mpiexec(python=str(tmp_path / "nopython"), env=env,
                                        library=mpich)
    assert chosen.path == str(second / "mpiexec") and chosen.family == "mpich", chosen
    assert mpi_library.extra_args(chosen) == []
    openmpi = mpi_library.Library("Open MPI v4.1.6", "openmpi", None)
    chosen = mpi_library.choose_mpiexec(python=str(tmp_path / "nopython"), env=env,
                                        library=openmpi)
    assert chosen.path == str(first / "mpiexec"), chosen
    assert "--oversubscribe" in mpi_library.extra_args(chosen)
    assert ("--allow-run-as-root" in mpi_library.extra_args(chosen)) == (os.geteuid() == 0)


def test_choose_refuses_when_only_foreign_mpiexecs_exist(tmp_path):
    fake_mpiexec(tmp_path / "mpiexec", HYDRA_VERSION)
    openmpi = mpi_library.Library("Open MPI v4.1.6", "openmpi",
                                  str(tmp_path / "lib" / "libmpi.so.40"))
    with pytest.raises(errors.LaunchError) as info:
        mpi_library.choose_mpiexec(python=str(tmp_path / "nopython"),
                                   env={"PATH": str(tmp_path)}, library=openmpi)
    text = str(info.value)
    assert "Open MPI v4.1.6" in text and str(tmp_path / "mpiexec") in text, text
    assert "(mpich)" in text and "Fix:" in text and "MPI4PY_LIBMPI" in text, text
    with pytest.raises(errors.LaunchError, match="the mpiexec named belongs to another MPI"):
        mpi_library.choose_mpiexec(explicit=str(tmp_path / "mpiexec"),
                                   env={"PATH": str(tmp_path)}, library=openmpi)


def test_loaded_library_is_this_interpreters():
    from mpi4py import MPI
    found = mpi_library.loaded_library()
    assert found.version == " ".join(MPI.Get_library_version().replace("\x00", "")
                                     .splitlines()[0].split())
    assert found.family in ("mpich", "openmpi") and found.path and os.path.exists(found.path)


# -- the launcher ------------------------------------------------------------------------

JOB = textwrap.dedent("""
    import sys, time
    import commlib
    try:
        comm = commlib.init()
    except commlib.LaunchError:
        if "--ignore" not in sys.argv:
            raise
        time.sleep(60)        # a script that swallows the error: the launcher must end it
        sys.exit(0)
    print("rank", comm.rank, "of", comm.size, "ran", flush=True)
""")


def launcher(args, timeout=90, env=None):
    full = _env(env or {})
    return run_bounded([PY, "-m", "commlib.launch", *map(str, args)], timeout, env=full)


def test_launcher_refuses_a_named_mpiexec_of_another_mpi(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    fake = fake_mpiexec(tmp_path / "mpirun", OPENMPI_VERSION)
    t0 = time.monotonic()
    res = launcher(["-n", 2, "--backend", "mpi", "--mpiexec", fake, script])
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "the mpiexec named belongs to another MPI" in res.stderr, res.stderr
    assert "Fix:" in res.stderr and str(fake) in res.stderr, res.stderr
    assert "ran" not in res.stdout
    assert time.monotonic() - t0 < 30
    res = launcher(["-n", 2, "--backend", "mpi", script],
                   env={"COMMLIB_MPIEXEC": str(fake)})
    assert res.returncode == 2 and "belongs to another MPI" in res.stderr, res.stderr


@pytest.mark.parametrize("ignore", [False, True], ids=["raises", "swallows"])
def test_launcher_ends_a_job_whose_ranks_see_another_size(tmp_path, ignore):
    # an mpiexec that claims to be hydra but starts plain processes: every
    # rank is a singleton of size 1
    script = tmp_path / "job.py"
    script.write_text(JOB)
    fake = fake_mpiexec(tmp_path / "mpiexec", HYDRA_VERSION)
    t0 = time.monotonic()
    res = launcher(["-n", 2, "--backend", "mpi", "--grace", 1, "--mpiexec", fake, script]
                   + (["--ignore"] if ignore else []))
    took = time.monotonic() - t0
    assert res.returncode != 0, (res.stdout, res.stderr)
    assert "ran" not in res.stdout, res.stdout
    assert "-n 2, but rank 0 sees a world of 1; rank 1 sees a world of 1" in res.stderr, \
        res.stderr
    assert "Fix:" in res.stderr, res.stderr
    if not ignore:
        assert "LaunchError" in res.stderr and "PMI_SIZE=2" in res.stderr, res.stderr
    assert took < 30, took


def test_launcher_picks_the_mpiexec_beside_python_over_a_foreign_one_on_path(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    here = mpi_library.loaded_library()
    fake = fake_mpiexec(tmp_path / "mpiexec", OPENMPI_VERSION if here.family == "mpich"
                        else HYDRA_VERSION)
    res = launcher(["-n", 2, "--backend", "mpi", script],
                   env={"PATH": "%s:%s" % (fake.parent, os.environ.get("PATH", ""))})
    assert res.returncode == 0, (res.stdout, res.stderr)
    lines = sorted(line.split("] ", 1)[-1] for line in res.stdout.splitlines() if "ran" in line)
    assert lines == ["rank 0 of 2 ran", "rank 1 of 2 ran"], res.stdout


def test_run_mpi_fails_a_job_that_ran_as_singletons(tmp_path, monkeypatch):
    """The harness's proof of size: a foreign mpiexec's singletons each
    report (0, 1), and run_mpi fails the test instead of passing it."""
    import mpirun
    fake = fake_mpiexec(tmp_path / "mpiexec", HYDRA_VERSION)
    monkeypatch.setattr(mpirun, "mpiexec", lambda required=True: [str(fake)])
    with pytest.raises(pytest.fail.Exception, match=r"\(rank, size\) = \[\(0, 1\), \(0, 1\)\]"):
        mpirun.run_mpi(2, "print('hello')\n", timeout=60)
    with pytest.raises(pytest.fail.Exception, match="one MPI world of 3 ranks"):
        mpirun.check_world([{"rank": 0, "size": 3}, {"rank": 1, "size": 3}], 3)
    mpirun.check_world([{"rank": r, "size": 3} for r in (2, 0, 1)], 3)
