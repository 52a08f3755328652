"""Start N data-parallel workers of a training script and watch over them.

    python -m commlib.launch -n 4 [--backend auto|nccl|mpi] [--timeout S] [--] train.py [args]
    commlib-run -n 4 train.py [args]

Each worker runs ``train.py args`` as ``__main__`` (like ``python train.py
args``) and calls :func:`commlib.init`.

* ``nccl`` (the default when cupy, NCCL and at least N GPUs are usable): the
  launcher makes one :class:`~commlib.NcclId` and starts N child processes
  (``python -m commlib.launch --_rank train.py args``) with
  ``COMMLIB_NCCL_ID``, ``COMMLIB_RANK``, ``COMMLIB_SIZE``,
  ``COMMLIB_LOCAL_RANK`` and ``COMMLIB_LOCAL_SIZE`` set; the local rank picks
  the GPU (``CUDA_VISIBLE_DEVICES`` is left alone). The launcher reads each
  worker's output and prints it line by line, prefixed with ``[rank] ``.
* ``mpi`` (otherwise): ``mpiexec -prepend-rank -n N python -m commlib.launch
  --_worker train.py args``, with an mpiexec of the MPI library mpi4py loads
  (``--mpiexec`` or ``COMMLIB_MPIEXEC``, else the one next to
  ``sys.executable`` (MPICH from the ``mpi`` extra), the library's own, or
  one on ``PATH``; see :func:`commlib.mpi_library.choose_mpiexec`): an
  mpiexec of another MPI would start N separate jobs of size 1, so the
  launcher refuses it, naming the fix. Open MPI's mpirun gets
  ``--oversubscribe`` (and ``--allow-run-as-root`` as root). Each rank's
  :meth:`~commlib.Communicator.from_mpi` reports the size of its MPI world
  (``started.R``); a size other than N ends the job with an error. Each process
  mpiexec starts is a supervisor that never initialises MPI: it starts the
  rank process (``--_rank``) as its child with the same environment and file
  descriptors (MPI_Init connects through them), forwards SIGINT/SIGTERM to it,
  passes its output on in whole lines (hydra's ``-prepend-rank`` adds
  ``[rank] ``; with another mpiexec the supervisor adds it), and when the
  child ends, writes what it saw before exiting with the child's status
  (128 + signal number for a signal). mpiexec thus learns of a rank's death
  only after it is recorded; the child dies with its supervisor
  (``PR_SET_PDEATHSIG``), e.g. when hydra kills the job.

A failing rank (exception or nonzero ``sys.exit``) records the failure,
prints a one-line summary and (under MPI) calls ``MPI_Abort`` so that peers
blocked in a collective do not wait forever.

Status directory (``COMMLIB_LAUNCH_STATUS_DIR``, made by the launcher): one
JSON object per file, written to a temporary name and renamed, with ``rank``,
``kind`` and ``time`` (``time.time()`` of the event):

* ``started.R``: rank R made its first communicator over MPI: ``size`` (its
  MPI world's) and ``library`` (mpi4py's MPI library).
* ``done.R``: rank R's script returned (or exited with status 0); written by
  the rank before MPI finalizes.
* ``failed.R``: rank R's script failed: ``code`` (its exit status),
  ``exception`` and ``message`` (None for ``sys.exit``), ``culprits`` (the
  ranks a commlib error blames) and ``traceback``.
* ``died.R``: written by the supervisor (the launcher itself for forked
  workers) when the rank process ended without ``failed.R``, and without
  ``done.R`` or with a nonzero status: ``signal`` or ``code``, ``finished``
  (whether ``done.R`` exists) and ``requested`` (the signal the supervisor or
  launcher had sent it, when it was asked to end; such records blame no one).

A rank killed together with its supervisor (hydra's cleanup after another
rank died or aborted) leaves no record and is not blamed. Workers inherit the
launcher's environment; with N > 1 and no ``OMP_NUM_THREADS`` set, it is set
to (CPU cores // N).

When a worker fails or dies, the launcher ends the others (SIGTERM, then
SIGKILL after ``--grace`` seconds); when all have ended it prints each
distinct traceback once, headed by the ranks that raised it (tracebacks that
differ only in ``rank R`` naming the rank's own number count as one), then
one line naming the rank to blame: a rank named in others' ``culprits``
first, then a rank that died or failed on its own before one that failed
blaming others, the earliest first. SIGINT or SIGTERM to the launcher, or
``--timeout``, ends all workers the same way. Exit status: 0 when every
worker finished; the blamed rank's exit code (128 + signal number when it was
killed by a signal, 1 when it exited with 0 without finishing its script);
mpiexec's status when it failed and no rank left a record; 124 after
``--timeout``; 3 when a rank's MPI world was not of size N; 128 + signal
number when the launcher was interrupted; 2 for bad arguments or an mpiexec
of another MPI than mpi4py's.
"""
import argparse
import collections
import ctypes
import json
import os
import re
import runpy
import select
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from . import _cuda
from . import mpi_library
from .bootstrap import ENV_LOCAL_RANK, ENV_LOCAL_SIZE, ENV_NCCL_ID, ENV_RANK, ENV_SIZE
from .errors import ArgumentError, BackendUnavailableError, CommlibError, LaunchError
from .launch_records import (ENV_STATUS_DIR, Record, blame, distinct_tracebacks,  # noqa: F401
                             launcher_rank, ranks_text, read_records, signal_name,
                             write_record)

