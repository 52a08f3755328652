"""Rank programs of tests/transport/test_nccl_standin.py: commlib's NCCL
transport, and the NCCL stand-in itself (tests/ops/nccl_standin.py), on the
host build's cupy, under mpiexec. Expected values come from numpy on every
rank's inputs, gathered over plain mpi4py."""
import sys
import time

import numpy as np
from mpi4py import MPI

import commlib
from commlib import errors
from collective_checks import assert_equal, expected_reduce, gathered, make
from compression_checks import check_half
import p2p_checks

WORLD = MPI.COMM_WORLD


def to_host(a):
    import cupy
    return cupy.asnumpy(a)


def nccl_of(comm):
    """The stand-in's NcclCommunicator under ``comm``'s NCCL transport."""
    return comm._session.routes["cupy"].comm


def collectives(comm, rng):
    import cupy
    n, me = comm.size, comm.rank
    # fused lists of odd lengths (empty too), several types and operators
    for dtype, ops in (("float32", ("sum", "avg", "max")), ("float64", ("sum", "min")),
                       ("int32", ("sum", "max")), ("float16", ("sum",)), ("uint8", ("sum",)),
                       ("int64", ("prod",))):
        for op in ops:
            host = [make(rng, dtype, (m,), op) for m in (0, 1, 7, 70001)]
            ins = [gathered(h) for h in host]
            dev = [cupy.asarray(h) for h in host]
            assert comm.all_reduce(dev, op=op) is dev
            for d, i in zip(dev, ins):
                assert_equal(to_host(d), expected_reduce(i, op, n), "%s %s" % (dtype, op))
    host = make(rng, "float32", (3, 5))
    ins = gathered(host)
    dev = cupy.asarray(host)
    comm.all_reduce(dev, division=True)
    assert_equal(to_host(dev), expected_reduce(ins, "avg", n), "division")
    # half-precision compression (float16 and bfloat16 wire, grouped calls)
    for seed, (op, fmt) in enumerate((("sum", "fp16"), ("avg", "bf16"))):
        check_half(comm, cupy, to_host, op, False, 900 + seed, False, fmt)
    for root in range(n):
        host = [make(rng, "float32", (m,)) for m in (1, 33, 70001)]
        want = [gathered(h)[root] for h in host]
        dev = [cupy.asarray(h) for h in host]
        comm.broadcast(dev, root=root)
        for d, w in zip(dev, want):
            assert_equal(to_host(d), w, "broadcast from %d" % root)
        h = make(rng, "float64", (999,))
        ins = gathered(h)
        d = cupy.asarray(h)
        comm.reduce(d, root=root, op="max")
        assert_equal(to_host(d), expected_reduce(ins, "max", n) if me == root else h,
                     "reduce to %d" % root)
    h = make(rng, "int32", (3, 5))
    assert_equal(to_host(comm.all_gather(cupy.asarray(h))), np.stack(gathered(h)), "all_gather")
    h = make(rng, "float32", (n * 1001,))
    ins = gathered(h)
    got = comm.reduce_scatter(cupy.asarray(h))
    assert_equal(to_host(got), expected_reduce(ins, "sum", n)[me * 1001:(me + 1) * 1001],
                 "reduce_scatter")
    h = make(rng, "float32", ((me * 3) % 4,))          # rank 0: empty
    values, counts = comm.all_gatherv(cupy.asarray(h))
    assert_equal(to_host(values), np.concatenate(gathered(h)), "all_gatherv")
    assert list(counts) == [(r * 3) % 4 for r in range(n)], counts
    # asynchronous calls: issued together, waited for in any order
    host = [make(rng, "float32", (m,)) for m in (5, 70001)]
    ins = [gathered(h) for h in host]
    dev = [cupy.asarray(h) for h in host]
    works = [comm.all_reduce(d, async_op=True) for d in dev]
    for w in reversed(works):
        w.wait()
    for d, i in zip(dev, ins):
        assert_equal(to_host(d), expected_reduce(i, "sum", n), "async all_reduce")
    comm.barrier(timeout=60)


