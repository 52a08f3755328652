"""The interface of a compression strategy."""


class Compression:
    """How a bucket of arrays is all-reduced in compressed form.

    A strategy holds only its settings; what it keeps between calls (wire
    buffers, error-feedback residuals) lives in the ``workspace`` dict the
    communicator hands it: one per strategy, bucket layout (the shapes and
    dtypes of the list, see :class:`~commlib.bucketing.BucketPlan`) and
    bucket, kept for the communicator's lifetime. Two lists of identical
    shapes reduced with the same strategy object therefore share state;
    use one strategy object per model.
    """

    #: short name, part of the consistency check's fingerprint
    name = "?"

    def applies_to(self, dtype):
        """Whether arrays of numpy/cupy ``dtype`` are compressed."""
        raise NotImplementedError

    def check(self, op, rank):
        """Raise :class:`~commlib.errors.ArgumentError` (naming ``rank``)
        when this strategy cannot serve ``op``; runs before any
        communication."""

    def reduce(self, transport, arrays, op, scale, wait, workspace):
        """All-reduce ``arrays`` (numpy or cupy arrays of one dtype this
        strategy applies to; one bucket) in place over ``transport`` with
        ``op`` (``"sum"``, ``"max"``, ``"min"``, ``"prod"``; averaging is
        ``"sum"`` with ``scale`` = 1/size), then multiply by ``scale``
        (float, or None). ``wait``: the collective's :class:`~commlib.waiting.Wait`
        (deadline and peers), handed on to every transport call.
        ``workspace``: this bucket's dict, kept between calls."""
        raise NotImplementedError

    def __repr__(self):
        return self.name
