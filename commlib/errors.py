"""Exception hierarchy of commlib.

Every error commlib raises derives from :class:`CommlibError`. Argument
errors also derive from the matching built-in (``TypeError``/``ValueError``)
so existing ``except ValueError`` code keeps working.
"""


class CommlibError(Exception):
    """Base class of every commlib error."""


class ArgumentError(CommlibError, ValueError):
    """An argument has a wrong value (root out of range, bad op, bad length)."""


class ArrayTypeError(CommlibError, TypeError):
    """An array has the wrong kind (numpy vs cupy), dtype or layout."""


class DeviceMismatchError(ArrayTypeError):
    """A cupy array lives on another GPU than the communicator's."""


class BackendUnavailableError(CommlibError, RuntimeError):
    """A transport (NCCL, MPI, CUDA kernels) was asked for but cannot be used here."""


class ClosedError(CommlibError, RuntimeError):
    """The communicator was used after :meth:`Communicator.close`."""


class ConsistencyError(CommlibError, RuntimeError):
    """Ranks called different collectives (op, dtype, shape or sequence differ)."""


class CollectiveTimeoutError(CommlibError, TimeoutError):
    """A collective did not complete before its deadline (a peer died or hangs)."""


class KernelError(CommlibError, RuntimeError):
    """A CUDA kernel reported a problem (bad index, overflow to inf)."""
