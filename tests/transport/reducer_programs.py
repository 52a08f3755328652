"""Rank programs of tests/transport/test_shm_reducer.py: the shared-memory reducer
on real MPI ranks, against a numpy reduction in rank order of every rank's
input gathered with plain mpi4py.

    mpiexec -n N python -m reducer_programs reduce|parts|gil|errors [args]
"""
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, n = comm.Get_rank(), comm.Get_size()


def make_reducer(comm, capacity_bytes=4 << 20, **options):
    """A SharedMemoryReducer of ``capacity_bytes`` per round over memory
    shared by the ranks of ``comm``, as the communicator makes it
    (collective)."""
    from commlib.startup import bootstrap
    from commlib.transport.shm import SharedMemoryReducer
    nbytes = SharedMemoryReducer.bytes_needed(comm.Get_size(), max(1, capacity_bytes),
                                              options.get("result_bytes"))
    segment = bootstrap.node_segment(comm, nbytes)
    assert segment is not None, "no shared memory on this node"
    reducer = SharedMemoryReducer(comm, segment.array, capacity_bytes, **options)
    reducer.segment = segment          # keeps the mapping alive with the reducer
    return reducer


def reduce(sync, *more):
    """Every dtype and op, odd and zero lengths, repeated calls of changing
    size, pieces longer than the window; ``sync``: flags, barrier or auto;
    then each of ``more`` (``thresholds``: :func:`thresholds`; ``no-grid``:
    without the grid of every dtype, length and op, whose arithmetic does
    not depend on how the ranks synchronise)."""
    DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]
    try:
        import ml_dtypes
        DTYPES.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
    CAPACITY = 8192
    red = make_reducer(comm, capacity_bytes=CAPACITY, sync=sync)
    assert red.capacity_bytes == CAPACITY

    def make(dtype, length, seed):
        rng = np.random.default_rng(seed)
        dtype = np.dtype(dtype)
        if dtype.kind == "f" or dtype.name == "bfloat16":
            return (rng.standard_normal(length) * 4).astype(dtype)
        return rng.integers(0, 200, length).astype(dtype)

    def check(dtype, length, op, seed):
        x = make(dtype, length, seed * 10 + rank)
        everyone = comm.allgather(x)
        with np.errstate(all="ignore"):
            ref = everyone[0].copy()
            for other in everyone[1:]:
                ref = UFUNCS[op](ref, other).astype(ref.dtype)
            assert red.all_reduce(x, op) is True
        mine = x.view(np.uint8).tobytes()
        assert mine == ref.view(np.uint8).tobytes(), (np.dtype(dtype).name, length, op, x, ref)
        assert all(b == mine for b in comm.allgather(mine)), "ranks differ"

    seed = 0
    for dtype in DTYPES if "no-grid" not in more else ():
        itemsize = np.dtype(dtype).itemsize
        for length in (0, 1, 2, 3, 5, 7, 64, 1001, CAPACITY // itemsize):
            for op in UFUNCS:
                seed += 1
                check(dtype, length, op, seed)

    # repeated calls of changing sizes and dtypes, no synchronisation in between
    rng = np.random.default_rng(1234)       # same sequence on every rank
    plan = [(DTYPES[rng.integers(len(DTYPES))], int(rng.integers(0, 600)),
             list(UFUNCS)[rng.integers(4)]) for _ in range(60)]
    inputs = [make(d, length, 7919 * i + rank) for i, (d, length, _) in enumerate(plan)]
    outputs = [x.copy() for x in inputs]
    with np.errstate(all="ignore"):
        for (_, _, op), x in zip(plan, outputs):
            assert red.all_reduce(x, op)
        everyone = comm.allgather(inputs)
        for i, (_, _, op) in enumerate(plan):
            ref = everyone[0][i].copy()
            for r in range(1, n):
                ref = UFUNCS[op](ref, everyone[r][i]).astype(ref.dtype)
            assert outputs[i].tobytes() == ref.tobytes(), (i, plan[i])

    # longer than the window: reduced piece by piece
    for length in (CAPACITY // 4 + 1, 3 * CAPACITY // 4 + 5):
        big = make("float32", length, 555 + rank)
        everyone = comm.allgather(big)
        assert red.all_reduce(big, "sum") is True
        assert big.tobytes() == sum(everyone[1:], everyone[0].copy()).tobytes()
        for dtype in ("float32", "float64", "float16"):      # the average's scale, fused
            x = make(dtype, length, 777 + rank)
            everyone = comm.allgather(x)
            ref = sum(everyone[1:], everyone[0].copy()).astype(x.dtype)
            ref *= 1.0 / n
            assert red.all_reduce(x, "sum", scale=1.0 / n) is True
            assert x.tobytes() == ref.tobytes(), (dtype, length, x, ref)
    # bfloat16 as uint16 bits (a compressed wire): the bits of ml_dtypes' bfloat16
    # reduction in rank order, window by window, with and without a scale
    if not isinstance(DTYPES[-1], str):
        for length, op, scale in ((CAPACITY // 2 + 3, "sum", None), (1001, "max", None),
                                  (CAPACITY + 7, "sum", 1.0 / n)):
            x = make(DTYPES[-1], length, 999 + rank)
            everyone = comm.allgather(x)
            with np.errstate(all="ignore"):
                ref = everyone[0].copy()
                for other in everyone[1:]:
                    ref = UFUNCS[op](ref, other).astype(ref.dtype)
                if scale is not None:
                    ref *= scale
            bits = x.view(np.uint16)
            assert red.all_reduce(bits, op, scale=scale, fmt="bfloat16") is True
            assert bits.tobytes() == ref.tobytes(), ("bfloat16 bits", length, op, bits, ref)
        assert red.all_reduce(np.ones(4, np.uint16), "sum") is False     # uint16 alone
    # float32 arrays cast into and out of a half-format wire by the reducer
    # itself (all_reduce_cast): the bits of the same wire cast by hostcast and
    # reduced by all_reduce, in one window and over several; the counts of
    # NaN and inf sent and found; guarded, nothing written when one is found
    # (with a result region of one window every longer result is copied out
    # of it window by window; with four, results of up to four windows stay
    # there: at, below and above that boundary)
    from commlib.ops import hostcast
    wide = make_reducer(comm, capacity_bytes=CAPACITY, sync=sync, result_bytes=4 * CAPACITY)
    cases = [(red, CAPACITY // 2 - 3, None), (red, 3 * CAPACITY // 2 + 5, 1.0 / n),
             (wide, 3 * CAPACITY // 2 + 5, 1.0 / n), (wide, 2 * CAPACITY - 1, None),
             (wide, 2 * CAPACITY, 1.0 / n), (wide, 2 * CAPACITY + 1, None)]
    for fmt, storage in (("float16", np.float16), ("bfloat16", np.uint16)):
        for reducer, total, scale in cases:
            sizes = [total // 3, 0, total - total // 3 - 7, 7]
            rng = np.random.default_rng([total, rank])
            flat = (rng.standard_normal(total) * 50).astype(np.float32)
            if rank == n - 1:
                flat[1] = np.nan                # one rank sends a NaN in rank 0's share,
                flat[min(total, CAPACITY // 2) * rank // n] = np.nan    # one in its own
            flat[2] = 1e6 * (rank + 1)          # beyond float16's range: inf once cast
            wire = np.empty(total, storage)
            sent = hostcast.cast_into(flat, wire, np.float32(1 if scale is None else scale))
            assert red.all_reduce(wire, "sum", fmt="bfloat16" if storage is np.uint16
                                  else None) is True
            want = np.empty(total, np.float32)
            hostcast.cast_into(wire, want)
            for guarded in (False, True):
                parts = [x.copy() for x in np.split(flat, np.cumsum(sizes)[:-1])]
                reducer._kept = None
                got = reducer.all_reduce_cast(parts, fmt, "sum", scale, guarded)
                # a result of several windows kept in shared memory where it fits
                assert (reducer._kept is None) == (reducer is red and total < CAPACITY // 2
                                                   or reducer is wide and total <= 2 * CAPACITY
                                                   ), (total, reducer._kept)
                found = hostcast.count_nonfinite(wire, fmt)
                assert got == (sent, found) and found >= 1, (fmt, total, got, sent, found)
                out = np.concatenate(parts)
                if guarded:                      # a NaN in the result: nothing written
                    assert out.tobytes() == flat.tobytes(), (fmt, total)
                else:
                    assert out.tobytes() == want.tobytes(), (fmt, total)
        for reducer in (red, wide):
            clean = [np.full(CAPACITY, rank + 1.0, np.float32)]
            assert reducer.all_reduce_cast(clean, fmt, "max", None, True) == (0, 0)
            assert (clean[0] == n).all()
    wide.close()
    # a bucket longer than the window, not numpy, unsupported dtype: declined, untouched
    big = np.ones(CAPACITY // 4 + 1, np.float32)
    assert red.all_reduce_parts((big,), big.size, big.dtype, "sum") is False and (big == 1).all()
    assert red.all_reduce([1.0, 2.0], "sum") is False
    assert red.all_reduce(np.ones(4, np.complex64), "sum") is False
    assert red.all_reduce(np.ones(4, np.int16), "sum") is False
    # at, before and after each window boundary (one element is 4 bytes)
    for length in (CAPACITY // 4 - 1, CAPACITY // 4, CAPACITY // 4 + 1, 2 * CAPACITY // 4,
                   2 * CAPACITY // 4 + 1):
        x = make("float32", length, 999 + rank)
        everyone = comm.allgather(x)
        assert red.all_reduce(x, "sum") is True
        assert x.tobytes() == sum(everyone[1:], everyone[0].copy()).tobytes(), length
    # the average's scale at float32's limits: the sum in rank order, then the scale
    top = float(np.finfo(np.float32).max)
    for value, ranks in ((top * 0.75, range(n)), (top / (2 * n), range(n)),
                         (2.0 ** -149, range(n)), (2.0 ** -126 * 3, [0])):
        x = np.full(1001, value if rank in ranks else 0.0, np.float32)
        everyone = comm.allgather(x)
        with np.errstate(over="ignore"):
            ref = sum(everyone[1:], everyone[0].copy()) * np.float32(1.0 / n)
            assert red.all_reduce(x, "sum", scale=1.0 / n) is True
        assert x.tobytes() == ref.tobytes(), (value, x[:2], ref[:2])
    red.close()
    red.close()
    for name in more:
        {"thresholds": thresholds, "no-grid": lambda: None}[name]()
    print("rank %d ok" % rank, flush=True)


def thresholds():
    """Through a communicator: all-reduces one element below, at and above
    the shared-memory threshold (MIN_BYTES: MPI's path below), and below,
    at and above one and two windows (WINDOW_BYTES: rounds of the reducer),
    and fused buckets of exactly a window and one element more (reduced
    from the arrays where they lie, or packed and reduced window by
    window); results against numpy on every rank's inputs, the path by the
    calls the reducer and MPI's transport saw."""
    import commlib
    from commlib.transport import mpi as mpi_transport, shm

    calls = []

    def counting(cls, name, tag):
        original = getattr(cls, name)

        def call(self, *args, **kwargs):
            calls.append((tag, args))
            return original(self, *args, **kwargs)
        setattr(cls, name, call)

    counting(shm.SharedMemoryReducer, "all_reduce_parts", "window")
    counting(mpi_transport.MpiTransport, "all_reduce", "mpi")
    low, window = shm.MIN_BYTES // 4, shm.WINDOW_BYTES // 4
    comm = commlib.Communicator.from_mpi(bucket_bytes=8 * shm.WINDOW_BYTES)
    cases = [([low - 1], "mpi", 1), ([low], "window", 1), ([low + 1], "window", 1),
             ([window - 1], "window", 1), ([window], "window", 1), ([window + 1], "window", 2),
             ([2 * window + 1], "window", 3),
             ([window // 2, window // 2], "parts", 1), ([window // 2, window // 2 + 1],
                                                        "window", 2)]
    def inputs(seed, layout, r):         # every rank's, made anew on each (no gather)
        rng = np.random.default_rng([seed, r])
        return [rng.integers(-20, 21, size).astype(np.float32) for size in layout]

    for seed, (layout, path, rounds) in enumerate(cases):
        arrays = inputs(seed, layout, rank)
        everyone = [inputs(seed, layout, r) for r in range(n)]
        del calls[:]
        comm.all_reduce(arrays, op="avg")
        for i, a in enumerate(arrays):
            want = everyone[0][i].copy()
            for e in everyone[1:]:
                want = want + e[i]
            assert a.tobytes() == (want * np.float32(1.0 / n)).tobytes(), (layout, i)
        tags = [tag for tag, _ in calls]
        if path == "parts":       # the bucket's arrays, straight from where they lie
            assert tags == ["window"] and len(calls[0][1][0]) == len(layout), (layout, calls)
        else:
            assert tags == [path] * rounds, (layout, tags)
    comm.close()


def parts(mode, stores):
    """Buckets given as lists of arrays. ``mode``: the compiled loops on
    every rank (all), on none, or on even ranks only (even); ``stores``:
    plain, streaming or auto stores into the shared memory."""
    if mode == "none" or (mode == "even" and rank % 2):
        os.environ["COMMLIB_NATIVE"] = "0"      # before commlib loads its host loops
    from commlib.ops import hostreduce
    if mode == "none" or (mode == "even" and rank % 2):
        os.environ["COMMLIB_NATIVE"] = "0"

    assert hostreduce.supports(np.dtype(np.float32), "sum") == (os.environ.get("COMMLIB_NATIVE") != "0")
    UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
    DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]
    red = make_reducer(comm, capacity_bytes=1 << 16, stores=stores)
    if n > 1 and stores == "auto" and mode == "all":
        # the start-up probe of plain against streaming stores agrees on every rank
        answers = comm.allgather((red.streaming, red.probe_stores()))
        assert all(a == answers[0] for a in answers) and isinstance(answers[0][1], bool), answers
    if stores != "auto":
        assert red.streaming == (stores == "streaming")
    rng = np.random.default_rng(99)              # same layouts on every rank
    for trial in range(40):
        dtype = np.dtype(DTYPES[trial % len(DTYPES)])
        op = list(UFUNCS)[trial % 4]
        sizes = [int(s) for s in rng.integers(0, 300, rng.integers(1, 30))]
        count = sum(sizes)
        if count * dtype.itemsize > red.capacity_bytes:
            continue
        scale = 0.25 if dtype.kind == "f" and op == "sum" and trial % 3 else None
        mine = np.random.default_rng(1000 * trial + rank)
        flat = ((mine.standard_normal(count) * 4) if dtype.kind == "f"
                else mine.integers(0, 200, count)).astype(dtype)
        parts, at = [], 0
        for k, size in enumerate(sizes):
            piece = flat[at:at + size].copy()
            parts.append(piece.reshape(size // 2, 2) if size % 2 == 0 and k % 2 else piece)
            at += size
        everyone = comm.allgather(flat)
        with np.errstate(all="ignore"):
            ref = everyone[0].copy()
            for other in everyone[1:]:
                ref = UFUNCS[op](ref, other)
            if scale is not None:
                ref *= scale
            assert red.all_reduce_parts(tuple(parts) if trial % 2 else parts, count, dtype, op,
                                        scale) is True
        got = np.concatenate(parts, axis=None) if parts else flat[:0]
        assert got.tobytes() == ref.tobytes(), (trial, dtype, op, sizes)
        assert all(b == got.tobytes() for b in comm.allgather(got.tobytes())), "ranks differ"
    modes = comm.allgather(red.streaming)
    assert all(m == modes[0] for m in modes), modes           # every rank chose alike
    red.close()
    print("rank %d ok" % rank, flush=True)


def gil():
    """A rank waiting for a late peer does not hold the GIL: another thread
    of it gets about as much CPU time during the wait as the waiting thread
    itself (the scheduler shares the cores fairly between the two, however
    crowded the machine). A wait that held the GIL in C would leave the
    other thread only the moments between its time slices, about a fifth."""
    from commlib.ops import hostcopy

    red = make_reducer(comm, capacity_bytes=1 << 16)
    x = np.full(1 << 12, rank + 1.0, np.float32)
    cpu, stop = [0.0], threading.Event()

    def spin():
        while not stop.is_set():
            for _ in range(1000):
                pass
            cpu[0] = time.thread_time()

    if rank == 0:
        worker = threading.Thread(target=spin)
        worker.start()
        time.sleep(0.1)
        before, start, own = cpu[0], time.perf_counter(), time.thread_time()
        assert red.all_reduce(x, "sum")       # waits about 1 s for rank 1
        during, waited = cpu[0] - before, time.perf_counter() - start
        own = time.thread_time() - own
        stop.set()
        worker.join()
        print("thread CPU while waiting: %.3f s; the waiting thread's: %.3f s; waited %.3f s"
              % (during, own, waited), flush=True)
        assert waited > 0.5, waited
        assert during > 0.5 * own or not hostcopy.available(), (during, own, waited)
    else:
        time.sleep(1.0)
        assert red.all_reduce(x, "sum")
    assert (x == 3).all()
    red.close()
    print("rank %d ok" % rank, flush=True)


def refused(error, text, call):
    """``call()`` raises exactly ``error`` with the message ``text``."""
    try:
        call()
    except Exception as exc:
        assert type(exc) is error and str(exc) == text, (type(exc), str(exc), text)
    else:
        raise AssertionError("accepted: expected %s(%r)" % (error.__name__, text))


def errors():
    """Bad settings, op and layouts are refused, before anything is written."""
    from commlib.errors import ArgumentError, ArrayTypeError
    refused(ArgumentError, "commlib: capacity_bytes must be positive, got 0",
            lambda: make_reducer(comm, capacity_bytes=0))
    refused(ArgumentError, "commlib: sync must be 'auto', 'flags' or 'barrier', got 'spin'",
            lambda: make_reducer(comm, sync="spin"))
    red = make_reducer(comm)
    x = np.ones(4, np.float32)
    refused(ArgumentError, "commlib: op must be one of ['max', 'min', 'prod', 'sum'], got 'avg'",
            lambda: red.all_reduce(x, "avg"))
    assert (x == 1).all()
    for bad in (np.ones((2, 2), np.float32), np.ones(8, np.float32)[::2]):
        refused(ArrayTypeError, "commlib: all_reduce needs a 1-D C-contiguous writeable array",
                lambda: red.all_reduce(bad, "sum"))
        assert (bad == 1).all()
    x = np.full(3, comm.Get_rank() + 1.0)
    assert red.all_reduce(x, "sum") and (x == comm.Get_size() * (comm.Get_size() + 1) / 2).all()
    red.close()
    print("rank %d ok" % rank, flush=True)


if __name__ == "__main__":
    {"reduce": reduce, "parts": parts, "gil": gil, "errors": errors}[sys.argv[1]](*sys.argv[2:])
