"""commlib's NCCL transport at 1-4 ranks without a GPU: the host build's
cupy with the NCCL stand-in (tests/ops/nccl_standin.py) under mpiexec, one
job per world size for the collectives (and, from 3 ranks, the stand-in's
own contract), one of 3 ranks for the other calls at an odd size and the
faults. Expected values come from numpy on every rank's inputs
(tests/transport/nccl_standin_programs.py)."""
import os
import re

import pytest

import cuda_host_build as chb
from mpirun import assert_each_rank, python_path, ranks_saying, run_mpi

CODE = "import sys, nccl_standin_programs\nnccl_standin_programs.main(sys.argv[1])\n"

needs_host_build = pytest.mark.skipif(chb.GXX is None or chb.OBJCOPY is None,
                                      reason="the host build needs g++ and objcopy")


@pytest.fixture(scope="module")
def nccl_env(tmp_path_factory):
    """Environment whose ``import cupy`` is the host build's, four devices,
    ``cupy.cuda.nccl`` the stand-in."""
    d = tmp_path_factory.mktemp("hostcupy-nccl")
    chb.write_cupy_package(d, chb.build(), nccl=True, devices=4)
    return {"PYTHONPATH": os.pathsep.join([str(d), python_path()]),
            "COMMLIB_NCCL_STANDIN_LIMIT_S": "60"}


@needs_host_build
@pytest.mark.parametrize("n", [1, 2, 4])
def test_nccl_transport_collectives(nccl_env, n):
    proc = run_mpi(n, CODE, args=["collectives"], env=nccl_env, timeout=300)
    assert_each_rank(proc.stdout, r"nccl stand-in collectives rank (?P<rank>\d+) ok", n)


@needs_host_build
def test_nccl_transport_odd_size_calls_and_faults(nccl_env):
    """At 3 ranks: the point-to-point, rooted, all-to-all, object and split
    calls on an NCCL-only communicator, then the faults."""
    proc = run_mpi(3, CODE, args=["calls,faults"], env=nccl_env, timeout=300)
    out = proc.stdout
    assert_each_rank(out, r"nccl stand-in calls rank (?P<rank>\d+) ok", 3)
    assert_each_rank(out, r"nccl stand-in faults rank (?P<rank>\d+) ok", 3)
    # an NCCL-only communicator's split without rank 0: ranks 1 and 2 name it
    assert sorted(ranks_saying(out, r"rank (?P<rank>\d): split timed out waiting for rank 0")) \
        == [1, 2], out
    # rank 0 late: ranks 1 and 2 time out naming it; then rank 2 late
    assert sorted(int(a) for a in re.findall(
        r"rank (\d) timed out waiting for rank 0", out)) == [1, 2], out
    assert sorted(int(a) for a in re.findall(
        r"rank (\d) timed out waiting for rank 2", out)) == [0, 1], out
    for stalled in (0, 2):
        assert_each_rank(out, r"rank (?P<rank>\d): watch timed out with rank %d stalled" % stalled,
                         3)
    for failing in (0, 1):
        assert_each_rank(out, r"rank (?P<rank>\d): transport error naming rank %d" % failing, 3)
