"""Update rules: how parameters move given their averaged gradients.

A rule is called as ``rule(params, grads)`` (lists of numpy or cupy arrays
of matching shapes and dtypes) and updates ``params`` in place, leaving
``grads`` as they are. Any callable of that signature is a rule (one with
a ``state(params)`` method returning ``{name: array}`` has that state
checkpointed too); the ones here (:class:`SGD`, :class:`Adam`,
:class:`AdamW`, :class:`LAMB`) are written once for numpy and cupy (the
array module of each parameter does the arithmetic, in the parameter's
dtype) and keep their state (momentum buffers, moments, step count) in
arrays that :meth:`Rule.state` hands out by name, so the optimizer can
save, load and broadcast them.

Their hyperparameters (:attr:`Rule.hyper`: ``lr``, ``weight_decay``,
``momentum``, ...) are the defaults of a
:class:`~commlib.optim.DistributedOptimizer`'s parameter groups, each of
which may override them; the optimizer calls :meth:`Rule.update` once per
group with that group's values. SGD, Adam and AdamW are elementwise, so the
optimizer hands them each run of parameters that lie back to back as one
flat array; LAMB needs each parameter's norm and gets them one by one.
"""
import math
import weakref

import numpy as np

from ..errors import ArgumentError
from ..ops.arrays import array_module


def check_number(value, what, low=0.0, high=math.inf, high_open=False, rank=None):
    """``float(value)`` when it is a real number with ``low <= value <= high``
    (``< high`` with ``high_open``); else ArgumentError naming ``what``
    (and ``rank`` when given).

    Args:
        value: the value to check.
        what: its name, for the message.
        low, high, high_open: the allowed range.
        rank: the caller's rank, named in the message when given.

    Returns:
        ``float(value)``.

    Raises:
        ArgumentError: not a finite real number in the range.
    """
    ok = (not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.number))
          and math.isfinite(value) and low <= value and (value < high if high_open
                                                          else value <= high))
    if not ok:
        upper = ("< %g" % high) if high_open else ("<= %g" % high)
        raise ArgumentError("%s%s must be a finite number >= %g%s, got %r"
                            % ("" if rank is None else "rank %d: " % rank, what, low,
                               "" if high == math.inf else " and " + upper, value))
    return float(value)


def _check_bool(value, what, rank=None):
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError("%s%s must be True or False, got %r"
                            % ("" if rank is None else "rank %d: " % rank, what, value))
    return bool(value)


def _check_betas(value, what, rank=None):
    if not isinstance(value, (tuple, list, np.ndarray)) or len(value) != 2:
        raise ArgumentError("%s%s must be a pair (beta1, beta2), got %r"
                            % ("" if rank is None else "rank %d: " % rank, what, value))
    return tuple(check_number(float(b) if isinstance(b, np.floating) else b,
                              "%s[%d]" % (what, i), high=1.0, high_open=True, rank=rank)
                 for i, b in enumerate(value))


