"""What a DistributedOptimizer's communication costs: the seconds blocked
in its collectives, and the payload bytes the communicator handed to its
transports from the first collective of an update to its end."""
import time


class CommMeter:
    """The counters behind ``DistributedOptimizer.stats``.

    Args:
        comm: the communicator whose ``stats.bytes_sent`` is read.
    """

    def __init__(self, comm):
        self.comm = comm
        self.seconds = 0.0      # blocked in the optimizer's collectives
        self.bytes = 0          # bytes_sent within closed windows
        self.window = None      # bytes_sent at the first collective of the open window

    def timed(self, fn, *args):
        """``fn(*args)`` (a collective), its time added to :attr:`seconds`;
        opens a window when none is open."""
        if self.window is None:
            self.window = self.comm.stats.bytes_sent
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def close(self):
        """Close the open window (at the end of an update): the bytes sent
        since it opened are added to :attr:`bytes`."""
        if self.window is not None:
            self.bytes += self.comm.stats.bytes_sent - self.window
            self.window = None
