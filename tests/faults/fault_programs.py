"""Rank programs of the fault suite (tests/faults/test_faults.py).

``python fault_programs.py SCENARIO`` runs on every rank of an MPI job. Each
rank prints one ``FAULT {json}`` line per call it makes that matters: what
it raised (error class, culprits, message), how long the call took, whether
the arrays it passed were left untouched by a failed call, and whether they
changed after the error was raised (``written_after``: compared again after
the late peer has come and gone).

The watch dog's deadline comes from ``COMMLIB_WATCHDOG_TIMEOUT`` (the test
sets a short one); everything else is commlib's default.
"""
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import commlib
from commlib.compression import Partial, Threshold, TopK
from commlib.errors import CommlibError

DEADLINE = float(os.environ.get("COMMLIB_WATCHDOG_TIMEOUT", "600"))
LATE = 1                  # the rank that misbehaves
SMALL, LARGE = 1000, 300_000   # floats: MPI's own path, and the shared-memory one


def rank_of_world():
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def report(**fields):
    """One record, in one write (the ranks share the pipe; a write of at
    most PIPE_BUF bytes is never interleaved with another)."""
    if len(fields.get("message", "")) > 2000:
        fields["message"] = fields["message"][:2000]
    sys.stdout.flush()
    os.write(1, ("FAULT " + json.dumps(fields) + "\n").encode())


def attempt(rank, what, call, arrays=()):
    """Run ``call()``; report what happened. Returns (error or None, snapshot
    of ``arrays`` right after the call)."""
    before = [np.array(a, copy=True) for a in arrays]
    start = time.monotonic()
    error = None
    try:
        call()
    except (CommlibError, KeyboardInterrupt) as exc:
        error = exc
    seconds = time.monotonic() - start
    after = [np.array(a, copy=True) for a in arrays]
    untouched = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(after, before))
    report(rank=rank, what=what, error=type(error).__name__ if error else None,
           culprits=list(getattr(error, "culprits", ())), message=str(error) if error else "",
           seconds=round(seconds, 3), untouched=untouched)
    return error, after


def check_not_written(rank, arrays, snapshot):
    report(rank=rank, what="after", written_after=not all(
        np.array_equal(a, b, equal_nan=True) for a, b in zip(arrays, snapshot)))


def grads(rank, n=SMALL, count=3):
    return [np.full(n, rank + 1.0, np.float32) for _ in range(count)]


# -- scenarios ---------------------------------------------------------------------------

def stall(comm, n=SMALL):
    """Rank LATE arrives DEADLINE + 1.5 s late; the others give up first."""
    rank = comm.rank
    arrays = grads(rank, n)
    comm.all_reduce(arrays)                    # a good step first
    arrays = grads(rank, n)
    if rank == LATE:
        time.sleep(DEADLINE + 1.5)
    error, snapshot = attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)
    time.sleep(DEADLINE + 2.5 - (DEADLINE + 1.5 if rank == LATE else DEADLINE))
    check_not_written(rank, arrays, snapshot)
    attempt(rank, "next", lambda: comm.all_reduce(arrays))


def stall_large(comm):
    stall(comm, LARGE)


def stall_unchecked(comm):
    """As stall, with the consistency check off: the late rank joins the
    collective its peers abandoned inside MPI."""
    stall(commlib.Communicator.from_mpi(check=False))


def die_by_exception(comm):
    rank = comm.rank
    if rank == LATE:
        time.sleep(0.3)
        raise RuntimeError("rank %d breaks down" % rank)
    arrays = grads(rank)
    attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)


def exception_in_with(comm):
    comm.close()
    with commlib.init() as comm:
        rank = comm.rank
        arrays = grads(rank)
        comm.all_reduce(arrays)
        if rank == LATE:
            time.sleep(0.3)
            raise RuntimeError("rank %d breaks inside with" % rank)
        attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)


def sys_exit(comm):
    rank = comm.rank
    comm.all_reduce(grads(rank))
    if rank == LATE:
        time.sleep(0.3)
        sys.exit(0)
    arrays = grads(rank)
    attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)


