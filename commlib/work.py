"""Asynchronous collectives: :class:`Work` handles and :class:`Progress`,
the per-communicator queue that executes them.

``comm.all_reduce(..., async_op=True)`` queues the whole collective
(argument checks, the consistency check, the data phase) and returns a
:class:`Work`. A communicator's collectives execute strictly in the order
issued, one at a time, with the same code as synchronous ones, so every
guarantee of the synchronous path holds unchanged (see the README's
"Failures"): a mismatch raises ConsistencyError, a late or dead peer
raises before the deadline, nothing is written into the arrays after an
error. Errors raise from :meth:`Work.wait`.

Where they execute: on a progress thread per communicator (its waits sleep
with backoff instead of spinning while no thread waits for its work,
:func:`commlib.waiting.relaxed`), or,
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

from . import waiting
from .errors import ClosedError

#: seconds an interrupted wait gives the progress thread to stop its
#: collective (its waits return to Python every few milliseconds)
STOP_S = 10.0


class Work:
    """The handle of one asynchronous collective.

    :attr:`arrays` are the arrays the call was given; they belong to the
    handle until :meth:`wait` returns (commlib reads and writes them only
    while the collective executes). Dropping a handle without waiting is
    allowed: ``close()`` waits for it.
    """

    __slots__ = ("arrays", "_progress", "_run", "_event", "_error", "_result", "_gpu",
                 "_waited")

    def __init__(self, progress, run, arrays, gpu=None):
        self.arrays = arrays
        self._progress, self._run, self._gpu = progress, run, gpu
        self._event = threading.Event()
        self._error = self._result = None
        self._waited = False

    def done(self):
        """Whether the collective has completed (or failed); never blocks."""
        if not self._event.is_set():
            return False
        return self._gpu is None or self._error is not None or self._gpu.finished()

    def wait(self, timeout=None):
        """Wait until the collective completed and return its result (the
        arrays, for an all-reduce), or raise its error (again at every call). ``timeout`` (seconds, or None
        for no limit beyond the watch dog's): raise :class:`TimeoutError`
        when it passes first; the collective goes on, call ``wait`` again.
        A KeyboardInterrupt while waiting stops the collective (as Ctrl-C
        in a synchronous one would) and leaves the communicator unusable."""
        start = time.perf_counter()
        try:
            self._progress.wait_for(self, timeout)
        finally:
            self._progress.stats.add_blocked(time.perf_counter() - start)
        if self._error is not None:
            raise self._error
        if self._gpu is not None and not self._waited:
            self._gpu.order_after()
        self._waited = True
        return self._result

    def _execute(self):
        """Run the collective (on the progress thread, or deferred)."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            self._result = run()
        except BaseException as exc:        # raised from wait(), on the caller's thread
            self._error = exc
        self._event.set()

    def _fail(self, exc):
        self._run, self._error = None, exc
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


class Progress:
    """The queue of a communicator's asynchronous collectives, executed in
    order on a daemon thread (``threaded=True``) or on the caller's thread
    when waited for (deferred). ``stats``: the communicator's CommStats;
    ``on_interrupt(exc)``: called after a KeyboardInterrupt in a wait.

    Only the thread that issues the communicator's collectives submits.
    The thread holds no reference to the communicator while idle.
    """

    def __init__(self, stats, threaded, on_interrupt, name="commlib-progress"):
        self.stats, self.threaded = stats, threaded
        self._on_interrupt = on_interrupt       # called with the KeyboardInterrupt
        self._queue = collections.deque()       # Work not yet finished, in order
        self._cond = threading.Condition()
        self._busy = False                      # the thread is executing _queue[0]
        self._waiters = 0                       # threads blocked in wait_for
        self._stopping = False
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
            self._thread.start()

    def idle(self):
        """Whether nothing is queued or executing (a synchronous collective
        may then run inline on the caller's thread)."""
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

    def _loop(self):
        waiting.set_relaxed(lambda: not self._waiters)
        while True:
            try:
                with self._cond:
                    while not self._queue and not self._stopping:
                        self._cond.wait()
                    if not self._queue:
                        return
                    work, self._busy = self._queue[0], True
                work._execute()
                with self._cond:
                    self._busy = False
                    self._queue.popleft()
                    self._cond.notify_all()
                del work
            except KeyboardInterrupt as exc:    # interrupt() landing outside the collective
                with self._cond:
                    self._busy = False
                    if self._queue:
                        head = self._queue.popleft()
                        if not head._event.is_set():
                            head._fail(exc)
                    self._cond.notify_all()

    def interrupt(self, stop_s=STOP_S):
        """Stop the collective executing now, as Ctrl-C would in a
        synchronous one (a KeyboardInterrupt raised inside it, which leaves
        the communicator unusable), and wait up to ``stop_s`` seconds for it
        to end. Returns whether the thread is idle afterwards."""
        if not self.threaded:
            return True
        with self._cond:
            current = self._queue[0] if self._busy else None
            if current is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread.ident), ctypes.py_object(KeyboardInterrupt))
        if current is None:
            return True
        return current._event.wait(stop_s)

    def cancel_queued(self, error):
        """Fail every queued collective that has not started with ``error``."""
        with self._cond:
            keep = 1 if self._busy and self._queue else 0
            while len(self._queue) > keep:
                self._queue.pop()._fail(error)
            self._cond.notify_all()

    def stop(self):
        """Let the thread end once the queue is empty (no waiting here)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
