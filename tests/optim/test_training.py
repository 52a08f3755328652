"""The training API around commlib.DistributedOptimizer: parameter groups,
schedules, clipping by the global norm, loss scaling and nonfinite=, AdamW /
LAMB / SGD dampening, no_sync, zero_grad, the sampler and join, on real MPI
jobs of 1 to 3 ranks against float64 numpy references
(tests/optim/training_programs.py), plus argument checks and the schedules'
values in this process."""
import json
import math

import numpy as np
import pytest

import commlib
from commlib.errors import ArgumentError
from commlib.optim import (LAMB, SGD, Adam, AdamW, CosineAnnealingLR, DistributedSampler,
                           DynamicLossScaler, ExponentialLR, LambdaLR, LinearLR, LinearWarmup,
                           SequentialLR, StepLR)
from inprocess import errors_of, run_ranks
from mpirun import run_mpi


CODE = "import training_programs\ntraining_programs.main()\n"
PROGRAMS = ["groups,schedules,clip", "scaler,scaler_residuals,scaler_half,nonfinite",
            "no_sync,sampler,join"]


def records(stdout):
    """Every JSON object printed by the ranks (lines of several ranks may
    run together)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while True:
        at = stdout.find('{"', at)
        if at < 0:
            return out
        try:
            obj, end = decoder.raw_decode(stdout, at)
        except ValueError:
            at += 1
            continue
        out.append(obj)
        at = end


@pytest.mark.parametrize("checks", PROGRAMS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_training_programs_match_numpy_references(checks, n, tmp_path):
    proc = run_mpi(n, CODE, timeout=240, args=[checks, str(tmp_path)])
    found = records(proc.stdout)
    for name in checks.split(","):
        mine = {r["rank"]: r for r in found if r.get("check") == name}
        # every rank 0..n-1 reports its own record, at this size
        assert sorted(mine) == list(range(n)), (name, proc.stdout)
        assert all(r["size"] == n for r in mine.values()), (name, proc.stdout)
        if name == "scaler":
            want = [2, 5, 8] if n > 1 else [2, 5]
            assert all(r["skipped"] == want for r in mine.values()), mine
        if name == "scaler_half":
            assert all(r["skipped"] == [1] for r in mine.values()), mine
        if name == "scaler_residuals":
            assert all(r["skipped"] == [1, 3] for r in mine.values()), mine
        if name == "clip":
            assert len({json.dumps(r["norms"]) for r in mine.values()}) == 1, mine
        if name == "nonfinite":
            assert all(r["culprit"] == n - 1 for r in mine.values()), mine
        if name == "join":
            assert {r["updates"] for r in mine.values()} == {2 * (3 + n - 1) + 1}, mine
            assert [mine[r]["own_batches"] for r in range(n)] == [
                [3 + r, 4 + r] for r in range(n)], mine
        if name == "sampler":
            lengths = [mine[r]["lengths"]["23"] for r in range(n)]
            assert lengths == [23 // n + (r < 23 % n) for r in range(n)], lengths


# -- schedules in one process, against hand-computed values ------------------------------

def one_rank(fn):
    return run_ranks(1, fn)[0]


def lrs_of(make, steps, base=0.1):
    def body(comm):
        opt = commlib.DistributedOptimizer(comm, [np.zeros(3, np.float32)], SGD(base))
        sched = make(opt)
        out = []
        for _ in range(steps):
            out.append(opt.lr)
            sched.step()
        return out
    return one_rank(body)


def test_schedules_hand_computed():
    assert lrs_of(lambda o: StepLR(o, 2, gamma=0.5), 6) == pytest.approx(
        [0.1, 0.1, 0.05, 0.05, 0.025, 0.025], rel=1e-12)
    assert lrs_of(lambda o: ExponentialLR(o, 0.5), 4) == pytest.approx(
        [0.1, 0.05, 0.025, 0.0125], rel=1e-12)
    assert lrs_of(lambda o: CosineAnnealingLR(o, 4), 6) == pytest.approx(
        [0.1, 0.1 * (1 + math.sqrt(0.5)) / 2, 0.05, 0.1 * (1 - math.sqrt(0.5)) / 2, 0, 0],
        rel=1e-12, abs=1e-15)
    assert lrs_of(lambda o: LinearWarmup(o, 4), 6) == pytest.approx(
        [0.025, 0.05, 0.075, 0.1, 0.1, 0.1], rel=1e-12)
    assert lrs_of(lambda o: LinearWarmup(o, 1), 2) == [0.1, 0.1]
    assert lrs_of(lambda o: LambdaLR(o, lambda t: 1 / (t + 1)), 3) == pytest.approx(
        [0.1, 0.05, 0.1 / 3], rel=1e-12)
    # warm-up then cosine, composed
    got = lrs_of(lambda o: SequentialLR(o, [LinearWarmup(o, 2), CosineAnnealingLR(o, 2)],
                                        milestones=[2]), 5)
    assert got == pytest.approx([0.05, 0.1, 0.1, 0.05, 0.0], rel=1e-12, abs=1e-15)


def test_groups_scheduled_from_their_own_base_and_state_dict_keeps_them():
    def body(comm):
        a, b = np.zeros(3, np.float32), np.zeros(2, np.float32)
        opt = commlib.DistributedOptimizer(
            comm, [{"params": [a], "weight_decay": 0.1}, {"params": [b], "lr": 1.0,
                                                           "weight_decay": 0.0}],
            SGD(0.1, momentum=0.9))
        sched = StepLR(opt, 1, gamma=0.5)
        sched.step()
        return [g["lr"] for g in opt.param_groups], opt.state_dict(), sched.state_dict()
    lrs, state, sched = one_rank(body)
    assert lrs == [0.05, 0.5]
    assert float(state["groups.0.weight_decay"]) == 0.1 and float(state["groups.1.lr"]) == 0.5
    assert float(state["groups.1.momentum"]) == 0.9
    assert int(state["scheduler.0.last_epoch"]) == 1 and int(sched["last_epoch"]) == 1


def test_sampler_in_one_process():
    s = DistributedSampler(10, rank=1, size=3, seed=4)
    s.set_epoch(2)
    order = np.random.default_rng([4, 2]).permutation(10)
    assert s.indices().tolist() == np.resize(order, 12)[1::3].tolist() and len(s) == 4
    assert DistributedSampler(10, rank=1, size=3, drop_last=True).__len__() == 3
    assert len(DistributedSampler(10, rank=2, size=3, pad=False)) == 3


# -- bad input: a clear, specific error --------------------------------------------------------


def opt_of(comm, rule=None, **kw):
    return commlib.DistributedOptimizer(comm, commlib.flat_arrays([(3, 4), (5,)]),
                                        rule or SGD(0.1), **kw)


def groups_of(comm, rule, *extra):
    p = commlib.flat_arrays([(3, 4), (5,)])
    groups = [{"params": [p[0]]}, {"params": [p[1]]}]
    for g, e in zip(groups, extra):
        g.update(e)
    return commlib.DistributedOptimizer(comm, groups, rule)


def join_step(opt):
    with opt.join():
        opt.step()


@pytest.mark.parametrize("make, fragments", [
    (lambda c: groups_of(c, SGD(0.1), {"weight_decy": 0.1}),
     ["param_groups[0]", "'weight_decy'", "SGD takes"]),
    (lambda c: groups_of(c, SGD(0.1), {}, {"lr": -1}), ["param_groups[1]", "lr", "-1"]),
    (lambda c: groups_of(c, Adam(0.1), {"betas": (0.9, 1.0)}), ["param_groups[0]", "betas[1]"]),
    (lambda c: groups_of(c, SGD(0.1), {"nesterov": True}), ["nesterov", "momentum > 0"]),
    (lambda c: groups_of(c, lambda p, g: None, {"lr": 0.1}), ["'lr'", "callable rule"]),
    (lambda c: commlib.DistributedOptimizer(c, [{"lr": 0.1}], SGD(0.1)), ["param_groups[0]",
                                                                         "no 'params'"]),
    (lambda c: commlib.DistributedOptimizer(c, [{"params": []}], SGD(0.1)), ["'params'",
                                                                           "non-empty"]),
    (lambda c: commlib.DistributedOptimizer(
        c, [{"params": [np.zeros(3)]}, np.zeros(3)], SGD(0.1)), ["not both"]),
    (lambda c: [commlib.DistributedOptimizer(c, [{"params": [a]}, {"params": [a]}], SGD(0.1))
                for a in [np.zeros(3)]], ["params[1]", "same array"]),
    (lambda c: opt_of(c, clip_norm=-1.0), ["clip_norm", "-1"]),
    (lambda c: opt_of(c).step(clip_norm="big"), ["clip_norm", "'big'"]),
    (lambda c: opt_of(c, nonfinite="ignore"), ["nonfinite", "'ignore'"]),
    (lambda c: opt_of(c, loss_scaler=2.0), ["loss_scaler", "DynamicLossScaler"]),
    (lambda c: opt_of(c, loss_scaler=DynamicLossScaler(), nonfinite="raise"),
     ["loss_scaler", "nonfinite", "'raise'"]),
    (lambda c: opt_of(c, compression=commlib.compression.Partial(0.5)).step(clip_norm=1.0),
     ["clip_norm", "partial"]),
    (lambda c: opt_of(c, clip_norm=1.0).update_partial(fraction=0.5), ["clip_norm", "partial"]),
    (lambda c: opt_of(c).register_hook(3), ["register_hook", "callable"]),
    (lambda c: join_step(opt_of(c, compression=commlib.compression.TopK(0.1))),
     ["join", "topk"]),
])
def test_argument_errors_name_the_argument_and_rank(make, fragments):
    for rank, text in enumerate(errors_of(2, make)):
        assert ("rank %d:" % rank) in text, text
        for fragment in fragments:
            assert fragment in text, (fragment, text)


@pytest.mark.parametrize("make, fragment", [
    (lambda: SGD(0.1, dampening=1.5), "dampening"),
    (lambda: SGD(0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening 0"),
    (lambda: AdamW(0.1, weight_decay=-1), "AdamW: weight_decay"),
    (lambda: LAMB(0.1, betas=(0.9,)), "LAMB: betas"),
    (lambda: DynamicLossScaler(init_scale=0), "init_scale"),
    (lambda: DynamicLossScaler(growth_factor=0.5), "growth_factor"),
    (lambda: DynamicLossScaler(backoff_factor=1.0), "backoff_factor"),
    (lambda: DynamicLossScaler(growth_interval=0), "growth_interval"),
    (lambda: DistributedSampler(10, rank=3, size=3), "0 <= rank < size"),
    (lambda: DistributedSampler(-1, rank=0, size=1), "n must be an int >= 0"),
    (lambda: DistributedSampler(10), "needs comm"),
    (lambda: DistributedSampler(10, "comm"), "comm must be a commlib.Communicator"),
    (lambda: DistributedSampler(10, rank=0, size=1, drop_last="yes"), "drop_last"),
    (lambda: DistributedSampler(10, rank=0, size=1).set_epoch(-1), "epoch"),
    (lambda: StepLR(object(), 3), "optimizer"),
])
def test_bad_values_raise_naming_them(make, fragment):
    with pytest.raises(ArgumentError) as info:
        make()
    assert fragment in str(info.value)


@pytest.mark.parametrize("make, fragment", [
    (lambda o: StepLR(o, 0), "step_size"),
    (lambda o: CosineAnnealingLR(o, 0), "T_max"),
    (lambda o: LinearLR(o, start_factor=0), "start_factor"),
    (lambda o: SequentialLR(o, [StepLR(o, 2), StepLR(o, 3)], milestones=[]), "milestones"),
    (lambda o: SequentialLR(o, [StepLR(o, 2), StepLR(o, 3), StepLR(o, 3)],
                            milestones=[4, 2]), "increase"),
])
def test_bad_schedules_raise_naming_the_value(make, fragment):
    def body(comm):
        try:
            make(opt_of(comm))
        except ArgumentError as exc:
            return str(exc)
        return None
    assert fragment in (one_rank(body) or "no error")


def test_group_hyperparameter_set_badly_between_steps_is_caught_at_the_step():
    def body(comm):
        opt = groups_of(comm, SGD(0.1), {}, {})
        opt.param_groups[1]["lr"] = float("nan")
        opt.step()
    for rank, text in enumerate(errors_of(2, body)):
        assert "rank %d: param_groups[1]: SGD: lr" % rank in text, text


def test_zero_grad_and_rule_defaults_follow_the_rule():
    def body(comm):
        opt = groups_of(comm, SGD(0.1), {}, {"lr": 0.3})
        for g in opt.grads:
            g[...] = 1
        opt.zero_grad()
        zero = all(not g.any() for g in opt.grads)
        opt.rule.lr = 0.2       # the groups that held the rule's value follow it
        return zero, [g["lr"] for g in opt.param_groups if opt.step() or True]
    zero, lrs = one_rank(body)
    assert zero and lrs == [0.2, 0.3]


def test_state_without_groups_from_before_they_were_saved_still_loads():
    def body(comm):
        a = groups_of(comm, Adam(0.01), {}, {"lr": 0.5})
        a.step([np.ones((3, 4), np.float32), np.ones(5, np.float32)])
        old = {k: v for k, v in a.state_dict().items()
               if not k.startswith("groups.") and k != "skipped_steps"}
        b = groups_of(comm, Adam(0.01), {}, {"lr": 0.25})
        b.load_state_dict(old)
        same = all(np.array_equal(x, y) for x, y in zip(a.params, b.params))
        return same, b.steps, [g["lr"] for g in b.param_groups], b.rule.t
    for same, steps, lrs, t in run_ranks(2, body):
        assert same and steps == 1 and t == 1 and lrs == [0.01, 0.25]
