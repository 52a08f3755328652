"""Data-parallel training of a PyTorch model with commlib.DistributedOptimizer.

    mpiexec -n 2 python examples/torch_train.py          # CPU workers over MPI
    python examples/torch_train.py                       # one process
    python examples/torch_train.py --steps 200 --lr 0.02

The model is a ``torch.nn`` module on the CPU; commlib updates its
parameters in place through numpy views of the tensors' memory (see
``commlib.interop``), so the model itself sees every update. Each step every
rank computes the gradients of its shard of the global batch with
``loss.backward()``; ``opt.step(grads=[p.grad for p in params])`` averages
them over the ranks (what PyTorch DDP's all-reduce gives) and applies SGD
with momentum, so every rank's model stays identical. The result is that
of ``torch.optim.SGD`` on one process whose gradient is the average of the
ranks' gradients (with equal shards: the gradient of the whole batch).
Rank 0 initialises the model and broadcasts it; the script checks at the
end that every rank holds the same parameters.

The data is a fixed random regression problem (``y = tanh(x @ w) + noise``),
the same on every rank; each rank takes its contiguous shard of every
global batch (``commlib.partition``). Rank 0 prints the loss of its shard
every ``--every`` steps.
"""
import argparse

import numpy as np
import torch

import commlib
from commlib.optim import SGD

FEATURES, HIDDEN = 8, 16


def make_model(seed=0):
    """A small MLP whose initial weights come from ``seed`` (numpy's
    generator, independent of torch's global one)."""
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, 1))
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.3))
    return model


def batches(steps, batch, seed=1):
    """``steps`` global batches ``(x, y)`` of ``batch`` examples (float32
    tensors), the same on every rank."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(FEATURES)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((batch, FEATURES))
        y = np.tanh(x @ w)[:, None] + 0.1 * rng.standard_normal((batch, 1))
        out.append((torch.from_numpy(x.astype(np.float32)),
                    torch.from_numpy(y.astype(np.float32))))
    return out


def train(comm, steps=20, batch=16, lr=0.05, momentum=0.9, seed=0):
    """Train on ``comm``'s ranks (every rank calls it).

    Returns:
        ``(model, losses)``: the trained model and this rank's loss per step.
    """
    model = make_model(seed)
    params = list(model.parameters())
    opt = commlib.DistributedOptimizer(comm, params, SGD(lr, momentum=momentum))
    opt.broadcast_parameters()                         # every rank starts from rank 0's
    mine = commlib.partition(batch, comm.rank, comm.size)
    loss_fn = torch.nn.MSELoss()
    losses = []
    for x, y in batches(steps, batch):
        model.zero_grad()
        loss = loss_fn(model(x[mine]), y[mine])
        loss.backward()
        opt.step(grads=[p.grad for p in params])      # average over the ranks, then SGD
        losses.append(loss.item())
    opt.check_parameters()                             # every rank holds the same model
    return model, losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=20, help="print every N steps")
    args = parser.parse_args()
    comm = commlib.init()
    if args.batch % comm.size:
        parser.error("--batch must be a multiple of the number of ranks (%d)" % comm.size)
    _, losses = train(comm, steps=args.steps, batch=args.batch, lr=args.lr)
    if comm.rank == 0:
        for step in range(0, args.steps, args.every):
            print("step %4d  loss %.4f" % (step, losses[step]))
        print("step %4d  loss %.4f" % (args.steps - 1, losses[-1]))
    comm.close()


if __name__ == "__main__":
    main()