class Rule:
    """Base of the built-in rules: validated hyperparameters (the defaults
    of every parameter group), a step count, and per-parameter state
    buffers (allocated at the first call or :meth:`state`, zero-filled,
    like the parameters).

    Subclasses set :attr:`hyper`, :attr:`buffers`, :attr:`elementwise`,
    define :meth:`update` and validate their own hyperparameters in
    :meth:`check_group`.

    Args:
        lr: learning rate (>= 0).
        weight_decay: >= 0.

    Raises:
        ArgumentError: ``lr`` or ``weight_decay`` not a finite number >= 0,
            naming it.
    """

    #: names of the hyperparameters (attributes, and keys of a parameter group)
    hyper = ("lr", "weight_decay")
    #: names of the per-parameter buffers this rule keeps
    buffers = ()
    #: True: the update of an element depends on that element only, so
    #: parameters lying back to back may be updated as one flat array
    elementwise = True

    def __init__(self, lr, weight_decay):
        self.lr = lr
        self.weight_decay = check_number(weight_decay, "%s: weight_decay" % type(self).__name__)
        self._state = None
        self._owner = None
        self.step_count = np.zeros((), np.int64)

    @property
    def lr(self):
        """Learning rate (float >= 0; may be changed between steps)."""
        return self._lr

    @lr.setter
    def lr(self, value):
        self._lr = check_number(value, "%s: lr" % type(self).__name__)

    @property
    def t(self):
        """Number of updates applied so far."""
        return int(self.step_count)

    def defaults(self):
        """This rule's own settings, the defaults of a parameter group.

        Returns:
            ``{name: value}`` of every name of :attr:`hyper`.
        """
        return {k: getattr(self, k) for k in self.hyper}

    def check_group(self, group, where="", rank=None):
        """Validate the hyperparameters of ``group`` (a dict holding every
        name of :attr:`hyper`).

        Args:
            group: ``{name: value}``.
            where: prefix of the messages (e.g. ``"param_groups[1]: "``).
            rank: named in the messages when given.

        Returns:
            ``{name: validated value}`` (floats, bools, tuples).

        Raises:
            ArgumentError: naming the hyperparameter, the group and the rank.
        """
        name = type(self).__name__
        return {"lr": check_number(group["lr"], "%s%s: lr" % (where, name), rank=rank),
                "weight_decay": check_number(group["weight_decay"], "%s%s: weight_decay"
                                             % (where, name), rank=rank)}

    def state(self, params):
        """The rule's state for ``params`` (its buffers allocated, zero-filled,
        at the first call).

        Args:
            params: the list of arrays the rule updates.

        Returns:
            ``{name: array}``: the live arrays (writing into them changes the
            state), ``"<buffer>.<i>"`` for array i's buffers, plus the rule's
            counters (:meth:`counters`) as 0-d numpy arrays.

        Raises:
            ArgumentError: called with another number of arrays than before
                (as :meth:`buffers_for`).
        """
        out = dict(self.counters())
        for name, arrays in self.buffers_for(params).items():
            out.update(("%s.%d" % (name, i), b) for i, b in enumerate(arrays))
        return out

    def counters(self):
        """The counters a checkpoint keeps (the rules whose update depends on
        the step count keep ``t``).

        Returns:
            ``{name: 0-d numpy array}``, the live arrays (empty for SGD).
        """
        return {}

    def buffers_for(self, params):
        """The per-parameter buffers, allocated (zero-filled) at the first
        call; a rule keeps the state of one list of arrays (one rule object
        per optimizer, see :meth:`bind`).

        Args:
            params: the list of arrays the rule updates.

        Returns:
            ``{buffer name: [one array like each of params]}`` (the live
            arrays; empty for a rule without buffers).

        Raises:
            ArgumentError: called with another number of arrays than before.
        """
        if self._state is None:
            self._state = {name: [array_module(p).zeros_like(p) for p in params]
                           for name in self.buffers}
            self._count = len(params)
        elif self._count != len(params):
            raise ArgumentError("%s: holds state for %d arrays, called with %d; use one rule "
                                "object per optimizer" % (type(self).__name__, self._count,
                                                          len(params)))
        return self._state

    def bind(self, owner, rank=None):
        """Make this rule ``owner``'s, for good: a rule keeps the state
        (buffers, step count) of one optimizer, so no other optimizer may
        take it, even after ``owner`` is gone.

        Args:
            owner: the :class:`~commlib.optim.DistributedOptimizer` made with it.
            rank: named in the message when given.

        Raises:
            ArgumentError: the rule was given to another optimizer before.
        """
        ref = getattr(self, "_owner", None)
        if ref is not None and ref() is not owner:
            raise ArgumentError(
                "%srule: this %s object was given to another DistributedOptimizer, whose "
                "momentum buffers, moments and step count it keeps; give each optimizer a "
                "rule object of its own (e.g. %s(...) again)"
                % ("" if rank is None else "rank %d: " % rank, type(self).__name__,
                   type(self).__name__))
        self._owner = weakref.ref(owner)

    def begin_step(self):
        """Count one more update (called once per update, before the
        :meth:`update` calls of its groups).

        Returns:
            The new count t (an int, from 1).
        """
        self.step_count += 1
        return int(self.step_count)

    def update(self, params, grads, buffers, group, t):
        """Update ``params`` in place with ``grads``.

        Args:
            params, grads: lists of arrays of matching shapes.
            buffers: ``{buffer name: [array like each of params]}``.
            group: the validated hyperparameters (:meth:`check_group`).
            t: the update's number, from 1.

        Raises:
            NotImplementedError: in the base class (subclasses define it).
        """
        raise NotImplementedError

    def __call__(self, params, grads):
        """One update of ``params`` with ``grads`` with this rule's own
        hyperparameters (one group)."""
        buffers = self.buffers_for(params)
        group = self.check_group(self.defaults())
        t = self.begin_step()
        self.update(params, grads, buffers, group, t)

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join(
            "%s=%r" % (k, getattr(self, k)) for k in self.hyper))


