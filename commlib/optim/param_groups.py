"""Parameter groups of a DistributedOptimizer (``torch.optim``'s
``param_groups``): the constructor's ``params`` checked and made into
groups, the groups following hyperparameters set on the rule object
afterwards, the learning rate of every group, and the groups'
hyperparameters as numbers (for ``join()``'s vote and for checkpoints) and
as the plain values every rank's update must agree on."""
from collections.abc import Mapping

import numpy as np

from .. import interop
from ..collective import validation
from ..errors import ArgumentError
from .rules import Rule, check_number

_GROUP_EXTRA = ("params", "name", "initial_lr")


def checked_groups(comm, params, rule):
    """The validated parameter groups of the constructor's ``params`` and
    the list of all their arrays, group after group.

    Raises:
        ArgumentError: bad ``params`` or ``rule``, naming the rank.
    """
    rank = comm.rank
    if not isinstance(params, (list, tuple)) or not params:
        raise ArgumentError("rank %d: params must be a non-empty list of arrays, got %r"
                            % (rank, params if not isinstance(params, (list, tuple))
                               else "an empty list"))
    if not callable(rule):
        raise ArgumentError("rank %d: rule must be commlib.optim.SGD, Adam or a callable "
                            "rule(params, grads), got %r" % (rank, rule))
    groups = make_groups(params, rule, rank)
    params = [p for g in groups for p in g["params"]]
    validation.check_arrays(params, rank=rank, device=comm.device, writeable=True,
                            floating=True, what="params")
    if len({id(p) for p in params}) != len(params):
        raise ArgumentError("rank %d: params: an array appears twice (in one group or in "
                            "two)" % rank)
    return groups, params


def make_groups(params, rule, rank):
    """The groups of ``params`` (a list of arrays: one group; or a list of
    dicts), each with every hyperparameter of ``rule`` (its own values as
    defaults), checked by the rule."""
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


def _plain(value):
    """A validated hyperparameter as a plain value (bool, float, tuple of floats)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, tuple):
        return tuple(float(v) for v in value)
    return float(value)


class ParamGroups:
    """The groups' hyperparameters, as the user and the rule object set them.

    Args:
        rule: the optimizer's rule (a :class:`~commlib.optim.rules.Rule` or
            a callable; a callable's groups have no hyperparameters).
        groups: the group dicts (the optimizer's ``param_groups`` list
            itself, not a copy).
        rank: this rank, for error messages.
    """

    def __init__(self, rule, groups, rank):
        self.rule, self.groups, self.rank = rule, groups, rank
        self.seen = None            # the rule's hyperparameters at the last look
        self.follow()

    def follow(self):
        """A hyperparameter changed on the rule object since the last look
        (``opt.rule.lr = x``) changes every group that still holds the
        rule's previous value."""
        if not isinstance(self.rule, Rule):
            return
        now = self.rule.defaults()
        if self.seen is not None:
            for k, v in now.items():
                if v != self.seen[k]:
                    for g in self.groups:
                        if g[k] == self.seen[k]:
                            g[k] = v
        self.seen = now

    def checked(self):
        """After :meth:`follow`: every group's validated hyperparameters,
        in order (empty dicts for a callable rule).

        Raises:
            ArgumentError: a bad value, naming the group and the rank.
        """
        self.follow()
        if not isinstance(self.rule, Rule):
            return [{} for _ in self.groups]
        return [self.rule.check_group(g, "param_groups[%d]: " % k, self.rank)
                for k, g in enumerate(self.groups)]

    @property
    def lr(self):
        """The first group's learning rate (a callable rule's ``lr``)."""
        if not isinstance(self.rule, Rule):
            return getattr(self.rule, "lr")
        self.follow()
        return self.groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        if not isinstance(self.rule, Rule):
            if not hasattr(self.rule, "lr"):
                raise ArgumentError("rank %d: lr: the rule %r has no learning rate"
                                    % (self.rank, self.rule))
            self.rule.lr = check_number(value, "lr", rank=self.rank)
            return
        value = check_number(value, "lr", rank=self.rank)
        self.follow()
        for g in self.groups:
            g["lr"] = value
        self.rule.lr = value                # the rule's default too, as before groups
        self.seen["lr"] = value

    def agreement(self, hypers):
        """What every rank's update must agree on about the rule and the
        groups, as plain values for ``comm.all_reduce(..., agree=...)``: a
        Rule's name and the names of its hyperparameters, then one row per
        group (``"param_groups[k]"`` and its values, in that order); a
        callable rule's type name (and its ``lr``, when it has a number).

        Args:
            hypers: every group's validated hyperparameters (:meth:`checked`).

        Returns:
            A tuple of tuples of str, float, bool.
        """
        if not isinstance(self.rule, Rule):
            rule = self.rule
            name = getattr(rule, "__qualname__", None) or type(rule).__qualname__
            lr = getattr(rule, "lr", None)
            if isinstance(lr, (int, float, np.integer, np.floating)) and not isinstance(
                    lr, (bool, np.bool_)):
                return ((name, "lr", float(lr)),)
            return ((name,),)
        names = self.rule.hyper
        rows = [(type(self.rule).__name__,) + tuple(names)]
        for k, h in enumerate(hypers):
            rows.append(("param_groups[%d]" % k,) + tuple(_plain(h[n]) for n in names))
        return tuple(rows)

    def vector(self):
        """Every group's numeric hyperparameters, as float64s."""
        out = []
        if isinstance(self.rule, Rule):
            for g in self.groups:
                for k in self.rule.hyper:
                    out.extend(np.ravel(np.asarray(g[k], np.float64)).tolist())
        return out

    def set_vector(self, values):
        """Set the hyperparameters from a :meth:`vector` (as Python floats
        and bools)."""
        values, at = [float(v) for v in values], 0
        if isinstance(self.rule, Rule):
            for g in self.groups:
                for k in self.rule.hyper:
                    old = g[k]
                    if isinstance(old, tuple):
                        g[k], at = tuple(values[at:at + len(old)]), at + len(old)
                    else:
                        g[k] = bool(values[at]) if isinstance(old, bool) else values[at]
                        at += 1

    def state_arrays(self):
        """``{"groups.sizes": each group's number of arrays (int64),
        "groups.<k>.<hyperparameter>": float64 copy}`` (the hyperparameters
        a Rule's)."""
        out = {"groups.sizes": np.array([len(g["params"]) for g in self.groups], np.int64)}
        if isinstance(self.rule, Rule):
            for k, g in enumerate(self.groups):
                for name in self.rule.hyper:
                    out["groups.%d.%s" % (k, name)] = np.array(g[name], np.float64)
        return out

    def load(self, live):
        """Set the hyperparameters from the ``groups.*`` arrays of ``live``
        (those it has)."""
        if not isinstance(self.rule, Rule):
            return
        for k, g in enumerate(self.groups):
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
