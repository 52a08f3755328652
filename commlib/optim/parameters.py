"""Making and checking that every rank holds the same parameters."""
import hashlib
from collections import Counter

import numpy as np

from ..collective import validation
from ..errors import ConsistencyError
from ..ops.arrays import is_cupy

#: bytes of each parameter's digest
DIGEST_BYTES = 8


def broadcast_parameters(comm, params, root=0):
    """Copy ``root``'s ``params`` (list of numpy or cupy arrays) into every
    rank's, in place (collective).

    Args:
        comm: a :class:`commlib.Communicator`.
        params: list of numpy or cupy arrays, of the same shapes and dtypes
            on every rank.
        root: the rank whose arrays every rank takes.

    Returns:
        ``params`` (the same list).

    Raises:
        ArgumentError: ``root`` out of range.
        ArrayTypeError: ``params`` not writeable arrays of one kind.
        ConsistencyError: the ranks' arrays differ in number, shape or dtype
            (found by the communicator's consistency check, on by default).
        ClosedError, CollectiveTimeoutError, PeerError: from the broadcast
            (``comm`` closed or unusable; a peer hangs, died or left).
    """
    comm.broadcast(params, root=root)
    return params


def digest(array):
    """``DIGEST_BYTES`` bytes (uint8 array) of BLAKE2b over ``array``'s
    shape, dtype and bytes (cupy arrays are copied to the host)."""
    host = array.get() if is_cupy(array) else array
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(repr((tuple(host.shape), host.dtype.str, host.dtype.name)).encode())
    h.update(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
    return np.frombuffer(h.digest(), np.uint8)


def check_parameters(comm, params):
    """Raise :class:`~commlib.errors.ConsistencyError` on every rank when
    some rank's ``params`` differ (by bytes, shape or dtype) from the
    majority's (ties go to the lowest rank); its ``culprits`` are the ranks
    that differ. Collective: each rank hashes its parameters and the
    ``DIGEST_BYTES``-byte digests are all-gathered (a different number of
    parameters on some rank is a ConsistencyError of the all-gather).

    Args:
        comm: a :class:`commlib.Communicator`.
        params: list of numpy or cupy arrays (read only).

    Raises:
        ConsistencyError: on every rank, as above.
        ArrayTypeError: ``params`` not arrays of one kind.
        ClosedError, CollectiveTimeoutError, PeerError: from the all-gather
            (``comm`` closed or unusable; a peer hangs, died or left).
    """
    params = validation.as_list(params, "params", comm.rank)[0]
    validation.check_arrays(params, rank=comm.rank, writeable=False, what="params")
    mine = (np.concatenate([digest(p) for p in params]) if params
            else np.zeros(0, np.uint8))
    everyone = comm.all_gather(mine).reshape(comm.size, len(params), DIGEST_BYTES)
    differ, first = set(), None
    for i in range(len(params)):
        column = [row[i].tobytes() for row in everyone]
        counts = Counter(column)
        best = max(counts.values())
        majority = next(d for d in column if counts[d] == best)     # lowest rank on ties
        odd = [r for r, d in enumerate(column) if d != majority]
        if odd and first is None:
            first = i
        differ.update(odd)
    if differ:
        raise ConsistencyError(
            "rank %d: check_parameters: the parameters of rank%s %s differ from the other "
            "ranks' (first at params[%d], shape %s, dtype %s)"
            % (comm.rank, "s" if len(differ) > 1 else "", ", ".join(map(str, sorted(differ))),
               first, tuple(params[first].shape), params[first].dtype),
            culprits=sorted(differ))
