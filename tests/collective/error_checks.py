"""Error checks run inside MPI jobs (imported by tests/collective/test_errors.py)."""
import os
import sys
import time

import numpy as np

import commlib
from mpi4py import MPI
from commlib import errors


def expect(exc_type, fragments, fn):
    """Call ``fn``; assert it raises exactly ``exc_type`` (not a subclass)
    whose text holds every fragment."""
    try:
        fn()
    except exc_type as exc:
        assert type(exc) is exc_type, "%s raised, not %s: %s" % (
            type(exc).__name__, exc_type.__name__, exc)
        text = str(exc)
        for frag in fragments:
            assert frag in text, "%r not in %r" % (frag, text)
        return exc
    raise AssertionError("%s was not raised" % exc_type.__name__)


def argument_errors(comm):
    r = comm.rank
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    keep = a.copy()
    expect(errors.ArrayTypeError, ["rank %d" % r, "arrays[1]", "not C-contiguous"],
           lambda: comm.all_reduce([a, a[:, ::2]]))
    ro = np.ones(3, np.float32)
    ro.setflags(write=False)
    expect(errors.ArrayTypeError, ["arrays[0]", "read-only"], lambda: comm.all_reduce(ro))
    expect(errors.ArrayTypeError, ["arrays[1]", "complex64", "supported dtypes"],
           lambda: comm.all_reduce([a, np.ones(2, np.complex64)]))
    swapped = np.ones(5, np.float32).astype(">f4" if np.little_endian else "<f4")
    expect(errors.ArrayTypeError, ["arrays[1]", "float32", "byte order"],
           lambda: comm.all_reduce([a, swapped]))
    expect(errors.ArrayTypeError, ["int32", "floating dtype"],
           lambda: comm.all_reduce(np.ones(2, np.int32), op="avg"))
    expect(errors.ArrayTypeError, ["int64", "floating dtype"],
           lambda: comm.all_reduce([np.ones(2, np.int64)], division=True))
    expect(errors.ArrayTypeError, ["arrays[1]", "got list"], lambda: comm.all_reduce([a, [1, 2]]))
    expect(errors.ArrayTypeError, ["got str"], lambda: comm.all_reduce("grads"))
    expect(errors.ArgumentError, ["op='mean'", "sum, avg, max, min"],
           lambda: comm.all_reduce(a, op="mean"))
    expect(errors.ArgumentError, ["arrays[1] is the same array as arrays[0]"],
           lambda: comm.all_reduce([a, a]))
    expect(errors.ArgumentError, ["root=%d is out of range" % comm.size, "size %d" % comm.size],
           lambda: comm.broadcast(a, root=comm.size))
    expect(errors.ArgumentError, ["root=-1"], lambda: comm.reduce([a], root=-1))
    if comm.size > 1:
        expect(errors.ArgumentError, ["divisible by size=%d" % comm.size,
                                      "array.size=%d" % (comm.size * 3 + 1)],
               lambda: comm.reduce_scatter(np.ones(comm.size * 3 + 1)))
    expect(errors.ArgumentError, ["one array"], lambda: comm.all_gather([a]))
    expect(errors.ArgumentError, ["timeout"], lambda: comm.barrier(timeout=-1))
    expect(errors.ArgumentError, ["bucket_bytes"],
           lambda: commlib.Communicator.from_mpi(bucket_bytes=0))
    assert np.array_equal(a, keep), "input changed by a rejected call"
    # the communicator still works after rejected calls
    x = np.full(3, r + 1.0)
    comm.all_reduce(x)
    assert (x == comm.size * (comm.size + 1) / 2).all()
    comm.close()
    comm.close()
    expect(errors.ClosedError, ["rank %d" % r, "after close()"], lambda: comm.all_reduce(x))
    expect(errors.ClosedError, ["barrier"], lambda: comm.barrier())


