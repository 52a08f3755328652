"""commlib's environment variables and defaults, read in one place.

:data:`VARIABLES` is the table of every ``COMMLIB_*`` variable commlib reads
(and nnabla's two watch-dog names): what each means and which values are
valid. :func:`check_environment` checks every one that is set; each
communicator's factory calls it, so a bad value is an ArgumentError naming
the variable, its value and what is valid when the communicator is made,
not later (in an exception hook, say). Flags accept ``1/true/yes/on`` and
``0/false/no/off`` (any case); an empty or unset variable means the default.
Seconds must be positive and finite.
"""
import collections
import math
import os
import re

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
WAIT = "COMMLIB_WAIT"
NATIVE = "COMMLIB_NATIVE"
#: the mpiexec to start ranks with (else one of the MPI that mpi4py loads is looked for)
MPIEXEC = "COMMLIB_MPIEXEC"
KERNEL_DIR = "COMMLIB_KERNEL_DIR"
ASYNC_DEPTH = "COMMLIB_ASYNC_DEPTH"
TRACE = "COMMLIB_TRACE"
#: whether fixed GPU launch sequences are replayed as CUDA graphs (commlib.ops.graphs)
CUDA_GRAPHS = "COMMLIB_CUDA_GRAPHS"
#: set by commlib.launch for its forked NCCL workers (read by commlib.init)
NCCL_ID = "COMMLIB_NCCL_ID"
RANK = "COMMLIB_RANK"
SIZE = "COMMLIB_SIZE"
LOCAL_RANK = "COMMLIB_LOCAL_RANK"
LOCAL_SIZE = "COMMLIB_LOCAL_SIZE"
#: set by commlib.launch for every rank: the folder of its status records
LAUNCH_STATUS_DIR = "COMMLIB_LAUNCH_STATUS_DIR"
#: set by commlib.launch: "1" when the rank supervisors prefix output lines with "[rank] "
LAUNCH_PREFIX = "COMMLIB_LAUNCH_PREFIX"
#: set by commlib.launch: "1" when the launcher's stderr is a terminal (the
#: ranks' stderr is a pipe to it): a rank may show progress there
LAUNCH_TERMINAL = "COMMLIB_LAUNCH_TERMINAL"

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
_STORES = ("auto", "plain", "streaming")
_WAITS = ("auto", "spin", "sleep")


# -- the table ---------------------------------------------------------------------------
def _parse_flag(text):
    value = text.lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError


def _parse_seconds(text):
    value = float(text)
    if not 0 < value < math.inf:
        raise ValueError
    return value


def _parse_seconds_or_off(text):
    return None if text.lower() in _FALSE else _parse_seconds(text)


def _parse_int(low):
    def parse(text):
        if not re.fullmatch(r"[+-]?\d+", text) or int(text) < low:
            raise ValueError
        return int(text)
    return parse


def _parse_choice(choices):
    def parse(text):
        if text.lower() not in choices:
            raise ValueError
        return text.lower()
    return parse


def _parse_nccl_id(text):
    if not re.fullmatch(r"[0-9a-fA-F]{256}", text):
        raise ValueError
    return text


def _parse_kernel_folder(text):
    if not os.path.isdir(text) or not any(n.endswith(".cu") for n in os.listdir(text)):
        raise ValueError
    return text


#: one variable of :data:`VARIABLES`: what it does, which values are valid
#: (text for messages), and ``parse(text)`` -> the value (ValueError when invalid)
Variable = collections.namedtuple("Variable", "effect valid parse")
_FLAG = "1/true/yes/on or 0/false/no/off"
_SECONDS = "a positive, finite number of seconds"

