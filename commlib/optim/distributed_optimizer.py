"""The training step of data-parallel training: average the gradients over
the ranks (overlapped with the backward pass when it marks gradients
ready), then apply an update rule, with optional gradient accumulation and
SINGA's ``DistOpt`` update variants."""
import time

import numpy as np

from .. import compression as _compression
from .. import validation
from ..bucketing import _span, flat_arrays
from ..compression import Partial, Threshold, TopK
from ..errors import ArgumentError
from ..ops._arrays import address, array_module, is_cupy
from ..overlap import BackwardReducer
from . import parameters, state
from .rules import Rule, check_number


def _like(params):
    """Zero-filled arrays of the shapes and dtypes of ``params``: for each
    dtype, consecutive views of one buffer (:func:`~commlib.flat_arrays`),
    so the all-reduce fuses them without copies."""
    xp = array_module(params[0])
    groups = {}
    for i, p in enumerate(params):
        groups.setdefault(p.dtype, []).append(i)
    out = [None] * len(params)

    def allocate():
        for dtype, indices in groups.items():
            views = flat_arrays([params[i].shape for i in indices], dtype=dtype, xp=xp)
            for i, view in zip(indices, views):
                out[i] = view

    if is_cupy(params[0]):
        with params[0].device:
            allocate()
    else:
        allocate()
    return out


def _runs(arrays):
    """Maximal runs of consecutive indices whose arrays lie back to back in
    one base array (same dtype), as lists of indices."""
    runs = []
    for i, a in enumerate(arrays):
        if runs:
            b = arrays[runs[-1][-1]]
            if (a.base is not None and a.base is b.base and a.dtype == b.dtype
                    and a.flags.c_contiguous and address(a) == address(b) + b.nbytes):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def _fused(arrays, run):
    """The array that stands for ``arrays[i] for i in run``: the array
    itself for a run of one, else the run's 1-D span (None if it has none)."""
    if len(run) == 1:
        return arrays[run[0]]
    return _span([arrays[i] for i in run], array_module(arrays[run[0]]))


