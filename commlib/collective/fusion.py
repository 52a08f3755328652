"""Fused collectives: a list of arrays planned into buckets and in-place
arrays (:mod:`commlib.collective.bucketing`), each handed to a step of the collective
or, for an all-reduce with compression, to the strategy as a
:class:`~commlib.compression.base.Bucket` with its state."""
from . import bucketing, consistency
from ..compression.base import Bucket, Completion
from ..ops.arrays import to_host
from .. import trace


def fused_checks(session, items, prepared, writeable, floating):
    """Array checks for a fused collective; a list already prepared with
    checks at least this strict skips them."""
    if (prepared is not None and (prepared.writeable or not writeable)
            and (prepared.floating or not floating)):
        return prepared.kind
    return session.array_checks(items, writeable=writeable, floating=floating)


def fused(session, *, items, kind, key, prepared, writeable, step, strategy=None, op=None,
          scale=None, wait=None, state=None):
    """Run ``step(transport, flat_buffer, bucket_index_or_None, prepared)``
    for every bucket and every in-place array of the list. With a
    compression ``strategy``, a bucket or array it applies to goes to it
    instead, as a :class:`~commlib.compression.base.Bucket` of ``op``,
    ``scale`` and the collective's ``wait``: all of them at once to its
    ``reduce_all`` first (:func:`reduce_all`), else one by one (:func:`unit`).
    The units of a cupy list that no strategy takes go to the step's
    ``together(transport, units, prepared)`` at once where it has one (see
    :func:`commlib.collective.collectives.reduce_step`);
    ``state`` (a :class:`~commlib.collective.reduce_state.ReduceState` or None)
    holds the list's plan and compression state instead of the
    communicator's own tables."""
    transport = session.transport(kind)
    if prepared is None:
        plan = bucketing.plan_for(items, session.bucket_bytes_for(transport))
        cache = session.fusion if state is None else state.fusion
        prepared = cache.prepare(key, items, plan, kind, writeable)
        prepared.digest = consistency.layout_digest(items)
    tables = session.workspaces if state is None else state.workspaces
    # a strategy may return a bucket's completion instead of finishing it:
    # completions run in bucket order once every bucket has been issued
    # (see Compression.reduce)
    completions = []
    units = None
    if strategy is not None:
        # the strategy may issue its buckets together (Compression.reduce_all),
        # before the call's other units: the same order on every rank
        split = split_units(prepared, strategy, tables)
        grouped = None if not split.compressed or split.declined else reduce_all(
            transport, items, prepared, split, strategy=strategy, op=op, scale=scale,
            wait=wait)
        if grouped is not None:
            completions += grouped
            units = split.rest
    if units is None:
        units = units_of(prepared)
        together = strategy is None
    else:                           # the strategy took its units: the rest are the step's
        together = True
    if together and prepared.kind == "cupy" and getattr(step, "together", None) is not None:
        issue_together(transport, items, units, prepared, step)
        units = ()
    for where, index, buf in units:
        if index is None:           # an array reduced in place: its flat view
            buf = prepared.flat(items, where)
        completions.append(unit(transport, items, prepared, where=where, index=index, buf=buf,
                                step=step, strategy=strategy, op=op, scale=scale, wait=wait,
                                tables=tables))
    pending = [c for c in completions if c is not None]
    if pending:
        # the values every completion reads, in one transfer
        values = to_host([getattr(complete, "reads", ()) for complete, _ in pending])
        for (complete, label), got in zip(pending, values):
            completion(complete, got, rank=transport.rank, label=label, name=strategy.name)


def issue_together(transport, items, units, prepared, step):
    """The ``units`` of a cupy list handed to ``step.together`` at once;
    while tracing, recorded as one ``bucket`` event of all their bytes."""
    start = trace.now() if trace.ON else 0.0
    step.together(transport, units, prepared)
    if start and units:
        trace.bucket(transport.rank, start, label_of(units[0][1], units[0][0]),
                     sum(prepared.sized(where, buf)[1] for where, _, buf in units), None)


def units_of(prepared):
    """``(where, index, buffer or None)`` of each unit of ``prepared``: its
    buckets (``where`` and ``index`` the bucket's index, its buffer), then
    its arrays reduced in place (``where`` ``("direct", position in the
    list)``, ``index`` and buffer None)."""
    return ([(i, i, buf) for i, buf in prepared.buckets()]
            + [(("direct", position), None, None) for position in prepared.plan.direct])


class Split:
    """The units of a list (buckets and in-place arrays) that a strategy
    compresses, each as ``(where, index, buffer or None, state)`` (the
    buffer of a bucket, None for an array reduced in place; its state from
    :func:`workspace`), with the state of them all together (``together``)
    and their bytes; whether the strategy ``declined`` to reduce them
    together (it answers alike for a list and settings, see
    Compression.reduce_all); and the other units, as :func:`units_of`
    gives them."""

    __slots__ = ("compressed", "together", "nbytes", "declined", "rest")


