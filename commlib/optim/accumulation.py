"""Gradient accumulation of a DistributedOptimizer (``accumulate=N`` and
``no_sync()``): which micro-batch ends an update, the running sums of the
micro-batches before it, the gradients marked ready in this micro-batch,
and gradients handed to ``step()``."""
import contextlib

import numpy as np

from .. import interop
from ..collective import validation
from ..collective.bucketing import flat_arrays
from ..errors import ArgumentError
from ..ops.arrays import array_module, is_cupy


def zeros_like(params):
    """Zero-filled arrays of the shapes and dtypes of ``params``: for each
    dtype, consecutive views of one buffer (:func:`~commlib.flat_arrays`),
    so the all-reduce fuses them without copies."""
    xp = array_module(params[0])
    groups = {}
    for i, p in enumerate(params):
        groups.setdefault(p.dtype, []).append(i)
    out = [None] * len(params)

    def allocate():
        for dtype, indices in groups.items():
            views = flat_arrays([params[i].shape for i in indices], dtype=dtype, xp=xp)
            for i, view in zip(indices, views):
                out[i] = view

    if is_cupy(params[0]):
        with params[0].device:
            allocate()
    else:
        allocate()
    return out


def check_accumulate(accumulate, rank):
    """ArgumentError unless ``accumulate`` is an int >= 1."""
    if (isinstance(accumulate, (bool, np.bool_))
            or not isinstance(accumulate, (int, np.integer)) or accumulate < 1):
        raise ArgumentError("rank %d: accumulate must be an int >= 1, got %r"
                            % (rank, accumulate))


class Accumulation:
    """Micro-batches towards the next update.

    Args:
        params: the parameters (shapes, dtypes).
        grads: the gradient arrays the backward pass writes into.
        accumulate: micro-batches per update.
        rank: this rank, for error messages.
    """

    def __init__(self, params, grads, accumulate, rank):
        self.params, self.grads, self.accumulate, self.rank = params, grads, accumulate, rank
        self.sums = None            # running sums of the micro-batches (allocated at need)
        self.micro = 0              # micro-batches accumulated towards this update
        self.marked = set()         # gradients marked ready in this micro-batch
        self.local = False          # inside no_sync(): accumulate, do not average
        self.decided = None         # last(), as decided at this micro-batch's first grad_ready

    def last(self):
        """Whether this micro-batch ends an update: decided when its first
        gradient is marked ready (the backward pass), else at its step."""
        return self.decided if self.decided is not None else self.undecided_last()

    def undecided_last(self):
        """Whether a micro-batch that nothing decided yet would end an update."""
        return not self.local and self.micro >= self.accumulate - 1

    @contextlib.contextmanager
    def no_sync(self, owner):
        """Context (yielding ``owner``) in which no micro-batch ends an
        update.

        Raises:
            ArgumentError: on entering, after ``grad_ready`` marked gradients
                of a micro-batch that ends an update (their all-reduce may
                have started); on leaving, after ``grad_ready`` inside it
                marked gradients of a micro-batch whose step has not come
                and that would end an update outside it (that micro-batch
                still only accumulates).
        """
        if self.marked and self.last():
            raise ArgumentError(
                "rank %d: no_sync(): entered after grad_ready() marked gradients of a "
                "micro-batch that ends an update (their all-reduce may have started); as "
                "DDP's no_sync() wraps the backward pass, enter it before the backward pass "
                "(or call step() first)" % self.rank)
        before, self.local = self.local, True
        try:
            yield owner
        finally:
            self.local = before
        if self.marked and not self.last() and self.undecided_last():
            raise ArgumentError(
                "rank %d: no_sync(): left after grad_ready() inside it marked gradients of a "
                "micro-batch whose step() has not come; call step() inside the block (that "
                "micro-batch only accumulates, as no_sync() decided at its backward pass)"
                % self.rank)

    def mark(self, i):
        """``grads[i]`` marked ready: ``i`` as an int (the first of a
        micro-batch decides whether it ends an update).

        Raises:
            ArgumentError: ``i`` out of range or marked twice.
        """
        if (isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer))
                or not 0 <= i < len(self.params)):
            raise ArgumentError("rank %d: grad_ready: i must be an int in [0, %d), got %r"
                                % (self.rank, len(self.params), i))
        i = int(i)
        if i in self.marked:
            raise ArgumentError("rank %d: grad_ready(%d) was already called in this "
                                "micro-batch" % (self.rank, i))
        if not self.marked:
            self.decided = self.undecided_last()
        self.marked.add(i)
        return i

    def prepare(self, i):
        """grads[i] is final for this micro-batch: add it to the sums, or on
        the last micro-batch make it the mean of the micro-batches.

        Returns:
            True when grads[i] now holds the update's mean.
        """
        g = self.grads[i]
        if not self.last():
            if self.sums is None:
                self.sums = zeros_like(self.params)
            total = self.sums[i]
            if self.micro == 0:
                total[...] = g
            else:
                total += g
            return False
        if self.micro:
            g += self.sums[i]
            g /= self.micro + 1
        return True

    def end_micro_batch(self):
        """After every gradient was prepared: True when this micro-batch
        ends an update (the count starts again), else False (counted)."""
        last = self.last()
        self.marked.clear()
        self.decided = None
        if not last:
            self.micro += 1
            return False
        self.micro = 0
        return True

    def take(self, grads):
        """Check ``grads`` against ``params`` and copy them into
        :attr:`grads`."""
        rank = self.rank
        if self.marked:
            raise ArgumentError("rank %d: grads: given to a step whose opt.grads were marked "
                                "ready with grad_ready(); use one or the other" % rank)
        if not isinstance(grads, (list, tuple)) or len(grads) != len(self.params):
            raise ArgumentError("rank %d: grads must be a list of %d arrays (one per "
                                "parameter), got %s" % (rank, len(self.params), (
                                    "%d" % len(grads)) if isinstance(grads, (list, tuple))
                                    else type(grads).__name__))
        grads = interop.native_list(list(grads), rank=rank, what="grads")
        validation.check_arrays(grads, rank=rank, writeable=False, what="grads")
        for i, (g, p) in enumerate(zip(grads, self.params)):
            if g.shape != p.shape or g.dtype != p.dtype or is_cupy(g) != is_cupy(p):
                raise ArgumentError(
                    "rank %d: grads[%d] is a %s of shape %s and dtype %s, but params[%d] is a "
                    "%s of shape %s and dtype %s" % (
                        rank, i, type(g).__name__, g.shape, g.dtype, i, type(p).__name__,
                        p.shape, p.dtype))
        for mine, g in zip(self.grads, grads):
            if mine is not g:
                mine[...] = g

    def check_between_updates(self):
        """ArgumentError (for ``state_dict()``) in the middle of an update."""
        if self.micro or self.marked:
            raise ArgumentError("rank %d: state_dict() in the middle of an update (after %d "
                                "of %d micro-batches); call it after a step that returned "
                                "True" % (self.rank, self.micro, self.accumulate))
