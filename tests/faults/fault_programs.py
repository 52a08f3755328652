"""Rank programs of the fault suite (tests/faults/test_faults.py,
tests/faults/test_stalls.py).

``python fault_programs.py SCENARIO [ARGS]`` runs on every rank of an MPI
job. Each rank prints one ``FAULT {json}`` line per call it makes that
matters: what it raised (error class, culprits, message), how long the call
took, whether the arrays it passed were left untouched by a failed call,
and whether they changed after the error was raised (``written_after``:
compared again after the late peer has come and gone). Every record of a
scenario that tries each rank in turn as the one that misbehaves carries
that rank as ``late``.

The watch dog's deadline comes from ``COMMLIB_WATCHDOG_TIMEOUT`` (the test
sets a short one); the stall episodes set their own (:data:`STALL_DEADLINE`).
Ranks that must wait for each other outside commlib (a late rank waiting
until its peers gave up on it) do so on notices: empty files in the job's
own folder ``FAULT_NOTICES`` (made by the test), polled, never on sleeps
that guess how long the others take, and never through MPI, whose progress
could complete a collective the peers abandoned.
"""
import gc
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import commlib
from commlib.compression import Compression, Partial, Threshold, TopK
from commlib.errors import CommlibError

DEADLINE = float(os.environ.get("COMMLIB_WATCHDOG_TIMEOUT", "600"))
#: the watch dog of the stall episodes (seconds): the survivors' errors come
#: from it, so it must outlast how long a busy machine may keep a rank that
#: runs from taking its turn, and every episode costs about this much
STALL_DEADLINE = 1.0
LATE = 1                  # the rank that misbehaves in scenarios that try one rank only
SMALL, LARGE = 1000, 300_000   # floats: MPI's own path, and the shared-memory one
NOTICE_BOUND_S = 60.0     # the longest a rank waits for a notice (the job's bound is shorter)


def rank_of_world():
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def report(**fields):
    """One record, in one write (the ranks share the pipe; a write of at
    most PIPE_BUF bytes is never interleaved with another)."""
    if len(fields.get("message", "")) > 1500:
        fields["message"] = fields["message"][:1500]
    sys.stdout.flush()
    os.write(1, ("FAULT " + json.dumps(fields) + "\n").encode())


def attempt(rank, what, call, arrays=(), **extra):
    """Run ``call()``; report what happened (with the fields ``extra``).
    Returns (error or None, snapshot of ``arrays`` right after the call)."""
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
           seconds=round(seconds, 3), untouched=untouched, **extra)
    return error, after


def check_not_written(rank, arrays, snapshot, **extra):
    report(rank=rank, what="after", written_after=not all(
        np.array_equal(a, b, equal_nan=True) for a, b in zip(arrays, snapshot)), **extra)


def grads(rank, n=SMALL, count=3):
    return [np.full(n, rank + 1.0, np.float32) for _ in range(count)]


def rank_argument(text, size):
    """The misbehaving rank given on the command line, checked."""
    late = int(text)
    if not 0 <= late < size:
        raise SystemExit("fault_programs: the misbehaving rank must be in 0..%d, got %r"
                         % (size - 1, text))
    return late


# -- notices between ranks, outside commlib and MPI --------------------------------------

def _notice_path(name, rank):
    folder = os.environ.get("FAULT_NOTICES", "")
    if not os.path.isdir(folder):
        raise SystemExit("fault_programs: FAULT_NOTICES must name the job's notice folder, "
                         "got %r" % folder)
    return os.path.join(folder, "%s.%d" % (name, rank))


