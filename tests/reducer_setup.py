"""Rank-side helper of tests/test_shm_reducer.py: a SharedMemoryReducer over
memory shared by the ranks of MPI.COMM_WORLD, as the communicator makes it."""
from commlib import bootstrap
from commlib.transport.shm import SharedMemoryReducer


def make_reducer(comm, capacity_bytes=4 << 20, **options):
    """A reducer of ``capacity_bytes`` per round (collective over ``comm``)."""
    nbytes = SharedMemoryReducer.bytes_needed(comm.Get_size(), max(1, capacity_bytes))
    segment = bootstrap.node_segment(comm, nbytes)
    assert segment is not None, "no shared memory on this node"
    reducer = SharedMemoryReducer(comm, segment.array, capacity_bytes, **options)
    reducer.segment = segment          # keeps the mapping alive with the reducer
    return reducer
