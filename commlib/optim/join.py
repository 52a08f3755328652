"""Uneven inputs (``DistributedOptimizer.join()``, as Horovod's and DDP's
``join``): inside the block every update starts with a vote (who brings
gradients, with which clip norm and hyperparameters); a rank that has left
takes part in the others' updates with no gradients of its own, and at the
end every rank takes the hyperparameters and schedulers' state of the rank
that took the most steps."""
import contextlib

import numpy as np

from ..compression import HalfPrecision
from ..errors import ArgumentError


def check_joinable(strategy, rank):
    """ArgumentError unless ``strategy`` can take ranks that have finished
    (none, fp16 or bf16)."""
    if strategy is not None and not isinstance(strategy, HalfPrecision):
        raise ArgumentError("rank %d: join(): only plain or half-precision averaging can "
                            "take ranks that have finished, not compression=%r"
                            % (rank, strategy))


def sync_small_state(comm, live_state, loaded, root):
    """Broadcast root's group hyperparameters and schedulers' state (the
    ``groups.*`` and ``scheduler.*`` arrays of ``live_state()``), then
    ``loaded(live)``."""
    live = {k: v for k, v in live_state().items()
            if k.startswith("groups.") or k.startswith("scheduler.")}
    names = sorted(live)
    if not names:
        return
    copies = [np.array(live[k], copy=True) for k in names]
    comm.broadcast(copies, root=root)
    for name, value in zip(names, copies):
        live[name][...] = value
    loaded(live)


class Join:
    """The state of a ``join()`` block.

    Args:
        comm: the communicator.
        meter: the :class:`~commlib.optim.metering.CommMeter` timing the votes.
        groups: the :class:`~commlib.optim.param_groups.ParamGroups` voted on.
        accumulation: the :class:`~commlib.optim.accumulation.Accumulation`
            (the block starts and ends between micro-batches).
    """

    def __init__(self, comm, meter, groups, accumulation):
        self.comm, self.meter, self.groups = comm, meter, groups
        self.accumulation = accumulation
        self.joining = False        # inside join(): vote before every average
        self.updates = 0            # updates with this rank's own gradients in join()
        self.clip = None            # the clip_norm of the update voted on
        self.table = None           # the last vote, one row per rank

    def vote(self, active):
        """Every rank says whether it brings gradients; returns how many do.
        A rank that has finished takes the clip norm and hyperparameters of
        the lowest rank that has not (so every rank applies the same
        update)."""
        clip = self.clip if active and self.clip is not None else -1.0
        row = np.array([1.0 if active else 0.0, float(self.updates), clip]
                       + self.groups.vector(), np.float64)
        table = self.meter.timed(self.comm.all_gather, row).reshape(self.comm.size, -1)
        self.table = table
        count = int(table[:, 0].sum())
        if not active and count:
            first = int(np.argmax(table[:, 0] > 0))
            self.clip = None if table[first, 2] < 0 else float(table[first, 2])
            self.groups.set_vector(table[first, 3:])
        return count

    @contextlib.contextmanager
    def block(self, owner, idle_update):
        """The ``join()`` context of the optimizer ``owner``, yielding it:
        after this rank has left, ``idle_update(strategy, clip, active)``
        takes part in each update of the ``active`` ranks that have not
        (with ``owner.compression``), then every rank takes the
        hyperparameters and schedulers' state (``owner.live_state()``,
        ``owner.loaded()``) of the rank that took the most steps."""
        rank, accumulation, compression = self.comm.rank, self.accumulation, owner.compression
        if self.joining:
            raise ArgumentError("rank %d: join(): already inside join()" % rank)
        if accumulation.marked:
            raise ArgumentError("rank %d: join(): entered in the middle of a micro-batch "
                                "whose gradients were marked ready" % rank)
        check_joinable(compression, rank)
        self.joining, self.updates = True, 0
        try:
            yield owner
            if accumulation.micro:
                raise ArgumentError("rank %d: join(): left after %d of %d micro-batches of an "
                                    "update; finish the update first"
                                    % (rank, accumulation.micro, accumulation.accumulate))
            while True:
                try:
                    count = self.vote(False)
                    if not count:
                        break
                    idle_update(compression, self.clip, count)
                finally:
                    self.meter.close()
            root = int(np.argmax(self.table[:, 1]))
            sync_small_state(self.comm, owner.live_state, owner.loaded, root)
        finally:
            self.joining = False