def notify(name, rank):
    """Tell the other ranks that ``rank`` reached ``name`` (once per name)."""
    os.close(os.open(_notice_path(name, rank), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


def await_notices(name, ranks):
    """Return once each of ``ranks`` has notified ``name``; AssertionError
    after :data:`NOTICE_BOUND_S` seconds (a rank that never got there)."""
    end = time.monotonic() + NOTICE_BOUND_S
    paths = [_notice_path(name, r) for r in ranks]
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > end:
            raise AssertionError("no notice %r from ranks %s within %s s"
                                 % (name, [r for r, p in zip(ranks, paths)
                                           if not os.path.exists(p)], NOTICE_BOUND_S))
        time.sleep(0.002)


# -- stalls: a rank that comes late, tried as each rank in turn ---------------------------

class Hold(Compression):
    """A plain all-reduce of each float32 array of the bucket, after
    ``hold()`` on rank ``late``: a stall inside the data phase, once the
    consistency check has let every rank in."""

    name = "hold"

    def __init__(self, late, hold):
        self.late, self.hold = late, hold

    def applies_to(self, dtype):
        return dtype == np.float32

    def reduce(self, bucket):
        if bucket.rank == self.late:
            self.hold()
        for a in bucket.arrays:
            bucket.all_reduce(a.reshape(-1))


def stalls(comm, mode, sizes=None):
    """Each rank in turn stalls in an all-reduce of small arrays (MPI's
    path) and of large ones (shared memory), on a fresh communicator whose
    watch dog is :data:`STALL_DEADLINE`. ``mode``: ``board``: the check on,
    the late rank calls late (its peers wait in the consistency check; one
    size per late rank); ``off``: the check off, the late rank calls late
    (its peers wait inside the transport); ``inside``: the check on, the
    late rank stalls inside the data phase (:class:`Hold`).

    The late rank comes only once its peers gave up; every rank then tries
    one call more (``next``), and compares its arrays again after an MPI
    barrier, during which MPI may complete what was abandoned
    (``written_after``). Records: ``stall``, ``next`` and ``after``, each
    with ``late``, ``size`` and ``mode``; the late rank's ``stall`` also says
    whether each element holds its input or the sum (``input_or_sum``).
    ``sizes``: the sizes tried with each late rank instead (None: as said
    above)."""
    comm.close()
    rank, n = rank_of_world()
    plan = [(late, size) for late in range(n)
            for size in sizes or ((LARGE if late == 1 else SMALL,) if mode == "board"
                                  else (SMALL, LARGE))]
    for late, size in plan:
        episode = "%s-%d-%d" % (mode, late, size)
        others = [r for r in range(n) if r != late]
        unit = commlib.Communicator.from_mpi(check=mode != "off", timeout=STALL_DEADLINE)
        arrays = grads(rank, size, count=2)
        inputs = [a.copy() for a in arrays]
        hold = None
        if rank == late:
            hold = lambda: await_notices("gave-up-" + episode, others)
            if mode != "inside":
                hold()
        compression = Hold(late, hold) if mode == "inside" else None
        where = dict(late=late, size=size, mode=mode)
        error, snapshot = attempt(rank, "stall", lambda: unit.all_reduce(
            arrays, compression=compression), arrays, **where)
        total = n * (n + 1) / 2
        if rank == late:
            report(rank=rank, what="input_or_sum", ok=all(
                bool(((a == x) | (a == total)).all()) for a, x in zip(arrays, inputs)), **where)
            notify("came-" + episode, rank)
        else:
            notify("gave-up-" + episode, rank)
            await_notices("came-" + episode, [late])
        attempt(rank, "next", lambda: unit.all_reduce(grads(rank, size, count=2)), **where)
        world().Barrier()
        check_not_written(rank, arrays, snapshot, **where)
        unit.close()


def stalls_board(comm):
    stalls(comm, "board")


def stalls_off(comm):
    stalls(comm, "off")


def stalls_inside(comm):
    stalls(comm, "inside")


def stalls_nodes(comm):
    """Every kind of stall in one job, for ranks on nodes of their own
    (MPI's path only: the sizes make no difference there)."""
    stalls(comm, "board")
    stalls(comm, "inside", sizes=(SMALL,))
    stalls(comm, "off", sizes=(SMALL,))


# -- a rank that dies or leaves (one job per misbehaving rank) --------------------------------

def die_by_exception(comm, late):
    """Rank ``late`` raises once the others are on their way into an
    all-reduce (the exception hook then ends the job with MPI_Abort)."""
    rank = comm.rank
    if rank == late:
        await_notices("ready", [r for r in range(comm.size) if r != late])
        raise RuntimeError("rank %d breaks down" % rank)
    arrays = grads(rank)
    notify("ready", rank)
    attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)


def exception_in_with(comm, late):
    comm.close()
    with commlib.init() as comm:
        rank = comm.rank
        arrays = grads(rank)
        comm.all_reduce(arrays)
        if rank == late:
            await_notices("ready", [r for r in range(comm.size) if r != late])
            raise RuntimeError("rank %d breaks inside with" % rank)
        notify("ready", rank)
        attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)


def sys_exit(comm, late):
    rank = comm.rank
    comm.all_reduce(grads(rank))
    if rank == late:
        await_notices("ready", [r for r in range(comm.size) if r != late])
        sys.exit(0)
    arrays = grads(rank)
    notify("ready", rank)
    attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)


