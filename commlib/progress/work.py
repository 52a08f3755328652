"""Asynchronous collectives: :class:`Work` handles and :class:`Progress`,
the per-communicator queue that executes them.

``comm.all_reduce(..., async_op=True)`` queues the whole collective
(argument checks, the consistency check, the data phase) and returns a
:class:`Work`. A communicator's collectives execute strictly in the order
issued, with the same code as synchronous ones, so every guarantee of the
synchronous path holds unchanged (see the README's "Failures"): a mismatch
raises ConsistencyError, a late or dead peer raises before the deadline,
nothing is written into the arrays after an error. Errors raise from
:meth:`Work.wait`. One at a time, except that all-reduces whose data
phase is MPI requests alone are pipelined: up to ``depth`` of them in
flight, started and completed in order (:mod:`commlib.progress.inflight`).

Where they execute: on a progress thread per communicator (its waits sleep
with backoff instead of spinning while no thread waits for its work,
:func:`commlib.core.waiting.relaxed`), or,
when the MPI library does not provide ``MPI_THREAD_MULTIPLE``, deferred:
nothing runs until :meth:`Work.wait` (or the next synchronous collective,
or ``close()``) runs the queue up to it on the calling thread; ``done()``
is False until then.

GPU arrays (cupy): the collective runs on a side stream of the
communicator that first waits for the work issued on the caller's current
stream before the call; :meth:`Work.wait` makes the caller's current stream
wait for the collective (no host synchronisation), :meth:`Work.done`
queries its event.
"""
import collections
import ctypes
import threading
import time

from .. import interop, trace
from ..core import waiting
from ..errors import ClosedError
from .inflight import Pacer

#: seconds an interrupted wait gives the progress thread to stop its
#: collective (its waits return to Python every few milliseconds)
STOP_S = 10.0


