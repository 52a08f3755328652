"""Data-parallel training of a digit classifier on real MNIST images with commlib.

    mpiexec -n 2 python examples/mnist_train.py                 # CPU workers over MPI
    python -m commlib.launch -n 2 examples/mnist_train.py       # NCCL on GPUs, else mpiexec
    python examples/mnist_train.py                              # one process

Data: ``examples/data/mnist_5k.npz`` (5,000 MNIST digits, see data/README.md),
split once into 4,000 training and 1,000 test images. Each epoch every rank
shuffles the training split with the same seed and takes its shard
(``perm[rank::size]``); each step it computes the softmax cross-entropy
gradients of its minibatch, averages them over the ranks with
``comm.all_reduce(grads, division=True)`` and applies SGD with momentum.
Rank 0 initialises the parameters and broadcasts them, so all ranks start
(and stay) identical; the script checks that at the end.

Models (``--model``): ``mlp`` (default: 784-256-10; > 92 % test accuracy after
3 epochs, well under a second per epoch on CPU) and ``cnn`` (conv 5x5x20 - relu
- maxpool 2 - conv 5x5x50 - relu - maxpool 2 - fc 800-500 - relu - fc 500-10,
im2col convolutions; about 93 % after 3 epochs, a few seconds per epoch on
CPU). The learning rate follows a cosine from ``--lr`` to 0 over the run.
Arrays are numpy on CPU and cupy on the communicator's GPU (``--device``).
Unless ``OMP_NUM_THREADS`` is set, each worker uses one BLAS thread.

With ``--batch-size B`` on N workers every step sees the same N*B images
as one worker with ``--batch-size`` N*B, so both train (up to rounding)
the same model.

Communication savings (``--compression``, see ``commlib.compression``):
``fp16`` and ``bf16`` average the gradients in half precision; ``topk`` sends the
``--ratio`` largest gradients of each bucket and ``threshold`` those above
``--threshold``, both with error feedback; ``partial`` (SINGA's partial
update) applies each rank's own gradients locally and then averages only a
rotating ``--ratio`` of the parameters per step (all of them once more at
the end, so the ranks finish with one model).
"""
import argparse
import hashlib
import math
import os
import sys
import time

# One BLAS thread per worker unless the user says otherwise: the matrices are
# small, and several multi-threaded workers on a few cores run many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the thread setting, which numpy reads at import)

import commlib  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mnist_5k.npz")
N_TRAIN = 4000
SPLIT_SEED = 0  # the train/test split is fixed; --seed varies initialisation and order
PIXEL_MEAN, PIXEL_STD = 0.1307, 0.3081
DEFAULT_LR = {"mlp": 0.05, "cnn": 0.01}  # the cnn diverges at 0.02 with momentum 0.9


# -- layers: forward(x) caches what backward(dy) needs; backward fills self.grads ------------

class Linear:
    """y = x @ W + b; x (batch, n_in) -> y (batch, n_out), float32."""

    def __init__(self, xp, n_in, n_out):
        self.xp, self.fan_in = xp, n_in
        self.params = [xp.zeros((n_in, n_out), xp.float32), xp.zeros(n_out, xp.float32)]
        self.grads = [xp.zeros_like(p) for p in self.params]

    def forward(self, x):
        self.x = x
        return x @ self.params[0] + self.params[1]

    def backward(self, dy, need_dx=True):
        self.grads[0][...] = self.x.T @ dy
        self.grads[1][...] = dy.sum(axis=0)
        return dy @ self.params[0].T if need_dx else None


