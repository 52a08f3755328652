"""The models of the MNIST example, in numpy (or cupy) with hand-written backward.

``CNN`` is SINGA's MNIST network: conv 5x5x20 - relu - maxpool 2 - conv
5x5x50 - relu - maxpool 2 - fc 800-500 - relu - fc 500-10 (431,080
parameters); ``MLP`` is 784-256-10. Images are NHWC, (batch, 28, 28, 1).
A model's parameters are consecutive views of one flat buffer
(``commlib.flat_arrays``), in forward order, weight then bias per layer.
``backward`` runs last layer first, writes each layer's gradients into the
arrays given to :meth:`Model.bind_grads` and calls ``ready(i)`` for each
of them as soon as they are final, so their all-reduce can start while the
earlier layers' backward still computes.
"""
import math
import sys

import numpy as np

import commlib


def xp_of(a):
    """numpy or cupy, whichever module ``a`` belongs to."""
    return sys.modules["cupy"].get_array_module(a) if "cupy" in sys.modules else np


# -- layers: forward(x) caches what backward(dy) needs; backward fills self.grads ------------

class Layer:
    """A layer without parameters; subclasses with parameters set ``shapes``."""

    shapes = ()
    fan_in = None

    def __init__(self):
        self.params, self.grads = [], []


class Linear(Layer):
    """y = x @ W + b; x (batch, n_in) -> y (batch, n_out); W (n_in, n_out), b (n_out,)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.shapes, self.fan_in = [(n_in, n_out), (n_out,)], n_in

    def forward(self, x):
        self.x = x
        return x @ self.params[0] + self.params[1]

    def backward(self, dy, need_dx=True):
        self.grads[0][...] = self.x.T @ dy
        self.grads[1][...] = dy.sum(axis=0)
        return dy @ self.params[0].T if need_dx else None


class Conv2d(Layer):
    """Valid 2-D convolution, stride 1, NHWC: x (batch, H, W, C) ->
    y (batch, H-k+1, W-k+1, F); kernel W (k, k, C, F), bias (F,); im2col + matmul."""

    def __init__(self, k, c_in, c_out):
        super().__init__()
        self.k, self.fan_in = k, k * k * c_in
        self.shapes = [(k, k, c_in, c_out), (c_out,)]

    def _cols(self, x):
        """(batch*Ho*Wo, k*k*C) matrix of the k x k patches of x (B, H, W, C)."""
        k, (b, h, w, c) = self.k, x.shape
        x = xp_of(x).ascontiguousarray(x)
        s = x.strides
        patches = xp_of(x).lib.stride_tricks.as_strided(
            x, (b, h - k + 1, w - k + 1, k, k, c), (s[0], s[1], s[2], s[1], s[2], s[3]))
        return patches.reshape(-1, k * k * c)

    def forward(self, x):
        w, bias = self.params
        b, h, wd, _ = self.x_shape = x.shape
        self.cols = self._cols(x)
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
        b, h, wd, c = self.x_shape
        ho, wo = h - k + 1, wd - k + 1
        dcols = (dy2 @ w.reshape(-1, f).T).reshape(b, ho, wo, k, k, c)
        dx = xp_of(dy).zeros(self.x_shape, dy.dtype)
        for i in range(k):            # col2im: each patch offset adds back where it came from
            for j in range(k):
                dx[:, i:i + ho, j:j + wo, :] += dcols[:, :, :, i, j, :]
        return dx


class MaxPool2(Layer):
    """2 x 2 max pooling, stride 2, NHWC (H and W even)."""

    def forward(self, x):
        b, h, w, c = self.x_shape = x.shape
        windows = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
        windows = windows.reshape(b, h // 2, w // 2, c, 4)
        self.argmax = windows.argmax(axis=-1)
        return windows.max(axis=-1)

    def backward(self, dy, need_dx=True):
        b, h, w, c = self.x_shape
        dx = (xp_of(dy).arange(4) == self.argmax[..., None]) * dy[..., None]
        dx = dx.reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)
        return dx.reshape(self.x_shape).astype(dy.dtype, copy=False)


class Relu(Layer):
    def forward(self, x):
        self.mask = x > 0
        return x * self.mask

    def backward(self, dy, need_dx=True):
        return dy * self.mask


class Flatten(Layer):
    def forward(self, x):
        self.shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy, need_dx=True):
        return dy.reshape(self.shape)


# -- models -----------------------------------------------------------------------------------

class Model:
    """A stack of layers whose parameters are one flat buffer of ``dtype`` on ``xp``."""

    def __init__(self, layers, xp=np, dtype="float32"):
        self.layers = layers
        shapes = [s for layer in layers for s in layer.shapes]
        self.params = commlib.flat_arrays(shapes, dtype, xp)
        self._slices, start = [], 0
        for layer in layers:
            self._slices.append(slice(start, start + len(layer.shapes)))
            layer.params = self.params[self._slices[-1]]
            start += len(layer.shapes)
        self.bind_grads(commlib.flat_arrays(shapes, dtype, xp))

    def bind_grads(self, grads):
        """Let backward write into ``grads`` (arrays of the parameters' shapes, same order)."""
        if [g.shape for g in grads] != [p.shape for p in self.params]:
            raise commlib.ArgumentError("grads: shapes %s, the parameters have %s"
                                        % ([g.shape for g in grads],
                                           [p.shape for p in self.params]))
        self.grads = list(grads)
        for layer, part in zip(self.layers, self._slices):
            layer.grads = self.grads[part]

    def init_params(self, seed):
        """LeCun-normal weights (std sqrt(1 / fan_in)) and zero biases, drawn from ``seed``."""
        rng = np.random.default_rng(seed)
        for layer in self.layers:
            if layer.shapes:
                w = layer.params[0]
                std = math.sqrt(1.0 / layer.fan_in)
                w[...] = xp_of(w).asarray(rng.normal(0.0, std, w.shape).astype(w.dtype))
                layer.params[1][...] = 0

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dlogits, ready=None):
        """Gradients of all parameters from d loss / d logits, last layer first;
        ``ready(i)`` is called for parameter i once its gradient is written."""
        dy = dlogits
        for n in range(len(self.layers) - 1, -1, -1):
            dy = self.layers[n].backward(dy, need_dx=n > 0)
            if ready is not None:
                for i in range(self._slices[n].start, self._slices[n].stop)[::-1]:
                    ready(i)


def CNN(xp=np, dtype="float32"):
    """SINGA's MNIST CNN (see the module doc)."""
    return Model([Conv2d(5, 1, 20), Relu(), MaxPool2(), Conv2d(5, 20, 50), Relu(), MaxPool2(),
                  Flatten(), Linear(800, 500), Relu(), Linear(500, 10)], xp, dtype)


def MLP(xp=np, dtype="float32"):
    """784-256-10 with a relu."""
    return Model([Flatten(), Linear(784, 256), Relu(), Linear(256, 10)], xp, dtype)


MODELS = {"cnn": CNN, "mlp": MLP}


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
