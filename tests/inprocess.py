"""Ranks as threads of this process (commlib.transport.threads), to test the
communicator's own logic without mpiexec.

    results = run_ranks(3, lambda comm: ...)   # one result per rank, by rank
"""
import threading

from commlib import settings
from commlib.faults import board
from commlib.communicator import Communicator
from commlib.transport.threads import ThreadGroup, ThreadTransport


def communicators(size, **options):
    """``size`` Communicators, rank r's first, over one ThreadGroup and one
    status board in this process's memory."""
    group = ThreadGroup(size)
    comms = []
    for rank in range(size):
        status = board.StatusBoard(group.board_memory, rank, size) if size > 1 else None
        if status is not None:
            status.join()
        threads = ThreadTransport(group, rank)
        comms.append(Communicator(rank=rank, size=size, local_rank=rank, local_size=size,
                                  routes={"numpy": threads, "cupy": threads}, board=status,
                                  options=settings.options(**options)))
    return comms


def run_ranks(size, fn, timeout=60, **options):
    """Call ``fn(comm)`` on every rank, each in a thread; returns the list of
    results by rank, or raises the first rank's exception (an
    AssertionError when a rank did not finish within ``timeout`` seconds).
    The communicators are closed afterwards."""
    comms = communicators(size, **options)
    results, errors = [None] * size, [None] * size

    def body(rank):
        try:
            results[rank] = fn(comms[rank])
        except BaseException as exc:          # reported below, by rank
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not stuck, "ranks %s did not finish within %s s" % (stuck, timeout)
    for comm in comms:
        comm._session.abandon(board.CLOSED, "")
    for error in errors:
        if error is not None:
            raise error
    return results


def errors_of(n, body):
    """``body(comm)`` on n thread ranks: the text of the ArgumentError each
    rank raised (AssertionError when one did not raise)."""
    from commlib.errors import ArgumentError

    def run(comm):
        try:
            body(comm)
        except ArgumentError as exc:
            return str(exc)
        raise AssertionError("rank %d: no ArgumentError" % comm.rank)
    return run_ranks(n, run)