def vanish(comm, late, leave="os._exit"):
    """Rank ``late`` ends with ``os._exit(0)`` after a good step, without a
    word to anyone; the others find its process gone. Each survivor then
    leaves at once (``leave="os._exit"``: after its records; MPI cannot
    finalize with a rank missing), or, with ``leave="sys.exit"``, once
    every survivor reported, by ``sys.exit(1)`` as a script that caught the
    error would (commlib must then keep MPI's finalisation from waiting
    for the dead rank). Before it ends, rank ``late`` forks a child (as a
    data loader's workers are made) that outlives it until the survivors
    reported: the child's copies of the process's files and sockets must
    not keep its death from being seen."""
    rank = comm.rank
    survivors = [r for r in range(comm.size) if r != late]
    comm.all_reduce(grads(rank))
    if rank == late:        # once every rank completed the good step
        await_notices("ready", survivors)
        sys.stdout.flush()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            await_notices("caught", survivors)
        os._exit(0)
    notify("ready", rank)
    arrays = grads(rank)
    attempt(rank, "all_reduce", lambda: comm.all_reduce(arrays), arrays)
    report(rank=rank, what="done")
    notify("caught", rank)
    if leave == "sys.exit":
        await_notices("caught", survivors)
        sys.exit(1)
    os._exit(0)


# -- uneven numbers of steps, each rank in turn ------------------------------------------------

def leaves_early(comm, how):
    """Each rank in turn leaves a fresh communicator after two steps, by
    ``close()`` (``how="close"``) or by dropping it without close
    (``"drop"``); the others take a third. Records ``step 2`` (the others'
    third step) and ``close`` (the late rank's, ``how="close"``), each with
    ``late``."""
    comm.close()
    rank, n = rank_of_world()
    for late in range(n):
        unit = commlib.Communicator.from_mpi()
        for _ in range(2):
            unit.all_reduce(grads(rank))
        if rank == late:
            if how == "close":
                attempt(rank, "close", unit.close, late=late)
            else:
                del unit
                gc.collect()
        else:
            arrays = grads(rank)
            attempt(rank, "step 2", lambda: unit.all_reduce(arrays), arrays, late=late)
            unit.close()
        world().Barrier()


def close_early(comm):
    leaves_early(comm, "close")


def drop_early(comm):
    leaves_early(comm, "drop")


def uneven_steps(comm):
    """Rank LATE's script ends after two steps (no close); the others take a third."""
    rank = comm.rank
    steps = 2 if rank == LATE else 3
    for step in range(steps):
        arrays = grads(rank)
        attempt(rank, "step %d" % step, lambda: comm.all_reduce(arrays), arrays)


# -- calls that disagree or fail alike: every rank in turn, one communicator -------------------

def mismatches(comm):
    """Every kind of mismatch on each rank in turn; every rank raises,
    nothing moves, and the communicator works afterwards."""
    rank = comm.rank
    for late_rank in range(comm.size):
        late = rank == late_rank
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
            "root": lambda a: comm.broadcast(a, root=(late_rank + 1) % comm.size if late
                                             else late_rank),
            "collective": lambda a: comm.barrier() if late else comm.all_reduce(a),
            "barrier timeout": lambda a: comm.barrier(timeout=30 if late else None),
        }
        for what, call in cases.items():
            arrays = grads(rank)
            arrays[1] = np.full(SMALL, rank + 1.0, np.float32)
            if what == "order":
                arrays[0] = np.full(2 * SMALL, rank + 1.0, np.float32)
            attempt(rank, what, lambda: call(arrays), arrays, late=late_rank)
        arrays = grads(rank)
        attempt(rank, "afterwards", lambda: comm.all_reduce(arrays), arrays, late=late_rank)
        report(rank=rank, what="result", value=float(arrays[0][0]), late=late_rank)


def bad_input(comm):
    """Bad arguments on each rank in turn."""
    rank = comm.rank
    read_only = np.ones(SMALL, np.float32)
    read_only.setflags(write=False)
    for late_rank in range(comm.size):
        late = rank == late_rank
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
            attempt(rank, what, lambda: call(arrays), arrays, late=late_rank)
        arrays = grads(rank)
        attempt(rank, "afterwards", lambda: comm.all_reduce(arrays), arrays, late=late_rank)
        report(rank=rank, what="result", value=float(arrays[0][0]), late=late_rank)


def nonfinite(comm):
    """NaN or inf on each rank in turn with every lossy compression."""
    rank = comm.rank
    for late in range(comm.size):
        for compression in ("fp16", "bf16", TopK(0.1), Threshold(0.5)):
            for bad in (np.nan, np.inf):
                arrays = [np.linspace(-1, 1, SMALL, dtype=np.float32) * (rank + 1)
                          for _ in range(3)]
                if rank == late:
                    arrays[1][7] = bad
                attempt(rank, "%s %s" % (compression, bad),
                        lambda: comm.all_reduce(arrays, op="avg", compression=compression),
                        arrays, late=late)
        arrays = grads(rank)
        attempt(rank, "afterwards", lambda: comm.all_reduce(arrays, compression=TopK(0.1)),
                arrays, late=late)


