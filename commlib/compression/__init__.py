"""Compressed all-reduce: how a fused bucket travels between ranks.

``comm.all_reduce(grads, op="avg", compression="fp16")`` (or a
:class:`Compression` instance) hands every bucket of arrays the strategy
applies to (:meth:`Compression.applies_to`) to :meth:`Compression.reduce`
as a :class:`Bucket` (its arrays, op, scale, its own state dict, and the
call's communication) instead of the plain all-reduce; the other arrays of
the call are reduced as usual. A strategy of one's own subclasses
:class:`Compression` (see :mod:`.base`). One small module per strategy:
:mod:`.half` (float16 / bfloat16), :mod:`.topk` and :mod:`.threshold`
(sparsification with error feedback), :mod:`.partial` (partial
synchronisation).

The lossy strategies (half precision, top-K, threshold) take
``nonfinite="raise"`` (default) or ``"warn"``: NaN or inf in a bucket raises
:class:`~commlib.errors.NonFiniteError` on every rank with nothing written,
or is dropped (sparse) / written (half) with a warning (:mod:`.nonfinite`).
The sparse strategies validate every rank's payload before writing and raise
:class:`~commlib.errors.PayloadError` on every rank, naming the sender, when
one is malformed (:mod:`._payload`).
"""
from ..errors import ArgumentError
from .base import Bucket, Completion, Compression
from .half import BF16, FP16, HalfPrecision
from .partial import Partial
from .threshold import Threshold
from .topk import TopK

#: strategies by the names ``compression=`` accepts
BY_NAME = {"fp16": FP16(), "bf16": BF16()}


def resolve(compression, rank):
    """The strategy for a call's ``compression=`` argument.

    Args:
        compression: None, a name of :data:`BY_NAME` (``"fp16"``,
            ``"bf16"``), or a :class:`Compression`.
        rank: this rank, named in the message.

    Returns:
        The :class:`Compression` (a name gives :data:`BY_NAME`'s shared
        instance), or None for no compression.

    Raises:
        ArgumentError: ``compression`` is none of these.
    """
    if compression is None or isinstance(compression, Compression):
        return compression
    found = BY_NAME.get(compression) if isinstance(compression, str) else None
    if found is None:
        raise ArgumentError("rank %d: compression=%r is not supported; expected None, one of "
                            "%s, or a commlib.compression.Compression"
                            % (rank, compression, ", ".join(sorted(BY_NAME))))
    return found


__all__ = ["Bucket", "Completion", "Compression", "HalfPrecision", "FP16", "BF16", "TopK",
           "Threshold", "Partial", "BY_NAME", "resolve"]
