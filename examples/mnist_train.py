"""Data-parallel training of SINGA's MNIST CNN with commlib.DistributedOptimizer.

    mpiexec -n 2 python examples/mnist_train.py                 # CPU workers over MPI
    python -m commlib.launch -n 2 examples/mnist_train.py       # NCCL on GPUs, else mpiexec
    python examples/mnist_train.py                              # one process
    python examples/mnist_train.py --data ~/mnist               # full MNIST (IDX files or npz)

SINGA's distributed MNIST example (``opt.DistOpt``) on commlib: the training
set is partitioned once into one contiguous shard per rank
(``commlib.partition``), every rank shuffles its own shard each epoch, and
each step computes the gradients of its minibatch (each image moved by up to
``--shift`` pixels) layer by layer, last layer first. As each layer's
gradients are written into ``opt.grads`` the script calls
``opt.grad_ready(i)``, so their bucket's all-reduce starts while the earlier
layers' backward still computes; ``opt.step()`` waits for the average over
the ranks and applies SGD with momentum. Rank 0 initialises the
parameters and broadcasts them, so all ranks start (and stay) identical;
the script checks that at the end.

Data (``--data``): ``examples/data/mnist_5k.npz`` by default (5,000 MNIST
digits, see data/README.md), split once into ``1 - --eval-fraction`` for
training and the rest for evaluation; or full MNIST (see mnist_data.py).
Each epoch rank 0 prints, like SINGA's example, the training loss (mean per
image) and accuracy and the evaluation accuracy, plus the training images
per second (all ranks together), the seconds a rank spent blocked on
gradient communication and the gradient bytes it sent (``opt.stats``; both
per rank, the mean over the ranks). ``--json PATH`` writes the same numbers
per epoch to a file.

Models (``--model``): ``cnn`` (the default; conv 5x5x20 - relu - maxpool 2 -
conv 5x5x50 - relu - maxpool 2 - fc 800-500 - relu - fc 500-10, im2col
convolutions; LeCun-normal initialisation) and ``mlp`` (784-256-10). The
learning rate rises linearly from 0 to ``--lr`` over the first ``--warmup``
epochs, then follows a cosine to 0 at the end of the run. Arrays are numpy
on CPU and cupy on the communicator's GPU (``--device``). Unless
``OMP_NUM_THREADS`` is set, each worker uses one BLAS thread.

Communication savings (``--compression``, SINGA's DistOpt strategies):
``fp16`` and ``bf16`` average the gradients in half precision
(``backward_and_update_half``); ``topk`` sends the ``--ratio`` largest
gradients of each bucket and ``threshold`` those above ``--threshold``, both
with error feedback (``backward_and_sparse_update`` with ``topK=True`` /
``False``, ``corr=True``); ``partial`` (``backward_and_partial_update``)
applies each rank's own gradients locally and then averages a rotating
``--ratio`` of the parameters per step (all of them once more at the end,
so the ranks finish with one model). Each is the optimizer's
``compression=`` (SINGA's method names are there too: ``opt.update_half``,
``opt.update_sparse``, ``opt.update_partial``); scripts/compare_compression.py
compares them.
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

# One BLAS thread per worker unless the user says otherwise: the matrices are
# small, and several multi-threaded workers on a few cores run many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the thread setting, which numpy reads at import)

import commlib  # noqa: E402
import commlib.optim  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cnn_model  # noqa: E402
import mnist_data  # noqa: E402

COMPRESSIONS = ("none", "fp16", "bf16", "topk", "threshold", "partial")


def strategy(args):
    """The ``compression=`` of ``--compression`` (None for none)."""
    c = commlib.compression
    return {"none": lambda: None, "fp16": lambda: "fp16", "bf16": lambda: "bf16",
            "topk": lambda: c.TopK(args.ratio, error_feedback=True),
            "threshold": lambda: c.Threshold(args.threshold, error_feedback=True),
            "partial": lambda: c.Partial(args.ratio)}[args.compression]()


def learning_rate(base, progress, epochs, warmup):
    """Learning rate after ``progress`` epochs: linear from 0 to ``base`` over the first
    ``warmup`` epochs, then a cosine decay from ``base`` to 0 at ``epochs``."""
    if progress < warmup or epochs <= warmup:
        return base * min(progress / warmup, 1.0)
    return base * 0.5 * (1.0 + math.cos(math.pi * (progress - warmup) / (epochs - warmup)))


def shifted(x, rng, shift):
    """The images x (batch, H, W, C) each moved by a random offset of up to ``shift``
    pixels in each direction (drawn from ``rng``), the border filled with background."""
    if not shift:
        return x
    xp = cnn_model.xp_of(x)
    b, h, w, _ = x.shape
    padded = xp.pad(x, ((0, 0), (shift, shift), (shift, shift), (0, 0)),
                    constant_values=mnist_data.BACKGROUND)
    rows = xp.asarray(rng.integers(0, 2 * shift + 1, b))[:, None] + xp.arange(h)
    cols = xp.asarray(rng.integers(0, 2 * shift + 1, b))[:, None] + xp.arange(w)
    return padded[xp.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def train_epoch(comm, model, opt, train, epoch, args):
    """One epoch over this rank's shard; returns (mean loss, accuracy) over all ranks."""
    x, y = train
    xp = cnn_model.xp_of(x)
    rng = np.random.default_rng([args.seed, epoch, comm.rank])
    perm = rng.permutation(len(y))
    steps = len(y) // args.batch_size       # shards are of one size: the same on every rank
    totals = xp.zeros(3, xp.float64)        # loss sum, correct, images
    for step in range(steps):
        opt.lr = learning_rate(args.lr, epoch + (step + 1) / steps, args.epochs, args.warmup)
        idx = xp.asarray(perm[step * args.batch_size:(step + 1) * args.batch_size])
        logits = model.forward(shifted(x[idx], rng, args.shift))
        loss, correct, dlogits = cnn_model.softmax_cross_entropy(logits, y[idx])
        model.backward(dlogits, ready=opt.grad_ready)   # buckets start as soon as they are final
        opt.step()                                      # wait for the average, update
        totals[0] += loss * len(idx)        # device-side sums: no host sync per step
        totals[1] += correct
        totals[2] += len(idx)
    comm.all_reduce(totals)
    loss_sum, correct, n = to_host(totals)
    return loss_sum / n, correct / n


