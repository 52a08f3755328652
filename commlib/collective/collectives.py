"""The collectives' own steps, behind :class:`commlib.Communicator`'s
methods: the checks of their arguments, the consistency check
(:meth:`Session.begin <commlib.collective.session.Session.begin>`), and the data
phase over the session's transports (fused into buckets for lists)."""
from functools import partial

import numpy as np

from .. import compression as _compression
from . import fusion, validation
from ..progress import issuing
from .. import interop, settings
from ..errors import ArgumentError
from ..progress.inflight import now
from ..ops.arrays import array_module
from .reduce_state import ReduceState


def broadcast(session, arrays, root):
    is_root = session.rank == root
    items, key, prepared = [], None, None

    def checks():
        nonlocal items, key, prepared
        items = validation.as_list(arrays, rank=session.rank, writeable=not is_root)[0]
        key, prepared = session.fusion.lookup(items)
        validation.check_root(root, session.size, session.rank)
        return fusion.fused_checks(session, items, prepared, not is_root, False)

    kind, wait = session.begin("broadcast", ("broadcast", root), checks,
                               lambda: (items, prepared))
    if kind is None:
        return arrays

    def step(transport, buf, i, prepared):
        if i is not None and is_root:
            prepared.pack(items, i)
        transport.broadcast(buf, root, wait, owned=i is not None)
        if i is not None and not is_root:
            prepared.unpack(items, i)

    session.run(fusion.fused, session, items=items, kind=kind, key=key, prepared=prepared,
                writeable=not is_root, step=step)
    return arrays


def reduce(session, name, arrays, root, op, division, compression=None, state=None,
           agree=None):
    """all_reduce (``root=None``: every rank receives) or reduce to ``root``;
    ``state``: see :func:`commlib.collective.fusion.fused` (its name is compared between
    ranks like the call's parameters)."""
    averaging = op == "avg" or (division is True and op == "sum")
    receives = root is None or session.rank == root
    items, key, prepared, strategy = [], None, None, None
    cache = state.fusion if isinstance(state, ReduceState) else session.fusion

    def checks():
        nonlocal items, key, prepared, strategy
        if state is not None and not isinstance(state, ReduceState):
            raise ArgumentError("rank %d: %s: state must be a commlib.ReduceState or "
                                "None, got %s" % (session.rank, name, type(state).__name__))
        validation.check_agree(agree, session.rank, name)
        items = validation.as_list(arrays, rank=session.rank, writeable=receives)[0]
        key, prepared = cache.lookup(items)
        if root is not None:
            validation.check_root(root, session.size, session.rank)
        validation.check_op(op, division, session.rank)
        strategy = _compression.resolve(compression, session.rank)
        if strategy is not None:
            strategy.check("sum" if op == "avg" else op, session.rank)
        return fusion.fused_checks(session, items, prepared, receives, averaging)

    reduce_op = "sum" if op == "avg" else op
    params = (name, reduce_op, averaging, root,
              None if compression is None else getattr(compression, "name", compression),
              agree if validation.plain(agree) else "<invalid>",
              state.name if isinstance(state, ReduceState) else None)
    # a compressed exchange depends on the kind (cupy buckets may be issued
    # together, see Compression.reduce_all): compared between ranks
    kind, wait = session.begin(name, params, checks, lambda: (items, prepared),
                               kind_matters=compression is not None)
    if kind is None:
        return arrays
    scale = 1.0 / session.size if averaging else None
    flight = None
    if root is None and strategy is None:
        flight = issuing.in_flight(session, kind, items, wait)
    step = reduce_step(items, root=root, op=reduce_op, scale=scale, receives=receives, wait=wait,
                       flight=flight)
    session.run(fusion.fused, session, items=items, kind=kind, key=key, prepared=prepared,
                writeable=receives, step=step, strategy=strategy, op=reduce_op, scale=scale,
                wait=wait, state=state, deferred=flight is not None)
    return arrays


def all_gather(session, given):
    array = given

    def checks():
        nonlocal array
        array = session.one_array("all_gather", given)
        return session.array_checks([array], writeable=False)

    kind, wait = session.begin("all_gather", ("all_gather",), checks, lambda: ([array], None))
    xp = array_module(array)
    out = xp.empty((session.size,) + tuple(array.shape), dtype=array.dtype)
    if session.size == 1:
        out[0] = array
    elif array.size:
        send = xp.ascontiguousarray(array).reshape(-1)
        session.run(session.transport(kind).all_gather, send, out.reshape(-1), wait)
    return interop.like(given, out)


