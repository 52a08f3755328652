"""SINGA's ``DistOpt`` update variants of a DistributedOptimizer
(``backward_and_update``, ``_half``, ``_partial_update``,
``_sparse_update``): each is one step with a strategy of its own."""
from .. import compression as compression_module
from ..compression import Partial, Threshold, TopK


class SingaUpdates:
    """The update variants; the optimizer's methods of the same names call
    these.

    Args:
        training: the optimizer's
            :class:`~commlib.optim.training_step.TrainingStep`.
        compression: the constructor's compression (resolved).
        clip_norm: the constructor's clip_norm.
        rank: this rank, for error messages.
    """

    def __init__(self, training, *, compression, clip_norm, rank):
        self.training, self.compression, self.clip_norm, self.rank = \
            training, compression, clip_norm, rank

    def update(self, grads=None):
        """SINGA's ``backward_and_update``: :meth:`step` (the constructor's
        compression and clip_norm).

        Args:
            grads: as :meth:`step`'s.

        Returns:
            As :meth:`step`.
        """
        return self.training.step(grads, self.compression, self.clip_norm)

    def update_half(self, grads=None):
        """SINGA's ``backward_and_update_half``: the gradients are averaged in
        float16 (``compression="fp16"``).

        Args:
            grads: as :meth:`step`'s.

        Returns:
            As :meth:`step`.
        """
        fp16 = compression_module.resolve("fp16", self.rank)
        return self.training.step(grads, fp16, self.clip_norm)

    def update_partial(self, grads=None, fraction=None):
        """SINGA's ``backward_and_partial_update``: each rank updates its
        parameters with its own gradients, then one rotating window of
        ``fraction`` of each parameter bucket is averaged over the ranks
        (:class:`~commlib.compression.Partial`; default: the constructor's
        Partial, else 0.1). Ranks' parameters differ between windows:
        average them all (``comm.all_reduce(params, op="avg")``) before
        evaluating or saving.

        Args:
            grads: as :meth:`step`'s.
            fraction: the share of each bucket averaged per call.

        Returns:
            As :meth:`step`.

        Raises:
            ArgumentError: a bad fraction, or a clip_norm set (partial updates
                cannot be clipped by a global norm).
        """
        if fraction is None:
            strategy = (self.compression if isinstance(self.compression, Partial)
                        else Partial(0.1))
        else:
            strategy = Partial(fraction)
        return self.training.step(grads, strategy)

    def update_sparse(self, grads, spars, topK=True, corr=True):
        """SINGA's ``backward_and_sparse_update``: with ``topK`` the
        ``spars`` fraction of largest-magnitude gradients of each bucket
        travel (:class:`~commlib.compression.TopK`), else those with
        magnitude above ``spars`` (:class:`~commlib.compression.Threshold`);
        ``corr``: error feedback (what was not sent is added to the next
        step's gradients).

        Args:
            grads: as :meth:`step`'s.
            spars: the fraction (top-K) or the threshold.
            topK: top-K (True) or threshold (False).
            corr: error feedback.

        Returns:
            As :meth:`step`.
        """
        kind = TopK if topK else Threshold
        return self.training.step(grads, kind(spars, error_feedback=corr), self.clip_norm)