def split_units(prepared, strategy, tables):
    """The :class:`Split` of ``prepared``'s units for ``strategy`` (its
    ``applies_to``), made once per list and strategy name
    (``prepared.by_strategy``)."""
    split = prepared.by_strategy.get(strategy.name)
    if split is None:
        split = prepared.by_strategy[strategy.name] = Split()
        units = units_of(prepared)
        sized = [prepared.sized(where, buf) for where, _, buf in units]
        applies = [strategy.applies_to(dt) for dt, _ in sized]
        split.compressed = [(where, index, buf, workspace(prepared, strategy, where, tables))
                            for (where, index, buf), yes in zip(units, applies) if yes]
        split.rest = [u for u, yes in zip(units, applies) if not yes]
        split.together = workspace(prepared, strategy, "together", tables)
        split.nbytes = sum(n for (_, n), yes in zip(sized, applies) if yes)
        split.declined = False
    return split


def reduce_all(transport, items, prepared, split, *, strategy, op, scale, wait):
    """The compressed units of ``split`` (a :class:`Split`) handed to
    ``strategy.reduce_all`` together, with their states. Returns None when
    the strategy reduces them one by one (see :func:`unit`), else the
    completions it returned, paired with the first unit's name in a trace
    (:func:`label_of`). While tracing, recorded as one ``bucket`` event of
    all their bytes."""
    start = trace.now() if trace.ON else 0.0
    # an array reduced in place is handed as it is: a flat view of it would
    # be a new object at every call, where a plan of the strategy's is
    # recognised by the arrays' identity
    buckets = [Bucket(transport, prepared.arrays(items, index, buf) if index is not None
                      else (items[where[1]],), op, scale, wait, state)
               for where, index, buf, state in split.compressed]
    done = strategy.reduce_all(buckets, split.together)
    if done is None:
        split.declined = True
        return None
    where, index = split.compressed[0][:2]
    label = label_of(index, where)
    if start:
        trace.bucket(transport.rank, start, label, split.nbytes, strategy.name)
    return [None if complete is None else (complete, label) for complete in done]


def unit(transport, items, prepared, *, where, index, buf, step, strategy, op, scale, wait,
         tables):
    """One bucket (``index``) or in-place array (``index`` None) of a fused
    collective; ``where`` names it within the plan for the compression
    state, kept in ``tables``. Returns the strategy's completion of the
    bucket and the unit's name in a trace (:func:`label_of`), or None when
    nothing is left to do. While tracing,
    recorded as a ``bucket`` event around the transport calls it makes."""
    start = trace.now() if trace.ON else 0.0
    compressed = strategy is not None and strategy.applies_to(buf.dtype)
    try:
        if compressed:
            complete = strategy.reduce(Bucket(transport, prepared.arrays(items, index, buf), op,
                                              scale, wait,
                                              state=workspace(prepared, strategy, where, tables)))
            return None if complete is None else (complete, label_of(index, where))
        step(transport, buf, index, prepared)
        return None
    finally:
        if start:
            trace.bucket(transport.rank, start, label_of(index, where), buf.nbytes,
                         strategy.name if compressed else None)


def label_of(index, where):
    """A unit's name in a trace: its bucket index, or ``"direct N"``."""
    return index if index is not None else "direct %d" % where[1]


def completion(complete, values, *, rank, label, name):
    """Finish a compressed bucket (strategy ``name``): ``complete.finish(*values)``
    for a :class:`~commlib.compression.base.Completion` (``values``: its
    reads on the host), ``complete()`` for any other callable; while
    tracing, recorded as a ``bucket`` event of its own (``label``, phase
    ``"completion"``, no bytes: the bucket's event counted them)."""
    start = trace.now() if trace.ON else 0.0
    try:
        if isinstance(complete, Completion):
            complete.finish(*values)
        else:
            complete()
    finally:
        if start:
            trace.bucket(rank, start, label, 0, name, phase="completion")


def workspace(prepared, strategy, where, tables):
    """The dict a compression strategy keeps for one bucket (``where``)
    of one list layout (``prepared.plan.key``) in ``tables`` (the
    communicator's, or a ReduceState's): it lasts as long as they do, so
    error-feedback residuals carry over between calls with arrays of the
    same shapes. It is keyed by the strategy's settings (its ``name``),
    not the object: a new object with the same settings continues where
    the last one stopped, on every rank alike. The layout's table is
    looked up once per prepared list (hashing a layout of many arrays is
    not free)."""
    if prepared.workspaces is None:
        prepared.workspaces = tables.setdefault(prepared.plan.key, {})
    key = (strategy.name, where)
    found = prepared.workspaces.get(key)
    if found is None:
        found = prepared.workspaces[key] = {}
    return found
