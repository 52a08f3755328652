"""Rank programs of tests/progress/test_async.py: asynchronous collectives and the
BackwardReducer on real MPI ranks.

    mpiexec -n N python async_programs.py SCENARIO

Every rank checks its own results (asserting, so a failure ends the job with
a non-zero status) against numpy references computed from every rank's
inputs gathered with plain mpi4py, and against the synchronous path of a
second communicator, bit for bit; then prints ``ASYNC {json}`` records
(``what``, ``rank`` and what the test checks further: errors, culprits,
seconds) and a last record ``what="ok"``.
"""
import json
import os
import signal
import sys
import threading
import time

import mpi4py
import numpy as np

if sys.argv[1:2] == ["deferred"]:           # in case MPI is not initialised yet
    mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI  # noqa: E402

import commlib
from commlib.compression import Partial, Threshold, TopK
from commlib.errors import CommlibError

WORLD = MPI.COMM_WORLD
DEADLINE = float(os.environ.get("COMMLIB_WATCHDOG_TIMEOUT", "600"))
LATE = 1
UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
LENGTHS = [0, 1, 3, 7, 1001, 70001, 300001]     # MPI's own path and shared memory


def report(**fields):
    """One record in one write (the ranks share the pipe)."""
    sys.stdout.flush()
    os.write(1, ("ASYNC " + json.dumps(fields) + "\n").encode())


def inputs(rank, dtype, lengths, op, seed):
    """Small integers: every reduction, and every average's sum, is exact."""
    rng = np.random.default_rng([seed, rank])
    low, high = (1, 3) if op == "prod" else (-20, 21)
    return [rng.integers(low, high, n).astype(dtype) for n in lengths]


def reference(everyone, op, size):
    """Rank-order numpy reduction of every rank's list; ``avg``: the sum
    times ``1/size`` in the arrays' dtype (commlib's definition)."""
    out = []
    for k in range(len(everyone[0])):
        acc = everyone[0][k].copy()
        for e in everyone[1:]:
            acc = UFUNCS["sum" if op == "avg" else op](acc, e[k]).astype(acc.dtype)
        if op == "avg":
            acc = acc * acc.dtype.type(1.0 / size)
        out.append(acc)
    return out


def same(got, want, what):
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, w.dtype)
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), (what, k, g[:5], w[:5])


def results(comm):
    """Every op and dtype, odd, empty and large lengths, async == numpy
    reference == the synchronous path of a second communicator; several
    handles outstanding at once; an empty list."""
    other = commlib.Communicator.from_mpi()
    cases = [(d, op) for d in ("float32", "float64", "int32", "float16")
             for op in UFUNCS] + [("float32", "avg"), ("float64", "avg")]
    works, sync = [], []
    for seed, (dtype, op) in enumerate(cases):
        mine = inputs(comm.rank, dtype, LENGTHS, op, seed)
        works.append((comm.all_reduce(mine, op=op, async_op=True), mine, dtype, op, seed))
        twin = inputs(comm.rank, dtype, LENGTHS, op, seed)
        other.all_reduce(twin, op=op)
        sync.append(twin)
    for (work, mine, dtype, op, seed), twin in zip(works, sync):
        assert work.wait() is mine and work.done()
        want = reference(WORLD.allgather(inputs(comm.rank, dtype, LENGTHS, op, seed)),
                         op, comm.size)
        same(mine, want, (dtype, op, "reference"))
        same(mine, twin, (dtype, op, "sync"))
    assert comm.all_reduce([], async_op=True).wait() == []
    big = np.arange(4_000_001, dtype=np.float32) % 97 + comm.rank
    twin = big.copy()
    comm.all_reduce(big, op="avg", async_op=True).wait()
    other.all_reduce(twin, op="avg")
    want = reference(WORLD.allgather([np.arange(4_000_001, dtype=np.float32) % 97 + comm.rank]),
                     "avg", comm.size)
    same([big], want, "large")
    same([big], [twin], "large sync")
    other.close()


