"""Learning-rate schedules of a :class:`~commlib.optim.DistributedOptimizer`'s
parameter groups, with ``torch.optim.lr_scheduler``'s semantics: made on the
optimizer (which sets every group's ``lr`` to the schedule's value at 0),
then :meth:`LRScheduler.step` once per step or once per epoch, whichever
unit the schedule's lengths are in. ``lr = schedule(base_lr, t)`` where
base_lr is each group's ``lr`` when the first scheduler was made on it
(kept as the group's ``"initial_lr"``) and t the number of ``step()`` calls.

    warmup = commlib.optim.LinearLR(opt, start_factor=0.01, total_iters=500)
    cosine = commlib.optim.CosineAnnealingLR(opt, T_max=9500)
    sched = commlib.optim.SequentialLR(opt, [warmup, cosine], milestones=[500])
    for batch in batches:
        ...; opt.step(); sched.step()

A scheduler's state (``last_epoch``, ``base_lrs``) is part of the
optimizer's :meth:`~commlib.optim.DistributedOptimizer.state_dict` (make the
schedulers before loading a checkpoint into it).
"""
import math

import numpy as np

from ..errors import ArgumentError
from .rules import check_number


def _int(value, what, low):
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
            or value < low):
        raise ArgumentError("%s must be an int >= %d, got %r" % (what, low, value))
    return int(value)


class LRScheduler:
    """Base of the schedules: subclasses define :meth:`lr_at`. Made on an
    optimizer, it joins the optimizer's schedulers (whose state its
    checkpoints keep) and sets every group's lr to the schedule's value at 0.
    Not collective.

    Args:
        optimizer: a :class:`~commlib.optim.DistributedOptimizer` whose
            rule has a learning rate.

    Raises:
        ArgumentError: an optimizer without parameter groups with ``lr``.
    """

    def __init__(self, optimizer):
        groups = getattr(optimizer, "param_groups", None)
        if not groups or any("lr" not in g for g in groups):
            raise ArgumentError("%s: optimizer must be a DistributedOptimizer whose rule has a "
                                "learning rate, got %r" % (type(self).__name__, optimizer))
        self.optimizer = optimizer
        self.base_lrs = np.array([g.setdefault("initial_lr", g["lr"]) for g in groups],
                                 np.float64)
        self._last = np.array(-1, np.int64)
        optimizer.schedulers.append(self)
        self.step()

    @property
    def last_epoch(self):
        """How many times :meth:`step` was called since the one the
        constructor makes (PyTorch's name, whichever the unit)."""
        return int(self._last)

    def lr_at(self, base, t):
        """The learning rate ``t`` steps in, from ``base``.

        Args:
            base: the group's base learning rate (its ``"initial_lr"``).
            t: the number of :meth:`step` calls (an int >= 0).

        Returns:
            The learning rate (a number).

        Raises:
            NotImplementedError: in the base class (subclasses define it).
        """
        raise NotImplementedError

    def step(self):
        """Advance by one (a step or an epoch) and set every group's lr."""
        self._last += 1
        self._set(int(self._last))

    def _set(self, t):
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = float(self.lr_at(float(base), t))

    def get_last_lr(self):
        """Every group's current learning rate.

        Returns:
            A list of floats, one per parameter group.
        """
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_arrays(self):
        """The scheduler's state, as the optimizer's checkpoints keep it.

        Returns:
            ``{"last_epoch": 0-d int64, "base_lrs": float64 per group}``: the
            live arrays, not copies.
        """
        return {"last_epoch": self._last, "base_lrs": self.base_lrs}

    def state_dict(self):
        """The scheduler's state (also part of the optimizer's state dict).

        Returns:
            ``{"last_epoch", "base_lrs"}`` as numpy copies.
        """
        return {k: np.array(v, copy=True) for k, v in self.state_arrays().items()}

    def load_state_dict(self, state_dict):
        """Take :meth:`state_dict`'s values and set the groups' lr from
        them (not collective).

        Args:
            state_dict: ``{"last_epoch", "base_lrs"}`` from :meth:`state_dict`.

        Raises:
            ArgumentError: a key is missing or of another shape.
        """
        for k, v in self.state_arrays().items():
            given = np.asarray(state_dict.get(k)) if k in state_dict else None
            if given is None or given.shape != v.shape:
                raise ArgumentError("%s.load_state_dict: %r missing or not of shape %s"
                                    % (type(self).__name__, k, v.shape))
            v[...] = given
        self._set(int(self._last))

    def _detach(self):
        if self in self.optimizer.schedulers:
            self.optimizer.schedulers.remove(self)


class LambdaLR(LRScheduler):
    """``lr = base * fn(t)``.

    Args:
        optimizer: the optimizer.
        fn: callable of the int t returning a factor.

    Raises:
        ArgumentError: fn not callable, or an optimizer whose rule has no
            learning rate.
    """

    def __init__(self, optimizer, fn):
        if not callable(fn):
            raise ArgumentError("LambdaLR: fn must be callable, got %r" % (fn,))
        self.fn = fn
        super().__init__(optimizer)

    def lr_at(self, base, t):
        return base * self.fn(t)


