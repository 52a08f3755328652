"""Bad input raises a specific error (never a hang or garbage), on 1-4 ranks."""
import os
import pickle
import sys

import pytest

import commlib
from commlib import errors
from commlib.startup.bootstrap import NcclId, launcher_env
from mpirun import ROOT, assert_each_rank, mpiexec, python_path, run_bounded, run_mpi

CODE = "import sys, error_checks\nerror_checks.main(sys.argv[1])\n"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_argument_errors_name_argument_rank_and_expectation(n):
    proc = run_mpi(n, CODE, args=["arguments"], timeout=60)
    assert_each_rank(proc.stdout, r"errors arguments rank (?P<rank>\d+) ok", n)


@pytest.mark.parametrize("n", [2, 4])
def test_consistency_check_raises_on_every_rank(n):
    proc = run_mpi(n, CODE, args=["consistency"], timeout=60)
    assert_each_rank(proc.stdout, r"consistency (?P<rank>\d+) ok \(rank (?P=rank): ranks "
                     r"disagree on all_reduce #1", n)
    assert_each_rank(proc.stdout, r"errors consistency rank (?P<rank>\d+) ok", n)


def test_consistency_check_enabled_by_environment():
    proc = run_mpi(2, CODE, args=["consistency_env"], timeout=60, env={"COMMLIB_CHECK": "1"})
    assert_each_rank(proc.stdout, r"errors consistency_env rank (?P<rank>\d+) ok", 2)


def test_watchdog_turns_a_missing_peer_into_an_error():
    proc = run_mpi(2, CODE, args=["watchdog_env"], timeout=60, survivors=True,
                   env={"COMMLIB_WATCHDOG_ENABLE": "1", "COMMLIB_WATCHDOG_TIMEOUT": "1"})
    assert "watchdog all_reduce ok" in proc.stdout
    assert "watchdog rank 1 stayed out for 4 s" in proc.stdout


def test_watchdog_on_the_shared_memory_path():
    proc = run_mpi(2, CODE, args=["watchdog_shm"], timeout=60, survivors=True,
                   env={"COMMLIB_WATCHDOG_ENABLE": "1", "COMMLIB_WATCHDOG_TIMEOUT": "1"})
    assert "watchdog all_reduce ok" in proc.stdout
    assert "watchdog rank 1 stayed out for 4 s" in proc.stdout


def test_barrier_timeout():
    proc = run_mpi(2, CODE, args=["barrier_timeout"], timeout=60, survivors=True)
    assert "watchdog barrier ok" in proc.stdout
    assert "watchdog rank 1 stayed out for 4 s" in proc.stdout


def test_uncaught_exception_on_one_rank_ends_the_job():
    proc = run_mpi(3, CODE, args=["uncaught_exception"], timeout=30, expect_fail=True)
    assert "rank one failed" in proc.stderr


def test_sys_exit_on_one_rank_under_python_m_mpi4py_ends_the_job():
    """What the README recommends for bare mpiexec: a nonzero sys.exit on one
    rank aborts the job instead of leaving its peer blocked in a collective."""
    env = dict(os.environ, PYTHONPATH=python_path())
    proc = run_bounded([*mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py",
                        ROOT / "tests" / "collective" / "error_checks.py", "exit_nonzero"], 30, env=env)
    assert proc.returncode != 0 and "not reached" not in proc.stdout


def test_nccl_id_bytes_hex_and_pickle_round_trip():
    nid = NcclId(bytes(range(128)))
    assert NcclId.from_hex(str(nid)) == nid
    assert pickle.loads(pickle.dumps(nid)) == nid
    assert len(nid.for_cupy()) == 128 and min(nid.for_cupy()) == 0
    assert NcclId(bytes([255] * 128)).for_cupy()[0] == -1
    with pytest.raises(errors.ArgumentError, match="expected 128 bytes, got 3"):
        NcclId(b"abc")
    with pytest.raises(errors.ArgumentError, match="not a hex string"):
        NcclId.from_hex("zz")


def test_launcher_environment_parsing():
    nid = NcclId(bytes(128))
    env = {"COMMLIB_NCCL_ID": str(nid), "COMMLIB_RANK": "2", "COMMLIB_SIZE": "4"}
    assert launcher_env(env) == (nid, 2, 4, 2, 4)
    env.update(COMMLIB_LOCAL_RANK="0", COMMLIB_LOCAL_SIZE="2")
    assert launcher_env(env) == (nid, 2, 4, 0, 2)
    assert launcher_env({}) is None
    with pytest.raises(errors.ArgumentError, match="COMMLIB_RANK"):
        launcher_env({"COMMLIB_NCCL_ID": str(nid)})
    with pytest.raises(errors.ArgumentError, match="COMMLIB_RANK='x': expected an int >= 0"):
        launcher_env({"COMMLIB_NCCL_ID": str(nid), "COMMLIB_RANK": "x", "COMMLIB_SIZE": "2"})


def test_from_nccl_id_argument_checks():
    nid = NcclId(bytes(128))
    with pytest.raises(errors.ArgumentError, match="commlib.NcclId"):
        commlib.Communicator.from_nccl_id("abc", 0, 1)
    with pytest.raises(errors.ArgumentError, match="0 <= rank < size"):
        commlib.Communicator.from_nccl_id(nid, 3, 2)


def test_without_gpu_nccl_paths_say_why():
    from commlib.core.gpu import nccl_unavailable_reason
    if nccl_unavailable_reason() is None:
        pytest.skip("NCCL is usable here; this checks the message without it")
    with pytest.raises(errors.BackendUnavailableError, match="NCCL"):
        NcclId()
    with pytest.raises(errors.BackendUnavailableError, match="from_nccl_id needs NCCL"):
        commlib.Communicator.from_nccl_id(NcclId(bytes(128)), 0, 1)
