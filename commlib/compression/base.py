"""The interface of a compression strategy: :class:`Compression`, and the
:class:`Bucket` it is handed.

The communicator hands a strategy every bucket of a call that it applies
to at once: :meth:`Compression.reduce_all(buckets, state)
<Compression.reduce_all>`, the counterpart of PyTorch DDP's communication
hook ``hook(state, bucket) -> Future`` for all of a call's buckets, with
states the caller may own (a :class:`~commlib.ReduceState`). It returns
what completes them (DDP's futures: one entry per bucket, None or a
completion, run in bucket order once every unit of the call was issued).

A strategy that works bucket by bucket defines only :meth:`Compression.reduce`:
the base class's ``reduce_all`` calls it for each bucket. A bucket holds
float32 arrays of one call (fused by the communicator), the operation, the
scale of an average and a dict of the strategy's own state for that
bucket; the strategy communicates through the bucket's three methods
(``all_reduce``, ``all_gather``, ``all_gatherv``), which carry the call's
deadline and watch for peers that leave, exactly like every other
collective. It must leave the reduced, scaled result in ``bucket.arrays``,
the same on every rank, and raise before writing anything if it fails (a
:class:`~commlib.errors.CommlibError` raised alike on every rank keeps the
communicator usable). A strategy written by a user is one small file
(``tests/compression/user_compression.py`` is one). A strategy never
decides for another rank: whatever it does must be what every rank does
with the same buckets and settings.
"""
from ..ops.arrays import to_host


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

    The communicator makes the buckets; a strategy only receives them.

    Args:
        transport: the transport carrying the bucket's arrays (gives
            ``rank`` and ``size``).
        arrays: as the attribute.
        op: as the attribute.
        scale: as the attribute.
        wait: the call's :class:`~commlib.core.waiting.Wait` (deadline, and
            the peers to watch), passed to every transport call.
        state: as the attribute.
        stats: the communicator's :class:`~commlib.CommStats`, counting
            the bytes handed to the transport, or None.
    """

    __slots__ = ("arrays", "op", "scale", "state", "rank", "size", "_transport", "_wait",
                 "_stats")

    def __init__(self, transport, arrays, op, scale, wait, state, stats=None):
        self.arrays, self.op, self.scale, self.state = arrays, op, scale, state
        self.rank, self.size = transport.rank, transport.size
        self._transport, self._wait, self._stats = transport, wait, stats

    def _count(self, buf):
        if self._stats is not None:
            self._stats.bytes_sent += buf.nbytes

    def all_reduce(self, buf, op=None, fmt=None, owned=False):
        """Reduce the contiguous array ``buf`` over every rank, in place.

        Args:
            buf: a contiguous numpy or cupy array, the same length on every
                rank.
            op: ``"sum"``, ``"max"``, ``"min"`` or ``"prod"``; default (None)
                the bucket's :attr:`op`.
            fmt: ``"bfloat16"`` for uint16 buffers holding bfloat16 bits;
                None otherwise (the buffer's dtype says what it holds).
            owned: ``buf`` is the strategy's own buffer, which the transport
                may write into directly (else it stages the result, so that
                a failure never leaves half a result in memory the user
                sees).

        Raises:
            CollectiveTimeoutError: the call's deadline passed first.
            PeerError: a peer left (closed, exited, died or gave up).
            TransportError: the MPI or NCCL library reported an error.
            ClosedError: the transport was left unusable by an earlier
                failure.
        """
        self._count(buf)
        self._transport.all_reduce(buf, op or self.op, self._wait, fmt=fmt, owned=owned)

    def casts(self):
        """Whether the bucket's transport casts its float32 arrays into and
        out of a half-format wire of its own (:meth:`all_reduce_cast`); the
        same answer on every rank for the same arrays' shapes."""
        return self._transport.casts(self.arrays)

    def all_reduce_cast(self, fmt, guarded):
        """All-reduce the bucket's float32 arrays in place through a wire of
        the half format ``fmt`` (``"float16"``/``"bfloat16"``) that the
        transport casts into and out of itself, where :meth:`casts` says so
        (see :meth:`commlib.transport.base.Transport.all_reduce_cast`): the
        arrays times :attr:`scale` rounded to ``fmt``, reduced there with
        :attr:`op`, cast back unless ``guarded`` and the result holds NaN
        or inf.

        Returns:
            ``(sent, found)``: the NaN and inf this rank sent and those in
            the result.

        Raises:
            As :meth:`all_reduce`.
        """
        arrays = self.arrays
        if self._stats is not None:
            self._stats.bytes_sent += 2 * sum(a.size for a in arrays)
        return self._transport.all_reduce_cast(arrays, fmt, self.op, self.scale, guarded,
                                               self._wait)

    def all_gather(self, send, out):
        """Gather every rank's ``send`` into ``out``, back to back in rank order.

        Args:
            send: a contiguous array, of one length on every rank.
            out: a contiguous array of ``size * send.size`` elements, written
                with rank r's ``send`` at ``[r * send.size, (r + 1) *
                send.size)``.

        Raises:
            CollectiveTimeoutError: the call's deadline passed first.
            PeerError: a peer left (closed, exited, died or gave up).
            TransportError: the MPI or NCCL library reported an error.
            ClosedError: the transport was left unusable by an earlier
                failure.
        """
        self._count(send)
        self._transport.all_gather(send, out, self._wait)

    def all_gatherv(self, send, out, counts):
        """Gather every rank's ``send``, of lengths that differ, into ``out``.

        Args:
            send: a contiguous array of ``counts[rank]`` elements.
            out: a contiguous array of ``sum(counts)`` elements, written with
                every rank's ``send`` back to back in rank order.
            counts: a list of ints, every rank's ``send`` length, known (and
                the same) on every rank.

        Raises:
            CollectiveTimeoutError: the call's deadline passed first.
            PeerError: a peer left (closed, exited, died or gave up).
            TransportError: the MPI or NCCL library reported an error.
            ClosedError: the transport was left unusable by an earlier
                failure.
        """
        self._count(send)
        self._transport.all_gatherv(send, out, counts, self._wait)


class Completion:
    """A bucket's completion that needs values computed on the GPU.

    ``reads`` are the integer device arrays (counts, headers, flags) the
    completion needs on the host; ``finish`` is called with their host
    copies, numpy arrays of the same shapes and dtypes, in order. The
    communicator reads the ``reads`` of every completion of a call in one
    transfer (:func:`commlib.ops.arrays.to_host`) once every bucket has been
    issued, then calls the ``finish`` functions in bucket order. With numpy
    arrays ``reads`` are numpy arrays, passed as they are.

    Called with no arguments, a Completion reads its own values and
    finishes: it is a completion like any other callable.

    Args:
        reads: a sequence of integer numpy or cupy arrays.
        finish: a callable taking one host array per entry of ``reads``.
    """

    __slots__ = ("reads", "finish")

    def __init__(self, reads, finish):
        self.reads, self.finish = tuple(reads), finish

    def __call__(self):
        (values,) = to_host([self.reads])
        self.finish(*values)


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
        """Whether arrays of a dtype are compressed.

        Args:
            dtype: a numpy/cupy dtype of the call's arrays.

        Returns:
            True when arrays of ``dtype`` go to :meth:`reduce`; False when
            they are reduced as usual with the call's other arrays.

        Raises:
            NotImplementedError: in the base class; every strategy defines it.
        """
        raise NotImplementedError

    def check(self, op, rank):
        """Refuse an operation this strategy cannot serve.

        Runs before any communication. The base class accepts every op.

        Args:
            op: the call's operation, ``"sum"``, ``"max"``, ``"min"`` or
                ``"prod"`` (an average is ``"sum"`` with a scale).
            rank: this rank, to name in the message.

        Raises:
            ArgumentError: (naming ``rank``) this strategy cannot serve
                ``op``.
        """

    def reduce(self, bucket):
        """All-reduce one bucket in compressed form.

        Reduce ``bucket.arrays`` in place with ``bucket.op``, then multiply
        by ``bucket.scale`` (when not None), communicating only through the
        :class:`Bucket`'s methods. The result must be the same on every
        rank, and nothing may be written before a failure.

        The work may be split in two, like a DDP hook's returned future:
        ``reduce`` queues what it can (on a GPU: kernels and collectives,
        without reading anything back) and returns the bucket's
        completion, which finishes it (reads, checks, writes the arrays):
        a callable of no arguments, or a :class:`Completion` naming the
        device values it needs. The communicator calls the completions of
        a call's buckets in bucket order once every bucket of the call has
        been issued, so a GPU works on later buckets while the host waits
        for an earlier one; the values of every :class:`Completion` of the
        call come to the host first, in one transfer, so that the call
        waits for the GPU once rather than once per bucket. A completion
        may communicate through the bucket, and the same rules hold for
        it: alike on every rank, and nothing written before a failure.

        Args:
            bucket: the :class:`Bucket` to reduce.

        Returns:
            None when the bucket is done, or its completion (a callable of
            no arguments, or a :class:`Completion`; see above).

        Raises:
            NotImplementedError: in the base class; every strategy defines it.
            CommlibError: a strategy's failure, raised alike on every rank
                before anything is written (keeps the communicator usable);
                the :class:`Bucket` methods' errors pass through.
        """
        raise NotImplementedError

    def reduce_all(self, buckets, state):
        """All-reduce every bucket of one call: what the communicator calls.

        The buckets are the call's buckets and in-place arrays that the
        strategy applies to, in order; their communication comes before
        the call's other buckets'. The base class calls :meth:`reduce` for
        each bucket in turn. A strategy may instead issue its work for all
        of them at once (one kernel sequence for every bucket, one
        collective for every bucket's payload), which saves host time per
        bucket; how it communicates must depend only on what every rank has
        alike (the buckets' lengths and kind, the settings), never on this
        rank's history or data, so that every rank communicates alike.

        Args:
            buckets: the list of :class:`Bucket` objects (each with its own
                ``state``, as :meth:`reduce` gets them).
            state: a dict of the strategy's own, kept between calls for
                this list layout (as the buckets' are).

        Returns:
            A list of one entry per bucket, each as :meth:`reduce` returns
            (None, or a completion), run in order once every unit of the
            call is issued (a single completion may finish every bucket).

        Raises:
            As :meth:`reduce`, with nothing written to a bucket that was
            not finished.
        """
        return [self.reduce(bucket) for bucket in buckets]

    def __repr__(self):
        return self.name
