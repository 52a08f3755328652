"""What the sparsifying strategies (top-K, threshold) share: their base
class, which exchanges (index, value) sets and sums them."""
import functools

import numpy as np

from ..errors import ArgumentError
from ..ops import hostselect
from ..ops.arrays import array_module
from . import _payload, _sparse_gpu
from . import nonfinite as _nonfinite
from ._flat import accumulators, copy_in, describe, flat_of, identity, plan_of, scatter
from .base import Completion, Compression


class Sparsifier(Compression):
    """A strategy that sends (index, value) pairs of float32 buckets and sums
    them (``sum`` and ``avg`` only), with optional error feedback.

    Per call and bucket of ``n`` values, each rank forms ``acc`` = its
    residual + the bucket (the bucket alone without error feedback), sets
    acc's NaN and +-inf entries to 0 and counts them (a finite sum that
    overflows counts too), and sends ``select(acc)`` with that count. The
    ranks' records are all-gathered and validated (:mod:`._payload`), then
    summed rank by rank in rank order (so every rank computes the same bits)
    into the bucket, times ``scale`` if given; the new residual is ``acc``
    less what was sent. ``nonfinite`` (:mod:`.nonfinite`): with
    ``"raise"``, a non-zero count on any rank raises NonFiniteError on every
    rank; with ``"warn"`` the dropped entries are not sent, their residual
    is 0, and every rank warns. On any error nothing is written: the arrays
    and residuals stay as they were.

    Subclasses set ``error_feedback``, ``nonfinite`` and ``name``, and define
    :meth:`select` and, when every rank sends as many entries,
    :meth:`count_for`. The base class's constructor takes no arguments.
    """

    error_feedback = True
    nonfinite = "raise"

    def applies_to(self, dtype):
        """Whether arrays of ``dtype`` are compressed.

        Args:
            dtype: a numpy/cupy dtype.

        Returns:
            True for float32 only.
        """
        return dtype == np.float32

    def check(self, op, rank):
        """Refuse every op but a sum (an average is a sum with a scale).

        Args:
            op: the call's operation.
            rank: this rank, named in the message.

        Raises:
            ArgumentError: ``op`` is not ``"sum"`` or ``"avg"`` (before any
                communication).
        """
        if op not in ("sum", "avg"):
            raise ArgumentError("rank %d: compression %s sums; op=%r is not supported "
                                "(use 'sum' or 'avg')" % (rank, self.name, op))

    def count_for(self, size):
        """How many entries every rank sends from a bucket.

        Args:
            size: the bucket's number of values.

        Returns:
            The number of entries every rank sends from a bucket of ``size``
            values (one all-gather), or None when it varies by rank (the
            default: headers, then the entries by count, all-gather-v).
        """
        return None

    def select(self, acc):
        """The entries this rank sends.

        Args:
            acc: 1-D float32 (numpy or cupy, finite); not to be modified.

        Returns:
            ``(indices, values)``: int32 indices in ``[0, len(acc))`` (or the
            padding -1 with value 0), unique, preferably ascending (else the
            duplicate check sorts), and float32 values of the same length,
            1-D arrays of ``acc``'s kind. The selection is not trusted: a
            malformed one (another kind, dtype or length, an index out of
            range or repeated, a non-finite value) raises PayloadError on
            every rank in :meth:`reduce`.

        Raises:
            NotImplementedError: in the base class; every subclass defines it.
        """
        raise NotImplementedError

    def accumulate_and_select(self, residual, flat, acc):
        """numpy buckets: accumulate into ``acc``, drop non-finite values, select.

        ``acc = residual + flat`` (``flat`` alone when ``residual`` is None)
        with its NaN and +-inf set to 0, then :meth:`select`. A subclass may
        fuse the two.

        Args:
            residual: 1-D float32 numpy array, the error-feedback residual,
                or None without error feedback.
            flat: 1-D float32 numpy array, the bucket's values.
            acc: 1-D float32 numpy array of the same length, written.

        Returns:
            ``(non-finite count, indices, values)``: how many NaN and +-inf
            ``acc`` held (an int), then :meth:`select`'s ``(indices,
            values)``.
        """
        nonfinite = hostselect.accumulate_finite(residual, flat, acc)
        return (nonfinite,) + tuple(self.select(acc))

    def reduce(self, bucket):
        """Sum every rank's selection into the bucket (see the class docstring).

        On any error nothing is written: the arrays and residuals stay as
        they were. With ``nonfinite="warn"`` the dropped entries are not
        sent, their residual is 0, and every rank emits a
        ``RuntimeWarning``.

        Args:
            bucket: the :class:`~commlib.compression.base.Bucket` (float32
                arrays, op ``"sum"``), reduced in place, times ``scale`` if
                given; its ``state`` keeps the residual between calls.

        Returns:
            None for numpy arrays (the bucket is done). For cupy arrays the
            bucket's :class:`~commlib.compression.base.Completion`: the
            selection, the all-gather of the records (of their headers
            when counts vary) and the entries' check are queued, and the
            completion, given the headers and the check on the host (read
            with the call's other reads), validates them, sums the entries
            into the arrays and updates the residual (see
            :meth:`~commlib.compression.base.Compression.reduce`); the
            errors below may come from either.

        Raises:
            NonFiniteError: with ``nonfinite="raise"``, on every rank, when
                any rank's ``acc`` held NaN or +-inf (before the entries
                travel); ``counts``: per rank, how many.
            PayloadError: on every rank, naming the senders, when a rank's
                selection or record is malformed (see
                :mod:`commlib.compression._payload`).
            CollectiveTimeoutError, PeerError, TransportError, ClosedError:
                from the bucket's communication.
        """
        arrays, workspace = bucket.arrays, bucket.state
        at, size = identity(arrays, workspace)     # addresses: the graphs' keys
        flat = flat_of(arrays, workspace, size)
        xp, n = array_module(flat), flat.size
        acc, residual = accumulators(workspace, xp, n, self.error_feedback)
        slots = self.count_for(n)
        if xp is np:                         # compiled passes
            copy_in(arrays, flat)
            nonfinite, indices, values = self.accumulate_and_select(residual, flat, acc)
            record = _payload.encode(xp, indices, values, nonfinite, slots)
        else:
            record, indices, values = _sparse_gpu.encode(self, arrays, at, residual, flat, acc,
                                                         slots, workspace)
        exchange = _payload.send(bucket, record, slots, n)
        finish = functools.partial(
            self._complete, bucket, flat=flat, acc=acc, residual=residual, sent=(indices, values),
            record=record, exchange=exchange, slots=slots, at=at)
        if xp is np:
            finish(exchange.reads)
            return None
        # the rest needs the headers on the host: read with the call's other
        # reads once its later buckets are queued (see Compression.reduce)
        return Completion((exchange.reads,), finish)

    def reduce_all(self, buckets, state):
        """cupy buckets whose every rank sends a fixed count (:meth:`count_for`):
        every bucket of the call reduced together (see
        :meth:`~commlib.compression.base.Compression.reduce_all`), with
        the results, errors and residuals of :meth:`reduce` bucket by
        bucket. Their records lie back to back in one buffer and travel in
        one all-gather; the selections of every bucket are one launch
        sequence, the entries' checks another and the sums a third, each
        replayed as a CUDA graph once it repeats (the selections and sums
        only when the strategy :meth:`select_into` the records); the
        headers and checks of every bucket come to the host in one read
        and are judged at once, bucket by bucket only when one of them
        fails.

        numpy buckets, and counts that vary by rank, are reduced one by one
        (:meth:`reduce`). ``state`` keeps the plan of a list of arrays
        (:class:`._sparse_gpu.Together`, see :func:`._flat.plan_of`).
        """
        if array_module(buckets[0].arrays[0]) is np:
            return super().reduce_all(buckets, state)
        plan = plan_of(buckets, state, functools.partial(_sparse_gpu.Together.make, self))
        if plan is None:
            return super().reduce_all(buckets, state)
        call = plan.select(self, buckets)
        buckets[0].all_gather(plan.records, plan.gathered)
        plan.split()
        finish = functools.partial(self._finish_together, plan, buckets, call)
        return [Completion((plan.reads,), finish)] + [None] * (len(buckets) - 1)

    def _finish_together(self, plan, buckets, call, host):
        """The end of :meth:`reduce_all` (``call``: what
        :meth:`._sparse_gpu.Together.select` returned), ``host`` being the host copy of
        the plan's reads: with every header and entries' check as they must
        be, the sums of every bucket (:func:`._sparse_gpu.sum_launches`) and the
        residuals' swap; else each bucket finished in turn by
        :meth:`_complete`, which raises for the first bad one (the buckets
        before it are written, as when they are reduced one by one)."""
        if plan.as_expected(host):
            plan.sum(self, buckets, call)
            return
        # the sums run directly: the buckets' own graphs of reduce hold
        # other buffers than the plan's
        flats, sent, (pairs, _) = call
        for part, bucket, flat, own, (acc, residual) in zip(plan.parts, buckets, flats, sent,
                                                            pairs):
            self._complete(bucket, host[part.reads_at:part.reads_at + part.reads.size],
                           flat=flat, acc=acc, residual=residual, sent=own,
                           record=part.record, exchange=part.exchange, slots=part.slots,
                           at=part.at, replay=False)

    def _complete(self, bucket, host, *, flat, acc, residual, sent, record, exchange, slots,
                  at, replay=True):
        """The second half of :meth:`reduce`, ``host`` being the host copy
        of ``exchange.reads``: validate the gathered records
        (:func:`._payload.receive`), sum them into ``flat`` and the arrays,
        and take what was ``sent`` (this rank's indices and values) off the
        residual."""
        arrays, workspace, n = bucket.arrays, bucket.state, flat.size
        context = "rank %d: compression %s" % (bucket.rank, self.name)
        where = describe(n, len(arrays))
        dropped = []

        def on_headers(counts):
            if any(counts) and self.nonfinite == "raise":
                raise _nonfinite.error(
                    "%s: NaN or inf in the gradient%s of %s, in %s; nothing was written: "
                    "arrays and residuals are unchanged"
                    % (context, " + residual" if residual is not None else "",
                       _nonfinite.ranks(counts), where), counts)
            dropped[:] = counts

        all_indices, all_values, counts = _payload.receive(
            bucket, record, exchange, host, slots, n, context,
            "in %s; nothing was written: arrays and residuals are unchanged" % where,
            on_headers)
        if array_module(flat) is np:
            hostselect.sparse_sum(flat, all_indices, all_values, bucket.scale, counts)
            if residual is not None:    # what was sent is no longer owed
                hostselect.scatter_add(acc, *sent, alpha=-1.0)
            scatter(flat, arrays)
        else:
            _sparse_gpu.finish(bucket, at, flat, all_indices, all_values, counts, acc,
                               residual, sent, fixed=replay and slots is not None
                               and workspace["selects into"])
        if residual is not None:
            workspace["residual"], workspace["acc"] = acc, residual
        if any(dropped):
            _nonfinite.warn("%s: dropped NaN and inf of %s, in %s: not sent%s"
                            % (context, _nonfinite.ranks(dropped), where,
                               ", residual set to 0" if residual is not None else ""))

    def select_into(self, acc, indices, values):
        """Optionally, write the selection into the given arrays instead of
        returning new ones (cupy buckets whose count every rank sends, see
        :meth:`count_for`): saves copying it into the record that travels.

        Args:
            acc: as for :meth:`select`.
            indices, values: int32 and float32 arrays of ``count_for(len(acc))``
                elements, of ``acc``'s kind: parts of this rank's record.

        Returns:
            True when written (exactly as :meth:`select` would have
            returned them), False to have :meth:`select` called instead
            (the default). The same answer at every call of a bucket: its
            launches are replayed as a CUDA graph without calling it.
        """
        return False
