"""Compressed all-reduce (commlib.compression) on 1-4 real MPI ranks,
against numpy on every rank's inputs; with cupy arrays on a GPU."""
import pytest

from mpirun import assert_each_rank, run_mpi

CODE = "import sys, compression_checks\ncompression_checks.main(sys.argv[1])\n"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_compressed_all_reduce_numpy(n):
    pytest.importorskip("ml_dtypes", reason="the bfloat16 reference needs ml_dtypes")
    proc = run_mpi(n, CODE, args=["numpy"], timeout=120)
    assert_each_rank(proc.stdout, r"compression rank (?P<rank>\d+) ok", n)


@pytest.mark.parametrize("n", [2])
def test_compressed_all_reduce_without_shared_memory_or_compiled_loops(n):
    pytest.importorskip("ml_dtypes", reason="the bfloat16 reference needs ml_dtypes")
    proc = run_mpi(n, CODE, args=["numpy"], timeout=120,
                   env={"COMMLIB_SHM": "0", "COMMLIB_NATIVE": "0"})
    assert_each_rank(proc.stdout, r"compression rank (?P<rank>\d+) ok", n)


@pytest.mark.gpu
def test_compressed_all_reduce_cupy_nccl_world_size_1():
    proc = run_mpi(1, CODE, args=["cupy"], timeout=240)
    assert "compression rank 0 ok" in proc.stdout