def evaluate(comm, model, evaluation, batch=500):
    """Accuracy on the whole evaluation set; each rank scores its contiguous shard."""
    x, y = evaluation
    xp = cnn_model.xp_of(x)
    correct = sum(int((model.forward(x[i:i + batch]).argmax(axis=1) == y[i:i + batch]).sum())
                  for i in range(0, len(y), batch))
    counts = xp.asarray([correct, len(y)], xp.float64)
    comm.all_reduce(counts)
    correct, n = to_host(counts)
    return correct / n


def to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def communication(comm, opt):
    """(gradient bytes sent, seconds blocked on communication) per rank, mean over ranks."""
    mine = np.array([opt.stats["bytes_sent"], opt.stats["comm_seconds"]], np.float64)
    return tuple(comm.all_reduce(mine, op="avg"))


def parameter_digest(params):
    """Hex sha256 of this rank's parameters."""
    return hashlib.sha256(b"".join(to_host(p).tobytes() for p in params)).hexdigest()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="peak learning rate (after the warm-up), then a cosine decay to 0")
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="epochs of linear learning-rate warm-up before the cosine decay")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--weight-decay", type=float, default=1e-4, help="SGD weight decay")
    parser.add_argument("--model", choices=tuple(cnn_model.MODELS), default="cnn",
                        help="SINGA's convolutional network or a two-layer perceptron")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial parameters and of the data order")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="gpu: cupy arrays on the communicator's GPU; auto: gpu when "
                             "the communicator has one")
    parser.add_argument("--data", default=mnist_data.SHIPPED,
                        help="npz file, or directory of IDX files (see mnist_data.py)")
    parser.add_argument("--eval-fraction", type=float, default=0.2,
                        help="share of an npz of images and labels held out for evaluation")
    parser.add_argument("--train-images", type=int, default=0,
                        help="train on the first N training images only (0: all)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none",
                        help="communication savings (see the module doc)")
    parser.add_argument("--ratio", type=float, default=0.01,
                        help="topk: fraction of each bucket sent; partial: fraction of the "
                             "parameters averaged per step")
    parser.add_argument("--threshold", type=float, default=0.03,
                        help="threshold: magnitude above which a gradient is sent")
    parser.add_argument("--shift", type=int, default=2,
                        help="training images are moved by up to this many pixels (0: never)")
    parser.add_argument("--json", default=None, help="rank 0 writes the per-epoch log here")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error("--%s must be >= 1" % name.replace("_", "-"))
    for name in ("train_images", "shift", "warmup"):
        if getattr(args, name) < 0:
            parser.error("--%s must be >= 0" % name.replace("_", "-"))
    if not args.lr > 0 or not 0 <= args.momentum < 1 or not args.weight_decay >= 0:
        parser.error("--lr must be > 0, --momentum in [0, 1) and --weight-decay >= 0")
    try:
        args.strategy = strategy(args)
    except commlib.ArgumentError as exc:
        parser.error(str(exc))
    try:
        args.train, args.evaluation = mnist_data.load(args.data, args.eval_fraction)
    except mnist_data.DataError as exc:
        parser.error(str(exc))
    if args.train_images:
        args.train = tuple(a[:args.train_images] for a in args.train)
    return args