def consistency_errors(comm):
    assert comm.check
    r = comm.rank
    # shapes differ on the last rank
    x = np.ones(5 if r != comm.size - 1 else 6, np.float32)
    exc = expect(errors.ConsistencyError, ["disagree", "float32(5,)", "float32(6,)",
                                           "[%d]" % (comm.size - 1)],
                 lambda: comm.all_reduce(x))
    # ops differ
    expect(errors.ConsistencyError, ["op=max", "op=sum"],
           lambda: comm.all_reduce(np.ones(3), op="max" if r == 0 else "sum"))
    # a bad argument on rank 1 only: rank 1 gets its own error, the others a consistency error
    bad = np.ones(3, np.complex64) if r == 1 else np.ones(3, np.float32)
    if r == 1:
        expect(errors.ArrayTypeError, ["complex64"], lambda: comm.all_reduce(bad))
    else:
        expect(errors.ConsistencyError, ["rank 1 rejected its arguments", "complex64"],
               lambda: comm.all_reduce(bad))
    # a skipped collective: rank 0 calls barrier while the others all_reduce
    if r == 0:
        expect(errors.ConsistencyError, ["barrier", "all_reduce"], lambda: comm.barrier())
    else:
        expect(errors.ConsistencyError, ["barrier", "all_reduce"],
               lambda: comm.all_reduce(np.ones(2)))
    # values to agree on differ on the last rank only (rank 0 when size 1 is
    # excluded): every rank raises, naming both values and the odd rank out
    odd = comm.size - 1
    lr = 0.05 if r == odd else 0.1
    z = np.full(3, float(r))
    keep = z.copy()
    expect(errors.ConsistencyError, ["agree=(('group 0 lr', 0.1),)",
                                     "agree=(('group 0 lr', 0.05),)", "ranks [%d]" % odd],
           lambda: comm.all_reduce(z, op="avg", agree=(("group 0 lr", lr),)))
    assert np.array_equal(z, keep), "written after a disagreement"
    # a value that is not plain is this rank's argument error
    if r == 0:
        expect(errors.ArgumentError, ["agree must be None or a tuple", "rank 0"],
               lambda: comm.all_reduce(z, agree=[1]))
    else:
        expect(errors.ConsistencyError, ["rank 0 rejected its arguments", "agree"],
               lambda: comm.all_reduce(z, agree=(1,)))
    comm.all_reduce(z, op="avg", agree=(("group 0 lr", 0.1), ("momentum", 0.9)))
    assert np.allclose(z, sum(range(comm.size)) / comm.size)
    shared_memory(comm)
    # agreement afterwards: results are right again
    y = np.full(4, float(r))
    comm.all_reduce(y)
    assert (y == sum(range(comm.size))).all()
    print("consistency %d ok (%s)" % (r, str(exc).splitlines()[0]))


