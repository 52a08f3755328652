"""The launcher's command line: arguments, the backend they choose (forked
workers over NCCL or an MPI job), and ``main``."""
import argparse
import os
import sys

from .. import settings
from ..core import gpu
from ..errors import ArgumentError, BackendUnavailableError, CommlibError
from ..startup import hosts as host_list
from . import slurm
from .jobs import ENV_MPIEXEC, ForkedWorkers, MpiJob, common_env
from .processes import PROG, RANK_FLAG, WORKER_FLAG, say
from .rank import main_internal
from .slurm import STARTERS
from .supervision import EXIT_TIMEOUT, EXIT_WRONG_SIZE, supervise


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
        epilog="Exit status: 0 when every rank finishes its script; else the exit code of "
               "the worker to blame (128 + N for signal N; the others are ended); %d after "
               "--timeout; %d when the job was not N ranks (a rank's MPI world is not of size "
               "N, or ranks never reported); 128 + N after signal N to the launcher; 2 when "
               "nothing could be started (bad arguments or COMMLIB_* variables, a bad host entry "
               "or hostfile line, more ranks than slots, an mpiexec that is not a program or "
               "belongs to another MPI than mpi4py's)."
               % (EXIT_TIMEOUT, EXIT_WRONG_SIZE))
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
    machines = parser.add_argument_group(
        "several machines", "ranks fill the hosts in order (a:2,b:2 with -n 4: ranks 0, 1 on "
        "a, 2, 3 on b); -n may not exceed the slots. The hosts need this Python at the "
        "same path, the script at its path, and commlib; mpiexec reaches them with ssh "
        "unless --launcher-exec names another program. Inside a Slurm allocation "
        "(SLURM_JOB_ID set) the ranks are a job step: srun -n N --kill-on-bad-exit=1 ...; "
        "srun's MPI plugin is its default or SLURM_MPI_TYPE's (MPICH: pmi2 or pmix)")
    where = machines.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", default=None, metavar="HOST:N,...",
                       help="the hosts and their slots, e.g. a:2,b:2 (HOST alone: 1 slot); "
                            "passed to mpiexec (hydra -hosts, Open MPI --host)")
    where.add_argument("--hostfile", default=None, metavar="FILE",
                       help="a file of one HOST or HOST:N per line (MPICH hydra's format; "
                            "# comments); read and checked here, passed on as --hosts is")
    machines.add_argument("--launcher-exec", default=None, metavar="PROGRAM",
                          help="the program mpiexec reaches the hosts with instead of ssh, "
                               "called as ssh is (PROGRAM HOST COMMAND; hydra "
                               "-launcher-exec, Open MPI --mca plm_rsh_agent)")
    machines.add_argument("--starter", choices=STARTERS, default="auto",
                          help="what starts the ranks: mpiexec, or srun (a Slurm job step); "
                               "auto (default): srun inside a Slurm allocation when srun is "
                               "on PATH and none of --hosts, --hostfile, --mpiexec, "
                               "--launcher-exec is given, else mpiexec")
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


def machines(ns, env):
    """(hosts or None, launcher-exec path or None, ``"srun"`` or
    ``"mpiexec"``) of the parsed arguments ``ns``, checked: a job on
    several machines.

    Raises:
        ArgumentError: a bad host entry or hostfile line, more ranks than
            slots (or than the Slurm allocation's tasks), a launcher-exec
            that is not a program, srun together with mpiexec's options.
    """
    hosts = None
    if ns.hosts is not None:
        hosts = host_list.parse_hosts(ns.hosts)
        host_list.check_slots(hosts, ns.nprocs, "--hosts")
    elif ns.hostfile is not None:
        hosts = host_list.read_hostfile(ns.hostfile)
        host_list.check_slots(hosts, ns.nprocs, "--hostfile %s" % ns.hostfile)
    launcher_exec = (host_list.check_launcher_exec(ns.launcher_exec)
                     if ns.launcher_exec is not None else None)
    across = hosts is not None or launcher_exec is not None or bool(ns.mpiexec)
    starter = slurm.choose_starter(ns.starter, env, across)
    if starter == "srun":
        slurm.check_tasks(ns.nprocs, env)
    return hosts, launcher_exec, starter


