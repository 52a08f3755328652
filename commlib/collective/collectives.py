"""The collectives' own steps, behind :class:`commlib.Communicator`'s methods.

Every collective takes the same steps, in this order:

1. **check and agree**: its arguments are checked, then compared with every
   rank's call (:meth:`Session.begin
   <commlib.collective.session.Session.begin>`, the consistency check)
   before any data moves; a bad argument or a mismatch raises on every rank.
2. **plan**: a list of arrays is planned into fused buckets and arrays
   reduced in place (:mod:`commlib.collective.bucketing`), worked out once
   for a list that is passed again.
3. **move the data**, inside :meth:`Session.data_phase
   <commlib.collective.session.Session.data_phase>` (a failure leaves the
   communicator unusable): the units a compression strategy takes go to it
   together (:func:`compressed`), the others over the transport
   (:func:`dense`).
4. **finish**: the strategy's completions run in bucket order once every
   unit was issued (:func:`finish`).
"""
import numpy as np

from .. import compression as _compression
from .. import interop, settings, trace
from ..compression.base import Bucket, Completion
from ..errors import ArgumentError
from ..ops.arrays import array_module, to_host
from . import bucketing, validation
from .reduce_state import ReduceState


def reduce(session, arrays, root, op, division, compression, state, agree):
    """all_reduce (``root`` None: every rank receives the result) or reduce
    to ``root`` (see the Communicator's methods of these names)."""
    name = "all_reduce" if root is None else "reduce"
    averaging = op == "avg" or (division is True and op == "sum")
    receives = root is None or session.rank == root
    cache = state.fusion if isinstance(state, ReduceState) else session.fusion

    def checks():
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
        kind = checked(session, items, prepared, writeable=receives, floating=averaging)
        return kind, items, prepared, key, strategy

    reduce_op = "sum" if op == "avg" else op
    params = (name, reduce_op, averaging, root,
              None if compression is None else getattr(compression, "name", compression),
              agree if validation.plain(agree) else "<invalid>",
              state.name if isinstance(state, ReduceState) else None)
    # 1. check and agree (a compressed exchange depends on the arrays' kind:
    # cupy buckets may be issued together, see Compression.reduce_all)
    wait, (kind, items, prepared, key, strategy) = session.begin(
        name, params, checks, kind_matters=compression is not None)
    if kind is None:
        return arrays
    # 2. plan
    if prepared is None:
        prepared = plan(session, cache, key, items, kind, receives)
    transport = session.transport(kind)
    scale = 1.0 / session.size if averaging else None
    flight = session.in_flight(kind, items, wait) if root is None and strategy is None \
        else None
    with session.data_phase(deferred=flight is not None):
        # 3. move the data: a strategy's units together, then the others
        units, completions = prepared.units, ()
        if strategy is not None:
            split = prepared.split(strategy, session.workspaces if state is None
                                   else state.workspaces)
            completions = compressed(session, transport, items, split, strategy, reduce_op,
                                     scale, wait)
            units = split.rest
        dense(session, transport, items, prepared, units, name, root=root, op=reduce_op,
              scale=scale, wait=wait, flight=flight)
        # 4. finish
        finish(completions, session.rank, strategy)
    return arrays


def broadcast(session, arrays, root):
    """See :meth:`commlib.Communicator.broadcast`."""
    receives = session.rank != root

    def checks():
        items = validation.as_list(arrays, rank=session.rank, writeable=receives)[0]
        key, prepared = session.fusion.lookup(items)
        validation.check_root(root, session.size, session.rank)
        return checked(session, items, prepared, receives, False), items, prepared, key

    wait, (kind, items, prepared, key) = session.begin("broadcast", ("broadcast", root),
                                                       checks)
    if kind is None:
        return arrays
    if prepared is None:
        prepared = plan(session, session.fusion, key, items, kind, receives)
    with session.data_phase():
        dense(session, session.transport(kind), items, prepared, prepared.units, "broadcast",
              root=root, wait=wait)
    return arrays


def checked(session, items, prepared, writeable, floating):
    """The array checks of a list (its kind): none for a list already
    prepared with checks at least this strict but whether its arrays are
    still writeable (a numpy array made read-only since)."""
    if (prepared is not None and (prepared.writeable or not writeable)
            and (prepared.floating or not floating)):
        if writeable and prepared.kind == "numpy":
            validation.check_still_writeable(items, session.rank)
        return prepared.kind
    return validation.check_arrays(items, rank=session.rank, device=session.device,
                                   writeable=writeable, floating=floating)


