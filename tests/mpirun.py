"""Run a Python snippet under ``mpiexec -n N`` with a hard time bound, and
prove that it ran as one job of N ranks.

With MPICH, a rank that exits early leaves its peers blocked forever, so
every multi-process test goes through :func:`run_mpi`, which kills the whole
job after ``timeout`` seconds and fails the test with the job's output.

An mpiexec of another MPI than mpi4py's starts N singletons of size 1 that
each pass on their own, so :func:`run_mpi` runs every snippet behind a
prologue that records, per process, the rank and size of its MPI world, and
fails unless ranks 0..N-1 of a world of size N each reported exactly once.
The mpiexec is the one :func:`commlib.startup.mpi_library.choose_mpiexec` picks for
this interpreter's mpi4py (with Open MPI's ``--oversubscribe`` and, as root,
``--allow-run-as-root``).
"""
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: where rank programs import from: the checkout, the shared helpers of
#: tests/ and every test folder (each rank program lies beside its tests)
IMPORT_DIRS = [ROOT, ROOT / "tests"] + sorted(
    p for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("*.py")))


def python_path(env=None):
    """``PYTHONPATH`` for a child process: :data:`IMPORT_DIRS` ahead of the
    one in ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    return os.pathsep.join([str(d) for d in IMPORT_DIRS] + [env.get("PYTHONPATH", "")])


#: the folder where each rank of a run_mpi job writes its record
ENV_REPORTS = "COMMLIB_TEST_RANK_REPORTS"

# Runs before the snippet, in every process: MPI is initialised as mpi4py's
# defaults (and MPI4PY_RC_* variables) say, and the world's rank and size
# are written to a file of this process's own.
PROLOGUE = """\
def _commlib_test_report():
    import json, os
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    folder = os.environ[%r]
    path = os.path.join(folder, "rank-%%d-pid-%%d.json" %% (world.Get_rank(), os.getpid()))
    with open(path, "w") as f:
        json.dump({"rank": world.Get_rank(), "size": world.Get_size(), "pid": os.getpid(),
                   "library": MPI.Get_library_version().splitlines()[0]}, f)
_commlib_test_report()
del _commlib_test_report
""" % ENV_REPORTS


@functools.lru_cache(maxsize=None)
def _chosen():
    from commlib.startup import mpi_library
    return mpi_library.choose_mpiexec()


def mpiexec(required=True):
    """The command that starts ranks of this interpreter's mpi4py: a list,
    the mpiexec of its MPI library and the arguments it needs; None if
    there is none and not ``required`` (the test fails if ``required``)."""
    from commlib import errors
    from commlib.startup import mpi_library
    try:
        chosen = _chosen()
    except errors.CommlibError as exc:
        if required:
            pytest.fail("no mpiexec for this mpi4py: %s" % exc)
        return None
    return [chosen.path, *mpi_library.extra_args(chosen)]


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


def read_reports(folder):
    """The records the ranks of a job wrote into ``folder``."""
    found = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            found.append(json.load(f))
    return found


def check_world(reports, n, what="the job"):
    """Fail unless ``reports`` are exactly ranks 0..n-1 of one world of size n."""
    got = sorted((r["rank"], r["size"]) for r in reports)
    want = [(r, n) for r in range(n)]
    if got != want:
        pytest.fail("%s was to run as one MPI world of %d ranks, but its processes reported "
                    "(rank, size) = %s (mpi4py's library: %s). An mpiexec of another MPI "
                    "than mpi4py's makes every process a singleton of size 1."
                    % (what, n, got, sorted({r.get("library") for r in reports})))


def keep_survivors():
    """Arguments that stop the mpiexec of :func:`mpiexec` from ending the
    other ranks when one leaves without ``MPI_Finalize``.

    Hydra (MPICH) SIGKILLs the rest of the job when a rank exits without
    finalizing, and whether mpiexec then exits 0 or 9 depends on which exit
    it hears of first: a test whose rank leaves early on purpose would pass
    or fail by chance. ``-disable-auto-cleanup`` lets each rank end by itself.
    Open MPI's mpirun has no such switch (it ends such a job as failed);
    the tests that need this run under hydra.
    """
    from commlib.startup import mpi_library
    return ["-disable-auto-cleanup"] if _chosen().family == mpi_library.MPICH else []


def run_mpi(n, code, timeout=60, env=None, args=(), expect_fail=False, survivors=False):
    """Run ``code`` (Python source) on ``n`` ranks; returns the CompletedProcess.

    Fails the test when the job times out, when its exit status is not what
    ``expect_fail`` says, or when ranks 0..n-1 of a world of size n did not
    each start (see :data:`PROLOGUE`). With ``survivors``, a rank that
    leaves without ``MPI_Finalize`` does not end the others (see
    :func:`keep_survivors`): for programs whose ranks ``os._exit`` at
    different times on purpose.
    """
    tmp = Path(os.environ.get("PYTEST_TMPDIR", tempfile.gettempdir()))
    # made exclusively under a random name: never a name planted in a shared /tmp
    fd, script = tempfile.mkstemp(prefix="commlib_mpi_", suffix=".py", dir=str(tmp))
    script = Path(script)
    with os.fdopen(fd, "w") as f:
        f.write(PROLOGUE + textwrap.dedent(code))
    reports = tempfile.mkdtemp(prefix="commlib-ranks-", dir=str(tmp))
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = python_path(full_env)
    full_env.update(env or {})
    full_env[ENV_REPORTS] = reports
    launcher = mpiexec(required=n > 1)
    # one rank without mpiexec runs as an MPI singleton
    if launcher and survivors:
        launcher = launcher + keep_survivors()
    cmd = (launcher + ["-n", str(n)] if launcher else []) + [sys.executable, str(script), *args]
    try:
        proc = run_bounded(cmd, timeout, env=full_env)
        check_world(read_reports(reports), n, "mpiexec -n %d" % n)
    finally:
        script.unlink(missing_ok=True)
        for name in os.listdir(reports):
            os.unlink(os.path.join(reports, name))
        os.rmdir(reports)
    failed = proc.returncode != 0
    if failed != expect_fail:
        pytest.fail("mpiexec -n %d exited %d\nstdout:\n%s\nstderr:\n%s"
                    % (n, proc.returncode, proc.stdout, proc.stderr))
    return proc


def ranks_saying(text, pattern):
    """The ranks, in order of appearance, of the matches of ``pattern`` (a
    regular expression with a ``(?P<rank>\\d+)`` group) in ``text``. Output
    of several ranks can share a line (an unbuffered print writes its text
    and its newline apart), so matches are searched in the whole text."""
    return [int(m.group("rank")) for m in re.finditer(pattern, text)]


def assert_each_rank(text, pattern, n):
    """Assert that each of ranks 0..n-1 said ``pattern`` (with a
    ``(?P<rank>\\d+)`` group) once, and no other rank did."""
    said = ranks_saying(text, pattern)
    assert sorted(said) == list(range(n)), (
        "expected one %r line from each of ranks 0..%d, got ranks %s\n%s"
        % (pattern, n - 1, said, text))