def compression(comm):
    """fp16, bf16, top-K, threshold and partial over 3 steps: async results
    equal the synchronous ones of a second communicator bit for bit (error
    feedback residuals and partial windows carry over alike); fp16 sums of
    small integers equal the numpy reference."""
    other = commlib.Communicator.from_mpi()
    shapes = [1001, 7, 70001, 3]
    for name in ("fp16", "bf16", "topk", "threshold", "partial"):
        for step in range(3):
            strategy = {"fp16": "fp16", "bf16": "bf16", "topk": TopK(0.1),
                        "threshold": Threshold(0.5), "partial": Partial(0.3)}[name]
            rng = np.random.default_rng([step, comm.rank, len(name)])
            mine = [(rng.integers(-8, 9, n) if name == "fp16" else rng.standard_normal(n))
                    .astype(np.float32) for n in shapes]
            twin = [a.copy() for a in mine]
            gathered = WORLD.allgather(mine)
            op = "sum" if name == "fp16" else "avg"
            comm.all_reduce(mine, op=op, compression=strategy, async_op=True).wait()
            other.all_reduce(twin, op=op, compression=strategy)
            same(mine, twin, (name, step))
            if name == "fp16":
                same(mine, reference(gathered, "sum", comm.size), (name, step, "reference"))
    other.close()


def order(comm):
    """Mixed sync and async calls in one order on every rank, with rank LATE
    issuing late: each result is right, a sync call returns only after the
    async ones issued before it completed, and the async calls complete in
    order."""
    rank, n = comm.rank, comm.size
    a = [np.full(300001, rank + 1.0, np.float32)]
    b = [np.full(1001, rank + 1.0, np.float64)]
    c = np.full(5, float(rank), np.float32)
    if rank == LATE % n:
        time.sleep(0.3)
    wa = comm.all_reduce(a, op="sum", async_op=True)
    wb = comm.all_reduce(b, op="max", async_op=True)
    gathered = comm.all_gather(c)                 # sync, after wa and wb
    assert wa.done() and wb.done()
    wd = comm.all_reduce([c], op="min", async_op=True)
    comm.barrier()
    assert wd.done()
    assert np.array_equal(gathered, np.repeat(np.arange(n, dtype=np.float32), 5).reshape(n, 5))
    assert np.all(wa.wait()[0] == n * (n + 1) / 2) and np.all(wb.wait()[0] == n)
    assert np.all(wd.wait()[0] == 0)
    assert wa.wait()[0] is a[0]                    # a second wait: the same arrays
    report(what="order", rank=rank)


def progress(comm):
    """done() is False while a peer has not issued, never blocks, and turns
    True by itself once the peer came (no wait needed)."""
    rank = comm.rank
    x = [np.full(70001, rank + 1.0, np.float32)]
    if rank == LATE:
        time.sleep(1.0)
    start = time.monotonic()
    work = comm.all_reduce(x, op="sum", async_op=True)
    issued = time.monotonic() - start
    polls, early, longest = 0, None, 0.0
    while True:
        t = time.monotonic()
        finished = work.done()
        longest = max(longest, time.monotonic() - t)
        if early is None:
            early = finished
        if finished:
            break
        polls += 1
        time.sleep(0.001)
    assert np.all(work.wait()[0] == comm.size * (comm.size + 1) / 2)
    report(what="progress", rank=rank, issued=issued, early=early, longest=longest,
           waited=time.monotonic() - start)


def mismatch(comm):
    """Rank LATE issues an async all-reduce of another length: every rank's
    wait() raises ConsistencyError naming the ranks of each call; the
    communicator stays usable."""
    rank = comm.rank
    x = [np.ones(1001 if rank != LATE else 1002, np.float32)]
    before = x[0].copy()
    work = comm.all_reduce(x, async_op=True)
    try:
        work.wait()
        raise AssertionError("no error")
    except commlib.ConsistencyError as exc:
        report(what="mismatch", rank=rank, culprits=list(exc.culprits), message=str(exc))
    assert np.array_equal(x[0], before)
    y = [np.ones(11, np.float32)]
    assert np.all(comm.all_reduce(y, async_op=True).wait()[0] == comm.size)


def bad_argument(comm):
    """Rank LATE passes an integer array with op="avg": its wait() raises
    ArrayTypeError, the others' ConsistencyError naming it."""
    rank = comm.rank
    x = [np.ones(1001, np.int32 if rank == LATE else np.float32)]
    try:
        comm.all_reduce(x, op="avg", async_op=True).wait()
        raise AssertionError("no error")
    except CommlibError as exc:
        report(what="bad_argument", rank=rank, error=type(exc).__name__,
               culprits=list(getattr(exc, "culprits", ())), message=str(exc))


