"""commlib's environment variables and defaults, read in one place.

Flags accept ``1/true/yes/on`` and ``0/false/no/off`` (any case); an empty or
unset variable means the default; anything else is an ArgumentError naming
the variable. Seconds must be positive and finite.
"""
import math
import os

from .errors import ArgumentError

CHECK = "COMMLIB_CHECK"
WATCHDOG_ENABLE = "COMMLIB_WATCHDOG_ENABLE"
WATCHDOG_TIMEOUT = "COMMLIB_WATCHDOG_TIMEOUT"
#: nnabla's names for the same settings (its MPI data-parallel communicator's
#: watch dog), read when commlib's own are unset: ENABLE, any value but 0
#: (and the usual off words) turns it on; TIMEOUT in seconds
NNABLA_WATCHDOG_ENABLE = "NNABLA_MPI_WATCH_DOG_ENABLE"
NNABLA_WATCHDOG_TIMEOUT = "NNABLA_MPI_WATCH_DOG_TIMEOUT"
STALL_WARNING = "COMMLIB_STALL_WARNING"
ABORT_ON_ERROR = "COMMLIB_ABORT_ON_ERROR"
SHM = "COMMLIB_SHM"
SHM_STORES = "COMMLIB_SHM_STORES"
NATIVE = "COMMLIB_NATIVE"
#: the mpiexec to start ranks with (else one of the MPI that mpi4py loads is looked for)
MPIEXEC = "COMMLIB_MPIEXEC"
KERNEL_DIR = "COMMLIB_KERNEL_DIR"
ASYNC_DEPTH = "COMMLIB_ASYNC_DEPTH"
TRACE = "COMMLIB_TRACE"
#: whether fixed GPU launch sequences are replayed as CUDA graphs (commlib.ops.graphs)
CUDA_GRAPHS = "COMMLIB_CUDA_GRAPHS"

#: the watch dog's default deadline per collective, seconds: long enough for
#: a rank that evaluates or saves a checkpoint while the others wait at the
#: next all-reduce, short enough that a hung job ends the same shift
#: (PyTorch's default for its NCCL process groups is the same 10 minutes)
DEFAULT_TIMEOUT = 600.0
#: seconds a rank waits in one collective before it prints which ranks it
#: waits for (once per collective; it keeps waiting until the deadline)
DEFAULT_STALL_WARNING = 60.0
#: asynchronous all-reduces over MPI in flight at once (commlib.progress.inflight)
DEFAULT_ASYNC_DEPTH = 4

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(name, default):
    """Boolean environment variable ``name`` (``default`` when unset or empty)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ArgumentError("%s=%r: expected one of %s (on) or %s (off)"
                        % (name, os.environ[name], "/".join(_TRUE), "/".join(_FALSE)))


def seconds(value, what):
    """``value`` as positive finite seconds (float), else ArgumentError naming ``what``."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ArgumentError("%s=%r is not a number of seconds" % (what, value)) from None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value < math.inf):
        raise ArgumentError("%s must be a positive, finite number of seconds, got %r"
                            % (what, value))
    return float(value)


def env_seconds(name, default):
    value = os.environ.get(name, "").strip()
    return default if not value else seconds(value, name)


def timeout(value=None):
    """The watch dog's deadline per collective: ``value`` (seconds; ``math.inf``
    turns the watch dog off) or, when None, the environment: off with
    ``COMMLIB_WATCHDOG_ENABLE=0``, else ``COMMLIB_WATCHDOG_TIMEOUT`` seconds
    (default :data:`DEFAULT_TIMEOUT`). nnabla's
    ``NNABLA_MPI_WATCH_DOG_ENABLE`` / ``NNABLA_MPI_WATCH_DOG_TIMEOUT`` stand
    in for commlib's two variables where those are unset. Returns seconds,
    or None for off."""
    if value is None:
        if not _watchdog_enabled():
            return None
        if os.environ.get(WATCHDOG_TIMEOUT, "").strip():
            return env_seconds(WATCHDOG_TIMEOUT, DEFAULT_TIMEOUT)
        return env_seconds(NNABLA_WATCHDOG_TIMEOUT, DEFAULT_TIMEOUT)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == math.inf:
        return None
    return seconds(value, "timeout")


def _watchdog_enabled():
    if os.environ.get(WATCHDOG_ENABLE, "").strip():
        return flag(WATCHDOG_ENABLE, True)
    value = os.environ.get(NNABLA_WATCHDOG_ENABLE, "").strip().lower()
    if not value:
        return True
    return value not in _FALSE


def stall_warning():
    """Seconds before a waiting rank says whom it waits for (None: never)."""
    value = os.environ.get(STALL_WARNING, "").strip().lower()
    if value in ("0", "off", "no", "false"):
        return None
    return env_seconds(STALL_WARNING, DEFAULT_STALL_WARNING)


def shm_stores():
    value = os.environ.get(SHM_STORES, "").strip().lower() or "auto"
    if value not in ("auto", "plain", "streaming"):
        raise ArgumentError("%s=%r: expected auto, plain or streaming"
                            % (SHM_STORES, os.environ[SHM_STORES]))
    return value


def async_depth():
    """How many asynchronous all-reduces over MPI may be in flight at once:
    ``COMMLIB_ASYNC_DEPTH`` (a positive int; 1 runs them one at a time),
    default :data:`DEFAULT_ASYNC_DEPTH`."""
    value = os.environ.get(ASYNC_DEPTH, "").strip()
    if not value:
        return DEFAULT_ASYNC_DEPTH
    try:
        depth = int(value)
    except ValueError:
        depth = 0
    if depth < 1:
        raise ArgumentError("%s=%r: expected a positive int" % (ASYNC_DEPTH, value))
    return depth


def trace_path():
    """Where ``COMMLIB_TRACE`` asks the trace to be written (see
    :mod:`commlib.trace` for the path rule), or None: no trace."""
    return os.environ.get(TRACE, "").strip() or None


#: a communicator's options (``Communicator.from_mpi(**options)`` and the
#: other factories)
OPTIONS = ("bucket_bytes", "check", "timeout")


def options(**given):
    """A communicator's options, checked once and resolved against the
    environment (``COMMLIB_CHECK``, the watch-dog variables): a dict of
    :data:`OPTIONS`.

    Args:
        bucket_bytes: a positive int, or None (each transport's default).
        check: the consistency check, a bool, or None (``COMMLIB_CHECK``,
            default on).
        timeout: the watch dog's deadline, see :func:`timeout`.

    Raises:
        ArgumentError: an unknown option, ``bucket_bytes`` that is not a
            positive int, or a timeout that is not positive seconds.
    """
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise ArgumentError("unknown communicator option%s %s; the options are %s"
                            % ("s" if len(unknown) > 1 else "", ", ".join(unknown),
                               ", ".join(OPTIONS)))
    bucket_bytes, check = given.get("bucket_bytes"), given.get("check")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool)
                                     or not hasattr(bucket_bytes, "__index__")
                                     or bucket_bytes < 1):
        raise ArgumentError("bucket_bytes must be a positive int (bytes), got %r"
                            % (bucket_bytes,))
    return {"bucket_bytes": None if bucket_bytes is None else int(bucket_bytes),
            "check": flag(CHECK, True) if check is None else bool(check),
            "timeout": timeout(given.get("timeout"))}
