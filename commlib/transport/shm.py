"""The shared-memory transport: all-reduce through memory shared by the
ranks of one node.

When every rank of a communicator lives on one node, the communicator
reduces numpy arrays with :class:`SharedMemoryTransport`: all-reduces of at
least :data:`MIN_BYTES` (a fused bucket straight from its arrays) of every
supported dtype, float16 and bfloat16 included, go through shared memory,
everything else (smaller ones, cupy arrays, the other collectives) to the
MPI transport it was given.

:class:`SharedMemoryReducer` does the all-reduce, ``capacity_bytes`` at a
time: each rank copies its data into its own slot of the shared memory,
the ranks synchronise, rank r reduces elements ``[r*N//n, (r+1)*N//n)`` of
all slots (in rank order) into a shared result region, the ranks synchronise
again, and every rank copies the whole result region out. Every rank reads
the same result bytes, so results are bit-identical across ranks, and each
element is ``op(...op(op(x0, x1), x2)..., x(n-1))`` in rank order, computed
in the data's dtype as the numpy ufunc does (deterministic from run to run);
float16 and bfloat16 (uint16 bits with ``fmt="bfloat16"``) as
:func:`commlib.ops.hostcast.reduce_into`, the other transports' rounding:
each step widened to float32 and rounded back to nearest even.

The data is a list of arrays (a fused bucket's gradients, or one array):
they are copied straight into the slot and out of the result, with no
intermediate flat buffer. With the compiled host loops
(:mod:`commlib.ops.hostreduce`; float32/64, int32/64, uint8) rank r's own
share ``[lo, hi)`` skips its slot altogether: it is reduced straight from
the arrays and written straight back to them, so each rank copies only the
other ranks' shares in and out. No rank ever reads another rank's share of
its slot, so ranks may mix both ways.

Reuse needs no extra synchronisation: a rank starts writing its slot for
call k+1 only after the second synchronisation of call k, when every reduction
that reads the slots is done; and the result region of call k+1 is written
only after the first synchronisation of call k+1, which every rank reaches
only once it has copied out the result of call k.

Synchronisation (``sync``): ``"flags"`` spins on one monotonically increasing
sequence number per rank in the shared memory (in C without the GIL, with
acquire/release order, when the host loops are compiled; in Python only on
x86-64, where stores become visible in program order); ``"barrier"`` is
``MPI_Ibarrier`` on the communicator. The waits take the collective's
:class:`~commlib.core.waiting.Wait`: they give up at its deadline or when a rank
leaves the status board, naming the ranks that had not arrived, and return
to Python every few milliseconds so signal handlers run. A failure leaves
each element of the caller's arrays holding its input or its result (a
rank writes its own share's result into its arrays between the two
synchronisations), never a partial sum, and nothing is written after it.

Stores (``stores``): with flags, the copies into the slots and the result
use plain or streaming (non-temporal) stores. ``"auto"`` probes both when
the reducer is made (:meth:`SharedMemoryReducer.probe_stores`, a few
milliseconds) and keeps the winner, the same on every rank; ``"plain"`` or
``"streaming"`` fixes it.
"""
import platform
import statistics
import time

import numpy as np

from ..core import waiting
from ..core.dtypes import UFUNCS, supported_fast
from ..errors import ArgumentError, ArrayTypeError
from ..ops import hostcast, hostcopy, hostreduce, native
from .base import Transport


def _mpi():
    from mpi4py import MPI      # the communicator handed in is an mpi4py one
    return MPI


#: smallest all-reduce (bytes) that goes through shared memory; below it
#: MPI's latency is lower (benchmarks/allreduce.py)
MIN_BYTES = 64 << 10
#: bytes reduced per round (the slot size): pieces of 1-2 MiB stay
#: cache-resident and were fastest from 4 to 64 MiB
WINDOW_BYTES = 2 << 20
#: bytes of the shared result region: a half-precision all-reduce of several
#: windows keeps its result there until every window's count of NaN and inf
#: is known, with no copy of its own (ResNet-50's largest gradient,
#: 2,359,296 float16 values, fits); longer ones are copied out window by window
RESULT_BYTES = 8 << 20
_LINE = 64                # bytes per rank in the control region: its sequence number
_STORES = {"auto": None, "plain": False, "streaming": True}
_ALIGN = 4096             # alignment of slots and the result region, bytes


def _round_up(x, to):
    return (x + to - 1) // to * to


