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
PROGRAMS = ["groups,schedules,clip,agree", "scaler,scaler_residuals,scaler_half,nonfinite",
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
        if name == "agree":         # 8 disagreements, with rank 0 and the last rank odd
            assert all(r["cases"] == (16 if n > 1 else 0) for r in mine.values()), mine
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
    # down to 0 at T_max, then up again, as PyTorch's
    assert lrs_of(lambda o: CosineAnnealingLR(o, 4), 6) == pytest.approx(
        [0.1, 0.1 * (1 + math.sqrt(0.5)) / 2, 0.05, 0.1 * (1 - math.sqrt(0.5)) / 2, 0,
         0.1 * (1 - math.sqrt(0.5)) / 2], rel=1e-12, abs=1e-15)
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
])
def test_bad_values_raise_naming_them(make, fragment):
    with pytest.raises(ArgumentError) as info:
        make()
    assert fragment in str(info.value)


def test_a_scheduler_needs_a_distributed_optimizer():
    with pytest.raises(TypeError, match="StepLR: optimizer must be a commlib.DistributedOptimizer, "
                                        "got builtins.object"):
        StepLR(object(), 3)


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


# -- layouts, shared rules, no_sync with grad_ready, unreadable checkpoints, the scale's range --

def sized(comm, sizes, rule=None):
    """An optimizer of groups of ``sizes`` arrays of 3 float32s each (so
    that states of the same total number of arrays have the same names)."""
    return commlib.DistributedOptimizer(
        comm, [{"params": [np.full(3, k + 1.0, np.float32) for _ in range(n)]}
               for k, n in enumerate(sizes)], rule or SGD(0.1, momentum=0.9))


@pytest.mark.parametrize("saved, loading", [([2], [1, 1]), ([2, 2], [1, 3]), ([2, 2], [1, 2]),
                                            ([1, 1], [2])])
def test_a_state_of_other_parameter_groups_is_refused_on_every_rank(saved, loading):
    """torch.optim's checks: another number of groups, or groups of other
    sizes (even with the same arrays in all), raise ArgumentError on every
    rank naming both layouts; the optimizer is left as it was."""
    def body(comm):
        source = sized(comm, saved)
        source.step([np.ones(3, np.float32)] * sum(saved))
        target = sized(comm, loading)
        before = target.state_dict()
        with pytest.raises(ArgumentError) as info:
            target.load_state_dict(source.state_dict() if comm.rank == 0 else None)
        after = target.state_dict()
        unchanged = sorted(before) == sorted(after) and all(
            np.array_equal(before[k], after[k]) for k in before)
        return str(info.value), info.value.culprits, unchanged
    for rank, (text, culprits, unchanged) in enumerate(run_ranks(2, body)):
        assert text == ("rank %d: load_state_dict: rank 0's state does not fit: its parameter "
                        "groups differ: %d group%s of sizes %s, this optimizer's %d of sizes %s"
                        % (rank, len(saved), "" if len(saved) == 1 else "s", saved,
                           len(loading), loading)), text
        assert culprits == (0,) and unchanged


def test_a_state_with_some_groups_hyperparameters_and_not_others_is_refused():
    """A state from before groups.sizes was kept, of one group, into an
    optimizer of two: the second group's hyperparameters are missing, not
    optional."""
    def body(comm):
        state = sized(comm, [2]).state_dict()
        del state["groups.sizes"]
        with pytest.raises(ArgumentError) as info:
            sized(comm, [1, 1]).load_state_dict(state)
        return str(info.value)
    for rank, text in enumerate(run_ranks(2, body)):
        assert ("rank %d: load_state_dict: rank 0's state does not fit: names differ from this "
                "optimizer's: missing ['groups.1.dampening', 'groups.1.lr'" % rank) in text, text


def test_one_rule_object_is_refused_by_a_second_optimizer():
    """A rule keeps its optimizer's moments and step count: a second
    optimizer (of as many arrays, where sharing would go unnoticed) may not
    take it, even after the first is gone; a construction refused for
    another reason leaves the rule free."""
    import gc

    def body(comm):
        rule = Adam(0.1)
        first = commlib.DistributedOptimizer(comm, [np.zeros(3)], rule)
        assert first.rule is rule
        texts = []
        for alive in (True, False):
            if not alive:
                del first
                gc.collect()
            with pytest.raises(ArgumentError) as info:
                commlib.DistributedOptimizer(comm, [np.zeros(3)], rule)
            texts.append(str(info.value))
        other = SGD(0.1, momentum=0.9)
        with pytest.raises(ArgumentError, match="accumulate"):
            commlib.DistributedOptimizer(comm, [np.zeros(3)], other, accumulate=0)
        opt = commlib.DistributedOptimizer(comm, [np.zeros(3)], other)
        opt.step([np.ones(3)])
        return texts, opt.params[0].tolist()
    for rank, (texts, params) in enumerate(run_ranks(2, body)):
        assert texts == ["rank %d: rule: this Adam object was given to another "
                         "DistributedOptimizer, whose momentum buffers, moments and step count it "
                         "keeps; give each optimizer a rule object of its own (e.g. Adam(...) "
                         "again)" % rank] * 2, texts
        assert params == [-0.1] * 3


