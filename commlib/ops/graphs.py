"""Fixed launch sequences replayed as CUDA graphs: one graph launch in place
of a dozen kernel launches and memsets, each of which costs the calling
thread a few microseconds.

A caller hands :func:`replay` a function that issues a fixed sequence of
launches (the part of a compressed bucket's work between two
communications, say) and a key naming everything the launches bake in:
the addresses of the arrays they read and write, their sizes, their
constant arguments. The first time a key is seen the function runs as it
is, which also makes every workspace and launch plan it needs; the next
time it is captured into a graph, and from then on the graph is launched.

What the function may do, so that its capture is exact:

* only kernel launches and memsets on the current stream (no allocation,
  no copy from the host, no host read, no synchronisation);
* the same launches, with the same arguments, every time its key is
  seen: everything that varies must be in the key.

A capture that fails (a CUDA error, an operation refused while capturing)
is ended, the key is remembered as one that runs directly, and the
function runs as it is: a failed capture never costs a result (the first
in a process warns, with the error). The graph keeps every workspace and
launch plan that the launch caches held when it was captured, so a
workspace grown or dropped later never leaves the graph pointing at freed
memory.

Captures are made on a private stream of the caller's device (cupy cannot
capture the default stream); the graph is launched on the caller's current
stream, and the workspaces it uses are those of that stream (see
:func:`commlib.ops._launch.issuing_for`). When the caller's stream is
itself capturing (a training step captured whole), the launches are issued
directly, into the caller's graph.
"""
import threading
import warnings

from . import _launch
from . import _pack_cuda

#: keys a store keeps, the oldest dropped first (arrays that move at every
#: call make new keys that never repeat: they run directly)
MAX_GRAPHS = 8
#: runs of a key before it is captured (the first makes the workspaces)
CAPTURE_AFTER = 1

_side_streams = {}   # (device, stream ptr, thread) -> the private stream captures are made on
_warned = []         # the first failed capture's error, once warned


class _Entry:
    __slots__ = ("runs", "graph", "keep", "failed")

    def __init__(self):
        self.runs, self.graph, self.keep, self.failed = 0, None, None, None


def enabled():
    """Whether graphs are used (``COMMLIB_CUDA_GRAPHS``, default on)."""
    from .. import settings
    return settings.flag(settings.CUDA_GRAPHS, True)


def replay(store, key, issue):
    """Issue ``issue()``'s launches on the current stream, through a graph
    once ``key`` has been seen before (see the module docstring).

    Args:
        store: a dict the caller keeps (per bucket, say): the graphs of its
            latest :data:`MAX_GRAPHS` keys.
        key: a hashable naming everything ``issue``'s launches bake in.
        issue: a function of no arguments issuing only kernel launches and
            memsets on the current stream.

    Returns:
        ``"direct"``, ``"captured"`` or ``"graph"``: how the work was issued
        (a capture also launches its graph).
    """
    import cupy
    stream = cupy.cuda.get_current_stream()
    if _in_capture(stream):     # the caller captures: its graph takes the launches
        issue()
        return "direct"
    full = (stream.ptr, key)
    entry = store.get(full)
    if entry is None:
        if not enabled():
            issue()
            return "direct"
        while len(store) >= MAX_GRAPHS:
            del store[next(iter(store))]
        entry = store[full] = _Entry()
    if entry.graph is not None:
        entry.graph.launch(stream)
        return "graph"
    if entry.failed is None and entry.runs >= CAPTURE_AFTER:
        graph = _capture(stream, issue, entry)
        if graph is not None:
            entry.graph = graph
            graph.launch(stream)
            return "captured"
    entry.runs += 1
    issue()
    return "direct"


def failure(store):
    """The first failed capture's error in ``store`` (for tests and
    diagnostics), or None."""
    for entry in store.values():
        if entry.failed is not None:
            return entry.failed
    return None


def _in_capture(stream):
    """Whether ``stream`` is capturing (the caller's own graph), or cannot
    tell (the legacy stream while another stream captures)."""
    try:
        return bool(stream.is_capturing())
    except Exception:               # noqa: BLE001 -- cudaErrorStreamCaptureImplicit
        return True


def _capture(stream, issue, entry):
    """``issue()`` captured into a graph (None, and ``entry.failed`` set,
    when the capture fails)."""
    import cupy
    # one per thread: threads issuing on one stream (ranks of the threads
    # transport) capture at the same time; the caller's stream is held with
    # it, so that its handle is not reused
    where = (cupy.cuda.runtime.getDevice(), stream.ptr, threading.get_ident())
    held = _side_streams.get(where)
    if held is None:
        held = _side_streams[where] = (stream, cupy.cuda.Stream(non_blocking=True))
    side = held[1]
    graph = None
    try:
        with _launch.issuing_for(stream), side:
            side.begin_capture()
            try:
                issue()
            finally:
                graph = side.end_capture()
    except Exception as e:          # noqa: BLE001 -- any failure: run directly
        entry.failed = e
        if not _warned:
            _warned.append(e)
            warnings.warn("commlib: a CUDA graph capture failed (%s: %s); these launches run "
                          "one by one from now on (results are unaffected; set "
                          "COMMLIB_CUDA_GRAPHS=0 to skip captures)" % (type(e).__name__, e),
                          RuntimeWarning, stacklevel=4)
        return None
    entry.keep = (_launch.cached(), _pack_cuda.cached())
    return graph
