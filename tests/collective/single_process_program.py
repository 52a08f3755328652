"""Rank program of tests/collective/test_single_process.py: commlib used by one process
with mpi4py unimportable, as after ``pip install .`` without the mpi extra.

    python tests/collective/single_process_program.py
"""
import sys

sys.modules["mpi4py"] = None          # as if mpi4py were not installed
import numpy as np
import commlib
comm = commlib.init()
assert comm.size == 1 and comm.rank == 0 and comm.backend == "local", comm
xs = [np.arange(5, dtype=np.float32), np.ones((3, 4))]
comm.all_reduce(xs, op="avg")
assert (xs[0] == np.arange(5)).all() and (xs[1] == 1).all()
comm.broadcast(xs)
comm.reduce(xs, op="max")
gathered = comm.all_gather(xs[0])
assert gathered.shape == (1, 5) and (gathered[0] == xs[0]).all()
values, counts = comm.all_gatherv(xs[0])
assert (values == xs[0]).all() and counts.tolist() == [5]
assert (comm.reduce_scatter(np.arange(4.0)) == np.arange(4.0)).all()
comm.barrier()
grads = [np.linspace(-1, 1, 100, dtype=np.float32)]
comm.all_reduce(grads, op="avg", compression=commlib.compression.TopK(0.1))
assert np.count_nonzero(grads[0]) == 10          # the 10 largest travelled
try:
    comm.all_reduce(None)
except commlib.ArrayTypeError as exc:
    assert "rank 0" in str(exc)
else:
    raise AssertionError("None accepted")
try:
    commlib.Communicator.from_mpi()
except commlib.BackendUnavailableError as exc:
    assert "pip install '.[mpi]'" in str(exc) and "commlib[mpi]" not in str(exc), exc
else:
    raise AssertionError("from_mpi without mpi4py")
comm.close()
print("single process ok")
