"""Learning-rate schedules of a :class:`~commlib.optim.DistributedOptimizer`'s
parameter groups, with ``torch.optim.lr_scheduler``'s semantics: made on the
optimizer (the constructor makes the schedule's first step), then
:meth:`LRScheduler.step` once per step or once per epoch, whichever unit the
schedule's lengths are in.

Each ``step()`` computes every group's new ``lr`` from its current one, as
PyTorch's schedulers do (their "chainable form"): two schedulers stepped
together on one optimizer compose (``ExponentialLR(opt, 0.9)`` and
``StepLR(opt, 3, 0.5)``: 0.1, 0.09, 0.081, 0.03645, ...), and an ``lr`` set
by hand between steps is where the schedule continues from. The base of a
schedule (its closed form, which :class:`SequentialLR` restarts a scheduler
from at its milestone, and :class:`LambdaLR` always uses) is each group's
``lr`` when the first scheduler was made on it (kept as the group's
``"initial_lr"``). Values are the same floats PyTorch's give.

    warmup = commlib.optim.LinearLR(opt, start_factor=0.01, total_iters=500)
    cosine = commlib.optim.CosineAnnealingLR(opt, T_max=9500)
    sched = commlib.optim.SequentialLR(opt, [warmup, cosine], milestones=[500])
    for batch in batches:
        ...; opt.step(); sched.step()

A scheduler's state (``last_epoch``, ``base_lrs``, ``last_lr``) is part of
the optimizer's :meth:`~commlib.optim.DistributedOptimizer.state_dict`, with
the groups' ``lr`` (make the schedulers before loading a checkpoint into
it). Every rank must step its schedulers alike: the optimizer's all-reduces
compare the groups' hyperparameters between the ranks.
"""
import bisect
import math

import numpy as np

from ..errors import ArgumentError
from .distributed_optimizer import DistributedOptimizer
from .rules import check_number


def _int(value, what, low):
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
            or value < low):
        raise ArgumentError("%s must be an int >= %d, got %r" % (what, low, value))
    return int(value)


def check_optimizer(optimizer, name):
    """The checks of a scheduler's ``optimizer``, made before anything is
    written into it.

    Raises:
        TypeError: not a :class:`~commlib.optim.DistributedOptimizer` (a
            ``torch.optim`` optimizer, say: use ``torch.optim.lr_scheduler``).
        ArgumentError: its rule has no learning rate (a callable rule).
    """
    if not isinstance(optimizer, DistributedOptimizer):
        kind = type(optimizer)
        raise TypeError("%s: optimizer must be a commlib.DistributedOptimizer, got %s.%s%s"
                        % (name, kind.__module__, kind.__qualname__,
                           " (use torch.optim.lr_scheduler for torch optimizers)"
                           if kind.__module__.startswith("torch") else ""))
    if any("lr" not in g for g in optimizer.param_groups):
        raise ArgumentError("rank %d: %s: the optimizer's rule %r has no learning rate"
                            % (optimizer.comm.rank, name, optimizer.rule))


