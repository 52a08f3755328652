"""Every collective against numpy, in real MPI jobs of 1 to 4 ranks."""
import pytest

from mpirun import ROOT, assert_each_rank, run_mpi

SIZES = [1, 2, 3, 4]


def run_checks(n, which, timeout=120, env=None):
    code = ("import sys, collective_checks\n"
            "collective_checks.main(sys.argv[1], sys.argv[2])\n")
    proc = run_mpi(n, code, timeout=timeout, env=env,
                   args=[which, str(ROOT / "tests" / "data" / "resnet50.json")])
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", n)


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_every_dtype_op_and_length(n):
    run_checks(n, "all_reduce")


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_many_small_mixed_arrays_and_buckets(n):
    run_checks(n, "many,buckets,flat_views")


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_and_reduce_every_root(n):
    run_checks(n, "broadcast_reduce")


@pytest.mark.parametrize("n", SIZES)
def test_all_gather_reduce_scatter_gatherv_barrier(n):
    run_checks(n, "gather_scatter")


@pytest.mark.parametrize("n", [3, 4])
def test_communicator_on_a_split_of_comm_world(n):
    run_checks(n, "sub")


@pytest.mark.parametrize("n", [2, 4])
def test_all_reduce_resnet50_gradient_list(n):
    run_checks(n, "resnet50", timeout=240)


@pytest.mark.parametrize("n", [1, 3])
def test_bfloat16_all_reduce_over_mpi(n):
    pytest.importorskip("ml_dtypes", reason="bfloat16 on numpy needs ml_dtypes")
    run_checks(n, "bfloat16")


@pytest.mark.parametrize("n", [2, 3])
def test_plain_mpi_and_numpy_paths(n):
    """The same checks with the shared-memory reducer and the compiled host
    loops turned off: MPI's own all-reduce and numpy packing."""
    run_checks(n, "all_reduce,many,buckets,flat_views",
               env={"COMMLIB_SHM": "0", "COMMLIB_NATIVE": "0"})


@pytest.mark.parametrize("n", [2, 4])
def test_shared_memory_reducer_without_compiled_loops(n):
    """The shared-memory reducer with numpy doing the copies and reductions."""
    run_checks(n, "all_reduce,many,buckets,flat_views", env={"COMMLIB_NATIVE": "0"})
