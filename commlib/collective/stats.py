"""What a communicator has done: :class:`CommStats` (``comm.stats``), and
:class:`TracedTransport`, the front through which the communicator hands
every buffer to a transport while tracing.

``bytes_sent`` counts the payload this rank handed to its transports, after
compression: for every transport call, the bytes of the buffer it was given
to contribute (an all-reduce's buffer, a broadcast's buffer on every rank, a
gather's send buffer; a barrier counts 0). What travels on the wire
depends on the transport's algorithm (a ring all-reduce sends about
``2 (n-1)/n`` times that); the count is the same on every transport.
The collectives count them where they hand a buffer over. While tracing
(:mod:`commlib.trace`), each call is also recorded as a ``transport`` event
with the same bytes, so those events' bytes add up to ``bytes_sent``.
"""
from .. import trace

class CommStats:
    """Counters of one communicator, since it was made or since :meth:`reset`.

    ``bytes_sent`` (int, bytes, see the module docstring), ``collectives``
    (int: collectives entered, sync or async, including failed ones),
    ``blocked_seconds`` (float: wall time the calling thread spent inside
    blocking collective calls and :meth:`commlib.Work.wait`). The first two
    are updated by whichever thread executes the collective (one at a time),
    the third by the calling thread: no counter has two writers at once.

    The communicator makes one (``comm.stats``); the constructor takes no
    arguments and starts every counter at zero.
    """

    __slots__ = ("bytes_sent", "collectives", "blocked_seconds")

    def __init__(self):
        self.reset()

    def reset(self):
        """Set every counter to zero (call it while no collective is outstanding)."""
        self.bytes_sent, self.collectives, self.blocked_seconds = 0, 0, 0.0

    def snapshot(self):
        """The counters as a dict (a copy).

        Returns:
            ``{"bytes_sent": int, "collectives": int, "blocked_seconds":
            float}``, not updated afterwards.
        """
        return {"bytes_sent": self.bytes_sent, "collectives": self.collectives,
                "blocked_seconds": self.blocked_seconds}

    def add_bytes(self, nbytes):
        """Count bytes handed to a transport.

        Args:
            nbytes: the number of bytes (anything ``int()`` takes), added to
                ``bytes_sent``.
        """
        self.bytes_sent += int(nbytes)

    def add_collective(self):
        """Count one collective entered (``collectives`` += 1)."""
        self.collectives += 1

    def add_blocked(self, seconds):
        """Count time the calling thread spent blocked in a collective.

        Args:
            seconds: wall time (a float), added to ``blocked_seconds``.
        """
        self.blocked_seconds += seconds

    def __repr__(self):
        return "CommStats(%s)" % ", ".join("%s=%r" % kv for kv in self.snapshot().items())


class TracedTransport:
    """``transport`` with every collective call recorded as a ``transport``
    event of the bytes it was handed (what the communicator's collectives
    call while tracing, see :meth:`Session.transport
    <commlib.collective.session.Session.transport>`); everything else
    (``name``, ``rank``, ``reduces_parts``, ...) is the transport's own."""

    def __init__(self, transport):
        self.transport = transport
        self.name, self.rank, self.size = transport.name, transport.rank, transport.size

    def __getattr__(self, name):
        return getattr(self.transport, name)


def _traced(name, at=0):
    """A TracedTransport method forwarding ``name``; argument ``at`` is the
    buffer whose bytes are recorded (None: no bytes)."""
    def call(self, *args, **kwargs):
        nbytes = 0 if at is None else args[at].nbytes
        return trace.transport_call(self.rank, self.name, name, nbytes,
                                    getattr(self.transport, name), args, kwargs)
    call.__name__ = name
    return call


for _name in ("all_reduce", "broadcast", "reduce", "all_gather", "all_gatherv",
              "reduce_scatter"):
    setattr(TracedTransport, _name, _traced(_name))
TracedTransport.all_reduce_parts = _traced("all_reduce_parts", at=1)
TracedTransport.barrier = _traced("barrier", at=None)


def _traced_cast(self, parts, *args, **kwargs):
    """The transport's all_reduce_cast, recorded with the bytes of its
    half-format wire (two per element)."""
    return trace.transport_call(self.rank, self.name, "all_reduce_cast",
                                2 * sum(p.size for p in parts),
                                self.transport.all_reduce_cast, (parts,) + args, kwargs)


TracedTransport.all_reduce_cast = _traced_cast