def gpu_status():
    """(reason NCCL is unusable or None, number of visible GPUs)."""
    reason = gpu.nccl_unavailable_reason()
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
    reason, gpus = gpu_status()
    if requested == "nccl":
        if reason is not None:
            raise BackendUnavailableError("--backend nccl: NCCL is not usable here: " + reason)
        if n > gpus:
            raise ArgumentError("--backend nccl: -n %d needs %d GPUs, %d visible" % (n, n, gpus))
        return "nccl"
    if reason is None and n > gpus:
        say("-n %d is more than the %d visible GPUs; using mpiexec" % (n, gpus))
    return "nccl" if reason is None and n <= gpus else "mpi"


def start_job(ns):
    """Start the job the parsed arguments ``ns`` ask for (after checking every
    ``COMMLIB_*`` variable the workers will see); returns it.

    Raises:
        CommlibError: it cannot be started (an invalid variable, no usable
            backend, no mpiexec of mpi4py's MPI, ...).
    """
    settings.check_environment(common_env(os.environ, ns.nprocs))
    hosts, launcher_exec, starter = machines(ns, os.environ)
    several = hosts is not None or starter == "srun"
    if several and ns.backend == "nccl":
        raise ArgumentError("--backend nccl: forked workers run on this machine only; "
                            "--hosts, --hostfile and Slurm steps take --backend mpi (or auto)")
    backend = "mpi" if several else choose_backend(ns.backend, ns.nprocs)
    if backend == "nccl":
        from ..startup.bootstrap import NcclId
        return ForkedWorkers.start_script(ns.script, ns.args, ns.nprocs, str(NcclId()))
    return MpiJob.start(ns.script, ns.args, ns.nprocs, mpiexec=ns.mpiexec, hosts=hosts,
                        launcher_exec=launcher_exec, starter=starter)


def main(argv=None):
    """``commlib-run`` / ``python -m commlib.launch``; returns the exit status.

    Starts ``--nprocs`` workers of the script (NCCL: forked workers sharing
    a fresh :class:`~commlib.NcclId`; MPI: an mpiexec of mpi4py's MPI) and
    watches over them. The internal first arguments ``--_worker`` (a rank's
    supervisor under mpiexec) and ``--_rank`` (the rank process) run that
    part instead.

    Args:
        argv: the command line's arguments without the program name
            (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 when every rank finishes its script; else the
        exit code of the worker to blame (128 + N for signal N; the others
        are ended; see :mod:`commlib.launch`); ``EXIT_TIMEOUT`` (124) after
        ``--timeout``; ``EXIT_WRONG_SIZE`` (3) when the job was not N ranks
        (a rank's MPI world is not of size N, or mpiexec exited 0 while
        ranks never reported finishing); 128 + N after signal N to the
        launcher; 2 when the job could not be started (a CommlibError such
        as BackendUnavailableError, ArgumentError or LaunchError, e.g. an
        invalid ``COMMLIB_*`` variable, an mpiexec that is not a program or
        of another MPI than mpi4py's; its message is printed on one line),
        or for ``--_worker`` / ``--_rank`` without a script. With ``--_worker`` / ``--_rank``, the
        status of that part.

    Raises:
        SystemExit: (status 2, from argparse) bad arguments, or a script
            that does not exist or is not a file.
        CommlibError: one raised while watching the job (not while
            starting it) passes through.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in ([WORKER_FLAG], [RANK_FLAG]):
        return main_internal(argv)
    ns = parse_args(argv)
    failed = []

    def start():
        try:
            return start_job(ns)
        except CommlibError as exc:
            failed.append(exc)
            raise

    try:
        return supervise(start, timeout=ns.timeout, grace=ns.grace)
    except CommlibError as exc:
        if exc not in failed:
            raise
        say("error: %s" % exc)
        return 2