def array_module(comm, device):
    if device == "cpu" or (device == "auto" and comm.device is None):
        return np
    if comm.device is None:
        raise SystemExit("--device gpu: this communicator has no GPU (cupy or CUDA missing)")
    import cupy
    cupy.cuda.Device(comm.device).use()
    return cupy


def shard(comm, xp, data, drop_remainder):
    """This rank's contiguous shard of (images, labels), normalised, on ``xp``."""
    images, labels = data
    mine = commlib.partition(len(labels), comm.rank, comm.size, drop_remainder=drop_remainder)
    return xp.asarray(mnist_data.normalise(images[mine])), xp.asarray(labels[mine])


def main(argv=None):
    args = parse_args(argv)
    comm = commlib.init()
    xp = array_module(comm, args.device)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    n_train, n_eval = len(args.train[1]), len(args.evaluation[1])
    if args.batch_size * comm.size > n_train:
        raise SystemExit("--batch-size %d x %d workers exceeds the %d training images"
                         % (args.batch_size, comm.size, n_train))
    train = shard(comm, xp, args.train, drop_remainder=True)
    evaluation = shard(comm, xp, args.evaluation, drop_remainder=False)
    model = cnn_model.MODELS[args.model](xp)
    if comm.rank == 0:
        model.init_params(args.seed)
    rule = commlib.optim.SGD(args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    opt = commlib.DistributedOptimizer(comm, model.params, rule, compression=args.strategy)
    model.bind_grads(opt.grads)
    opt.broadcast_parameters(root=0)
    before = communication(comm, opt)       # the broadcast's share, left out of the log
    say("MNIST: %d workers (%s, %s), model %s, %d train / %d evaluation images, batch %d per "
        "worker, lr %g, momentum %g, weight decay %g, seed %d, compression %s"
        % (comm.size, comm.backend, xp.__name__, args.model, n_train, n_eval, args.batch_size,
           args.lr, args.momentum, args.weight_decay, args.seed, args.strategy), flush=True)
    log, start = [], time.perf_counter()
    for epoch in range(args.epochs):
        say("Starting Epoch %d:" % epoch)
        t0 = time.perf_counter()
        loss, train_acc = train_epoch(comm, model, opt, train, epoch, args)
        seconds = time.perf_counter() - t0
        eval_acc = evaluate(comm, model, evaluation)
        sent, blocked = (now - then for now, then in zip(communication(comm, opt), before))
        images = (len(train[1]) // args.batch_size) * args.batch_size * comm.size
        log.append({"epoch": epoch, "loss": loss, "train_accuracy": train_acc,
                    "eval_accuracy": eval_acc, "seconds": seconds,
                    "images_per_second": images / seconds,
                    "bytes_sent": sent, "comm_seconds": blocked})
        say("Training loss = %.6f, training accuracy = %.6f" % (loss, train_acc))
        say("Evaluation accuracy = %.6f" % eval_acc)
        say("Images per second = %.0f (all ranks), time in communication = %.2f s, bytes sent "
            "= %.4g MB (per rank, so far)" % (images / seconds, blocked, sent / 1e6), flush=True)
    if args.compression == "partial":
        comm.all_reduce(model.params, op="avg")          # one model on every rank
    try:
        opt.check_parameters()
        same = True
    except commlib.ConsistencyError as exc:
        say("Parameters DIFFER: %s" % exc)
        same = False
    digest = parameter_digest(model.params)
    say("Total time = %.2f s" % (time.perf_counter() - start))
    if same:
        say("Parameters identical on all %d ranks (sha256 %s)" % (comm.size, digest[:16]),
            flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": comm.size, "model": args.model, "compression":
                       args.compression, "strategy": str(args.strategy), "train_images": n_train,
                       "eval_images": n_eval, "batch_size": args.batch_size, "lr": args.lr,
                       "seed": args.seed, "epochs": log, "identical": same, "sha256": digest,
                       "total_seconds": time.perf_counter() - start}, f, indent=1)
    comm.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