class OutOfRange(TopK):
    """Top-K whose selection sends an index past the bucket on rank ``late``."""

    def __init__(self, ratio, late):
        super().__init__(ratio)
        self.late = late

    def select(self, *args):
        indices, values = super().select(*args)
        if rank_of_world()[0] == self.late:
            indices = indices.copy()
            indices[0] = 10 ** 7
        return indices, values


def tampered(comm):
    rank = comm.rank
    for late in range(comm.size):
        arrays = [np.linspace(-1, 1, SMALL, dtype=np.float32) * (rank + 1) for _ in range(3)]
        attempt(rank, "out of range",
                lambda: comm.all_reduce(arrays, compression=OutOfRange(0.1, late)), arrays,
                late=late)
        attempt(rank, "afterwards", lambda: comm.all_reduce(arrays, compression=TopK(0.1)),
                arrays, late=late)


def partial_objects(comm):
    """A new Partial object per call on one rank (each in turn, on a fresh
    communicator), one object on the others: the windows must still agree
    (the state follows the settings)."""
    comm.close()
    rank, n = rank_of_world()
    for late in range(n):
        with commlib.Communicator.from_mpi() as unit:
            kept = Partial(0.25)
            values = []
            for call in range(6):     # values differ along the array: a window mix-up shows
                arrays = [np.arange(SMALL, dtype=np.float32) + np.float32(rank + 1 + call)]
                unit.all_reduce(arrays, op="avg",
                                compression=Partial(0.25) if rank == late else kept)
                values.append(arrays[0].tolist())
        report(rank=rank, what="partial", values=values, late=late)


def settings_differ(which):
    """The watch dog or the check turned off on one rank, each in turn:
    the communicator is not made, on every rank."""
    rank, n = rank_of_world()
    for late in range(n):
        if rank == late:
            os.environ[which] = "0"
        attempt(rank, which, lambda: commlib.init(), late=late)
        os.environ.pop(which, None)


def bad_environment(*values):
    """commlib.init() with each of ``values`` as the watch dog's deadline."""
    for value in values:
        os.environ["COMMLIB_WATCHDOG_TIMEOUT"] = value
        attempt(rank_of_world()[0], value, lambda: commlib.init())


def init_error(comm):
    """Each rank in turn asks for a backend it cannot have."""
    comm.close()
    rank = comm.rank
    for late in range(comm.size):
        attempt(rank, "init", lambda: commlib.init(backend="gpu" if rank == late else None),
                late=late)


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


def communicators_left():
    """How many more communicators MPI can make now: duplicates of
    COMM_WORLD until MPI refuses one (MPICH: about 2,000 in a process), all
    freed again."""
    from mpi4py import MPI
    made = []
    try:
        while True:
            made.append(MPI.COMM_WORLD.Dup())
    except MPI.Exception:
        pass
    finally:
        for c in made:
            c.Free()
    return len(made)


def dropped(comm):
    """100 communicators made and dropped without close(): MPI's
    communicators and the shared memory are released with them. MPI can
    make as many communicators after them as before (a leak of one MPI
    communicator each would leave 100 fewer)."""
    before = communicators_left()
    for _ in range(100):
        dropped = commlib.Communicator.from_mpi()
        x = np.ones(4)
        dropped.all_reduce(x)
        assert x[0] == comm.size
    del dropped
    gc.collect()
    after = communicators_left()
    left = [f for f in os.listdir("/dev/shm") if f.startswith("commlib-")]
    report(rank=comm.rank, what="dropped", left=len(left), before=before, after=after)


SCENARIOS = {fn.__name__: fn for fn in (
    stalls_board, stalls_off, stalls_inside, stalls_nodes, die_by_exception, exception_in_with, sys_exit,
    vanish, close_early, drop_early, uneven_steps, mismatches, bad_input, nonfinite, tampered,
    partial_objects, init_error, interrupt, mpi_error, dropped)}
#: scenarios whose first argument is the misbehaving rank
TAKE_A_RANK = ("die_by_exception", "exception_in_with", "sys_exit", "vanish")


def main(which, *args):
    if which == "settings_differ":
        return settings_differ(*args)
    if which == "bad_environment":
        return bad_environment(*args)
    global COMM
    COMM = commlib.init()      # lives until exit, as a script's module global does
    if which in TAKE_A_RANK:
        args = (rank_argument(args[0], COMM.size),) + args[1:]
    SCENARIOS[which](COMM, *args)
    report(rank=rank_of_world()[0], what="done")


if __name__ == "__main__":
    main(*sys.argv[1:])
