"""Launch-side state the CUDA wrappers keep between calls, so that a call in
the steady state does little beyond its launches: workspaces kept per
(device, stream) and launch plans (kernels, grids, constant arguments) kept
per call shape.

A workspace is only ever used by launches on its own stream, which run in
order, so consecutive calls can share it. The stream object is held so its
handle is not reused while its workspace is cached.
"""
import collections
import contextlib
import threading

WORKSPACES = 16  # (device, stream, name) workspaces kept
PLANS = 256      # launch plans kept

_workspaces = collections.OrderedDict()  # (device, stream ptr, name) -> (stream, array)
_plans = collections.OrderedDict()       # key -> plan
_issuing = threading.local()             # .stream: see issuing_for


def clear():
    """Forget every cached workspace and plan (device shape changed)."""
    _workspaces.clear()
    _plans.clear()


def cached():
    """Every workspace and plan held now (a graph captured from launches
    that use them keeps them alive: :mod:`commlib.ops.graphs`)."""
    return tuple(_workspaces.values()) + tuple(_plans.values())


def plan(key, build):
    """The plan cached under ``key``, made by ``build()`` on first use."""
    hit = _plans.get(key)
    if hit is None:
        hit = _plans[key] = build()
        while len(_plans) > PLANS:
            _plans.popitem(last=False)
    return hit


@contextlib.contextmanager
def issuing_for(stream):
    """Within the block, workspaces are those of ``stream`` whatever the
    current stream is: launches captured on a private stream into a graph
    that will run on ``stream`` (:mod:`commlib.ops.graphs`) use its
    workspaces."""
    previous = getattr(_issuing, "stream", None)
    _issuing.stream = stream
    try:
        yield stream
    finally:
        _issuing.stream = previous


def workspace(device_id, name, size, dtype, zeroed=False, stream=None):
    """An array of at least ``size`` elements of ``dtype`` for ``stream``
    (default: the stream the current launches run on: the current stream,
    or the one of :func:`issuing_for`; ``name`` tells workspaces of
    different uses apart). With ``zeroed`` a new array starts zero-filled
    (callers that leave their workspace zeroed on return use this)."""
    import cupy
    if stream is None:
        stream = getattr(_issuing, "stream", None) or cupy.cuda.get_current_stream()
    key = (device_id, getattr(stream, "ptr", 0), name)
    hit = _workspaces.get(key)
    if hit is not None and hit[1].size >= size:
        return hit[1]
    grown = max(size, 2 * hit[1].size if hit else 0)
    ws = (cupy.zeros if zeroed else cupy.empty)(grown, dtype=dtype)
    _workspaces[key] = (stream, ws)
    while len(_workspaces) > WORKSPACES:
        _workspaces.popitem(last=False)
    return ws


def memset0(a, nbytes=None, stream=None):
    """Zero the first ``nbytes`` bytes (default: all) of device array ``a``
    on ``stream`` (default: the current one): one runtime call, no kernel."""
    import cupy
    if stream is None:
        stream = cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memsetAsync(a.data.ptr, 0, a.nbytes if nbytes is None else nbytes,
                                  stream.ptr)
