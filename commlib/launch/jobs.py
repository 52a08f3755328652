"""The two kinds of job the launcher starts: forked workers sharing an NCCL
ID (:class:`ForkedWorkers`) and an MPI job (:class:`MpiJob`). Both give the
supervisor the same small interface: ``size``, ``poll()``, ``records()``,
``end(grace)``, ``unreported_exit()``, ``missing(records)``, ``drain()``,
``close()``. Also the environment the workers get (:func:`common_env`,
:func:`worker_env`), and what a worker learns from it
(:func:`stderr_is_terminal`)."""
import os
import shutil
import site
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .. import settings
from ..errors import ArgumentError, LaunchError
from ..startup import hosts as host_list, mpi_library
from . import slurm
from .processes import (ENV_PREFIX, PIPE_DRAIN_S, POLL_S, PROG, RANK_FLAG, WORKER_FLAG,
                        end_processes, join, parse_record_line, popen, relay, start_relays)
from ..startup.records import ENV_STATUS_DIR, Record, read_records, write_record


ENV_MPIEXEC = settings.MPIEXEC  # the mpiexec to use
# the forked workers' variables (commlib.startup.bootstrap reads them; named in
# settings, so that the launcher need not load the start-up code and numpy)
ENV_NCCL_ID, ENV_RANK, ENV_SIZE = settings.NCCL_ID, settings.RANK, settings.SIZE
ENV_LOCAL_RANK, ENV_LOCAL_SIZE = settings.LOCAL_RANK, settings.LOCAL_SIZE
LAUNCH_ENV = (ENV_NCCL_ID, ENV_RANK, ENV_SIZE, ENV_LOCAL_RANK, ENV_LOCAL_SIZE)


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):        # replaced or closed
        return False


def stderr_is_terminal():
    """Whether what this process writes to stderr reaches a terminal: it is
    one, or this is a worker of :mod:`commlib.launch` (whose stderr is a
    pipe to the launcher) and the launcher's own stderr is one
    (``COMMLIB_LAUNCH_TERMINAL=1``). A progress bar is worth drawing then.

    Raises:
        ArgumentError: ``COMMLIB_LAUNCH_TERMINAL`` is not a flag.
    """
    return _is_terminal(sys.stderr) or settings.flag(settings.LAUNCH_TERMINAL, False)


def common_env(base, n):
    """Copy of ``base`` for one of ``n`` workers: no launch variables left over
    from an outer launch, this commlib importable, ``COMMLIB_LAUNCH_TERMINAL=1``
    when the launcher's stderr is a terminal, and (when ``n`` > 1 and the
    user did not choose) OMP_NUM_THREADS = CPU cores // n, so that the
    workers' BLAS threads do not oversubscribe the cores."""
    env = dict(base)
    for name in LAUNCH_ENV + (ENV_STATUS_DIR, ENV_PREFIX, settings.LAUNCH_TERMINAL):
        env.pop(name, None)
    if _is_terminal(sys.stderr):
        env[settings.LAUNCH_TERMINAL] = "1"
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sites = set(site.getsitepackages()) | {site.getusersitepackages()}
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in sites and here not in parts:  # not needed (nor wanted) when installed
        env["PYTHONPATH"] = os.pathsep.join(parts + [here])
    if n > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, settings.usable_cores() // n))
    return env


def worker_env(base, nccl_id, rank, size, local_rank=None, local_size=None):
    """Environment (a new dict) of forked worker ``rank`` of ``size``.

    ``base`` is the launcher's environment, ``nccl_id`` the hex text of the
    shared :class:`~commlib.NcclId`; local rank/size default to rank/size
    (all workers on this machine).
    """
    if not 0 <= rank < size:
        raise ArgumentError("rank=%r, size=%r: expected 0 <= rank < size" % (rank, size))
    env = common_env(base, size)
    env.update({
        ENV_NCCL_ID: str(nccl_id),
        ENV_RANK: str(rank),
        ENV_SIZE: str(size),
        ENV_LOCAL_RANK: str(rank if local_rank is None else local_rank),
        ENV_LOCAL_SIZE: str(size if local_size is None else local_size),
    })
    return env


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
            self._relays += start_relays(p, b"[%d] " % rank)
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
                procs.append(popen(cmd, env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE))
        except BaseException:
            end_processes(procs, 0)
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
        """(all ended, the records so far)."""
        return all(t is not None for t in self.ended_at), self.records()

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
        join(self._waiters, 60)

    def unreported_exit(self):
        return None

    def missing(self, records):
        """Ranks that never reported finishing: none (the launcher sees each
        worker's exit, and one that exits without finishing gets a ``died``
        record)."""
        return []

    def drain(self):
        """Wait (briefly) until the ended workers' output is passed on."""
        join(self._relays, PIPE_DRAIN_S)

    def close(self):
        self.drain()
        if self.status_dir:
            shutil.rmtree(self.status_dir, ignore_errors=True)


