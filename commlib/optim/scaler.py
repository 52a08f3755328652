"""Dynamic loss scaling for mixed-precision training (PyTorch's
``torch.cuda.amp.GradScaler`` semantics), with the found-inf decision made
from every rank's gradients, so every rank skips the same steps.

    scaler = commlib.optim.DynamicLossScaler()
    opt = commlib.DistributedOptimizer(comm, params, rule, loss_scaler=scaler)
    dloss = scaler.scale_loss(dloss)          # backward of loss * scale
    backward(...); opt.step()                 # False when skipped
"""
import numpy as np

from ..errors import ArgumentError
from .rules import check_number

#: the largest scale: float32's largest finite number
MAX_SCALE = float(np.finfo(np.float32).max)
#: the smallest scale: float32's smallest normal number (2**-126)
MIN_SCALE = float(np.finfo(np.float32).tiny)


class DynamicLossScaler:
    """The loss scale and its schedule.

    Multiply the loss (or the gradient of the loss that starts the
    backward pass) by :attr:`scale`; give the scaler to a
    :class:`~commlib.optim.DistributedOptimizer` (``loss_scaler=``), which
    after the average checks the gradients of every rank for NaN and inf:

    * any found: every rank skips the update (parameters, the rule's state,
      compression residuals and the step count stay as they were) and the
      scale is multiplied by ``backoff_factor``;
    * none: the gradients are divided by the scale before clipping and the
      rule; after ``growth_interval`` such updates in a row the scale is
      multiplied by ``growth_factor``.

    Args:
        init_scale: the first scale, a float32 normal number
            (:data:`MIN_SCALE` to :data:`MAX_SCALE`).
        growth_factor: > 1.
        backoff_factor: in (0, 1).
        growth_interval: updates without NaN or inf before growing (int >= 1).
        min_scale: the scale never backs off below this (>= 0).

    Raises:
        ArgumentError: a value out of range, naming it.
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, min_scale=0.0):
        init_scale = check_number(init_scale, "DynamicLossScaler: init_scale", high=MAX_SCALE)
        if not init_scale >= MIN_SCALE:
            raise ArgumentError("DynamicLossScaler: init_scale must be >= %g (float32's "
                                "smallest normal number), got %r" % (MIN_SCALE, init_scale))
        self.growth_factor = check_number(growth_factor, "DynamicLossScaler: growth_factor",
                                          low=1.0)
        self.backoff_factor = check_number(backoff_factor, "DynamicLossScaler: backoff_factor",
                                           high=1.0)
        if not 0 < self.backoff_factor < 1 or not self.growth_factor > 1:
            raise ArgumentError("DynamicLossScaler: expected growth_factor > 1 and 0 < "
                                "backoff_factor < 1, got %r and %r"
                                % (growth_factor, backoff_factor))
        if (isinstance(growth_interval, (bool, np.bool_))
                or not isinstance(growth_interval, (int, np.integer)) or growth_interval < 1):
            raise ArgumentError("DynamicLossScaler: growth_interval must be an int >= 1, got %r"
                                % (growth_interval,))
        self.growth_interval = int(growth_interval)
        self.min_scale = check_number(min_scale, "DynamicLossScaler: min_scale")
        self._scale = np.array(init_scale, np.float64)
        self._tracker = np.zeros((), np.int64)     # updates without NaN/inf in a row

    @property
    def scale(self):
        """The current loss scale (float)."""
        return float(self._scale)

    @property
    def growth_tracker(self):
        """Updates without NaN or inf since the scale last changed."""
        return int(self._tracker)

    def scale_loss(self, value):
        """Scale the loss (or the gradient of the loss that starts the
        backward pass).

        Args:
            value: a number or an array of the loss or of its gradient.

        Returns:
            ``value * scale``, in ``value``'s own type.
        """
        return value * self.scale

    def update(self, found_inf):
        """Count an update (the optimizer calls it after each): back off, or
        grow after ``growth_interval`` taken updates in a row. The scale
        stays within float32's normal numbers, as the gradients it
        multiplies: it grows only while the result is at most
        :data:`MAX_SCALE` (PyTorch's GradScaler keeps it a finite float32),
        and backs off no lower than :data:`MIN_SCALE` (nor ``min_scale``),
        whose inverse, which unscales the gradients, is a finite float32.

        Args:
            found_inf: True when the update was skipped for NaN or inf (the
                scale is multiplied by ``backoff_factor``), False when it was
                taken.
        """
        if found_inf:
            self._scale[...] = max(float(self._scale) * self.backoff_factor, self.min_scale,
                                   MIN_SCALE)
            self._tracker[...] = 0
        else:
            self._tracker += 1
            if self._tracker >= self.growth_interval:
                grown = float(self._scale) * self.growth_factor
                if grown <= MAX_SCALE:
                    self._scale[...] = grown
                self._tracker[...] = 0

    def state_arrays(self):
        """The scaler's state, as the optimizer's checkpoints keep it.

        Returns:
            ``{"scale": 0-d float64, "growth_tracker": 0-d int64}``: the live
            arrays, not copies.
        """
        return {"scale": self._scale, "growth_tracker": self._tracker}

    def state_dict(self):
        """The scaler's state (also part of the optimizer's state dict).

        Returns:
            ``{"scale", "growth_tracker"}`` as numpy copies.
        """
        return {k: np.array(v, copy=True) for k, v in self.state_arrays().items()}

    def load_state_dict(self, state_dict):
        """Take :meth:`state_dict`'s values (not collective).

        Args:
            state_dict: ``{"scale", "growth_tracker"}`` from :meth:`state_dict`.

        Raises:
            ArgumentError: a key is missing.
        """
        for k, v in self.state_arrays().items():
            if k not in state_dict:
                raise ArgumentError("DynamicLossScaler.load_state_dict: no %r in %r"
                                    % (k, sorted(state_dict)))
            v[...] = state_dict[k]

    def __repr__(self):
        return ("DynamicLossScaler(scale=%g, growth_factor=%g, backoff_factor=%g, "
                "growth_interval=%d)" % (self.scale, self.growth_factor, self.backoff_factor,
                                         self.growth_interval))