def standin(comm_world):
    """The stand-in's own contract, below commlib: send/recv in a group,
    in-place calls, stream order, argument errors, mismatched calls."""
    import cupy
    from cupy.cuda import nccl
    n, me = comm_world.size, comm_world.rank
    cupy.cuda.Device(me).use()
    uid = comm_world.bcast(nccl.get_unique_id() if me == 0 else None)
    c = nccl.NcclCommunicator(n, uid, me)
    assert (c.rank_id(), c.size(), c.device_id()) == (me, n, me)
    stream = cupy.cuda.Stream(non_blocking=True)
    s = stream.ptr
    # a ring of sends and receives in one group (would deadlock ungrouped),
    # and every rank sends to itself too
    big = 300_001                       # > one channel chunk
    a = cupy.asarray(np.arange(big, dtype=np.int64) * (me + 1))
    b = cupy.zeros(big, np.int64)
    own = cupy.zeros(3, np.int64)
    nccl.groupStart()
    c.send(a.data.ptr, big, nccl.NCCL_INT64, (me + 1) % n, s)
    c.recv(b.data.ptr, big, nccl.NCCL_INT64, (me - 1) % n, s)
    c.send(a.data.ptr, 3, nccl.NCCL_INT64, me, s)
    c.recv(own.data.ptr, 3, nccl.NCCL_INT64, me, s)
    nccl.groupEnd()
    event = stream.record()
    stream.synchronize()
    assert event.done
    assert (b.get(stream) == np.arange(big) * ((me - 1) % n + 1)).all()
    assert (own.get(stream) == np.arange(3) * (me + 1)).all()
    # in place: all-gather into its own slot, reduce-scatter from its own
    x = cupy.zeros(4 * n, np.float32)
    x[4 * me:4 * me + 4] = me + 1
    c.allGather(x[4 * me:].data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, s)
    want = np.repeat(np.arange(1, n + 1, dtype=np.float32), 4)
    assert (x.get(stream) == want).all()
    c.reduceScatter(x.data.ptr, x[4 * me:].data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    assert (x.get(stream)[4 * me:4 * me + 4] == n * want[4 * me:4 * me + 4]).all()
    # stream order: an event recorded after a call is not done before it is
    # (the last rank calls once the others have looked at their events)
    y = cupy.full(5, me + 1, np.float32)
    if me == n - 1:
        WORLD.Barrier()
    c.allReduce(y.data.ptr, y.data.ptr, 5, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    event = stream.record()
    if me != n - 1:
        assert not event.done, "an event completed before the collective it follows"
        WORLD.Barrier()
    assert (y.get(stream) == n * (n + 1) / 2).all()
    assert event.done
    # arguments are checked at the call
    for call, text in ((lambda: c.allReduce(y.data.ptr, y.data.ptr, 5, 77, nccl.NCCL_SUM, s),
                        "unknown datatype 77"),
                       (lambda: c.broadcast(y.data.ptr, y.data.ptr, 5, nccl.NCCL_FLOAT32, n, s),
                        "root %d is not a rank of %d" % (n, n)),
                       (lambda: c.allReduce(y.data.ptr, y[1:].data.ptr, 4, nccl.NCCL_FLOAT32,
                                            nccl.NCCL_SUM, s), "overlap but the call is not in")):
        try:
            call()
        except nccl.NcclError as exc:
            assert "NCCL_ERROR_INVALID_ARGUMENT" in str(exc) and text in str(exc), exc
        else:
            raise AssertionError("accepted: " + text)
    # mismatched calls fail loudly: rank 0 reduces one more element
    z = cupy.ones(8, np.float32)
    c.allReduce(z.data.ptr, z.data.ptr, 7 + (me == 0), nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    text, end = None, time.monotonic() + 60
    while text is None:
        assert time.monotonic() < end, "rank %d: a mismatched allReduce passed" % me
        try:
            c.check_async_error()
        except nccl.NcclError as exc:
            text = str(exc)
        time.sleep(0.01)
    assert not stream.record().done, "failed work finished before the abort"
    if me == 0:
        assert "NCCL_ERROR_INVALID_USAGE" in text and "count 8 here, 7 on rank" in text, text
    else:
        assert ("NCCL_ERROR_INVALID_USAGE" in text and "count 7 here, 8 on rank 0" in text) or (
            "NCCL_ERROR_REMOTE_ERROR" in text and "failed" in text), text
    try:
        c.allReduce(z.data.ptr, z.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    except nccl.NcclError as exc:
        assert "asynchronous error" in str(exc), exc
    else:
        raise AssertionError("a call on a failed communicator was taken")
    c.abort()
    assert (z.get(stream) == 1).all(), "a mismatched call wrote its output"
    try:
        c.check_async_error()
    except nccl.NcclError as exc:
        assert "NCCL_ERROR_INVALID_ARGUMENT" in str(exc) and "NULL" in str(exc), exc
    else:
        raise AssertionError("an aborted communicator's handle is still usable")
    # two ranks on one device: refused on every rank, as NCCL does
    uid = comm_world.bcast(nccl.get_unique_id() if me == 0 else None)
    with cupy.cuda.Device(min(me, 1)):
        try:
            nccl.NcclCommunicator(n, uid, me)
        except nccl.NcclError as exc:
            assert "NCCL_ERROR_INVALID_USAGE" in str(exc) and "Duplicate GPU detected : rank 1 " \
                "and rank 2 both on CUDA device 1" in str(exc), exc
        else:
            raise AssertionError("rank %d: a duplicate device was accepted" % me)


def nccl_only(**options):
    """An NCCL-only communicator of the world (from_nccl_id): numpy arrays
    travel over NCCL too, and its split makes new NCCL communicators whose
    ID the lowest rank of each colour made, sent over this one."""
    import cupy
    me = WORLD.rank
    nid = commlib.NcclId(WORLD.bcast(commlib.NcclId().data if me == 0 else None))
    comm = commlib.Communicator.from_nccl_id(nid, me, WORLD.size, device=me, **options)
    assert comm.transport_for("numpy") == "nccl"
    cupy.cuda.Device(me).use()
    return comm


def nccl_only_grid():
    """A 2x2 grid split from an NCCL-only communicator."""
    import cupy
    me = WORLD.rank
    comm = nccl_only()
    p2p_checks.check_grid(comm, cupy)
    sub = comm.split(me % 2, key=-me)
    assert (sub.rank, sub.size, sub.backend) == (1 - me // 2, 2, "nccl")
    assert nccl_of(sub) is not nccl_of(comm)
    x = np.array([me], np.float64)             # numpy arrays travel over NCCL too
    sub.all_reduce(x)
    assert x[0] == me % 2 * 2 + 2, x
    sub.close()
    comm.close()


def main(cases):
    """Each of the comma-separated ``cases``: ``collectives`` (every call
    over NCCL under an MPI communicator; at 4 ranks grids, at 3 and more
    the stand-in's contract), ``calls`` (the point-to-point, rooted,
    all-to-all, object and split calls alone, on an NCCL-only
    communicator), ``faults``."""
    import cupy
    rng = np.random.default_rng(77 + WORLD.rank)
    for case in cases.split(","):
        if case == "collectives":
            comm = commlib.Communicator.from_mpi(backend="nccl")
            assert comm.backend == "nccl" and comm.device == comm.rank, (comm.backend,
                                                                         comm.device)
            cupy.cuda.Device(comm.device).use()
            collectives(comm, rng)
            calls(comm)
            comm.close()
            if WORLD.size == 4:
                nccl_only_grid()
            if WORLD.size >= 3:
                standin(WORLD)
        elif case == "calls":
            comm = nccl_only()
            calls(comm)
            comm.close()
        else:
            assert case == "faults", case
            faults()
        print("nccl stand-in %s rank %d ok" % (case, WORLD.rank))
        sys.stdout.flush()


def calls(comm):
    """Point-to-point, rooted, all-to-all, object and split calls with cupy
    arrays (empty, odd-length and large): their data over NCCL."""
    import cupy
    p2p_checks.check_p2p(comm, cupy)
    p2p_checks.check_exchanges(comm, cupy)
    if comm.size == 4:
        p2p_checks.check_grid(comm, cupy)


def faults():
    """A rank that never calls: the others' watch aborts the collective,
    CollectiveTimeoutError naming it, nothing written then or after it
    comes. An asynchronous NCCL error on one rank: TransportError naming
    it there; on its peers TransportError with NCCL's remote error naming
    it. A rank that never calls an NCCL-only communicator's split: the
    others' split times out naming it. The misbehaving rank varies, rank 0
    included."""
    import cupy
    n, me = WORLD.size, WORLD.rank
    # an NCCL-only communicator's split that rank 0 never calls: the
    # others' split ends at the deadline naming it
    comm = nccl_only(timeout=1.0)
    if me != 0:
        try:
            comm.split(me % 2)
        except errors.CollectiveTimeoutError as exc:
            assert exc.culprits == (0,), (exc.culprits, str(exc))
            assert "rank %d: split #1 did not complete before its deadline: waiting for rank 0 " \
                   "(has not entered any collective)" % me in str(exc), exc
            print("rank %d: split timed out waiting for rank 0" % me)
        else:
            raise AssertionError("rank %d: split with rank 0 absent returned" % me)
    WORLD.Barrier()                     # rank 0 stays until its peers gave up
    try:
        comm.close()
    except errors.PeerError as exc:     # the absent rank, told it missed a call
        assert me == 0 and "rank 0 entered 0 collectives" in str(exc), exc
    else:
        assert me != 0, "rank 0 closed without a word after missing a split"
    for late in (0, n - 1):
        # a rank that does not call: its peers' entry times out, naming it
        comm = commlib.Communicator.from_mpi(backend="nccl", timeout=2)
        cupy.cuda.Device(comm.device).use()
        x = cupy.full(70001, me + 1, np.float32)
        comm.all_reduce(x)                                     # all arrive
        assert (x.get() == n * (n + 1) / 2).all()
        x[...] = me + 1
        if me != late:
            try:
                comm.all_reduce(x)
                comm.barrier()
            except errors.CollectiveTimeoutError as exc:
                assert exc.culprits == (late,), (exc.culprits, str(exc))
                assert "rank %d" % late in str(exc), exc
                print("rank %d timed out waiting for rank %d" % (me, late))
            else:
                raise AssertionError("rank %d: no timeout with rank %d absent" % (me, late))
            assert (x.get() == me + 1).all(), "written by an abandoned all_reduce"
        WORLD.Barrier()
        if me == late:                  # comes after the others gave up
            y = cupy.full(70001, me + 1, np.float32)
            try:
                comm.all_reduce(y)
                comm.barrier()
            except errors.CommlibError as exc:
                print("late rank %d: %s: %s" % (me, type(exc).__name__, exc))
            else:
                raise AssertionError("the late rank completed with its peers gone")
        WORLD.Barrier()                 # the late rank's call has ended
        assert (x.get() == me + 1).all(), "written after the late rank came"
        comm.close()
    # a rank whose NCCL work hangs (stall: the watch aborts the all_reduce
    # at its deadline, the read waiting until then) or fails (fail: NCCL's
    # asynchronous error): nothing is written, the next call raises
    for how, culprit in (("stall", 0), ("stall", n - 1), ("fail", 0), ("fail", 1)):
        stall = how == "stall"
        comm = commlib.Communicator.from_mpi(backend="nccl", timeout=2 if stall else 60)
        cupy.cuda.Device(comm.device).use()
        x = cupy.full(70001, me + 1, np.float32)
        if me == culprit:
            getattr(nccl_of(comm), how + "_at")(0)
        comm.all_reduce(x)
        assert (x.get() == me + 1).all(), "written by an aborted all_reduce"
        try:
            comm.all_reduce(x)
        except errors.CommlibError as exc:
            (stalled_error if stall else failed_error)(exc, me, culprit)
        else:
            raise AssertionError("rank %d: no error with rank %d %s" % (me, culprit, how))
        assert (x.get() == me + 1).all(), "written after the abort"
        WORLD.Barrier()
        comm.close()


def stalled_error(exc, me, stalled):
    """The error of the all_reduce after one that rank ``stalled`` hung."""
    assert isinstance(exc, (errors.CollectiveTimeoutError, errors.PeerError)), repr(exc)
    assert "all_reduce #1 did not complete before its deadline" in str(exc), exc
    print("rank %d: watch timed out with rank %d stalled" % (me, stalled))


def failed_error(exc, me, failing):
    """The error of the all_reduce after one that failed on rank
    ``failing``: TransportError where this rank's watch saw NCCL's error,
    PeerError citing it where a peer's watch did first and left the board."""
    assert isinstance(exc, (errors.TransportError, errors.PeerError)), repr(exc)
    text = str(exc)
    assert "NCCL reported an error in all_reduce #1: " in text, text
    named = ["rank %d: allReduce #0 failed (injected)" % failing,
             "rank %d aborted its communicator" % failing, "rank %d failed" % failing]
    assert any(t in text for t in named), text
    if isinstance(exc, errors.TransportError):
        assert text.startswith("rank %d: NCCL reported an error in all_reduce #1: " % me), text
    print("rank %d: transport error naming rank %d" % (me, failing))

if __name__ == "__main__":
    main(sys.argv[1])