class StepLR(LRScheduler):
    """``lr = base * gamma ** (t // step_size)``.

    Args:
        optimizer: the optimizer.
        step_size: int >= 1.
        gamma: >= 0 (default 0.1).

    Raises:
        ArgumentError: a value out of range, or an optimizer whose rule has
            no learning rate.
    """

    def __init__(self, optimizer, step_size, gamma=0.1):
        self.step_size = _int(step_size, "StepLR: step_size", 1)
        self.gamma = check_number(gamma, "StepLR: gamma")
        super().__init__(optimizer)

    def lr_at(self, base, t):
        return base * self.gamma ** (t // self.step_size)


class ExponentialLR(LRScheduler):
    """``lr = base * gamma ** t``.

    Args:
        optimizer: the optimizer.
        gamma: >= 0.

    Raises:
        ArgumentError: a value out of range, or an optimizer whose rule has
            no learning rate.
    """

    def __init__(self, optimizer, gamma):
        self.gamma = check_number(gamma, "ExponentialLR: gamma")
        super().__init__(optimizer)

    def lr_at(self, base, t):
        return base * self.gamma ** t


class CosineAnnealingLR(LRScheduler):
    """``lr = eta_min + (base - eta_min) * (1 + cos(pi * t / T_max)) / 2`` for
    t <= T_max, then eta_min (not periodic, unlike PyTorch's beyond T_max).

    Args:
        optimizer: the optimizer.
        T_max: int >= 1, in steps or epochs.
        eta_min: >= 0.

    Raises:
        ArgumentError: a value out of range, or an optimizer whose rule has
            no learning rate.
    """

    def __init__(self, optimizer, T_max, eta_min=0.0):
        self.T_max = _int(T_max, "CosineAnnealingLR: T_max", 1)
        self.eta_min = check_number(eta_min, "CosineAnnealingLR: eta_min")
        super().__init__(optimizer)

    def lr_at(self, base, t):
        t = min(t, self.T_max)
        return self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * t / self.T_max)) / 2


class LinearLR(LRScheduler):
    """Linear warm-up (or decay): ``lr = base * f`` with f going linearly
    from ``start_factor`` at t = 0 to ``end_factor`` at ``total_iters``,
    then staying there.

    Args:
        optimizer: the optimizer.
        start_factor: in (0, 1] (default 1/3, as PyTorch's).
        end_factor: in [0, 1].
        total_iters: int >= 1.

    Raises:
        ArgumentError: a value out of range, or an optimizer whose rule has
            no learning rate.
    """

    def __init__(self, optimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5):
        self.start_factor = check_number(start_factor, "LinearLR: start_factor", high=1.0)
        if not self.start_factor > 0:
            raise ArgumentError("LinearLR: start_factor must be > 0 and <= 1, got %r"
                                % (start_factor,))
        self.end_factor = check_number(end_factor, "LinearLR: end_factor", high=1.0)
        self.total_iters = _int(total_iters, "LinearLR: total_iters", 1)
        super().__init__(optimizer)

    def lr_at(self, base, t):
        t = min(t, self.total_iters)
        return base * (self.start_factor + (self.end_factor - self.start_factor)
                       * t / self.total_iters)


def LinearWarmup(optimizer, warmup):
    """Linear warm-up over ``warmup`` steps: ``lr = base * min(1, (t + 1) /
    warmup)``, so the first step runs at base / warmup and step warmup - 1
    at base (a :class:`LinearLR` from ``1 / warmup`` over ``warmup - 1``).

    Args:
        optimizer: the optimizer.
        warmup: int >= 1.

    Returns:
        The LinearLR.

    Raises:
        ArgumentError: warmup not an int >= 1, or an optimizer whose rule
            has no learning rate.
    """
    warmup = _int(warmup, "LinearWarmup: warmup", 1)
    if warmup == 1:
        return LinearLR(optimizer, start_factor=1.0, end_factor=1.0, total_iters=1)
    return LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0,
                    total_iters=warmup - 1)


class SequentialLR(LRScheduler):
    """The ``schedulers`` one after the other: schedulers[j] from
    ``milestones[j-1]`` on, its own t counted from there (PyTorch's
    ``SequentialLR``): warm-up then cosine is
    ``SequentialLR(opt, [LinearLR(opt, 0.01, total_iters=W), CosineAnnealingLR(opt, T - W)],
    milestones=[W])``.

    Args:
        optimizer: the optimizer the schedulers were made on.
        schedulers: list of them (they become this one's parts: step this
            one only).
        milestones: increasing ints >= 1, one fewer than schedulers.

    Raises:
        ArgumentError: schedulers not a non-empty list of schedulers, or made
            on another optimizer; bad milestones.
    """

    def __init__(self, optimizer, schedulers, milestones):
        if (not isinstance(schedulers, (list, tuple)) or not schedulers
                or not all(isinstance(s, LRScheduler) for s in schedulers)):
            raise ArgumentError("SequentialLR: schedulers must be a non-empty list of "
                                "schedulers, got %r" % (schedulers,))
        if any(s.optimizer is not optimizer for s in schedulers):
            raise ArgumentError("SequentialLR: every scheduler must be made on the same "
                                "optimizer as SequentialLR's")
        if not isinstance(milestones, (list, tuple)) or len(milestones) != len(schedulers) - 1:
            raise ArgumentError("SequentialLR: milestones must be a list of %d ints (one "
                                "fewer than schedulers), got %r"
                                % (len(schedulers) - 1, milestones))
        ms = [_int(m, "SequentialLR: milestones[%d]" % j, 1) for j, m in enumerate(milestones)]
        if ms != sorted(set(ms)):
            raise ArgumentError("SequentialLR: milestones must increase, got %r" % (ms,))
        self.schedulers, self.milestones = list(schedulers), ms
        for s in self.schedulers:
            s._detach()
        super().__init__(optimizer)

    def lr_at(self, base, t):
        j = sum(t >= m for m in self.milestones)
        start = self.milestones[j - 1] if j else 0
        return self.schedulers[j].lr_at(base, t - start)