def shared_memory(comm):
    """Arrays that share memory, on one rank (rank 0, then the last) or on
    all, and a list made read-only after it was passed before: the rank
    raises naming the arrays, the others name that rank, and nothing is
    written anywhere (every element would otherwise be reduced twice)."""
    r, n = comm.rank, comm.size
    for odd in sorted({0, n - 1}):
        b = np.full(400_000, r + 1.0, np.float32)       # above a bucket's size
        w = np.full(1000, r + 1.0, np.float32)
        mine = {"alias": [b, b[:]] if r == odd else [b, np.full_like(b, r + 1.0)],
                "overlap": [w[:600], w[400:]] if r == odd else [w[:600], w[600:1000].copy()
                                                                 .repeat(2)[:600]]}
        for name, arrays in mine.items():
            keep = [a.copy() for a in arrays]
            if r == odd:
                expect(errors.ArgumentError, ["rank %d: arrays[1] shares memory with "
                                              "arrays[0]" % r], lambda: comm.all_reduce(arrays))
            else:
                expect(errors.ConsistencyError, ["rank %d rejected its arguments" % odd,
                                                 "memory"], lambda: comm.all_reduce(arrays))
            assert all(np.array_equal(a, k) for a, k in zip(arrays, keep)), name
    both = np.arange(10, dtype=np.float64)
    expect(errors.ArgumentError, ["arrays[1] shares memory with arrays[0]"],
           lambda: comm.all_reduce([both[:6], both[5:]]))
    assert (both == np.arange(10)).all()
    # a list reduced before (its checks are kept), then one array made
    # read-only on one rank: it raises before any write, on every rank
    for odd in sorted({0, n - 1}):
        grads = [np.full(s, r + 1.0, np.float32) for s in (3, 300_000, 7, 5)]
        for _ in range(3):
            comm.all_reduce(grads, op="avg")
        expected = (n + 1) / 2
        assert all(np.allclose(g, expected) for g in grads)
        if r == odd:
            grads[2].setflags(write=False)
        keep = [g.copy() for g in grads]
        if r == odd:
            expect(errors.ArrayTypeError, ["rank %d" % r, "arrays[2] is read-only"],
                   lambda: comm.all_reduce(grads, op="avg"))
        else:
            expect(errors.ConsistencyError, ["rank %d rejected its arguments" % odd,
                                             "read-only"],
                   lambda: comm.all_reduce(grads, op="avg"))
        assert all(np.array_equal(g, k) for g, k in zip(grads, keep)), "written"
    x = np.full(4, float(r))
    comm.all_reduce(x)                      # usable afterwards
    assert (x == sum(range(n))).all()


def watchdog(comm, what):
    """Rank 0 waits in a collective that rank 1 never joins."""
    r = comm.rank
    if r == 0:
        start = time.monotonic()
        calls = {"barrier": lambda: comm.barrier(timeout=1.0),
                 "all_reduce": lambda: comm.all_reduce(np.ones(10)),
                 # 512 KiB: the shared-memory path on one node
                 "all_reduce_shm": lambda: comm.all_reduce([np.ones(1 << 15), np.ones(1 << 15)])}
        call = calls[what]
        what = what.replace("_shm", "")
        expect(errors.CollectiveTimeoutError, ["rank 0", what, "deadline"], call)
        took = time.monotonic() - start
        assert took < 10, took
        expect(errors.ClosedError, ["unusable"], lambda: comm.all_reduce(np.ones(3)))
        print("watchdog %s ok after %.1fs" % (what, took), flush=True)
    else:
        time.sleep(4)
        print("watchdog rank 1 stayed out for 4 s", flush=True)
    sys.stdout.flush()
    os._exit(0)   # rank 0's call is still open: skip MPI_Finalize


def uncaught_exception():
    """Rank 1 raises while the others wait in a collective."""
    comm = commlib.init()
    if comm.rank == 1:
        raise RuntimeError("rank one failed")
    comm.all_reduce(np.ones(4))   # would block forever without the abort hook


def exit_nonzero():
    """Rank 1 leaves with sys.exit(3) while the others wait in a collective."""
    comm = commlib.Communicator.from_mpi(backend="mpi")
    if comm.rank == 1:
        sys.exit(3)
    comm.all_reduce(np.ones(4))
    print("not reached", flush=True)


def main(which):
    if which in ("uncaught_exception", "exit_nonzero"):
        return globals()[which]()
    if which == "arguments":
        argument_errors(commlib.Communicator.from_mpi())
    elif which == "consistency":
        consistency_errors(commlib.Communicator.from_mpi(check=True))
    elif which == "consistency_env":
        consistency_errors(commlib.init())
    elif which == "watchdog_env":
        watchdog(commlib.init(), "all_reduce")
    elif which == "watchdog_shm":
        watchdog(commlib.init(), "all_reduce_shm")
    elif which == "barrier_timeout":
        watchdog(commlib.init(), "barrier")
    print("errors %s rank %d ok" % (which, MPI.COMM_WORLD.Get_rank()))


if __name__ == "__main__":
    main(sys.argv[1])