def _half(dtype, fmt):
    """Whether ``dtype`` holding ``fmt`` is float16 or bfloat16."""
    return fmt is not None or dtype.name in ("float16", "bfloat16")


def _half_scale(scale, fmt):
    """``scale`` rounded to the half format ``fmt`` (``"float16"`` or
    ``"bfloat16"``), as numpy rounds a Python float that multiplies an array
    of that dtype (``out *= scale``), as a float."""
    if fmt == "float16":
        return float(np.float16(scale))
    bits = np.empty(1, np.uint16)
    hostcast.cast_into(np.array([scale], np.float32), bits)
    wide = np.empty(1, np.float32)
    hostcast.cast_into(bits, wide)
    return float(wide[0])


def _scale(out, scale, fmt):
    """``out *= scale`` in ``out``'s format (the half formats through
    float32, rounded back as :func:`commlib.ops.hostcast.cast_into`; the
    scale rounded to the format first, see :func:`_half_scale`)."""
    if _half(out.dtype, fmt):
        wire = out.reshape(-1).view(np.uint16) if fmt is not None else out.reshape(-1)
        hostcast.cast_into(wire, wire, np.float32(scale))
    else:
        out *= scale


def _reduce_share(slots, out, lo, hi, op, scale, fmt):
    """Without the compiled share: elements ``[lo, hi)`` of every rank's
    slot reduced into ``out`` in rank order (numpy's ufunc; the half formats
    by :func:`commlib.ops.hostcast.reduce_into`), times ``scale``."""
    with np.errstate(all="ignore"):      # overflow to inf is silent, as in MPI
        if _half(out.dtype, fmt):
            out[...] = slots[0][lo:hi]
            for r in range(1, len(slots)):
                hostcast.reduce_into(slots[r][lo:hi], out, op)
        else:
            ufunc = UFUNCS[op]
            ufunc(slots[0][lo:hi], slots[1][lo:hi], out=out)
            for r in range(2, len(slots)):
                ufunc(out, slots[r][lo:hi], out=out)
        if scale is not None:
            _scale(out, scale, fmt)


class _Concatenation:
    """float32 arrays seen as one vector, for casts of ranges of it."""

    def __init__(self, parts):
        self.parts = [p.reshape(-1) for p in parts]
        self.starts = np.concatenate(([0], np.cumsum([p.size for p in self.parts]))).tolist()
        self.size = self.starts[-1]

    def pieces(self, a, b):
        """``[(part slice, its offset in [a, b))]`` of the elements ``[a, b)``."""
        found = []
        for part, start, end in zip(self.parts, self.starts, self.starts[1:]):
            if end > a and start < b:
                lo, hi = max(a, start), min(b, end)
                found.append((part[lo - start:hi - start], lo - a))
        return found


