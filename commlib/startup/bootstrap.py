"""What a communicator needs before its first collective: the NCCL unique
ID, the launch environment, the ranks' agreement on settings, memory
shared by the ranks of one node, and the parts each of the communicator's
factories (``from_mpi``, ``from_nccl_id``, ``single``) makes it of.

An :class:`NcclId` is NCCL's 128-byte rendezvous ticket: rank 0 (or a parent
process) creates it, every rank passes the same ID to
``Communicator.from_nccl_id``. It pickles (for ``multiprocessing`` fork and
spawn) and round-trips through hex text (for environment variables).
"""
import hashlib
import os

import numpy as np

from ..collective import lifetime
from ..core import fingerprints
from . import shared_segment
from .. import settings
from ..core.gpu import nccl_module, nccl_unavailable_reason
from ..errors import ArgumentError, BackendUnavailableError, CommlibError, ConsistencyError

from ..transport.nccl import NCCL_ID_BYTES

#: environment variables the launcher sets for each worker
ENV_NCCL_ID = settings.NCCL_ID
ENV_RANK = settings.RANK
ENV_SIZE = settings.SIZE
ENV_LOCAL_RANK = settings.LOCAL_RANK
ENV_LOCAL_SIZE = settings.LOCAL_SIZE



class NcclId:
    """NCCL unique ID (128 bytes).

    ``NcclId()`` asks NCCL for a fresh ID (needs cupy with NCCL);
    ``NcclId(data)`` wraps existing bytes; ``NcclId.from_hex(text)`` parses
    ``str(nid)``. IDs compare and hash by their bytes, pickle, and print as
    hex (``str``).

    Args:
        data: the 128 bytes (anything ``bytes()`` takes), or None (default)
            for a fresh ID from NCCL.

    Raises:
        ArgumentError: ``data`` is not 128 bytes long.
        TypeError: ``bytes()`` refuses ``data`` (a str, say).
        BackendUnavailableError: ``data`` is None and NCCL is not usable here
            (saying why).
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
        """Parse the hex form written by ``str(nid)``.

        Args:
            text: the hex string (surrounding whitespace is ignored).

        Returns:
            The :class:`NcclId`.

        Raises:
            ArgumentError: ``text`` is not a hex string (or not a str), or
                does not hold 128 bytes.
        """
        try:
            data = bytes.fromhex(text.strip())
        except (ValueError, AttributeError) as exc:
            raise ArgumentError("NcclId.from_hex: not a hex string: %r" % (text,)) from exc
        return cls(data)

    @property
    def data(self):
        """The 128 raw bytes (``bytes``)."""
        return self._data

    def for_cupy(self):
        """The ID in the form cupy's ``NcclCommunicator`` is given.

        Returns:
            A tuple of 128 ints in [-128, 127]: the bytes as signed chars,
            whatever cupy's version.
        """
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


def launcher_env(env=None):
    """(NcclId, rank, size, local_rank, local_size) from the launcher's
    variables, or None when ``COMMLIB_NCCL_ID`` is not set.

    Raises:
        ArgumentError: a variable is invalid (naming it), or the rank or
            size is missing.
    """
    env = os.environ if env is None else env
    if ENV_NCCL_ID not in env:
        return None
    nid = settings.read(ENV_NCCL_ID, "", env=env)
    rank, size = settings.read(ENV_RANK, env=env), settings.read(ENV_SIZE, env=env)
    if rank is None or size is None:
        raise ArgumentError("%s is set but %s/%s are not" % (ENV_NCCL_ID, ENV_RANK, ENV_SIZE))
    local_rank = settings.read(ENV_LOCAL_RANK, env=env)
    local_size = settings.read(ENV_LOCAL_SIZE, env=env)
    return (NcclId.from_hex(nid), rank, size,
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
    fingerprints.compare_settings(rank, [s for s, _ in records])
    return [s for s, _ in records]


def node_segment(comm, nbytes):
    """A :class:`~commlib.startup.shared_segment.SharedSegment` of ``nbytes`` shared
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
    from ..transport.mpi import mpi
    everyone = comm.allreduce(segment is not None, op=mpi().LAND)
    if segment is not None and comm.Get_rank() == 0:
        segment.unlink()
    if not everyone and segment is not None:
        segment.close()
        segment = None
    return segment


def nccl_segment(nccl_id, size, nbytes):
    """The segment of ``nbytes`` that every process using ``nccl_id`` on this
    node opens (its name derives from the ID; the first to come makes it
    exclusively, the others take it only when it is this user's and closed
    to others: see :class:`~commlib.startup.shared_segment.SharedSegment`),
    or None when shared memory is not available here or the file under the
    name is refused (every rank then refuses it, and the status board is
    exchanged over NCCL instead)."""
    if not shared_segment.available():
        return None
    try:
        return shared_segment.SharedSegment(nccl_segment_name(nccl_id, size), nbytes,
                                            exist_ok=True)
    except CommlibError:
        return None