def close_early(comm):
    """Rank LATE closes after two steps; the others take a third."""
    rank = comm.rank
    for _ in range(2):
        comm.all_reduce(grads(rank))
    if rank == LATE:
        attempt(rank, "close", comm.close)
        return
    arrays = grads(rank)
    attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)


def uneven_steps(comm):
    """Rank LATE's script ends after two steps (no close); the others take a third."""
    rank = comm.rank
    steps = 2 if rank == LATE else 3
    for step in range(steps):
        arrays = grads(rank)
        attempt(rank, "step %d" % step, lambda: comm.all_reduce(arrays), arrays)


def mismatches(comm):
    """Every kind of mismatch on rank LATE; every rank raises, nothing moves,
    and the communicator works afterwards."""
    rank, late = comm.rank, comm.rank == LATE
    cases = {
        "op": lambda a: comm.all_reduce(a, op="max" if late else "sum"),
        "shape": lambda a: comm.all_reduce(a[:2] + [a[2].reshape(10, -1)] if late else a),
        "dtype": lambda a: comm.all_reduce([x.astype(np.float64) for x in a] if late else a),
        "count": lambda a: comm.all_reduce(a[:2] if late else a),
        "order": lambda a: comm.all_reduce(a[::-1] if late else a),
        "division": lambda a: comm.all_reduce(a, division=late),
        "compression": lambda a: comm.all_reduce(a, compression="fp16" if late else None),
        "compression settings": lambda a: comm.all_reduce(
            a, compression=TopK(0.1 if late else 0.2)),
        "root": lambda a: comm.broadcast(a, root=1 if late else 0),
        "collective": lambda a: comm.barrier() if late else comm.all_reduce(a),
        "barrier timeout": lambda a: comm.barrier(timeout=30 if late else None),
    }
    for what, call in cases.items():
        arrays = grads(rank)
        arrays[1] = np.full(SMALL, rank + 1.0, np.float32)
        if what == "order":
            arrays[0] = np.full(2 * SMALL, rank + 1.0, np.float32)
        attempt(rank, what, lambda: call(arrays), arrays)
    arrays = grads(rank)
    attempt(rank, "afterwards", lambda: comm.all_reduce(arrays), arrays)
    report(rank=rank, what="result", value=float(arrays[0][0]))


def bad_input(comm):
    """Bad arguments on rank LATE only."""
    rank, late = comm.rank, comm.rank == LATE
    read_only = np.ones(SMALL, np.float32)
    read_only.setflags(write=False)
    cases = {
        "None": lambda a: comm.all_reduce(None if late else a),
        "scalar": lambda a: comm.all_reduce(3.0 if late else a),
        "list with None": lambda a: comm.all_reduce(a[:2] + [None] if late else a),
        "complex": lambda a: comm.all_reduce([x.astype(np.complex64) for x in a] if late
                                             else a),
        "strided": lambda a: comm.all_reduce(a[:2] + [np.ones(2 * SMALL, np.float32)[::2]]
                                             if late else a),
        "read-only": lambda a: comm.all_reduce(a[:2] + [read_only] if late else a),
        "integer avg": lambda a: comm.all_reduce([x.astype(np.int32) for x in a] if late
                                                 else a, op="avg"),
        "bad op": lambda a: comm.all_reduce(a, op="mean" if late else "sum"),
        "root": lambda a: comm.broadcast(a, root=comm.size if late else 0),
        "all_gatherv None": lambda a: comm.all_gatherv(None if late else a[0]),
        "all_gather list": lambda a: comm.all_gather(a if late else a[0]),
        "barrier timeout": lambda a: comm.barrier(timeout=-1 if late else None),
        "compression": lambda a: comm.all_reduce(a, compression="zip" if late else None),
    }
    for what, call in cases.items():
        arrays = grads(rank)
        attempt(rank, what, lambda: call(arrays), arrays)
    arrays = grads(rank)
    attempt(rank, "afterwards", lambda: comm.all_reduce(arrays), arrays)
    report(rank=rank, what="result", value=float(arrays[0][0]))