def _failing(comm, misbehave):
    """Async all-reduces of a good step, then one that rank LATE spoils with
    ``misbehave()``; the others report what wait() raised, how long it
    took, whether the arrays were untouched and stay so."""
    rank = comm.rank
    for length in (1001, 300001):
        x = [np.full(length, rank + 1.0, np.float32)]
        comm.all_reduce(x, async_op=True).wait()
    x = [np.full(300001, rank + 1.0, np.float32), np.full(1001, rank + 1.0, np.float32)]
    before = [a.copy() for a in x]
    if rank == LATE:
        misbehave()
    start = time.monotonic()
    work = comm.all_reduce(x, async_op=True)
    error = None
    try:
        work.wait()
    except CommlibError as exc:
        error = exc
    seconds = time.monotonic() - start
    report(what="failed", rank=rank, error=type(error).__name__ if error else None,
           culprits=list(getattr(error, "culprits", ())), seconds=seconds,
           untouched=all(np.array_equal(a, b) for a, b in zip(x, before)),
           message=str(error))
    time.sleep(DEADLINE + 2.0 if rank != LATE else 0.5)    # the late rank has come and gone
    report(what="after", rank=rank,
           written_after=not all(np.array_equal(a, b) for a, b in zip(x, before)))
    try:
        comm.all_reduce(x, async_op=True).wait()
        later = None
    except CommlibError as exc:
        later = type(exc).__name__
    report(what="later", rank=rank, error=later)


def stall(comm):
    """Rank LATE issues DEADLINE + 1.5 s late: the others' wait() raises
    CollectiveTimeoutError naming it within the deadline."""
    _failing(comm, lambda: time.sleep(DEADLINE + 1.5))


def crash(comm):
    """Rank LATE raises (its exception hook tells the others): their wait()
    raises PeerError naming it."""
    def fail():
        time.sleep(0.3)
        raise RuntimeError("rank %d breaks down" % LATE)
    _failing(comm, fail)


def killed(comm):
    """Rank LATE is killed (SIGKILL): the others' wait() raises PeerError
    naming it, if they notice before mpiexec ends the job."""
    _failing(comm, lambda: (time.sleep(0.3), os.kill(os.getpid(), signal.SIGKILL)))


def vanished(comm):
    """Rank LATE ends with ``os._exit(0)`` once every rank completed a good
    step, while the others wait for an async all-reduce of both sizes:
    their wait() raises PeerError naming it; they report and leave at once
    (MPI cannot finalize with a rank missing)."""
    rank = comm.rank
    x = [np.full(300001, rank + 1.0, np.float32), np.full(1001, rank + 1.0, np.float32)]
    comm.all_reduce([a.copy() for a in x], async_op=True).wait()
    WORLD.Barrier()
    if rank == LATE:
        os._exit(0)
    before = [a.copy() for a in x]
    start = time.monotonic()
    work = comm.all_reduce(x, async_op=True)
    try:
        work.wait()
        error = None
    except CommlibError as exc:
        error = exc
    report(what="failed", rank=rank, error=type(error).__name__ if error else None,
           culprits=list(getattr(error, "culprits", ())), seconds=time.monotonic() - start,
           untouched=all(np.array_equal(a, b) for a, b in zip(x, before)), message=str(error))
    os._exit(0)


def interrupt(comm):
    """Ctrl-C on rank 0 while it waits for an async all-reduce that rank LATE
    has not issued: rank 0's wait() raises KeyboardInterrupt at once and its
    communicator is unusable; rank LATE's wait() raises PeerError naming 0;
    nobody's arrays change."""
    rank = comm.rank
    x = [np.full(300001, rank + 1.0, np.float32)]
    before = x[0].copy()
    if rank == LATE:
        time.sleep(1.5)
    else:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    work = comm.all_reduce(x, async_op=True)
    try:
        work.wait()
        error = None
    except (CommlibError, KeyboardInterrupt) as exc:
        error = exc
    seconds = time.monotonic() - start
    time.sleep(1.0)
    try:
        comm.all_reduce([np.ones(3, np.float32)])
        later = None
    except CommlibError as exc:
        later = type(exc).__name__
    report(what="interrupt", rank=rank, error=type(error).__name__ if error else None,
           culprits=list(getattr(error, "culprits", ())), seconds=seconds,
           untouched=bool(np.array_equal(x[0], before)), later=later)


