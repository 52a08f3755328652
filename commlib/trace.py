"""Where the time goes: a Chrome trace-event recording of every communicator.

Turn it on with ``COMMLIB_TRACE=PATH`` (read when a communicator is made) or
``commlib.trace(PATH)`` (this module is callable; the call returns an
object that also works as a context manager, whose exit writes the files and
turns tracing off); ``commlib.trace(None)`` writes the files and turns it
off. Open a file in https://ui.perfetto.dev or chrome://tracing.

**Files.** One JSON file per rank: ``{"traceEvents": [...],
"displayTimeUnit": "ms", "otherData": {rank, size, transports, versions,
host, os_pid, clock}}``. Path rule: ``{rank}`` in the path is replaced by
the rank; otherwise the rank goes before the extension (``trace.json`` ->
``trace.rank0.json``, ``trace.rank1.json``; a path without extension gets
``.rank0.json``); a path that is a directory (or ends with ``/``) gets
``trace.rank0.json`` inside it. A rank's file is (re)written, with
everything recorded so far, when one of its communicators closes, when
tracing is turned off and at interpreter exit. A missing folder is made
(with its parents) when tracing starts, one whose name holds ``{rank}`` by
each rank when it writes; a folder that cannot be made or is not writable
raises :class:`~commlib.errors.ArgumentError` (naming the path and where it
came from) when tracing starts. Files are written all or nothing, with mode
0600 (:func:`commlib.files.write_atomically`). Several
communicators of one rank in one process share the rank's file.

**Clock.** Events are complete events (``"ph": "X"``) with ``ts`` and
``dur`` in whole microseconds: a wall-clock anchor taken once per process
plus ``time.perf_counter()`` offsets, so the ranks of one machine line up
(across machines, as well as their clocks agree). ``pid`` is the rank (a
``process_name`` metadata event says "rank R"), ``tid`` the thread's native
id (a ``thread_name`` event names it: the caller's thread, e.g.
``MainThread``, and ``commlib-progress-rankR``). Events of one thread nest.

**Events** (``cat``: what it is):

* ``collective`` -- a whole collective (``all_reduce``, ``broadcast``, ...)
  on the thread that executed it; args ``seq``, ``bytes`` and ``arrays``
  (the caller's payload), ``op``, ``compression``, ``transport``, ``async``,
  and ``queued_us`` for one that waited in the progress queue (a flow
  arrow also joins its ``enqueue`` event on the caller's thread to it);
* ``check`` -- ``check arguments`` and ``consistency check`` (the status
  board: the time waiting there is time waiting for the peers to arrive);
* ``bucket`` -- a fused bucket or an array reduced in place: ``index``,
  ``bytes``, ``compression`` (the strategy's name, or null); a compressed
  bucket's time outside its transport calls is the strategy's own work;
* ``transport`` -- a call handed to a transport (``shm.all_reduce``...):
  ``transport``, ``call``, ``bytes`` (the buffer's bytes, as counted);
* ``wait`` -- ``wait for peers``: a polling wait of
  :func:`commlib.core.waiting.until` that did not find its answer at once
  (inside a transport call); ``Work.wait`` on the caller's thread;
* ``inflight`` -- an async event (``"b"``/``"e"``) from the start of an
  all-reduce left in flight to its completion on the progress thread;
* ``user`` -- the program's own work, marked with :func:`span`.

**The program's spans.** ``with commlib.trace.span("forward/backward",
step=i): ...`` records its body as a ``user`` event of that name and args
(JSON-ready; anything else is written as its ``str``) on the calling
thread, like ``torch.profiler.record_function``; ``@commlib.trace.spanned()``
does it for each call of a function. The rank it goes under is the
thread's: that of the first communicator the thread made or issued a traced
collective of, else that of the first communicator the process made.
Before any communicator, or off, a span records nothing, and off it costs
one check of :data:`ON` (the ``with`` gets a shared idle object).

**Invariant.** Every buffer a collective hands to a transport is counted
into ``comm.stats.bytes_sent`` where it is handed over
(:mod:`commlib.collective.collectives`, the compression strategies'
:class:`~commlib.compression.base.Bucket`) and, while tracing, passes
through :class:`commlib.collective.stats.TracedTransport`, which records the
``transport`` event with the same ``bytes``: over the traced interval, the
sum of ``args.bytes`` of a rank's ``transport`` events equals the growth
of its communicators' ``stats.bytes_sent``.

**Cost.** Off, each instrumented place costs one check of :data:`ON`. On,
each event appends one tuple to a list; JSON is made only when writing.

``python -m commlib.trace merge OUT IN...`` joins the ranks' files (or a
directory, or a glob) into one; ``python -m commlib.trace summary FILE``
prints a table per rank. Both live in :mod:`commlib.trace_files`
(:func:`merge`, :func:`summarize` are reachable from here too).
"""
import atexit
import functools
import itertools
import json
import os
import platform
import socket
import sys
import threading
import time
import types
import warnings

