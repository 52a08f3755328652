"""What a communicator is made of while it lives: its transports and how
arrays are routed to them, the status board, options, caches and counters,
and the steps every collective takes (begin: checks and the consistency
check; run: the data phase; fail; close). :class:`Session` is the
communicator's internal state, shared by :mod:`commlib.collective.collectives`,
:mod:`commlib.collective.fusion` and :mod:`commlib.progress.issuing`; users hold a
:class:`~commlib.Communicator`, which keeps one.
"""
import time

from ..faults import board as _board
from ..startup import bootstrap, lifetime
from . import bucketing, consistency, validation
from .. import settings, trace
from ..errors import (ArgumentError, ClosedError, CommlibError, ConsistencyError, NonFiniteError,
                      PayloadError)
from .stats import CommStats, CountingTransport
from ..faults.waiting import Wait, background, relaxed

#: errors a collective raises alike on every rank, after which it stays usable
AGREED = (NonFiniteError, PayloadError)


class Session:
    """The state of one communicator (see the module docstring)."""

    def __init__(self, *, rank, size, local_rank, local_size, routes, transports=None,
                 device=None, board=None, segment=None, bucket_bytes=None, check=None,
                 timeout=None):
        """A session of the parts a communicator's factory made: ``routes``: ``{"numpy": transport, "cupy":
        transport}``, the :class:`~commlib.transport.base.Transport` that
        carries arrays of each kind; ``transports``: every transport the
        communicator owns, fails and closes (default: those of ``routes``);
        ``board``: the status board of the consistency check and the watch
        dog (None: no check); ``segment``: shared memory to close last."""
        options = bootstrap.check_options(bucket_bytes, check, timeout)
        trace.from_environment()
        if not isinstance(routes, dict) or set(routes) != {"numpy", "cupy"}:
            raise ArgumentError("Communicator: routes must be a dict with the keys 'numpy' and "
                                "'cupy', got %r" % (routes,))
        self.rank, self.size = rank, size
        trace.made(rank)
        self.local_rank, self.local_size = local_rank, local_size
        self.device = device
        #: array kind -> the transport that carries it
        self.routes = dict(routes)
        #: every transport, the one in front of another first
        self.transports = list(transports or dict.fromkeys(routes.values()))
        self.stats = CommStats()
        #: what collectives call: each transport behind a front counting its bytes
        self.counted = {id(t): CountingTransport(t, self.stats) for t in self.transports}
        self.progress = None     # the queue of asynchronous collectives, made on first use
        self.side = None         # the side stream of asynchronous GPU collectives
        #: run asynchronous collectives on a thread (None: decide, see commlib.progress.issuing.threaded)
        self.async_threaded = None
        #: asynchronous all-reduces over MPI in flight at once (see commlib.progress.inflight)
        self.async_depth = settings.async_depth()
        self.bucket_bytes = options["bucket_bytes"]
        self.check = options["check"]
        self.timeout = options["timeout"]
        self.board, self.segment = board, segment
        self.fusion = bucketing.FusionCache()
        self.workspaces = {}     # compression state, see commlib.collective.fusion.workspace
        self.seq = 0             # collectives entered
        self.failure = None      # the error that left the communicator unusable
        self.closed = False
        self.registration = lifetime.Registration(abandon=self.abandon_on_exception,
                                                  close=self.close_at_exit)
        if board is not None:
            board.warn_after = settings.stall_warning()
        self.relaxed_board = self.sleeping_board(board)
        if size > 1:
            self.registration.open()

    def transport(self, kind):
        """The transport for arrays of ``kind`` (see ``routes``), behind its
        byte counter."""
        return self.counted[id(self.routes[kind])]

    def bucket_bytes_for(self, transport):
        return self.bucket_bytes or bucketing.default_bucket_bytes(transport.name)

    def usable(self, name):
        if self.closed:
            raise ClosedError("rank %d: %s called after close()" % (self.rank, name))
        if self.failure is not None:
            raise ClosedError("rank %d: %s called on a communicator left unusable by an "
                              "earlier failure: %s" % (self.rank, name, self.failure),
                              culprits=getattr(self.failure, "culprits", ()))

    def begin(self, name, params, checks, layout=lambda: ([], None), timeout=None,
              kind_matters=False):
        """Start collective ``name``: run ``checks()`` (returns the array
        kind; raises CommlibError for bad arguments), then, when the check is
        on, compare the call with every rank: ``params`` (tuple of the call's
        parameters), the array kind too when it ``kind_matters`` (a
        compressed call's exchange depends on it), and ``layout()`` (the
        list of arrays whose dtypes and shapes must match, and its
        PreparedList or None). ``timeout`` replaces the watch dog's
        deadline. Returns (kind, wait) or raises, on every rank alike when
        the check is on."""
        self.usable(name)
        self.stats.add_collective()
        start = trace.now() if trace.ON else 0.0
        error = kind = None
        try:
            kind = checks()
        except CommlibError as exc:
            error = exc
        if start:
            start = trace.checked(self.rank, start)
        seq = self.seq = self.seq + 1
        timeout = self.timeout if timeout is None else timeout
        wait = Wait(None if timeout is None else time.monotonic() + timeout, seq,
                    consistency.CODES[name], self.board, self.rank)
        board = self.board if self.relaxed_board is None or not (
            relaxed() or background() is not None) else self.relaxed_board
        if board is not None and not self.check:
            board.arrive(seq)
        elif board is not None:
            digest = arrays = None
            shown = kind if kind_matters else None
            if error is None:
                arrays, prepared = layout()
                digest = (prepared.digest if prepared is not None else
                          consistency.layout_digest(arrays),
                          consistency.params_digest(params + (shown,)))
            try:
                board.enter(seq, wait.what, digest, wait.deadline, error,
                            lambda: consistency.describe(params, arrays, shown))
            except (CommlibError, KeyboardInterrupt) as exc:
                if exc is not error and not isinstance(exc, ConsistencyError):
                    self.fail(exc)
                raise
        if start:
            trace.began(self, name, seq, kind, params, layout()[0] if error is None else (),
                        start, board is not None and self.check)
        if error is not None:
            raise error
        return kind, wait

    @staticmethod
    def sleeping_board(board):
        """For the progress thread: a second view of the same status board
        whose compiled waits sleep between short spins
        (:class:`commlib.faults.waiting.SleepingWaits`; without the compiled loops
        the Python waits sleep on a relaxed thread anyway); None when there
        is no status board."""
        if not isinstance(board, _board.StatusBoard):
            return None
        twin = _board.StatusBoard(board.memory, board.rank, board.size, sleeping=True)
        twin.warn_after = board.warn_after
        return twin

    def fail(self, exc):
        """A collective failed: the communicator is unusable from now on and
        its peers learn that this rank gave up."""
        if self.failure is None:
            self.failure = exc
            if self.board is not None:
                text = "%s: %s" % (type(exc).__name__, exc) if str(exc) else type(exc).__name__
                self.board.leave(self.seq - 1, _board.GAVE_UP, text,
                                 blame=getattr(exc, "culprits", ()))
            for transport in self.transports:
                transport.fail("%s: %s" % (type(exc).__name__, exc))

    def run(self, phase, *args, deferred=False, **named):
        """The data phase of a collective, ``phase(*args, **named)``: any
        failure but an agreed one leaves the communicator unusable. Unless
        it is ``deferred`` (its requests left in flight, see
        :func:`commlib.progress.issuing.in_flight`), the collectives in flight
        complete first."""
        progress = self.progress
        if not deferred and progress is not None and progress.may_defer() \
                and progress.in_flight():
            progress.complete_flight()
        try:
            return phase(*args, **named)
        except AGREED:
            raise
        except BaseException as exc:
            self.fail(exc)
            raise

    def array_checks(self, arrays, writeable=True, floating=False):
        return validation.check_arrays(arrays, rank=self.rank, device=self.device,
                                       writeable=writeable, floating=floating)

    def one_array(self, name, array):
        """``array``, the one array collective ``name`` takes, as a numpy or
        cupy array (a view of another framework's, see :mod:`commlib.interop`)."""
        if isinstance(array, (list, tuple)):
            raise ArgumentError("rank %d: %s takes one array, got a %s"
                                % (self.rank, name, type(array).__name__))
        return validation.as_list(array, name, self.rank)[0][0]

    def close(self, reason):
        if self.closed:
            return
        try:
            if self.progress is not None:
                self.progress.drain()        # outstanding asynchronous collectives
            board, failed = self.board, self.failure is not None
            if board is not None and not failed:
                board.leave(self.seq, reason)
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
                board.wait_left(self.seq, deadline)
        finally:
            self.release()

    def abandon_on_exception(self, text):
        self.abandon(_board.CLOSED_ON_EXCEPTION, text)

    def close_at_exit(self):
        self.close(_board.EXITED)

    def abandon(self, reason, text):
        """Leave without waiting for anyone (an exception is on its way up)."""
        if self.closed:
            return
        if self.board is not None:
            self.board.leave(self.seq, reason, text)
        self.release()

    def release(self):
        """Free this rank's resources; never waits for the other ranks."""
        self.closed = True
        self.registration.closed()
        if trace.ON:
            trace.closed(self.rank)
        if not self.quiesce():
            return        # a collective still runs on the progress thread: keep its memory
        self.fusion.clear()
        for transport in self.transports:
            transport.close()
        if self.segment is not None:
            self.board = None
            self.segment.close()
            self.segment = None

    def quiesce(self):
        """End the progress thread: queued collectives fail with ClosedError,
        the one executing is interrupted (as by Ctrl-C). Returns whether it
        is idle (it stops within milliseconds, its waits return to Python
        often)."""
        progress = self.progress
        if progress is None:
            return True
        progress.stop()
        progress.cancel_queued(ClosedError("rank %d: the communicator was closed before this "
                                           "collective started" % self.rank))
        return progress.interrupt()