#: every variable commlib reads, by name
VARIABLES = {
    CHECK: Variable("the consistency check before each collective (default on)",
                    _FLAG, _parse_flag),
    WATCHDOG_ENABLE: Variable("the watch dog (default on)", _FLAG, _parse_flag),
    WATCHDOG_TIMEOUT: Variable("the watch dog's deadline per collective (default %g s)"
                               % DEFAULT_TIMEOUT, _SECONDS, _parse_seconds),
    NNABLA_WATCHDOG_ENABLE: Variable("nnabla's name, read where %s is unset: 0/false/no/off "
                                     "turns the watch dog off, any other value on"
                                     % WATCHDOG_ENABLE, "any value", str),
    NNABLA_WATCHDOG_TIMEOUT: Variable("nnabla's name, read where %s is unset" % WATCHDOG_TIMEOUT,
                                      _SECONDS, _parse_seconds),
    STALL_WARNING: Variable("seconds in one collective before a rank prints whom it waits "
                            "for (default %g)" % DEFAULT_STALL_WARNING,
                            _SECONDS + ", or 0/false/no/off for never", _parse_seconds_or_off),
    ABORT_ON_ERROR: Variable("MPI_Abort on an uncaught exception in an MPI job (default on)",
                             _FLAG, _parse_flag),
    SHM: Variable("single-node all-reduces through shared memory (default on)",
                  _FLAG, _parse_flag),
    SHM_STORES: Variable("the kind of stores into the shared memory (default auto: probed)",
                         "/".join(_STORES), _parse_choice(_STORES)),
    WAIT: Variable("how a waiting rank polls: spin (back to back), sleep (20-100 us sleeps "
                   "between polls after the first 32), auto (default): sleep where the "
                   "node runs more ranks than a rank has cores", "/".join(_WAITS),
                   _parse_choice(_WAITS)),
    NATIVE: Variable("the compiled host loops (default on; off: numpy)", _FLAG, _parse_flag),
    MPIEXEC: Variable("the mpiexec commlib.launch starts MPI ranks with (checked there: "
                      "ranks on other machines need not have it)",
                      "an executable file, or a program on PATH", str),
    KERNEL_DIR: Variable("where the CUDA kernel sources are read from (default: the package's)",
                         "a folder holding the .cu sources", _parse_kernel_folder),
    ASYNC_DEPTH: Variable("asynchronous all-reduces over MPI in flight at once (default %d)"
                          % DEFAULT_ASYNC_DEPTH, "a positive int", _parse_int(1)),
    TRACE: Variable("write a trace of every communicator (see commlib.trace)",
                    "a path (its folder is made)", str),
    CUDA_GRAPHS: Variable("replay fixed GPU launch sequences as CUDA graphs (default on)",
                          _FLAG, _parse_flag),
    NCCL_ID: Variable("set by commlib.launch: the forked workers' NCCL ID",
                      "256 hex digits (str(commlib.NcclId))", _parse_nccl_id),
    RANK: Variable("set by commlib.launch: the worker's rank", "an int >= 0", _parse_int(0)),
    SIZE: Variable("set by commlib.launch: the number of ranks", "an int >= 1", _parse_int(1)),
    LOCAL_RANK: Variable("set by commlib.launch: the worker's rank on its node",
                         "an int >= 0", _parse_int(0)),
    LOCAL_SIZE: Variable("set by commlib.launch: the number of ranks on the worker's node",
                         "an int >= 1", _parse_int(1)),
    LAUNCH_STATUS_DIR: Variable("set by commlib.launch: where ranks record how they ended "
                                "(ranks on other machines do without)", "a folder", str),
    LAUNCH_PREFIX: Variable("set by commlib.launch: the rank supervisors prefix output lines "
                            "with [rank]", _FLAG, _parse_flag),
    LAUNCH_TERMINAL: Variable("set by commlib.launch: its stderr is a terminal, so rank 0 may "
                              "show progress", _FLAG, _parse_flag),
}


