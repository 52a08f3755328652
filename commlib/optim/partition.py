"""Which items of a data set a rank trains on (SINGA's ``data_partition``)."""
import numpy as np

from ..errors import ArgumentError


def _index(value, what, rank):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentError("rank %s: partition: %s must be an int, got %r" % (rank, what, value))
    return int(value)


def partition(n, rank, size, drop_remainder=True):
    """The ``slice`` of items ``0 .. n-1`` that ``rank`` (of ``size`` ranks)
    takes: contiguous shards in rank order.

    Args:
        n: the number of items (int >= 0).
        rank: the rank whose share is wanted (int, ``0 <= rank < size``).
        size: the number of ranks (int >= 1).
        drop_remainder: True: every rank gets ``n // size`` items and the
            last ``n % size`` items are left out (every rank then takes the
            same number of steps). False: every item is taken once, the
            first ``n % size`` ranks get one more.

    Returns:
        A ``slice`` of ``range(n)``.

    Raises:
        ArgumentError: ``n``, ``rank`` or ``size`` not an int, ``n < 0``, or
            not ``0 <= rank < size``; naming the rank.
    """
    n, rank, size = (_index(n, "n", rank), _index(rank, "rank", rank),
                     _index(size, "size", rank))
    if n < 0:
        raise ArgumentError("rank %d: partition: n must be >= 0, got %d" % (rank, n))
    if size < 1 or not 0 <= rank < size:
        raise ArgumentError("rank %d: partition: expected 0 <= rank < size, got rank=%d, "
                            "size=%d" % (rank, rank, size))
    share, extra = divmod(n, size)
    if drop_remainder:
        return slice(rank * share, (rank + 1) * share)
    start = rank * share + min(rank, extra)
    return slice(start, start + share + (rank < extra))
