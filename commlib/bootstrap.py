"""Creating and passing the NCCL unique ID, and reading the launch environment.

An :class:`NcclId` is NCCL's 128-byte rendezvous ticket: rank 0 (or a parent
process) creates it, every rank passes the same ID to
``Communicator.from_nccl_id``. It pickles (for ``multiprocessing`` fork and
spawn) and round-trips through hex text (for environment variables).
"""
import os

from .errors import ArgumentError, BackendUnavailableError

NCCL_ID_BYTES = 128

#: environment variables the launcher sets for each worker
ENV_NCCL_ID = "COMMLIB_NCCL_ID"
ENV_RANK = "COMMLIB_RANK"
ENV_SIZE = "COMMLIB_SIZE"
ENV_LOCAL_RANK = "COMMLIB_LOCAL_RANK"
ENV_LOCAL_SIZE = "COMMLIB_LOCAL_SIZE"

#: (rank, size, local rank, local size) variables of common MPI launchers
MPI_LAUNCHER_ENV = (
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),          # MPICH hydra
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),            # Open MPI
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def _nccl():
    from ._cuda import nccl_unavailable_reason
    reason = nccl_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError("commlib: NCCL is not usable here: " + reason)
    from cupy.cuda import nccl
    return nccl


class NcclId:
    """NCCL unique ID (128 bytes).

    ``NcclId()`` asks NCCL for a fresh ID (needs cupy with NCCL);
    ``NcclId(data)`` wraps existing bytes; ``NcclId.from_hex(text)`` parses
    ``str(nid)``.
    """

    __slots__ = ("_data",)

    def __init__(self, data=None):
        if data is None:
            raw = _nccl().get_unique_id()
            data = raw if isinstance(raw, (bytes, bytearray)) else bytes(b & 0xFF for b in raw)
        data = bytes(data)
        if len(data) != NCCL_ID_BYTES:
            raise ArgumentError("NcclId: expected %d bytes, got %d" % (NCCL_ID_BYTES, len(data)))
        self._data = data

    @classmethod
    def from_hex(cls, text):
        """Parse the hex form written by ``str(nid)``."""
        try:
            data = bytes.fromhex(text.strip())
        except (ValueError, AttributeError) as exc:
            raise ArgumentError("NcclId.from_hex: not a hex string: %r" % (text,)) from exc
        return cls(data)

    @property
    def data(self):
        """The 128 raw bytes."""
        return self._data

    def for_cupy(self):
        """The ID in the form this cupy's ``NcclCommunicator`` takes: a tuple of
        signed chars (CuPy < 14) or bytes (CuPy >= 14)."""
        return tuple(b - 256 if b > 127 else b for b in self._data)

    def __str__(self):
        return self._data.hex()

    def __repr__(self):
        return "NcclId(%s...)" % self._data[:8].hex()

    def __eq__(self, other):
        return isinstance(other, NcclId) and other._data == self._data

    def __hash__(self):
        return hash(self._data)

    def __reduce__(self):
        return (NcclId, (self._data,))


def _int_env(name, env):
    value = env.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ArgumentError("environment variable %s=%r is not an integer" % (name, value)) from None


def launcher_env(env=None):
    """(NcclId, rank, size, local_rank, local_size) from the launcher's
    variables, or None when ``COMMLIB_NCCL_ID`` is not set."""
    env = os.environ if env is None else env
    if ENV_NCCL_ID not in env:
        return None
    rank, size = _int_env(ENV_RANK, env), _int_env(ENV_SIZE, env)
    if rank is None or size is None:
        raise ArgumentError("%s is set but %s/%s are not" % (ENV_NCCL_ID, ENV_RANK, ENV_SIZE))
    local_rank = _int_env(ENV_LOCAL_RANK, env)
    local_size = _int_env(ENV_LOCAL_SIZE, env)
    return (NcclId.from_hex(env[ENV_NCCL_ID]), rank, size,
            rank if local_rank is None else local_rank,
            size if local_size is None else local_size)
