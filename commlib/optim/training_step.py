"""One update of a DistributedOptimizer, from its parts: gradients marked
ready (their buckets started early), the end of a micro-batch, and on the
last micro-batch of an update the average, the non-finite check,
unscaling, the gradient hooks, clipping by the global norm and the rule;
or a partial update (the rule on each rank's own gradients, then a window
of the parameters averaged). Every all-reduce of an update carries what the
ranks must agree on (``agree=``: the rule and every group's
hyperparameters, the loss scale, the micro-batches of the update, the
clip norm), so that ranks that differ raise ConsistencyError instead of
diverging."""
import numpy as np

from ..compression import Partial
from ..errors import ArgumentError, NonFiniteError
from .clipping import clip_by_global_norm
from .join import check_joinable


class TrainingStep:
    """The steps of an optimizer.

    Args:
        comm: the communicator.
        compression: the optimizer's compression (the one ``grad_ready``
            starts buckets with).
        overlap: whether ``grad_ready`` may start buckets (True or ``"auto"``).
        meter: a :class:`~commlib.optim.metering.CommMeter`.
        accumulation: an :class:`~commlib.optim.accumulation.Accumulation`.
        averaging: a :class:`~commlib.optim.averaging.GradientAveraging`.
        guard: a :class:`~commlib.optim.nonfinite_guard.NonFiniteGuard`.
        hooks: a :class:`~commlib.optim.hooks.GradientHooks`.
        groups: a :class:`~commlib.optim.param_groups.ParamGroups`.
        rule_runs: a :class:`~commlib.optim.rule_runs.RuleRuns`.
        join: a :class:`~commlib.optim.join.Join`.
    """

    def __init__(self, comm, *, compression, overlap, meter, accumulation, averaging, guard,
                 hooks, groups, rule_runs, join):
        self.comm, self.compression, self.overlap, self.meter = comm, compression, overlap, meter
        self.accumulation, self.averaging, self.guard = accumulation, averaging, guard
        self.hooks, self.groups, self.rule_runs, self.join = hooks, groups, rule_runs, join
        self.started = False        # grad_ready started this update's all-reduce
        self.agreed = None          # the agree= of the buckets grad_ready started
        self.steps = np.zeros((), np.int64)
        self.last_grad_norm = None

    def agreement(self, hypers, micro):
        """What the ranks must agree on in this update (``agree=`` of its
        all-reduces): the rule and every group's hyperparameters
        (``hypers``, validated), the loss scale (or ``nonfinite=``, which
        decides alike what a NaN does), and (but inside ``join()``, where
        ranks that have finished bring none) the update's number of
        micro-batches ``micro`` when more than one."""
        agree = self.groups.agreement(hypers)
        scaler = self.guard.loss_scaler
        if scaler is not None:
            agree += (("loss scale", scaler.scale),)
        elif self.guard.mode is not None:
            agree += (("nonfinite", self.guard.mode),)
        if micro > 1 and not self.join.joining:
            agree += (("micro-batches", int(micro)),)
        return agree

    def busy(self):
        """Whether this micro-batch has gradients marked ready."""
        return self.started or bool(self.accumulation.marked)

    def prepare(self, i, strategy):
        """grads[i] is final for this micro-batch (see
        :meth:`Accumulation.prepare`); counted when it is the update's mean."""
        if self.accumulation.prepare(i):
            self.guard.note(i, self.accumulation.grads[i], strategy)

    def grad_ready(self, i):
        """``grads[i]`` is final; on the last micro-batch, with overlap and
        nothing against it, its bucket starts."""
        i = self.accumulation.mark(i)
        compression = self.compression
        self.prepare(i, compression)
        if (self.accumulation.last() and self.overlap and not self.join.joining
                and not (self.guard.mode is not None and compression is not None)
                and not isinstance(compression, Partial)):
            if self.agreed is None:
                self.agreed = self.agreement(self.groups.checked(), self.accumulation.micro + 1)
            self.started = True
            self.averaging.start(i, compression, self.agreed)

    def step(self, grads, strategy, clip=None):
        """Finish this micro-batch, averaging with ``strategy`` and clipping
        to ``clip``; True when an update was applied."""
        rank = self.comm.rank
        if self.started and strategy is not self.compression:
            raise ArgumentError(
                "rank %d: grad_ready() started this update's all-reduce with compression=%r; "
                "finish it with step()" % (rank, self.compression))
        if clip is not None and isinstance(strategy, Partial):
            raise ArgumentError("rank %d: clip_norm: a partial update applies each rank's own "
                                "gradients, which have no global norm; use clip_norm=None"
                                % rank)
        if self.join.joining:
            check_joinable(strategy, rank)
        if grads is not None:
            self.accumulation.take(grads)
        for i in range(len(self.accumulation.grads)):
            if i not in self.accumulation.marked:
                self.prepare(i, strategy)
        micro = self.accumulation.micro + 1
        if not self.accumulation.end_micro_batch():
            return False
        try:
            if isinstance(strategy, Partial):
                return self.partial_update(strategy, micro)
            active = self.comm.size
            if self.join.joining:
                self.join.clip = clip
                active = self.join.vote(True)
                self.join.updates += 1
            return self.finish(strategy, clip, active, micro)
        finally:
            self.started = False
            self.agreed = None
            self.guard.bad.clear()
            self.meter.close()

    def partial_update(self, strategy, micro):
        """The rule on this rank's gradients, then ``strategy``'s window of
        the parameters averaged (``micro``: the update's micro-batches)."""
        params = self.rule_runs.params
        hypers = self.groups.checked()
        agree = self.agreement(hypers, micro)
        self.rule_runs.apply(hypers)
        self.meter.timed(lambda: self.comm.all_reduce(params, op="avg", compression=strategy,
                                                      agree=agree))
        self.steps += 1
        return True

    def idle_update(self, strategy, clip, active):
        """``join()``: an update of the ``active`` ranks that this rank,
        having left, takes part in with zero gradients."""
        for g in self.rule_runs.fused_grads:
            g.fill(0)
        self.guard.bad.clear()
        self.finish(strategy, clip, active, 1)

    def finish(self, strategy, clip, active, micro):
        """Average, check, unscale, hook, clip and apply (every rank;
        ``micro``: the update's micro-batches). The hyperparameters are
        checked first; when they changed since ``grad_ready`` started the
        update's all-reduce, they are compared again after the average (by
        the clipping's all-reduce, or by one of a single number)."""
        hypers = self.groups.checked()
        agree = self.agreement(hypers, micro)
        found, check_average = self.guard.before_send(strategy)
        if not (found and any(found)):
            found = self.average(strategy, active, found, check_average, agree)
        if self.agreed is not None and agree != self.agreed and clip is None:
            check = np.zeros(1)
            self.meter.timed(lambda: self.comm.all_reduce(check, op="max", agree=agree))
        if found is not None and any(found) and not self.guard.proceed(found):
            return False
        self.guard.unscale()
        self.hooks.run(self.accumulation.grads)
        if clip is not None:
            self.last_grad_norm = clip_by_global_norm(
                self.rule_runs.fused_grads, clip, self.comm, self.meter,
                agree=agree + (("clip_norm", clip),))
        self.rule_runs.apply(hypers)
        self.guard.taken()
        self.steps += 1
        return True

    def average(self, strategy, active, found, check_average, agree):
        """Average with ``strategy`` as the mean over ``active`` ranks, the
        all-reduces carrying ``agree``; returns the non-finite counts found
        (or ``found``)."""
        try:
            self.averaging.average(strategy, agree)
        except NonFiniteError as exc:       # a compression's check, on every rank alike
            if self.guard.mode != "skip":
                raise
            found = list(exc.counts)
        if active != self.comm.size:    # join(): the mean over the ranks that contributed
            factor = self.comm.size / active
            for g in self.rule_runs.fused_grads:
                g *= factor
        if found is None and check_average:
            found = self.guard.counts(averaged=True)
        return found
