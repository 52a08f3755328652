"""What a communicator is made of while it lives: its transports and how
arrays are routed to them, the status board, options, caches and counters,
the queue of asynchronous collectives, and the steps every collective takes
(:meth:`Session.begin`: checks and the consistency check;
:meth:`Session.data_phase`: the data moves; :meth:`Session.fail`;
:meth:`Session.close`). :class:`Session` is the communicator's internal
state, used by :mod:`commlib.collective.collectives`; users hold a
:class:`~commlib.Communicator`, which keeps one.
"""
import contextlib
import time
import weakref

from ..faults import board as _board
from ..progress import inflight
from ..progress.work import Progress, gpu_order
from . import bucketing, lifetime
from .p2p import PairWait
from ..core import fingerprints
from .. import settings, trace
from ..errors import (ArgumentError, ClosedError, CollectiveTimeoutError, CommlibError,
                      ConsistencyError, NonFiniteError, PayloadError, PeerError, rank_name)
from .stats import CommStats, TracedTransport
from ..core import waiting
from ..core.waiting import Wait

#: errors a collective raises alike on every rank, after which it stays usable
AGREED = (NonFiniteError, PayloadError)


class Session:
    """The state of one communicator (see the module docstring).

    Args:
        rank, size, local_rank, local_size, device: as the communicator's
            properties.
        routes: ``{"numpy": transport, "cupy": transport}``, the
            :class:`~commlib.transport.base.Transport` that carries arrays
            of each kind.
        options: the resolved options (:func:`commlib.settings.options`).
        transports: every transport the communicator owns, fails and
            closes (default: those of ``routes``).
        board: the status board of the consistency check and the watch
            dog (None: no check).
        segment: shared memory to close last.
    """

    def __init__(self, *, rank, size, local_rank, local_size, routes, options, transports=None,
                 device=None, board=None, segment=None):
        trace.from_environment()
        if not isinstance(routes, dict) or set(routes) != {"numpy", "cupy"}:
            raise ArgumentError("Communicator: routes must be a dict with the keys 'numpy' and "
                                "'cupy', got %r" % (routes,))
        self.rank, self.size = rank, size
        trace.made(rank)
        self.local_rank, self.local_size = local_rank, local_size
        waiting.set_cores_shared(settings.waits_sleep(local_size))
        self.device = device
        #: array kind -> the transport that carries it
        self.routes = dict(routes)
        #: every transport, the one in front of another first
        self.transports = list(transports or dict.fromkeys(routes.values()))
        self.stats = CommStats()
        #: while tracing, what collectives call: each transport behind a
        #: front recording its calls
        self.traced = {id(t): TracedTransport(t) for t in self.transports}
        self.progress = None     # the queue of asynchronous collectives, made on first use
        self.side = None         # the side stream of asynchronous GPU collectives
        #: run asynchronous collectives on a thread (None: decide, see threaded())
        self.async_threaded = None
        #: asynchronous all-reduces over MPI in flight at once (see commlib.progress.inflight)
        self.async_depth = settings.async_depth()
        self.bucket_bytes = options["bucket_bytes"]
        self.check = options["check"]
        self.timeout = options["timeout"]
        self.board, self.segment = board, segment
        #: per rank, its rank in the communicator this one was split from
        #: (transitively: the first one), or None (see name_world)
        self.world = None
        self.fusion = bucketing.FusionCache()
        #: compression state per list layout (see PreparedList.split)
        self.workspaces = {}
        self.seq = 0             # collectives entered
        self.failure = None      # the error that left the communicator unusable
        self.closed = False
        self.registration = lifetime.Registration(abandon=self.abandon_on_exception,
                                                  close=self.close_at_exit)
        if board is not None:
            board.warn_after = settings.stall_warning()
        if size > 1:
            self.registration.open()

    def name_world(self, world):
        """Name rank r ``rank r (world rank world[r])`` in this
        communicator's errors, the status board's included (a
        communicator made by ``split``)."""
        self.world = list(world)
        if self.board is not None:
            self.board.world = self.world

    def world_rank(self, r):
        """Rank ``r``'s rank in the first communicator (see :meth:`name_world`)."""
        return r if self.world is None else self.world[r]

    def name(self, r):
        """How errors name rank ``r``: ``rank 3``, ``rank 1 (world rank 3)``."""
        return rank_name(r, self.world)

    def transport(self, kind):
        """The transport for arrays of ``kind`` (see ``routes``); while
        tracing, behind the front that records its calls."""
        transport = self.routes[kind]
        return self.traced[id(transport)] if trace.ON else transport

    def bucket_bytes_for(self, transport):
        return self.bucket_bytes or bucketing.default_bucket_bytes(transport.name)

    def usable(self, name):
        if self.closed:
            raise ClosedError("rank %d: %s called after close()" % (self.rank, name))
        if self.failure is not None:
            raise ClosedError("rank %d: %s called on a communicator left unusable by an "
                              "earlier failure: %s" % (self.rank, name, self.failure),
                              culprits=getattr(self.failure, "culprits", ()))

    # -- the progress queue of asynchronous collectives --------------------------------
    def idle(self):
        """Whether nothing is queued: a blocking collective runs inline."""
        return self.progress is None or self.progress.idle()

    def submit(self, name, run, arrays, async_op):
        """Queue ``run()``, the whole collective ``name`` on ``arrays``,
        after the queued ones (GPU stream order for cupy arrays); returns
        its :class:`~commlib.progress.work.Work`."""
        self.usable(name)
        progress = self.progress
        if progress is None:
            progress = self.progress = self.start_progress()
        gpu = gpu_order(self, arrays)
        call = run if gpu is None else (lambda: gpu.run(run))
        if trace.ON:
            call = trace.queued(self.rank, name, call, async_op)
        return progress.submit(call, arrays, gpu)

    def start_progress(self):
        me = weakref.ref(self)

        def fail(exc):          # Ctrl-C in a wait, or a collective failing in flight
            session = me()
            if session is not None and session.failure is None:
                session.fail(exc)

        gone = ClosedError("rank %d: the communicator is gone" % self.rank)
        return Progress(self.stats, self.threaded(), fail,
                        name="commlib-progress-rank%d" % self.rank, depth=self.async_depth,
                        on_error=fail, failed=lambda: getattr(me(), "failure", gone),
                        rank=self.rank)

    def threaded(self):
        """Whether asynchronous collectives run on a progress thread: unless
        ``async_threaded`` says otherwise, when there is no MPI transport or
        MPI provides ``MPI_THREAD_MULTIPLE`` (else they run deferred, when
        waited for)."""
        if self.async_threaded is not None:
            return bool(self.async_threaded)
        return all(t.thread_safe() for t in self.transports)

    def in_flight(self, kind, items, wait):
        """For an all-reduce of ``items`` executing on the progress thread:
        an :class:`~commlib.progress.inflight.InFlight` when its data phase
        may leave its requests in flight (see :func:`commlib.progress.inflight.start`),
        else None."""
        progress = self.progress
        if kind != "numpy" or progress is None or not items:
            return None
        return inflight.start(progress, self.routes[kind], items, wait)

    # -- the steps of every collective ---------------------------------------------------
    def begin(self, name, params, checks, timeout=None, kind_matters=False):
        """Start collective ``name``: run ``checks()`` (raises CommlibError
        for bad arguments; returns a tuple whose first three entries are the
        array kind, the list of arrays whose dtypes and shapes must match on
        every rank, and its PreparedList or None), then, when the check is
        on, compare the call with every rank: ``params`` (tuple of the
        call's parameters), the array kind too when it ``kind_matters`` (a
        compressed call's exchange depends on it), and the arrays' layout.
        ``timeout`` replaces the watch dog's deadline. Returns ``(wait,
        checked)``: the collective's :class:`~commlib.core.waiting.Wait`
        and what ``checks()`` returned; raises, on every rank alike when the
        check is on."""
        self.usable(name)
        self.stats.add_collective()
        start = trace.now() if trace.ON else 0.0
        error = checked = None
        try:
            checked = checks()
        except CommlibError as exc:
            error = exc
        if start:
            start = trace.checked(self.rank, start)
        seq = self.seq = self.seq + 1
        timeout = self.timeout if timeout is None else timeout
        wait = Wait(None if timeout is None else time.monotonic() + timeout, seq,
                    fingerprints.CODES[name], self.board, self.rank)
        board = self.board
        kind, arrays, prepared = checked[:3] if error is None else (None, (), None)
        if board is not None and not self.check:
            board.arrive(seq)
        elif board is not None:
            digest = None
            shown = kind if kind_matters else None
            if error is None:
                digest = (prepared.digest if prepared is not None else
                          fingerprints.layout_digest(arrays),
                          fingerprints.params_digest(params + (shown,)))
            try:
                board.enter(wait, digest, error, lambda: fingerprints.describe(params, arrays,
                                                                              shown))
            except (CommlibError, KeyboardInterrupt) as exc:
                if exc is not error and not isinstance(exc, ConsistencyError):
                    self.fail(exc)
                raise
        if start:
            trace.began(self, name, seq, kind, params, arrays, start,
                        board is not None and self.check)
        if error is not None:
            raise error
        return wait, checked

    def begin_pair(self, name, peers, call):
        """Start the point-to-point call ``name`` with ``peers`` (``call``:
        its text, e.g. ``send to rank 1``): not numbered and not on the
        status board (see :mod:`commlib.collective.p2p`). Returns its
        :class:`~commlib.collective.p2p.PairWait`, whose sequence number is
        the next collective's."""
        self.usable(name)
        self.stats.add_collective()
        timeout = self.timeout
        return PairWait(None if timeout is None else time.monotonic() + timeout, self.seq + 1,
                        fingerprints.CODES[name], self.board, self.rank, peers, call)

    @contextlib.contextmanager
    def data_phase(self, deferred=False):
        """The data phase of a collective, the body of a ``with`` block: any
        failure but an agreed one (:data:`AGREED`) leaves the communicator
        unusable. Unless it is ``deferred`` (its requests left in flight,
        see :meth:`in_flight`), the collectives in flight complete first."""
        progress = self.progress
        if not deferred and progress is not None and progress.may_defer() \
                and progress.in_flight():
            progress.complete_flight()
        try:
            yield
        except AGREED:
            raise
        except BaseException as exc:
            self.fail(exc)
            raise

    def fail(self, exc):
        """A collective failed: the communicator is unusable from now on and
        its peers learn that this rank gave up, and whom it blames: the
        ranks its error names when it waited for them (a deadline, a peer
        that left, an earlier failure), else itself (an interrupt, a
        library's error, a bug: the failure is its own)."""
        if self.failure is None:
            self.failure = exc
            if self.board is not None:
                text = "%s: %s" % (type(exc).__name__, exc) if str(exc) else type(exc).__name__
                waited = isinstance(exc, (CollectiveTimeoutError, PeerError, ClosedError))
                blame = tuple(getattr(exc, "culprits", ()) or ()) if waited else (self.rank,)
                self.board.leave(self.seq - 1, _board.GAVE_UP, text, blame=blame)
            for transport in self.transports:
                transport.fail("%s: %s" % (type(exc).__name__, exc))

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
