"""Start N data-parallel workers of a training script and watch over them.

    python -m commlib.launch -n 4 [--backend auto|nccl|mpi] [--timeout S] [--] train.py [args]
    commlib-run -n 4 train.py [args]

Each worker runs ``python train.py args`` and calls :func:`commlib.init`.

* ``nccl`` (the default when cupy, NCCL and at least N GPUs are usable): the
  launcher makes one :class:`~commlib.NcclId` and starts N child processes
  with ``COMMLIB_NCCL_ID``, ``COMMLIB_RANK``, ``COMMLIB_SIZE``,
  ``COMMLIB_LOCAL_RANK`` and ``COMMLIB_LOCAL_SIZE`` set; the local rank picks
  the GPU (``CUDA_VISIBLE_DEVICES`` is left alone).
* ``mpi`` (otherwise): ``mpiexec -n N python -m commlib.launch --_worker
  train.py args``, with the mpiexec next to ``sys.executable`` (MPICH from the
  ``mpi`` extra) or else the one on ``PATH``. The ``--_worker`` wrapper runs
  the script; when it fails on a rank, the wrapper records the rank and exit
  code for the launcher and aborts the MPI job, so that peers blocked in a
  collective do not wait forever.

Workers inherit the launcher's environment; with N > 1 and no
``OMP_NUM_THREADS`` set, it is set to (CPU cores // N).

When a worker fails, the launcher ends the others (SIGTERM, then SIGKILL after
``--grace`` seconds), prints ``commlib.launch: rank R failed with exit code C``
and exits with C. SIGINT or SIGTERM to the launcher, or ``--timeout``, ends
all workers the same way. Exit status: 0 when every worker succeeded, the
failed rank's exit code (128 + signal number when it was killed by a signal),
124 after ``--timeout``, 128 + signal number when the launcher was
interrupted, 2 for bad arguments.
"""
import argparse
import collections
import ctypes
import os
import runpy
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import traceback

from . import _cuda
from .bootstrap import (ENV_LOCAL_RANK, ENV_LOCAL_SIZE, ENV_NCCL_ID, ENV_RANK, ENV_SIZE,
                        MPI_LAUNCHER_ENV)
from .errors import ArgumentError, BackendUnavailableError, CommlibError

PROG = "commlib.launch"  # also the module name workers run with -m
WORKER_FLAG = "--_worker"
#: directory where ``--_worker`` wrappers record failures for the launcher
ENV_STATUS_DIR = "COMMLIB_LAUNCH_STATUS_DIR"
LAUNCH_ENV = (ENV_NCCL_ID, ENV_RANK, ENV_SIZE, ENV_LOCAL_RANK, ENV_LOCAL_SIZE)
EXIT_TIMEOUT = 124
POLL_S = 0.05
SETTLE_S = 1.0  # after a failure, time for the job to end itself (MPI_Abort)
OUTPUT_DRAIN_S = 0.25  # a failed rank's pause between its last output and MPI_Abort


def _say(message):
    print("%s: %s" % (PROG, message), file=sys.stderr, flush=True)


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
        epilog="Exit status: 0 when all workers succeed; the exit code of the first worker "
               "that failed (the others are ended); %d after --timeout; 128 + N after "
               "signal N; 2 for bad arguments." % EXIT_TIMEOUT)
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


def mpiexec_path():
    """The mpiexec next to ``sys.executable``, else the one on PATH."""
    exe = (shutil.which("mpiexec", path=os.path.dirname(sys.executable))
           or shutil.which("mpiexec"))
    if exe is None:
        raise BackendUnavailableError(
            "mpiexec not found next to %s or on PATH: install MPI, e.g. "
            "pip install 'commlib[mpi]'" % sys.executable)
    return exe


# -- worker environments -----------------------------------------------------------------

