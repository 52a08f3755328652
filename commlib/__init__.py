"""commlib: data-parallel gradient averaging for custom numpy/cupy training loops.

    import commlib
    comm = commlib.init()
    comm.all_reduce(grads, division=True)

``import commlib`` works without cupy, NCCL or a GPU.
"""
from .core.lazy import public_names

#: public name -> the module that defines it (relative to this package), imported on
#: first use: ``import commlib`` stays cheap for the launcher's processes (a rank's
#: supervisor, which needs neither numpy nor the collectives)
_WHERE = {
    "compression": ".compression", "errors": ".errors", "trace": ".trace", "optim": ".optim",
    "NcclId": ".startup.bootstrap", "flat_arrays": ".collective.bucketing",
    "Communicator": ".communicator", "BackwardReducer": ".overlap",
    "ReduceState": ".collective.reduce_state", "P2POp": ".collective.p2p",
    "CommStats": ".collective.stats", "Work": ".progress.work",
    "DistributedOptimizer": ".optim", "broadcast_parameters": ".optim",
    "check_parameters": ".optim", "partition": ".optim",
}
_WHERE.update(dict.fromkeys((
    "ArgumentError", "ArrayTypeError", "BackendUnavailableError", "ClosedError",
    "CollectiveTimeoutError", "CommlibError", "ConsistencyError", "DeviceMismatchError",
    "LaunchError", "NonFiniteError", "PayloadError", "PeerError", "TransportError"), ".errors"))


__getattr__, __dir__ = public_names(__name__, _WHERE, submodules=True)

__version__ = "0.1.0"


def init(**options):
    """A Communicator bootstrapped from the environment.

    Under ``commlib.launch``'s forked workers (``COMMLIB_NCCL_ID`` set) it
    uses :meth:`Communicator.from_nccl_id`; otherwise
    :meth:`Communicator.from_mpi` (under mpiexec, or as an MPI singleton of
    size 1); without mpi4py, :meth:`Communicator.single` (one process).
    ``options`` go to the constructor (``bucket_bytes``, ``check``,
    ``timeout``, ``device``, ``backend`` for MPI).

    Raises:
        LaunchError: a launcher variable (``PMI_SIZE``,
            ``OMPI_COMM_WORLD_SIZE``, ``COMMLIB_SIZE``, Slurm's
            ``SLURM_STEP_NUM_TASKS``, ...) says N ranks and this process's
            MPI world has another size (an mpiexec of another MPI than
            mpi4py's): raised on every process, never run as N separate jobs.
        BackendUnavailableError: a launcher says several ranks but mpi4py is
            not installed.
    """
    from .communicator import Communicator
    from .errors import BackendUnavailableError
    from .startup.bootstrap import launcher_env
    from .startup.mpi_library import launched_size
    found = launcher_env()
    if found is not None:
        nid, rank, size, local_rank, local_size = found
        options.pop("backend", None)
        return Communicator.from_nccl_id(nid, rank, size, local_rank=local_rank,
                                         local_size=local_size, **options)
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        launched = launched_size()
        if launched is not None and launched[0] > 1:
            raise BackendUnavailableError(
                "commlib: %s=%d (set by %s) says this process is one of %d ranks, but "
                "mpi4py is not installed, so it would run alone; install mpi4py and an "
                "MPI, e.g. from the commlib source tree: pip install '.[mpi]' "
                "(or pip install mpi4py mpich)" % (launched[1], launched[0], launched[2],
                                                   launched[0])) from None
        options.pop("backend", None)
        return Communicator.single(**options)
    return Communicator.from_mpi(**options)


__all__ = ["Communicator", "NcclId", "init", "flat_arrays", "compression", "errors", "trace",
           "Work", "CommStats", "BackwardReducer", "ReduceState",
           "optim", "DistributedOptimizer", "broadcast_parameters", "check_parameters",
           "partition", "ArgumentError", "ArrayTypeError",
           "BackendUnavailableError", "ClosedError", "CollectiveTimeoutError",
           "CommlibError", "ConsistencyError", "DeviceMismatchError", "LaunchError",
           "NonFiniteError",
           "PayloadError", "PeerError", "TransportError"]