from .errors import ArgumentError
from .files import write_atomically
from . import settings
from .trace_files import expand, main, merge, summarize, summary_text  # noqa: F401  (as before)

#: whether tracing is on; every instrumented place checks it first
ON = False
now = time.perf_counter
_ANCHOR_US = int(time.time() * 1e6) - round(time.perf_counter() * 1e6)
_lock = threading.Lock()
_recorders = {}          # rank -> Recorder
_threads = {}            # native id -> name, of every thread that recorded something
_local = threading.local()   # .tid: this thread's native id; .rank: its rank (see span)
_flows = itertools.count(1)
_config = {"template": None, "source": None, "env_read": False, "atexit": False}
_process = {"rank": None}    # the rank of the first communicator this process made
# ``python -m commlib.trace`` imports the package (which imports this module)
# before running this file as __main__; runpy warns about that, harmlessly
warnings.filterwarnings("ignore", message="'commlib.trace' found in sys.modules",
                        category=RuntimeWarning)


class Recorder:
    """The events of one rank, in the order they ended, and what the
    file's ``otherData`` says about it."""

    def __init__(self, rank):
        self.rank, self.size = rank, None
        self.events = []
        self.transports = set()
        self.pending = {}        # tid -> args of the collective executing on it


def _recorder(rank):
    found = _recorders.get(rank)
    if found is None:
        with _lock:
            found = _recorders.setdefault(rank, Recorder(rank))
    return found


def _tid():
    try:
        return _local.tid
    except AttributeError:           # this thread's first event (a thread-local dies with
        tid = _local.tid = threading.get_native_id()     # its thread: no reused ids)
        _threads[tid] = threading.current_thread().name
        return tid


def _span(rank, name, cat, t0, t1, args=None):
    _recorder(rank).events.append(("X", name, cat, t0, t1, _tid(), args))


# -- what the instrumented places call (only while ON) ---------------------------------
def collective(rank, name, t0, t1, async_op, queued_us=None):
    """A whole collective ``name`` ran on this thread from ``t0`` to ``t1``
    (its details come from :func:`began`, if it got that far)."""
    recorder = _recorder(rank)
    args = recorder.pending.pop(_tid(), None) or {}
    args["async"] = async_op
    if queued_us is not None:
        args["queued_us"] = queued_us
    recorder.events.append(("X", name, "collective", t0, t1, _tid(), args))


def checked(rank, t0):
    """The argument checks took ``t0`` until now; returns now."""
    t1 = now()
    _span(rank, "check arguments", "check", t0, t1)
    return t1


def began(session, name, seq, kind, params, arrays, t0, consistency):
    """Collective ``name`` number ``seq`` passed its checks; the consistency
    check (when it ran: ``consistency``) took ``t0`` until now."""
    recorder = _recorder(session.rank)
    recorder.size = session.size
    if getattr(_local, "rank", None) is None:
        _local.rank = session.rank      # the rank of this thread's spans
    transport = session.routes[kind or "numpy"].name
    if transport is not None:
        recorder.transports.add(transport)
    if consistency:
        _span(session.rank, "consistency check", "check", t0, now(), {"seq": seq})
    op = compression = None
    if name in ("all_reduce", "reduce"):
        op = "avg" if params[2] and params[1] == "sum" else params[1]
        compression = params[4]
    elif name == "reduce_scatter":
        op = params[1]
    recorder.pending[_tid()] = {
        "seq": seq, "bytes": sum(int(getattr(a, "nbytes", 0)) for a in arrays),
        "arrays": len(arrays), "op": op, "compression": compression, "transport": transport}