def _common_env(base, n):
    """Copy of ``base`` for one of ``n`` workers: no launch variables left over
    from an outer launch, this commlib importable, and (when ``n`` > 1 and the
    user did not choose) OMP_NUM_THREADS = CPU cores // n, so that the
    workers' BLAS threads do not oversubscribe the cores."""
    env = dict(base)
    for name in LAUNCH_ENV:
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


# -- jobs --------------------------------------------------------------------------------

class Failure(collections.namedtuple("Failure", "rank code")):
    """A worker that ended badly: ``code`` > 0 is an exit code, < 0 a signal."""

    def describe(self):
        if self.code < 0:
            try:
                name = signal.Signals(-self.code).name
            except ValueError:
                name = "signal %d" % -self.code
            return "rank %s was killed by %s" % (self.rank, name)
        return "rank %s failed with exit code %d" % (self.rank, self.code)

    def exit_status(self):
        return 128 - self.code if self.code < 0 else (self.code or 1)


_prctl = None


def _die_with_launcher():
    """preexec_fn (Linux): SIGKILL the child if the launcher dies first."""
    if _prctl is not None:
        _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _popen(cmd, env):
    global _prctl
    preexec = None
    if sys.platform.startswith("linux"):
        try:
            _prctl = _prctl or ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
            preexec = _die_with_launcher
        except (OSError, AttributeError):
            pass
    return subprocess.Popen(cmd, env=env, preexec_fn=preexec)


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


class ForkedWorkers:
    """N child processes sharing an NCCL ID; the launcher sees each exit code."""

    def __init__(self, procs):
        self.procs = procs

    @classmethod
    def start(cls, cmd, n, nccl_id, base_env=None):
        """Start ``cmd`` (argv list) ``n`` times, rank r with :func:`worker_env`."""
        base = os.environ if base_env is None else base_env
        procs = []
        try:
            for rank in range(n):
                procs.append(_popen(cmd, worker_env(base, nccl_id, rank, n)))
        except BaseException:
            _end(procs, 0)
            raise
        return cls(procs)

    def poll(self):
        """(all ended, first Failure or None)."""
        codes = [p.poll() for p in self.procs]
        failed = [Failure(rank, code) for rank, code in enumerate(codes) if code]
        return all(c is not None for c in codes), failed[0] if failed else None

    def end(self, grace):
        _end(self.procs, grace)

    def unreported_exit(self):
        return None

    def close(self):
        pass


