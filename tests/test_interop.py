"""Arrays of other frameworks (commlib.interop): torch tensors reduced in
place on real MPI ranks against numpy results (tests/interop_programs.py),
the optimizer with torch parameters against the same run with numpy ones,
and the errors for tensors commlib cannot write into (non-contiguous,
inference tensors, JAX arrays, read-only DLPack exports), on ranks of this
process."""
import re

import numpy as np
import pytest

import commlib
from commlib import interop
from commlib.errors import ArrayTypeError, ConsistencyError
from inprocess import run_ranks
from mpirun import assert_each_rank, run_mpi

torch = pytest.importorskip("torch")
CODE = "import sys, interop_programs\ninterop_programs.main()\n"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_tensors_through_real_mpi_ranks_match_numpy(n):
    proc = run_mpi(n, CODE, timeout=240, args=["all_reduce,broadcast,new_arrays,optimizer"])
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", n)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
def test_torch_cuda_tensors_reduced_in_place_match_numpy(n):
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    proc = run_mpi(n, CODE, timeout=240, args=["cuda"])
    assert_each_rank(proc.stdout, r"rank (?P<rank>\d+) ok", n)


# -- on ranks of this process -------------------------------------------------------------
def outcome(fn):
    """``fn(comm)`` wrapped to return the exception it raised (or its result)."""
    def body(comm):
        try:
            return fn(comm)
        except commlib.errors.CommlibError as exc:
            return exc
    return body


def test_views_share_memory_and_are_kept_for_the_same_tensor():
    t = torch.arange(6, dtype=torch.float32)
    view = interop.native(t, writeable=True)
    assert isinstance(view, np.ndarray) and view.flags.writeable
    view[0] = 42
    assert t[0].item() == 42
    assert interop.native(t) is view                    # the same view while t is the same
    t.data = torch.zeros(3)
    again = interop.native(t)
    assert again is not view and again.shape == (3,)
    assert interop.native_list([t.numpy()]) is not None
    plain = [np.ones(2), np.zeros(3)]
    assert interop.native_list(plain) is plain          # numpy lists pass untouched


def test_requires_grad_and_bfloat16_tensors_reduced_in_place_on_two_ranks():
    def body(comm):
        w = torch.full((5,), float(comm.rank + 1), requires_grad=True)
        b = torch.full((3,), comm.rank + 1.5, dtype=torch.bfloat16)
        comm.all_reduce([w, b])
        return w.detach().tolist(), b.float().tolist(), w.requires_grad
    for w, b, grad in run_ranks(2, body):
        assert w == [3.0] * 5 and b == [4.0] * 3 and grad


def test_all_gather_of_torch_and_jax_returns_their_types():
    jnp = pytest.importorskip("jax.numpy")

    def body(comm):
        t = comm.all_gather(torch.full((2,), comm.rank, dtype=torch.int64))
        j = comm.all_gather(jnp.full((2,), comm.rank, dtype=jnp.float32))
        return t, j
    for t, j in run_ranks(2, body):
        assert isinstance(t, torch.Tensor) and t.tolist() == [[0, 0], [1, 1]]
        assert type(j).__module__.split(".")[0] in ("jax", "jaxlib")
        assert np.asarray(j).tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_non_contiguous_tensor_raises_naming_the_argument_and_the_rank():
    def fn(comm):
        comm.all_reduce([torch.ones(3), torch.ones(4, 6).T])
    for rank, exc in enumerate(run_ranks(2, outcome(fn))):
        assert isinstance(exc, ArrayTypeError), exc
        assert "rank %d: arrays[1]" % rank in str(exc) and "not C-contiguous" in str(exc)