class SharedMemoryReducer:
    """All-reduce of numpy buffers over ``comm`` (an mpi4py communicator
    whose ranks all share one node), ``capacity_bytes`` at a time, in
    ``memory``: a zero-filled uint8 numpy array of :meth:`bytes_needed`
    bytes shared by the ranks (:mod:`commlib.startup.shared_segment`).
    ``result_bytes``: the size of the shared result region, at least
    ``capacity_bytes`` (the default): where :meth:`all_reduce_cast` keeps a
    result of several windows.

    The constructor is collective over ``comm`` (with ``stores="auto"`` it
    probes the stores). ``comm`` is used only there and, with
    ``sync="barrier"``, for the synchronisations. ``names``: the rank
    by which errors name each rank of ``comm`` (default: its rank in
    ``comm``). Closing is local.
    """

    def __init__(self, comm, memory, capacity_bytes=4 << 20, sync="auto", stores="auto",
                 names=None, result_bytes=None):
        if int(capacity_bytes) <= 0:
            raise ArgumentError("commlib: capacity_bytes must be positive, got %r"
                                % (capacity_bytes,))
        if sync not in ("auto", "flags", "barrier"):
            raise ArgumentError("commlib: sync must be 'auto', 'flags' or 'barrier', got %r"
                                % (sync,))
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        compiled = native.available()  # compile the host loops now, not inside a timed collective
        if sync == "auto":
            sync = "flags" if x86 or compiled else "barrier"
        if sync == "flags" and not (x86 or compiled):
            raise ArgumentError("commlib: sync='flags' needs x86-64 memory ordering or the "
                                "compiled host loops")
        if stores not in _STORES:
            raise ArgumentError("commlib: stores must be one of %s, got %r"
                                % (", ".join(_STORES), stores))
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.names = list(range(self.size)) if names is None else list(names)
        self.capacity_bytes = _round_up(int(capacity_bytes), _ALIGN)
        self.result_bytes = self._result_bytes(self.capacity_bytes, result_bytes)
        self.sync = sync
        self._comm = comm
        self._views = {}          # dtype -> (slots, result), arrays of that dtype
        self._kept = None         # all_reduce_cast's own copy of a longer result
        self._seq = 0
        #: whether copies into shared memory use streaming stores (x86-64 only)
        self.streaming = bool(_STORES[stores]) and x86
        control = self._control_bytes(self.size)
        total = self.bytes_needed(self.size, self.capacity_bytes, self.result_bytes)
        if memory.size < total:
            raise ArgumentError("commlib: the shared-memory reducer needs %d bytes, got %d"
                                % (total, memory.size))
        self._mem = memory[:total]
        self._slots_at = [control + r * self.capacity_bytes for r in range(self.size)]
        self._result_at = control + self.size * self.capacity_bytes
        self._control = self._mem[:control].view(np.int64)
        # the probe is collective: only when every rank has the compiled loops
        if (stores == "auto" and x86 and sync == "flags"
                and comm.allreduce(compiled, op=_mpi().LAND)):
            self.streaming = self.probe_stores()

    @staticmethod
    def _control_bytes(size):
        return _round_up(size * _LINE, _ALIGN)

    @staticmethod
    def _result_bytes(capacity, result_bytes):
        return capacity if result_bytes is None else max(capacity,
                                                         _round_up(int(result_bytes), _ALIGN))

    @classmethod
    def bytes_needed(cls, size, capacity_bytes, result_bytes=None):
        """Bytes of shared memory for ``size`` ranks, ``capacity_bytes``
        and ``result_bytes``."""
        capacity = _round_up(int(capacity_bytes), _ALIGN)
        return (cls._control_bytes(size) + size * capacity
                + cls._result_bytes(capacity, result_bytes))

    def probe_stores(self, nbytes=4 << 20, rounds=3):
        """Whether streaming stores beat plain ones here and now (collective;
        the same answer on every rank; a few milliseconds). ``nbytes`` is a
        window's worth: a probe that fits in the caches (256 KiB) chose plain
        stores in about one run in six here, which made a ResNet-50
        all-reduce 3.5x slower for that whole run (52 ms against 15).

        Each round every rank writes ``nbytes`` into its slot, which the next
        rank read in the round before (the reducer's own pattern), then reads
        the next rank's slot; plain and streaming rounds alternate after one
        untimed round. Streaming wins when its median write-plus-read time,
        slowest rank, is below 0.7 of plain's.
        """
        count = min(nbytes, self.capacity_bytes) // 4
        slots, _ = self._views_for(np.dtype(np.float32))
        mine, seen = np.ones(count, np.float32), np.empty(count, np.float32)
        slot, other = slots[self.rank][:count], slots[(self.rank + 1) % self.size][:count]
        clock, times = time.perf_counter_ns, ([], [])
        for streaming in [False] + [False, True] * rounds:
            self._comm.Barrier()
            start = clock()
            hostcopy.gather((mine,), slot, None, streaming)
            written = clock() - start
            self._comm.Barrier()
            start = clock()
            hostcopy.gather((other,), seen)
            times[streaming].append(written + clock() - start)
        cost = np.array([statistics.median(t[-rounds:]) for t in times], dtype=np.float64)
        self._comm.Allreduce(_mpi().IN_PLACE, cost, op=_mpi().MAX)
        return bool(cost[1] < 0.7 * cost[0])

    # -- synchronisation ---------------------------------------------------------
    def _wait_all(self, seq, wait):
        """Publish this rank's sequence number ``seq`` and wait until every
        rank has published at least ``seq``. ``wait``: the collective's
        :class:`~commlib.core.waiting.Wait` (deadline, and the status board whose
        ranks leaving end the wait)."""
        if self.sync == "barrier":
            request = self._comm.Ibarrier()
            waiting.until(lambda _: request.Test() or None, wait)
            return
        stride = _LINE // 8
        board = wait.board
        gone, gone_stride = board.gone_words if board is not None else (None, 1)
        ext = native.module()
        flags = self._control
        if ext is None:
            flags[self.rank * stride] = seq
        first = [True]

        def step(slice_s):
            if ext is not None:      # spins in C, without the GIL
                found = ext.wait_flags(flags, self.rank, self.size, stride, seq, first[0],
                                       wait.deadline, slice_s, gone, gone_stride, wait.seq)
                first[0] = False
            else:
                found = waiting.spin_py(flags[:self.size * stride:stride], seq,
                                        None if gone is None else
                                        gone[:self.size * gone_stride:gone_stride],
                                        wait.seq, self.rank, slice_s)
            if found <= -2:
                board.check_peers(wait.seq, wait.what, [-2 - found])
            return True if found == 0 else None

        # never sleeping (see waiting.until): every rank is inside this
        # collective, so the peers' flags follow within microseconds; a
        # progress thread sleeping between these looks paid up to 0.5 ms per
        # piece (two syncs per 2 MiB); where the node's ranks outnumber its
        # cores these waits sleep too (waiting.set_cores_shared)
        waiting.until(step, wait, late=lambda: [self.names[r] for r in range(self.size)
                                                if flags[r * stride] < seq], pace="spin")

    def _views_for(self, dtype):
        """(slots, result) for ``dtype``: a tuple of every rank's slot, and
        the result region, as arrays of ``dtype``."""
        found = self._views.get(dtype)
        if found is None:
            count = self.capacity_bytes // dtype.itemsize
            mem = self._mem
            slots = [mem[at:at + count * dtype.itemsize].view(dtype) for at in self._slots_at]
            at, count = self._result_at, self.result_bytes // dtype.itemsize
            result = mem[at:at + count * dtype.itemsize].view(dtype)
            found = self._views[dtype] = (tuple(slots), result)
        return found

    # -- the collective ----------------------------------------------------------
    def all_reduce(self, buf, op, wait=waiting.FOREVER, scale=None, fmt=None):
        """Reduce ``buf`` (1-D C-contiguous writeable numpy array, any length:
        one window after the other, see :meth:`windows`) with ``op``
        (``"sum"``, ``"max"``, ``"min"``, ``"prod"``) over all ranks, in place,
        times ``scale`` (float, or None for no scaling); ``fmt="bfloat16"``:
        ``buf`` is uint16 holding bfloat16 bits.

        Returns True when done, False (``buf`` untouched, no communication)
        when this reducer cannot take the call: not a numpy array or an
        unsupported dtype. Every rank must pass the same dtype and length,
        so all ranks agree. ``wait``: the collective's
        :class:`~commlib.core.waiting.Wait`. A failure raises with each element
        of ``buf`` holding either its input or its result.
        """
        if type(buf) is not np.ndarray or not self.takes(buf.dtype, 0, fmt):
            return False
        if buf.ndim != 1 or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ArrayTypeError("commlib: all_reduce needs a 1-D C-contiguous writeable array")
        for piece in self.windows(buf):
            self.all_reduce_parts((piece,), piece.size, buf.dtype, op, scale, wait, fmt)
        return True

    def windows(self, buf):
        """``buf`` (1-D) as consecutive pieces of one window each (one
        empty piece for an empty ``buf``)."""
        step = max(1, self.capacity_bytes // buf.itemsize)
        return [buf[start:start + step] for start in range(0, max(buf.size, 1), step)]

    def takes(self, dtype, nbytes, fmt=None):
        """Whether :meth:`all_reduce_parts` takes ``nbytes`` of ``dtype``
        holding ``fmt`` (one window at most)."""
        return nbytes <= self.capacity_bytes and (
            supported_fast(dtype) if fmt is None else fmt == "bfloat16" and dtype == np.uint16)

    def all_reduce_parts(self, parts, count, dtype, op, scale=None, wait=waiting.FOREVER,
                         fmt=None, between=None):
        """All-reduce, in place, the concatenation of ``parts`` (a tuple or
        list of C-contiguous writeable numpy arrays of ``dtype``, ``count``
        elements in all, any shapes) and multiply it by ``scale`` (float, or
        None for no scaling); ``fmt`` as in :meth:`all_reduce`. Returns
        True, or False, touching nothing, when the reducer does not take
        them (more than one window, an unsupported dtype: see :meth:`takes`).

        ``between``: None, or a callable given this rank's share of the
        node's reduction (a writeable array in the shared result region,
        empty for a rank with no share), which it may change in place (the
        hierarchical transport all-reduces it across nodes there); it runs
        between the two synchronisations, before ``scale`` would apply,
        so ``scale`` must then be None. With ``between`` nothing at all is
        written into ``parts`` before the second synchronisation (each rank
        reduces its share from its slot), so a failure leaves ``parts``
        untouched.

        Raises:
            ArgumentError: ``op`` is unknown, or the reducer is closed;
                nothing is touched.
        """
        if op not in UFUNCS:
            raise ArgumentError("commlib: op must be one of %s, got %r" % (sorted(UFUNCS), op))
        if not self.takes(dtype, count * dtype.itemsize, fmt):
            return False
        if scale is not None and _half(dtype, fmt):
            # as numpy's `out *= scale` of a float16 (or bfloat16) array
            scale = _half_scale(scale, fmt or dtype.name)
        if self.size == 1 or count == 0:
            if scale is not None:
                for part in parts:
                    _scale(part, scale, fmt)
            return True
        if self._mem is None:
            raise ArgumentError("commlib: the shared-memory reducer is closed")
        slots, result = self._views_for(dtype)
        n, rank = self.size, self.rank
        lo, hi = count * rank // n, count * (rank + 1) // n
        slot, result = slots[rank][:count], result[:count]
        compiled = hostcopy.available()
        streaming = self.streaming
        # this rank's own share: straight from and to the parts, or via its slot
        fast = hostreduce.supports(dtype, op, fmt)
        own = (lo, hi) if fast and between is None else None
        if not (compiled and hostcopy.gather(parts, slot, own, streaming)):
            own = None
            hostcopy.gather_any(parts, slot)
        self._seq += 2
        self._wait_all(self._seq - 1, wait)
        if own is not None:
            hostreduce.reduce_share(parts, slots, rank, result, lo, hi, op, scale, streaming,
                                    fmt)
        elif fast and between is not None:   # from the slot, written back to it too
            hostreduce.reduce_share((slot,), slots, rank, result, lo, hi, op, None, streaming,
                                    fmt)
        else:
            _reduce_share(slots, result[lo:hi], lo, hi, op, scale, fmt)
        if between is not None:
            between(result[lo:hi])
        self._wait_all(self._seq, wait)
        if not (compiled and hostcopy.scatter(result, parts, own)):
            hostcopy.scatter_any(result, parts)
        return True

    def all_reduce_cast(self, parts, fmt, op, scale, guarded, wait=waiting.FOREVER):
        """All-reduce float32 ``parts`` (C-contiguous writeable numpy arrays,
        any shapes) in the half format ``fmt`` (``"float16"`` or
        ``"bfloat16"``), casting on the way in and out of the shared memory:
        each rank's values times ``scale`` (float or None) are rounded to
        ``fmt`` into its slot, reduced there with ``op`` in rank order as
        :meth:`all_reduce_parts` reduces that format, and the result is cast
        back into ``parts``, unless ``guarded`` and it holds NaN or inf;
        then nothing is written. The compression strategies' wire without
        a wire buffer: one cast in, window by window, and one cast out of
        the result, which stays in the shared result region until every
        window's count is known (a result longer than ``result_bytes`` is
        copied out into a buffer of this rank's, window by window). With
        the compiled loops a rank's own share of a window is not cast into
        its slot: the reduction rounds it from ``parts`` as it goes
        (:func:`~commlib.ops.hostreduce.reduce_share`'s ``cast_own``) and
        counts the NaN and inf of the result on the way.

        Returns:
            ``(sent, found)``: how many NaN and inf this rank sent (its
            values after the cast), and how many the reduced result holds
            (the same on every rank).
        """
        storage = np.dtype(np.uint16) if fmt == "bfloat16" else np.dtype(np.float16)
        bits = "bfloat16" if fmt == "bfloat16" else None
        flat = _Concatenation(parts)
        count = flat.size
        step = max(1, self.capacity_bytes // storage.itemsize)
        windows = [(a, min(count, a + step)) for a in range(0, count, step)] or [(0, 0)]
        slots, result = self._views_for(storage)
        factor = np.float32(1) if scale is None else np.float32(scale)
        # the whole result, kept until every window's count is known (nothing
        # is written before a NaN is known): the shared result region where it
        # fits, else a buffer of this rank's that each window is copied into
        shared = count <= result.size
        kept = result[:count] if shared else self._own_result(count, storage)
        sent = found = 0
        n, rank, words = self.size, self.rank, self._control
        # this rank's share of each window is cast inside the reduction,
        # read straight from the parts: it never passes through the slot
        direct = (n > 1 and hostreduce.supports(storage, op, bits)
                  and all(p.flags.aligned for p in flat.parts))
        for a, b in windows:
            length = b - a
            window = flat.pieces(a, b)
            reduced = result[a:b] if shared else result[:length]
            # with one rank the window is cast straight into its result
            slot = slots[rank][:length] if n > 1 else reduced
            lo, hi = length * rank // n, length * (rank + 1) // n
            skip = (a + lo, a + hi) if direct else (b, b)
            for first, last in ((a, skip[0]), (skip[1], b)):
                for piece, at in flat.pieces(first, last):
                    at += first - a
                    sent += hostcast.cast_into(piece, slot[at:at + piece.size], factor,
                                               streaming=self.streaming)
            if n > 1:
                self._seq += 2
                self._wait_all(self._seq - 1, wait)
                if direct:
                    own, share = hostreduce.reduce_share(
                        [piece for piece, _ in window], slots, rank, reduced, lo, hi,
                        op, None, self.streaming, bits, cast_own=factor)
                    sent += own
                else:
                    _reduce_share(slots, reduced[lo:hi], lo, hi, op, None, bits)
                    share = hostcast.count_nonfinite(reduced[lo:hi], fmt)
                words[rank * (_LINE // 8) + 1] = share
                self._wait_all(self._seq, wait)
                found += int(words[1::_LINE // 8][:n].sum())
            else:
                found += hostcast.count_nonfinite(reduced, fmt)
            if not shared:
                kept[a:b] = reduced
        if not (found and guarded):
            for piece, at in flat.pieces(0, count):
                hostcast.cast_into(kept[at:at + piece.size], piece)
        return sent, found

    def _own_result(self, count, storage):
        """This rank's buffer of ``count`` elements of ``storage`` for
        :meth:`all_reduce_cast`'s results longer than the shared result
        region (kept between calls, grown as needed)."""
        nbytes = count * storage.itemsize
        if self._kept is None or self._kept.size < nbytes:
            self._kept = np.empty(nbytes, np.uint8)
        return self._kept[:nbytes].view(storage)

    def close(self):
        """Drop this rank's views of the shared memory (local). Idempotent."""
        self._control = None
        self._views.clear()
        self._mem = None
        self._kept = None


class SharedMemoryTransport(Transport):
    """All-reduces of numpy buffers of at least :data:`MIN_BYTES` in shared
    memory; the rest through ``fallback`` (the MPI transport over the same
    ranks, which must all be on this node).

    ``memory``: zero-filled shared uint8 numpy array of :meth:`bytes_needed`
    bytes; ``stores``: ``"auto"``, ``"plain"`` or ``"streaming"``; ``node``:
    None, or the mpi4py communicator of the ranks whose memory is shared
    when they are not all of ``fallback``'s (see
    :class:`~commlib.transport.hierarchical.HierarchicalTransport`);
    ``window_bytes``: bytes reduced per round; ``result_bytes``: the
    shared result region's size (see :data:`RESULT_BYTES`). The constructor
    is collective (the store probe).
    """

    name = "shm"

    def __init__(self, fallback, memory, stores="auto", node=None, window_bytes=WINDOW_BYTES,
                 result_bytes=RESULT_BYTES):
        super().__init__(fallback.rank, fallback.size)
        self.fallback = fallback
        comm = fallback.comm if node is None else node
        names = None if node is None else node.allgather(fallback.rank)
        self.reducer = SharedMemoryReducer(comm, memory, window_bytes, stores=stores,
                                           names=names, result_bytes=result_bytes)

    def _steps(self, op, scale, wait, fmt=None):
        """``(scale, between)`` for the reducer's
        :meth:`~SharedMemoryReducer.all_reduce_parts` of an all-reduce
        with ``op``, ``scale``, ``wait`` and ``fmt``: here the scale as it
        is and no step between the synchronisations."""
        return scale, None

    def thread_safe(self):
        return self.fallback.thread_safe()

    @staticmethod
    def bytes_needed(size, window_bytes=WINDOW_BYTES, result_bytes=RESULT_BYTES):
        """Bytes of shared memory for ``size`` ranks, windows of
        ``window_bytes`` and a result region of ``result_bytes``."""
        return SharedMemoryReducer.bytes_needed(size, window_bytes, result_bytes)

    def _takes(self, buf, fmt=None):
        return type(buf) is np.ndarray and buf.nbytes >= MIN_BYTES and (
            supported_fast(buf.dtype) if fmt is None else fmt == "bfloat16"
            and buf.dtype == np.uint16)

    def all_reduce(self, buf, op, wait=waiting.FOREVER, fmt=None, owned=False, scale=None):
        """See :meth:`Transport.all_reduce`: numpy buffers of at least
        :data:`MIN_BYTES` in shared memory, window by window; the rest
        through the MPI transport."""
        if not self._takes(buf, fmt):
            self.fallback.all_reduce(buf, op, wait, fmt, owned, scale)
            return
        self.check_usable()
        reducer = self.reducer
        scale, between = self._steps(op, scale, wait, fmt)
        try:
            for piece in reducer.windows(buf):
                reducer.all_reduce_parts((piece,), piece.size, buf.dtype, op, scale, wait, fmt,
                                         between)
        except BaseException as exc:
            self.fail("all_reduce failed (%s)" % type(exc).__name__)
            raise

    def casts(self, parts):
        """float32 numpy arrays whose half-format wire would be at least
        :data:`MIN_BYTES`, with the compiled host loops."""
        return (native.available() and bool(parts)
                and all(type(p) is np.ndarray and p.dtype == np.float32 for p in parts)
                and 2 * sum(p.size for p in parts) >= MIN_BYTES)

    def all_reduce_cast(self, parts, fmt, op, scale, guarded, wait=waiting.FOREVER):
        """See :meth:`Transport.all_reduce_cast`: cast on the way into and
        out of the shared memory (:meth:`SharedMemoryReducer.all_reduce_cast`)."""
        self.check_usable()
        try:
            return self.reducer.all_reduce_cast(parts, fmt, op, scale, guarded, wait)
        except BaseException as exc:
            self.fail("all_reduce failed (%s)" % type(exc).__name__)
            raise

    def reduces_parts(self, buf):
        """Buckets of one window at most (larger ones are packed and reduced
        window by window)."""
        return self._takes(buf) and buf.nbytes <= self.reducer.capacity_bytes

    def all_reduce_parts(self, parts, buf, op, scale, wait=waiting.FOREVER):
        self.check_usable()
        try:
            scale, between = self._steps(op, scale, wait)
            taken = self.reducer.all_reduce_parts(parts, buf.size, buf.dtype, op, scale, wait,
                                                  between=between)
        except BaseException as exc:
            self.fail("all_reduce failed (%s)" % type(exc).__name__)
            raise
        if not taken:
            raise ArgumentError("commlib: the shared-memory transport cannot take a bucket of "
                                "%d bytes of %s" % (buf.nbytes, buf.dtype))

    def broadcast(self, buf, root, wait=waiting.FOREVER, owned=False):
        self.fallback.broadcast(buf, root, wait, owned)

    def reduce(self, buf, root, op, wait=waiting.FOREVER, owned=False):
        self.fallback.reduce(buf, root, op, wait, owned)

    def all_gather(self, sendbuf, recvbuf, wait=waiting.FOREVER):
        self.fallback.all_gather(sendbuf, recvbuf, wait)

    def all_gatherv(self, sendbuf, recvbuf, counts, wait=waiting.FOREVER):
        self.fallback.all_gatherv(sendbuf, recvbuf, counts, wait)

    def reduce_scatter(self, sendbuf, recvbuf, op, wait=waiting.FOREVER):
        self.fallback.reduce_scatter(sendbuf, recvbuf, op, wait)

    def barrier(self, wait=waiting.FOREVER):
        self.fallback.barrier(wait)

    def send_recv(self, ops, wait=waiting.FOREVER):
        self.fallback.send_recv(ops, wait)

    def all_to_allv(self, sendbuf, sendcounts, recvbuf, recvcounts, wait=waiting.FOREVER):
        self.fallback.all_to_allv(sendbuf, sendcounts, recvbuf, recvcounts, wait)

    def split(self, color, key, table, wait=waiting.FOREVER):
        return self.fallback.split(color, key, table, wait)

    def check_usable(self):
        super().check_usable()
        self.fallback.check_usable()

    def close(self):
        """Drop this rank's views of the shared memory (local)."""
        self.reducer.close()
        super().close()
