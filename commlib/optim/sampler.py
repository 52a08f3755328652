"""Which items of a data set each rank takes in an epoch: PyTorch's
``DistributedSampler`` for numpy loops."""
import math

import numpy as np

from ..errors import ArgumentError


def _int(value, what, low, rank=None):
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
            or value < low):
        raise ArgumentError("%sDistributedSampler: %s must be an int >= %d, got %r"
                            % ("" if rank is None else "rank %d: " % rank, what, low, value))
    return int(value)


class DistributedSampler:
    """Every rank its share of ``0 .. n-1``, reshuffled each epoch.

    Each epoch the items are permuted by ``numpy.random.default_rng([seed,
    epoch])`` (the same on every rank, without communication), then rank r
    takes every ``size``-th item from position r (PyTorch's layout). The
    remainder when ``size`` does not divide ``n``: ``drop_last=True`` drops
    the last ``n % size`` items of the permutation (every rank ``n // size``
    items); else with ``pad=True`` (default) the first items of the
    permutation are repeated to fill the last round (every rank
    ``ceil(n / size)``); with ``pad=False`` every item is taken exactly once
    and the first ``n % size`` ranks have one more (uneven: finish with
    :meth:`DistributedOptimizer.join <commlib.optim.DistributedOptimizer.join>`).

    Args:
        n: number of items (int >= 0).
        comm: a Communicator, for ``rank`` and ``size`` (or give those).
        rank, size: this rank and the number of ranks.
        shuffle: False: the items in order (no permutation).
        seed: int, the same on every rank.
        drop_last, pad: the remainder, as above.

    Raises:
        ArgumentError: a bad value, naming it; ``comm`` together with
            ``rank`` or ``size``, or neither; not ``0 <= rank < size``.
    """

    def __init__(self, n, comm=None, *, rank=None, size=None, shuffle=True, seed=0,
                 drop_last=False, pad=True):
        if comm is not None:
            if rank is not None or size is not None:
                raise ArgumentError("DistributedSampler: give comm or rank and size, not both")
            rank, size = getattr(comm, "rank", None), getattr(comm, "size", None)
            if rank is None or size is None:
                raise ArgumentError("DistributedSampler: comm must be a commlib.Communicator "
                                    "(with rank and size), got %s" % type(comm).__name__)
        if rank is None or size is None:
            raise ArgumentError("DistributedSampler: needs comm, or rank and size")
        self.size = _int(size, "size", 1)
        self.rank = _int(rank, "rank", 0)
        if self.rank >= self.size:
            raise ArgumentError("DistributedSampler: expected 0 <= rank < size, got rank=%d, "
                                "size=%d" % (self.rank, self.size))
        self.n = _int(n, "n", 0, self.rank)
        self.seed = _int(seed, "seed", 0, self.rank)
        for what, value in (("shuffle", shuffle), ("drop_last", drop_last), ("pad", pad)):
            if not isinstance(value, (bool, np.bool_)):
                raise ArgumentError("rank %d: DistributedSampler: %s must be True or False, "
                                    "got %r" % (self.rank, what, value))
        self.shuffle, self.drop_last, self.pad = bool(shuffle), bool(drop_last), bool(pad)
        self.epoch = 0

    def set_epoch(self, epoch):
        """Use the permutation of ``epoch`` (call it at the start of each
        epoch, with the same value on every rank).

        Args:
            epoch: an int >= 0.

        Raises:
            ArgumentError: not an int >= 0.
        """
        self.epoch = _int(epoch, "epoch", 0, self.rank)

    def indices(self):
        """This rank's items of the current epoch.

        Returns:
            An int64 numpy array of item indices (``len(self)`` of them).
        """
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
                 if self.shuffle else np.arange(self.n))
        if self.drop_last:
            order = order[:self.n // self.size * self.size]
        elif self.pad and self.n % self.size:
            total = math.ceil(self.n / self.size) * self.size
            if self.n == 0:
                return np.zeros(0, np.int64)
            order = np.resize(order, total)      # repeats from the start
        return order[self.rank::self.size].astype(np.int64)

    def batches(self, batch_size, drop_last=False):
        """This rank's items of the current epoch in batches.

        Args:
            batch_size: int >= 1.
            drop_last: leave out the last, shorter batch.

        Returns:
            List of int64 arrays.

        Raises:
            ArgumentError: a bad batch_size.
        """
        batch_size = _int(batch_size, "batch_size", 1, self.rank)
        mine = self.indices()
        stop = len(mine) // batch_size * batch_size if drop_last else len(mine)
        return [mine[i:i + batch_size] for i in range(0, stop, batch_size)]

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        if self.drop_last:
            return self.n // self.size
        if self.pad:
            return math.ceil(self.n / self.size)
        return self.n // self.size + (self.rank < self.n % self.size)

    def __repr__(self):
        return ("DistributedSampler(n=%d, rank=%d, size=%d, shuffle=%r, seed=%d, "
                "drop_last=%r, pad=%r, epoch=%d)" % (self.n, self.rank, self.size, self.shuffle,
                                                     self.seed, self.drop_last, self.pad,
                                                     self.epoch))
