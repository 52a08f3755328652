"""How a collective is issued: inline when nothing is queued, else on the
communicator's progress queue (:class:`commlib.progress.work.Progress`), in order,
with GPU stream order for cupy arrays; and when an all-reduce may leave its
requests in flight (:class:`commlib.progress.inflight.InFlight`)."""
import time
import weakref

from .. import interop
from .. import trace
from ..errors import ArgumentError, ClosedError
from .inflight import InFlight, overlap
from .work import GpuOrder, Progress


def issue(session, name, run, async_op=False, arrays=None):
    """Execute collective ``name``: ``run(session)`` (the collective's
    function with its arguments bound by name, e.g. ``functools.partial(
    collectives.reduce, arrays=..., compression=...)``), on ``arrays``:
    inline when nothing is queued, else after the queued ones;
    ``async_op``: queue it and return its Work."""
    if async_op is not True and async_op is not False:
        raise ArgumentError("rank %d: %s: async_op must be True or False, got %r"
                            % (session.rank, name, async_op))
    progress = session.progress
    if not async_op and (progress is None or progress.idle()):
        start = time.perf_counter()
        try:
            return run(session)
        finally:
            end = time.perf_counter()
            session.stats.add_blocked(end - start)
            if trace.ON:
                trace.collective(session.rank, name, start, end, False)
    session.usable(name)
    if progress is None:
        progress = session.progress = start_progress(session)
    gpu = gpu_order(session, arrays)
    call = (lambda: run(session)) if gpu is None else (lambda: gpu.run(lambda: run(session)))
    if trace.ON:
        call = trace.queued(session.rank, name, call, async_op)
    work = progress.submit(call, arrays, gpu)
    return work if async_op else work.wait()


def start_progress(session):
    me = weakref.ref(session)

    def fail(exc):          # Ctrl-C in a wait, or a collective failing in flight
        comm = me()
        if comm is not None and comm.failure is None:
            comm.fail(exc)

    gone = ClosedError("rank %d: the communicator is gone" % session.rank)
    return Progress(session.stats, threaded(session), fail,
                    name="commlib-progress-rank%d" % session.rank, depth=session.async_depth,
                    on_error=fail, failed=lambda: getattr(me(), "failure", gone),
                    rank=session.rank)


def threaded(session):
    """Whether asynchronous collectives run on a progress thread: unless
    :attr:`async_threaded` says otherwise, when there is no MPI
    transport or MPI provides ``MPI_THREAD_MULTIPLE`` (else they run
    deferred, when waited for)."""
    if session.async_threaded is not None:
        return bool(session.async_threaded)
    return all(t.thread_safe() for t in session.transports)


def gpu_order(session, arrays):
    """A GpuOrder when ``arrays`` (an array or a list) hold cupy arrays (or
    another framework's CUDA arrays)."""
    items = arrays if isinstance(arrays, (list, tuple)) else [arrays]
    if session.device is None or arrays is None or not any(map(interop.on_gpu, items)):
        return None
    import cupy
    if session.side is None:
        with cupy.cuda.Device(session.device):
            session.side = cupy.cuda.Stream(non_blocking=True)
    return GpuOrder(cupy, session.device, session.side)


def in_flight(session, kind, items, wait):
    """For an all-reduce of ``items`` executing on the progress thread:
    an InFlight (registered with the progress thread, with a Wait of its
    own) when its data phase may leave its requests in flight: numpy
    arrays over the MPI transport, pipelining on, and no memory shared
    with a collective in flight (else None: it runs whole, after them)."""
    progress = session.progress
    if (kind != "numpy" or progress is None or not progress.may_defer()
            or not items or not session.transport(kind).defers(items[0])):
        return None
    flight = InFlight(wait, holds=items)
    earlier = progress.in_flight()
    if earlier and any(overlap(flight.spans(), f.spans()) for f in earlier):
        return None
    progress.defer(flight)
    return flight
