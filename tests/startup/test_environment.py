"""Every COMMLIB_* variable commlib reads is in one table
(commlib.settings.VARIABLES) and in the docs' table, and a bad value of
any of them is an ArgumentError naming it, its value and what is valid
when a communicator is made -- not later, in an exception hook, nor
silently ignored."""
import ast
import os
import re
import subprocess
import sys
import pytest

import commlib
from commlib import settings
from commlib.errors import ArgumentError, LaunchError
from commlib.collective import lifetime
from commlib.startup import mpi_library
from mpirun import ROOT, python_path

LAUNCHING_DOC = ROOT / "docs" / "launching.md"


def names_in_code():
    """Every ``COMMLIB_*`` string constant in commlib's Python sources."""
    found = set()
    for path in (ROOT / "commlib").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= set(re.findall(r"\bCOMMLIB_[A-Z][A-Z0-9_]*\b", node.value))
    return found


def names_in_doc():
    """The variables the docs' table names (first column)."""
    text = LAUNCHING_DOC.read_text()
    table = text[text.index("## Environment variables"):]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return {name for row in rows
            for name in re.findall(r"`((?:COMMLIB|NNABLA)_[A-Z0-9_]+)", row.split(" | ")[0])}


def test_the_table_holds_every_variable_the_code_reads_and_the_docs_list_it():
    code = names_in_code()
    assert {"COMMLIB_TRACE", "COMMLIB_MPIEXEC", "COMMLIB_ABORT_ON_ERROR"} <= code
    assert code - set(settings.VARIABLES) == set()
    assert names_in_doc() == set(settings.VARIABLES)


@pytest.fixture
def clean_env(monkeypatch):
    for name in settings.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


BAD = [(settings.CHECK, "maybe"), (settings.WATCHDOG_ENABLE, "2"),
       (settings.WATCHDOG_TIMEOUT, "-1"), (settings.NNABLA_WATCHDOG_TIMEOUT, "soon"),
       (settings.STALL_WARNING, "inf"), (settings.ABORT_ON_ERROR, "abc"),
       (settings.SHM, "yes please"), (settings.SHM_STORES, "fast"), (settings.WAIT, "yield"), (settings.NATIVE, "-"),
       (settings.KERNEL_DIR, "/nonexistent"), (settings.ASYNC_DEPTH, "0"),
       (settings.CUDA_GRAPHS, "maybe"), (settings.NCCL_ID, "abc"), (settings.RANK, "-1"),
       (settings.SIZE, "two"), (settings.LOCAL_RANK, "x"), (settings.LOCAL_SIZE, "0"),
       (settings.LAUNCH_PREFIX, "2"), (settings.LAUNCH_TERMINAL, "tty")]


def test_every_checked_variable_has_a_bad_value_here():
    unchecked = {name for name, v in settings.VARIABLES.items() if v.parse is str}
    assert unchecked == {settings.NNABLA_WATCHDOG_ENABLE, settings.MPIEXEC, settings.TRACE,
                         settings.LAUNCH_STATUS_DIR}
    assert {name for name, _ in BAD} == set(settings.VARIABLES) - unchecked


@pytest.mark.parametrize("name, value", BAD)
def test_a_bad_value_is_an_error_when_the_communicator_is_made(clean_env, name, value):
    clean_env.setenv(name, value)
    with pytest.raises(ArgumentError, match=re.escape(
            "%s=%r: expected %s" % (name, value, settings.VARIABLES[name].valid))):
        commlib.Communicator.single()


def test_every_bad_variable_is_named_at_once(clean_env):
    clean_env.setenv(settings.ABORT_ON_ERROR, "abc")
    clean_env.setenv(settings.ASYNC_DEPTH, "many")
    with pytest.raises(ArgumentError, match=r"COMMLIB_ABORT_ON_ERROR='abc'.*"
                                            r"COMMLIB_ASYNC_DEPTH='many'"):
        settings.check_environment()


def test_good_values_are_read(clean_env):
    for name, value in [(settings.ABORT_ON_ERROR, "Off"), (settings.STALL_WARNING, "no"),
                        (settings.ASYNC_DEPTH, "2"), (settings.SHM_STORES, "Plain"), (settings.WAIT, "Sleep"),
                        (settings.KERNEL_DIR, str(ROOT / "kernels"))]:
        clean_env.setenv(name, value)
    settings.check_environment()
    assert settings.flag(settings.ABORT_ON_ERROR, True) is False
    assert settings.stall_warning() is None and settings.async_depth() == 2
    assert settings.shm_stores() == "plain"
    commlib.Communicator.single().close()


def test_the_exception_hook_never_raises_on_a_bad_value(clean_env, capsys):
    # made invalid after the communicator checked it: the job still ends
    clean_env.setenv(settings.ABORT_ON_ERROR, "abc")
    assert lifetime.abort_on_error() is True
    assert "COMMLIB_ABORT_ON_ERROR='abc'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["abc", "-1", "0"])
def test_a_bad_launch_size_is_an_error_and_the_others_are_still_read(value):
    env = {"COMMLIB_SIZE": value, "OMPI_COMM_WORLD_SIZE": "2"}
    with pytest.raises(ArgumentError, match=re.escape(
            "COMMLIB_SIZE=%r: expected a positive int (the number of ranks commlib.launch "
            "started); and OMPI_COMM_WORLD_SIZE=2 (set by Open MPI's mpirun) says 2 ranks, "
            "but this process's MPI world has 1" % value)):
        mpi_library.check_world_size(1, env=env)
    with pytest.raises(ArgumentError, match="COMMLIB_SIZE=%r" % value):
        mpi_library.launched_size(env)
    mpi_library.check_world_size(1, env={"PMI_SIZE": "1", "SLURM_STEP_NUM_TASKS": "4"})
    with pytest.raises(LaunchError, match="PMI_SIZE=2"):
        mpi_library.check_world_size(1, env={"PMI_SIZE": "2"})


def test_init_refuses_a_bad_launch_size_beside_a_good_one():
    """Two plain processes told 2 ranks by OMPI_COMM_WORLD_SIZE, beside an
    unparsable COMMLIB_SIZE, used to run as two jobs of size 1."""
    env = {k: v for k, v in os.environ.items()
           if k not in settings.VARIABLES and not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    env.update(PYTHONPATH=python_path(), COMMLIB_SIZE="abc", OMPI_COMM_WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", "import commlib; commlib.init()"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "commlib.errors.ArgumentError: invalid launcher variable: COMMLIB_SIZE='abc': expected "
        "a positive int (the number of ranks commlib.launch started); and "
        "OMPI_COMM_WORLD_SIZE=2 (set by Open MPI's mpirun) says 2 ranks, but this process's "
        "MPI world has 1"), proc.stderr
