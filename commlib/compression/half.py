"""Half-precision all-reduce (SINGA's fused half-precision synchronisation,
Horovod's ``Compression.fp16``, PyTorch DDP's ``fp16_compress_hook`` and
``bf16_compress_hook``).

A bucket of float32 arrays is cast to float16 or bfloat16 into one flat
wire buffer (the batched pack kernel on GPUs; on CPUs each array straight
into its part of it, or many small ones through one flat copy, by the
compiled host cast, ``commlib/ops/hostcast.py``),
all-reduced in that format, and cast back into the arrays: half the bytes on
the wire. When averaging, values are divided by the number of ranks
*before* the cast, so the half-precision sum cannot overflow where the
average does not. The reduction itself runs in the half format (as NCCL's
does), so results carry its rounding (relative error about 2**-11 per
addition for float16, 2**-8 for bfloat16); a float16 value beyond 65504
becomes inf (bfloat16 has float32's range). bfloat16 travels as uint16 bit
patterns. Every transport reduces the wire in its format: NCCL's float16
and bfloat16 types, the shared-memory reducer's and the MPI operators'
compiled loops, which widen to float32 and round back to nearest even
(:mod:`commlib.ops.hostcast`). Other dtypes are not compressed. A call's
buckets travel together, in one wire and one all-reduce
(:meth:`HalfPrecision.reduce_all`), except numpy buckets that the
shared-memory transport casts into and out of its own memory itself, with
no wire of ours (:meth:`~commlib.compression.base.Bucket.all_reduce_cast`:
the same bits, one cast each way and no copy).

``nonfinite`` (see :mod:`.nonfinite`) looks at the reduced half-precision
result, whose bits are the same on every rank, so every rank decides alike:
NaN or inf in it (a rank's NaN or inf, a value beyond float16's range after
the division, or a float16 sum that overflowed) keeps the bucket from being
written back (on a GPU the cast back reads the count itself: no host read)
and raises NonFiniteError on every rank once every bucket of the call is
issued (``"raise"``, the default; the call's finite buckets are written), or
is written and warned about (``"warn"``). Only then do the ranks all-gather how
many non-finite values each sent (counted while casting), for ``counts``
and ``culprits``; none when only the sum overflowed.
"""
import functools

import numpy as np

from ..errors import ArgumentError
from ..ops import pack as _pack
from ..ops import graphs, hostcast
from ..ops.arrays import array_module, zero
from ..ops.cast import cast, storage_dtype
from . import _flat
from . import nonfinite as _nonfinite
from .base import Completion, Compression


