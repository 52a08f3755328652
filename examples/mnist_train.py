"""Data-parallel training of SINGA's MNIST CNN with commlib.DistributedOptimizer.

    mpiexec -n 2 python examples/mnist_train.py                 # CPU workers over MPI
    python -m commlib.launch -n 2 examples/mnist_train.py       # NCCL on GPUs, else mpiexec
    python examples/mnist_train.py                              # one process
    python examples/mnist_train.py --data ~/mnist               # full MNIST (IDX files or npz)

SINGA's distributed MNIST example (``opt.DistOpt``) on commlib: each epoch
a ``commlib.optim.DistributedSampler`` deals every rank its share of the
training set, reshuffled from ``(seed, epoch)``, and each step computes the
gradients of its minibatch (each image moved by up to ``--shift`` pixels)
layer by layer, last layer first. As each layer's gradients are written
into ``opt.grads`` the script calls ``opt.grad_ready(i)``, so their
bucket's all-reduce starts while the earlier layers' backward still
computes; ``opt.step()`` waits for the average over the ranks, clips it to
the global norm ``--clip-norm`` and applies SGD with momentum to two
parameter groups: the weights with ``--weight-decay``, the biases without.
A scheduler object sets the learning rate each step. Rank 0 initialises
the parameters and broadcasts them, so all ranks start (and stay)
identical; the script checks that at the end. On a terminal (also under
``python -m commlib.launch`` run on one) rank 0 shows a progress bar per
epoch (tqdm when installed).

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
learning rate rises linearly to ``--lr`` over the first ``--warmup`` epochs
(``LinearWarmup``), then follows a cosine to 0 at the end of the run
(``CosineAnnealingLR``, one after the other by ``SequentialLR``), stepped
once per update. Arrays are numpy
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

``--trace DIR`` records the last epoch (see docs/tracing.md): every rank
writes ``DIR/epoch.rankR.json`` and rank 0 joins them into
``DIR/epoch.merged.json``, which https://ui.perfetto.dev opens. Each
step's forward and backward pass is a span ``forward/backward`` and its
update (waiting for the gradients, clipping, SGD) a span ``update``
(``commlib.trace.span``, with the step's number), beside commlib's own events.
"""
import argparse
import hashlib
import json
import os
import sys
import time

# One BLAS thread per worker unless the user says otherwise: the matrices are
# small, and several multi-threaded workers on a few cores run many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the thread setting, which numpy reads at import)

import commlib  # noqa: E402
import commlib.launch  # noqa: E402
import commlib.optim  # noqa: E402
from commlib.files import write_atomically  # noqa: E402

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


def progress(total, desc, enabled):
    """A progress bar of ``total`` steps on stderr (tqdm where installed, else
    one line rewritten in place); a stand-in that does nothing unless ``enabled``.
    Under commlib.launch (stderr a pipe to a launcher on a terminal), whose
    ``[rank]`` prefix starts each line, the bar's last state is left as a line."""
    if not enabled:
        return _Quiet()
    keep = not sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Line(total, desc, keep)
    return tqdm(total=total, desc=desc, unit="step", leave=keep, file=sys.stderr)


class _Quiet:
    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def close(self):
        pass


class _Line(_Quiet):
    def __init__(self, total, desc, keep):
        self.total, self.desc, self.done, self.shown, self.text = total, desc, 0, 0.0, ""
        self.keep = keep

    def update(self, n=1):
        self.done += n
        now = time.monotonic()
        if now - self.shown > 0.2 or self.done == self.total:
            self.shown = now
            sys.stderr.write("\r%s: %d/%d steps %s" % (self.desc, self.done, self.total,
                                                        self.text))
            sys.stderr.flush()

    def set_postfix_str(self, text):
        self.text = text

    def close(self):
        sys.stderr.write("\n" if self.keep else "\r\033[K")
        sys.stderr.flush()


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