class MpiJob:
    """``mpiexec -n N python -m commlib.launch --_worker script args``; failures
    come back through files the wrappers write in a status directory."""

    def __init__(self, proc, status_dir):
        self.proc, self.status_dir = proc, status_dir

    @classmethod
    def start(cls, script, args, n, mpiexec=None, base_env=None):
        status_dir = tempfile.mkdtemp(prefix="commlib-launch-")
        env = _common_env(os.environ if base_env is None else base_env, n)
        env[ENV_STATUS_DIR] = status_dir
        cmd = [mpiexec or mpiexec_path(), "-n", str(n), sys.executable, "-m", PROG,
               WORKER_FLAG, script, *args]
        try:
            return cls(_popen(cmd, env), status_dir)
        except BaseException:
            shutil.rmtree(status_dir, ignore_errors=True)
            raise

    def failures(self):
        """Failures recorded so far, earliest first."""
        found = []
        for name in os.listdir(self.status_dir):
            if name.startswith("failed."):
                try:
                    with open(os.path.join(self.status_dir, name)) as f:
                        code, when = f.read().split()
                    found.append((float(when), Failure(int(name.split(".")[1]), int(code))))
                except (OSError, ValueError):
                    continue  # being written; read again at the next poll
        return [f for _, f in sorted(found)]

    def poll(self):
        ended = self.proc.poll() is not None
        failed = self.failures()
        return ended, failed[0] if failed else None

    def end(self, grace):
        _end([self.proc], grace)

    def unreported_exit(self):
        """mpiexec's nonzero exit status when no wrapper recorded a failure
        (a rank killed by a signal, or mpiexec itself failed)."""
        return self.proc.returncode or None

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
    """Wait for ``job`` (:class:`ForkedWorkers` or :class:`MpiJob`); end it on
    a failure, a signal or after ``timeout`` seconds. Returns the exit status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        with _Signals() as signals:
            while True:
                ended, failure = job.poll()
                if signals.received is not None:
                    name = signal.Signals(signals.received).name
                    _say("received %s; ending all workers" % name)
                    job.end(grace)
                    return 128 + signals.received
                if failure is not None:
                    return _after_failure(job, failure, grace)
                if ended:
                    code = job.unreported_exit()
                    if code:
                        _say("mpiexec exited with status %d (a rank ended without reporting, "
                             "e.g. killed by a signal; see the output above)" % code)
                        return code
                    return 0
                if deadline is not None and time.monotonic() > deadline:
                    _say("timed out after %g s; ending all workers" % timeout)
                    job.end(grace)
                    return EXIT_TIMEOUT
                time.sleep(POLL_S)
    finally:
        job.close()


def _after_failure(job, failure, grace):
    """Let the job end itself briefly (MPI_Abort), then end what is left."""
    settle = time.monotonic() + min(SETTLE_S, grace)
    while time.monotonic() < settle and not job.poll()[0]:
        time.sleep(POLL_S)
    job.end(grace)
    _say(failure.describe() + "; all workers ended")
    return failure.exit_status()


# -- the per-rank wrapper under mpiexec --------------------------------------------------

def _mpi_rank_from_env():
    for names in MPI_LAUNCHER_ENV:
        if names[0] in os.environ:
            return os.environ[names[0]]
    return "?"


def _exit_status(value):
    """Process exit status for ``SystemExit(value)``, as Python computes it."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _report_failure(code):
    """Record the failure for the launcher, then end this rank and the job."""
    rank = _mpi_rank_from_env()
    status_dir = os.environ.get(ENV_STATUS_DIR)
    recorded = False
    if status_dir and rank != "?":
        path = os.path.join(status_dir, "failed.%s" % rank)
        try:
            with open(path + ".tmp", "w") as f:
                f.write("%d %r\n" % (code, time.time()))
            os.replace(path + ".tmp", path)
            recorded = True
        except OSError:  # e.g. another host: the message below still names the rank
            pass
    if not recorded:
        _say(Failure(rank, code).describe())
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(OUTPUT_DRAIN_S)  # mpiexec drops output still in its pipes at an abort
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)


def _print_script_traceback(exc):
    """Print ``exc`` as ``python script.py`` would: without this module's and
    runpy's frames."""
    skip = {os.path.abspath(__file__), runpy.__file__, "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def run_worker(script, args):
    """Run ``script`` as ``__main__`` with ``args``, like ``python script args``.

    A failure (exception or nonzero exit) goes to :func:`_report_failure`
    instead of a normal exit, because a normal exit would finalize MPI and
    block while peers wait in a collective.
    """
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt as exc:
        _print_script_traceback(exc)
        code = 128 + signal.SIGINT
    except BaseException as exc:
        _print_script_traceback(exc)
        code = 1
    if code:
        _report_failure(code)
    return 0


# -- entry point -------------------------------------------------------------------------

def main(argv=None):
    """``commlib-run`` / ``python -m commlib.launch``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [WORKER_FLAG]:
        if len(argv) < 2:
            _say("%s needs a script" % WORKER_FLAG)
            return 2
        return run_worker(argv[1], argv[2:])
    ns = parse_args(argv)
    try:
        backend = choose_backend(ns.backend, ns.nprocs)
        if backend == "nccl":
            from .bootstrap import NcclId
            job = ForkedWorkers.start([sys.executable, ns.script, *ns.args], ns.nprocs,
                                      str(NcclId()))
        else:
            job = MpiJob.start(ns.script, ns.args, ns.nprocs)
    except CommlibError as exc:
        _say("error: %s" % exc)
        return 2
    return supervise(job, timeout=ns.timeout, grace=ns.grace)


if __name__ == "__main__":
    sys.exit(main())