class HalfPrecision(Compression):
    """float32 buckets travel as float16 or bfloat16 (see the module docstring).

    The name is ``"fp16"`` / ``"bf16"`` (like the ``compression=`` strings)
    with ``"raise"``, and spells the setting otherwise:
    ``"fp16(nonfinite='warn')"``. It refuses no op (the reduction runs in
    the half format with the call's op); other dtypes than float32 are not
    compressed.

    Args:
        fmt: the wire format, ``"float16"`` or ``"bfloat16"``.
        nonfinite: ``"raise"`` (default) or ``"warn"``: what NaN or inf in
            the reduced result does (see :mod:`.nonfinite`).

    Raises:
        ArgumentError: ``fmt`` is neither ``"float16"`` nor ``"bfloat16"``,
            or ``nonfinite`` is neither ``"raise"`` nor ``"warn"``.
    """

    def __init__(self, fmt, nonfinite="raise"):
        if fmt not in ("float16", "bfloat16"):
            raise ArgumentError("HalfPrecision: fmt must be 'float16' or 'bfloat16', got %r"
                                % (fmt,))
        self.fmt = fmt
        self.nonfinite = _nonfinite.check_mode(nonfinite, type(self).__name__)
        short = {"float16": "fp16", "bfloat16": "bf16"}[fmt]
        self.name = short if nonfinite == "raise" else "%s(nonfinite=%r)" % (short, nonfinite)
        # the wire buffer's dtype, and the format the transport must be told
        # (bfloat16 travels as uint16 bits; float16 says so by its dtype)
        self._storage = storage_dtype(fmt)
        self._wire_fmt = fmt if fmt == "bfloat16" else None

    def applies_to(self, dtype):
        """Whether arrays of ``dtype`` are compressed.

        Args:
            dtype: a numpy/cupy dtype.

        Returns:
            True for float32 only.
        """
        return dtype == np.float32

    def reduce(self, bucket):
        """Cast the bucket to the half format, all-reduce it, cast it back.

        When averaging, the values are multiplied by ``bucket.scale`` before
        the cast. The reduced half-precision result is checked for NaN and
        inf before anything is written back; with ``nonfinite="warn"`` it is
        written as it is and a ``RuntimeWarning`` names the ranks and counts.

        Args:
            bucket: the :class:`~commlib.compression.base.Bucket` (float32
                arrays), reduced in place.

        Returns:
            The bucket's :class:`~commlib.compression.base.Completion`. The
            cast, the all-reduce, the count of NaN and inf and the cast
            back are done (on a GPU: queued, without a host read) before it
            returns, the cast back guarded by the count (with ``"raise"``
            nothing is written when the count is not 0). The completion
            takes the count on the host (with the call's other reads, once
            every bucket of the call is issued, see
            :meth:`~commlib.compression.base.Compression.reduce`) and raises
            or warns.

        Raises:
            NonFiniteError: (from the completion) with ``nonfinite="raise"``,
                on every rank, when the reduced result holds NaN or inf
                (``counts``: the non-finite values each rank sent; none when
                only the sum overflowed); nothing of this bucket was
                written: its arrays are unchanged. The call's other buckets
                whose results are finite have been written.
            CollectiveTimeoutError, PeerError, TransportError, ClosedError:
                from the bucket's communication (see
                :meth:`~commlib.compression.base.Bucket.all_reduce`).
        """
        # a scale comes only with "sum" (averaging): dividing before the cast
        # keeps the half-precision sum from overflowing
        arrays, scale, workspace = bucket.arrays, bucket.scale, bucket.state
        xp = array_module(arrays[0])
        at, size = _flat.identity(arrays, workspace)   # addresses: the graphs' keys
        wire = _flat.buffer(workspace, "wire", xp, size, self._storage)
        guarded = self.nonfinite == "raise"
        if xp is not np:             # one pack / unpack launch, casting on the way
            sent, found = self._reduce_on_device(bucket, at, wire, guarded)
        else:                        # the arrays cast into their parts of the wire and back
            sent = _flat.cast_parts(arrays, wire, workspace,
                                    np.float32(1) if scale is None else np.float32(scale))
            # overflow is counted and reported by _settle, not warned by numpy
            with np.errstate(over="ignore", invalid="ignore"):
                bucket.all_reduce(wire, fmt=self._wire_fmt, owned=True)
            found = np.array(hostcast.count_nonfinite(wire, self.fmt), np.int64)
            if not (found and guarded):
                _flat.cast_parts(arrays, wire, workspace, into_wire=False)
        return Completion((found,), functools.partial(self._settle, bucket, wire.size, sent))

    def _reduce_on_device(self, bucket, at, wire, guarded):
        """cupy buckets: the arrays cast into ``wire`` (one pack launch),
        all-reduced, the NaN and inf of the result counted and the cast
        back guarded by that count when ``guarded`` (nothing waits for the
        host). Returns the 0-d device counts ``(sent, found)``, kept with
        the bucket. The launches before and after the all-reduce are fixed
        per bucket and addresses: replayed as CUDA graphs
        (:mod:`commlib.ops.graphs`) keyed by ``at``, the arrays' addresses
        (:func:`._flat.identity`; the bucket's buffers are made once)."""
        arrays, scale, workspace = bucket.arrays, bucket.scale, bucket.state
        xp = array_module(wire)
        # the counts of NaN and inf sent and found, kept with the bucket
        counts, (sent, found) = _flat.counters(workspace, "nonfinite counts", xp, 2)

        def cast_in():
            zero(counts)
            _pack.pack(arrays, wire, scale=scale, nonfinite=sent)

        def cast_back():
            self._cast_back(arrays, wire, found, guarded)

        store = workspace.setdefault("graphs", {})
        graphs.replay(store, ("cast in", at, None if scale is None else float(scale)), cast_in)
        bucket.all_reduce(wire, fmt=self._wire_fmt, owned=True)
        graphs.replay(store, ("cast back", at, guarded), cast_back)
        return sent, found

    def _cast_back(self, arrays, wire, found, guarded):
        """cupy buckets: NaN and inf in the reduced ``wire`` counted into
        ``found`` on the GPU by one cast of the wire onto itself (bits
        unchanged but for canonical NaNs; not read), then the wire cast
        back into the arrays, unless ``guarded`` and ``found`` is not 0
        (the GPU decides, so nothing waits for the host here)."""
        cast(wire, self.fmt, out=wire, nonfinite=found)
        _pack.unpack(wire, arrays, unless=found if guarded else None)

    def reduce_all(self, buckets, state):
        """Every bucket of the call reduced together (see
        :meth:`~commlib.compression.base.Compression.reduce_all`), with the
        results and errors of :meth:`reduce` bucket by bucket: their wires
        lie back to back in one buffer, all-reduced in one call, and every
        bucket's counts come to the host in one read. numpy: each bucket's
        arrays cast into their part of the wire and back by the compiled
        host cast, or, where the transport casts on the way itself
        (shared memory, :meth:`~commlib.compression.base.Bucket.casts`),
        handed to it without a wire. cupy: the casts in are one launch sequence (one pack
        launch per bucket), the casts back another (guarded per bucket),
        both replayed as CUDA graphs once they repeat. ``state`` keeps the
        plan of a list of arrays (see :func:`._flat.plan_of`): the wire and
        counts and the graphs, none of the arrays."""
        plan = _flat.plan_of(buckets, state, self._plan)
        scale, guarded = buckets[0].scale, self.nonfinite == "raise"
        counts, pairs, wires = plan["counts"], plan["pairs"], plan["wires"]
        if type(counts) is np.ndarray:
            # a transport that casts on the way takes a bucket itself (no
            # wire of ours); the others' wires travel in one all-reduce
            factor, wired = np.float32(1) if scale is None else np.float32(scale), []
            for i, (b, wire) in enumerate(zip(buckets, wires)):
                if wire is None:
                    counts[2 * i:2 * i + 2] = b.all_reduce_cast(self.fmt, guarded)
                else:
                    counts[2 * i] = _flat.cast_parts(b.arrays, wire, b.state, factor)
                    wired.append(i)
            if wired:
                with np.errstate(over="ignore", invalid="ignore"):
                    buckets[0].all_reduce(plan["wire"], fmt=self._wire_fmt, owned=True)
            for i in wired:
                counts[2 * i + 1] = found = hostcast.count_nonfinite(wires[i], self.fmt)
                if not (found and guarded):
                    _flat.cast_parts(buckets[i].arrays, wires[i], buckets[i].state,
                                     into_wire=False)
        else:
            def cast_in():
                zero(counts)
                for b, wire, (sent, _) in zip(buckets, wires, pairs):
                    _pack.pack(b.arrays, wire, scale=scale, nonfinite=sent)

            def cast_back():
                for b, wire, (_, found) in zip(buckets, wires, pairs):
                    self._cast_back(b.arrays, wire, found, guarded)

            graphs.replay(plan["graphs"], ("cast in", None if scale is None else float(scale)),
                          cast_in)
            buckets[0].all_reduce(plan["wire"], fmt=self._wire_fmt, owned=True)
            graphs.replay(plan["graphs"], ("cast back", guarded), cast_back)
        return [Completion((counts,), functools.partial(self._settle_all, plan, buckets))] \
            + [None] * (len(buckets) - 1)

    def _plan(self, buckets):
        """:meth:`reduce_all`'s plan: one wire for the buckets that need one
        of ours (not those a numpy transport casts itself, see
        :meth:`~commlib.compression.base.Bucket.casts`), each such bucket's
        part of it (None for the others), and each bucket's counts of NaN
        and inf sent and found (0-d views of one buffer)."""
        xp = array_module(buckets[0].arrays[0])
        own = [xp is not np or not b.casts() for b in buckets]
        sizes = [_flat.identity(b.arrays, b.state)[1] if mine else 0
                 for b, mine in zip(buckets, own)]
        wire = xp.empty(sum(sizes), self._storage)
        starts = np.concatenate(([0], np.cumsum(sizes))).tolist()
        plan = {"wire": wire, "graphs": {},
                "wires": [wire[a:b] if mine else None
                          for a, b, mine in zip(starts, starts[1:], own)]}
        # plan["counts"]: (sent, found) of bucket i at 2 i and 2 i + 1
        _, parts = _flat.counters(plan, "counts", xp, 2 * len(buckets), zero=True)
        plan["pairs"] = list(zip(parts[0::2], parts[1::2]))
        return plan

    def _settle_all(self, plan, buckets, counts):
        """The end of :meth:`reduce_all`: :meth:`_settle` for each bucket
        whose result held NaN or inf (``counts``: the host copy of the
        plan's counts), in order."""
        found = counts[1::2]
        if not found.any():
            return
        for b, (sent, _), n in zip(buckets, plan["pairs"], found):
            self._settle(b, _flat.identity(b.arrays, b.state)[1], sent, int(n))

    def _settle(self, bucket, size, sent, found):
        """The end of :meth:`reduce`, once ``found``, the number of NaN and
        inf in the reduced result of the bucket's ``size`` values, is on the
        host (the result has been
        written, or, with ``"raise"`` and a count, not). If there are any,
        all-gather every rank's count of non-finite values sent (``sent``:
        int or 0-d device array), then raise NonFiniteError (``"raise"``)
        or warn."""
        total = int(found)
        if not total:
            return
        xp = array_module(bucket.arrays[0])
        counts = xp.empty(bucket.size, dtype=np.int64)
        bucket.all_gather(xp.asarray(sent, dtype=np.int64).reshape(1), counts)
        counts = (counts if xp is np else counts.get()).tolist()
        origin = ("sent by " + _nonfinite.ranks(counts) if any(counts)
                  else "no rank sent any: the %s reduction overflowed" % self.fmt)
        text = ("rank %d: compression %s: the reduced %s result holds %d NaN or inf, in %s; %s"
                % (bucket.rank, self.name, self.fmt, total,
                   _flat.describe(size, len(bucket.arrays)), origin))
        if self.nonfinite == "raise":
            raise _nonfinite.error(text + "; nothing was written: arrays are unchanged", counts)
        _nonfinite.warn(text + "; written as they are")


class FP16(HalfPrecision):
    """float32 buckets travel as float16 (``compression="fp16"``).

    Args:
        nonfinite: ``"raise"`` (default) or ``"warn"``, as
            :class:`HalfPrecision`'s.

    Raises:
        ArgumentError: ``nonfinite`` is neither ``"raise"`` nor ``"warn"``.
    """

    def __init__(self, nonfinite="raise"):
        super().__init__("float16", nonfinite)


class BF16(HalfPrecision):
    """float32 buckets travel as bfloat16 (``compression="bf16"``).

    Args:
        nonfinite: ``"raise"`` (default) or ``"warn"``, as
            :class:`HalfPrecision`'s.

    Raises:
        ArgumentError: ``nonfinite`` is neither ``"raise"`` nor ``"warn"``.
    """

    def __init__(self, nonfinite="raise"):
        super().__init__("bfloat16", nonfinite)