def train_epoch(comm, model, opt, sched, train, sampler, epoch, args):
    """One epoch over this rank's share; returns (mean loss, accuracy) over all ranks."""
    x, y = train                            # the whole training set, on every rank
    xp = cnn_model.xp_of(x)
    sampler.set_epoch(epoch)                # this epoch's shuffle, the same on every rank
    rng = np.random.default_rng([args.seed, epoch, comm.rank])      # the image shifts
    where = {id(p): i for i, p in enumerate(opt.params)}            # groups reorder params
    ready = [where[id(p)] for p in model.params]
    totals = xp.zeros(3, xp.float64)        # loss sum, correct, images
    batches = sampler.batches(args.batch_size, drop_last=True)    # as many on every rank
    bar = progress(len(batches), "Epoch %d" % epoch,
                   comm.rank == 0 and commlib.launch.stderr_is_terminal())
    span = commlib.trace.span               # marks a part of the step (records only in a trace)
    for step, idx in enumerate(batches):
        idx = xp.asarray(idx)
        with span("forward/backward", step=step):
            logits = model.forward(shifted(x[idx], rng, args.shift))
            loss, correct, dlogits = cnn_model.softmax_cross_entropy(logits, y[idx])
            model.backward(dlogits, ready=lambda i: opt.grad_ready(ready[i]))  # buckets start
        with span("update", step=step):
            opt.step()                      # wait for the average, clip, update
            sched.step()                    # the learning rate of the next step
        totals[0] += loss * len(idx)        # device-side sums: no host sync per step
        totals[1] += correct
        totals[2] += len(idx)
        bar.update()
        bar.set_postfix_str("lr %.4f" % opt.lr)
    bar.close()
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
    """(gradient bytes sent, seconds blocked on communication) per rank, mean
    over ranks. One process sends nothing (its collectives copy in place;
    ``opt.stats`` counts the bytes handed to its transport all the same)."""
    mine = np.array([opt.stats["bytes_sent"] if comm.size > 1 else 0,
                     opt.stats["comm_seconds"]], np.float64)
    return tuple(comm.all_reduce(mine, op="avg"))


def parameter_digest(params):
    """Hex sha256 of this rank's parameters."""
    return hashlib.sha256(b"".join(to_host(p).tobytes() for p in params)).hexdigest()


def output_args(parser):
    parser.add_argument("--json", default=None, help="rank 0 writes the per-epoch log here")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="record the last epoch: DIR/epoch.rankR.json per rank, merged "
                             "by rank 0 into DIR/epoch.merged.json (see docs/tracing.md)")


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
    parser.add_argument("--weight-decay", type=float, default=1e-4,
                        help="SGD weight decay of the weights (the biases have none)")
    parser.add_argument("--clip-norm", type=float, default=5.0,
                        help="clip the averaged gradients to this global L2 norm (0: never; "
                             "never with --compression partial)")
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
    output_args(parser)
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error("--%s must be >= 1" % name.replace("_", "-"))
    for name in ("train_images", "shift", "warmup"):
        if getattr(args, name) < 0:
            parser.error("--%s must be >= 0" % name.replace("_", "-"))
    if not args.lr > 0 or not 0 <= args.momentum < 1 or not args.weight_decay >= 0:
        parser.error("--lr must be > 0, --momentum in [0, 1) and --weight-decay >= 0")
    if not args.clip_norm >= 0:
        parser.error("--clip-norm must be >= 0")
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


def on_device(xp, data):
    """(images, labels), normalised, on ``xp``."""
    images, labels = data
    return xp.asarray(mnist_data.normalise(images)), xp.asarray(labels)


def shard(comm, xp, data):
    """This rank's contiguous shard of (images, labels), normalised, on ``xp``."""
    mine = commlib.partition(len(data[1]), comm.rank, comm.size, drop_remainder=False)
    return on_device(xp, (data[0][mine], data[1][mine]))


def scheduler(opt, args, steps):
    """Linear warm-up over ``--warmup`` epochs, then a cosine to 0 at the last
    of ``steps`` updates."""
    warmup = min(steps - 1, round(args.warmup * steps / args.epochs))
    cosine = lambda: commlib.optim.CosineAnnealingLR(opt, T_max=steps - warmup)  # noqa: E731
    if warmup < 1:
        return cosine()
    return commlib.optim.SequentialLR(
        opt, [commlib.optim.LinearWarmup(opt, warmup), cosine()], milestones=[warmup])


