"""Watching a job: ending it on a failure, a signal, a timeout or a wrong
world size, then printing each distinct traceback once and the rank to
blame; the launcher's exit status."""
import os
import signal
import sys
import time

from .processes import POLL_S, say
from ..settings import RANK_VARIABLES
from ..startup.records import distinct_tracebacks, ranks_text, signal_name, verdict


EXIT_TIMEOUT = 124
#: the job was not -n ranks: they reported an MPI world of another size, or
#: mpiexec exited 0 while ranks never reported finishing
EXIT_WRONG_SIZE = 3
SETTLE_S = 1.0  # after a failure, time for the job to end itself (MPI_Abort)


class _Signals:
    """Records SIGINT/SIGTERM/SIGHUP to the launcher while installed."""

    CAUGHT = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        try:
            for sig in self.CAUGHT:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            pass
        return self

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def supervise(job, timeout=None, grace=5.0):
    """Wait for ``job`` (:class:`ForkedWorkers` or :class:`MpiJob`, or a
    callable that starts one: a signal that arrives while it starts is then
    caught too, not left to kill the launcher and orphan the workers); end
    it on a failure, a signal or after ``timeout`` seconds. Returns the exit
    status."""
    with _Signals() as signals:
        if not hasattr(job, "poll"):
            job = job()
        return _watch(job, signals, timeout, grace)


def _watch(job, signals, timeout, grace):
    """supervise's loop, its signal handlers installed; closes ``job``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            ended, records = job.poll()
            if wrong_size(records, job.size):
                _settle(job, grace)
                job.drain()
                records = job.records()
                print_tracebacks(records)
                say(wrong_size_text(wrong_size(records, job.size), job))
                return EXIT_WRONG_SIZE
            if signals.received is not None:
                say("received %s; ending all workers" % signal_name(signals.received))
                job.end(grace)
                return 128 + signals.received
            if any(r.bad for r in records):
                _settle(job, grace)
                return report(job)
            if ended:
                return report(job)
            if deadline is not None and time.monotonic() > deadline:
                say("timed out after %g s; ending all workers" % timeout)
                job.end(grace)
                return EXIT_TIMEOUT
            time.sleep(POLL_S)
    finally:
        job.close()


def wrong_size(records, size):
    """The ``started`` records of ranks whose MPI world is not ``size``."""
    return [r for r in records if r.kind == "started" and r.size != size]


def wrong_size_text(wrong, job):
    """What the launcher says when ranks report the wrong world size."""
    first = wrong[0]
    used = getattr(job, "mpiexec", None)
    return ("-n %d, but %s: the workers do not form one job of %d ranks (rank %s's MPI "
            "library: %s; mpiexec: %s). All workers ended. Fix: an mpiexec of mpi4py's MPI "
            "(--mpiexec PATH or COMMLIB_MPIEXEC), or point mpi4py at the mpiexec's MPI "
            "(MPI4PY_LIBMPI=/path/to/its/libmpi.so)"
            % (job.size, "; ".join("rank %s sees a world of %s" % (r.rank, r.size)
                                   for r in sorted(wrong, key=lambda r: int(r.rank))),
               job.size, first.rank, first.library,
               "%s (%s)" % (used.path, used.version) if used else "forked workers"))


def _settle(job, grace):
    """Let the job end itself briefly (MPI_Abort), then end what is left."""
    settle = time.monotonic() + min(SETTLE_S, grace)
    while time.monotonic() < settle and not job.poll()[0]:
        time.sleep(POLL_S)
    job.end(grace)


def print_tracebacks(records):
    """Print each distinct traceback of ``records`` once, headed by its ranks."""
    for ranks, text in distinct_tracebacks(records):
        say("%s raised:" % ranks_text(ranks))
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()


def report(job):
    """Print the ended ``job``'s distinct tracebacks and the ranks to blame
    (:func:`~commlib.startup.records.verdict`), or the ranks that never
    reported finishing; returns the exit status."""
    job.drain()
    records = job.records()
    print_tracebacks(records)
    found = verdict(records)
    if found is not None:
        say(found[0] + "; all workers ended")
        return found[1]
    code = job.unreported_exit()
    if code:
        used = getattr(job, "mpiexec", None)
        name = os.path.basename(used.path) if used else "mpiexec"
        say("%s exited with status %d and no rank recorded a failure (%s failed, or a rank "
            "was ended from outside; see the output above)" % (name, code, name))
        return code
    missing = job.missing(records)
    if missing:
        say(missing_text(missing, job))
        return EXIT_WRONG_SIZE
    return 0


def missing_text(missing, job):
    """What the launcher says when ``missing`` ranks of an ended job never
    reported finishing their script (nor failing)."""
    used = getattr(job, "mpiexec", None)
    return ("%s of %d never ran or never reported finishing, although %s exited with status 0: "
            "%s did not start the ranks as the launcher asked (it is not an mpiexec, or it "
            "sets none of %s)" % (
                ranks_text(missing), job.size, used.path if used else "the job",
                used.path if used else "it", ", ".join(RANK_VARIABLES)))