def _count_deferrals():
    """Record, for every all-reduce left in flight, how many earlier ones
    were in flight then (commlib.progress.work.Progress.defer)."""
    import commlib.progress.work
    seen = []
    defer = commlib.progress.work.Progress.defer

    def counting(self, flight):
        seen.append(len(self.in_flight()))
        return defer(self, flight)

    commlib.progress.work.Progress.defer = counting
    return seen


def pipelined(comm):
    """Over MPI (the test turns shared memory off): async all-reduces issued
    back to back, pipelined up to COMMLIB_ASYNC_DEPTH in flight: every op
    and dtype, empty, odd and multi-piece (> 4 MiB) lengths, separate
    (packed) and consecutive (zero-copy) arrays, equal the numpy reference
    and the synchronous path of a second communicator bit for bit; arrays
    issued again while in flight (the same list, or views overlapping it)
    see the first result, as one after the other would; compressed and
    other collectives queued in between run after the ones in flight."""
    seen = _count_deferrals()
    rank, n = comm.rank, comm.size
    other = commlib.Communicator.from_mpi()
    cases = [(d, op) for d in ("float32", "float64", "int32", "float16")
             for op in UFUNCS] + [("float32", "avg"), ("float64", "avg")]
    works = []
    for seed, (dtype, op) in enumerate(cases):
        # a multi-piece length with every dtype, for the sums and averages
        lengths = LENGTHS + [1_100_001] * (op in ("sum", "avg"))
        mine = inputs(rank, dtype, lengths, op, seed)
        works.append((comm.all_reduce(mine, op=op, async_op=True), mine, dtype, op, seed,
                      lengths))
    flat = commlib.flat_arrays([(300, 7), (1,), (2049,), (5, 5)], "float32")
    for j, a in enumerate(flat):
        a[...] = np.random.default_rng([rank, j]).integers(-20, 21, a.shape)
    flat_in = [a.copy() for a in flat]
    flat_work = comm.all_reduce(flat, op="avg", async_op=True)
    for work, mine, dtype, op, seed, lengths in works:
        assert work.wait() is mine
        want = reference(WORLD.allgather(inputs(rank, dtype, lengths, op, seed)), op, n)
        same(mine, want, (dtype, op, "reference"))
        twin = inputs(rank, dtype, lengths, op, seed)
        other.all_reduce(twin, op=op)
        same(mine, twin, (dtype, op, "sync"))
    flat_work.wait()
    same(flat, reference(WORLD.allgather(flat_in), "avg", n), "zero-copy")
    # the same memory again while in flight: as if one after the other
    x = [np.full(70001, rank + 1.0, np.float64), np.full(5, rank + 2.0, np.float64)]
    first = comm.all_reduce(x, op="sum", async_op=True)
    again = comm.all_reduce(x, op="sum", async_op=True)
    base = np.arange(1000, dtype=np.float64) + rank
    view_a, view_b = base[:600], base[500:]                  # overlapping views
    wa = comm.all_reduce([view_a], op="sum", async_op=True)
    wb = comm.all_reduce([view_b], op="sum", async_op=True)
    again.wait(), first.wait(), wb.wait(), wa.wait()
    total = sum(r + 1.0 for r in range(n))
    assert np.all(x[0] == total * n) and np.all(x[1] == sum(r + 2.0 for r in range(n)) * n)
    every = [np.arange(1000, dtype=np.float64) + r for r in range(n)]
    after_a = [e.copy() for e in every]
    for e in after_a:
        e[:600] = sum(v[:600] for v in every)
    after_b = [e.copy() for e in after_a]
    for e in after_b:
        e[500:] = sum(v[500:] for v in after_a)
    assert np.array_equal(base, after_b[rank]), "overlapping views"
    # other collectives between all-reduces in flight
    y = [np.full(300001, rank + 1.0, np.float32)]
    z = [np.random.default_rng([rank, 9]).standard_normal(10001).astype(np.float32)]
    ztwin = [z[0].copy()]
    w1 = comm.all_reduce(y, op="max", async_op=True)
    w2 = comm.all_reduce(z, op="avg", compression=TopK(0.1), async_op=True)
    b = [np.full(1001, float(rank), np.float32)]
    comm.broadcast(b, root=n - 1)
    g = comm.all_gather(np.array([rank], np.int64))
    w1.wait(), w2.wait()
    other.all_reduce(ztwin, op="avg", compression=TopK(0.1))
    assert np.all(y[0] == n) and np.all(b[0] == n - 1) and g.reshape(-1).tolist() == list(range(n))
    same(z, ztwin, "compressed between")
    other.close()
    report(what="pipelined", rank=rank, deferred=len(seen), most=max(seen, default=-1))