def _decayed(p, g, weight_decay):
    """The gradient with L2 weight decay (a new array when decaying)."""
    return g + weight_decay * p if weight_decay else g


class SGD(Rule):
    """Stochastic gradient descent with optional momentum, dampening,
    Nesterov momentum and L2 weight decay (PyTorch's ``torch.optim.SGD``):

        d = g + weight_decay * p
        buf = d                                       (first update)
        buf = momentum * buf + (1 - dampening) * d    (later ones)
        d = d + momentum * buf if nesterov else buf   (with momentum > 0)
        p -= lr * d

    Args:
        lr: learning rate (>= 0).
        momentum: >= 0.
        dampening: in [0, 1].
        nesterov: needs momentum > 0 and dampening 0.
        weight_decay: >= 0.

    Raises:
        ArgumentError: a value out of range, naming it.
    """

    hyper = ("lr", "momentum", "dampening", "nesterov", "weight_decay")

    def __init__(self, lr, momentum=0.0, nesterov=False, weight_decay=0.0, dampening=0.0):
        self.momentum = check_number(momentum, "SGD: momentum")
        self.dampening = check_number(dampening, "SGD: dampening", high=1.0)
        self.nesterov = _check_bool(nesterov, "SGD: nesterov")
        super().__init__(lr, weight_decay)
        self.check_group(self.defaults())
        self.buffers = ("momentum",) if self.momentum else ()

    def check_group(self, group, where="", rank=None):
        """Validate the hyperparameters of ``group``, as
        :meth:`Rule.check_group`; a group with momentum > 0 gives the rule
        momentum buffers when it had none (only before its first update).

        Args:
            group: ``{name: value}`` holding every name of :attr:`hyper`.
            where: prefix of the messages (e.g. ``"param_groups[1]: "``).
            rank: named in the messages when given.

        Returns:
            ``{name: validated value}``.

        Raises:
            ArgumentError: a value out of range; ``nesterov`` without
                momentum > 0 and dampening 0; momentum > 0 in a group of a
                rule created without momentum, after its first update.
        """
        out = super().check_group(group, where, rank)
        out["momentum"] = check_number(group["momentum"], where + "SGD: momentum", rank=rank)
        out["dampening"] = check_number(group["dampening"], where + "SGD: dampening",
                                        high=1.0, rank=rank)
        out["nesterov"] = _check_bool(group["nesterov"], where + "SGD: nesterov", rank)
        prefix = "" if rank is None else "rank %d: " % rank
        if out["nesterov"] and (out["momentum"] == 0 or out["dampening"] != 0):
            raise ArgumentError("%s%sSGD: nesterov=True needs momentum > 0 and dampening 0, "
                                "got momentum=%r, dampening=%r"
                                % (prefix, where, out["momentum"], out["dampening"]))
        if out["momentum"] and "momentum" not in self.buffers:
            # a group asks for momentum that the rule's defaults did not
            if self._state is not None:
                raise ArgumentError("%s%sSGD: momentum > 0 in a group of a rule created "
                                    "without momentum, after its first update; give the rule "
                                    "momentum > 0" % (prefix, where))
            self.buffers = ("momentum",)
        return out

    def update(self, params, grads, buffers, group, t):
        lr, mu, damp = group["lr"], group["momentum"], group["dampening"]
        wd, nesterov = group["weight_decay"], group["nesterov"]
        bufs = buffers.get("momentum")
        for i, (p, g) in enumerate(zip(params, grads)):
            d = _decayed(p, g, wd)
            if mu:
                buf = bufs[i]
                buf *= mu
                if damp and t > 1:
                    buf += (1 - damp) * d
                else:
                    buf += d
                d = d + mu * buf if nesterov else buf
            p -= lr * d