def traced(run, comm, model, opt, sched, train, sampler, epoch, args):
    """``run(comm, ..., args)`` (one epoch); with ``--trace DIR`` and the last
    epoch, recorded (see the module docstring)."""
    if not args.trace or epoch != args.epochs - 1:
        return run(comm, model, opt, sched, train, sampler, epoch, args)
    os.makedirs(args.trace, exist_ok=True)
    template = os.path.join(args.trace, "epoch.json")
    with commlib.trace(template):
        result = run(comm, model, opt, sched, train, sampler, epoch, args)
    comm.barrier()                          # every rank's file is written
    if comm.rank == 0:
        merged = os.path.join(args.trace, "epoch.merged.json")
        commlib.trace.merge(merged, [commlib.trace.path_for(template, r)
                                     for r in range(comm.size)])
        print("Trace of epoch %d: %s (one file per rank beside it)" % (epoch, merged),
              flush=True)
    return result


def main(argv=None):
    args = parse_args(argv)
    comm = commlib.init()
    xp = array_module(comm, args.device)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    n_train, n_eval = len(args.train[1]), len(args.evaluation[1])
    if args.batch_size * comm.size > n_train:
        raise SystemExit("--batch-size %d x %d workers exceeds the %d training images"
                         % (args.batch_size, comm.size, n_train))
    train = on_device(xp, args.train)
    sampler = commlib.optim.DistributedSampler(n_train, comm, seed=args.seed, drop_last=True)
    evaluation = shard(comm, xp, args.evaluation)
    model = cnn_model.MODELS[args.model](xp)
    if comm.rank == 0:
        model.init_params(args.seed)
    rule = commlib.optim.SGD(args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    groups = [{"params": [p for p in model.params if p.ndim > 1]},                  # weights
              {"params": [p for p in model.params if p.ndim == 1], "weight_decay": 0.0}]
    if args.compression == "partial":       # each rank's own gradients: no global norm
        args.clip_norm = 0
    opt = commlib.DistributedOptimizer(comm, groups, rule, compression=args.strategy,
                                       clip_norm=args.clip_norm or None)
    by_array = {id(p): g for p, g in zip(opt.params, opt.grads)}
    model.bind_grads([by_array[id(p)] for p in model.params])
    steps_per_epoch = len(sampler) // args.batch_size
    sched = scheduler(opt, args, args.epochs * steps_per_epoch)
    opt.broadcast_parameters(root=0)
    before = communication(comm, opt)       # the broadcast's share, left out of the log
    say("MNIST: %d workers (%s, %s), model %s, %d train / %d evaluation images, batch %d per "
        "worker, lr %g, momentum %g, weight decay %g (weights), clip norm %g, seed %d, "
        "compression %s" % (comm.size, comm.backend, xp.__name__, args.model, n_train, n_eval,
                            args.batch_size, args.lr, args.momentum, args.weight_decay,
                            args.clip_norm, args.seed, args.strategy), flush=True)
    log, start = [], time.perf_counter()
    for epoch in range(args.epochs):
        say("Starting Epoch %d:" % epoch)
        t0 = time.perf_counter()
        loss, train_acc = traced(train_epoch, comm, model, opt, sched, train, sampler, epoch, args)
        seconds = time.perf_counter() - t0
        eval_acc = evaluate(comm, model, evaluation)
        sent, blocked = (now - then for now, then in zip(communication(comm, opt), before))
        images = steps_per_epoch * args.batch_size * comm.size
        log.append({"epoch": epoch, "loss": loss, "train_accuracy": train_acc,
                    "eval_accuracy": eval_acc, "seconds": seconds,
                    "images_per_second": images / seconds,
                    "bytes_sent": sent, "comm_seconds": blocked})
        say("Training loss = %.6f, training accuracy = %.6f" % (loss, train_acc))
        say("Evaluation accuracy = %.6f" % eval_acc)
        say("Images per second = %.0f (all ranks), time in communication = %.2f s, bytes sent "
            "= %.4g MB (%s)" % (images / seconds, blocked, sent / 1e6, "per rank, so far"
                                if comm.size > 1 else "one worker: nothing to send"),
            flush=True)
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
        summary = {"workers": comm.size, "model": args.model, "compression": args.compression,
                   "strategy": str(args.strategy), "train_images": n_train,
                   "eval_images": n_eval, "batch_size": args.batch_size, "lr": args.lr,
                   "seed": args.seed, "epochs": log, "identical": same, "sha256": digest,
                   "total_seconds": time.perf_counter() - start}
        write_atomically(args.json, lambda f: json.dump(summary, f, indent=1))
    comm.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