def hang_in_flight(comm):
    """Rank LATE stalls past the deadline inside the data phase of the third
    of five async all-reduces (once the first two completed, its MPI request
    starts too late): on the others the first two complete, the third
    (started, in flight) fails with CollectiveTimeoutError, every later one
    with a CommlibError, and none of the failed ones writes into its arrays,
    then or later; every rank's communicator is unusable."""
    rank = comm.rank
    if rank == LATE:
        from commlib.transport.mpi import MpiTransport
        call, calls = MpiTransport._call, []

        def stalling(self, name, *args, **kwargs):
            if name == "Iallreduce":
                calls.append(1)
                if len(calls) == 3:
                    comm._session.progress.complete_flight()
                    time.sleep(DEADLINE + 3.0)
            return call(self, name, *args, **kwargs)

        MpiTransport._call = stalling
    xs = [[np.full(200001, rank + 1.0 + k, np.float32)] for k in range(5)]
    before = [x[0].copy() for x in xs]
    works = [comm.all_reduce(x, op="sum", async_op=True) for x in xs]
    outcome = []
    for work in works:
        try:
            work.wait()
            outcome.append(None)
        except CommlibError as exc:
            outcome.append([type(exc).__name__, list(getattr(exc, "culprits", ())), str(exc)])
    right = [bool(np.all(x[0] == sum(r + 1.0 + k for r in range(comm.size))))
             for k, x in enumerate(xs)]
    time.sleep(DEADLINE + 4.0 if rank != LATE else 0.5)      # past the late start
    untouched = [bool(np.array_equal(x[0], b)) for x, b in zip(xs, before)]
    try:
        comm.all_reduce([np.ones(3, np.float32)])
        later = None
    except CommlibError as exc:
        later = type(exc).__name__
    report(what="hang", rank=rank, outcome=outcome, right=right, untouched=untouched,
           later=later)


SHAPES = [(64, 3, 7, 7), (64,), (64,), (256, 64, 1, 1), (256,), (1001,), (3,), (17, 19),
          (256, 256, 3, 3), (1000, 2048), (1000,)]


def reducer(comm):
    """BackwardReducer over flat_arrays gradients: buckets in reverse order,
    one dtype each, within bucket_bytes; ready() in a different random
    order on every rank; results equal the numpy average of every rank's
    gradients and, bit for bit, the synchronous per-bucket path of a second
    communicator; ready() twice raises naming the index and the rank."""
    rank = comm.rank
    other = commlib.Communicator.from_mpi()
    grads = commlib.flat_arrays(SHAPES, "float32")
    twins = commlib.flat_arrays(SHAPES, "float32")
    red = commlib.BackwardReducer(comm, grads, bucket_bytes=1 << 20)
    buckets = red.buckets
    assert sorted(j for b in buckets for j in b) == list(range(len(SHAPES)))
    flat_order = [j for b in buckets for j in reversed(b)]
    assert flat_order == list(range(len(SHAPES) - 1, -1, -1)), buckets
    for b in buckets:
        assert b == sorted(b)
        nbytes = sum(grads[j].nbytes for j in b)
        assert len(b) == 1 or nbytes <= 1 << 20, (b, nbytes)
    rng = np.random.default_rng(rank)
    for step in range(3):
        for j, (g, t) in enumerate(zip(grads, twins)):
            g[...] = np.random.default_rng([step, rank, j]).integers(-9, 10, g.shape)
            t[...] = g
        mine = [g.copy() for g in grads]
        for j in rng.permutation(len(grads)):
            red.ready(int(j))
        assert red.wait() is not None
        for b in buckets:
            other.all_reduce([twins[j] for j in b], op="avg")
        everyone = WORLD.allgather(mine)
        same(grads, reference(everyone, "avg", comm.size), ("reducer", step))
        same(grads, twins, ("reducer sync", step))
    red.ready(2)
    try:
        red.ready(2)
        raise AssertionError("ready twice accepted")
    except commlib.ArgumentError as exc:
        assert "ready(2)" in str(exc) and "rank %d" % rank in str(exc), str(exc)
    red.wait()
    other.close()
    report(what="buckets", rank=rank, buckets=buckets)