def bucket(rank, t0, index, nbytes, compression, phase=None):
    """A bucket (``index``; ``"direct N"`` for an array reduced in place) ran
    from ``t0``; ``phase="completion"``: a compressed bucket's completion
    (see :meth:`commlib.compression.Compression.reduce`)."""
    args = {"index": index, "bytes": int(nbytes), "compression": compression}
    if phase is not None:
        args["phase"] = phase
    _span(rank, "bucket" if phase is None else "bucket " + phase, "bucket", t0, now(), args)


def transport_call(rank, transport, call, nbytes, fn, args, kwargs):
    """``fn(*args, **kwargs)``, the transport's ``call``, recorded with ``nbytes``."""
    t0 = now()
    try:
        return fn(*args, **kwargs)
    finally:
        _span(rank, "%s.%s" % (transport, call), "transport", t0, now(),
              {"transport": transport, "call": call, "bytes": int(nbytes)})


def peer_wait(rank, t0):
    _span(rank, "wait for peers", "wait", t0, now())


def work_wait(rank, t0, t1):
    _span(rank, "Work.wait", "wait", t0, t1)


def in_flight(rank, seq, t0, t1):
    """An all-reduce's requests were in flight from ``t0`` until ``t1``."""
    events = _recorder(rank).events
    tid = _tid()
    events.append(("b", "in flight", "inflight", t0, seq, tid, {"seq": seq}))
    events.append(("e", "in flight", "inflight", t1, seq, tid, None))


def queued(rank, name, call, async_op):
    """``call`` (a queued collective) wrapped to record its time in the queue
    (a flow from an ``enqueue`` event on this thread) and the collective."""
    flow, submitted = next(_flows), now()
    events = _recorder(rank).events
    events.append(("s", "queued", "queue", submitted, flow, _tid(), None))

    def traced():
        t0 = now()
        events.append(("f", "queued", "queue", t0, flow, _tid(), None))
        try:
            return call()
        finally:
            collective(rank, name, t0, now(), async_op,
                       queued_us=int((t0 - submitted) * 1e6))
    _span(rank, "enqueue " + name, "queue", submitted, now())
    return traced


def made(rank):
    """A communicator of ``rank`` was made on this thread (traced or not)."""
    if _process["rank"] is None:
        _process["rank"] = rank
    if getattr(_local, "rank", None) is None:
        _local.rank = rank


def closed(rank):
    """A communicator of ``rank`` closed: write the rank's file."""
    recorder = _recorders.get(rank)
    if recorder is not None and _config["template"] is not None:
        write_recorder(recorder)


# -- the program's own spans -----------------------------------------------------------
def span(name, **args):
    """A context manager recording its body as a ``user`` event ``name``
    with ``args`` on this thread, under this thread's rank (see the module
    docstring); off, or before any communicator, it records nothing.

    ``with commlib.trace.span("forward/backward", step=i): ...``"""
    if not ON:
        return _IDLE
    rank = getattr(_local, "rank", None)
    if rank is None:
        rank = _process["rank"]
        if rank is None:
            return _IDLE
    return Span(rank, name, args or None)


def spanned(name=None, **args):
    """A decorator: each call of the function is a :func:`span` ``name``
    (default: the function's qualified name) with ``args``."""
    def decorate(fn):
        label = name or fn.__qualname__

        @functools.wraps(fn)
        def wrapper(*a, **k):
            if not ON:
                return fn(*a, **k)
            with span(label, **args):
                return fn(*a, **k)
        return wrapper
    return decorate


class Span:
    """What :func:`span` returns while tracing."""
    __slots__ = ("rank", "name", "args", "t0")

    def __init__(self, rank, name, args):
        self.rank, self.name, self.args, self.t0 = rank, name, args, None

    def __enter__(self):
        self.t0 = now()
        return self

    def __exit__(self, *exc):
        _span(self.rank, self.name, "user", self.t0, now(), self.args)


class _Idle:
    """What :func:`span` returns when it records nothing."""
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


_IDLE = _Idle()


# -- turning it on and off ---------------------------------------------------------------
def path_for(template, rank):
    """The file of ``rank`` under the path rule (see the module docstring)."""
    template = os.fspath(template)
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    if template.endswith(os.sep) or os.path.isdir(template):
        return os.path.join(template, "trace.rank%d.json" % rank)
    stem, ext = os.path.splitext(template)
    return "%s.rank%d%s" % (stem, rank, ext or ".json")


