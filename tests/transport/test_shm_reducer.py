"""commlib.transport.shm.SharedMemoryReducer on 1-4 real MPI ranks: every
dtype and op, odd and zero lengths, repeated calls of changing size, against
a numpy reduction in rank order of every rank's input, bit for bit on every
rank. The rank programs are in tests/transport/reducer_programs.py."""
import pytest

from mpirun import assert_each_rank, run_mpi

CODE = "import runpy, sys\nrunpy.run_module('reducer_programs', run_name='__main__')\n"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reducer_matches_rank_order_numpy_reduction(n):
    """With 3 ranks, the communicator's thresholds too: one element below,
    at and above the shared-memory threshold, one and two windows, and a
    fused bucket of one window."""
    proc = run_mpi(n, CODE, timeout=60, args=("reduce", "auto") + (("thresholds",) if n == 3
                                                                    else ()))
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", n)


@pytest.mark.parametrize("n,mode,stores", [
    (1, "all", "auto"), (2, "all", "auto"), (3, "all", "auto"), (4, "all", "auto"),
    (2, "all", "plain"), (3, "all", "streaming"), (4, "all", "streaming"),
    (2, "none", "auto"), (3, "even", "auto"), (4, "even", "streaming")])
def test_reducer_of_many_parts_with_scale(n, mode, stores):
    """Buckets given as lists of arrays: reduced straight from and into them
    with the compiled loops, through the slots with numpy, or mixed; with
    plain, streaming or measured stores."""
    proc = run_mpi(n, CODE, timeout=60, args=("parts", mode, stores))
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", n)


def test_reducer_with_mpi_barrier_sync():
    """MPI_Ibarrier instead of the flags: repeated calls of changing sizes
    and dtypes, pieces longer than the window (the grid of every dtype,
    length and op runs with the flags above)."""
    proc = run_mpi(3, CODE, timeout=60, args=("reduce", "barrier", "no-grid"))
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", 3)


def test_reducer_argument_errors():
    proc = run_mpi(2, CODE, timeout=60, args=("errors",))
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", 2)


def test_waiting_rank_lets_other_threads_run():
    proc = run_mpi(2, CODE, timeout=60, args=("gil",))
    assert "thread CPU while waiting" in proc.stdout
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", 2)
