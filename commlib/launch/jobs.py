"""The two kinds of job the launcher starts: forked workers sharing an NCCL
ID (:class:`ForkedWorkers`) and an MPI job (:class:`MpiJob`). Both give the
supervisor the same small interface: ``size``, ``poll()``, ``records()``,
``end(grace)``, ``unreported_exit()``, ``missing(records)``, ``drain()``,
``close()``."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ..errors import LaunchError
from ..startup import mpi_library
from .common import ENV_MPIEXEC, ENV_PREFIX, PIPE_DRAIN_S, POLL_S, PROG, RANK_FLAG, WORKER_FLAG
from .environment import common_env, worker_env
from .processes import end_processes, join, popen, start_relays
from ..startup.records import ENV_STATUS_DIR, Record, read_records


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
        :func:`commlib.startup.mpi_library.choose_mpiexec`).

        Raises:
            ArgumentError: the mpiexec named is not a program.
            LaunchError: no mpiexec of mpi4py's MPI library was found, or
                the one named belongs to another MPI, or it cannot be
                started.
            BackendUnavailableError: mpi4py or mpiexec is missing.
        """
        env = common_env(os.environ if base_env is None else base_env, n)
        named, source = (mpiexec, "--mpiexec") if mpiexec else (env.get(ENV_MPIEXEC), ENV_MPIEXEC)
        chosen = mpi_library.choose_mpiexec(named or None, env=env, source=source)
        hydra = chosen.family == mpi_library.MPICH and _says_hydra(chosen.path)
        status_dir = tempfile.mkdtemp(prefix="commlib-launch-")
        env[ENV_STATUS_DIR] = status_dir
        prepend = ["-prepend-rank"] if hydra else []
        if not prepend:
            env[ENV_PREFIX] = "1"
        cmd = [chosen.path, *mpi_library.extra_args(chosen), *prepend, "-n", str(n),
               sys.executable, "-m", PROG, WORKER_FLAG, script, *args]
        try:
            return cls(popen(cmd, env), status_dir, n, chosen)
        except OSError as exc:
            shutil.rmtree(status_dir, ignore_errors=True)
            raise LaunchError("cannot start %s: %s" % (chosen.path, exc)) from None
        except BaseException:
            shutil.rmtree(status_dir, ignore_errors=True)
            raise

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
        pass  # mpiexec has passed the ranks' output on before it exited

    def close(self):
        shutil.rmtree(self.status_dir, ignore_errors=True)
