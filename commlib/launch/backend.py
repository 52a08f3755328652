"""Forked workers over NCCL or an MPI job: which one ``--backend`` gives."""
from ..core import gpu
from ..errors import ArgumentError, BackendUnavailableError
from .common import say


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
