"""How a DistributedOptimizer applies its rule: a built-in elementwise rule
updates each run of parameters that lie back to back in one buffer
(:func:`~commlib.flat_arrays` views) as one array, the same bits in fewer
calls; runs never cross parameter groups. Also the rule's state, cut back
from the runs into one array per parameter."""
from ..collective.bucketing import span
from ..ops.arrays import address, array_module
from .rules import Rule


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


def layout(rule, groups, params, grads):
    """``(runs, fused params, fused grads, spans)``: the runs (lists of
    parameter indices; one each unless ``rule`` is an elementwise Rule),
    the arrays that stand for them, and each group's ``(first, end)`` run."""
    fuse = isinstance(rule, Rule) and rule.elementwise
    runs, spans, offset = [], [], 0
    for g in groups:
        indices = list(range(offset, offset + len(g["params"])))
        offset += len(indices)
        mine = ([[indices[j] for j in run] for run in _runs([params[i] for i in indices])]
                if fuse else [[i] for i in indices])
        spans.append((len(runs), len(runs) + len(mine)))
        runs.extend(mine)
    fused = ([_fused(params, run) for run in runs], [_fused(grads, run) for run in runs])
    if any(a is None for a in fused[0] + fused[1]):
        runs = [[i] for i in range(len(params))]
        spans, offset = [], 0
        for g in groups:
            spans.append((offset, offset + len(g["params"])))
            offset += len(g["params"])
        fused = (params, grads)
    return runs, fused[0], fused[1], spans


class RuleRuns:
    """The rule and the arrays it is called with.

    Args:
        rule: a :class:`~commlib.optim.rules.Rule` or a callable
            ``rule(params, grads)``.
        groups: the parameter groups (dicts with ``"params"``).
        params: every group's arrays, group after group.
        grads: the gradient arrays, one per parameter.
    """

    def __init__(self, rule, groups, params, grads):
        self.rule, self.params = rule, params
        self.runs, self.fused_params, self.fused_grads, self.spans = layout(
            rule, groups, params, grads)

    def apply(self, hypers):
        """The rule, group by group, on the averaged gradients, with
        ``hypers`` (every group's validated hyperparameters,
        :meth:`ParamGroups.checked <commlib.optim.param_groups.ParamGroups.checked>`;
        a callable rule takes none)."""
        params, grads = self.fused_params, self.fused_grads
        if not isinstance(self.rule, Rule):
            self.rule(params, grads)
            return
        buffers = self.rule.buffers_for(params)
        t = self.rule.begin_step()
        for (lo, hi), hyper in zip(self.spans, hypers):
            self.rule.update(params[lo:hi], grads[lo:hi],
                             {k: v[lo:hi] for k, v in buffers.items()}, hyper, t)

    def state_arrays(self):
        """The rule's state by name: ``"rule.<counter>"`` and
        ``"rule.<buffer>.<i>"`` per parameter (views of the run buffers) for
        a Rule, ``"rule.<name>"`` of a callable's ``state(params)``."""
        out = {}
        if isinstance(self.rule, Rule):     # per parameter, whichever runs it updates
            out.update(("rule." + k, v) for k, v in self.rule.counters().items())
            for name, buffers in self.rule.buffers_for(self.fused_params).items():
                for run, buf in zip(self.runs, buffers):
                    flat, offset = buf.reshape(-1), 0
                    for i in run:
                        size = self.params[i].size
                        out["rule.%s.%d" % (name, i)] = \
                            flat[offset:offset + size].reshape(self.params[i].shape)
                        offset += size
        elif hasattr(self.rule, "state"):
            out.update(("rule." + k, v) for k, v in self.rule.state(self.params).items())
        return out

    def loaded(self, steps):
        """After a state was loaded: a Rule that saves no step count of its
        own (no ``"t"`` counter) takes ``steps``."""
        if isinstance(self.rule, Rule) and "t" not in self.rule.counters():
            self.rule.step_count[...] = steps
