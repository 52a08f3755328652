"""The interface of a compression strategy."""


class Compression:
    """How a bucket of arrays is all-reduced in compressed form.

    A strategy is stateless; what it keeps between calls (wire buffers,
    error-feedback residuals) lives in the ``workspace`` dict the
    communicator hands it, one per bucket of one list of arrays, so it
    follows the arrays' lifetime.
    """

    #: short name, part of the consistency check's fingerprint
    name = "?"

    def applies_to(self, dtype):
        """Whether arrays of numpy/cupy ``dtype`` are compressed."""
        raise NotImplementedError

    def reduce(self, transport, arrays, op, scale, workspace, deadline=None):
        """All-reduce ``arrays`` (numpy or cupy arrays of one dtype this
        strategy applies to; one bucket) in place over ``transport`` with
        ``op`` (``"sum"``, ``"max"``, ``"min"``, ``"prod"``), then multiply
        by ``scale`` (float, or None). ``deadline``: ``time.monotonic()``
        value or None."""
        raise NotImplementedError