def plan(session, cache, key, items, kind, writeable):
    """The :class:`~commlib.collective.bucketing.PreparedList` of ``items``
    (kept in ``cache`` when the list comes back, see
    :class:`~commlib.collective.bucketing.FusionCache`)."""
    layout = bucketing.plan_for(items, session.bucket_bytes_for(session.routes[kind]))
    return cache.prepare(key, items, layout, kind, writeable)


def dense(session, transport, items, prepared, units, call, *, root=None, op=None, scale=None,
          wait, flight=None):
    """``units`` of ``prepared`` (``(where, index, buffer)``, see
    :attr:`~commlib.collective.bucketing.PreparedList.units`) moved over
    ``transport`` by collective ``call`` (``"all_reduce"``, ``"reduce"`` to
    ``root`` or ``"broadcast"`` from ``root``): the buckets with buffers of
    their own packed (all of them at once), each unit handed to the
    transport in turn, the buckets unpacked times ``scale`` where this rank
    receives (all at once, after the last unit). An all-reduce's ``scale``
    of the user's own memory is the transport's (as it writes the result),
    or, for cupy float32, a kernel in the unpacks' CUDA graph; a bucket the
    transport reduces where its arrays lie (``reduces_parts``) needs no
    copy. ``flight``: the all-reduce's requests stay in flight, the unpacks
    wait for them (see :mod:`commlib.progress.inflight`)."""
    all_reduce = call == "all_reduce"
    sends = call != "broadcast" or session.rank == root
    receives = root is None or (session.rank == root) == (call == "reduce")
    copied = prepared.copied(units, transport if all_reduce else None)
    later = prepared.float32_in_place(units) if (
        all_reduce and scale is not None and prepared.kind == "cupy") else ()
    if sends and copied:
        prepared.copy_many(items, copied, "pack")
    stats = session.stats
    for where, i, buf in units:
        start = trace.now() if trace.ON else 0.0
        if i is None:           # an array reduced in place: its flat view
            buf = prepared.flat(items, where)
        owned = i in copied
        stats.bytes_sent += buf.nbytes
        if all_reduce and i is not None and not owned and not prepared.zero_copy(i):
            transport.all_reduce_parts(prepared.arrays(items, i, buf), buf, op, scale, wait)
        elif all_reduce:
            by_transport = None if owned or where in later else scale
            if flight is None:
                transport.all_reduce(buf, op, wait, owned=owned, scale=by_transport)
            else:
                transport.all_reduce(buf, op, wait, owned=owned, scale=by_transport,
                                     defer=flight)
                flight.nbytes += buf.nbytes
        elif call == "reduce":
            transport.reduce(buf, root, op, wait, owned=owned)
            if receives and not owned and scale is not None:
                buf *= scale
        else:
            transport.broadcast(buf, root, wait, owned=owned)
        if start:
            trace.bucket(transport.rank, start, bucketing.label_of(i, where), buf.nbytes, None)
    if receives and (copied or later):
        unpack = prepared.unpacking(items, copied, scale, later)
        if flight is None:
            unpack()
        else:
            flight.then(unpack)


def compressed(session, transport, items, split, strategy, op, scale, wait):
    """The units of ``split`` (a :class:`~commlib.collective.bucketing.Split`)
    that ``strategy`` compresses, handed to its ``reduce_all`` as
    :class:`~commlib.compression.base.Bucket` objects of ``op``, ``scale``
    and the call's ``wait``, each with its state. Returns the completions
    it returned (``(completion, the bucket's name in a trace)`` pairs, in
    bucket order). While tracing, recorded as one ``bucket`` event of all
    their bytes, named after the first."""
    if not split.compressed:
        return ()
    start = trace.now() if trace.ON else 0.0
    buckets = [Bucket(transport, arrays, op, scale, wait, state, session.stats)
               for arrays, state in split.buckets(items)]
    done = strategy.reduce_all(buckets, split.together)
    if not isinstance(done, (list, tuple)) or len(done) != len(buckets):
        raise TypeError("rank %d: compression %s: reduce_all returned %r; expected a list of "
                        "one entry per bucket (%d), each None or a completion"
                        % (session.rank, strategy.name, done, len(buckets)))
    if start:
        trace.bucket(transport.rank, start, split.labels[0], split.nbytes, strategy.name)
    return [(complete, label) for complete, label in zip(done, split.labels)
            if complete is not None]


def finish(completions, rank, strategy):
    """Run a call's ``completions`` (``(completion, label)`` pairs, see
    :func:`compressed`) in order: the values every
    :class:`~commlib.compression.base.Completion` reads come to the host in
    one transfer first; any other completion is called with no arguments.
    While tracing, each is a ``bucket`` event of its own (phase
    ``"completion"``, no bytes: the bucket's event counted them)."""
    if not completions:
        return
    values = to_host([getattr(complete, "reads", ()) for complete, _ in completions])
    for (complete, label), got in zip(completions, values):
        start = trace.now() if trace.ON else 0.0
        try:
            if isinstance(complete, Completion):
                complete.finish(*got)
            else:
                complete()
        finally:
            if start:
                trace.bucket(rank, start, label, 0, strategy.name, phase="completion")