PROG = "commlib.launch"  # also the module name workers run with -m
WORKER_FLAG = "--_worker"  # the supervisor of one rank under mpiexec
RANK_FLAG = "--_rank"  # the rank process itself: runs the script
#: the mpiexec to use (else one of the MPI that mpi4py loads is looked for)
ENV_MPIEXEC = "COMMLIB_MPIEXEC"
#: "1": supervisors prefix output lines with "[rank] " (mpiexec without -prepend-rank)
ENV_PREFIX = "COMMLIB_LAUNCH_PREFIX"
LAUNCH_ENV = (ENV_NCCL_ID, ENV_RANK, ENV_SIZE, ENV_LOCAL_RANK, ENV_LOCAL_SIZE)
EXIT_TIMEOUT = 124
#: the ranks reported an MPI world of another size than -n
EXIT_WRONG_SIZE = 3
POLL_S = 0.05
SETTLE_S = 1.0  # after a failure, time for the job to end itself (MPI_Abort)
OUTPUT_DRAIN_S = 0.25  # a failed rank's pause between its last output and MPI_Abort
PARTIAL_LINE_S = 0.5  # an unfinished output line is passed on after this long
PARTIAL_LINE_MAX = 1 << 16  # or when it has this many bytes
PIPE_DRAIN_S = 1.0  # after a process ended, wait for its pipes (held by its children?)


def _say(message):
    sys.stderr.write("%s: %s\n" % (PROG, message))  # one write: other output is per line
    sys.stderr.flush()


# -- arguments ---------------------------------------------------------------------------

def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected an integer, got %r" % text) from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1, got %d" % value)
    return value


def _seconds(zero_ok):
    """argparse type: a finite number of seconds, > 0 (or >= 0 when ``zero_ok``)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError("expected seconds, got %r" % text) from None
        if not (0 <= value < float("inf")) or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError("must be a finite number of seconds %s 0, got %r"
                                             % (">=" if zero_ok else ">", text))
        return value
    return parse


def build_parser():
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run N data-parallel workers of a commlib training script.",
        epilog="Exit status: 0 when all workers finish; else the exit code of the worker "
               "that failed or died first (128 + N for signal N; the others are ended); "
               "%d after --timeout; %d when a rank's MPI world is not of size N; 128 + N "
               "after signal N to the launcher; 2 for bad arguments or an mpiexec of "
               "another MPI than mpi4py's." % (EXIT_TIMEOUT, EXIT_WRONG_SIZE))
    parser.add_argument("-n", "--nprocs", type=_positive_int, required=True,
                        help="number of workers (ranks)")
    parser.add_argument("--backend", choices=("auto", "nccl", "mpi"), default="auto",
                        help="nccl: forked workers, one GPU each; mpi: mpiexec; "
                             "auto (default): nccl when cupy, NCCL and N GPUs are usable")
    parser.add_argument("--timeout", type=_seconds(False), default=None,
                        help="end all workers and exit %d after this many seconds"
                             % EXIT_TIMEOUT)
    parser.add_argument("--grace", type=_seconds(True), default=5.0,
                        help="seconds between SIGTERM and SIGKILL when ending workers "
                             "(default 5)")
    parser.add_argument("--mpiexec", default=None,
                        help="the mpiexec to start MPI workers with (default: %s, else one "
                             "of the MPI library mpi4py loads: the one beside the Python "
                             "interpreter, the library's own, then PATH's)" % ENV_MPIEXEC)
    parser.add_argument("script", help="the Python training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def parse_args(argv=None):
    """Parsed and checked launcher arguments (exits 2 with a message on errors)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not os.path.isfile(ns.script):
        parser.error("script %r does not exist or is not a file" % ns.script)
    return ns


