"""Update rules: how parameters move given their averaged gradients.

A rule is called as ``rule(params, grads)`` (lists of numpy or cupy arrays
of matching shapes and dtypes) and updates ``params`` in place, leaving
``grads`` as they are. Any callable of that signature is a rule (one with
a ``state(params)`` method returning ``{name: array}`` has that state
checkpointed too); the ones here are written once for numpy and cupy (the
array module of each parameter does the arithmetic, in the parameter's
dtype) and keep their state (momentum buffers, Adam moments, step count) in
arrays that :meth:`Rule.state` hands out by name, so the optimizer can
save, load and broadcast them. They are elementwise, so the optimizer hands
them each run of parameters that lie back to back as one flat array.
``lr`` and the other hyperparameters may be changed between steps.
"""
import math

import numpy as np

from ..errors import ArgumentError
from ..ops._arrays import array_module


def check_number(value, what, low=0.0, high=math.inf, high_open=False, rank=None):
    """``float(value)`` when it is a real number with ``low <= value <= high``
    (``< high`` with ``high_open``); else ArgumentError naming ``what``
    (and ``rank`` when given)."""
    ok = (not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.number))
          and math.isfinite(value) and low <= value and (value < high if high_open
                                                          else value <= high))
    if not ok:
        upper = ("< %g" % high) if high_open else ("<= %g" % high)
        raise ArgumentError("%s%s must be a finite number >= %g%s, got %r"
                            % ("" if rank is None else "rank %d: " % rank, what, low,
                               "" if high == math.inf else " and " + upper, value))
    return float(value)


class Rule:
    """Base of the built-in rules: the validated ``lr`` and ``weight_decay``
    and per-parameter state buffers (allocated at the first call or
    :meth:`state`, zero-filled, like the parameters)."""

    #: names of the per-parameter buffers this rule keeps
    buffers = ()

    def __init__(self, lr, weight_decay):
        self.lr = lr
        self.weight_decay = check_number(weight_decay, "%s: weight_decay" % type(self).__name__)
        self._state = None

    @property
    def lr(self):
        """Learning rate (float >= 0; may be changed between steps)."""
        return self._lr

    @lr.setter
    def lr(self, value):
        self._lr = check_number(value, "%s: lr" % type(self).__name__)

    def state(self, params):
        """The rule's state for ``params`` as ``{name: array}``: the live
        arrays (writing into them changes the state), ``"<buffer>.<i>"`` for
        array i's buffers, plus the rule's counters as 0-d numpy arrays."""
        out = dict(self.counters())
        for name, arrays in self.buffers_for(params).items():
            out.update(("%s.%d" % (name, i), b) for i, b in enumerate(arrays))
        return out

    def counters(self):
        """``{name: 0-d numpy array}`` of the rule's counters."""
        return {}

    def buffers_for(self, params):
        """``{buffer name: [one array like each of params]}``, allocated
        (zero-filled) at the first call; a rule keeps the state of one list
        of arrays (one rule object per optimizer)."""
        if self._state is None:
            self._state = {name: [array_module(p).zeros_like(p) for p in params]
                           for name in self.buffers}
            self._count = len(params)
        elif self._count != len(params):
            raise ArgumentError("%s: holds state for %d arrays, called with %d; use one rule "
                                "object per optimizer" % (type(self).__name__, self._count,
                                                          len(params)))
        return self._state

    def _decayed(self, p, g):
        """The gradient with L2 weight decay (a new array when decaying)."""
        return g + self.weight_decay * p if self.weight_decay else g


class SGD(Rule):
    """Stochastic gradient descent with optional momentum, Nesterov momentum
    and L2 weight decay (PyTorch's ``torch.optim.SGD`` without dampening):

        d = g + weight_decay * p
        buf = momentum * buf + d                      (buf starts at 0)
        d = d + momentum * buf if nesterov else buf   (with momentum > 0)
        p -= lr * d
    """

    def __init__(self, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
        self.momentum = check_number(momentum, "SGD: momentum")
        if not isinstance(nesterov, (bool, np.bool_)):
            raise ArgumentError("SGD: nesterov must be True or False, got %r" % (nesterov,))
        if nesterov and self.momentum == 0:
            raise ArgumentError("SGD: nesterov=True needs momentum > 0")
        self.nesterov = bool(nesterov)
        self.buffers = ("momentum",) if self.momentum else ()
        super().__init__(lr, weight_decay)

    def __call__(self, params, grads):
        buffers = self.buffers_for(params).get("momentum")
        for i, (p, g) in enumerate(zip(params, grads)):
            d = self._decayed(p, g)
            if buffers is not None:
                buf = buffers[i]
                buf *= self.momentum
                buf += d
                d = d + self.momentum * buf if self.nesterov else buf
            p -= self.lr * d

    def __repr__(self):
        return "SGD(lr=%r, momentum=%r, nesterov=%r, weight_decay=%r)" % (
            self.lr, self.momentum, self.nesterov, self.weight_decay)


class Adam(Rule):
    """Adam (Kingma & Ba; PyTorch's ``torch.optim.Adam``, L2 weight decay
    added to the gradient), with step count t from 1:

        d = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * d
        v = beta2 * v + (1 - beta2) * d * d
        p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    """

    buffers = ("m", "v")

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ArgumentError("Adam: betas must be a pair (beta1, beta2), got %r" % (betas,))
        self.betas = tuple(check_number(b, "Adam: betas[%d]" % i, high=1.0, high_open=True)
                           for i, b in enumerate(betas))
        self.eps = check_number(eps, "Adam: eps")
        self._t = np.zeros((), np.int64)
        super().__init__(lr, weight_decay)

    @property
    def t(self):
        """Number of updates applied so far."""
        return int(self._t)

    def counters(self):
        return {"t": self._t}

    def __call__(self, params, grads):
        state = self.buffers_for(params)
        self._t += 1
        b1, b2 = self.betas
        step_size = self.lr / (1 - b1 ** self.t)
        root_c2 = math.sqrt(1 - b2 ** self.t)
        for p, g, m, v in zip(params, grads, state["m"], state["v"]):
            xp = array_module(p)
            d = self._decayed(p, g)
            m *= b1
            m += (1 - b1) * d
            v *= b2
            v += (1 - b2) * (d * d)
            denom = xp.sqrt(v)
            denom /= root_c2
            denom += self.eps
            p -= step_size * (m / denom)

    def __repr__(self):
        return "Adam(lr=%r, betas=%r, eps=%r, weight_decay=%r)" % (
            self.lr, self.betas, self.eps, self.weight_decay)
