"""GPU tests: NCCL at world size 1 (one GPU), and the MPI transport carrying
cupy arrays at world size 2. Skipped, with the reason, without a GPU."""
import multiprocessing as mp

import numpy as np
import pytest

from mpirun import assert_each_rank, run_mpi

pytestmark = pytest.mark.gpu
CODE = "import sys, gpu_checks\ngpu_checks.main(sys.argv[1])\n"


def test_nccl_world_size_1_every_collective():
    proc = run_mpi(1, CODE, args=["nccl"], timeout=240)
    assert_each_rank(proc.stdout, r"gpu nccl rank (?P<rank>\d+) ok", 1)


def test_mpi_transport_with_cupy_arrays_world_size_2():
    proc = run_mpi(2, CODE, args=["mpi"], timeout=240)
    assert_each_rank(proc.stdout, r"gpu mpi rank (?P<rank>\d+) ok", 2)


def _forked_worker(nid, rank, size, queue):
    import cupy
    import commlib
    comm = commlib.Communicator.from_nccl_id(nid, rank, size)
    x = cupy.arange(10, dtype=cupy.float32) * (rank + 1)
    comm.all_reduce(x, division=True)
    h = np.arange(6, dtype=np.float64)        # numpy on an NCCL-only communicator
    comm.all_reduce(h)
    queue.put((rank, cupy.asnumpy(x).tolist(), h.tolist(), comm.backend))
    comm.close()


def test_nccl_id_passed_to_a_spawned_process():
    import commlib
    nid = commlib.NcclId()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_forked_worker, args=(nid, 0, 1, queue))
    proc.start()
    rank, x, h, backend = queue.get(timeout=180)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and backend == "nccl"
    assert x == list(np.arange(10, dtype=np.float32)) and h == list(range(6))


def test_nccl_id_hex_round_trip_through_the_environment():
    import commlib
    nid = commlib.NcclId()
    assert commlib.NcclId.from_hex(str(nid)) == nid and len(nid.data) == 128


def test_resident_blocks_match_the_drivers_occupancy():
    # the grids are sized by _loader.resident_blocks (the occupancy rule on
    # the kernel's attributes); the driver's own answer must agree
    import cupy
    from commlib.ops import _loader, _pack_cuda, cast as cast_mod
    kernels = [("cast.cu", k) for k in cast_mod.KERNEL_NAMES]
    kernels += [("pack.cu", k) for k in _pack_cuda.KERNEL_NAMES]
    kernels += [("topk.cu", k) for k in ("topk_sample", "topk_hist1", "topk_hist1_resid",
                                         "topk_hist1_resid_scalar", "topk_filter",
                                         "topk_refine", "topk_compact")]
    kernels += [("threshold.cu", "threshold_select"), ("sparse.cu", "scatter_add")]
    bad = []
    for source, name in kernels:
        fn = _loader.get_function(source, name)
        want = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, 256, 0)
        got = _loader.resident_blocks(fn, 256)
        if got != want or fn.attributes["local_size_bytes"] != 0:
            bad.append((name, got, want, fn.attributes))
    assert not bad, bad


def test_every_kernel_path_small_against_the_twins():
    import gpu_checks
    gpu_checks.small_workload()


def test_two_streams_at_once_against_the_twins():
    import gpu_checks
    gpu_checks.concurrent_streams()


def test_replayed_buckets_match_the_numpy_path():
    import gpu_checks
    gpu_checks.replayed_buckets()


def test_two_ranks_on_one_gpu_name_the_shared_gpu_and_run_over_mpi():
    """NCCL takes one rank per GPU: with fewer GPUs than ranks on the node,
    backend="nccl" raises naming the shared GPU, and the default
    (backend=None) carries the cupy arrays over the MPI transport."""
    code = """
import cupy, numpy as np, commlib
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
if cupy.cuda.runtime.getDeviceCount() < 2:
    try:
        commlib.Communicator.from_mpi(backend="nccl")
    except commlib.BackendUnavailableError as exc:
        assert "would share GPU 0" in str(exc) and "NCCL takes one rank per GPU" in str(exc), exc
        print("shared gpu named by rank %d" % rank, flush=True)
    else:
        raise AssertionError("NCCL accepted two ranks on one GPU")
comm = commlib.Communicator.from_mpi()
x = cupy.full(1001, comm.rank + 1.0, cupy.float32)
comm.all_reduce(x, op="avg")
assert float(abs(x - 1.5).max()) == 0.0
print("shared gpu rank %d ok over %s" % (comm.rank, comm.backend), flush=True)
comm.close()
"""
    import cupy
    proc = run_mpi(2, code, timeout=120)
    assert_each_rank(proc.stdout, r"shared gpu rank (?P<rank>\d+) ok over ", 2)
    if cupy.cuda.runtime.getDeviceCount() < 2:
        assert_each_rank(proc.stdout, r"shared gpu named by rank (?P<rank>\d+)", 2)
        assert_each_rank(proc.stdout, r"shared gpu rank (?P<rank>\d+) ok over mpi", 2)
