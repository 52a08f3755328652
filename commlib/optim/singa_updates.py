"""SINGA's ``DistOpt`` update variants of a DistributedOptimizer
(``backward_and_update``, ``_half``, ``_partial_update``,
``_sparse_update``): each is one step with a strategy of its own."""
from .. import compression as compression_module
from ..compression import Partial, Threshold, TopK


class SingaUpdates:
    """The update variants; the optimizer's methods of the same names call
    these. Each is collective: it may also raise the errors of the
    communicator's collectives (see
    :class:`~commlib.optim.DistributedOptimizer`).

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
            grads: as :meth:`step`'s (None: the backward pass wrote into
                ``grads``).

        Returns:
            As :meth:`step`: True when an update was applied.

        Raises:
            ArgumentError: as :meth:`step`'s.
            ArrayTypeError: as :meth:`step`'s.
            NonFiniteError: as :meth:`step`'s.
        """
        return self.training.step(grads, self.compression, self.clip_norm)

    def update_half(self, grads=None):
        """SINGA's ``backward_and_update_half``: the gradients are averaged in
        float16 (``compression="fp16"``), clipped to the constructor's
        clip_norm.

        Args:
            grads: as :meth:`step`'s.

        Returns:
            As :meth:`step`.

        Raises:
            ArgumentError: as :meth:`step`'s; also after :meth:`grad_ready`
                started this update's all-reduce with another compression.
            ArrayTypeError: as :meth:`step`'s.
            NonFiniteError: as :meth:`step`'s; fp16's own check raises on
                NaN or inf unless ``nonfinite="skip"``.
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
        evaluating or saving. Partial updates cannot be clipped by a global
        norm (each rank applies its own gradients): with a clip_norm set in
        the constructor it raises, as :meth:`step` with a Partial
        compression does; the ``nonfinite`` check is not made.

        Args:
            grads: as :meth:`step`'s.
            fraction: the share of each bucket averaged per call, a number in
                (0, 1]; None: the constructor's Partial's, else 0.1.

        Returns:
            As :meth:`step` (True on the last micro-batch of an update).

        Raises:
            ArgumentError: a bad fraction; bad ``grads`` (as :meth:`step`'s);
                a clip_norm set in the constructor; inside :meth:`join`; after :meth:`grad_ready` started this
                update's all-reduce with another compression.
            ArrayTypeError: as :meth:`step`'s.
        """
        if fraction is None:
            strategy = (self.compression if isinstance(self.compression, Partial)
                        else Partial(0.1))
        else:
            strategy = Partial(fraction)
        return self.training.step(grads, strategy, self.clip_norm)

    def update_sparse(self, grads, spars, topK=True, corr=True):
        """SINGA's ``backward_and_sparse_update``: with ``topK`` the
        ``spars`` fraction of largest-magnitude gradients of each bucket
        travel (:class:`~commlib.compression.TopK`), else those with
        magnitude above ``spars`` (:class:`~commlib.compression.Threshold`);
        ``corr``: error feedback (what was not sent is added to the next
        step's gradients).

        Args:
            grads: as :meth:`step`'s.
            spars: the fraction (top-K; in (0, 1]) or the threshold (a finite
                number >= 0).
            topK: top-K (True) or threshold (False).
            corr: error feedback.

        Returns:
            As :meth:`step`.

        Raises:
            ArgumentError: a bad ``spars``; bad ``grads`` (as :meth:`step`'s);
                inside :meth:`join`; after :meth:`grad_ready` started this
                update's all-reduce with another compression.
            ArrayTypeError: as :meth:`step`'s.
            NonFiniteError: as :meth:`step`'s; the sparsifier's own check
                raises on NaN or inf unless ``nonfinite="skip"``.
        """
        kind = TopK if topK else Threshold
        return self.training.step(grads, kind(spars, error_feedback=corr), self.clip_norm)