def read(name, default=None, env=None):
    """The value of variable ``name`` of :data:`VARIABLES` in ``env``
    (default ``os.environ``): parsed, or ``default`` when unset or empty.

    Raises:
        ArgumentError: the value is not valid (naming the variable, its
            value and what is valid).
    """
    env = os.environ if env is None else env
    text = env.get(name, "").strip()
    if not text:
        return default
    variable = VARIABLES[name]
    try:
        return variable.parse(text)
    except ValueError:
        raise ArgumentError("%s=%r: expected %s" % (name, env[name], variable.valid)) from None


def check_environment(env=None):
    """Check every variable of :data:`VARIABLES` set in ``env`` (default
    ``os.environ``).

    Raises:
        ArgumentError: naming each invalid variable, its value and what is
            valid (all of them, one per line).
    """
    problems = []
    for name in VARIABLES:
        try:
            read(name, env=env)
        except ArgumentError as exc:
            problems.append(str(exc))
    if problems:
        raise ArgumentError("invalid environment variable%s: %s" % (
            "s" if len(problems) > 1 else "", "; ".join(problems)))


def flag(name, default):
    """Boolean environment variable ``name`` (``default`` when unset or empty)."""
    return read(name, default)


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
    """Seconds from variable ``name`` (``default`` when unset or empty)."""
    return read(name, default)


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
    return read(STALL_WARNING, DEFAULT_STALL_WARNING)


def shm_stores():
    return read(SHM_STORES, "auto")


def usable_cores():
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def waits_sleep(local_size):
    """Whether a rank of a node of ``local_size`` ranks sleeps between the
    polls of its waits (``COMMLIB_WAIT``, see
    :func:`commlib.core.waiting.set_cores_shared`): ``sleep``; ``spin``
    never; ``auto`` (default) where the ranks outnumber the cores this
    process may use, so that a waiting rank does not take the core of the
    rank it waits for."""
    policy = read(WAIT, "auto")
    if policy == "auto":
        return local_size > usable_cores()
    return policy == "sleep"


def async_depth():
    """How many asynchronous all-reduces over MPI may be in flight at once:
    ``COMMLIB_ASYNC_DEPTH`` (a positive int; 1 runs them one at a time),
    default :data:`DEFAULT_ASYNC_DEPTH`."""
    return read(ASYNC_DEPTH, DEFAULT_ASYNC_DEPTH)


def trace_path():
    """Where ``COMMLIB_TRACE`` asks the trace to be written (see
    :mod:`commlib.trace` for the path rule), or None: no trace."""
    return read(TRACE)


#: a communicator's options (``Communicator.from_mpi(**options)`` and the
#: other factories)
OPTIONS = ("bucket_bytes", "check", "timeout")


def options(rank=None, **given):
    """A communicator's options, checked once and resolved against the
    environment (``COMMLIB_CHECK``, the watch-dog variables): a dict of
    :data:`OPTIONS`.

    Args:
        rank: the rank whose options these are, named in an error (None:
            not known yet).
        bucket_bytes: a positive int, or None (each transport's default).
        check: the consistency check, a bool, or None (``COMMLIB_CHECK``,
            default on).
        timeout: the watch dog's deadline, see :func:`timeout`.

    Raises:
        ArgumentError: an unknown option, ``bucket_bytes`` that is not a
            positive int, a timeout that is not positive seconds, or an
            environment variable of :data:`VARIABLES` that is invalid
            (:func:`check_environment`: naming it, its value and what is
            valid).
    """
    try:
        return _options(given)
    except ArgumentError as exc:
        if rank is None:
            raise
        raise ArgumentError("rank %s: %s" % (rank, exc)) from None


def _options(given):
    check_environment()
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


#: the variables in which launchers tell a process its rank (commlib.launch's
#: own first)
RANK_VARIABLES = ("COMMLIB_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK",
                  "PMIX_RANK", "SLURM_PROCID")


def launcher_rank(env=None):
    """This process's rank (str) as its launcher numbered it, or None."""
    env = os.environ if env is None else env
    for name in RANK_VARIABLES:
        if env.get(name, "").isdigit():
            return env[name]
    return None