class DistributedOptimizer:
    """Averages gradients over ``comm``'s ranks and updates ``params``.

    ``params``: list of numpy or cupy arrays of floating dtypes (ideally
    :func:`~commlib.flat_arrays` views), updated in place and kept
    identical on every rank (start from :meth:`broadcast_parameters`).
    ``rule``: :class:`~commlib.optim.SGD`, :class:`~commlib.optim.Adam` or
    any callable ``rule(params, grads)`` that updates ``params`` in place.
    ``compression``: as ``comm.all_reduce``'s (``"fp16"``, ``"bf16"``,
    ``TopK``, ``Threshold``), applied to the gradients; a
    :class:`~commlib.compression.Partial` makes every step a partial update
    (see :meth:`update_partial`). ``bucket_bytes``: the gradient buckets'
    size (default: the transport's). ``overlap``: True: :meth:`grad_ready`
    starts a bucket's all-reduce as soon as its gradients are ready;
    ``"auto"`` (default): the same unless it cannot pay on this node (see
    :func:`commlib.overlap.early_start_pays`); False: every bucket starts in
    :meth:`step`. The result is bit-identical either way. ``accumulate``: micro-batches per update.

    The backward pass writes into :attr:`grads` (same shapes and dtypes as
    ``params``), calls :meth:`grad_ready(i) <grad_ready>` when ``grads[i]``
    is final (optional: it only moves communication earlier), then every
    rank calls :meth:`step` (collective).
    """

    def __init__(self, comm, params, rule, *, compression=None, bucket_bytes=None,
                 overlap="auto", accumulate=1):
        rank = getattr(comm, "rank", None)
        if rank is None or not callable(getattr(comm, "all_reduce", None)):
            raise ArgumentError("DistributedOptimizer: comm must be a commlib.Communicator, "
                                "got %s" % type(comm).__name__)
        if not isinstance(params, (list, tuple)) or not params:
            raise ArgumentError("rank %d: params must be a non-empty list of arrays, got %r"
                                % (rank, params if not isinstance(params, (list, tuple))
                                   else "an empty list"))
        params = list(params)
        validation.check_arrays(params, rank=rank, device=comm.device, writeable=True,
                                floating=True, what="params")
        if not callable(rule):
            raise ArgumentError("rank %d: rule must be commlib.optim.SGD, Adam or a callable "
                                "rule(params, grads), got %r" % (rank, rule))
        if (isinstance(accumulate, (bool, np.bool_))
                or not isinstance(accumulate, (int, np.integer)) or accumulate < 1):
            raise ArgumentError("rank %d: accumulate must be an int >= 1, got %r"
                                % (rank, accumulate))
        if not (isinstance(overlap, (bool, np.bool_)) or overlap == "auto"):
            raise ArgumentError("rank %d: overlap must be True, False or 'auto', got %r"
                                % (rank, overlap))
        if bucket_bytes is not None and (
                isinstance(bucket_bytes, (bool, np.bool_))
                or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1):
            raise ArgumentError("rank %d: bucket_bytes must be None or an int >= 1, got %r"
                                % (rank, bucket_bytes))
        self.comm, self.params, self.rule = comm, params, rule
        self.compression = _compression.resolve(compression, rank)
        self.bucket_bytes = None if bucket_bytes is None else int(bucket_bytes)
        self.overlap = overlap if overlap == "auto" else bool(overlap)
        self.accumulate = int(accumulate)
        self.grads = _like(params)
        # a built-in rule updates each run of parameters that lie back to back
        # (flat_arrays) as one array: elementwise, so the same bits, fewer calls
        runs = _runs(params) if isinstance(rule, Rule) else [[i] for i in range(len(params))]
        args = ([_fused(params, run) for run in runs], [_fused(self.grads, run) for run in runs])
        if any(a is None for a in args[0] + args[1]):
            runs, args = [[i] for i in range(len(params))], (params, self.grads)
        self._runs, self._rule_args = runs, args
        self._sums = _like(params) if self.accumulate > 1 else None
        self._reducers = {}            # strategy name -> BackwardReducer of self.grads
        self._micro = 0                # micro-batches accumulated towards this update
        self._marked = set()           # gradients marked ready in this micro-batch
        self._started = False          # grad_ready started this update's all-reduce
        self._steps = np.zeros((), np.int64)
        self._seconds, self._bytes, self._window = 0.0, 0, None

    # -- hyperparameters and statistics ------------------------------------------
    @property
    def lr(self):
        """The rule's learning rate (settable between steps)."""
        return self.rule.lr

    @lr.setter
    def lr(self, value):
        if not hasattr(self.rule, "lr"):
            raise ArgumentError("rank %d: lr: the rule %r has no learning rate"
                                % (self.comm.rank, self.rule))
        self.rule.lr = check_number(value, "lr", rank=self.comm.rank)

    @property
    def steps(self):
        """Updates applied so far."""
        return int(self._steps)

    @property
    def stats(self):
        """``{"bytes_sent", "comm_seconds", "steps"}``: payload bytes this
        rank handed to its transports from the first collective of an
        update to its end (``comm.stats.bytes_sent``, so also any collective
        issued in between), seconds blocked in the optimizer's collectives,
        and updates applied."""
        return {"bytes_sent": self._bytes, "comm_seconds": self._seconds, "steps": self.steps}

    def _timed(self, fn, *args):
        """``fn(*args)`` (a collective), its time added to comm_seconds."""
        if self._window is None:
            self._window = self.comm.stats.bytes_sent
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._seconds += time.perf_counter() - start

    def _close_window(self):
        if self._window is not None:
            self._bytes += self.comm.stats.bytes_sent - self._window
            self._window = None

    # -- the training step ---------------------------------------------------------
    def _last(self):
        return self._micro == self.accumulate - 1

    def _prepare(self, i):
        """grads[i] is final for this micro-batch: add it to the sums, or on
        the last micro-batch make it the mean of the micro-batches."""
        if self._sums is None:
            return
        g, total = self.grads[i], self._sums[i]
        if not self._last():
            if self._micro == 0:
                total[...] = g
            else:
                total += g
        else:
            g += total
            g /= self.accumulate

    def grad_ready(self, i):
        """``grads[i]`` holds its final value for this micro-batch; on the
        last micro-batch of an update with ``overlap``, the all-reduce of
        its bucket starts once the bucket is complete (and the buckets
        before it have started). Each i once per micro-batch."""
        rank = self.comm.rank
        if (isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer))
                or not 0 <= i < len(self.params)):
            raise ArgumentError("rank %d: grad_ready: i must be an int in [0, %d), got %r"
                                % (rank, len(self.params), i))
        i = int(i)
        if i in self._marked:
            raise ArgumentError("rank %d: grad_ready(%d) was already called in this "
                                "micro-batch" % (rank, i))
        self._marked.add(i)
        self._prepare(i)
        if (self._last() and self.overlap and not isinstance(self.compression, Partial)):
            self._started = True
            self._timed(self._reducer_for(self.compression).ready, i)

    def step(self, grads=None):
        """Finish this micro-batch (collective): with ``grads`` (a list like
        ``params``) those are copied into :attr:`grads` first. Before the
        last micro-batch of an update only accumulates and returns False;
        on the last averages the mean gradients over the ranks, applies the
        rule and returns True."""
        return self._step(grads, self.compression)

    def _step(self, grads, strategy):
        if self._started and strategy is not self.compression:
            raise ArgumentError(
                "rank %d: grad_ready() started this update's all-reduce with compression=%r; "
                "finish it with step()" % (self.comm.rank, self.compression))
        if grads is not None:
            self._take(grads)
        for i in range(len(self.params)):
            if i not in self._marked:
                self._prepare(i)
        self._marked.clear()
        if not self._last():
            self._micro += 1
            return False
        self._micro = 0
        try:
            if isinstance(strategy, Partial):
                self.rule(*self._rule_args)
                self._timed(lambda: self.comm.all_reduce(self.params, op="avg",
                                                         compression=strategy))
            else:
                self._reduce(strategy)
                self.rule(*self._rule_args)
        finally:
            self._started = False
            self._close_window()
        self._steps += 1
        return True

    def _take(self, grads):
        """Check ``grads`` against ``params`` and copy them into self.grads."""
        rank = self.comm.rank
        if self._marked:
            raise ArgumentError("rank %d: grads: given to a step whose opt.grads were marked "
                                "ready with grad_ready(); use one or the other" % rank)
        if not isinstance(grads, (list, tuple)) or len(grads) != len(self.params):
            raise ArgumentError("rank %d: grads must be a list of %d arrays (one per "
                                "parameter), got %s" % (rank, len(self.params), (
                                    "%d" % len(grads)) if isinstance(grads, (list, tuple))
                                    else type(grads).__name__))
        validation.check_arrays(list(grads), rank=rank, writeable=False, what="grads")
        for i, (g, p) in enumerate(zip(grads, self.params)):
            if g.shape != p.shape or g.dtype != p.dtype or is_cupy(g) != is_cupy(p):
                raise ArgumentError(
                    "rank %d: grads[%d] is a %s of shape %s and dtype %s, but params[%d] is a "
                    "%s of shape %s and dtype %s" % (
                        rank, i, type(g).__name__, g.shape, g.dtype, i, type(p).__name__,
                        p.shape, p.dtype))
        for mine, g in zip(self.grads, grads):
            if mine is not g:
                mine[...] = g

    def _reducer_for(self, strategy):
        name = None if strategy is None else strategy.name
        found = self._reducers.get(name)
        if found is None:
            found = self._reducers[name] = BackwardReducer(
                self.comm, self.grads, bucket_bytes=self.bucket_bytes, op="avg",
                compression=strategy, overlap=self.overlap or False)
        return found

    def _reduce(self, strategy):
        """Average self.grads over the ranks with ``strategy``, finishing
        the buckets grad_ready started."""
        self._timed(self._reducer_for(strategy).wait)

    # -- SINGA's DistOpt ------------------------------------------------------------
    def update(self, grads=None):
        """SINGA's ``backward_and_update``: :meth:`step` (the constructor's
        compression)."""
        return self._step(grads, self.compression)

    def update_half(self, grads=None):
        """SINGA's ``backward_and_update_half``: the gradients are averaged in
        float16 (``compression="fp16"``)."""
        return self._step(grads, _compression.resolve("fp16", self.comm.rank))

    def update_partial(self, grads=None, fraction=None):
        """SINGA's ``backward_and_partial_update``: each rank updates its
        parameters with its own gradients, then one rotating window of
        ``fraction`` of each parameter bucket is averaged over the ranks
        (:class:`~commlib.compression.Partial`; default: the constructor's
        Partial, else 0.1). Ranks' parameters differ between windows:
        average them all (``comm.all_reduce(params, op="avg")``) before
        evaluating or saving."""
        if fraction is None:
            strategy = (self.compression if isinstance(self.compression, Partial)
                        else Partial(0.1))
        else:
            strategy = Partial(fraction)
        return self._step(grads, strategy)

    def update_sparse(self, grads, spars, topK=True, corr=True):
        """SINGA's ``backward_and_sparse_update``: with ``topK`` the
        ``spars`` fraction of largest-magnitude gradients of each bucket
        travel (:class:`~commlib.compression.TopK`), else those with
        magnitude above ``spars`` (:class:`~commlib.compression.Threshold`);
        ``corr``: error feedback (what was not sent is added to the next
        step's gradients)."""
        kind = TopK if topK else Threshold
        return self._step(grads, kind(spars, error_feedback=corr))

    # -- parameters and checkpoints -------------------------------------------------
    def broadcast_parameters(self, root=0):
        """Copy ``root``'s parameters into every rank's (collective)."""
        try:
            return self._timed(parameters.broadcast_parameters, self.comm, self.params, root)
        finally:
            self._close_window()

    def check_parameters(self):
        """Raise ConsistencyError naming the ranks whose parameters differ
        (collective; see :func:`commlib.optim.check_parameters`)."""
        parameters.check_parameters(self.comm, self.params)

    def live_state(self):
        """The arrays that make up the training state, by name: ``"steps"``
        (0-d int64), ``"params.<i>"`` and ``"rule.<name>"`` (the rule's
        :meth:`~commlib.optim.rules.Rule.state`, when it has one). The
        arrays themselves, not copies."""
        out = {"steps": self._steps}
        out.update(("params.%d" % i, p) for i, p in enumerate(self.params))
        if isinstance(self.rule, Rule):     # per parameter, whichever runs it updates
            out.update(("rule." + k, v) for k, v in self.rule.counters().items())
            for name, buffers in self.rule.buffers_for(self._rule_args[0]).items():
                for run, buf in zip(self._runs, buffers):
                    flat, offset = buf.reshape(-1), 0
                    for i in run:
                        size = self.params[i].size
                        out["rule.%s.%d" % (name, i)] = \
                            flat[offset:offset + size].reshape(self.params[i].shape)
                        offset += size
        elif hasattr(self.rule, "state"):
            out.update(("rule." + k, v) for k, v in self.rule.state(self.params).items())
        return out

    def state_dict(self):
        """numpy copies of :meth:`live_state` (not compression residuals);
        only between updates (not in the middle of an accumulation)."""
        if self._micro or self._marked:
            raise ArgumentError("rank %d: state_dict() in the middle of an update (after %d "
                                "of %d micro-batches); call it after a step that returned "
                                "True" % (self.comm.rank, self._micro, self.accumulate))
        return state.host_copies(self.live_state())

    def load_state_dict(self, state_dict, root=0):
        """Restore a :meth:`state_dict` on every rank (collective): only
        ``root``'s ``state_dict`` is used (the others may pass None)."""
        state.load_state_dict(self, state_dict, root)

    def __repr__(self):
        return ("DistributedOptimizer(%r, %d params, compression=%r, accumulate=%d, "
                "overlap=%r, steps=%d)" % (self.rule, len(self.params), self.compression,
                                           self.accumulate, self.overlap, self.steps))