class Adam(Rule):
    """Adam (Kingma & Ba; PyTorch's ``torch.optim.Adam``, L2 weight decay
    added to the gradient), with step count t from 1:

        d = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * d
        v = beta2 * v + (1 - beta2) * d * d
        p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    Args:
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: >= 0.
        weight_decay: >= 0.

    Raises:
        ArgumentError: a value out of range, naming it.
    """

    hyper = ("lr", "betas", "eps", "weight_decay")
    buffers = ("m", "v")
    #: True: weight decay is decoupled from the gradient (AdamW)
    decoupled = False

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        name = type(self).__name__
        self.betas = _check_betas(betas, name + ": betas")
        self.eps = check_number(eps, name + ": eps")
        super().__init__(lr, weight_decay)

    def counters(self):
        return {"t": self.step_count}

    def check_group(self, group, where="", rank=None):
        out = super().check_group(group, where, rank)
        name = type(self).__name__
        out["betas"] = _check_betas(group["betas"], where + name + ": betas", rank)
        out["eps"] = check_number(group["eps"], where + name + ": eps", rank=rank)
        return out

    def _direction(self, p, g, m, v, group, t):
        """Update m and v in place; returns the bias-corrected Adam step
        direction m_hat / (sqrt(v_hat) + eps) (a new array)."""
        xp = array_module(p)
        b1, b2 = group["betas"]
        d = g if self.decoupled else _decayed(p, g, group["weight_decay"])
        m *= b1
        m += (1 - b1) * d
        v *= b2
        v += (1 - b2) * (d * d)
        denom = xp.sqrt(v)
        denom /= math.sqrt(1 - b2 ** t)
        denom += group["eps"]
        out = m / denom
        out *= 1 / (1 - b1 ** t)
        return out

    def update(self, params, grads, buffers, group, t):
        lr, wd = group["lr"], group["weight_decay"]
        b1, b2 = group["betas"]
        step_size = lr / (1 - b1 ** t)
        root_c2 = math.sqrt(1 - b2 ** t)
        for p, g, m, v in zip(params, grads, buffers["m"], buffers["v"]):
            xp = array_module(p)
            if self.decoupled and wd:
                p *= 1 - lr * wd
                d = g
            else:
                d = _decayed(p, g, wd)
            m *= b1
            m += (1 - b1) * d
            v *= b2
            v += (1 - b2) * (d * d)
            denom = xp.sqrt(v)
            denom /= root_c2
            denom += group["eps"]
            p -= step_size * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter; PyTorch's
    ``torch.optim.AdamW``): ``p *= 1 - lr * weight_decay`` first, then the
    Adam update of the plain gradient.

    Args:
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: >= 0.
        weight_decay: >= 0 (default 0.01, as PyTorch's).

    Raises:
        ArgumentError: a value out of range, naming it.
    """

    decoupled = True

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(lr, betas, eps, weight_decay)


class LAMB(Adam):
    """LAMB (You et al., "Large batch optimization for deep learning"):
    per parameter array, the bias-corrected Adam direction plus decoupled
    weight decay, scaled by the trust ratio ``||p|| / ||r||`` (1 when
    either norm is 0):

        m, v as Adam's (of the plain gradient)
        r = m / (1 - beta1**t) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * p
        p -= lr * trust * r

    Not elementwise: the optimizer hands it each parameter array on its
    own. Exclude biases and norms from the decay (and trust ratio, as
    usual) with a parameter group of ``weight_decay=0``.

    Args:
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: >= 0 (default 1e-6).
        weight_decay: >= 0.

    Raises:
        ArgumentError: a value out of range, naming it.
    """

    elementwise = False
    decoupled = True

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(lr, betas, eps, weight_decay)

    def update(self, params, grads, buffers, group, t):
        lr, wd = group["lr"], group["weight_decay"]
        for p, g, m, v in zip(params, grads, buffers["m"], buffers["v"]):
            xp = array_module(p)
            r = self._direction(p, g, m, v, group, t)
            if wd:
                r += wd * p
            p_norm = xp.sqrt(xp.sum(p.astype(xp.float64) ** 2))
            r_norm = xp.sqrt(xp.sum(r.astype(xp.float64) ** 2))
            trust = xp.where((p_norm > 0) & (r_norm > 0), p_norm / xp.where(r_norm > 0, r_norm, 1),
                             1.0)
            r *= (lr * trust).astype(p.dtype)
            p -= r