class MpiJob:
    """``mpiexec -n N python -m commlib.launch --_worker script args`` (or
    ``srun -n N ...``); how ranks start and end comes back through records
    in a status directory."""

    def __init__(self, proc, status_dir, size, mpiexec=None):
        self.proc, self.status_dir, self.size = proc, status_dir, size
        self.mpiexec = mpiexec    # the mpi_library.Mpiexec that started it

    @classmethod
    def start(cls, script, args, n, mpiexec=None, base_env=None, hosts=None,
              launcher_exec=None, starter="mpiexec"):
        """Start ``script args`` on ``n`` ranks under the supervisor.

        ``mpiexec``: a path or name (default ``COMMLIB_MPIEXEC``, else one of
        the MPI library mpi4py loads, see
        :func:`commlib.startup.mpi_library.choose_mpiexec`). ``hosts``: the
        :class:`~commlib.startup.hosts.Host` list to place the ranks on
        (default: this machine), ``launcher_exec``: the program mpiexec
        reaches them with (default its own: ssh); both checked already.
        ``starter="srun"``: a Slurm job step instead
        (:mod:`commlib.launch.slurm`; no mpiexec is needed).

        Raises:
            ArgumentError: the mpiexec named is not a program.
            LaunchError: no mpiexec of mpi4py's MPI library was found, or
                the one named belongs to another MPI, or it cannot be
                started.
            BackendUnavailableError: mpi4py or mpiexec (or srun) is missing.
        """
        env = common_env(os.environ if base_env is None else base_env, n)
        worker = [sys.executable, "-m", PROG, WORKER_FLAG, script, *args]
        if starter == "srun":
            chosen = slurm.srun(env)
            cmd, prepend = slurm.command(chosen.path, n, worker), []
        else:
            named, source = ((mpiexec, "--mpiexec") if mpiexec
                             else (env.get(ENV_MPIEXEC), ENV_MPIEXEC))
            chosen = mpi_library.choose_mpiexec(named or None, env=env, source=source)
            hydra = chosen.family == mpi_library.MPICH and _says_hydra(chosen.path)
            prepend = ["-prepend-rank"] if hydra else []
            cmd = [chosen.path, *mpi_library.extra_args(chosen),
                   *host_list.mpiexec_args(chosen.family, hosts, launcher_exec), *prepend,
                   "-n", str(n), *worker]
        status_dir = tempfile.mkdtemp(prefix="commlib-launch-")
        env[ENV_STATUS_DIR] = status_dir
        if not prepend:
            env[ENV_PREFIX] = "1"
        try:
            job = cls(popen(cmd, env, stdout=subprocess.PIPE), status_dir, n, chosen)
        except OSError as exc:
            shutil.rmtree(status_dir, ignore_errors=True)
            raise LaunchError("cannot start %s: %s" % (chosen.path, exc)) from None
        except BaseException:
            shutil.rmtree(status_dir, ignore_errors=True)
            raise
        job.start_relay()
        return job

    def start_relay(self):
        """Pass mpiexec's stdout on, line by line, keeping the records that
        ranks on other nodes send over it (see
        :func:`~commlib.launch.processes.record_line`): they go into the
        status directory, as the ranks of this node write theirs."""
        def consume(line):
            found = parse_record_line(line)
            if found is None:
                return False
            try:
                write_record(self.status_dir, Record.from_dict(found))
            except (TypeError, ValueError, KeyError):
                pass            # not a record after all: dropped, never printed
            return True

        fd = os.dup(self.proc.stdout.fileno())
        self.proc.stdout.close()
        self.relay = threading.Thread(target=relay, args=(fd, 1, b"", consume), daemon=True)
        self.relay.start()

    def records(self):
        return read_records(self.status_dir)

    def poll(self):
        """(mpiexec ended, the records so far)."""
        return self.proc.poll() is not None, self.records()

    def end(self, grace):
        end_processes([self.proc], grace)

    def unreported_exit(self):
        """mpiexec's nonzero exit status (used when no rank recorded a failure)."""
        return self.proc.returncode or None

    def missing(self, records):
        """The ranks of ``records`` (of the ended job) without a ``done``
        record: under an mpiexec that started them, every rank that finished
        its script wrote one."""
        done = {r.rank for r in records if r.kind == "done"}
        return [rank for rank in range(self.size) if rank not in done]

    def drain(self):
        """Wait (bounded) until mpiexec's output, and the records in it, was
        passed on."""
        if self.proc.poll() is not None:
            join([self.relay], PIPE_DRAIN_S)

    def close(self):
        shutil.rmtree(self.status_dir, ignore_errors=True)
