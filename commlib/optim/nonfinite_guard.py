"""NaN and inf in a DistributedOptimizer's gradients (``nonfinite="raise"``,
``"warn"`` or ``"skip"``) and the loss scaler's part in mixed precision:
each rank counts the non-finite values of its gradients before the
average, the counts are exchanged in one small all-gather so that every
rank decides alike, a skipped update is counted and backs the loss scale
off, and a taken one is unscaled and lets the scale grow."""
import numpy as np

from ..compression import Partial
from ..compression import nonfinite as compression_nonfinite
from ..errors import ArgumentError
from ..ops.arrays import array_module
from .clipping import multiply
from .scaler import DynamicLossScaler

NONFINITE_MODES = ("raise", "warn", "skip")


def count_nonfinite(a):
    """How many NaN and +-inf ``a`` holds (an int)."""
    xp = array_module(a)
    return int(a.size - xp.count_nonzero(xp.isfinite(a)))


def all_finite(a):
    """Whether ``a`` holds neither NaN nor inf."""
    xp = array_module(a)
    return bool(xp.isfinite(a).all())


def check_nonfinite(nonfinite, loss_scaler, rank):
    """ArgumentError unless ``nonfinite`` is None or one of
    :data:`NONFINITE_MODES`, ``loss_scaler`` None or a DynamicLossScaler,
    and, with a loss scaler, ``nonfinite`` None or ``"skip"``."""
    if nonfinite is not None and nonfinite not in NONFINITE_MODES:
        raise ArgumentError("rank %d: nonfinite must be None, 'raise', 'warn' or 'skip', "
                            "got %r" % (rank, nonfinite))
    if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
        raise ArgumentError("rank %d: loss_scaler must be a commlib.optim.DynamicLossScaler "
                            "or None, got %r" % (rank, loss_scaler))
    if loss_scaler is not None and nonfinite not in (None, "skip"):
        raise ArgumentError("rank %d: with a loss_scaler a step with NaN or inf gradients "
                            "is skipped; nonfinite must be None or 'skip', got %r"
                            % (rank, nonfinite))


class NonFiniteGuard:
    """The non-finite check of every update.

    Args:
        comm: the communicator.
        meter: the :class:`~commlib.optim.metering.CommMeter` timing the
            all-gathers.
        grads: the gradient arrays as the rule sees them (checked after the
            average, unscaled).
        mode: None (no check), ``"raise"``, ``"warn"`` or ``"skip"``.
        loss_scaler: None or a :class:`~commlib.optim.DynamicLossScaler`.
    """

    def __init__(self, comm, meter, grads, mode, loss_scaler):
        self.comm, self.meter, self.grads = comm, meter, grads
        self.mode, self.loss_scaler = mode, loss_scaler
        self.bad = {}               # i -> non-finite count of grads[i] before the average
        self.skipped = np.zeros((), np.int64)

    def note(self, i, g, strategy):
        """``g`` (``grads[i]``) is final before an average with
        ``strategy``: count its non-finite values (not for a partial
        update, which has no average to check)."""
        if self.mode is not None and not isinstance(strategy, Partial):
            self.bad[i] = count_nonfinite(g)

    def counts(self, averaged):
        """Per rank: the non-finite values of its gradients before the
        average (with ``averaged``, 1 when there were none but the average
        has some, as when the sum overflowed); the same list on every rank
        (one all-gather)."""
        mine = sum(int(c) for c in self.bad.values())
        if averaged and not mine and not all(all_finite(g) for g in self.grads):
            mine = -1
        counts = self.meter.timed(self.comm.all_gather, np.array([mine], np.int64)).reshape(-1)
        overflow = bool((counts < 0).any())
        out = [max(int(c), 0) for c in counts]
        if overflow and not any(out):
            out = [1 if c < 0 else 0 for c in counts]
        return out

    def text(self, found, tail, warn=False):
        """The message naming the ranks of ``found`` (warned with ``warn``)."""
        text = ("rank %d: DistributedOptimizer.step: NaN or inf in the gradients (before the "
                "average: %s)%s" % (self.comm.rank, compression_nonfinite.ranks(found)
                                    or "none; the sum overflowed", tail))
        if warn:
            compression_nonfinite.warn(text)
        return text

    def before_send(self, strategy):
        """``(found, check_average)`` before the average with ``strategy``:
        compressed, the counts are exchanged before any bucket is sent, so
        that a skipped update leaves every bucket's error-feedback residual
        as it was; ``found`` is None unless they hold non-finite values to
        act on, ``check_average`` whether the average is to be checked."""
        found, check_average = None, self.mode is not None
        if strategy is not None and self.mode is not None:
            found = self.counts(averaged=False)
            if any(found) and self.mode == "warn":
                self.text(found, "; sending anyway", warn=True)
                check_average = False           # warned once
            if not any(found) or self.mode == "warn":
                found = None                    # the average is checked too
        return found, check_average

    def proceed(self, found):
        """Non-finite values were found (``found``: counts per rank):
        whether the update goes on (``"warn"``); False when it is skipped
        (counted, the loss scale backs off).

        Raises:
            NonFiniteError: with ``"raise"``.
        """
        if self.mode == "raise":
            raise compression_nonfinite.error(
                self.text(found, "; parameters not updated"), found)
        if self.mode == "skip":
            self.skipped += 1
            if self.loss_scaler is not None:
                self.loss_scaler.update(True)
            return False
        self.text(found, "; applied anyway", warn=True)
        return True

    def unscale(self):
        """Divide the averaged gradients by the loss scale (if any), by its
        inverse in float32 at least (float16's would be 0 beyond a scale of
        2**24)."""
        if self.loss_scaler is not None:
            multiply(self.grads, 1.0 / self.loss_scaler.scale)

    def taken(self):
        """The update was applied: the loss scaler (if any) counts it."""
        if self.loss_scaler is not None:
            self.loss_scaler.update(False)