def nccl_segment_name(nccl_id, size):
    """The name of :func:`nccl_segment`'s file for ``nccl_id`` and ``size``
    ranks (in ``/dev/shm``)."""
    digest = hashlib.sha256(nccl_id.data).hexdigest()[:24]
    return "%snccl-%s-%d" % (shared_segment.PREFIX, digest, size)


# -- the communicator's parts: what Communicator(...) is made of -------------------------
# Each ``parts_*`` function returns the keyword arguments of Communicator's
# constructor other than the options (rank, size, local rank and size,
# device, transports, status board, shared segment).

def gpu_count():
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def default_device(local_rank):
    """The GPU of the rank of local rank ``local_rank``: one GPU each, in turn."""
    return local_rank % gpu_count()


def shared_gpu_text(local_size, gpus):
    """Why NCCL cannot serve ``local_size`` ranks on a node of ``gpus`` GPUs."""
    return ("%d ranks share this node but it has %d GPU(s): ranks %d and %d would share GPU 0, "
            "and NCCL takes one rank per GPU (it refuses a duplicate device, "
            "NCCL_ERROR_INVALID_USAGE); use the MPI transport with cupy arrays "
            "(backend='mpi'), or at most %d rank(s) per node"
            % (local_size, gpus, 0, gpus, max(gpus, 1)))


def parts_from_mpi(mpi_comm, device, backend, options):
    """Collective over ``mpi_comm`` (default ``MPI.COMM_WORLD``): the parts
    of :meth:`Communicator.from_mpi` (see there)."""
    from ..transport.mpi import mpi
    MPI = mpi()
    _check_launch(MPI)
    base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    if base.Get_size() > 1:
        lifetime.install_hooks()      # an error below must end the job, not hang it
    comm = base.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    mine, error, device = _choices(rank, local_rank, local_size, device, backend, options)
    try:
        agree(comm, rank, {k: v for k, v in mine.items() if k != "nccl_usable"}, error)
        use_nccl = backend == "nccl" or (
            backend is None and comm.allreduce(mine["nccl_usable"], op=MPI.LAND))
        local_sizes = comm.allgather(local_size)
        parts = _mpi_transports(comm, local, rank, size, local_sizes, mine, use_nccl, device)
        local = None          # the hierarchical transport's now, or freed
        comm.Barrier()        # every rank joined the board
    except BaseException:
        comm.Free()
        if local is not None and local != MPI.COMM_NULL:   # not freed by now
            local.Free()
        raise
    return dict(parts, rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                device=device, options={k: mine[k] for k in settings.OPTIONS})


def _check_launch(MPI):
    """Report this rank's world to the launcher, then refuse a world of
    another size than the launcher announced (LaunchError)."""
    from . import mpi_library
    from . import records
    world = MPI.COMM_WORLD.Get_size()
    library = mpi_library.this_library()
    records.record_started(world, library.version)
    mpi_library.check_world_size(world, library=library)


def _choices(rank, local_rank, local_size, device, backend, options):
    """(this rank's settings to agree on, its set-up error or None, its device)."""
    from ..core.gpu import available as gpu_available
    error, mine, reason = None, {}, None
    try:
        if backend not in (None, "mpi", "nccl"):
            raise ArgumentError("rank %d: backend must be None, 'mpi' or 'nccl', got %r"
                                % (rank, backend))
        mine = dict(settings.options(rank, **options), backend=backend,
                    shm=settings.flag(settings.SHM, True), stores=settings.shm_stores())
        if backend != "mpi":
            reason = nccl_unavailable_reason()
            if reason is None and device is None and gpu_count() < local_size:
                reason = shared_gpu_text(local_size, gpu_count())
            if backend == "nccl" and reason is not None:
                raise BackendUnavailableError("rank %d: backend='nccl' but %s"
                                              % (rank, reason))
        if device is None and backend != "mpi" and gpu_available():
            device = default_device(local_rank)
    except CommlibError as exc:
        error = exc
    mine["nccl_usable"] = reason is None and backend != "mpi"
    return mine, error, device


