"""The training step of data-parallel training: average the gradients over
the ranks (overlapped with the backward pass when it marks gradients
ready), then apply an update rule per parameter group, with optional
gradient accumulation, loss scaling, clipping by the global norm, uneven
inputs (:meth:`DistributedOptimizer.join`) and SINGA's ``DistOpt`` update
variants."""
import contextlib
import math
import time
from collections.abc import Mapping

import numpy as np

from .. import compression as _compression
from .. import interop
from ..collective import validation
from ..collective.bucketing import flat_arrays, span
from ..compression import Partial, Threshold, TopK
from ..compression import nonfinite as _nonfinite
from ..errors import ArgumentError, NonFiniteError
from ..ops.arrays import address, array_module, is_cupy
from ..progress.overlap import BackwardReducer
from . import parameters, state
from .rules import Rule, check_number
from .scaler import DynamicLossScaler

_DEFAULT = object()


def _count_nonfinite(a):
    """How many NaN and +-inf ``a`` holds (an int)."""
    xp = array_module(a)
    return int(a.size - xp.count_nonzero(xp.isfinite(a)))


def _all_finite(a):
    xp = array_module(a)
    return bool(xp.isfinite(a).all())


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
    return span([arrays[i] for i in run], array_module(arrays[run[0]]))


_GROUP_EXTRA = ("params", "name", "initial_lr")
NONFINITE_MODES = ("raise", "warn", "skip")


class _Hook:
    """Handle of a gradient hook: :meth:`remove` unregisters it."""

    def __init__(self, hooks, fn):
        self._hooks, self.fn = hooks, fn

    def remove(self):
        """Unregister the hook (once is enough; later calls do nothing)."""
        if self.fn in self._hooks:
            self._hooks.remove(self.fn)