def stats(comm):
    """bytes_sent: 4 N per dense all-reduce of N float32 (every transport
    path), half with fp16; collectives counts every call; blocked_seconds
    grows while waiting for a late peer."""
    rank = comm.rank
    comm.stats.reset()
    counts = []
    for n in (1001, 300001):
        before = comm.stats.bytes_sent
        comm.all_reduce([np.ones(n, np.float32)], async_op=True).wait()
        dense = comm.stats.bytes_sent - before
        before = comm.stats.bytes_sent
        comm.all_reduce([np.ones(n, np.float32)], compression="fp16", async_op=True).wait()
        half = comm.stats.bytes_sent - before
        counts.append((n, dense, half))
    comm.stats.reset()
    assert comm.stats.snapshot() == {"bytes_sent": 0, "collectives": 0, "blocked_seconds": 0.0}
    if rank == LATE:
        time.sleep(0.5)
    comm.all_reduce([np.ones(5, np.float32)], async_op=True).wait()
    comm.barrier()
    snap = comm.stats.snapshot()
    report(what="stats", rank=rank, counts=counts, snapshot=snap)


def deferred(comm):
    """With MPI_THREAD_SERIALIZED (mpi4py.rc.thread_level) async collectives
    run when waited for, with the same results."""
    rank = comm.rank
    assert MPI.Query_thread() < MPI.THREAD_MULTIPLE
    x = [np.full(70001, rank + 1.0, np.float32)]
    work = comm.all_reduce(x, op="sum", async_op=True)
    time.sleep(0.3)
    early = work.done()
    y = [np.full(3, rank + 1.0, np.float32)]
    w2 = comm.all_reduce(y, op="max", async_op=True)
    assert np.all(work.wait()[0] == comm.size * (comm.size + 1) / 2)
    assert not comm._session.progress.threaded
    comm.barrier()                                   # runs w2 first
    assert w2.done() and np.all(y[0] == comm.size)
    report(what="deferred", rank=rank, early=early)


def gpu(comm):
    """cupy arrays (NCCL where usable): the collective runs after the work
    issued on the caller's stream before it, and work issued after wait()
    on that stream sees its result, without host synchronisation; done()
    turns True; a BackwardReducer over cupy flat_arrays equals the numpy
    average of every rank's gradients."""
    import cupy
    rank, n = comm.rank, comm.size
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.zeros(1 << 24, cupy.float32)
        for _ in range(20):                          # still running when the call is issued
            x += 0.05 * (rank + 1)
        work = comm.all_reduce([x], op="sum", async_op=True)
        y = work.wait()[0] * 2                       # ordered after the collective
        got = cupy.asnumpy(y, stream=stream)
        stream.synchronize()
    want = 2 * sum(np.float32(0.05 * (r + 1)) * 20 for r in range(n))
    assert np.allclose(got, want, rtol=1e-4), (got[:4], want)
    deadline = time.monotonic() + 30
    while not work.done():
        assert time.monotonic() < deadline, "done() never turned True"
        time.sleep(0.001)
    grads = commlib.flat_arrays(SHAPES, "float32", xp=cupy)
    red = commlib.BackwardReducer(comm, grads, bucket_bytes=1 << 20)
    mine = []
    for j, g in enumerate(grads):
        host = np.random.default_rng([rank, j]).integers(-9, 10, g.shape).astype(np.float32)
        g.set(host)
        mine.append(host)
    for j in np.random.default_rng(rank).permutation(len(grads)):
        red.ready(int(j))
    red.wait()
    same([cupy.asnumpy(g) for g in grads], reference(WORLD.allgather(mine), "avg", n),
         "gpu reducer")
    report(what="gpu", rank=rank, backend=comm.backend)


def main(scenario):
    comm = commlib.init()
    globals()[scenario](comm)
    comm.close()
    report(what="ok", rank=comm.rank)


if __name__ == "__main__":
    main(*sys.argv[1:])
