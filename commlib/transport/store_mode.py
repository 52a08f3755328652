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
time (copies and reduction, not waiting) of its slowest rank. The first
``warmup`` calls use the ``initial`` mode (the reducer measures one at
start-up) and are not counted (page faults, cold caches; and a short job, or
one that reduces seldom, never pays for trying the other mode). Then the modes take turns until each has ``samples``
measurements; a mode's cost is the
median of its last ``samples`` measurements in nanoseconds per byte, so one
outlier never decides. The chooser then uses the cheaper mode, switching only
when the other costs less than ``switch_below`` times the one in use (noise
between close modes does not flip it), and gives the other mode one call
every ``explore_every`` calls to keep its cost current. Given the same
reports, every rank makes the same choices.
"""
import collections
import statistics


class StoreModeChooser:
    """``mode`` (False: plain stores, True: streaming) for the next call.

    ``fixed``: None to measure, or a mode to always use. ``initial``: the
    mode of the warm-up calls (see :meth:`SharedMemoryReducer.probe_stores
    <commlib.transport.shm.SharedMemoryReducer.probe_stores>`). Calls
    smaller than ``min_bytes`` are not measured (fixed costs dominate them).
    """

    def __init__(self, fixed=None, explore_every=16, samples=3, min_bytes=256 << 10,
                 warmup=32, switch_below=0.7, initial=False):
        self.fixed = fixed
        self.explore_every = explore_every
        self.min_bytes = min_bytes
        self.warmup = warmup
        self.switch_below = switch_below
        #: recent ns per byte with plain and with streaming stores
        self.samples = (collections.deque(maxlen=samples), collections.deque(maxlen=samples))
        self.measured = 0         # calls measured, the warm-up calls included
        self.best = self.mode = bool(initial if fixed is None else fixed)

    @property
    def cost(self):
        """[plain, streaming]: median recent ns per byte, None while unmeasured."""
        return [statistics.median(s) if s else None for s in self.samples]

    def observe(self, mode, nbytes, busy_ns):
        """Record a call that used ``mode`` on ``nbytes`` bytes and kept its
        slowest rank busy ``busy_ns`` nanoseconds; set :attr:`mode` for the
        next call."""
        if self.fixed is not None:
            return
        if nbytes >= self.min_bytes and busy_ns > 0:
            if self.measured >= self.warmup:
                self.samples[mode].append(busy_ns / nbytes)
            self.measured += 1
        plain, streaming = self.samples
        full = plain.maxlen
        if len(plain) < full or len(streaming) < full:      # take turns until both are measured
            self.mode = len(streaming) < len(plain)
            return
        cost = self.cost
        if cost[not self.best] < self.switch_below * cost[self.best]:
            self.best = not self.best
        explore = self.measured % self.explore_every == 0
        self.mode = self.best != explore