def test_no_sync_with_grad_ready_accumulates_as_ddp_or_refuses_a_mixed_micro_batch():
    """grad_ready during the backward pass, then no_sync() around step():
    refused on entering (nothing changed; step() then finishes that
    update). no_sync() around the backward pass and step of two
    micro-batches and a third outside: SGD with momentum on the mean of
    the three, averaged over the ranks (numpy). Leaving no_sync() between
    a micro-batch's backward pass and its step: refused, and the micro-batch
    still only accumulates."""
    shapes = [(3, 4), (5,)]

    def grads(k, rank):
        return [np.full(s, (k + 1.0) * (i + 1) + 3.0 * rank, np.float32)
                for i, s in enumerate(shapes)]

    def body(comm):
        opt = commlib.DistributedOptimizer(comm, commlib.flat_arrays(shapes),
                                           SGD(0.1, momentum=0.9), overlap=True, bucket_bytes=16)

        def backward(k):
            for i in reversed(range(len(shapes))):
                opt.grads[i][...] = grads(k, comm.rank)[i]
                opt.grad_ready(i)
        backward(0)
        with pytest.raises(ArgumentError) as entering:
            with opt.no_sync():
                opt.step()
        untouched = opt.steps == 0 and all(not p.any() for p in opt.params)
        assert opt.step() is True
        snapshots = [[p.copy() for p in opt.params]]
        results = []
        for k in (1, 2):
            with opt.no_sync():
                backward(k)
                results.append(opt.step())
        backward(3)
        results.append(opt.step())
        snapshots.append([p.copy() for p in opt.params])
        with pytest.raises(ArgumentError) as leaving:
            with opt.no_sync():
                backward(4)
        results.append(opt.step())
        backward(5)
        results.append(opt.step())
        snapshots.append([p.copy() for p in opt.params])
        return str(entering.value), str(leaving.value), untouched, results, snapshots
    updates = [[0], [1, 2, 3], [4, 5]]
    want, buf = [np.zeros(s) for s in shapes], None
    expected = []
    for ks in updates:
        mean = [np.mean([grads(k, r)[i].astype(np.float64) for k in ks for r in range(2)], axis=0)
                for i in range(len(shapes))]
        buf = mean if buf is None else [0.9 * b + m for b, m in zip(buf, mean)]
        want = [p - 0.1 * b for p, b in zip(want, buf)]
        expected.append(want)
    for rank, (entering, leaving, untouched, results, snapshots) in enumerate(
            run_ranks(2, body)):
        assert entering.startswith("rank %d: no_sync(): entered after grad_ready() marked "
                                   "gradients of a micro-batch that ends an update" % rank)
        assert leaving.startswith("rank %d: no_sync(): left after grad_ready() inside it marked "
                                  "gradients of a micro-batch whose step() has not come" % rank)
        assert untouched and results == [False, False, True, False, True]
        for got, w in zip(snapshots, expected):
            for g, x in zip(got, w):
                np.testing.assert_allclose(g, x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("root", [0, 1])
def test_an_unreadable_checkpoint_raises_argument_error_on_every_rank(tmp_path, root):
    """A truncated, empty, non-npz or missing file read on ``root``:
    every rank raises ArgumentError naming root, the file and the reason
    (the error reading raised), before any other collective; the optimizer
    is left as it was and the communicator works on (a good file loads)."""
    good = tmp_path / "good.npz"
    cases = [("truncated.npz", "BadZipFile: File is not a zip file"),
             ("empty.npz", "EOFError: No data left in file"),
             ("text.npz", "ValueError: This file contains pickled (object) data"),
             ("missing.npz", "FileNotFoundError: [Errno 2] No such file or directory")]

    def body(comm):
        opt = opt_of(comm, SGD(0.1, momentum=0.9))
        opt.step([np.ones((3, 4), np.float32), np.ones(5, np.float32)])
        if comm.rank == 0:
            commlib.optim.save(good, opt)
            data = good.read_bytes()
            (tmp_path / "truncated.npz").write_bytes(data[:len(data) // 2])
            (tmp_path / "empty.npz").write_bytes(b"")
            (tmp_path / "text.npz").write_bytes(b"not an npz file")
        comm.barrier()
        opt.step([np.ones((3, 4), np.float32), np.ones(5, np.float32)])
        before = opt.state_dict()
        out = []
        for name, _ in cases:
            with pytest.raises(ArgumentError) as info:
                commlib.optim.load(tmp_path / name, opt, root=root)
            out.append((str(info.value), info.value.culprits))
        after = opt.state_dict()
        unchanged = all(np.array_equal(before[k], after[k]) for k in before)
        commlib.optim.load(good, opt, root=root)
        return out, unchanged, opt.steps
    for rank, (out, unchanged, steps) in enumerate(run_ranks(2, body)):
        for (text, culprits), (name, reason) in zip(out, cases):
            assert text.startswith("rank %d: load: rank %d cannot read %r: %s"
                                   % (rank, root, str(tmp_path / name), reason)), text
            assert culprits == (root,)
        assert unchanged and steps == 1


def test_the_loss_scale_stays_a_float32_normal_number():
    """Growth stops below float32's largest number (2**127 with factor 2),
    a run of skipped steps stops at 2**-126 (not 0: the unscaling divides
    by it), and a step at that scale is unscaled exactly; init_scale
    outside that range is refused."""
    s = DynamicLossScaler(init_scale=2.0 ** 120, growth_interval=1)
    for _ in range(20):
        s.update(False)
    assert s.scale == 2.0 ** 127 and s.growth_tracker == 0
    for _ in range(400):
        s.update(True)
    assert s.scale == 2.0 ** -126
    for bad in (1e39, 1e-39):
        with pytest.raises(ArgumentError, match="init_scale"):
            DynamicLossScaler(init_scale=bad)

    def body(comm):
        opt = commlib.DistributedOptimizer(comm, [np.zeros(4, np.float32)], SGD(1.0),
                                           loss_scaler=DynamicLossScaler(init_scale=2.0 ** -125))
        assert opt.step([np.full(4, np.nan, np.float32)]) is False
        scale = opt.loss_scaler.scale
        assert opt.step([np.full(4, np.float32(2.0 ** -126) * (comm.rank + 1))]) is True
        return scale, opt.params[0].tolist()
    for scale, params in run_ranks(2, body):
        assert scale == 2.0 ** -126 and params == [-1.5] * 4


def test_float16_gradients_unscaled_in_float32():
    """A loss scale of 2**25 on float16 gradients: its inverse is 0 in
    float16, so the unscaling multiplies in float32; the update is the
    mean of the true gradients (numpy, within float16 rounding)."""
    def body(comm):
        opt = commlib.DistributedOptimizer(comm, [np.zeros(8, np.float16)], SGD(1.0),
                                           loss_scaler=DynamicLossScaler(init_scale=2.0 ** 25))
        true = 5e-4 * (comm.rank + 1)
        assert opt.step([np.full(8, true * 2 ** 25, np.float16)]) is True
        return opt.params[0].astype(np.float64)
    for params in run_ranks(2, body):
        np.testing.assert_allclose(params, -7.5e-4, rtol=2e-3)


def test_hyperparameters_changed_after_grad_ready_are_compared_at_the_step():
    """grad_ready started the buckets with lr 0.1; an lr set alike before
    step() is the one applied; set differently, step() raises
    ConsistencyError on every rank naming both values, before the
    parameters are written, and the next update works."""
    def body(comm):
        opt = opt_of(comm, overlap=True, bucket_bytes=16)

        def backward():
            for i in (1, 0):
                opt.grads[i][...] = comm.rank + 1.0
                opt.grad_ready(i)
        backward()
        opt.lr = 0.5
        assert opt.step() is True                   # -0.5 * 1.5
        backward()
        opt.lr = 0.3 if comm.rank == 1 else 0.2
        with pytest.raises(commlib.ConsistencyError) as info:
            opt.step()
        kept = [p.copy() for p in opt.params]
        opt.lr = 1.0
        backward()
        assert opt.step() is True                   # -1.0 * 1.5 more
        return str(info.value), info.value.culprits, kept, [p.copy() for p in opt.params]
    for rank, (text, culprits, kept, params) in enumerate(run_ranks(2, body)):
        assert culprits == (1,) and "rank %d:" % rank in text, text
        assert "('param_groups[0]', 0.2," in text and "('param_groups[0]', 0.3," in text, text
        assert all((p == np.float32(-0.75)).all() for p in kept), kept
        assert all((p == np.float32(-2.25)).all() for p in params), params
