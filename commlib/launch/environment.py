"""The environment of the launcher's workers, and what a worker learns
from it (:func:`stderr_is_terminal`)."""
import os
import site
import sys

from ..startup.bootstrap import ENV_LOCAL_RANK, ENV_LOCAL_SIZE, ENV_NCCL_ID, ENV_RANK, ENV_SIZE
from .. import settings
from ..errors import ArgumentError
from .common import ENV_PREFIX
from ..startup.records import ENV_STATUS_DIR


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
    env = common_env(base, size)
    env.update({
        ENV_NCCL_ID: str(nccl_id),
        ENV_RANK: str(rank),
        ENV_SIZE: str(size),
        ENV_LOCAL_RANK: str(rank if local_rank is None else local_rank),
        ENV_LOCAL_SIZE: str(size if local_size is None else local_size),
    })
    return env
