"""The processes of one rank: under mpiexec, a supervisor that never
initialises MPI (``--_worker``), and the rank process that runs the script
(``--_rank``) and records how it ended."""
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from .processes import (ENV_PREFIX, PIPE_DRAIN_S, POLL_S, PROG, RANK_FLAG, WORKER_FLAG,
                        write_all, join,
                        popen, record_line, say, start_relays)
from ..settings import launcher_rank
from ..startup.records import ENV_STATUS_DIR, Record, read_records, write_record


OUTPUT_DRAIN_S = 0.25  # a failed rank's pause between its last output and MPI_Abort


def _forward_pending(started, received):
    for entry in received:
        if started and not entry[1]:
            entry[1] = True
            if started[0].returncode is None:
                try:
                    os.kill(started[0].pid, entry[0])
                except ProcessLookupError:
                    pass


def run_supervisor(script, args):
    """What mpiexec starts (``--_worker``): run the rank process as a child
    (same environment and inherited file descriptors, so its MPI_Init reaches
    mpiexec), forward SIGINT/SIGTERM to it, pass its output on in whole lines,
    record its end if it did not (``died.R``), then exit with its status.
    Never initialises MPI."""
    rank = launcher_rank()
    status_dir = os.environ.get(ENV_STATUS_DIR)
    prefix = b"[%s] " % rank.encode() if rank and os.environ.get(ENV_PREFIX) == "1" else b""
    env, forwarder = os.environ, None
    if status_dir and rank is not None and not os.path.isdir(status_dir):
        # another node than the launcher's: records go into a folder here and
        # travel to the launcher over this process's output
        status_dir = tempfile.mkdtemp(prefix="commlib-launch-rank%s-" % rank)
        env = dict(os.environ, **{ENV_STATUS_DIR: status_dir})
        forwarder = _Forwarder(status_dir)
    received, started = [], []  # [signal, forwarded], the child once started

    def forward(signum, frame=None):
        received.append([signum, False])
        _forward_pending(started, received)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    # own process group: a signal mpiexec sends to this group reaches the child once,
    # through forward()
    child = popen([sys.executable, "-m", PROG, RANK_FLAG, script, *args], env,
                   new_group=True, close_fds=False, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)
    started.append(child)
    _forward_pending(started, received)  # what arrived while it started
    relays = start_relays(child, prefix)
    status = child.wait()
    ended = time.time()
    if status_dir and rank is not None:
        failed = os.path.exists(os.path.join(status_dir, "failed.%s" % rank))
        finished = os.path.exists(os.path.join(status_dir, "done.%s" % rank))
        if not failed and (status != 0 or not finished):
            write_record(status_dir, Record(
                int(rank), "died", ended, code=status if status >= 0 else None,
                signal=-status if status < 0 else None, finished=finished,
                requested=received[-1][0] if received else None))
    join(relays, PIPE_DRAIN_S)
    if forwarder is not None:
        forwarder.stop()
        shutil.rmtree(status_dir, ignore_errors=True)
    os._exit(128 - status if status < 0 else status)


class _Forwarder:
    """Passes each record written into ``folder`` on to this process's
    stdout, once, as a :func:`~commlib.launch.processes.record_line`
    (polled every POLL_S seconds, on a thread, until :meth:`stop`)."""

    def __init__(self, folder):
        self.folder, self.sent = folder, set()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _send(self):
        for record in read_records(self.folder):
            key = (record.kind, record.rank)
            if key not in self.sent:
                self.sent.add(key)
                write_all(1, record_line(record))

    def _run(self):
        while not self.stopped.wait(POLL_S):
            self._send()

    def stop(self):
        """Stop polling, after passing on what is there now."""
        self.stopped.set()
        self.thread.join(PIPE_DRAIN_S)
        self._send()


def _exit_status(value):
    """Process exit status for ``SystemExit(value)``, as Python computes it."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _script_traceback(exc):
    """``exc``'s traceback as ``python script.py`` prints it: without this
    module's and runpy's frames."""
    skip = {os.path.abspath(__file__), runpy.__file__, "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _failure_record(rank, code, exc):
    if exc is None:
        return Record(rank, "failed", time.time(), code=code)
    try:
        message = str(exc)
    except Exception:
        message = "<str() failed>"
    try:
        culprits = tuple(int(r) for r in getattr(exc, "culprits", ()) or ())
    except (TypeError, ValueError):
        culprits = ()
    return Record(rank, "failed", time.time(), code=code, exception=type(exc).__name__,
                  message=message, culprits=culprits, traceback=_script_traceback(exc))


def _report_failure(code, exc=None):
    """Record the failure for the launcher, then end this rank and the MPI job."""
    rank = launcher_rank()
    status_dir = os.environ.get(ENV_STATUS_DIR)
    record = _failure_record(int(rank) if rank is not None else "?", code, exc)
    recorded = bool(status_dir) and rank is not None and write_record(status_dir, record)
    if not recorded:  # e.g. another host, or no launcher: tell it here in full
        if record.traceback:
            sys.stderr.write(record.traceback)
        say(record.describe())
    elif exc is not None:
        say(record.describe() + "; traceback when the job has ended")
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        time.sleep(OUTPUT_DRAIN_S)  # mpiexec drops output still in its pipes at an abort
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)


def main_internal(argv=None):
    """``python -m commlib.launch --_worker|--_rank script args``: run that
    part (see :func:`commlib.launch.cli.main`); returns its status (2 when
    the script is missing)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 2:
        say("%s needs a script" % (argv[0] if argv else "--_worker or --_rank"))
        return 2
    run = run_supervisor if argv[0] == WORKER_FLAG else run_worker
    return run(argv[1], argv[2:])


def run_worker(script, args):
    """Run ``script`` as ``__main__`` with ``args``, like ``python script args``
    (``--_rank``).

    When the script returns (or exits with 0) it records ``done.R``. A
    failure (exception or nonzero exit) goes to :func:`_report_failure`
    instead of a normal exit, because a normal exit would finalize MPI and
    block while peers wait in a collective.
    """
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    error = None
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt as exc:
        error, code = exc, 128 + signal.SIGINT
    except BaseException as exc:
        error, code = exc, 1
    if code:
        _report_failure(code, error)
    rank, status_dir = launcher_rank(), os.environ.get(ENV_STATUS_DIR)
    if status_dir and rank is not None:
        write_record(status_dir, Record(int(rank), "done", time.time()))
    return 0