class LRScheduler:
    """Base of the schedules. Made on an optimizer, it joins the optimizer's
    schedulers (whose state its checkpoints keep) and makes its first step
    (t = 0). Not collective.

    Subclasses define :meth:`closed_form` and, when the schedule has one of
    its own, :meth:`chained` (the default is the closed form, as
    :class:`LambdaLR`'s).

    Args:
        optimizer: a :class:`~commlib.optim.DistributedOptimizer` whose
            rule has a learning rate.

    Raises:
        TypeError: ``optimizer`` is not a DistributedOptimizer (nothing is
            written into it).
        ArgumentError: an optimizer whose rule has no learning rate.
    """

    def __init__(self, optimizer):
        check_optimizer(optimizer, type(self).__name__)
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.base_lrs = np.array([g.setdefault("initial_lr", g["lr"]) for g in groups],
                                 np.float64)
        self._last = np.array(-1, np.int64)
        self._last_lr = np.zeros(len(groups), np.float64)
        optimizer.schedulers.append(self)
        self.step()

    @property
    def last_epoch(self):
        """How many times :meth:`step` was called since the one the
        constructor makes (PyTorch's name, whichever the unit)."""
        return int(self._last)

    def closed_form(self, base, t):
        """The learning rate ``t`` steps in, from ``base`` alone (PyTorch's
        ``_get_closed_form_lr``).

        Args:
            base: the group's base learning rate (its ``"initial_lr"``).
            t: the number of :meth:`step` calls (an int >= 0).

        Returns:
            The learning rate (a float).

        Raises:
            NotImplementedError: in the base class (subclasses define it).
        """
        raise NotImplementedError

    def chained(self, lr, base, t):
        """The learning rate after step ``t`` from the group's current ``lr``
        (PyTorch's ``get_lr``; t = 0 is the constructor's step). This default
        is the closed form.

        Args:
            lr: the group's learning rate before this step.
            base: the group's base learning rate.
            t: this step's number (an int >= 0).

        Returns:
            The learning rate (a float).
        """
        return self.closed_form(base, t)

    def step(self):
        """Advance by one (a step or an epoch) and set every group's lr from
        its current one (as PyTorch's, whatever it gives: the optimizer's
        step refuses an lr below 0).

        Raises:
            ArgumentError: a group's lr is not a finite number.
        """
        t = int(self._last) + 1
        groups = self.optimizer.param_groups
        rank = self.optimizer.comm.rank
        lrs = [float(self.chained(check_number(g["lr"], "param_groups[%d]['lr']" % k,
                                               low=-math.inf, rank=rank), float(base), t))
               for k, (g, base) in enumerate(zip(groups, self.base_lrs))]
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
        self._last[...] = t
        self._last_lr[...] = lrs

    def get_last_lr(self):
        """The learning rates this scheduler's last step set.

        Returns:
            A list of floats, one per parameter group.
        """
        return [float(x) for x in self._last_lr]

    def state_arrays(self):
        """The scheduler's state, as the optimizer's checkpoints keep it.

        Returns:
            ``{"last_epoch": 0-d int64, "base_lrs": float64 per group,
            "last_lr": float64 per group}``: the live arrays, not copies.
        """
        return {"last_epoch": self._last, "base_lrs": self.base_lrs, "last_lr": self._last_lr}

    def state_dict(self):
        """The scheduler's state (also part of the optimizer's state dict).

        Returns:
            ``{"last_epoch", "base_lrs", "last_lr"}`` as numpy copies.
        """
        return {k: np.array(v, copy=True) for k, v in self.state_arrays().items()}

    def load_state_dict(self, state_dict):
        """Take :meth:`state_dict`'s values (not collective). As PyTorch's,
        the groups' ``lr`` are left as they are: they are the optimizer's
        state (:meth:`~commlib.optim.DistributedOptimizer.load_state_dict`).

        Args:
            state_dict: ``{"last_epoch", "base_lrs"}`` (and ``"last_lr"``,
                which a state from before it was kept lacks) from
                :meth:`state_dict`.

        Raises:
            ArgumentError: a key is missing or of another shape; nothing is
                changed.
        """
        values = {}
        for k, v in self.state_arrays().items():
            if k == "last_lr" and k not in state_dict:
                continue
            given = np.asarray(state_dict[k]) if k in state_dict else None
            if given is None or given.shape != v.shape:
                raise ArgumentError("%s.load_state_dict: %r missing or not of shape %s"
                                    % (type(self).__name__, k, v.shape))
            values[k] = given
        for k, given in values.items():
            self.state_arrays()[k][...] = given

    def _detach(self):
        if self in self.optimizer.schedulers:
            self.optimizer.schedulers.remove(self)