def nonfinite(comm):
    """NaN or inf on rank LATE with every lossy compression."""
    rank = comm.rank
    for compression in ("fp16", "bf16", TopK(0.1), Threshold(0.5)):
        for bad in (np.nan, np.inf):
            arrays = [np.linspace(-1, 1, SMALL, dtype=np.float32) * (rank + 1)
                      for _ in range(3)]
            if rank == LATE:
                arrays[1][7] = bad
            attempt(rank, "%s %s" % (compression, bad),
                    lambda: comm.all_reduce(arrays, op="avg", compression=compression), arrays)
    arrays = grads(rank)
    attempt(rank, "afterwards", lambda: comm.all_reduce(arrays, compression=TopK(0.1)),
            arrays)


class OutOfRange(TopK):
    """Top-K whose selection sends an index past the bucket on rank LATE."""

    def select(self, *args):
        indices, values = super().select(*args)
        if rank_of_world()[0] == LATE:
            indices = indices.copy()
            indices[0] = 10 ** 7
        return indices, values


def tampered(comm):
    rank = comm.rank
    arrays = [np.linspace(-1, 1, SMALL, dtype=np.float32) * (rank + 1) for _ in range(3)]
    attempt(rank, "out of range", lambda: comm.all_reduce(arrays, compression=OutOfRange(0.1)),
            arrays)
    attempt(rank, "afterwards", lambda: comm.all_reduce(arrays, compression=TopK(0.1)),
            arrays)


def partial_objects(comm):
    """A new Partial object per call on rank LATE, one object on the others:
    the windows must still agree (the state follows the settings)."""
    rank = comm.rank
    kept = Partial(0.25)
    values = []
    for call in range(6):     # values differ along the array: a window mix-up shows
        arrays = [np.arange(SMALL, dtype=np.float32) + np.float32(rank + 1 + call)]
        comm.all_reduce(arrays, op="avg",
                        compression=Partial(0.25) if rank == LATE else kept)
        values.append(arrays[0].tolist())
    report(rank=rank, what="partial", values=values)


def settings_differ(which):
    """The watch dog or the check on some ranks only: the communicator is
    not made, on every rank."""
    rank, _ = rank_of_world()
    if rank == LATE:
        os.environ[which] = "0"
    attempt(rank, which, lambda: commlib.init())


def bad_environment(value):
    os.environ["COMMLIB_WATCHDOG_TIMEOUT"] = value
    attempt(rank_of_world()[0], value, lambda: commlib.init())


def init_error(comm):
    comm.close()
    rank = comm.rank
    attempt(rank, "init", lambda: commlib.init(backend="gpu" if rank == LATE else None))


def interrupt(comm):
    """Ctrl-C reaches rank 0 while it waits for a late rank LATE."""
    rank = comm.rank
    arrays = grads(rank)
    if rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    if rank == LATE:
        time.sleep(1.5)
    attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)


def mpi_error(comm):
    """The check off and sizes that differ: MPI's own error becomes a
    TransportError that says what probably differs."""
    rank = comm.rank
    unchecked = commlib.Communicator.from_mpi(check=False)
    x = np.ones(100_000 if rank == 0 else 10, np.float32)
    attempt(rank, "broadcast", lambda: unchecked.broadcast(x), [x])


def dropped(comm):
    """1,500 communicators made and dropped without close(): MPI's
    communicators and the shared memory are released with them."""
    for _ in range(1500):
        dropped = commlib.Communicator.from_mpi()
        x = np.ones(4)
        dropped.all_reduce(x)
        assert x[0] == comm.size
    left = [f for f in os.listdir("/dev/shm") if f.startswith("commlib-")]
    report(rank=comm.rank, what="dropped", left=len(left))


SCENARIOS = {name: fn for name, fn in globals().items()
             if callable(fn) and name in (
                 "stall", "stall_large", "stall_unchecked", "die_by_exception",
                 "exception_in_with", "sys_exit", "close_early", "uneven_steps", "mismatches",
                 "bad_input", "nonfinite", "tampered", "partial_objects", "init_error",
                 "interrupt", "mpi_error", "dropped")}


def main(which, *args):
    if which == "settings_differ":
        return settings_differ(*args)
    if which == "bad_environment":
        return bad_environment(*args)
    global COMM
    COMM = commlib.init()      # lives until exit, as a script's module global does
    SCENARIOS[which](COMM)
    report(rank=rank_of_world()[0], what="done")


if __name__ == "__main__":
    main(*sys.argv[1:])
