"""What a communicator needs before its first collective: the NCCL unique
ID, the launch environment, the ranks' agreement on settings, and memory
shared by the ranks of one node.

An :class:`NcclId` is NCCL's 128-byte rendezvous ticket: rank 0 (or a parent
process) creates it, every rank passes the same ID to
``Communicator.from_nccl_id``. It pickles (for ``multiprocessing`` fork and
spawn) and round-trips through hex text (for environment variables).
"""
import hashlib
import os

from . import consistency, shared_segment
from ._cuda import nccl_module
from .errors import ArgumentError, CommlibError, ConsistencyError

NCCL_ID_BYTES = 128

#: environment variables the launcher sets for each worker
ENV_NCCL_ID = "COMMLIB_NCCL_ID"
ENV_RANK = "COMMLIB_RANK"
ENV_SIZE = "COMMLIB_SIZE"
ENV_LOCAL_RANK = "COMMLIB_LOCAL_RANK"
ENV_LOCAL_SIZE = "COMMLIB_LOCAL_SIZE"



class NcclId:
    """NCCL unique ID (128 bytes).

    ``NcclId()`` asks NCCL for a fresh ID (needs cupy with NCCL);
    ``NcclId(data)`` wraps existing bytes; ``NcclId.from_hex(text)`` parses
    ``str(nid)``.
    """

    __slots__ = ("_data",)

    def __init__(self, data=None):
        if data is None:
            raw = nccl_module().get_unique_id()
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


# -- agreement at construction (over MPI) ----------------------------------------------

def agree(comm, rank, settings, error):
    """All-gather every rank's ``settings`` (a dict of plain values) and its
    set-up ``error`` (an exception or None) over ``comm`` (mpi4py); raise the
    same way on every rank when a rank failed or the settings differ: this
    rank's own error, or a ConsistencyError naming the ranks. Returns the
    list of every rank's settings."""
    text = None if error is None else "%s: %s" % (type(error).__name__, error)
    records = comm.allgather((settings, text))
    failed = [(r, t) for r, (_, t) in enumerate(records) if t is not None]
    if error is not None:
        raise error
    if failed:
        raise ConsistencyError("rank %d: the communicator was not made:\n  %s" % (
            rank, "\n  ".join("rank %d failed: %s" % (r, t) for r, t in failed)),
            culprits=[r for r, _ in failed])
    consistency.compare_settings(rank, [s for s, _ in records])
    return [s for s, _ in records]


def node_segment(comm, nbytes):
    """A :class:`~commlib.shared_segment.SharedSegment` of ``nbytes`` shared
    by every rank of ``comm`` (mpi4py; all on one node), or None when one
    cannot be made on some rank. Collective; the name is gone from
    ``/dev/shm`` when it returns."""
    segment = None
    if comm.Get_rank() == 0 and shared_segment.available():
        try:
            segment = shared_segment.SharedSegment(shared_segment.new_name(), nbytes, create=True)
        except CommlibError:
            segment = None
    name = comm.bcast(None if segment is None else segment.name, root=0)
    if name is not None and segment is None:
        try:
            segment = shared_segment.SharedSegment(name, nbytes)
        except CommlibError:
            segment = None
    from .transport.mpi import mpi
    everyone = comm.allreduce(segment is not None, op=mpi().LAND)
    if segment is not None and comm.Get_rank() == 0:
        segment.unlink()
    if not everyone and segment is not None:
        segment.close()
        segment = None
    return segment


def nccl_segment(nccl_id, size, nbytes):
    """The segment of ``nbytes`` that every process using ``nccl_id`` on this
    node opens (its name derives from the ID), or None when shared memory
    is not available here."""
    if not shared_segment.available():
        return None
    digest = hashlib.sha256(nccl_id.data).hexdigest()[:24]
    name = "%snccl-%s-%d" % (shared_segment.PREFIX, digest, size)
    try:
        return shared_segment.SharedSegment(name, nbytes, exist_ok=True)
    except CommlibError:
        return None
