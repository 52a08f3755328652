"""Plain or streaming stores into the shared-memory window, chosen by
measurement and the same on every rank.

Copying into shared memory that another core read in the previous round
first takes each cache line away from that core. On cores that share a
cache this is cheap and plain stores win; on cores far apart (another core
complex or socket, or a virtual machine whose vCPUs the host moved apart) it
costs several times the copy, and streaming stores, which write whole lines
to memory without fetching them, are up to 3x faster. Which case holds can
change while a job runs, so :class:`StoreModeChooser` measures both.

Each call of the reducer reports the mode it used, its size and the busy
time (copies and reduction, not waiting) of its slowest rank. The mode in
use keeps a moving average of nanoseconds per byte; every
``explore_every``-th call tries the other mode, whose cost is that one
latest sample (an old outlier never lingers), and the cheaper mode is used
from then on. The first ``warmup`` calls (page faults, cold caches) are not
counted. Given the same reports, every rank makes the same choices.
"""


class StoreModeChooser:
    """``mode`` (False: plain stores, True: streaming) for the next call.

    ``fixed``: None to measure, or a mode to always use. Calls smaller than
    ``min_bytes`` are not measured (fixed costs dominate them).
    """

    def __init__(self, fixed=None, explore_every=32, alpha=0.25, min_bytes=256 << 10,
                 warmup=2):
        self.fixed = fixed
        self.warmup = warmup
        self.explore_every = explore_every
        self.alpha = alpha
        self.min_bytes = min_bytes
        #: ns per byte with plain and with streaming stores (None: not measured yet)
        self.cost = [None, None]
        self.measured = 0         # calls measured, the warm-up calls included
        self.best = bool(fixed)   # the mode used between explorations
        self.mode = bool(fixed)

    def observe(self, mode, nbytes, busy_ns):
        """Record a call that used ``mode`` on ``nbytes`` bytes and kept its
        slowest rank busy ``busy_ns`` nanoseconds; set :attr:`mode` for the
        next call."""
        if self.fixed is not None:
            return
        if nbytes >= self.min_bytes and busy_ns > 0:
            x, old = busy_ns / nbytes, self.cost[mode]
            if self.measured < self.warmup:
                pass
            elif mode == self.best and old is not None:
                self.cost[mode] = old + self.alpha * (x - old)
            else:
                self.cost[mode] = x
            self.measured += 1
        plain, streaming = self.cost
        if plain is None or streaming is None:
            self.mode = plain is not None      # measure plain first, then streaming
            return
        self.best = streaming < plain
        explore = self.measured % self.explore_every == 0
        self.mode = self.best != explore