class DistributedOptimizer:
    """Averages gradients over ``comm``'s ranks and updates ``params``.

    The backward pass writes into :attr:`grads` (same shapes and dtypes as
    :attr:`params`), calls :meth:`grad_ready(i) <grad_ready>` when
    ``grads[i]`` is final (optional: it only moves communication earlier),
    then every rank calls :meth:`step` (collective). One update is: average
    over the ranks, then (each optional) the loss scaler's non-finite check
    and unscaling, the gradient hooks, clipping by the global norm, and the
    rule, group by group.

    Args:
        comm: a :class:`commlib.Communicator`.
        params: list of numpy or cupy arrays of floating dtypes (ideally
            :func:`~commlib.flat_arrays` views), updated in place and kept
            identical on every rank (start from :meth:`broadcast_parameters`);
            or, as ``torch.optim``'s, a list of parameter groups: dicts with
            ``"params"`` (a list of arrays) and any of the rule's
            hyperparameters (:attr:`Rule.hyper <commlib.optim.rules.Rule.hyper>`:
            ``lr``, ``momentum``, ``weight_decay``, ...; the rule's own values
            are the defaults), plus optionally ``"name"``.
        rule: :class:`~commlib.optim.SGD`, :class:`~commlib.optim.Adam`,
            :class:`~commlib.optim.AdamW`, :class:`~commlib.optim.LAMB`, or any
            callable ``rule(params, grads)`` that updates ``params`` in place
            (then one group without hyperparameters).
        compression: as ``comm.all_reduce``'s (``"fp16"``, ``"bf16"``,
            ``TopK``, ``Threshold``), applied to the gradients; a
            :class:`~commlib.compression.Partial` makes every step a partial
            update (see :meth:`update_partial`).
        bucket_bytes: the gradient buckets' size (default: the transport's).
        overlap: True: :meth:`grad_ready` starts a bucket's all-reduce as
            soon as its gradients are ready; ``"auto"`` (default): the same
            unless it cannot pay on this node (see
            :func:`commlib.progress.overlap.early_start_pays`); False: every bucket
            starts in :meth:`step`. The result is bit-identical either way.
        accumulate: micro-batches per update (see also :meth:`no_sync`).
        clip_norm: None, or the default ``clip_norm`` of :meth:`step`.
        loss_scaler: a :class:`~commlib.optim.DynamicLossScaler`: the
            gradients are unscaled after the average, and a step whose
            averaged gradients hold NaN or inf on any rank is skipped on
            every rank (the scale backs off).
        nonfinite: None (default; no check: a NaN on one rank becomes NaN
            in every rank's parameters), ``"raise"``
            (:class:`~commlib.errors.NonFiniteError` on every rank naming the
            ranks and counts, parameters untouched), ``"warn"`` (a
            RuntimeWarning, then the update) or ``"skip"`` (every rank skips
            the update; :meth:`step` returns False). With a loss scaler:
            ``"skip"``. The check costs one small all-gather per update;
            with compression it is made before any bucket is sent (so a
            skipped update leaves the error-feedback residuals as they
            were), and :meth:`grad_ready` then starts nothing early.

    Raises:
        ArgumentError: a bad argument, naming it and the rank.
    """

    def __init__(self, comm, params, rule, *, compression=None, bucket_bytes=None,
                 overlap="auto", accumulate=1, clip_norm=None, loss_scaler=None,
                 nonfinite=None):
        rank = getattr(comm, "rank", None)
        if rank is None or not callable(getattr(comm, "all_reduce", None)):
            raise ArgumentError("DistributedOptimizer: comm must be a commlib.Communicator, "
                                "got %s" % type(comm).__name__)
        if not isinstance(params, (list, tuple)) or not params:
            raise ArgumentError("rank %d: params must be a non-empty list of arrays, got %r"
                                % (rank, params if not isinstance(params, (list, tuple))
                                   else "an empty list"))
        if not callable(rule):
            raise ArgumentError("rank %d: rule must be commlib.optim.SGD, Adam or a callable "
                                "rule(params, grads), got %r" % (rank, rule))
        self.comm, self.rule = comm, rule
        self.param_groups = self._groups(params)
        params = [p for g in self.param_groups for p in g["params"]]
        validation.check_arrays(params, rank=rank, device=comm.device, writeable=True,
                                floating=True, what="params")
        if len({id(p) for p in params}) != len(params):
            raise ArgumentError("rank %d: params: an array appears twice (in one group or in "
                                "two)" % rank)
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
        if nonfinite is not None and nonfinite not in NONFINITE_MODES:
            raise ArgumentError("rank %d: nonfinite must be None, 'raise', 'warn' or 'skip', "
                                "got %r" % (rank, nonfinite))
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise ArgumentError("rank %d: loss_scaler must be a commlib.optim.DynamicLossScaler "
                                "or None, got %r" % (rank, loss_scaler))
        if loss_scaler is not None and nonfinite not in (None, "skip"):
            raise ArgumentError("rank %d: with a loss_scaler a step with NaN or inf gradients "
                                "is skipped; nonfinite must be None or 'skip', got %r"
                                % (rank, nonfinite))
        self.params = params
        self.compression = _compression.resolve(compression, rank)
        self.bucket_bytes = None if bucket_bytes is None else int(bucket_bytes)
        self.overlap = overlap if overlap == "auto" else bool(overlap)
        self.accumulate = int(accumulate)
        self.clip_norm = self._check_clip(clip_norm)
        self.loss_scaler = loss_scaler
        self.nonfinite = "skip" if loss_scaler is not None else nonfinite
        self.grads = _like(params)
        # a built-in elementwise rule updates each run of parameters that lie
        # back to back (flat_arrays) as one array: the same bits, fewer calls;
        # runs never cross groups
        fuse = isinstance(rule, Rule) and rule.elementwise
        runs, spans, offset = [], [], 0
        for g in self.param_groups:
            indices = list(range(offset, offset + len(g["params"])))
            offset += len(indices)
            mine = ([[indices[j] for j in run] for run in _runs([params[i] for i in indices])]
                    if fuse else [[i] for i in indices])
            spans.append((len(runs), len(runs) + len(mine)))
            runs.extend(mine)
        args = ([_fused(params, run) for run in runs], [_fused(self.grads, run) for run in runs])
        if any(a is None for a in args[0] + args[1]):
            runs = [[i] for i in range(len(params))]
            spans, offset = [], 0
            for g in self.param_groups:
                spans.append((offset, offset + len(g["params"])))
                offset += len(g["params"])
            args = (params, self.grads)
        self._runs, self._rule_args, self._spans = runs, args, spans
        self._follow_rule()
        self._sums = None              # running sums of the micro-batches (allocated at need)
        self._reducers = {}            # strategy name -> BackwardReducer of self.grads
        self._micro = 0                # micro-batches accumulated towards this update
        self._marked = set()           # gradients marked ready in this micro-batch
        self._started = False          # grad_ready started this update's all-reduce
        self._no_sync = False          # inside no_sync(): accumulate, do not average
        self._joining = False          # inside join(): vote before every average
        self._updates_in_join = 0      # updates with this rank's own gradients in join()
        self._clip_now = None          # join(): the clip_norm of the update voted on
        self._bad = {}                 # i -> non-finite count of grads[i] before the average
        self._hooks = []
        self.schedulers = []          # schedulers whose state checkpoints keep
        self._steps = np.zeros((), np.int64)
        self._skipped = np.zeros((), np.int64)
        self.last_grad_norm = None
        self._seconds, self._bytes, self._window = 0.0, 0, None

    # -- parameter groups ----------------------------------------------------------
    def _groups(self, params):
        """The validated parameter groups of the constructor's ``params``."""
        rank, rule = self.comm.rank, self.rule
        defaults = rule.defaults() if isinstance(rule, Rule) else {}
        if all(isinstance(p, Mapping) for p in params):
            given = [dict(p) for p in params]
        elif any(isinstance(p, Mapping) for p in params):
            raise ArgumentError("rank %d: params must be a list of arrays or a list of "
                                "parameter groups (dicts), not both" % rank)
        else:
            given = [{"params": list(params)}]
        groups = []
        for k, g in enumerate(given):
            where = "param_groups[%d]" % k
            if "params" not in g:
                raise ArgumentError("rank %d: %s has no 'params' (a list of arrays)"
                                    % (rank, where))
            arrays = g["params"]
            if not isinstance(arrays, (list, tuple)) or not arrays:
                raise ArgumentError("rank %d: %s['params'] must be a non-empty list of arrays, "
                                    "got %r" % (rank, where, arrays if not isinstance(
                                        arrays, (list, tuple)) else "an empty list"))
            unknown = sorted(set(g) - set(defaults) - set(_GROUP_EXTRA))
            if unknown:
                raise ArgumentError("rank %d: %s: unknown key%s %s; %s takes %s"
                                    % (rank, where, "s" if len(unknown) > 1 else "",
                                       ", ".join(map(repr, unknown)),
                                       type(rule).__name__ if isinstance(rule, Rule)
                                       else "a callable rule",
                                       ", ".join(map(repr, ("params",) + tuple(defaults)))))
            group = dict(defaults)
            group.update(g)
            group["params"] = interop.native_list(list(arrays), rank=rank, writeable=True,
                                                  what=where + "['params']")
            if isinstance(rule, Rule):
                group.update(rule.check_group(group, where + ": ", rank))
            groups.append(group)
        return groups

    def _follow_rule(self):
        """A hyperparameter changed on the rule object since the last look
        (``opt.rule.lr = x``) changes every group that still holds the
        rule's previous value."""
        if not isinstance(self.rule, Rule):
            return
        now = self.rule.defaults()
        seen = getattr(self, "_rule_seen", None)
        if seen is not None:
            for k, v in now.items():
                if v != seen[k]:
                    for g in self.param_groups:
                        if g[k] == seen[k]:
                            g[k] = v
        self._rule_seen = now

    def _hypers(self, k):
        """The validated hyperparameters of group ``k``."""
        return self.rule.check_group(self.param_groups[k], "param_groups[%d]: " % k,
                                     self.comm.rank)

    # -- hyperparameters and statistics ------------------------------------------
    @property
    def lr(self):
        """The learning rate of the first parameter group; setting it sets
        every group's (between steps).

        Raises:
            ArgumentError: a rule without a learning rate, or a bad value.
        """
        if not isinstance(self.rule, Rule):
            return getattr(self.rule, "lr")
        self._follow_rule()
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        if not isinstance(self.rule, Rule):
            if not hasattr(self.rule, "lr"):
                raise ArgumentError("rank %d: lr: the rule %r has no learning rate"
                                    % (self.comm.rank, self.rule))
            self.rule.lr = check_number(value, "lr", rank=self.comm.rank)
            return
        value = check_number(value, "lr", rank=self.comm.rank)
        self._follow_rule()
        for g in self.param_groups:
            g["lr"] = value
        self.rule.lr = value                # the rule's default too, as before groups
        self._rule_seen["lr"] = value

    @property
    def steps(self):
        """Updates applied so far (skipped ones not counted)."""
        return int(self._steps)

    @property
    def skipped_steps(self):
        """Updates skipped for NaN or inf gradients (``nonfinite="skip"`` or
        a loss scaler)."""
        return int(self._skipped)

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

    def _check_clip(self, clip_norm):
        if clip_norm is None:
            return None
        return check_number(clip_norm, "clip_norm", rank=self.comm.rank)

    # -- loop helpers ----------------------------------------------------------------
    def zero_grad(self):
        """Set every gradient in :attr:`grads` to 0 (for a backward pass
        that adds into them). Not collective; returns None."""
        for g in self._rule_args[1]:
            g.fill(0)

    @contextlib.contextmanager
    def no_sync(self):
        """Context in which :meth:`step` only accumulates (returns False,
        no communication): the first step after it averages the mean of
        all micro-batches since the last update, like DDP's ``no_sync``
        decided at run time (with ``accumulate=N`` also, whichever comes
        later). Every rank must use it alike.

        Returns:
            A context manager (yielding this optimizer).
        """
        before, self._no_sync = self._no_sync, True
        try:
            yield self
        finally:
            self._no_sync = before

    def register_hook(self, fn):
        """Call ``fn(grads)`` in every update after the average (and the
        loss scaler's unscaling), before clipping and the rule; ``fn`` may
        change the arrays in place and must do the same on every rank.

        Returns:
            A handle whose ``remove()`` unregisters ``fn``.

        Raises:
            ArgumentError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise ArgumentError("rank %d: register_hook: fn must be callable, got %r"
                                % (self.comm.rank, fn))
        self._hooks.append(fn)
        return _Hook(self._hooks, fn)

    # -- the training step ---------------------------------------------------------
    def _last(self):
        return not self._no_sync and self._micro >= self.accumulate - 1

    def _prepare(self, i):
        """grads[i] is final for this micro-batch: add it to the sums, or on
        the last micro-batch make it the mean of the micro-batches."""
        g = self.grads[i]
        if not self._last():
            if self._sums is None:
                self._sums = _like(self.params)
            total = self._sums[i]
            if self._micro == 0:
                total[...] = g
            else:
                total += g
            return
        if self._micro:
            g += self._sums[i]
            g /= self._micro + 1
        if self.nonfinite is not None and not isinstance(self._checked_strategy, Partial):
            self._bad[i] = _count_nonfinite(g)

    _checked_strategy = None       # the strategy of the update being prepared

    def grad_ready(self, i):
        """``grads[i]`` holds its final value for this micro-batch; on the
        last micro-batch of an update with ``overlap``, the all-reduce of
        its bucket starts once the bucket is complete (and the buckets
        before it have started). Each i once per micro-batch.

        Raises:
            ArgumentError: ``i`` out of range or marked twice.
        """
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
        self._checked_strategy = self.compression
        self._prepare(i)
        if (self._last() and self.overlap and not self._joining
                and not (self.nonfinite is not None and self.compression is not None)
                and not isinstance(self.compression, Partial)):
            self._started = True
            self._timed(self._reducer_for(self.compression).ready, i)

    def step(self, grads=None, clip_norm=_DEFAULT):
        """Finish this micro-batch (collective).

        Args:
            grads: optional list like ``params``, copied into :attr:`grads`
                first.
            clip_norm: scale the averaged gradients by
                ``clip_norm / (norm + 1e-6)`` when their global L2 norm
                (over every parameter; the same on every rank) exceeds it,
                like ``torch.nn.utils.clip_grad_norm_``; None: no clipping;
                default: the constructor's. The norm before clipping is
                :attr:`last_grad_norm`.

        Returns:
            True when an update was applied; False before the last
            micro-batch of an update (only accumulated), and when the update
            was skipped for NaN or inf gradients.

        Raises:
            ArgumentError: bad ``grads`` or ``clip_norm``.
            NonFiniteError: with ``nonfinite="raise"``, on every rank.
        """
        clip = self.clip_norm if clip_norm is _DEFAULT else self._check_clip(clip_norm)
        return self._step(grads, self.compression, clip)

    def _step(self, grads, strategy, clip=None):
        rank = self.comm.rank
        if self._started and strategy is not self.compression:
            raise ArgumentError(
                "rank %d: grad_ready() started this update's all-reduce with compression=%r; "
                "finish it with step()" % (rank, self.compression))
        if clip is not None and isinstance(strategy, Partial):
            raise ArgumentError("rank %d: clip_norm: a partial update applies each rank's own "
                                "gradients, which have no global norm; use clip_norm=None"
                                % rank)
        if self._joining and strategy is not None and (
                not isinstance(strategy, _compression.HalfPrecision)):
            raise ArgumentError("rank %d: join(): only plain or half-precision averaging can "
                                "take ranks that have finished, not compression=%r"
                                % (rank, strategy))
        if grads is not None:
            self._take(grads)
        self._checked_strategy = strategy
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
                self._apply()
                self._timed(lambda: self.comm.all_reduce(self.params, op="avg",
                                                         compression=strategy))
                self._steps += 1
                return True
            active = self.comm.size
            if self._joining:
                self._clip_now = clip
                active = self._vote(True)
                self._updates_in_join += 1
            return self._finish(strategy, clip, active)
        finally:
            self._started = False
            self._bad.clear()
            self._close_window()

    def _finish(self, strategy, clip, active):
        """Average, check, unscale, hook, clip and apply (every rank)."""
        found, check_average = None, self.nonfinite is not None
        if strategy is not None and self.nonfinite is not None:
            # compressed: decide before any bucket is sent, so that a skipped
            # update leaves every bucket's error-feedback residual as it was
            found = self._nonfinite_counts(averaged=False)
            if any(found) and self.nonfinite == "warn":
                self._nonfinite_text(found, "; sending anyway", warn=True)
                check_average = False           # warned once
            if not any(found) or self.nonfinite == "warn":
                found = None                    # the average is checked below too
        if not (found and any(found)):
            try:
                self._reduce(strategy)
            except NonFiniteError as exc:       # a compression's check, on every rank alike
                if self.nonfinite != "skip":
                    raise
                found = list(exc.counts)
            if active != self.comm.size:    # join(): the mean over the ranks that contributed
                factor = self.comm.size / active
                for g in self._rule_args[1]:
                    g *= factor
            if found is None and check_average:
                found = self._nonfinite_counts(averaged=True)
        if found is not None and any(found):
            if self.nonfinite == "raise":
                raise _nonfinite.error(self._nonfinite_text(found, "; parameters not updated"),
                                       found)
            if self.nonfinite == "skip":
                self._skipped += 1
                if self.loss_scaler is not None:
                    self.loss_scaler.update(True)
                return False
            self._nonfinite_text(found, "; applied anyway", warn=True)
        if self.loss_scaler is not None:
            inv = 1.0 / self.loss_scaler.scale
            for g in self._rule_args[1]:
                g *= inv
        for fn in list(self._hooks):
            fn(self.grads)
        if clip is not None:
            self._clip(clip)
        self._apply()
        if self.loss_scaler is not None:
            self.loss_scaler.update(False)
        self._steps += 1
        return True

    def _nonfinite_text(self, found, tail, warn=False):
        text = ("rank %d: DistributedOptimizer.step: NaN or inf in the gradients (before the "
                "average: %s)%s" % (self.comm.rank, _nonfinite.ranks(found)
                                    or "none; the sum overflowed", tail))
        if warn:
            _nonfinite.warn(text)
        return text

    def _nonfinite_counts(self, averaged):
        """Per rank: the non-finite values of its gradients before the
        average (with ``averaged``, 1 when there were none but the average
        has some, as when the sum overflowed); the same list on every rank
        (one all-gather)."""
        mine = sum(int(c) for c in self._bad.values())
        if averaged and not mine and not all(_all_finite(g) for g in self._rule_args[1]):
            mine = -1
        counts = self._timed(self.comm.all_gather, np.array([mine], np.int64)).reshape(-1)
        overflow = bool((counts < 0).any())
        out = [max(int(c), 0) for c in counts]
        if overflow and not any(out):
            out = [1 if c < 0 else 0 for c in counts]
        return out

    def _clip(self, clip):
        """Scale the averaged gradients to global norm ``clip`` when above.
        The squared norm is summed here (BLAS dot products, float64 only
        where float32 overflows), then its maximum over the ranks is taken
        (one 8-byte all-reduce), so that every rank scales alike even where
        ranks' BLAS libraries round differently."""
        total = 0.0
        for g in self._rule_args[1]:
            xp = array_module(g)
            flat = g.reshape(-1)
            if flat.dtype.itemsize < 4:
                flat = flat.astype(xp.float32)
            part = float(xp.dot(flat, flat))
            if math.isinf(part) and flat.dtype != xp.float64:
                wide = flat.astype(xp.float64)
                part = float(xp.dot(wide, wide))
            total += part
        total = np.array([total], np.float64)
        self._timed(self.comm.all_reduce, total, "max")
        norm = math.sqrt(float(total[0]))
        self.last_grad_norm = norm
        coef = clip / (norm + 1e-6)
        if coef < 1:
            for g in self._rule_args[1]:
                g *= coef

    def _apply(self):
        """The rule, group by group, on the averaged gradients."""
        params, grads = self._rule_args
        if not isinstance(self.rule, Rule):
            self.rule(params, grads)
            return
        self._follow_rule()
        hypers = [self._hypers(k) for k in range(len(self.param_groups))]
        buffers = self.rule.buffers_for(params)
        t = self.rule.begin_step()
        for (lo, hi), hyper in zip(self._spans, hypers):
            self.rule.update(params[lo:hi], grads[lo:hi],
                             {k: v[lo:hi] for k, v in buffers.items()}, hyper, t)

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
        grads = interop.native_list(list(grads), rank=rank, what="grads")
        validation.check_arrays(grads, rank=rank, writeable=False, what="grads")
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

    # -- uneven inputs -----------------------------------------------------------------
    def _hyper_vector(self):
        """Every group's numeric hyperparameters, as float64s."""
        out = []
        if isinstance(self.rule, Rule):
            for g in self.param_groups:
                for k in self.rule.hyper:
                    out.extend(np.ravel(np.asarray(g[k], np.float64)).tolist())
        return out

    def _set_hyper_vector(self, values):
        values, at = list(values), 0
        if isinstance(self.rule, Rule):
            for g in self.param_groups:
                for k in self.rule.hyper:
                    old = g[k]
                    if isinstance(old, tuple):
                        g[k], at = tuple(values[at:at + len(old)]), at + len(old)
                    else:
                        g[k] = bool(values[at]) if isinstance(old, bool) else values[at]
                        at += 1

    def _vote(self, active):
        """join(): every rank says whether it brings gradients; returns how
        many do. A rank that has finished takes the hyperparameters of the
        lowest rank that has not (so every rank applies the same update)."""
        clip = self._clip_now if active and self._clip_now is not None else -1.0
        row = np.array([1.0 if active else 0.0, float(self._updates_in_join), clip]
                       + self._hyper_vector(), np.float64)
        table = self._timed(self.comm.all_gather, row).reshape(self.comm.size, -1)
        self._vote_table = table
        count = int(table[:, 0].sum())
        if not active and count:
            first = int(np.argmax(table[:, 0] > 0))
            self._clip_now = None if table[first, 2] < 0 else float(table[first, 2])
            self._set_hyper_vector(table[first, 3:])
        return count

    @contextlib.contextmanager
    def join(self):
        """Context for ranks with different numbers of batches (Horovod's
        and DDP's ``join``): inside it every update first counts the ranks
        that bring gradients (one small all-gather), and the average is the
        mean over those; a rank that leaves the block keeps taking part in
        the others' updates with no gradients of its own (applying the same
        update, so parameters stay identical) until every rank has left it.
        Then the hyperparameters and schedulers of the rank that took the
        most steps are copied to every rank. Inside it, :meth:`grad_ready`
        does not start all-reduces early.

        Raises:
            ArgumentError: compression other than none, fp16 or bf16, or
                leaving in the middle of an accumulation.
        """
        rank = self.comm.rank
        if self._joining:
            raise ArgumentError("rank %d: join(): already inside join()" % rank)
        if self._started or self._marked:
            raise ArgumentError("rank %d: join(): entered in the middle of a micro-batch "
                                "whose gradients were marked ready" % rank)
        if self.compression is not None and not isinstance(self.compression,
                                                           _compression.HalfPrecision):
            raise ArgumentError("rank %d: join(): only plain or half-precision averaging can "
                                "take ranks that have finished, not compression=%r"
                                % (rank, self.compression))
        self._joining, self._updates_in_join = True, 0
        try:
            yield self
            if self._micro:
                raise ArgumentError("rank %d: join(): left after %d of %d micro-batches of an "
                                    "update; finish the update first"
                                    % (rank, self._micro, self.accumulate))
            while True:
                try:
                    if not self._vote(False):
                        break
                    for g in self._rule_args[1]:
                        g.fill(0)
                    self._checked_strategy = self.compression
                    self._bad.clear()
                    self._finish(self.compression, self._clip_now, int(
                        self._vote_table[:, 0].sum()))
                finally:
                    self._close_window()
            table = self._vote_table
            root = int(np.argmax(table[:, 1]))
            self._sync_small_state(root)
        finally:
            self._joining = False

    def _sync_small_state(self, root):
        """Broadcast root's group hyperparameters and schedulers' state."""
        live = {k: v for k, v in self.live_state().items()
                if k.startswith("groups.") or k.startswith("scheduler.")}
        names = sorted(live)
        if not names:
            return
        copies = [np.array(live[k], copy=True) for k in names]
        self.comm.broadcast(copies, root=root)
        for name, value in zip(names, copies):
            live[name][...] = value
        self.loaded(live)
    # -- SINGA's DistOpt ------------------------------------------------------------
    def update(self, grads=None):
        """SINGA's ``backward_and_update``: :meth:`step` (the constructor's
        compression and clip_norm).

        Args:
            grads: as :meth:`step`'s.

        Returns:
            As :meth:`step`.
        """
        return self._step(grads, self.compression, self.clip_norm)

    def update_half(self, grads=None):
        """SINGA's ``backward_and_update_half``: the gradients are averaged in
        float16 (``compression="fp16"``).

        Args:
            grads: as :meth:`step`'s.

        Returns:
            As :meth:`step`.
        """
        return self._step(grads, _compression.resolve("fp16", self.comm.rank), self.clip_norm)

    def update_partial(self, grads=None, fraction=None):
        """SINGA's ``backward_and_partial_update``: each rank updates its
        parameters with its own gradients, then one rotating window of
        ``fraction`` of each parameter bucket is averaged over the ranks
        (:class:`~commlib.compression.Partial`; default: the constructor's
        Partial, else 0.1). Ranks' parameters differ between windows:
        average them all (``comm.all_reduce(params, op="avg")``) before
        evaluating or saving.

        Args:
            grads: as :meth:`step`'s.
            fraction: the share of each bucket averaged per call.

        Returns:
            As :meth:`step`.

        Raises:
            ArgumentError: a bad fraction, or a clip_norm set (partial updates
                cannot be clipped by a global norm).
        """
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
        step's gradients).

        Args:
            grads: as :meth:`step`'s.
            spars: the fraction (top-K) or the threshold.
            topK: top-K (True) or threshold (False).
            corr: error feedback.

        Returns:
            As :meth:`step`.
        """
        kind = TopK if topK else Threshold
        return self._step(grads, kind(spars, error_feedback=corr), self.clip_norm)

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
        and ``"skipped_steps"`` (0-d int64), ``"params.<i>"``,
        ``"rule.<name>"`` (the rule's :meth:`~commlib.optim.rules.Rule.state`,
        when it has one), ``"groups.<k>.<hyperparameter>"`` (float64; copies:
        :meth:`load_state_dict` sets the groups from them),
        ``"scheduler.<j>.<name>"`` for each scheduler made on this optimizer
        and ``"scaler.<name>"`` for the loss scaler. The arrays themselves,
        not copies, except the groups'."""
        out = {"steps": self._steps, "skipped_steps": self._skipped}
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
            for k, g in enumerate(self.param_groups):
                for name in self.rule.hyper:
                    out["groups.%d.%s" % (k, name)] = np.array(g[name], np.float64)
        elif hasattr(self.rule, "state"):
            out.update(("rule." + k, v) for k, v in self.rule.state(self.params).items())
        for j, sched in enumerate(self.schedulers):
            out.update(("scheduler.%d.%s" % (j, k), v) for k, v in sched.state_arrays().items())
        if self.loss_scaler is not None:
            out.update(("scaler." + k, v) for k, v in self.loss_scaler.state_arrays().items())
        return out

    def loaded(self, live):
        """After ``live`` (from :meth:`live_state`) was overwritten: set the
        groups' hyperparameters from it and the rule's step count."""
        if not isinstance(self.rule, Rule):
            return
        for k, g in enumerate(self.param_groups):
            for name in self.rule.hyper:
                key = "groups.%d.%s" % (k, name)
                if key not in live:
                    continue
                value, old = live[key], g[name]
                if isinstance(old, tuple):
                    g[name] = tuple(float(x) for x in value)
                elif isinstance(old, bool):
                    g[name] = bool(value)
                else:
                    g[name] = float(value)
        if "t" not in self.rule.counters():
            self.rule.step_count[...] = self._steps

    def state_dict(self):
        """numpy copies of :meth:`live_state` (not compression residuals);
        only between updates (not in the middle of an accumulation).

        Returns:
            ``{name: numpy array}``.

        Raises:
            ArgumentError: in the middle of an update.
        """
        if self._micro or self._marked:
            raise ArgumentError("rank %d: state_dict() in the middle of an update (after %d "
                                "of %d micro-batches); call it after a step that returned "
                                "True" % (self.comm.rank, self._micro, self.accumulate))
        return state.host_copies(self.live_state())

    def load_state_dict(self, state_dict, root=0):
        """Restore a :meth:`state_dict` on every rank (collective): only
        ``root``'s ``state_dict`` is used (the others may pass None). A
        state without ``groups.*`` or ``skipped_steps`` (an older one)
        leaves those as they are.

        Raises:
            ArgumentError: on every rank, when root's state does not fit.
        """
        state.load_state_dict(self, state_dict, root)

    def __repr__(self):
        return ("DistributedOptimizer(%r, %d params, compression=%r, accumulate=%d, "
                "overlap=%r, steps=%d)" % (self.rule, len(self.params), self.compression,
                                           self.accumulate, self.overlap, self.steps))