class LambdaLR(LRScheduler):
    """``lr = base * fn(t)`` (the closed form at every step, as PyTorch's:
    it overrides what other schedulers set).

    Args:
        optimizer: the optimizer.
        fn: callable of the int t returning a factor.

    Raises:
        ArgumentError: fn not callable, or an optimizer whose rule has no
            learning rate.
        TypeError: ``optimizer`` is not a DistributedOptimizer.
    """

    def __init__(self, optimizer, fn):
        if not callable(fn):
            raise ArgumentError("LambdaLR: fn must be callable, got %r" % (fn,))
        self.fn = fn
        super().__init__(optimizer)

    def closed_form(self, base, t):
        return base * self.fn(t)


class StepLR(LRScheduler):
    """Multiplies the lr by ``gamma`` every ``step_size`` steps; alone,
    ``lr = base * gamma ** (t // step_size)``.

    Args:
        optimizer: the optimizer.
        step_size: int >= 1.
        gamma: >= 0 (default 0.1).

    Raises:
        ArgumentError: a value out of range, or an optimizer whose rule has
            no learning rate.
        TypeError: ``optimizer`` is not a DistributedOptimizer.
    """

    def __init__(self, optimizer, step_size, gamma=0.1):
        self.step_size = _int(step_size, "StepLR: step_size", 1)
        self.gamma = check_number(gamma, "StepLR: gamma")
        super().__init__(optimizer)

    def closed_form(self, base, t):
        return base * self.gamma ** (t // self.step_size)

    def chained(self, lr, base, t):
        if t == 0 or t % self.step_size != 0:
            return lr
        return lr * self.gamma


class ExponentialLR(LRScheduler):
    """Multiplies the lr by ``gamma`` every step; alone, ``lr = base * gamma ** t``.

    Args:
        optimizer: the optimizer.
        gamma: >= 0.

    Raises:
        ArgumentError: a value out of range, or an optimizer whose rule has
            no learning rate.
        TypeError: ``optimizer`` is not a DistributedOptimizer.
    """

    def __init__(self, optimizer, gamma):
        self.gamma = check_number(gamma, "ExponentialLR: gamma")
        super().__init__(optimizer)

    def closed_form(self, base, t):
        return base * self.gamma ** t

    def chained(self, lr, base, t):
        return lr if t == 0 else lr * self.gamma


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing; alone, ``lr = eta_min + (base - eta_min) * (1 +
    cos(pi * t / T_max)) / 2``: from base down to eta_min at ``T_max``, then,
    as PyTorch's, up again (period ``2 * T_max``). Stepped, each lr follows
    from the current one by PyTorch's recursive formula.

    Args:
        optimizer: the optimizer.
        T_max: int >= 1, in steps or epochs.
        eta_min: >= 0.

    Raises:
        ArgumentError: a value out of range, or an optimizer whose rule has
            no learning rate.
        TypeError: ``optimizer`` is not a DistributedOptimizer.
    """

    def __init__(self, optimizer, T_max, eta_min=0.0):
        self.T_max = _int(T_max, "CosineAnnealingLR: T_max", 1)
        self.eta_min = check_number(eta_min, "CosineAnnealingLR: eta_min")
        super().__init__(optimizer)

    def closed_form(self, base, t):
        return self.eta_min + (base - self.eta_min) * (
            1 + math.cos(math.pi * t / self.T_max)) / 2

    def chained(self, lr, base, t):
        T, eta_min = self.T_max, self.eta_min
        if t == 0:
            return lr
        if (t - 1 - T) % (2 * T) == 0:          # from eta_min, where the ratio is 0 / 0
            return lr + (base - eta_min) * (1 - math.cos(math.pi / T)) / 2
        return ((1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T))
                * (lr - eta_min) + eta_min)


class LinearLR(LRScheduler):
    """Linear warm-up (or decay); alone, ``lr = base * f`` with f going
    linearly from ``start_factor`` at t = 0 to ``end_factor`` at
    ``total_iters``, then staying there.

    Args:
        optimizer: the optimizer.
        start_factor: in (0, 1] (default 1/3, as PyTorch's).
        end_factor: in [0, 1].
        total_iters: int >= 1.

    Raises:
        ArgumentError: a value out of range, or an optimizer whose rule has
            no learning rate.
        TypeError: ``optimizer`` is not a DistributedOptimizer.
    """

    def __init__(self, optimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5):
        self.start_factor = check_number(start_factor, "LinearLR: start_factor", high=1.0)
        if not self.start_factor > 0:
            raise ArgumentError("LinearLR: start_factor must be > 0 and <= 1, got %r"
                                % (start_factor,))
        self.end_factor = check_number(end_factor, "LinearLR: end_factor", high=1.0)
        self.total_iters = _int(total_iters, "LinearLR: total_iters", 1)
        super().__init__(optimizer)

    def closed_form(self, base, t):
        return base * (self.start_factor + (self.end_factor - self.start_factor)
                       * min(self.total_iters, t) / self.total_iters)

    def chained(self, lr, base, t):
        start, end, total = self.start_factor, self.end_factor, self.total_iters
        if t == 0:
            return lr * start
        if t > total:
            return lr
        return lr * (1.0 + (end - start) / (total * start + (t - 1) * (end - start)))


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
        TypeError: ``optimizer`` is not a DistributedOptimizer.
    """
    warmup = _int(warmup, "LinearWarmup: warmup", 1)
    if warmup == 1:
        return LinearLR(optimizer, start_factor=1.0, end_factor=1.0, total_iters=1)
    return LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0,
                    total_iters=warmup - 1)


class SequentialLR(LRScheduler):
    """The ``schedulers`` one after the other (PyTorch's ``SequentialLR``):
    schedulers[0] from the start, schedulers[j] from ``milestones[j-1]`` on,
    restarted there from its closed form at 0 (from the groups' base lr) and
    then stepped, its own t counted from the milestone. Warm-up then cosine is
    ``SequentialLR(opt, [LinearLR(opt, 0.01, total_iters=W), CosineAnnealingLR(opt, T - W)],
    milestones=[W])``. Making it undoes the first steps its schedulers made
    (every group's lr goes back to its base) and makes schedulers[0]'s.

    Args:
        optimizer: the optimizer the schedulers were made on.
        schedulers: list of them (they become this one's parts: step this
            one only; a SequentialLR cannot be one).
        milestones: increasing ints >= 1, one fewer than schedulers.

    Raises:
        ArgumentError: schedulers not a non-empty list of schedulers (other
            than SequentialLR), or made on another optimizer; bad milestones.
        TypeError: ``optimizer`` is not a DistributedOptimizer.
    """

    def __init__(self, optimizer, schedulers, milestones):
        check_optimizer(optimizer, "SequentialLR")
        if (not isinstance(schedulers, (list, tuple)) or not schedulers
                or not all(isinstance(s, LRScheduler) for s in schedulers)):
            raise ArgumentError("SequentialLR: schedulers must be a non-empty list of "
                                "schedulers, got %r" % (schedulers,))
        nested = [j for j, s in enumerate(schedulers) if isinstance(s, SequentialLR)]
        if nested:
            raise ArgumentError("SequentialLR: schedulers[%d] is a SequentialLR; list its "
                                "schedulers in this one instead" % nested[0])
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
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"]
        super().__init__(optimizer)

    def closed_form(self, base, t):
        j = bisect.bisect_right(self.milestones, t)
        return self.schedulers[j].closed_form(base, t - (self.milestones[j - 1] if j else 0))

    def chained(self, lr, base, t):
        j = bisect.bisect_right(self.milestones, t)
        if j and self.milestones[j - 1] == t:
            return self.schedulers[j].closed_form(base, 0)
        return self.schedulers[j].chained(lr, base, t - (self.milestones[j - 1] if j else 0))
