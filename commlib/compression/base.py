"""The interface of a compression strategy: :class:`Compression`, and the
:class:`Bucket` it is handed.

A strategy is a small object of settings with one method that does the
work, ``reduce(bucket)``: it receives one bucket of arrays (float32 arrays
of one call, fused by the communicator), the operation, the scale of an
average and a dict of its own state for that bucket, and communicates
through the bucket's three methods (``all_reduce``, ``all_gather``,
``all_gatherv``), which carry the call's deadline and watch for peers that
leave, exactly like every other collective. It must leave the reduced,
scaled result in ``bucket.arrays``, the same on every rank, and raise
before writing anything if it fails (a :class:`~commlib.errors.CommlibError`
raised alike on every rank keeps the communicator usable). This is the
counterpart of PyTorch DDP's communication hook, ``hook(state, bucket)``,
with the state in ``bucket.state``; a strategy written by a user is one
small file (``tests/compression/user_compression.py`` is one).
"""


class Bucket:
    """One bucket of a compressed all-reduce, as a strategy sees it.

    Attributes:
        arrays: the bucket's arrays (numpy or cupy, one dtype the strategy
            applies to), reduced in place.
        op: ``"sum"``, ``"max"``, ``"min"`` or ``"prod"`` (an average is
            ``"sum"`` with ``scale``).
        scale: float to multiply the result by (``1 / size`` when
            averaging), or None.
        state: this bucket's dict, kept between calls: per strategy settings
            (its ``name``), list layout and bucket, for the communicator's
            lifetime (or a :class:`~commlib.ReduceState`'s).
        rank, size: this rank and the number of ranks.
    """

    __slots__ = ("arrays", "op", "scale", "state", "rank", "size", "_transport", "_wait")

    def __init__(self, transport, arrays, op, scale, wait, state):
        self.arrays, self.op, self.scale, self.state = arrays, op, scale, state
        self.rank, self.size = transport.rank, transport.size
        self._transport, self._wait = transport, wait

    def all_reduce(self, buf, op=None, fmt=None, owned=False):
        """Reduce the contiguous array ``buf`` over every rank, in place,
        with ``op`` (default the bucket's). ``fmt``: ``"bfloat16"`` for
        uint16 buffers holding bfloat16 bits (``"float16"`` for float16 ones
        may pick a faster operator). ``owned``: ``buf`` is the strategy's
        own buffer, which the transport may write into directly (else it
        stages the result, so that a failure never leaves half a result in
        memory the user sees)."""
        self._transport.all_reduce(buf, op or self.op, self._wait, fmt=fmt, owned=owned)

    def all_gather(self, send, out):
        """Every rank's ``send`` (contiguous, one length on every rank),
        back to back in rank order, into ``out`` (``size * send.size``)."""
        self._transport.all_gather(send, out, self._wait)

    def all_gatherv(self, send, out, counts):
        """Every rank's ``send``, whose lengths are ``counts`` (a list of ints,
        known on every rank), back to back in rank order, into ``out``."""
        self._transport.all_gatherv(send, out, counts, self._wait)


class Compression:
    """How a bucket of arrays is all-reduced in compressed form.

    A strategy holds only its settings; what it keeps between calls (wire
    buffers, error-feedback residuals) lives in ``bucket.state``: one dict
    per strategy settings (``name``), list layout (the shapes and dtypes of
    the list, see :class:`~commlib.collective.bucketing.BucketPlan`) and bucket. Two
    lists of identical shapes reduced with the same settings therefore
    share it, unless the calls pass their own :class:`~commlib.ReduceState`.
    """

    #: short name, the same on every rank: part of the consistency check's
    #: fingerprint and of the state's key, so it must spell every setting
    name = "?"

    def applies_to(self, dtype):
        """Whether arrays of numpy/cupy ``dtype`` are compressed (the others
        of the call are reduced as usual)."""
        raise NotImplementedError

    def check(self, op, rank):
        """Raise :class:`~commlib.errors.ArgumentError` (naming ``rank``)
        when this strategy cannot serve ``op``; runs before any
        communication."""

    def reduce(self, bucket):
        """All-reduce ``bucket.arrays`` in place with ``bucket.op``, then
        multiply by ``bucket.scale`` (when not None), communicating only
        through the :class:`Bucket`'s methods."""
        raise NotImplementedError

    def __repr__(self):
        return self.name