# -- choosing the transport --------------------------------------------------------------

def _gpu_status():
    """(reason NCCL is unusable or None, number of visible GPUs)."""
    reason = _cuda.nccl_unavailable_reason()
    if reason is not None:
        return reason, 0
    import cupy
    return None, cupy.cuda.runtime.getDeviceCount()


def choose_backend(requested, n):
    """``"nccl"`` or ``"mpi"`` for ``n`` workers; ``requested`` is the --backend value."""
    if requested not in ("auto", "nccl", "mpi"):
        raise ArgumentError("backend must be 'auto', 'nccl' or 'mpi', got %r" % (requested,))
    if requested == "mpi":
        return "mpi"
    reason, gpus = _gpu_status()
    if requested == "nccl":
        if reason is not None:
            raise BackendUnavailableError("--backend nccl: NCCL is not usable here: " + reason)
        if n > gpus:
            raise ArgumentError("--backend nccl: -n %d needs %d GPUs, %d visible" % (n, n, gpus))
        return "nccl"
    if reason is None and n > gpus:
        _say("-n %d is more than the %d visible GPUs; using mpiexec" % (n, gpus))
    return "nccl" if reason is None and n <= gpus else "mpi"


# -- worker environments -----------------------------------------------------------------

def _common_env(base, n):
    """Copy of ``base`` for one of ``n`` workers: no launch variables left over
    from an outer launch, this commlib importable, and (when ``n`` > 1 and the
    user did not choose) OMP_NUM_THREADS = CPU cores // n, so that the
    workers' BLAS threads do not oversubscribe the cores."""
    env = dict(base)
    for name in LAUNCH_ENV + (ENV_STATUS_DIR, ENV_PREFIX):
        env.pop(name, None)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sites = set(site.getsitepackages()) | {site.getusersitepackages()}
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in sites and here not in parts:  # not needed (nor wanted) when installed
        env["PYTHONPATH"] = os.pathsep.join(parts + [here])
    if n > 1 and "OMP_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // n))
    return env


def worker_env(base, nccl_id, rank, size, local_rank=None, local_size=None):
    """Environment (a new dict) of forked worker ``rank`` of ``size``.

    ``base`` is the launcher's environment, ``nccl_id`` the hex text of the
    shared :class:`~commlib.NcclId`; local rank/size default to rank/size
    (all workers on this machine).
    """
    if not 0 <= rank < size:
        raise ArgumentError("rank=%r, size=%r: expected 0 <= rank < size" % (rank, size))
    env = _common_env(base, size)
    env.update({
        ENV_NCCL_ID: str(nccl_id),
        ENV_RANK: str(rank),
        ENV_SIZE: str(size),
        ENV_LOCAL_RANK: str(rank if local_rank is None else local_rank),
        ENV_LOCAL_SIZE: str(size if local_size is None else local_size),
    })
    return env


# -- processes and their output ----------------------------------------------------------

_prctl = None


def _child_setup(parent, new_group):
    """preexec_fn (Linux): SIGKILL the child when ``parent`` (the pid that
    starts it) dies; with ``new_group``, a process group of its own."""
    def setup():
        if new_group:
            os.setpgid(0, 0)
        if _prctl is not None:
            _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before prctl
                os._exit(128 + signal.SIGKILL)
    return setup