def reduce_scatter(session, given, op):
    averaging = op == "avg"
    array = given

    def checks():
        nonlocal array
        array = session.one_array("reduce_scatter", given)
        validation.check_op(op, False, session.rank)
        kind = session.array_checks([array], writeable=False, floating=averaging)
        if array.size % session.size:
            raise ArgumentError(
                "rank %d: reduce_scatter needs array.size divisible by size=%d; got "
                "array.size=%d (shape %s)" % (session.rank, session.size, array.size,
                                              tuple(array.shape)))
        return kind

    kind, wait = session.begin("reduce_scatter", ("reduce_scatter", op), checks,
                               lambda: ([array], None))
    xp = array_module(array)
    out = xp.empty(array.size // session.size, dtype=array.dtype)
    if session.size == 1:
        out[...] = array.reshape(-1)
    elif out.size:
        send = xp.ascontiguousarray(array).reshape(-1)
        session.run(session.transport(kind).reduce_scatter, send, out,
                    "sum" if averaging else op, wait)
    if averaging:
        out *= 1.0 / session.size
    return interop.like(given, out)


def all_gatherv(session, given):
    array = given

    def checks():
        nonlocal array
        array = session.one_array("all_gatherv", given)
        kind = session.array_checks([array], writeable=False)
        if array.ndim != 1:
            raise ArgumentError("rank %d: all_gatherv takes a 1-D array, got shape %s"
                                % (session.rank, tuple(array.shape)))
        return kind

    kind, wait = session.begin("all_gatherv", ("all_gatherv", str(interop.dtype_name(given))),
                               checks)
    xp = array_module(array)
    if session.size == 1:
        return interop.like(given, xp.array(array, copy=True)), np.array([array.size],
                                                                          dtype=np.int64)
    counts = np.empty(session.size, dtype=np.int64)
    host = session.transport("numpy")
    session.run(host.all_gather, np.array([array.size], dtype=np.int64), counts, wait)
    out = xp.empty(int(counts.sum()), dtype=array.dtype)
    if out.size:
        session.run(session.transport(kind).all_gatherv, xp.ascontiguousarray(array), out,
                    counts, wait)
    return interop.like(given, out), counts


def barrier(session, timeout):
    own = None
    if timeout is not None:
        try:
            own = settings.seconds(timeout, "timeout")
        except ArgumentError as exc:
            own = exc

    def checks():
        if isinstance(own, ArgumentError):
            raise ArgumentError("rank %d: barrier: %s" % (session.rank, own))

    _, wait = session.begin("barrier", ("barrier", timeout), checks,
                            timeout=own if isinstance(own, float) else None)
    if session.size > 1:
        session.run(session.transport("numpy").barrier, wait)


def reduce_step(items, *, root, op, scale, receives, wait, flight):
    """The step of :func:`reduce` for one bucket (``i``) or in-place array
    (``i`` None) of ``items``: reduce over the transport (``root`` None:
    all-reduce; ``flight``: left in flight), scaled by ``scale``, and
    unpacked where this rank ``receives``. Its ``together(transport,
    units, prepared)`` takes the units of a cupy list at once (see
    :func:`commlib.collective.fusion.fused`): every bucket packed, then
    each unit reduced in turn, then every bucket unpacked, the copies of
    all buckets issued as one CUDA graph each way (see
    :meth:`~commlib.collective.bucketing.PreparedList.copy_many`); cupy
    work is ordered on the stream, so what a transport reads and writes is
    that of the step one by one."""
    after = now if flight is None else flight.then

    def exchange(transport, buf, i, prepared, scaled_later=False):
        """Unit ``i``'s collective, its bucket packed; the user's own
        memory scaled (by the transport as it writes an all-reduce's
        result, unless the caller scales it later). Returns whether the
        unit is a bucket of commlib's own buffer, which the caller unpacks
        times ``scale``."""
        owned = i is not None and not prepared.zero_copy(i)
        scaled = root is None and not owned
        by_transport = scale if scaled and not scaled_later else None
        if root is None and flight is not None:
            transport.all_reduce(buf, op, wait, owned=owned, scale=by_transport, defer=flight)
        elif root is None:
            transport.all_reduce(buf, op, wait, owned=owned, scale=by_transport)
        else:
            transport.reduce(buf, root, op, wait, owned=owned)
        if flight is not None:
            flight.nbytes += buf.nbytes
        if receives and not owned and not scaled and scale is not None:
            buf *= scale
        return owned

    def step(transport, buf, i, prepared):
        if i is not None and root is None and transport.reduces_parts(buf):
            transport.all_reduce_parts(prepared.arrays(items, i, buf), buf, op, scale, wait)
            return
        if i is not None:
            prepared.pack(items, i)
        if exchange(transport, buf, i, prepared) and receives:
            after(partial(prepared.unpack, items, i, scale))

    def together(transport, units, prepared):
        packed = tuple(i for _, i, _ in units if i is not None and not prepared.zero_copy(i))
        # an all-reduce's scale of the user's own float32 memory is a kernel
        # after the unpacks, in their graph, not a cupy operation per unit
        later = () if root is not None or scale is None else prepared.float32_in_place(units)
        if packed:
            prepared.copy_many(items, packed, "pack")
        for where, i, buf in units:
            exchange(transport, prepared.flat(items, where) if i is None else buf, i, prepared,
                     scaled_later=where in later)
        if (packed or later) and receives:
            prepared.copy_many(items, packed, "unpack", scale, in_place=later)

    step.together = together
    return step
