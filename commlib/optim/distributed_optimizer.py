"""The training step of data-parallel training: average the gradients over
the ranks (overlapped with the backward pass when it marks gradients
ready), then apply an update rule per parameter group, with optional
gradient accumulation, loss scaling, clipping by the global norm, uneven
inputs (:meth:`DistributedOptimizer.join`) and SINGA's ``DistOpt`` update
variants.

:class:`DistributedOptimizer` holds the step itself: gradients marked
ready (their buckets started early, one
:class:`~commlib.overlap.BackwardReducer` per compression), the end of a
micro-batch, and on the last micro-batch of an update the average, the
non-finite check, unscaling, the gradient hooks, clipping and the rule; or
a partial update (the rule on each rank's own gradients, then a window of
the parameters averaged). Every all-reduce of an update carries what the
ranks must agree on (``agree=``: the rule and every group's
hyperparameters, the loss scale, the micro-batches of the update, the clip
norm), so that ranks that differ raise ConsistencyError instead of
diverging. What has a contract of its own lies in a module of its own:
:mod:`.param_groups` (groups and their hyperparameters), :mod:`.rule_runs`
(the rule over runs of back-to-back parameters), :mod:`.accumulation`
(micro-batches, ``no_sync``), :mod:`.nonfinite_guard` (NaN/inf checks,
the loss scaler's part), :mod:`.clipping`, :mod:`.join` (uneven inputs),
:mod:`.metering` (``stats``) and :mod:`.state` (checkpoints)."""
import numpy as np

from .. import compression as _compression
from ..compression import Partial, Threshold, TopK
from ..errors import ArgumentError, NonFiniteError
from ..overlap import BackwardReducer
from . import parameters, state
from .accumulation import Accumulation, check_accumulate, zeros_like
from .clipping import check_clip, clip_by_global_norm
from .join import Join, check_joinable
from .metering import CommMeter
from .nonfinite_guard import NONFINITE_MODES, NonFiniteGuard, check_nonfinite
from .param_groups import ParamGroups, checked_groups
from .rule_runs import RuleRuns
from .rules import Rule

__all__ = ["DistributedOptimizer", "NONFINITE_MODES"]

_DEFAULT = object()