class Conv2d:
    """Valid 2-D convolution, stride 1, NHWC: x (batch, H, W, C) ->
    y (batch, H-k+1, W-k+1, F); kernel W (k, k, C, F), bias (F,); im2col + matmul."""

    def __init__(self, xp, k, c_in, c_out):
        self.xp, self.k, self.fan_in = xp, k, k * k * c_in
        self.params = [xp.zeros((k, k, c_in, c_out), xp.float32), xp.zeros(c_out, xp.float32)]
        self.grads = [xp.zeros_like(p) for p in self.params]

    def _cols(self, x):
        """(batch*Ho*Wo, k*k*C) matrix of the k x k patches of x (B, H, W, C)."""
        k, (b, h, w, c) = self.k, x.shape
        x = self.xp.ascontiguousarray(x)
        s = x.strides
        patches = self.xp.lib.stride_tricks.as_strided(
            x, (b, h - k + 1, w - k + 1, k, k, c), (s[0], s[1], s[2], s[1], s[2], s[3]))
        return patches.reshape(-1, k * k * c)

    def forward(self, x):
        w, bias = self.params
        self.x_shape, self.cols = x.shape, self._cols(x)
        b, h, wd, _ = x.shape
        y = self.cols @ w.reshape(-1, w.shape[3]) + bias
        return y.reshape(b, h - self.k + 1, wd - self.k + 1, w.shape[3])

    def backward(self, dy, need_dx=True):
        w = self.params[0]
        k, f = self.k, w.shape[3]
        dy2 = dy.reshape(-1, f)
        self.grads[0][...] = (self.cols.T @ dy2).reshape(w.shape)
        self.grads[1][...] = dy2.sum(axis=0)
        if not need_dx:
            return None
        # dx = full convolution of dy with the flipped kernel
        padded = self.xp.pad(dy, ((0, 0), (k - 1, k - 1), (k - 1, k - 1), (0, 0)))
        flipped = w[::-1, ::-1].transpose(0, 1, 3, 2).reshape(k * k * f, -1)
        return (self._cols(padded) @ flipped).reshape(self.x_shape)


class MaxPool2:
    """2 x 2 max pooling, stride 2, NHWC (H and W even)."""

    params = grads = ()

    def __init__(self, xp):
        self.xp = xp

    def forward(self, x):
        b, h, w, c = x.shape
        windows = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
        windows = windows.reshape(b, h // 2, w // 2, c, 4)
        self.argmax, self.x_shape = windows.argmax(axis=-1), x.shape
        return windows.max(axis=-1)

    def backward(self, dy, need_dx=True):
        b, h, w, c = self.x_shape
        dx = (self.xp.arange(4) == self.argmax[..., None]) * dy[..., None]
        dx = dx.reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)
        return dx.reshape(self.x_shape).astype(dy.dtype, copy=False)


class Relu:
    params = grads = ()

    def forward(self, x):
        self.mask = x > 0
        return x * self.mask

    def backward(self, dy, need_dx=True):
        return dy * self.mask


class Flatten:
    params = grads = ()

    def forward(self, x):
        self.shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy, need_dx=True):
        return dy.reshape(self.shape)


def build_model(name, xp):
    """The layers of ``name`` ("mlp" or "cnn"); inputs are (batch, 28, 28, 1) float32."""
    if name == "mlp":
        return [Flatten(), Linear(xp, 784, 256), Relu(), Linear(xp, 256, 10)]
    return [Conv2d(xp, 5, 1, 20), Relu(), MaxPool2(xp), Conv2d(xp, 5, 20, 50), Relu(),
            MaxPool2(xp), Flatten(), Linear(xp, 800, 500), Relu(), Linear(xp, 500, 10)]


def init_params(layers, seed):
    """He-normal weights and zero biases, from ``seed`` (rank 0 only)."""
    rng = np.random.default_rng(seed)
    for layer in layers:
        if layer.params:
            w = layer.params[0]
            std = math.sqrt(2.0 / layer.fan_in)
            w[...] = layer.xp.asarray(rng.normal(0.0, std, w.shape).astype(np.float32))


def forward(layers, x):
    for layer in layers:
        x = layer.forward(x)
    return x


def backward(layers, dlogits):
    for i in range(len(layers) - 1, -1, -1):
        dlogits = layers[i].backward(dlogits, need_dx=i > 0)