class Work:
    """The handle of one asynchronous collective.

    :attr:`arrays` are the arrays the call was given; they belong to the
    handle until :meth:`wait` returns (commlib reads and writes them only
    while the collective executes). Dropping a handle without waiting is
    allowed: ``close()`` waits for it.

    Handles are made by the communicator's collectives with
    ``async_op=True``, not by the caller.

    Args:
        progress: the communicator's :class:`Progress` queue.
        run: the whole collective, a callable returning its result.
        arrays: the arrays the call was given (:attr:`arrays`).
        gpu: a :class:`GpuOrder` for cupy arrays, else None.
    """

    __slots__ = ("arrays", "_progress", "_run", "_event", "_error", "_result", "_gpu",
                 "_waited", "_flight")

    def __init__(self, progress, run, arrays, gpu=None):
        self.arrays = arrays
        self._progress, self._run, self._gpu = progress, run, gpu
        self._event = threading.Event()
        self._error = self._result = None
        self._waited = False
        self._flight = None       # its InFlight, when its requests outlive _execute

    def done(self):
        """Whether the collective has completed (or failed); never blocks.

        Deferred (no progress thread): False until :meth:`wait` (or the next
        synchronous collective, or ``close()``) ran it. cupy arrays: also
        queries the collective's event on the side stream.

        Returns:
            True once the collective completed or failed, else False.
        """
        if not self._event.is_set():
            return False
        return self._gpu is None or self._error is not None or self._gpu.finished()

    def wait(self, timeout=None):
        """Wait until the collective completed and return its result.

        Deferred (no progress thread): runs the queue up to this collective
        on the calling thread. cupy arrays: makes the caller's current
        stream wait for the collective (no host synchronisation). The time
        spent here counts in the communicator's ``blocked_seconds``.

        Args:
            timeout: seconds, or None (default) for no limit beyond the
                watch dog's. When it passes first, :class:`TimeoutError` is
                raised; the collective goes on, call ``wait`` again. Only
                with a progress thread: deferred, the queue runs up to this
                collective whatever ``timeout`` says.

        Returns:
            The collective's result (the arrays, for an all-reduce).

        Raises:
            TimeoutError: ``timeout`` passed first (the built-in, not a
                CommlibError; the collective goes on; progress thread only).
            KeyboardInterrupt: while waiting; it stops the collective (as
                Ctrl-C in a synchronous one would) and leaves the
                communicator unusable.
            CommlibError: the collective's own error, again at every call:
                whatever the synchronous call raises (ArgumentError,
                ArrayTypeError, ConsistencyError, CollectiveTimeoutError,
                PeerError, TransportError, NonFiniteError, PayloadError,
                ...), or ClosedError when an earlier collective failed or
                the communicator was closed before it started.
        """
        start = time.perf_counter()
        try:
            self._progress.wait_for(self, timeout)
        finally:
            end = time.perf_counter()
            self._progress.stats.add_blocked(end - start)
            if trace.ON:
                trace.work_wait(self._progress.rank, start, end)
        if self._error is not None:
            raise self._error
        if self._gpu is not None and not self._waited:
            self._gpu.order_after()
        self._waited = True
        return self._result

    def _execute(self):
        """Run the collective, or start it (on the progress thread, or
        deferred); the Progress publishes it (:meth:`_publish`) in order."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            self._result = run()
        except BaseException as exc:        # raised from wait(), on the caller's thread
            self._error = exc

    def _pending(self):
        """Whether requests it started are still in flight."""
        return self._error is None and self._flight is not None and self._flight.pending()

    def _publish(self):
        self._event.set()

    def _fail(self, exc):
        self._run, self._error = None, exc
        if self._flight is not None:
            self._flight.abandon()
        self._event.set()

    def __repr__(self):
        state = "done" if self._event.is_set() else "pending"
        if self._error is not None:
            state = "failed: %s" % type(self._error).__name__
        return "<commlib.Work %s>" % state


class GpuOrder:
    """Stream order for one asynchronous collective on cupy arrays: made on
    the caller's thread (records the caller's current stream), used by the
    progress thread (:meth:`run`: on the communicator's ``side`` stream, after
    that record) and by :meth:`Work.wait` (the caller's stream waits for
    the collective)."""

    __slots__ = ("_cupy", "_device", "_side", "_issued", "_completed")

    def __init__(self, cupy, device, side):
        self._cupy, self._device, self._side = cupy, device, side
        self._issued = cupy.cuda.get_current_stream().record()
        self._completed = None

    def run(self, fn):
        cupy = self._cupy
        with cupy.cuda.Device(self._device):
            self._side.wait_event(self._issued)
            with self._side:
                result = fn()
            self._completed = self._side.record()
        return result

    def finished(self):
        return self._completed is not None and self._completed.done

    def order_after(self):
        if self._completed is not None:
            self._cupy.cuda.get_current_stream().wait_event(self._completed)


def gpu_order(session, arrays):
    """A :class:`GpuOrder` for an asynchronous collective of ``session`` (a
    communicator's :class:`~commlib.collective.session.Session`: its
    ``device`` and the ``side`` stream it makes here on first use) when
    ``arrays`` (an array or a list) hold cupy arrays (or another
    framework's CUDA arrays); else None."""
    items = arrays if isinstance(arrays, (list, tuple)) else [arrays]
    if session.device is None or arrays is None or not any(map(interop.on_gpu, items)):
        return None
    import cupy
    if session.side is None:
        with cupy.cuda.Device(session.device):
            session.side = cupy.cuda.Stream(non_blocking=True)
    return GpuOrder(cupy, session.device, session.side)


class Progress:
    """The queue of a communicator's asynchronous collectives, executed in
    order on a daemon thread (``threaded=True``) or on the caller's thread
    when waited for (deferred). ``stats``: the communicator's CommStats;
    ``on_interrupt(exc)``: called after a KeyboardInterrupt in a wait;
    ``depth``: how many collectives may be in flight at once (see
    :mod:`commlib.progress.inflight`; 1: none while another runs); ``on_error(exc)``:
    called when a collective in flight fails after its call returned;
    ``failed()``: the error that left the communicator unusable, or None
    (nothing in flight may complete after one); ``rank``: the
    communicator's rank (what a trace records it under).

    Only the thread that issues the communicator's collectives submits.
    The thread holds no reference to the communicator while idle.
    """

    def __init__(self, stats, threaded, on_interrupt, name="commlib-progress", depth=1,
                 on_error=None, failed=None, rank=0):
        self.stats, self.threaded, self.rank = stats, threaded, rank
        self.depth = max(1, int(depth)) if threaded else 1
        self._on_interrupt = on_interrupt       # called with the KeyboardInterrupt
        self._on_error = on_error or (lambda exc: None)
        self._failed = failed or (lambda: None)
        self._queue = collections.deque()       # Work not yet finished, in order
        self._flight = collections.deque()      # its first works: started, not published
        self._executing = None                  # the Work whose call runs now
        self._pacer = Pacer()
        self._next_check = 0.0                  # when the oldest in flight is checked next
        self._cond = threading.Condition()
        self._busy = False                      # the thread is executing or polling
        self._waiters = 0                       # threads blocked in wait_for
        self._stopping = False
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
            self._thread.start()

    def idle(self):
        """Whether nothing is queued, executing or in flight (a synchronous
        collective may then run inline on the caller's thread)."""
        return not self._queue

    def submit(self, run, arrays, gpu=None):
        """Queue ``run()`` (the whole collective); returns its Work."""
        work = Work(self, run, arrays, gpu)
        with self._cond:
            if self._stopping:
                raise ClosedError("commlib: the communicator's progress thread has stopped")
            self._queue.append(work)
            self._cond.notify()
        return work

    def wait_for(self, work, timeout=None):
        """Block until ``work`` finished (deferred: run the queue up to it)."""
        if work._event.is_set():
            return
        if not self.threaded:
            self._run_until(work)
            return
        self._waiters += 1          # the progress thread's waits spin while someone waits
        try:
            if not work._event.wait(timeout):
                raise TimeoutError("commlib: the collective did not complete within %s s; it "
                                   "goes on, wait again" % (timeout,))
        except KeyboardInterrupt as exc:
            self.interrupt()
            self._on_interrupt(exc)
            raise
        finally:
            self._waiters -= 1

    def drain(self):
        """Wait until everything queued has finished (errors stay in their Work)."""
        while True:
            with self._cond:
                if not self._queue:
                    return
                last = self._queue[-1]
            self.wait_for(last)

    def _run_until(self, work):
        while not work._event.is_set():
            first = self._queue[0]
            first._execute()
            self._queue.popleft()
            first._publish()

    # -- collectives in flight (called by the collective executing now) -----------------
    def may_defer(self):
        """Whether the collective executing on the calling thread may leave
        its requests in flight (:meth:`defer`)."""
        return (self.depth > 1 and self._executing is not None
                and threading.current_thread() is self._thread)

    def defer(self, flight):
        """The collective executing now leaves ``flight`` (an InFlight) in
        flight: its Work completes once the flight did."""
        self._executing._flight = flight

    def in_flight(self):
        """The InFlights of the collectives started and not yet complete,
        oldest first."""
        return [w._flight for w in self._flight if w._error is None and w._flight is not None]

    def complete_flight(self):
        """Complete every collective in flight (before a collective that
        cannot run beside them); raises ClosedError when one of them failed."""
        while self._flight:
            self._advance(block=True, raise_failure=True)

    # -- the thread ---------------------------------------------------------------------
    def _can_start(self):
        return (self._executing is None and len(self._queue) > len(self._flight)
                and len(self._flight) < self.depth)

    def _loop(self):
        waiting.set_relaxed(lambda: not self._waiters)
        while True:
            try:
                with self._cond:
                    while not self._queue and not self._stopping:
                        self._cond.wait()
                    if not self._queue:
                        return
                    work = self._queue[len(self._flight)] if self._can_start() else None
                    self._busy, self._executing = True, work
                if work is not None:
                    work._execute()
                    self._executing = None
                    self._flight.append(work)
                    waiting.set_background(self._background, self._longest_sleep)
                    self._advance(block=False)
                else:
                    self._advance(block=True)
                with self._cond:
                    self._busy = False
                del work
            except KeyboardInterrupt as exc:    # interrupt() landing outside a collective
                work, self._executing = self._executing, None
                if work is not None and work not in self._flight:
                    self._flight.append(work)
                self._fail_started(exc)
                with self._cond:
                    self._busy = False

    def _longest_sleep(self):
        """The pacer's longest sleep for the bytes in flight now (seconds)."""
        return self._pacer.longest_sleep(sum(f.nbytes for f in self.in_flight() if f.pending()))

    def _background(self):
        """The waits' background poll (see :func:`commlib.core.waiting.set_background`)."""
        self._advance(block=False, raise_failure=True)

    def _advance(self, block, raise_failure=False):
        """Publish the started collectives that completed, oldest first;
        with ``block``, poll the oldest until it completes or another may
        start. A failure in flight fails every started collective (and
        with ``raise_failure`` raises ClosedError)."""
        while self._flight:
            work = self._flight[0]
            flight = work._flight
            if flight is not None and work._error is not None:
                flight.abandon()        # it failed after starting requests
                flight = None
            try:
                if flight is not None:
                    failure = self._failed()
                    if failure is not None:
                        raise ClosedError("rank %d: the communicator failed while this "
                                          "collective was in flight: %s"
                                          % (flight.wait.rank, failure),
                                          culprits=getattr(failure, "culprits", ()))
                    if not flight.test():
                        now = time.monotonic()
                        if now >= self._next_check:     # its deadline, its peers
                            self._next_check = now + waiting.CHECK_EVERY_S
                            flight.wait.check()
                        if not block or self._can_start():
                            return
                        if waiting.relaxed():       # the caller computes: poll seldom
                            time.sleep(self._longest_sleep())
                        continue
                    flight.finish()
                    self._pacer.completed(flight.started, flight.nbytes)
                    if trace.ON:
                        trace.in_flight(self.rank, flight.wait.seq, flight.started, trace.now())
            except BaseException as exc:
                self._fail_started(exc)
                if raise_failure:
                    raise ClosedError("an earlier collective failed: %s: %s"
                                      % (type(exc).__name__, exc),
                                      culprits=getattr(exc, "culprits", ())) from exc
                return
            with self._cond:
                self._flight.popleft()
                self._queue.popleft()
                work._publish()
                self._cond.notify_all()
        waiting.set_background(None)

    def _fail_started(self, exc):
        """Every started collective not yet published fails: those with an
        error of their own keep it, the oldest other one gets ``exc``, the
        later ones ClosedError; their requests stay alive inside MPI
        (nothing more is written); the communicator learns of it. (The
        collective executing now, if any, fails by itself: the background
        poll raises into it.)"""
        with self._cond:
            started = [w for w in self._flight if not w._event.is_set()]
            later = ClosedError("an earlier collective failed: %s: %s"
                                % (type(exc).__name__, exc),
                                culprits=getattr(exc, "culprits", ()))
            first = True
            for work in started:
                if work._error is None:
                    work._error, first = (exc if first else later), False
                work._fail(work._error)
            for _ in self._flight:
                self._queue.popleft()
            self._flight.clear()
            self._cond.notify_all()
        waiting.set_background(None)
        if started:
            self._on_error(exc)

    def interrupt(self, stop_s=STOP_S):
        """Stop the collective executing or in flight now, as Ctrl-C would in
        a synchronous one (a KeyboardInterrupt raised inside it, which leaves
        the communicator unusable), and wait up to ``stop_s`` seconds for it
        to end. Returns whether the thread is idle afterwards."""
        if not self.threaded:
            return True
        with self._cond:
            current = self._queue[0] if self._busy and self._queue else None
            if current is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread.ident), ctypes.py_object(KeyboardInterrupt))
        if current is None:
            return True
        return current._event.wait(stop_s)

    def cancel_queued(self, error):
        """Fail every queued collective that has not started with ``error``."""
        with self._cond:
            keep = len(self._flight) + (1 if self._busy and self._executing is not None else 0)
            while len(self._queue) > keep:
                self._queue.pop()._fail(error)
            self._cond.notify_all()

    def stop(self):
        """Let the thread end once the queue is empty (no waiting here)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
