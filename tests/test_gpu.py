"""GPU tests: NCCL at world size 1 (one GPU), and the MPI transport carrying
cupy arrays at world size 2. Skipped, with the reason, without a GPU."""
import multiprocessing as mp

import numpy as np
import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.gpu
CODE = "import sys, gpu_checks\ngpu_checks.main(sys.argv[1])\n"


def test_nccl_world_size_1_every_collective():
    proc = run_mpi(1, CODE, args=["nccl"], timeout=240)
    assert "gpu nccl rank 0 ok" in proc.stdout


def test_mpi_transport_with_cupy_arrays_world_size_2():
    proc = run_mpi(2, CODE, args=["mpi"], timeout=240)
    assert proc.stdout.count("ok") == 2


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