def softmax_cross_entropy(logits, labels):
    """(mean loss, number correct, d mean loss / d logits) for logits (batch, 10)."""
    xp = xp_of(logits)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    probs = exp / total
    rows = xp.arange(len(labels))
    loss = (xp.log(total[:, 0]) - shifted[rows, labels]).mean()
    correct = (logits.argmax(axis=1) == labels).sum()
    probs[rows, labels] -= 1
    return loss, correct, probs / len(labels)


def xp_of(a):
    """numpy or cupy, whichever module ``a`` belongs to."""
    return sys.modules["cupy"].get_array_module(a) if "cupy" in sys.modules else np


# -- data ---------------------------------------------------------------------------------

def load_data(path, xp):
    """((x_train, y_train), (x_test, y_test)): x (n, 28, 28, 1) float32 normalised,
    y (n,) int64; the split is the same for every seed and worker count."""
    with np.load(path) as data:
        images, labels = data["images"], data["labels"]
    x = ((images.astype(np.float32) / 255.0 - PIXEL_MEAN) / PIXEL_STD)[..., None]
    y = labels.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    train, test = order[:N_TRAIN], order[N_TRAIN:]
    return ((xp.asarray(x[train]), xp.asarray(y[train])),
            (xp.asarray(x[test]), xp.asarray(y[test])))


def to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


# -- training -------------------------------------------------------------------------------

def cosine_lr(base, progress, epochs):
    """Learning rate after ``progress`` epochs: cosine decay from ``base`` to 0."""
    return base * 0.5 * (1.0 + math.cos(math.pi * progress / epochs))


def train_epoch(comm, layers, velocity, train, epoch, args):
    """One epoch of this rank's shard; returns global (mean loss, accuracy)."""
    x, y = train
    xp = xp_of(x)
    params = [p for layer in layers for p in layer.params]
    grads = [g for layer in layers for g in layer.grads]
    perm = np.random.default_rng([args.seed, epoch]).permutation(len(y))[comm.rank::comm.size]
    steps = (len(y) // comm.size) // args.batch_size  # the same on every rank
    totals = xp.zeros(3, xp.float64)  # loss sum, correct, samples
    for step in range(steps):
        lr = cosine_lr(args.lr, epoch + step / steps, args.epochs)
        idx = xp.asarray(perm[step * args.batch_size:(step + 1) * args.batch_size])
        logits = forward(layers, x[idx])
        loss, correct, dlogits = softmax_cross_entropy(logits, y[idx])
        backward(layers, dlogits)
        if args.compression != "partial":
            comm.all_reduce(grads, division=True, compression=args.strategy)
        for p, g, v in zip(params, grads, velocity):
            v *= args.momentum
            v -= lr * g
            p += v
        if args.compression == "partial":
            comm.all_reduce(params, op="avg", compression=args.strategy)
        totals[0] += loss * len(idx)  # device-side sums: no host sync per step
        totals[1] += correct
        totals[2] += len(idx)
    comm.all_reduce(totals)
    loss_sum, correct, n = to_host(totals)
    return loss_sum / n, correct / n


def evaluate(comm, layers, test, batch=500):
    """Accuracy on the whole test split; each rank scores its shard."""
    x, y = test
    xp = xp_of(x)
    x, y = x[comm.rank::comm.size], y[comm.rank::comm.size]
    correct = sum(int((forward(layers, x[i:i + batch]).argmax(axis=1) == y[i:i + batch]).sum())
                  for i in range(0, len(y), batch))
    counts = xp.asarray([correct, len(y)], xp.float64)
    comm.all_reduce(counts)
    correct, n = to_host(counts)
    return correct / n


def params_agree(comm, params):
    """(identical on every rank?, hex digest of this rank's parameters)."""
    digest = hashlib.sha256(b"".join(to_host(p).tobytes() for p in params)).digest()
    xp = xp_of(params[0])
    gathered = to_host(comm.all_gather(xp.asarray(np.frombuffer(digest, np.uint8))))
    return bool((gathered == gathered[0]).all()), digest.hex()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    parser.add_argument("--lr", type=float, default=None,
                        help="initial learning rate, decayed to 0 with a cosine; None: %s"
                             % ", ".join("%g for %s" % (v, k) for k, v in DEFAULT_LR.items()))
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--model", choices=tuple(DEFAULT_LR), default="mlp",
                        help="a two-layer perceptron or a small convolutional network")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial parameters and of the data order")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="gpu: cupy arrays on the communicator's GPU; auto: gpu when "
                             "the communicator has one")
    parser.add_argument("--data", default=DATA, help="npz file with images and labels")
    parser.add_argument("--compression",
                        choices=("none", "fp16", "bf16", "topk", "threshold", "partial"),
                        default="none", help="communication savings (see the module doc)")
    parser.add_argument("--ratio", type=float, default=0.01,
                        help="topk: fraction of each bucket sent; partial: fraction of the "
                             "parameters averaged per step")
    parser.add_argument("--threshold", type=float, default=0.01,
                        help="threshold: magnitude above which a gradient is sent")
    args = parser.parse_args(argv)
    if args.lr is None:
        args.lr = DEFAULT_LR[args.model]
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error("--%s must be >= 1" % name.replace("_", "-"))
    if not args.lr > 0 or not 0 <= args.momentum < 1:
        parser.error("--lr must be > 0 and --momentum in [0, 1)")
    if not os.path.isfile(args.data):
        parser.error("data file %s not found" % args.data)
    try:
        args.strategy = {"none": lambda: None, "fp16": lambda: "fp16", "bf16": lambda: "bf16",
                         "topk": lambda: commlib.compression.TopK(args.ratio),
                         "threshold": lambda: commlib.compression.Threshold(args.threshold),
                         "partial": lambda: commlib.compression.Partial(args.ratio),
                         }[args.compression]()
    except commlib.ArgumentError as exc:
        parser.error(str(exc))
    return args