def test_inference_tensor_is_not_written_outside_inference_mode():
    with torch.inference_mode():
        frozen = [torch.ones(3), torch.ones(3)]

    def fn(comm):
        comm.all_reduce([torch.ones(2), frozen[comm.rank]])
    for rank, exc in enumerate(run_ranks(2, outcome(fn))):
        assert isinstance(exc, ArrayTypeError), exc
        assert "rank %d: arrays[1] (torch.Tensor) is a torch inference tensor" % rank in str(exc)
    assert frozen[0].tolist() == [1.0] * 3
    with torch.inference_mode():        # inside inference mode torch allows it, and so do we
        inside = torch.ones(2)
        commlib.Communicator.single().all_reduce([inside])


class ReadOnlyExport:
    """An array of some framework that exports its memory read-only over
    DLPack (a versioned capsule with the read-only flag)."""

    def __init__(self, values):
        self.values = np.array(values)
        self.values.flags.writeable = False

    def __dlpack__(self, **kw):
        return self.values.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.values.__dlpack_device__()


def test_read_only_export_raises_for_in_place_and_is_read_by_all_gather():
    def fn(comm):
        x = ReadOnlyExport([1.0, 2.0])
        gathered = comm.all_gather(x)
        assert isinstance(gathered, np.ndarray) and gathered.tolist() == [[1.0, 2.0]] * 2
        comm.all_reduce([np.ones(2), x])
    for rank, exc in enumerate(run_ranks(2, outcome(fn))):
        assert isinstance(exc, ArrayTypeError), exc
        assert "rank %d: arrays[1] is read-only" % rank in str(exc)


def test_jax_arrays_raise_for_in_place_collectives_and_serve_as_sources():
    jnp = pytest.importorskip("jax.numpy")

    def fn(comm):
        mine = jnp.full((3,), float(comm.rank))
        sent = comm.broadcast(np.zeros(3, np.float32) if comm.rank else mine, root=0)
        assert np.asarray(sent).tolist() == [0.0] * 3
        comm.all_reduce([np.ones(2), mine])
    for rank, exc in enumerate(run_ranks(2, outcome(fn))):
        assert isinstance(exc, ArrayTypeError), exc
        text = str(exc)
        assert text.startswith("rank %d: arrays[1] (jax.Array) is immutable" % rank)
        assert "numpy.array(x)" in text and "all_gather" in text


def test_jax_array_on_one_rank_fails_every_rank():
    jnp = pytest.importorskip("jax.numpy")

    def fn(comm):
        comm.broadcast([jnp.ones(2) if comm.rank == 1 else np.ones(2)], root=0)
    zero, one = run_ranks(2, outcome(fn))
    assert isinstance(one, ArrayTypeError) and "rank 1: arrays[0] (jax.Array)" in str(one)
    assert isinstance(zero, ConsistencyError) and "rank 1" in str(zero), zero


def test_optimizer_rejects_jax_params_naming_them():
    jnp = pytest.importorskip("jax.numpy")
    comm = commlib.Communicator.single()
    with pytest.raises(ArrayTypeError, match=r"rank 0: param_groups\[0\]\['params'\]\[1\] "
                                             r"\(jax.Array\) is immutable"):
        commlib.optim.DistributedOptimizer(comm, [torch.ones(2), jnp.ones(2)],
                                           commlib.optim.SGD(lr=0.1))


def test_objects_without_dlpack_are_still_rejected():
    comm = commlib.Communicator.single()
    with pytest.raises(ArrayTypeError, match="rank 0: arrays: expected a numpy/cupy array"):
        comm.all_reduce(3.0)
    # a list of lists, or of numbers: the message names every kind of array taken
    with pytest.raises(ArrayTypeError, match=r"rank 0: arrays\[0\]: expected a numpy/cupy array "
                                             r"\(or a torch, JAX or other DLPack array\), got "
                                             r"list$"):
        comm.all_reduce([[1.0, 2.0]])
    with pytest.raises(ArrayTypeError, match=re.escape(
            "rank 0: arrays[0]: expected a numpy/cupy array (or a torch, JAX or other DLPack "
            "array), got float (a list of numbers is not an array: pass "
            "numpy.asarray(values))")):
        comm.all_reduce([1.0, 2.0])
