"""Gradient hooks of a DistributedOptimizer: functions called with the
averaged (and unscaled) gradients before clipping and the rule."""
from ..errors import ArgumentError


class _Hook:
    """Handle of a gradient hook: :meth:`remove` unregisters it."""

    def __init__(self, hooks, fn):
        self._hooks, self.fn = hooks, fn

    def remove(self):
        """Unregister the hook (once is enough; later calls do nothing)."""
        if self.fn in self._hooks:
            self._hooks.remove(self.fn)


class GradientHooks:
    """The registered hooks, called in the order of registration.

    Args:
        rank: this rank, for error messages.
    """

    def __init__(self, rank):
        self.rank = rank
        self.fns = []

    def register(self, fn):
        """Add ``fn``; returns a handle whose ``remove()`` unregisters it.

        Raises:
            ArgumentError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise ArgumentError("rank %d: register_hook: fn must be callable, got %r"
                                % (self.rank, fn))
        self.fns.append(fn)
        return _Hook(self.fns, fn)

    def run(self, grads):
        """Call every hook with ``grads`` (a hook may remove itself)."""
        for fn in list(self.fns):
            fn(grads)
