"""The training step of data-parallel training: average the gradients over
the ranks (overlapped with the backward pass when it marks gradients
ready), then apply an update rule per parameter group, with optional
gradient accumulation, loss scaling, clipping by the global norm, uneven
inputs (:meth:`DistributedOptimizer.join`) and SINGA's ``DistOpt`` update
variants.

:class:`DistributedOptimizer` is a facade over parts, each in a module of
its own: :mod:`.param_groups` (groups and their hyperparameters),
:mod:`.rule_runs` (the rule over runs of parameters), :mod:`.accumulation`
(micro-batches, ``no_sync``), :mod:`.averaging` (the reducers),
:mod:`.nonfinite_guard` (NaN/inf checks, the loss scaler), :mod:`.hooks`,
:mod:`.clipping`, :mod:`.join` (uneven inputs), :mod:`.metering` (``stats``),
:mod:`.singa_updates` (the ``update_*`` variants), :mod:`.state` (the
training state, state dicts) and :mod:`.training_step` (one update, put
together from them)."""
import functools

from .. import compression as _compression
from ..errors import ArgumentError
from . import parameters
from .accumulation import Accumulation, check_accumulate, zeros_like
from .averaging import GradientAveraging, check_averaging
from .clipping import check_clip
from .hooks import GradientHooks
from .join import Join
from .metering import CommMeter
from .nonfinite_guard import NONFINITE_MODES, NonFiniteGuard, check_nonfinite
from .param_groups import ParamGroups, checked_groups
from .rule_runs import RuleRuns
from .rules import Rule
from .singa_updates import SingaUpdates
from .state import TrainingState
from .training_step import TrainingStep

__all__ = ["DistributedOptimizer", "NONFINITE_MODES"]

_DEFAULT = object()


def _forward(part, method):
    """A method of the optimizer that is ``method`` (its name, signature and
    docstring) called on the part the optimizer holds in attribute ``part``."""
    @functools.wraps(method)
    def forwarded(self, *args, **kwargs):
        return method(getattr(self, part), *args, **kwargs)
    return forwarded


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
        self._make_parts()
        if isinstance(rule, Rule):
            rule.bind(self, rank)     # last: a rejected construction leaves it free

    def _make_parts(self):
        """The parts the optimizer hands its work to."""
        comm, rank = self.comm, self.comm.rank
        self._groups = ParamGroups(self.rule, self.param_groups, rank)
        self._rule_runs = RuleRuns(self.rule, self.param_groups, self.params, self.grads)
        self._runs = self._rule_runs.runs             # parameter indices the rule sees as one
        self._meter = CommMeter(comm)
        self._averaging = GradientAveraging(comm, self.grads, self._meter,
                                            bucket_bytes=self.bucket_bytes, overlap=self.overlap)
        self._reducers = self._averaging.reducers     # strategy name -> BackwardReducer
        self._accumulation = Accumulation(self.params, self.grads, self.accumulate, rank)
        self._guard = NonFiniteGuard(comm, self._meter, self._rule_runs.fused_grads,
                                     self.nonfinite, self.loss_scaler)
        self._hooks = GradientHooks(rank)
        self._join = Join(comm, self._meter, self._groups)
        self._training = TrainingStep(
            comm, compression=self.compression, overlap=self.overlap, meter=self._meter,
            accumulation=self._accumulation, averaging=self._averaging, guard=self._guard,
            hooks=self._hooks, groups=self._groups, rule_runs=self._rule_runs, join=self._join)
        self._singa = SingaUpdates(self._training, compression=self.compression,
                                   clip_norm=self.clip_norm, rank=rank)
        self._state = TrainingState(
            comm, params=self.params, steps=self._training.steps, skipped=self._guard.skipped,
            rule_runs=self._rule_runs, groups=self._groups, schedulers=self.schedulers,
            loss_scaler=self.loss_scaler, accumulation=self._accumulation)

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
        return int(self._training.steps)

    @property
    def skipped_steps(self):
        """Updates skipped for NaN or inf gradients (``nonfinite="skip"`` or a loss scaler)."""
        return int(self._guard.skipped)

    @property
    def last_grad_norm(self):
        """The global norm of the averaged gradients before clipping, in the last update that
        clipped (None before one)."""
        return self._training.last_grad_norm

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
        return self._hooks.register(fn)

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
        self._training.grad_ready(i)

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
        return self._training.step(grads, self.compression, clip)

    def _reducer_for(self, strategy):
        """The BackwardReducer that averages the gradients with ``strategy``."""
        return self._averaging.reducer_for(strategy)

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
        return self._join.block(self, training=self._training, compression=self.compression,
                                live_state=self.live_state, loaded=self.loaded)

    # -- SINGA's DistOpt: singa_updates.SingaUpdates's -------------------------------
    update = _forward("_singa", SingaUpdates.update)
    update_half = _forward("_singa", SingaUpdates.update_half)
    update_partial = _forward("_singa", SingaUpdates.update_partial)
    update_sparse = _forward("_singa", SingaUpdates.update_sparse)

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

    # the training state and checkpoints: state.TrainingState's
    live_state = _forward("_state", TrainingState.live_state)
    loaded = _forward("_state", TrainingState.loaded)
    state_dict = _forward("_state", TrainingState.state_dict)
    load_state_dict = _forward("_state", TrainingState.load_state_dict)

    def __repr__(self):
        return ("DistributedOptimizer(%r, %d params, compression=%r, accumulate=%d, "
                "overlap=%r, steps=%d)" % (self.rule, len(self.params), self.compression,
                                           self.accumulate, self.overlap, self.steps))