def _mpi_transports(comm, local, rank, size, local_sizes, mine, use_nccl, device):
    """The MPI transport, shared memory and the status board on one node,
    the fingerprint exchange across nodes (with the hierarchical transport
    where several nodes hold several ranks each), NCCL when used. ``local``:
    the communicator of this node's ranks, taken by the hierarchical
    transport or freed; ``local_sizes``: every rank's number of ranks on
    its node."""
    from ..faults.board import LINE_BYTES, StatusBoard
    from ..faults.board_exchange import ExchangeBoard
    from ..transport.hierarchical import WINDOWS, HierarchicalTransport, usable
    from ..transport.mpi import MpiTransport, mpi
    from ..transport.shm import SharedMemoryTransport
    from .mpi_library import abort_at_exit
    segment = board = shared = nccl = window = None
    board_bytes = size * LINE_BYTES
    one_node = all(s == size for s in local_sizes)
    shm = mine["shm"] and one_node and size > 1
    if one_node and size > 1:
        segment = node_segment(
            comm, board_bytes + (SharedMemoryTransport.bytes_needed(size) if shm else 0))
    elif mine["shm"] and usable(local_sizes):
        for window in WINDOWS:              # the largest that every node has room for
            segment = node_segment(local, HierarchicalTransport.bytes_needed(local.Get_size(),
                                                                             window))
            if comm.allreduce(segment is not None, op=mpi().LAND):
                break
            if segment is not None:
                segment.close()
            segment = None                  # after the last: flat MPI everywhere
    if segment is not None and one_node:
        board = StatusBoard(segment.array[:board_bytes], rank, size)
        board.join()
    transport = MpiTransport(comm)
    if segment is not None and shm:
        shared = SharedMemoryTransport(transport, segment.array[board_bytes:],
                                       stores=mine["stores"])
    elif segment is not None and not one_node:
        across = comm.Split(local.Get_rank(), rank)
        shared, local = HierarchicalTransport(transport, local, across, segment.array,
                                              stores=mine["stores"], window_bytes=window), None
    if local is not None:
        local.Free()
    if board is None and size > 1:
        board = ExchangeBoard(transport, rank, size, on_death=lambda r: abort_at_exit(
            1, "rank %d: rank %d of the communicator died" % (rank, r)))
    if use_nccl:
        from ..transport.nccl import NcclTransport
        nid = NcclId() if rank == 0 else None
        nid = NcclId(comm.bcast(nid.data if nid is not None else None, root=0))
        nccl = NcclTransport(nid, rank, size, device)
    return dict(routes={"numpy": shared or transport, "cupy": nccl or transport},
                transports=[t for t in (shared, nccl, transport) if t is not None],
                board=board, segment=segment)


def parts_from_nccl_id(nccl_id, rank, size, device, local_rank, local_size, options):
    """The parts of :meth:`Communicator.from_nccl_id` (see there), with
    its ``options`` (resolved, :func:`commlib.settings.options`)."""
    from ..faults.board import LINE_BYTES, StatusBoard
    from ..faults.board_exchange import ExchangeBoard
    if not isinstance(nccl_id, NcclId):
        raise ArgumentError("nccl_id must be a commlib.NcclId, got %s"
                            % type(nccl_id).__name__)
    for name, value in (("rank", rank), ("size", size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ArgumentError("%s must be an int, got %r" % (name, value))
    if size < 1 or not 0 <= rank < size:
        raise ArgumentError("rank=%d, size=%d: expected size >= 1 and 0 <= rank < size"
                            % (rank, size))
    reason = nccl_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError("rank %d: from_nccl_id needs NCCL: %s" % (rank, reason))
    from ..transport.nccl import NcclTransport
    local_rank = rank if local_rank is None else local_rank
    local_size = size if local_size is None else local_size
    if device is None:
        if gpu_count() < local_size:
            raise BackendUnavailableError("rank %d: from_nccl_id: %s" % (
                rank, shared_gpu_text(local_size, gpu_count())))
        device = default_device(local_rank)
    segment = board = None
    if size > 1:
        segment = nccl_segment(nccl_id, size, size * LINE_BYTES)
    if segment is not None:
        board = StatusBoard(segment.array, rank, size)
        board.join()
    nccl = NcclTransport(nccl_id, rank, size, device)   # collective: every rank joined
    if segment is not None:
        segment.unlink()
        if not board.everyone_joined():                  # ranks on other nodes
            board, segment = None, segment.close()
    if board is None and size > 1:
        board = ExchangeBoard(nccl, rank, size)
    return dict(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                device=device, routes={"numpy": nccl, "cupy": nccl}, board=board,
                segment=segment, options=options)


def parts_single(device):
    """The parts of :meth:`Communicator.single`: one process, local collectives."""
    from ..core.gpu import available as gpu_available
    from ..transport.local import LocalTransport
    if device is None and gpu_available():
        device = 0
    local = LocalTransport()
    return dict(rank=0, size=1, local_rank=0, local_size=1, device=device,
                routes={"numpy": local, "cupy": local})


def parts_from_transport(transport, cupy_transport, local_rank, local_size, device):
    """The parts of :meth:`Communicator.from_transport` (see there): the
    caller's transports, and the fingerprint exchange over ``transport``
    as the status board when there are several ranks."""
    from ..faults.board_exchange import ExchangeBoard
    from ..transport.base import Transport
    for what, t in (("transport", transport), ("cupy_transport", cupy_transport)):
        if t is not None and not isinstance(t, Transport):
            raise ArgumentError("from_transport: %s must be a commlib.transport.base.Transport, "
                                "got %s" % (what, type(t).__name__))
    if transport is None:
        raise ArgumentError("from_transport: transport must be a Transport, got None")
    rank, size = transport.rank, transport.size
    board = ExchangeBoard(transport, rank, size) if size > 1 else None
    return dict(rank=rank, size=size, local_rank=rank if local_rank is None else local_rank,
                local_size=size if local_size is None else local_size, device=device,
                routes={"numpy": transport, "cupy": cupy_transport or transport},
                board=board)