def _popen(cmd, env, new_group=False, **kwargs):
    """Popen whose child dies with this process (Linux)."""
    global _prctl
    preexec = None
    if sys.platform.startswith("linux"):
        try:
            _prctl = _prctl or ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
            preexec = _child_setup(os.getpid(), new_group)
        except (OSError, AttributeError):
            pass
    return subprocess.Popen(cmd, env=env, preexec_fn=preexec, **kwargs)


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


_LINE_END = re.compile(rb"\r\n|\n|\r(?=[^\n])")  # "\r" too: progress bars redraw a line


def _relay(src, dst, prefix=b""):
    """Copy output from file descriptor ``src`` to ``dst`` in whole lines, one
    write per line, each starting with ``prefix``; a line left unfinished for
    PARTIAL_LINE_S (or longer than PARTIAL_LINE_MAX) is passed on as it is.
    Closes ``src`` at its end."""
    pending, at_line_start, broken = b"", True, False
    readable = select.poll()
    readable.register(src, select.POLLIN)

    def emit(data):
        nonlocal broken
        if not broken:
            try:
                _write_all(dst, data)
            except OSError:  # the reader is gone: keep reading so the writer never blocks
                broken = True
    try:
        while True:
            if pending and not readable.poll(PARTIAL_LINE_S * 1000):
                emit((prefix if at_line_start else b"") + pending)
                pending, at_line_start = b"", False
                continue
            try:
                chunk = os.read(src, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            data, start = pending + chunk, 0
            for end in _LINE_END.finditer(data):
                emit((prefix if at_line_start else b"") + data[start:end.end()])
                start, at_line_start = end.end(), True
            pending = data[start:]
            if len(pending) >= PARTIAL_LINE_MAX:
                emit((prefix if at_line_start else b"") + pending)
                pending, at_line_start = b"", False
        if pending:
            emit((prefix if at_line_start else b"") + pending + b"\n")
    finally:
        os.close(src)


def _start_relays(proc, prefix=b""):
    """Threads passing ``proc``'s stdout and stderr pipes on to ours."""
    threads = []
    for pipe, dst in ((proc.stdout, 1), (proc.stderr, 2)):
        fd = os.dup(pipe.fileno())
        pipe.close()
        t = threading.Thread(target=_relay, args=(fd, dst, prefix), daemon=True)
        t.start()
        threads.append(t)
    return threads


def _join(threads, timeout):
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _end(procs, grace):
    """SIGTERM the live ``procs``, SIGKILL those still alive after ``grace`` s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    for p in procs:
        p.wait()


# -- jobs --------------------------------------------------------------------------------

def _says_hydra(mpiexec):
    """Whether ``mpiexec --version`` names MPICH's hydra (which knows
    -prepend-rank) anywhere in its output."""
    try:
        out = subprocess.run([mpiexec, "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return b"HYDRA" in out


class ForkedWorkers:
    """N child processes sharing an NCCL ID; the launcher sees each exit code
    (when it happens, from one waiting thread per worker) and passes each
    worker's output on with a ``[rank] `` prefix."""

    def __init__(self, procs, status_dir=None):
        self.procs, self.status_dir = procs, status_dir
        self.size = len(procs)
        n = len(procs)
        self.ended_at = [None] * n  # time.time() when each worker ended
        self.requested = [None] * n  # signal the launcher sent it while it ran
        self._relays = []
        for rank, p in enumerate(procs):
            self._relays += _start_relays(p, b"[%d] " % rank)
        self._waiters = [threading.Thread(target=self._wait, args=(rank,), daemon=True)
                         for rank in range(n)]
        for t in self._waiters:
            t.start()

    def _wait(self, rank):
        self.procs[rank].wait()
        self.ended_at[rank] = time.time()

    @classmethod
    def start(cls, cmd, n, nccl_id, base_env=None, status_dir=None):
        """Start ``cmd`` (argv list) ``n`` times, rank r with :func:`worker_env`
        (plus ``status_dir`` as COMMLIB_LAUNCH_STATUS_DIR when given)."""
        base = os.environ if base_env is None else base_env
        procs = []
        try:
            for rank in range(n):
                env = worker_env(base, nccl_id, rank, n)
                if status_dir is not None:
                    env[ENV_STATUS_DIR] = status_dir
                procs.append(_popen(cmd, env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE))
        except BaseException:
            _end(procs, 0)
            raise
        return cls(procs, status_dir)

    @classmethod
    def start_script(cls, script, args, n, nccl_id, base_env=None):
        """Start ``script args`` on ``n`` ranks under the ``--_rank`` wrapper,
        which records how each rank ended in a new status directory."""
        status_dir = tempfile.mkdtemp(prefix="commlib-launch-")
        try:
            return cls.start([sys.executable, "-m", PROG, RANK_FLAG, script, *args], n,
                             nccl_id, base_env, status_dir)
        except BaseException:
            shutil.rmtree(status_dir, ignore_errors=True)
            raise

    def records(self):
        """The wrappers' records, and a ``died`` (or, without a status
        directory, ``failed``) record for each worker that ended without
        recording it."""
        found = read_records(self.status_dir) if self.status_dir else []
        kinds = {(r.rank, r.kind) for r in found}
        for rank, p in enumerate(self.procs):
            ended, code = self.ended_at[rank], p.returncode
            if ended is None or code is None or (rank, "failed") in kinds:
                continue
            finished = (rank, "done") in kinds
            if code == 0 and (finished or self.status_dir is None):
                continue
            kind = "failed" if self.status_dir is None and code > 0 else "died"
            found.append(Record(rank, kind, ended, code=code if code >= 0 else None,
                                signal=-code if code < 0 else None, finished=finished,
                                requested=self.requested[rank]))
        return sorted(found, key=lambda r: r.time)

    def poll(self):
        """(all ended, whether a worker failed or died)."""
        return (all(t is not None for t in self.ended_at),
                any(r.bad for r in self.records()))

    def end(self, grace):
        def signal_live(sig):
            for rank, p in enumerate(self.procs):
                if self.ended_at[rank] is None:
                    self.requested[rank] = sig
                    try:
                        os.kill(p.pid, sig)  # not reaped yet: its waiter would have noted it
                    except ProcessLookupError:
                        pass
        signal_live(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while None in self.ended_at and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
        signal_live(signal.SIGKILL)
        _join(self._waiters, 60)

    def unreported_exit(self):
        return None

    def drain(self):
        """Wait (briefly) until the ended workers' output is passed on."""
        _join(self._relays, PIPE_DRAIN_S)

    def close(self):
        self.drain()
        if self.status_dir:
            shutil.rmtree(self.status_dir, ignore_errors=True)


class MpiJob:
    """``mpiexec -n N python -m commlib.launch --_worker script args``; how
    ranks start and end comes back through records in a status directory."""

    def __init__(self, proc, status_dir, size, mpiexec=None):
        self.proc, self.status_dir, self.size = proc, status_dir, size
        self.mpiexec = mpiexec    # the mpi_library.Mpiexec that started it

    @classmethod
    def start(cls, script, args, n, mpiexec=None, base_env=None):
        """Start ``script args`` on ``n`` ranks under the supervisor.

        ``mpiexec``: a path or name (default ``COMMLIB_MPIEXEC``, else one of
        the MPI library mpi4py loads, see
        :func:`commlib.mpi_library.choose_mpiexec`).

        Raises:
            LaunchError: no mpiexec of mpi4py's MPI library was found, or
                the one named belongs to another MPI.
            BackendUnavailableError: mpi4py or mpiexec is missing.
        """
        env = _common_env(os.environ if base_env is None else base_env, n)
        chosen = mpi_library.choose_mpiexec(mpiexec or env.get(ENV_MPIEXEC) or None, env=env)
        hydra = chosen.family == mpi_library.MPICH and _says_hydra(chosen.path)
        status_dir = tempfile.mkdtemp(prefix="commlib-launch-")
        env[ENV_STATUS_DIR] = status_dir
        prepend = ["-prepend-rank"] if hydra else []
        if not prepend:
            env[ENV_PREFIX] = "1"
        cmd = [chosen.path, *mpi_library.extra_args(chosen), *prepend, "-n", str(n),
               sys.executable, "-m", PROG, WORKER_FLAG, script, *args]
        try:
            return cls(_popen(cmd, env), status_dir, n, chosen)
        except BaseException:
            shutil.rmtree(status_dir, ignore_errors=True)
            raise

    def records(self):
        return read_records(self.status_dir)

    def poll(self):
        """(mpiexec ended, whether a rank failed or died)."""
        return self.proc.poll() is not None, any(r.bad for r in self.records())

    def end(self, grace):
        _end([self.proc], grace)

    def unreported_exit(self):
        """mpiexec's nonzero exit status (used when no rank recorded a failure)."""
        return self.proc.returncode or None

    def drain(self):
        pass  # mpiexec has passed the ranks' output on before it exited

    def close(self):
        shutil.rmtree(self.status_dir, ignore_errors=True)


# -- supervision -------------------------------------------------------------------------

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
            ended, failed = job.poll()
            if wrong_size(job.records(), job.size):
                _settle(job, grace)
                job.drain()
                records = job.records()
                print_tracebacks(records)
                _say(wrong_size_text(wrong_size(records, job.size), job))
                return EXIT_WRONG_SIZE
            if signals.received is not None:
                _say("received %s; ending all workers" % signal_name(signals.received))
                job.end(grace)
                return 128 + signals.received
            if failed:
                _settle(job, grace)
                return report(job)
            if ended:
                return report(job)
            if deadline is not None and time.monotonic() > deadline:
                _say("timed out after %g s; ending all workers" % timeout)
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
        _say("%s raised:" % ranks_text(ranks))
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()


def report(job):
    """Print the ended ``job``'s distinct tracebacks and the rank to blame;
    returns the exit status."""
    job.drain()
    records = job.records()
    print_tracebacks(records)
    culprit = blame(records)
    if culprit is not None:
        _say(culprit.describe() + "; all workers ended")
        return culprit.exit_status()
    code = job.unreported_exit()
    if code:
        _say("mpiexec exited with status %d and no rank recorded a failure (mpiexec "
             "failed, or a rank was ended from outside; see the output above)" % code)
        return code
    return 0


# -- one rank under mpiexec: its supervisor ----------------------------------------------

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
    received, started = [], []  # [signal, forwarded], the child once started

    def forward(signum, frame=None):
        received.append([signum, False])
        _forward_pending(started, received)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    # own process group: a signal mpiexec sends to this group reaches the child once,
    # through forward()
    child = _popen([sys.executable, "-m", PROG, RANK_FLAG, script, *args], os.environ,
                   new_group=True, close_fds=False, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)
    started.append(child)
    _forward_pending(started, received)  # what arrived while it started
    relays = _start_relays(child, prefix)
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
    _join(relays, PIPE_DRAIN_S)
    os._exit(128 - status if status < 0 else status)


# -- the rank process: runs the script ---------------------------------------------------

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
        _say(record.describe())
    elif exc is not None:
        _say(record.describe() + "; traceback when the job has ended")
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        time.sleep(OUTPUT_DRAIN_S)  # mpiexec drops output still in its pipes at an abort
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)


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


# -- entry point -------------------------------------------------------------------------

def main(argv=None):
    """``commlib-run`` / ``python -m commlib.launch``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in ([WORKER_FLAG], [RANK_FLAG]):
        if len(argv) < 2:
            _say("%s needs a script" % argv[0])
            return 2
        run = run_supervisor if argv[0] == WORKER_FLAG else run_worker
        return run(argv[1], argv[2:])
    ns = parse_args(argv)
    failed = []

    def start():
        try:
            backend = choose_backend(ns.backend, ns.nprocs)
            if backend == "nccl":
                from .bootstrap import NcclId
                return ForkedWorkers.start_script(ns.script, ns.args, ns.nprocs, str(NcclId()))
            return MpiJob.start(ns.script, ns.args, ns.nprocs, mpiexec=ns.mpiexec)
        except CommlibError as exc:
            failed.append(exc)
            raise

    try:
        return supervise(start, timeout=ns.timeout, grace=ns.grace)
    except CommlibError as exc:
        if exc not in failed:
            raise
        _say("error: %s" % exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