def check_averaging(overlap, bucket_bytes, rank):
    """ArgumentError unless ``overlap`` is True, False or ``"auto"`` and
    ``bucket_bytes`` None or an int >= 1."""
    if not (isinstance(overlap, (bool, np.bool_)) or overlap == "auto"):
        raise ArgumentError("rank %d: overlap must be True, False or 'auto', got %r"
                            % (rank, overlap))
    if bucket_bytes is not None and (
            isinstance(bucket_bytes, (bool, np.bool_))
            or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1):
        raise ArgumentError("rank %d: bucket_bytes must be None or an int >= 1, got %r"
                            % (rank, bucket_bytes))


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

    The backward pass writes into :attr:`grads` (same shapes and dtypes as :attr:`params`),
    calls :meth:`grad_ready(i) <grad_ready>` when ``grads[i]`` is final (optional: it only
    moves communication earlier), then every rank calls :meth:`step` (collective). One update
    is: average over the ranks, then (each optional) the loss scaler's non-finite check and
    unscaling, the gradient hooks, clipping by the global norm, and the rule, group by group.

    Every collective method may also raise the errors of ``comm``'s collectives
    (:mod:`commlib.errors`): ClosedError (``comm`` closed, or left unusable by a failure),
    CollectiveTimeoutError (a peer hangs or never called it), PeerError (a peer left or died),
    ConsistencyError (the ranks called differently), TransportError (MPI or NCCL failed).

    Args:
        comm: a :class:`commlib.Communicator`.
        params: list of numpy or cupy arrays of floating dtypes (ideally
            :func:`~commlib.flat_arrays` views), updated in place and kept identical on every
            rank (start from :meth:`broadcast_parameters`); or, as ``torch.optim``'s, a list
            of parameter groups: dicts with ``"params"`` (a list of arrays) and any of the
            rule's hyperparameters (:attr:`Rule.hyper <commlib.optim.rules.Rule.hyper>`:
            ``lr``, ``momentum``, ``weight_decay``, ...; the rule's own values are the
            defaults), plus optionally ``"name"``.
        rule: :class:`~commlib.optim.SGD`, :class:`~commlib.optim.Adam`,
            :class:`~commlib.optim.AdamW`, :class:`~commlib.optim.LAMB`, or any callable
            ``rule(params, grads)`` that updates ``params`` in place (then one group without
            hyperparameters).
        compression: as ``comm.all_reduce``'s (``"fp16"``, ``"bf16"``, ``TopK``,
            ``Threshold``), applied to the gradients; a :class:`~commlib.compression.Partial`
            makes every step a partial update (see :meth:`update_partial`).
        bucket_bytes: the gradient buckets' size (default: the transport's).
        overlap: True: :meth:`grad_ready` starts a bucket's all-reduce as soon as its
            gradients are ready; ``"auto"`` (default): the same unless it cannot pay on this
            node (see :func:`commlib.overlap.early_start_pays`); False: every bucket starts in
            :meth:`step`. The result is bit-identical either way.
        accumulate: micro-batches per update (see also :meth:`no_sync`).
        clip_norm: None, or the default ``clip_norm`` of :meth:`step`.
        loss_scaler: a :class:`~commlib.optim.DynamicLossScaler`: the gradients are unscaled
            after the average, and a step whose averaged gradients hold NaN or inf on any
            rank is skipped on every rank (the scale backs off).
        nonfinite: None (default; no check: a NaN on one rank becomes NaN in every rank's
            parameters), ``"raise"`` (:class:`~commlib.errors.NonFiniteError` on every rank
            naming the ranks and counts, parameters untouched), ``"warn"`` (a RuntimeWarning,
            then the update) or ``"skip"`` (every rank skips the update; :meth:`step` returns
            False). With a loss scaler: ``"skip"``. Unless ``"skip"``, a compression's own
            check (``nonfinite="raise"``, its default) still raises. The check costs one small
            all-gather per update; with compression it is made before any bucket is sent (so a
            skipped update leaves the error-feedback residuals as they were), and
            :meth:`grad_ready` then starts nothing early.

    Raises:
        ArgumentError: a bad argument, naming it and the rank; a ``rule`` object given to
            another DistributedOptimizer before (it keeps that one's state).
        ArrayTypeError: ``params`` not writeable C-contiguous floating numpy or cupy arrays of
            one kind (DeviceMismatchError: cupy arrays on another GPU than ``comm``'s).
    """

    def __init__(self, comm, params, rule, *, compression=None, bucket_bytes=None,
                 overlap="auto", accumulate=1, clip_norm=None, loss_scaler=None,
                 nonfinite=None):
        rank = getattr(comm, "rank", None)
        if rank is None or not callable(getattr(comm, "all_reduce", None)):
            raise ArgumentError("DistributedOptimizer: comm must be a commlib.Communicator, "
                                "got %s" % type(comm).__name__)
        self.comm, self.rule = comm, rule
        self.param_groups, params = checked_groups(comm, params, rule)
        check_accumulate(accumulate, rank)
        check_averaging(overlap, bucket_bytes, rank)
        check_nonfinite(nonfinite, loss_scaler, rank)
        self.params = params
        self.compression = _compression.resolve(compression, rank)
        self.bucket_bytes = None if bucket_bytes is None else int(bucket_bytes)
        self.overlap = overlap if overlap == "auto" else bool(overlap)
        self.accumulate = int(accumulate)
        self.clip_norm = check_clip(clip_norm, rank)
        self.loss_scaler = loss_scaler
        self.nonfinite = "skip" if loss_scaler is not None else nonfinite
        self.grads = zeros_like(params)
        self.schedulers = []          # schedulers whose state checkpoints keep
        self._groups = ParamGroups(rule, self.param_groups, rank)
        self._rule_runs = RuleRuns(rule, self.param_groups, params, self.grads)
        self._runs = self._rule_runs.runs             # parameter indices the rule sees as one
        self._meter = CommMeter(comm)
        self._reducers = {}           # strategy name -> BackwardReducer of grads
        self._accumulation = Accumulation(params, self.grads, self.accumulate, rank)
        self._guard = NonFiniteGuard(comm, self._meter, self._rule_runs.fused_grads,
                                     self.nonfinite, loss_scaler)
        self._join = Join(comm, self._meter, self._groups, self._accumulation)
        self._hooks = []              # gradient hooks, in the order of registration
        self._started = False         # grad_ready started this update's all-reduce
        self._agreed = None           # the agree= of the buckets grad_ready started
        self._steps = np.zeros((), np.int64)          # updates applied (in the state)
        self._last_grad_norm = None
        if isinstance(rule, Rule):
            rule.bind(self, rank)     # last: a rejected construction leaves it free

    # -- hyperparameters and statistics ------------------------------------------
    @property
    def lr(self):
        """The learning rate of the first parameter group; setting it sets every group's
        (between steps).

        Raises:
            ArgumentError: on setting: a rule without a learning rate, or a bad value.
            AttributeError: on reading: a callable rule without an ``lr`` attribute.
        """
        return self._groups.lr

    @lr.setter
    def lr(self, value):
        self._groups.lr = value

    @property
    def steps(self):
        """Updates applied so far (skipped ones not counted)."""
        return int(self._steps)

    @property
    def skipped_steps(self):
        """Updates skipped for NaN or inf gradients (``nonfinite="skip"`` or a loss scaler)."""
        return int(self._guard.skipped)

    @property
    def last_grad_norm(self):
        """The global norm of the averaged gradients before clipping, in the last update that
        clipped (None before one)."""
        return self._last_grad_norm

    @property
    def stats(self):
        """``{"bytes_sent", "comm_seconds", "steps"}``: payload bytes this rank handed to its
        transports from the first collective of an update to its end (``comm.stats.bytes_sent``,
        so also any collective issued in between), seconds blocked in the optimizer's
        collectives, and updates applied."""
        return {"bytes_sent": self._meter.bytes, "comm_seconds": self._meter.seconds,
                "steps": self.steps}

    # -- loop helpers ----------------------------------------------------------------
    def zero_grad(self):
        """Set every gradient in :attr:`grads` to 0 (for a backward pass that adds into them).
        Not collective; returns None."""
        for g in self._rule_runs.fused_grads:
            g.fill(0)

    def no_sync(self):
        """Context in which :meth:`step` only accumulates (returns False, no communication):
        the first step after it averages the mean of all micro-batches since the last update,
        like DDP's ``no_sync`` decided at run time (with ``accumulate=N`` also, whichever
        comes later). Every rank must use it alike; as DDP's, it wraps the backward pass too.

        Returns:
            A context manager (yielding this optimizer).

        Raises:
            ArgumentError: entered after :meth:`grad_ready` marked gradients of a micro-batch
                that ends an update, or left before the :meth:`step` of one marked inside it.
        """
        return self._accumulation.no_sync(self)

    def register_hook(self, fn):
        """Register a gradient hook, called in every update after the average (and the loss
        scaler's unscaling), before clipping and the rule.

        Args:
            fn: called as ``fn(grads)``; may change the arrays in place, and must do the
                same on every rank.

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
    def grad_ready(self, i):
        """Mark ``grads[i]`` final for this micro-batch; on the last micro-batch of an update
        with ``overlap``, the all-reduce of its bucket starts once the bucket is complete (and
        the buckets before it have started): then it is collective.

        Args:
            i: the index of the gradient (an int), each once per micro-batch.

        Raises:
            ArgumentError: ``i`` out of range or marked twice.
        """
        accumulation, compression = self._accumulation, self.compression
        i = accumulation.mark(i)
        self._prepare(i, compression)
        if (accumulation.last() and self.overlap and not self._join.joining
                and not (self._guard.mode is not None and compression is not None)
                and not isinstance(compression, Partial)):
            if self._agreed is None:
                self._agreed = self._agreement(self._groups.checked(), accumulation.micro + 1)
            self._started = True
            reducer = self._reducer_for(compression)
            reducer.agree = self._agreed
            self._meter.timed(reducer.ready, i)

    def step(self, grads=None, clip_norm=_DEFAULT):
        """Finish this micro-batch (collective).

        Args:
            grads: optional list like ``params``, copied into :attr:`grads` first.
            clip_norm: scale the averaged gradients by ``clip_norm / (norm + 1e-6)`` when
                their global L2 norm (over every parameter; the same on every rank) exceeds
                it, like ``torch.nn.utils.clip_grad_norm_``; None: no clipping; default: the
                constructor's. The norm before clipping is :attr:`last_grad_norm`.

        Returns:
            True when an update was applied; False before the last micro-batch of an update
            (only accumulated), and when the update was skipped for NaN or inf gradients.

        Raises:
            ArgumentError: bad ``grads`` (or given after :meth:`grad_ready`) or ``clip_norm``;
                a clip_norm with a Partial compression; a group's bad hyperparameter.
            ArrayTypeError: ``grads`` that are no arrays.
            ConsistencyError: on every rank, naming the ranks and both values, when their
                rule, hyperparameters, loss scale, nonfinite, micro-batches or clip_norm differ
                (every all-reduce of an update carries them: ``agree=``).
            NonFiniteError: on every rank, with ``nonfinite="raise"``; also, unless
                ``nonfinite="skip"``, from a compression whose own ``nonfinite`` is
                ``"raise"`` (its default).
        """
        clip = (self.clip_norm if clip_norm is _DEFAULT
                else check_clip(clip_norm, self.comm.rank))
        return self._step(grads, self.compression, clip)

    # SINGA's DistOpt: each variant is one step with a strategy of its own
    def update(self, grads=None):
        """SINGA's ``backward_and_update``: :meth:`step` (the constructor's
        compression and clip_norm).

        Args:
            grads: as :meth:`step`'s (None: the backward pass wrote into
                ``grads``).

        Returns:
            As :meth:`step`: True when an update was applied.

        Raises:
            ArgumentError: as :meth:`step`'s.
            ArrayTypeError: as :meth:`step`'s.
            NonFiniteError: as :meth:`step`'s.
        """
        return self._step(grads, self.compression, self.clip_norm)

    def update_half(self, grads=None):
        """SINGA's ``backward_and_update_half``: the gradients are averaged in
        float16 (``compression="fp16"``), clipped to the constructor's
        clip_norm.

        Args:
            grads: as :meth:`step`'s.

        Returns:
            As :meth:`step`.

        Raises:
            ArgumentError: as :meth:`step`'s; also after :meth:`grad_ready`
                started this update's all-reduce with another compression.
            ArrayTypeError: as :meth:`step`'s.
            NonFiniteError: as :meth:`step`'s; fp16's own check raises on
                NaN or inf unless ``nonfinite="skip"``.
        """
        fp16 = _compression.resolve("fp16", self.comm.rank)
        return self._step(grads, fp16, self.clip_norm)

    def update_partial(self, grads=None, fraction=None):
        """SINGA's ``backward_and_partial_update``: each rank updates its
        parameters with its own gradients, then one rotating window of
        ``fraction`` of each parameter bucket is averaged over the ranks
        (:class:`~commlib.compression.Partial`; default: the constructor's
        Partial, else 0.1). Ranks' parameters differ between windows:
        average them all (``comm.all_reduce(params, op="avg")``) before
        evaluating or saving. Partial updates cannot be clipped by a global
        norm (each rank applies its own gradients): with a clip_norm set in
        the constructor it raises, as :meth:`step` with a Partial
        compression does; the ``nonfinite`` check is not made.

        Args:
            grads: as :meth:`step`'s.
            fraction: the share of each bucket averaged per call, a number in
                (0, 1]; None: the constructor's Partial's, else 0.1.

        Returns:
            As :meth:`step` (True on the last micro-batch of an update).

        Raises:
            ArgumentError: a bad fraction; bad ``grads`` (as :meth:`step`'s);
                a clip_norm set in the constructor; inside :meth:`join`; after
                :meth:`grad_ready` started this update's all-reduce with another
                compression.
            ArrayTypeError: as :meth:`step`'s.
        """
        if fraction is None:
            strategy = (self.compression if isinstance(self.compression, Partial)
                        else Partial(0.1))
        else:
            strategy = Partial(fraction)
        return self._step(grads, strategy, self.clip_norm)

    def update_sparse(self, grads, spars, topK=True, corr=True):
        """SINGA's ``backward_and_sparse_update``: with ``topK`` the
        ``spars`` fraction of largest-magnitude gradients of each bucket
        travel (:class:`~commlib.compression.TopK`), else those with
        magnitude above ``spars`` (:class:`~commlib.compression.Threshold`);
        ``corr``: error feedback (what was not sent is added to the next
        step's gradients).

        Args:
            grads: as :meth:`step`'s.
            spars: the fraction (top-K; in (0, 1]) or the threshold (a finite
                number >= 0).
            topK: top-K (True) or threshold (False).
            corr: error feedback.

        Returns:
            As :meth:`step`.

        Raises:
            ArgumentError: a bad ``spars``; bad ``grads`` (as :meth:`step`'s);
                inside :meth:`join`; after :meth:`grad_ready` started this
                update's all-reduce with another compression.
            ArrayTypeError: as :meth:`step`'s.
            NonFiniteError: as :meth:`step`'s; the sparsifier's own check
                raises on NaN or inf unless ``nonfinite="skip"``.
        """
        kind = TopK if topK else Threshold
        return self._step(grads, kind(spars, error_feedback=corr), self.clip_norm)

    def _step(self, grads, strategy, clip):
        """Finish this micro-batch, averaging with ``strategy`` and clipping
        to ``clip``; True when an update was applied."""
        rank, accumulation = self.comm.rank, self._accumulation
        if self._started and strategy is not self.compression:
            raise ArgumentError(
                "rank %d: grad_ready() started this update's all-reduce with compression=%r; "
                "finish it with step()" % (rank, self.compression))
        if clip is not None and isinstance(strategy, Partial):
            raise ArgumentError("rank %d: clip_norm: a partial update applies each rank's own "
                                "gradients, which have no global norm; use clip_norm=None"
                                % rank)
        if self._join.joining:
            check_joinable(strategy, rank)
        if grads is not None:
            accumulation.take(grads)
        for i in range(len(self.grads)):
            if i not in accumulation.marked:
                self._prepare(i, strategy)
        micro = accumulation.micro + 1
        if not accumulation.end_micro_batch():
            return False
        try:
            if isinstance(strategy, Partial):
                return self._partial_update(strategy, micro)
            active = self.comm.size
            if self._join.joining:
                self._join.clip = clip
                active = self._join.vote(True)
                self._join.updates += 1
            return self._finish(strategy, clip, active, micro)
        finally:
            self._started = False
            self._agreed = None
            self._guard.bad.clear()
            self._meter.close()

    def _agreement(self, hypers, micro):
        """What the ranks must agree on in this update (``agree=`` of its
        all-reduces): the rule and every group's hyperparameters
        (``hypers``, validated), the loss scale (or ``nonfinite=``, which
        decides alike what a NaN does), and (but inside ``join()``, where
        ranks that have finished bring none) the update's number of
        micro-batches ``micro`` when more than one."""
        agree = self._groups.agreement(hypers)
        scaler = self._guard.loss_scaler
        if scaler is not None:
            agree += (("loss scale", scaler.scale),)
        elif self._guard.mode is not None:
            agree += (("nonfinite", self._guard.mode),)
        if micro > 1 and not self._join.joining:
            agree += (("micro-batches", int(micro)),)
        return agree

    def _prepare(self, i, strategy):
        """grads[i] is final for this micro-batch (see
        :meth:`Accumulation.prepare <commlib.optim.accumulation.Accumulation.prepare>`);
        its non-finite values are counted when it is the update's mean."""
        if self._accumulation.prepare(i):
            self._guard.note(i, self.grads[i], strategy)

    def _partial_update(self, strategy, micro):
        """The rule on this rank's gradients, then ``strategy``'s window of
        the parameters averaged (``micro``: the update's micro-batches)."""
        hypers = self._groups.checked()
        agree = self._agreement(hypers, micro)
        self._rule_runs.apply(hypers)
        self._meter.timed(lambda: self.comm.all_reduce(self.params, op="avg",
                                                       compression=strategy, agree=agree))
        self._steps += 1
        return True

    def _idle_update(self, strategy, clip, active):
        """``join()``: an update of the ``active`` ranks that this rank,
        having left, takes part in with zero gradients."""
        for g in self._rule_runs.fused_grads:
            g.fill(0)
        self._guard.bad.clear()
        self._finish(strategy, clip, active, 1)

    def _finish(self, strategy, clip, active, micro):
        """Average, check, unscale, hook, clip and apply (every rank;
        ``micro``: the update's micro-batches). The hyperparameters are
        checked first; when they changed since ``grad_ready`` started the
        update's all-reduce, they are compared again after the average (by
        the clipping's all-reduce, or by one of a single number)."""
        hypers = self._groups.checked()
        agree = self._agreement(hypers, micro)
        found, check_average = self._guard.before_send(strategy)
        if not (found and any(found)):
            found = self._average(strategy, active, found, check_average, agree)
        if self._agreed is not None and agree != self._agreed and clip is None:
            check = np.zeros(1)
            self._meter.timed(lambda: self.comm.all_reduce(check, op="max", agree=agree))
        if found is not None and any(found) and not self._guard.proceed(found):
            return False
        self._guard.unscale()
        for fn in list(self._hooks):            # a hook may remove itself
            fn(self.grads)
        if clip is not None:
            self._last_grad_norm = clip_by_global_norm(
                self._rule_runs.fused_grads, clip, self.comm, self._meter,
                agree=agree + (("clip_norm", clip),))
        self._rule_runs.apply(hypers)
        self._guard.taken()
        self._steps += 1
        return True

    def _average(self, strategy, active, found, check_average, agree):
        """Average with ``strategy`` as the mean over ``active`` ranks,
        finishing the buckets :meth:`grad_ready` started; the all-reduces
        carry ``agree``. Returns the non-finite counts found (or
        ``found``)."""
        reducer = self._reducer_for(strategy)
        reducer.agree = agree
        try:
            self._meter.timed(reducer.wait)
        except NonFiniteError as exc:       # a compression's check, on every rank alike
            if self._guard.mode != "skip":
                raise
            found = list(exc.counts)
        if active != self.comm.size:    # join(): the mean over the ranks that contributed
            factor = self.comm.size / active
            for g in self._rule_runs.fused_grads:
                g *= factor
        if found is None and check_average:
            found = self._guard.counts(averaged=True)
        return found

    def _reducer_for(self, strategy):
        """The BackwardReducer that averages the gradients with ``strategy``
        (None: plain), made at first use."""
        name = None if strategy is None else strategy.name
        found = self._reducers.get(name)
        if found is None:
            found = self._reducers[name] = BackwardReducer(
                self.comm, self.grads, bucket_bytes=self.bucket_bytes, op="avg",
                compression=strategy, overlap=self.overlap or False)
        return found

    # -- uneven inputs -----------------------------------------------------------------
    def join(self):
        """Context for ranks with different numbers of batches (Horovod's and DDP's ``join``):
        inside it every update first counts the ranks that bring gradients (one small
        all-gather), and the average is the mean over those; a rank that leaves the block
        keeps taking part in the others' updates with no gradients of its own (applying the
        same update, so parameters stay identical) until every rank has left it. Then the
        hyperparameters and schedulers of the rank that took the most steps are copied to
        every rank. Inside it, :meth:`grad_ready` does not start all-reduces early.

        Returns:
            A context manager (yielding this optimizer; collective when the block ends).

        Raises:
            ArgumentError: on entering: compression other than none, fp16 or bf16, already
                inside join(), or gradients marked ready in this micro-batch; on leaving in
                the middle of an accumulation.
        """
        return self._join.block(self, self._idle_update)

    # -- parameters and checkpoints -------------------------------------------------
    def broadcast_parameters(self, root=0):
        """Copy ``root``'s parameters into every rank's (collective).

        Args:
            root: the rank whose parameters every rank takes.

        Returns:
            :attr:`params`.

        Raises:
            ArgumentError: ``root`` out of range.
        """
        try:
            return self._meter.timed(parameters.broadcast_parameters, self.comm, self.params,
                                     root)
        finally:
            self._meter.close()

    def check_parameters(self):
        """Check that every rank holds the same parameters (collective; see
        :func:`commlib.optim.check_parameters`).

        Raises:
            ConsistencyError: on every rank, naming the ranks whose parameters differ.
        """
        parameters.check_parameters(self.comm, self.params)

    def live_state(self):
        """The arrays that make up the training state, by name: ``"steps"``
        and ``"skipped_steps"`` (0-d int64), ``"params.<i>"``,
        ``"rule.<name>"`` (the rule's :meth:`~commlib.optim.rules.Rule.state`,
        when it has one), ``"groups.sizes"`` (each group's number of arrays,
        which a state loaded must match), ``"groups.<k>.<hyperparameter>"``
        (float64; copies: :meth:`load_state_dict` sets the groups from them),
        ``"scheduler.<j>.<name>"`` for each scheduler made on this optimizer
        and ``"scaler.<name>"`` for the loss scaler. Not collective.

        Returns:
            ``{name: array}``: the arrays themselves, not copies, except the
            groups'.
        """
        out = {"steps": self._steps, "skipped_steps": self._guard.skipped}
        out.update(("params.%d" % i, p) for i, p in enumerate(self.params))
        out.update(self._rule_runs.state_arrays())
        out.update(self._groups.state_arrays())
        for j, sched in enumerate(self.schedulers):
            out.update(("scheduler.%d.%s" % (j, k), v) for k, v in sched.state_arrays().items())
        if self.loss_scaler is not None:
            out.update(("scaler." + k, v) for k, v in self.loss_scaler.state_arrays().items())
        return out

    def loaded(self, live):
        """After ``live`` (from :meth:`live_state`) was overwritten: set the
        groups' hyperparameters from it and the rule's step count.

        Args:
            live: the dict :meth:`live_state` returned, its arrays
                overwritten (the ``groups.*`` ones it has are read).
        """
        self._groups.load(live)
        self._rule_runs.loaded(self._steps)

    def state_dict(self):
        """numpy copies of :meth:`live_state` (not compression residuals);
        only between updates (not in the middle of an accumulation). Not
        collective.

        Returns:
            ``{name: numpy array}``.

        Raises:
            ArgumentError: in the middle of an update.
        """
        self._accumulation.check_between_updates()
        return state.host_copies(self.live_state())

    def load_state_dict(self, state_dict, root=0):
        """Restore a :meth:`state_dict` on every rank (collective): only
        ``root``'s ``state_dict`` is used (the others may pass None). A
        state without ``groups.*`` or ``skipped_steps`` (an older one)
        leaves those as they are.

        Args:
            state_dict: ``{name: array}`` from :meth:`state_dict` (or
                :func:`commlib.optim.load`'s file), used on ``root`` only.
            root: the rank whose ``state_dict`` every rank takes.

        Raises:
            ArgumentError: on every rank (``culprits``: ``root``), naming what
                differs, when root's state does not fit (not a dict; other
                parameter groups, as ``torch.optim``'s checks: their number or
                sizes; names, shapes or dtypes); nothing is changed.
        """
        state.load_state_dict(self, state_dict, root)

    def __repr__(self):
        return ("DistributedOptimizer(%r, %d params, compression=%r, accumulate=%d, "
                "overlap=%r, steps=%d)" % (self.rule, len(self.params), self.compression,
                                           self.accumulate, self.overlap, self.steps))
