"""State that a caller owns for its all-reduces, as PyTorch DDP's hook
state: the list's fusion plan and the compression state of each of its
buckets (error-feedback residuals, partial-synchronisation windows).

Without a state, a communicator keeps one table of compression state per
list layout (the shapes and dtypes of the arrays), so two lists of the same
layout, e.g. two models of one architecture on one communicator, would
share residuals. ``comm.all_reduce(grads, compression=TopK(0.01),
state=ReduceState("model A"))`` keeps them apart; the state lives as long
as the caller keeps the object. :class:`commlib.BackwardReducer` gives each
of its buckets one.
"""
from .bucketing import FusionCache
from ..errors import ArgumentError


class ReduceState:
    """The fusion plan and compression state of one caller's all-reduces.

    Args:
        name: a text naming the state, the same on every rank (the
            consistency check compares it between ranks).
        lists: how many distinct lists of arrays the state remembers the
            plans of (the least recently used is forgotten).

    Raises:
        ArgumentError: ``name`` is not a non-empty str, or ``lists`` is not
            a positive int.
    """

    def __init__(self, name, lists=1):
        if not isinstance(name, str) or not name:
            raise ArgumentError("ReduceState: name must be a non-empty str, got %r" % (name,))
        if isinstance(lists, bool) or not isinstance(lists, int) or lists < 1:
            raise ArgumentError("ReduceState: lists must be a positive int, got %r" % (lists,))
        self.name = name
        #: the plans of the lists reduced with this state
        self.fusion = FusionCache(max_entries=lists)
        #: list layout key -> {(strategy name, bucket): the strategy's workspace}
        self.workspaces = {}

    def clear(self):
        """Forget the plans and every compression state (residuals restart at 0).

        The next all-reduce with this state plans its list again, and every
        strategy starts from an empty state dict (partial windows from the
        first, error-feedback residuals at 0).
        """
        self.fusion.clear()
        self.workspaces.clear()

    def __repr__(self):
        return "ReduceState(%r)" % self.name