def array_module(comm, device):
    if device == "cpu" or (device == "auto" and comm.device is None):
        return np
    if comm.device is None:
        raise SystemExit("--device gpu: this communicator has no GPU (cupy or CUDA missing)")
    import cupy
    cupy.cuda.Device(comm.device).use()
    return cupy


def main(argv=None):
    args = parse_args(argv)
    comm = commlib.init()
    xp = array_module(comm, args.device)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    train, test = load_data(args.data, xp)
    if args.batch_size * comm.size > len(train[1]):
        raise SystemExit("--batch-size %d x %d workers exceeds the %d training images"
                         % (args.batch_size, comm.size, len(train[1])))
    layers = build_model(args.model, xp)
    params = [p for layer in layers for p in layer.params]
    if comm.rank == 0:
        init_params(layers, args.seed)
    comm.broadcast(params, root=0)
    velocity = [xp.zeros_like(p) for p in params]
    say("MNIST: %d workers (%s, %s), model %s, %d train / %d test images, batch %d per worker, "
        "lr %g, seed %d, compression %s"
        % (comm.size, comm.backend, xp.__name__, args.model, len(train[1]), len(test[1]),
           args.batch_size, args.lr, args.seed, args.strategy), flush=True)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        say("Starting Epoch %d:" % epoch)
        loss, train_acc = train_epoch(comm, layers, velocity, train, epoch, args)
        say("Training loss = %.4f, training accuracy = %.4f" % (loss, train_acc))
        test_acc = evaluate(comm, layers, test)
        say("Evaluation accuracy = %.4f, epoch time = %.2f s"
            % (test_acc, time.perf_counter() - t0), flush=True)
    if args.compression == "partial":
        comm.all_reduce(params, op="avg")          # one model on every rank
    same, digest = params_agree(comm, params)
    say("Total time = %.2f s" % (time.perf_counter() - start))
    say("Parameters %s on all %d ranks (sha256 %s)"
        % ("identical" if same else "DIFFER", comm.size, digest[:16]), flush=True)
    comm.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
