"""Rank programs of tests/test_interop.py: torch tensors through commlib's
collectives and DistributedOptimizer on real MPI ranks, against numpy
results computed here from every rank's inputs, which are gathered with
plain mpi4py before the call (copies, so commlib's in-place writes cannot
touch them).

    mpiexec -n N python -c "import interop_programs as p; p.main()" CHECK[,CHECK...]

Each check raises AssertionError on a wrong result (ending the job); every
rank prints "rank R ok" at the end.
"""
import sys

import numpy as np
import torch
from mpi4py import MPI

import commlib
from commlib.optim import SGD, DistributedOptimizer

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
#: odd lengths, an empty and a 0-d tensor, and one of about a million elements
SHAPES = [(5,), (3, 7), (0,), (), (1,), (1 << 20) + 3, (2, 2, 3), (129,)]
DTYPES = [torch.float32, torch.float64, torch.int64, torch.float32, torch.int64, torch.float32,
          torch.float64, torch.int64]
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-13}


def tensors_of(rank, seed=0, device="cpu"):
    """Rank ``rank``'s tensors (integers in a small range, so sums are exact)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    out = []
    for shape, dtype in zip(SHAPES, DTYPES):
        shape = shape if isinstance(shape, tuple) else (shape,)
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g, dtype=dtype)
        else:
            t = torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
        out.append(t.to(device))
    return out


def host_copies(tensors):
    return [t.detach().cpu().numpy().copy() for t in tensors]


def assert_close(got, want, dtype, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (
        what, got.shape, want.shape, got.dtype, want.dtype)
    if dtype.is_floating_point:
        np.testing.assert_allclose(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                   err_msg="rank %d: %s" % (RANK, what))
    else:
        assert np.array_equal(got, want), "rank %d: %s" % (RANK, what)


def check_all_reduce(comm, device="cpu"):
    for op, division in (("sum", False), ("max", False)):
        mine = tensors_of(RANK, seed=1, device=device)
        pointers = [t.data_ptr() for t in mine]
        every = WORLD.allgather(host_copies(mine))
        back = comm.all_reduce(mine, op=op, division=division)
        assert back is mine
        assert [t.data_ptr() for t in mine] == pointers       # in place, the same memory
        ufunc = np.add if op == "sum" else np.maximum
        for i, (t, dtype) in enumerate(zip(mine, DTYPES)):
            want = ufunc.reduce(np.stack([e[i] for e in every]), axis=0).astype(every[0][i].dtype)
            assert isinstance(t, torch.Tensor) and t.dtype == dtype
            assert_close(t.cpu().numpy(), want, dtype, "%s: tensors[%d]" % (op, i))
    # averaging, floating tensors only; one tensor alone too
    mine = [t for t in tensors_of(RANK, seed=2, device=device) if t.dtype.is_floating_point]
    every = WORLD.allgather(host_copies(mine))
    comm.all_reduce(mine, division=True)
    for i, t in enumerate(mine):
        want = np.mean(np.stack([e[i].astype(np.float64) for e in every]), axis=0)
        assert_close(t.cpu().numpy(), want.astype(every[0][i].dtype), t.dtype, "avg %d" % i)
    one = torch.full((7,), float(RANK + 1), device=device)
    comm.all_reduce(one)
    assert one.cpu().tolist() == [SIZE * (SIZE + 1) / 2] * 7


def check_broadcast(comm):
    root = SIZE - 1
    mine = tensors_of(RANK, seed=3)
    theirs = WORLD.bcast(host_copies(mine) if RANK == root else None, root=root)
    assert comm.broadcast(mine, root=root) is mine
    for i, (t, want) in enumerate(zip(mine, theirs)):
        assert np.array_equal(t.numpy(), want), "rank %d: broadcast tensors[%d]" % (RANK, i)


def check_new_arrays(comm):
    """all_gather, reduce_scatter and all_gatherv return torch tensors."""
    x = torch.arange(6, dtype=torch.float64) * (RANK + 1)
    got = comm.all_gather(x)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
    assert np.array_equal(got.numpy(), np.stack(WORLD.allgather(x.numpy().copy())))
    block = comm.reduce_scatter(torch.arange(2 * SIZE, dtype=torch.int64) + RANK)
    total = sum(np.arange(2 * SIZE) + r for r in range(SIZE))
    assert isinstance(block, torch.Tensor)
    assert block.tolist() == total[2 * RANK:2 * RANK + 2].tolist()
    values, counts = comm.all_gatherv(torch.full((RANK + 1,), RANK, dtype=torch.int64))
    assert isinstance(values, torch.Tensor) and counts.tolist() == list(range(1, SIZE + 1))
    assert values.tolist() == [r for r in range(SIZE) for _ in range(r + 1)]


def train(comm, make, steps=4):
    """Parameters after ``steps`` SGD steps with momentum, every kind of
    array made by ``make`` (torch.from_numpy or numpy itself)."""
    rng = np.random.default_rng(7 + RANK)                  # differs per rank, then broadcast
    shapes = [(3, 5), (), (0,), (7,), (1001,)]
    params = [make(rng.standard_normal(s)) for s in shapes]
    opt = DistributedOptimizer(comm, params, SGD(lr=0.1, momentum=0.9))
    opt.broadcast_parameters(0)
    opt.check_parameters()
    for step in range(steps):
        g = np.random.default_rng([step, RANK])
        opt.step([make(g.standard_normal(s)) for s in shapes])
    opt.check_parameters()
    return params


def check_optimizer(comm):
    with_torch = train(comm, lambda a: torch.from_numpy(a).requires_grad_())
    with_numpy = train(comm, lambda a: a)
    assert all(isinstance(p, torch.Tensor) for p in with_torch)
    for i, (t, a) in enumerate(zip(with_torch, with_numpy)):
        assert np.array_equal(t.detach().numpy(), a), "rank %d: params[%d]" % (RANK, i)
    # the module-level broadcast and check take torch tensors too
    params = [torch.full((3,), float(RANK)), torch.zeros(2, dtype=torch.float64) + RANK]
    commlib.optim.broadcast_parameters(comm, params, root=0)
    commlib.optim.check_parameters(comm, params)
    assert params[0].tolist() == [0.0] * 3 and params[1].tolist() == [0.0] * 2


def check_cuda(comm):
    check_all_reduce(comm, device="cuda:%d" % comm.device)


CHECKS = {"all_reduce": check_all_reduce, "broadcast": check_broadcast,
          "new_arrays": check_new_arrays, "optimizer": check_optimizer, "cuda": check_cuda}


def main():
    names = sys.argv[1].split(",")
    backend = "mpi" if "cuda" in names and SIZE > 1 else None
    comm = commlib.Communicator.from_mpi(WORLD, backend=backend)
    for name in names:
        CHECKS[name](comm)
        comm.barrier()
    comm.close()
    print("rank %d ok" % RANK, flush=True)


if __name__ == "__main__":
    main()