# -- collectives of one array -----------------------------------------------------------
def one_array(session, name, array, writeable=False, floating=False):
    """``(kind, [array])``: the one array collective ``name`` takes, as a
    numpy or cupy array (a view of another framework's, see
    :mod:`commlib.interop`), checked."""
    if isinstance(array, (list, tuple)):
        raise ArgumentError("rank %d: %s takes one array, got a %s"
                            % (session.rank, name, type(array).__name__))
    items = validation.as_list(array, name, session.rank)[0]
    return validation.check_arrays(items, rank=session.rank, device=session.device,
                                   writeable=writeable, floating=floating), items


def all_gather(session, given):
    """See :meth:`commlib.Communicator.all_gather`."""
    def checks():
        kind, items = one_array(session, "all_gather", given)
        return kind, items, None

    wait, (kind, (array,), _) = session.begin("all_gather", ("all_gather",), checks)
    xp = array_module(array)
    out = xp.empty((session.size,) + tuple(array.shape), dtype=array.dtype)
    if session.size == 1:
        out[0] = array
    elif array.size:
        send = xp.ascontiguousarray(array).reshape(-1)
        session.stats.bytes_sent += send.nbytes
        with session.data_phase():
            session.transport(kind).all_gather(send, out.reshape(-1), wait)
    return interop.like(given, out)


def reduce_scatter(session, given, op):
    """See :meth:`commlib.Communicator.reduce_scatter`."""
    averaging = op == "avg"

    def checks():
        validation.check_op(op, False, session.rank)
        kind, items = one_array(session, "reduce_scatter", given, floating=averaging)
        if items[0].size % session.size:
            raise ArgumentError(
                "rank %d: reduce_scatter needs array.size divisible by size=%d; got "
                "array.size=%d (shape %s)" % (session.rank, session.size, items[0].size,
                                              tuple(items[0].shape)))
        return kind, items, None

    wait, (kind, (array,), _) = session.begin("reduce_scatter", ("reduce_scatter", op), checks)
    xp = array_module(array)
    out = xp.empty(array.size // session.size, dtype=array.dtype)
    if session.size == 1:
        out[...] = array.reshape(-1)
    elif out.size:
        send = xp.ascontiguousarray(array).reshape(-1)
        session.stats.bytes_sent += send.nbytes
        with session.data_phase():
            session.transport(kind).reduce_scatter(send, out, "sum" if averaging else op, wait)
    if averaging:
        out *= 1.0 / session.size
    return interop.like(given, out)


def all_gatherv(session, given):
    """See :meth:`commlib.Communicator.all_gatherv`."""
    def checks():
        kind, items = one_array(session, "all_gatherv", given)
        if items[0].ndim != 1:
            raise ArgumentError("rank %d: all_gatherv takes a 1-D array, got shape %s"
                                % (session.rank, tuple(items[0].shape)))
        return kind, (), None, items[0]        # lengths may differ: no layout to compare

    wait, (kind, _, _, array) = session.begin(
        "all_gatherv", ("all_gatherv", str(interop.dtype_name(given))), checks)
    xp = array_module(array)
    if session.size == 1:
        return interop.like(given, xp.array(array, copy=True)), np.array([array.size],
                                                                          dtype=np.int64)
    counts = np.empty(session.size, dtype=np.int64)
    mine = np.array([array.size], dtype=np.int64)
    with session.data_phase():
        session.stats.bytes_sent += mine.nbytes
        session.transport("numpy").all_gather(mine, counts, wait)
        out = xp.empty(int(counts.sum()), dtype=array.dtype)
        if out.size:
            session.stats.bytes_sent += array.nbytes
            session.transport(kind).all_gatherv(xp.ascontiguousarray(array), out, counts, wait)
    return interop.like(given, out), counts


def barrier(session, timeout):
    """See :meth:`commlib.Communicator.barrier`."""
    own = None
    if timeout is not None:
        try:
            own = settings.seconds(timeout, "timeout")
        except ArgumentError as exc:
            own = exc

    def checks():
        if isinstance(own, ArgumentError):
            raise ArgumentError("rank %d: barrier: %s" % (session.rank, own))
        return None, (), None

    wait, _ = session.begin("barrier", ("barrier", timeout), checks,
                            timeout=own if isinstance(own, float) else None)
    if session.size > 1:
        with session.data_phase():
            session.transport("numpy").barrier(wait)
