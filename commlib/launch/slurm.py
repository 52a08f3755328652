"""Starting the ranks as a Slurm job step: inside an allocation
(``SLURM_JOB_ID`` set: ``sbatch``, ``salloc``) the launcher starts them with
``srun -n N --kill-on-bad-exit=1 python -m commlib.launch --_worker ...``
on the allocation's nodes, where Slurm places them. srun's PMI plugin
(its ``--mpi``, or ``SLURM_MPI_TYPE``; MPICH takes ``pmi2`` or ``pmix``,
Open MPI ``pmix``) connects the ranks into one MPI world; each rank's
``SLURM_PROCID`` is its rank and ``SLURM_STEP_NUM_TASKS`` the size it
compares with its MPI world's. ``--kill-on-bad-exit=1`` ends the step when
a rank exits with a nonzero status, as hydra ends a job."""
import os
import shutil

from ..errors import ArgumentError, BackendUnavailableError
from ..startup.mpi_library import Mpiexec

#: set in a Slurm allocation (its id)
ENV_JOB = "SLURM_JOB_ID"
#: the tasks of the allocation (set when it was asked for with -n/--ntasks)
ENV_NTASKS = "SLURM_NTASKS"
STARTERS = ("auto", "mpiexec", "srun")


def in_allocation(env):
    """Whether ``env`` is that of a process inside a Slurm allocation."""
    return bool(env.get(ENV_JOB, "").strip())


def find_srun(env):
    """The path of ``srun`` on ``env``'s PATH, or None."""
    return shutil.which("srun", path=env.get("PATH"))


def choose_starter(requested, env, across=False):
    """``"srun"`` or ``"mpiexec"`` for ``--starter requested``.

    ``auto``: srun inside a Slurm allocation with srun on PATH, unless
    ``across`` (hosts, a hostfile, an mpiexec or the program reaching the
    hosts were named: mpiexec's own arguments).

    Raises:
        ArgumentError: ``srun`` asked for together with ``across``, or
            ``requested`` is not one of :data:`STARTERS`.
    """
    if requested not in STARTERS:
        raise ArgumentError("--starter must be one of %s, got %r"
                            % (", ".join(STARTERS), requested))
    if requested == "srun" and across:
        raise ArgumentError("--starter srun: Slurm places the ranks on the allocation's nodes; "
                            "--hosts, --hostfile, --mpiexec and --launcher-exec are "
                            "mpiexec's (leave them out, or use --starter mpiexec)")
    if requested == "auto":
        use = in_allocation(env) and not across and find_srun(env) is not None
        return "srun" if use else "mpiexec"
    return requested


def srun(env):
    """The :class:`~commlib.startup.mpi_library.Mpiexec` that stands for
    ``srun`` in the launcher's messages.

    Raises:
        BackendUnavailableError: no srun on PATH.
    """
    path = find_srun(env)
    if path is None:
        raise BackendUnavailableError("--starter srun: srun not found on PATH")
    return Mpiexec(path, None, "Slurm's srun")


def check_tasks(n, env):
    """Raise when the allocation was asked for fewer tasks than ``n``.

    Raises:
        ArgumentError: ``n`` is more than ``SLURM_NTASKS`` (naming both).
    """
    tasks = env.get(ENV_NTASKS, "").strip()
    if tasks.isdigit() and n > int(tasks):
        raise ArgumentError("-n %d is more than the %s tasks of Slurm job %s (%s=%s): srun "
                            "would refuse the step; give -n %s or fewer, or allocate more "
                            "tasks" % (n, tasks, env.get(ENV_JOB), ENV_NTASKS, tasks, tasks))


def command(srun_path, n, worker):
    """``srun -n N --kill-on-bad-exit=1 WORKER...``: the step of ``n`` ranks."""
    return [srun_path, "-n", str(n), "--kill-on-bad-exit=1", *worker]
