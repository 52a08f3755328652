"""Start N data-parallel workers of a training script and watch over them.

    python -m commlib.launch -n 4 [--backend auto|nccl|mpi] [--timeout S] [--] train.py [args]
    python -m commlib.launch -n 4 --hosts a:2,b:2 [--launcher-exec PROG] train.py [args]
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
  one on ``PATH``; see :func:`commlib.startup.mpi_library.choose_mpiexec`): an
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

Several machines (:mod:`commlib.startup.hosts`, :mod:`~commlib.launch.slurm`):
``--hosts a:2,b:2`` (``-H``) or ``--hostfile FILE`` (hydra's ``host:n``
lines) place the ranks, in order, on those hosts (``-n`` at most the
slots' sum), and ``--launcher-exec PROGRAM`` names what mpiexec reaches
them with instead of ssh; they become hydra's ``-hosts ... -launcher ssh
-launcher-exec ...`` or Open MPI's ``--host ... --mca plm_rsh_agent ...``.
Inside a Slurm allocation (``SLURM_JOB_ID`` set, ``srun`` on PATH) and
without those options, the ranks are a job step: ``srun -n N
--kill-on-bad-exit=1 python -m commlib.launch --_worker train.py args``
(``--starter mpiexec|srun`` to choose); ``-n`` more than ``SLURM_NTASKS``
is refused.

A failing rank (exception or nonzero ``sys.exit``) records the failure,
prints a one-line summary and (under MPI) calls ``MPI_Abort`` so that peers
blocked in a collective do not wait forever.

Modules: :mod:`~commlib.launch.cli` (arguments, NCCL or MPI, ``main``),
:mod:`~commlib.launch.jobs` (forked workers, an MPI job, the workers'
environment), :mod:`~commlib.launch.processes` (the launcher's flags,
children and their output, its messages),
:mod:`~commlib.launch.supervision` (watching a job, the report, the exit
status), :mod:`~commlib.launch.rank` (a rank's supervisor and the rank
process), :mod:`~commlib.startup.records` (how ranks started and ended).

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

A rank on another node than the launcher's, where the status directory
does not exist (no shared file system), writes its records into a folder
its supervisor makes there; the supervisor passes each one on, as it
appears, as one line of its stdout (``\x1ecommlib-record {json}``), and
the launcher, which reads mpiexec's stdout, writes it into the status
directory instead of printing it. A rank killed together with its
supervisor (hydra's cleanup after another rank died or aborted) leaves no
record and is not blamed. Workers inherit the
launcher's environment; with N > 1 and no ``OMP_NUM_THREADS`` set, it is set
to (CPU cores // N). When the launcher's stderr is a terminal it sets
``COMMLIB_LAUNCH_TERMINAL=1``: a worker's stderr is a pipe to the launcher,
and :func:`stderr_is_terminal` tells it that what it writes there is seen
on a terminal (a progress bar, say). The launcher checks every ``COMMLIB_*``
variable (:func:`commlib.settings.check_environment`) before it starts
anything.

When a worker fails or dies, the launcher ends the others (SIGTERM, then
SIGKILL after ``--grace`` seconds); when all have ended it prints each
distinct traceback once, headed by the ranks that raised it (tracebacks that
differ only in ``rank R`` naming the rank's own number count as one), then
one line naming the rank to blame: a rank named in others' ``culprits``
first, then a rank that died or failed on its own before one that failed
blaming others, the earliest first. A rank is never blamed for giving up
on others: when the only failures blame ranks that left no failure of
their own (a stalled rank, which the others' watch dogs gave up on), the
line names those ranks, and which ranks blamed them
(:func:`~commlib.startup.records.verdict`). SIGINT or SIGTERM to the
launcher, or ``--timeout``, ends all workers the same way. Exit status: 0
when every rank finished its script; the blamed rank's exit code (128 +
signal number when it was killed by a signal, 1 when it exited with 0
without finishing its script; for ranks blamed by others, the exit code of
the rank that blamed them); mpiexec's status when it failed and no rank
left a record; 124 after ``--timeout``; 3 when the job was not N ranks: a
rank's MPI world was not of size N, or mpiexec exited 0 while ranks never
reported finishing (it started nothing, say); 128 + signal number when the
launcher was interrupted; 2 when nothing could be started: bad arguments,
an invalid ``COMMLIB_*`` variable, an mpiexec that is not a program or
belongs to another MPI than mpi4py's, a bad host entry or hostfile line,
more ranks than slots.
"""
from ..core.lazy import public_names

#: public name -> the module that defines it (relative to this package)
_WHERE = {
    "main": ".cli", "build_parser": ".cli", "parse_args": ".cli",
    "choose_backend": ".cli", "gpu_status": ".cli",
    "ForkedWorkers": ".jobs", "MpiJob": ".jobs", "ENV_MPIEXEC": ".jobs",
    "common_env": ".jobs", "worker_env": ".jobs", "LAUNCH_ENV": ".jobs",
    "stderr_is_terminal": ".jobs",
    "PROG": ".processes", "WORKER_FLAG": ".processes", "RANK_FLAG": ".processes",
    "ENV_PREFIX": ".processes",
    "popen": ".processes", "relay": ".processes", "start_relays": ".processes",
    "supervise": ".supervision", "report": ".supervision", "wrong_size": ".supervision",
    "EXIT_TIMEOUT": ".supervision", "EXIT_WRONG_SIZE": ".supervision",
    "run_supervisor": ".rank", "run_worker": ".rank",
    # what ranks record of themselves lies below the launcher, with start-up
    "Record": "..startup.records", "blame": "..startup.records",
    "verdict": "..startup.records", "distinct_tracebacks": "..startup.records",
    "read_records": "..startup.records", "write_record": "..startup.records",
    "record_started": "..startup.records", "ENV_STATUS_DIR": "..startup.records",
    "launcher_rank": "..settings",
}

__all__ = sorted(_WHERE)


# a rank imports commlib.startup.records and does not load the launcher itself
__getattr__, __dir__ = public_names(__name__, _WHERE)