def check_path(template, source):
    """Make the folder of the files of ``template`` (with its parents) unless
    it exists -- up to the first part that holds ``{rank}``: each rank makes
    its own when it writes; raise ArgumentError naming ``template`` and
    ``source`` when it cannot be made or is not writable."""
    template = os.fspath(template)
    folder = template if template.endswith(os.sep) or os.path.isdir(template) \
        else os.path.dirname(template)
    if "{rank}" in folder:                  # the folders above the first that holds it
        folder = os.path.dirname(folder.split("{rank}", 1)[0] + "x")
    folder = os.path.abspath(folder or ".")
    problem = None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        problem = "the directory %r cannot be made: %s" % (folder, exc.strerror or exc)
    else:
        if not os.access(folder, os.W_OK | os.X_OK):
            problem = "the directory %r is not writable" % folder
    if problem is not None:
        raise ArgumentError("%s: cannot write the trace to %r: %s"
                            % (source, template, problem))


class Tracing:
    """What :func:`start` returns: a context manager whose exit writes the
    files and turns tracing off."""

    def __init__(self, template):
        self.template = template

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if _config["template"] == self.template:
            stop()


def start(path, source="commlib.trace()"):
    """Record every communicator of this process into files of ``path``
    (see the path rule); ``path`` None: :func:`stop`. Returns a Tracing."""
    global ON
    if path is None:
        stop()
        return Tracing(None)
    template = os.fspath(path)
    check_path(template, source)
    if ON:
        stop()
    with _lock:
        _recorders.clear()
        _config["template"], _config["source"] = template, source
        if not _config["atexit"]:
            _config["atexit"] = True
            atexit.register(write_all)
    ON = True
    return Tracing(template)


def stop():
    """Write every rank's file and turn tracing off."""
    global ON
    ON = False
    write_all()
    _config["template"] = None


def from_environment():
    """Start tracing if ``COMMLIB_TRACE`` says so (read once per process)."""
    if _config["env_read"]:
        return
    _config["env_read"] = True
    path = settings.trace_path()
    if path and not ON:
        start(path, source="%s=%r" % (settings.TRACE, path))


def write_all():
    """(Re)write the file of every rank recorded so far."""
    for recorder in list(_recorders.values()):
        if _config["template"] is not None:
            write_recorder(recorder)


def write_recorder(recorder):
    """(Re)write ``recorder``'s file (see :func:`commlib.files.write_atomically`;
    its folder is made when the path rule puts ``{rank}`` in it). Returns the path."""
    path = path_for(_config["template"], recorder.rank)
    text = json.dumps(document(recorder), default=str)     # a span's args may be anything
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return write_atomically(path, lambda f: f.write(text))


def document(recorder):
    """The trace-event document of ``recorder`` (a dict, JSON-ready)."""
    rank = recorder.rank
    records = sorted(enumerate(list(recorder.events)),
                     key=lambda e: (e[1][3], -(e[1][4] - e[1][3]) if e[1][0] == "X" else 0,
                                    -e[0]))
    events = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
               "args": {"name": "rank %d" % rank}},
              {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
               "args": {"sort_index": rank}}]
    names = dict(_threads)
    for tid in sorted({e[5] for _, e in records}):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                       "args": {"name": names.get(tid, "thread %d" % tid)}})
    for _, (ph, name, cat, t0, extra, tid, args) in records:
        ts = _ANCHOR_US + round(t0 * 1e6)       # rounding keeps the nesting
        event = {"name": name, "cat": cat, "ph": ph, "ts": ts, "pid": rank, "tid": tid}
        if ph == "X":
            event["dur"] = _ANCHOR_US + round(extra * 1e6) - ts
        else:
            event["id"] = extra
            if ph == "f":
                event["bp"] = "e"
        if args is not None:
            event["args"] = args
        events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other_data(recorder)}


def other_data(recorder):
    versions = {"python": platform.python_version()}
    for module in ("commlib", "numpy", "mpi4py", "cupy"):
        found = sys.modules.get(module)
        if found is not None and getattr(found, "__version__", None):
            versions[module] = str(found.__version__)
    return {"rank": recorder.rank, "size": recorder.size,
            "transports": sorted(recorder.transports), "versions": versions,
            "host": socket.gethostname(), "os_pid": os.getpid(),
            "clock": "wall-clock anchor (time.time) + time.perf_counter offsets, microseconds"}


class _CallableModule(types.ModuleType):
    """This module's type: ``commlib.trace(path)`` is :func:`start`."""

    def __call__(self, path):
        return start(path)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())        # commlib.trace_files.main
