"""Rank programs of tests/optim/test_training.py: parameter groups, schedules,
clipping, loss scaling, the newer rules, no_sync, the sampler and join on
real MPI ranks, each against a float64 numpy reference computed here
(independently of commlib.optim) from every rank's inputs, which each rank
regenerates from their seeds.

    mpiexec -n N python -c "import training_programs as p; p.main()" CHECK[,CHECK...] DIR

Each check raises AssertionError on a wrong result (ending the job) and
returns a record; every rank prints one JSON line per check,
``{"rank": R, "size": N, "check": NAME, ...record}``, which the test parses.
"""
import json
import math
import os
import sys
import warnings

import numpy as np
from mpi4py import MPI

import commlib
from commlib.compression import TopK
from commlib.optim import (LAMB, SGD, Adam, AdamW, CosineAnnealingLR, DistributedSampler,
                           DynamicLossScaler, LinearLR, SequentialLR, StepLR)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SHAPES = [(3, 5), (5,), (7,), (4, 4), (2,)]
DTYPES = ["float32", "float32", "float64", "float32", "float32"]
GROUPS = [[0, 3], [1, 4], [2]]          # weights, biases, one float64 array


def new_comm():
    return commlib.Communicator.from_mpi(WORLD)


def start(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(d) for s, d in zip(SHAPES, DTYPES)]


def grads_of(rank, step, seed=1, scale=1.0):
    rng = np.random.default_rng([seed, step, rank])
    return [(rng.standard_normal(s) * scale * (1 + rank)).astype(d)
            for s, d in zip(SHAPES, DTYPES)]


def mean_grads(step, ranks=None, **kw):
    ranks = range(SIZE) if ranks is None else ranks
    every = [grads_of(r, step, **kw) for r in ranks]
    return [np.mean([e[i].astype(np.float64) for e in every], axis=0)
            for i in range(len(SHAPES))]


def close(got, want, rtol=3e-5, atol=3e-6, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol, atol=atol,
                                   err_msg="%s rank %d array %d" % (what, RANK, i))


def as64(arrays):
    return [np.array(a, np.float64) for a in arrays]


def grouped(params, hypers):
    """Parameter groups of GROUPS over ``params`` with ``hypers[k]``."""
    return [dict(hypers[k], params=[params[i] for i in idx]) for k, idx in enumerate(GROUPS)]


def group_of(i):
    return next(k for k, idx in enumerate(GROUPS) if i in idx)


# -- float64 references ------------------------------------------------------------------

def ref_sgd(p, g, buf, h, t):
    """torch.optim.SGD on one array (buf: a one-element list holding the buffer)."""
    d = g + h.get("weight_decay", 0.0) * p
    mu, damp = h.get("momentum", 0.0), h.get("dampening", 0.0)
    if mu:
        buf[0] = d.copy() if t == 1 else mu * buf[0] + (1 - damp) * d
        d = d + mu * buf[0] if h.get("nesterov") else buf[0]
    return p - h["lr"] * d


def ref_adam(p, g, mv, h, t, kind):
    """Adam ("adam"), AdamW ("adamw") or LAMB ("lamb") on one array; mv: [m, v]."""
    b1, b2 = h.get("betas", (0.9, 0.999))
    eps = h.get("eps", 1e-6 if kind == "lamb" else 1e-8)
    wd, lr = h.get("weight_decay", 0.0), h["lr"]
    if kind == "adam":
        g = g + wd * p
    elif kind == "adamw":
        p = p * (1 - lr * wd)
    mv[0] = b1 * mv[0] + (1 - b1) * g
    mv[1] = b2 * mv[1] + (1 - b2) * g * g
    r = (mv[0] / (1 - b1 ** t)) / (np.sqrt(mv[1] / (1 - b2 ** t)) + eps)
    if kind != "lamb":
        return p - lr * r
    r = r + wd * p
    pn, rn = np.linalg.norm(p), np.linalg.norm(r)
    trust = pn / rn if pn > 0 and rn > 0 else 1.0
    return p - lr * trust * r


class Ref:
    """A float64 reference optimizer over every array with per-group hypers."""

    def __init__(self, kind, hypers, params):
        self.kind, self.hypers = kind, hypers
        self.p = as64(params)
        self.state = [[np.zeros_like(x), np.zeros_like(x)] for x in self.p]
        self.t = 0

    def step(self, grads):
        self.t += 1
        for i, g in enumerate(grads):
            h = self.hypers[group_of(i)]
            if self.kind == "sgd":
                self.p[i] = ref_sgd(self.p[i], g, self.state[i], h, self.t)
            else:
                self.p[i] = ref_adam(self.p[i], g, self.state[i], h, self.t, self.kind)


# -- checks ------------------------------------------------------------------------------------

RULE_CASES = [
    ("sgd", lambda: SGD(0.1, momentum=0.9, weight_decay=0.01),
     [{"weight_decay": 0.05}, {"weight_decay": 0.0, "lr": 0.2}, {"momentum": 0.5}]),
    ("sgd", lambda: SGD(0.1, momentum=0.9, dampening=0.3),
     [{}, {"dampening": 0.0, "nesterov": True}, {"lr": 0.03, "weight_decay": 0.1}]),
    ("adam", lambda: Adam(0.01, weight_decay=0.01), [{}, {"weight_decay": 0.0}, {"lr": 0.002}]),
    ("adamw", lambda: AdamW(0.01, betas=(0.8, 0.99)),
     [{"weight_decay": 0.1}, {"weight_decay": 0.0}, {"lr": 0.05, "betas": (0.5, 0.9)}]),
    ("lamb", lambda: LAMB(0.02, weight_decay=0.01),
     [{}, {"weight_decay": 0.0}, {"eps": 1e-4, "lr": 0.01}]),
]


def full_hypers(rule, over):
    return [dict(rule.defaults(), **o) for o in over]


def check_groups(comm, directory):
    """Every rule with three parameter groups of their own hyperparameters
    (defaults, overrides), 4 steps with a group's lr changed midway:
    parameters match the float64 reference; the state dict holds the
    groups' hyperparameters and a fresh optimizer of other settings takes
    them (and continues identically)."""
    for n, (kind, make, over) in enumerate(RULE_CASES):
        rule = make()
        params = start()
        opt = commlib.DistributedOptimizer(comm, grouped(params, over), rule, bucket_bytes=64)
        assert [len(g["params"]) for g in opt.param_groups] == [2, 2, 1]
        hypers = full_hypers(rule, over)
        ref = Ref(kind, hypers, params)
        order = [i for idx in GROUPS for i in idx]
        for step in range(4):
            if step == 2:
                opt.param_groups[1]["lr"] *= 0.5
                hypers[1]["lr"] *= 0.5
            g = grads_of(RANK, step)
            assert opt.step([g[i] for i in order]) is True
            ref.step(mean_grads(step))
            close([params[i] for i in order], [ref.p[i] for i in order],
                  what="%s case %d step %d" % (kind, n, step))
        state = opt.state_dict()
        assert float(state["groups.1.lr"]) == hypers[1]["lr"], state["groups.1.lr"]
        other = make()
        other.lr = 0.5
        fresh = commlib.DistributedOptimizer(comm, [np.zeros_like(params[i]) for i in order],
                                             other)
        try:
            fresh.load_state_dict(state)
            raise AssertionError("a state of 3 groups was loaded into an optimizer of one")
        except commlib.ArgumentError as exc:
            # torch.optim's check, on every rank: the groups' number and sizes
            assert "rank %d:" % RANK in str(exc) and "rank 0's state" in str(exc), exc
            assert ("parameter groups differ: 3 groups of sizes [2, 2, 1], this optimizer's 1 "
                    "of sizes [5]") in str(exc) and exc.culprits == (0,), exc
        fresh = commlib.DistributedOptimizer(
            comm, grouped([np.zeros_like(p) for p in params], [{}, {}, {}]), make())
        if RANK == 0:
            path = os.path.join(directory, "groups_%d.npz" % n)
            commlib.optim.save(path, opt)
        comm.barrier()
        commlib.optim.load(os.path.join(directory, "groups_%d.npz" % n), fresh)
        for k, h in enumerate(hypers):
            for name, value in h.items():
                got = fresh.param_groups[k][name]
                assert (tuple(got) == tuple(value) if isinstance(value, tuple)
                        else got == value), (k, name, got, value)
        for step in range(4, 6):
            g = grads_of(RANK, step)
            opt.step([g[i] for i in order])
            fresh.step([g[i] for i in order])
        assert all(np.array_equal(a, b) for a, b in zip(opt.params, fresh.params))
    return {"rules": len(RULE_CASES)}


def sched_reference(name, base, t):
    """The hand-written closed forms of the schedules below (the cosine's
    periodic past T_max, as PyTorch's: the 14 updates go past it)."""
    if name == "step":
        return base * 0.5 ** (t // 3)
    if name == "warmcos":          # 4 steps from 0.25 * base up, then a cosine over 8
        if t < 4:
            return base * (0.25 + 0.75 * t / 4)
        return base * (1 + math.cos(math.pi * (t - 4) / 8)) / 2
    raise KeyError(name)


def make_sched(name, opt):
    if name == "step":
        return StepLR(opt, step_size=3, gamma=0.5)
    return SequentialLR(opt, [LinearLR(opt, start_factor=0.25, total_iters=4),
                              CosineAnnealingLR(opt, T_max=8)], milestones=[4])


def check_schedules(comm, directory):
    """A step schedule and warm-up then cosine (a SequentialLR), stepped once
    per update over 14 updates, on three groups of base lr 0.1, 0.02, 0.1:
    every group's lr equals the hand-computed value, plain SGD moves the
    parameters by exactly lr * mean gradient, and a checkpoint taken after
    update 6 and loaded into a fresh optimizer and scheduler continues with
    the same learning rates and parameters. (Every scheduler's values, alone
    and in pairs, against torch's: test_against_torch.py, in one process.)"""
    for name in ("step", "warmcos"):
        params = start()
        order = [i for idx in GROUPS for i in idx]
        opt = commlib.DistributedOptimizer(
            comm, grouped(params, [{}, {"lr": 0.02}, {}]), SGD(0.1))
        sched = make_sched(name, opt)
        bases = [0.1, 0.02, 0.1]
        want = as64(params)
        for t in range(14):
            lrs = [g["lr"] for g in opt.param_groups]
            ref = [sched_reference(name, b, t) for b in bases]
            assert np.allclose(lrs, ref, rtol=1e-12, atol=0), (name, t, lrs, ref)
            assert sched.last_epoch == t and sched.get_last_lr() == lrs
            g = grads_of(RANK, t)
            opt.step([g[i] for i in order])
            mean = mean_grads(t)
            want = [w - ref[group_of(i)] * m for i, (w, m) in enumerate(zip(want, mean))]
            close(params, want, what="schedule %s t %d" % (name, t))
            sched.step()
            if t == 6:
                state = opt.state_dict()
                assert int(state["scheduler.0.last_epoch"]) == 7
                if RANK == 0:
                    commlib.optim.save(os.path.join(directory, "sched.npz"), opt)
                comm.barrier()
                fresh = commlib.DistributedOptimizer(
                    comm, grouped([np.zeros_like(p) for p in params], [{}, {"lr": 0.02}, {}]),
                    SGD(0.1))
                fresh_sched = make_sched(name, fresh)
                commlib.optim.load(os.path.join(directory, "sched.npz"), fresh)
        assert fresh_sched.last_epoch == 7
        for t in range(7, 14):
            fresh.step([grads_of(RANK, t)[i] for i in order])
            fresh_sched.step()
        assert all(np.array_equal(a, b) for a, b in zip(fresh.params, opt.params)), name
    return {"schedules": 2}


def disagreement(run, odd, fragments, params=None):
    """``run()`` raises ConsistencyError on every rank, naming this rank, the
    odd rank out and ``fragments`` (the group and both values), with the
    exact culprits: ``odd`` (at 2 ranks, where the halves tie, rank 1: the
    check blames the half without rank 0); ``params``, if given, untouched."""
    keep = None if params is None else [p.copy() for p in params]
    try:
        run()
    except commlib.ConsistencyError as exc:
        text = str(exc)
        want = (1,) if SIZE == 2 else (odd,)
        assert exc.culprits == want, (exc.culprits, want, text)
        assert "rank %d:" % RANK in text and "ranks [%d]" % odd in text, text
        for fragment in fragments:
            assert fragment in text, (fragment, text)
    else:
        raise AssertionError("rank %d: no ConsistencyError (rank %d differs: %s)"
                             % (RANK, odd, fragments))
    if params is not None:
        assert all(np.array_equal(a, b) for a, b in zip(params, keep)), "written on error"


def check_agree(comm):
    """Every all-reduce of an update carries what the ranks must agree on:
    one rank (rank 0 too) with another lr in a group, a scheduler stepped
    on that rank only (the buckets started by grad_ready), another loss
    scale, nonfinite mode, clip_norm, rule, number of micro-batches or
    (partial update) lr
    raises ConsistencyError on every rank naming the rank, the group and
    both values, before any parameter is written (a partial update's
    window all-reduce comes after its local update); afterwards the
    optimizer and the communicator work on (an update equals the reference)."""
    cases = 0
    for odd in sorted({0, SIZE - 1}):
        if SIZE == 1:
            break
        mine = RANK == odd
        params = start()
        opt = commlib.DistributedOptimizer(comm, grouped(params, [{}, {}, {}]), SGD(0.1),
                                           overlap=False)
        opt.param_groups[1]["lr"] = 0.05 if mine else 0.1
        order = [i for idx in GROUPS for i in idx]
        disagreement(lambda: opt.step([grads_of(RANK, 0)[i] for i in order]), odd,
                     ["('param_groups[1]', 0.05, 0.0, 0.0, False, 0.0)",
                      "('param_groups[1]', 0.1, 0.0, 0.0, False, 0.0)"], params)
        # a scheduler stepped on one rank only; buckets started during the backward pass
        params = start()
        opt = commlib.DistributedOptimizer(comm, grouped(params, [{}, {}, {}]),
                                           SGD(0.1, momentum=0.9), overlap=True, bucket_bytes=64)
        sched = StepLR(opt, 1, gamma=0.5)
        if mine:
            sched.step()
        g = grads_of(RANK, 1)

        def backward_and_step():
            for i in reversed(range(len(order))):
                opt.grads[i][...] = g[order[i]]
                opt.grad_ready(i)
            opt.step()
        disagreement(backward_and_step, odd, ["('param_groups[0]', 0.05, 0.9,",
                                              "('param_groups[0]', 0.1, 0.9,"], params)
        # the clean update afterwards (every rank stepped alike): the reference
        if not mine:
            sched.step()
        before = [p.astype(np.float64) for p in params]
        opt.step([grads_of(RANK, 2)[i] for i in order])
        mean = mean_grads(2)
        close(params, [b - 0.05 * m for b, m in zip(before, mean)], what="agree: after")
        # the loss scale, the clip norm, the rule, the micro-batches
        params = start()
        opt = commlib.DistributedOptimizer(
            comm, params, SGD(0.1), loss_scaler=DynamicLossScaler(2.0 ** (11 if mine else 10)))
        disagreement(lambda: opt.step(grads_of(RANK, 3)), odd,
                     ["('loss scale', 1024.0)", "('loss scale', 2048.0)"], params)
        opt = commlib.DistributedOptimizer(comm, params, SGD(0.1),
                                           nonfinite="skip" if mine else "warn")
        disagreement(lambda: opt.step(grads_of(RANK, 3)), odd,
                     ["('nonfinite', 'skip')", "('nonfinite', 'warn')"], params)
        opt = commlib.DistributedOptimizer(comm, params, SGD(0.1))
        disagreement(lambda: opt.step(grads_of(RANK, 3), clip_norm=2.0 if mine else 1.0), odd,
                     ["('clip_norm', 1.0)", "('clip_norm', 2.0)"], params)
        opt = commlib.DistributedOptimizer(comm, params, Adam(0.1) if mine else SGD(0.1))
        disagreement(lambda: opt.step(grads_of(RANK, 3)), odd,
                     ["('Adam', 'lr', 'betas', 'eps', 'weight_decay')",
                      "('SGD', 'lr', 'momentum', 'dampening', 'nesterov', 'weight_decay')"],
                     params)
        opt = commlib.DistributedOptimizer(comm, params, SGD(0.1), accumulate=2 if mine else 1)
        disagreement(lambda: [opt.step(grads_of(RANK, 3)) for _ in range(2 if mine else 1)],
                     odd, ["('micro-batches', 2)"], params)
        opt = commlib.DistributedOptimizer(comm, params, SGD(0.2 if mine else 0.1))
        disagreement(lambda: opt.update_partial(grads_of(RANK, 3), fraction=0.5), odd,
                     ["('param_groups[0]', 0.2,", "('param_groups[0]', 0.1,"])
        cases += 8
    # alike on every rank: no error, the reference result
    params = start()
    opt = commlib.DistributedOptimizer(comm, grouped(params, [{}, {"lr": 0.05}, {}]), SGD(0.1),
                                       accumulate=2, clip_norm=1e6,
                                       loss_scaler=DynamicLossScaler(4.0))
    order = [i for idx in GROUPS for i in idx]
    before = as64(params)
    for micro in range(2):
        assert opt.step([(g * 4.0).astype(g.dtype) for g in (
            grads_of(RANK, 10 + micro)[i] for i in order)]) is (micro == 1)
    mean = [(a + b) / 2 for a, b in zip(mean_grads(10), mean_grads(11))]
    close(params, [b - (0.05 if group_of(i) == 1 else 0.1) * m
                   for i, (b, m) in enumerate(zip(before, mean))], what="agree: alike")
    return {"cases": cases}


def check_clip(comm):
    """clip_norm: the averaged gradients are scaled to the clip when their
    global norm (float64 reference over every array of the mean gradient;
    ranks' own gradients differ in scale, so a rank's local norm differs)
    exceeds it, and left alone below; the hook runs after the average and
    before clipping; last_grad_norm is the norm before clipping, the same on
    every rank."""
    params = start()
    opt = commlib.DistributedOptimizer(comm, params, SGD(0.1, momentum=0.9), bucket_bytes=64)
    seen = []
    handle = opt.register_hook(lambda grads: seen.append(
        [np.array(g, np.float64) for g in grads]))
    ref_p, buf = as64(params), [None] * len(params)
    norms = []
    for step in range(5):
        mean = mean_grads(step)
        norm = math.sqrt(sum(float((m * m).sum()) for m in mean))
        clip = norm * (0.5 if step % 2 == 0 else 2.0)
        assert opt.step(grads_of(RANK, step), clip_norm=clip) is True
        close(seen[-1], mean, what="hook step %d" % step)
        assert abs(opt.last_grad_norm - norm) <= 1e-5 * norm, (opt.last_grad_norm, norm)
        coef = min(1.0, clip / (norm + 1e-6))
        for i, m in enumerate(mean):
            d = m * coef
            buf[i] = d.copy() if step == 0 else 0.9 * buf[i] + d
            ref_p[i] = ref_p[i] - 0.1 * buf[i]
        close(params, ref_p, what="clip step %d" % step)
        norms.append(opt.last_grad_norm)
    handle.remove()
    opt.step(grads_of(RANK, 9))
    assert len(seen) == 5
    everyone = WORLD.allgather(norms)
    assert all(n == norms for n in everyone), everyone
    # the constructor's clip_norm, and clip_norm=None to switch it off for a step
    params = start()
    opt = commlib.DistributedOptimizer(comm, params, SGD(1.0), clip_norm=1e-3)
    opt.step(grads_of(RANK, 0))
    moved = math.sqrt(sum(float(((a.astype(np.float64) - b) ** 2).sum())
                          for a, b in zip(params, as64(start()))))
    assert abs(moved - 1e-3) < 1e-6, moved
    before = as64(params)
    opt.step(grads_of(RANK, 1), clip_norm=None)
    close(params, [b - m for b, m in zip(before, mean_grads(1))], what="clip None")
    return {"norms": norms}


def check_scaler(comm):
    """DynamicLossScaler with Adam over 12 updates; the gradients given are
    the true ones times the scale; a NaN on one rank at update 2, an inf on
    the last rank at update 5, and (with 2+ ranks) values finite on every
    rank whose sum overflows at update 8: exactly those updates are skipped
    on every rank, and a skipped update leaves the parameters, the Adam
    moments and step counts as they were and backs the scale off; the
    others unscale, and the scale grows after 3 clean updates in a row."""
    bad = {2: ("nan", 1 % SIZE), 5: ("inf", SIZE - 1)}
    if SIZE > 1:
        bad[8] = ("overflow", None)
    params = start()
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=3)
    opt = commlib.DistributedOptimizer(comm, params, Adam(0.01), loss_scaler=scaler,
                                       bucket_bytes=128)
    ref_p = as64(params)
    mv = [[np.zeros_like(x), np.zeros_like(x)] for x in ref_p]
    t, scale, tracker, skipped = 0, 2.0 ** 10, 0, []
    for step in range(12):
        g = grads_of(RANK, step, scale=scale)
        kind, who = bad.get(step, (None, None))
        if kind == "nan" and RANK == who:
            g[1][2] = np.nan
        elif kind == "inf" and RANK == who:
            g[3][0, 1] = -np.inf
        elif kind == "overflow":
            g[0][0, 0] = 3e38
        live = opt.live_state()
        before = {k: np.array(v, copy=True) for k, v in live.items()}
        applied = opt.step(g)
        if kind is not None:
            assert applied is False, (step, kind)
            skipped.append(step)
            scale, tracker = scale * 0.5, 0
            after = opt.live_state()
            for k, v in before.items():
                if k.startswith("scaler.") or k == "skipped_steps":
                    continue
                assert np.array_equal(v, after[k], equal_nan=True), (step, k)
        else:
            assert applied is True, step
            t += 1
            mean = mean_grads(step)          # the true gradients (the scale divided out)
            for i, m in enumerate(mean):
                ref_p[i] = ref_adam(ref_p[i], m, mv[i], {"lr": 0.01}, t, "adam")
            tracker += 1
            if tracker == 3:
                scale, tracker = scale * 2, 0
        assert scaler.scale == scale and scaler.growth_tracker == tracker, (
            step, scaler.scale, scale, scaler.growth_tracker, tracker)
        close(params, ref_p, rtol=1e-4, atol=1e-6, what="scaler step %d" % step)
        for i in range(len(params)):
            close([opt.live_state()["rule.m.%d" % i]], [mv[i][0]], rtol=1e-4, atol=1e-7,
                  what="m step %d" % step)
    assert opt.steps == t and opt.skipped_steps == len(skipped) and opt.rule.t == t
    state = opt.state_dict()
    assert float(state["scaler.scale"]) == scale and int(state["skipped_steps"]) == len(skipped)
    return {"skipped": skipped, "scale": scale}


def check_scaler_residuals(comm):
    """With top-K and error feedback, a run whose updates 1 and 3 hold a NaN
    on one rank (skipped; min_scale keeps the scale) ends bit-identical to a
    run without those updates: the residuals were left as they were."""
    runs = []
    for with_nan in (True, False):
        c = new_comm()
        params = start()
        scaler = DynamicLossScaler(init_scale=8.0, min_scale=8.0, growth_interval=1000)
        opt = commlib.DistributedOptimizer(c, params, SGD(0.1, momentum=0.9),
                                           compression=TopK(0.2, error_feedback=True),
                                           loss_scaler=scaler, bucket_bytes=128)
        skipped = []
        for step in range(6):
            if step in (1, 3) and not with_nan:
                continue
            g = grads_of(RANK, step, scale=8.0)
            if step in (1, 3) and RANK == (step % SIZE):
                g[0][1, 1] = np.nan
            if not opt.step(g):
                skipped.append(step)
        runs.append(([p.copy() for p in params], skipped))
        c.close()
    assert runs[0][1] == [1, 3] and runs[1][1] == [], (runs[0][1], runs[1][1])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(runs[0][0], runs[1][0]))
    return {"skipped": runs[0][1]}


def check_scaler_half(comm):
    """Averaged in float16 with a loss scaler: a gradient finite in float32
    on rank 0 but beyond float16's range (1e5) at update 1 makes the
    float16 average overflow; that update is skipped on every rank (the
    parameters as they were), the others applied, within float16 rounding
    of the reference."""
    shapes = [(301,), (3, 7)]
    params = [np.zeros(s, np.float32) for s in shapes]
    scaler = DynamicLossScaler(init_scale=4.0, growth_interval=100)
    opt = commlib.DistributedOptimizer(comm, params, SGD(1.0), compression="fp16",
                                       loss_scaler=scaler)
    want, skipped = [np.zeros(s) for s in shapes], []
    for step in range(4):
        rng = np.random.default_rng([3, step, RANK])
        g = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        if step == 1 and RANK == 0:
            g[0][5] = 1e5
        before = [p.copy() for p in params]
        if not opt.step([x * np.float32(scaler.scale) for x in g]):
            skipped.append(step)
            assert all(np.array_equal(a, b) for a, b in zip(params, before))
            continue
        rngs = [np.random.default_rng([3, step, r]) for r in range(SIZE)]
        every = [[r.standard_normal(s).astype(np.float32).astype(np.float64) for s in shapes]
                 for r in rngs]
        want = [w - np.mean([e[i] for e in every], axis=0) for i, w in enumerate(want)]
        close(params, want, rtol=0, atol=2e-2, what="half step %d" % step)
    assert skipped == [1] and opt.steps == 3 and scaler.scale == 2.0, (skipped, scaler.scale)
    return {"skipped": skipped}


def check_nonfinite(comm):
    """nonfinite='raise' on the dense path: a NaN on one rank raises
    NonFiniteError on every rank naming that rank and its count, the
    parameters untouched; 'skip' skips; 'warn' warns and applies."""
    culprit = SIZE - 1
    params = start()
    opt = commlib.DistributedOptimizer(comm, params, SGD(0.1), nonfinite="raise")
    opt.step(grads_of(RANK, 0))
    keep = [p.copy() for p in params]
    g = grads_of(RANK, 1)
    if RANK == culprit:
        g[2][:3] = np.nan
    try:
        opt.step(g)
        raise AssertionError("no NonFiniteError")
    except commlib.NonFiniteError as exc:
        text = str(exc)
        assert exc.culprits == (culprit,), exc.culprits
        assert exc.counts[culprit] == 3 and sum(exc.counts) == 3, exc.counts
        assert "rank %d (3 values)" % culprit in text and "rank %d:" % RANK in text, text
    assert all(np.array_equal(a, b) for a, b in zip(params, keep))
    assert opt.steps == 1
    opt.step(grads_of(RANK, 2))         # goes on
    assert opt.steps == 2
    opt = commlib.DistributedOptimizer(comm, start(), SGD(0.1), nonfinite="skip")
    assert opt.step(g) is False and opt.skipped_steps == 1
    opt = commlib.DistributedOptimizer(comm, start(), SGD(0.1), nonfinite="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert opt.step(g) is True
    assert any("rank %d" % culprit in str(w.message) for w in caught), caught
    assert np.isnan(opt.params[2]).any()
    return {"culprit": culprit}


def check_no_sync(comm):
    """no_sync: two micro-batches inside it (no communication, False,
    parameters untouched) and one after average the mean of the three;
    with accumulate=2 a no_sync micro-batch makes that update 3 long;
    zero_grad zeroes every gradient."""
    params = start()
    opt = commlib.DistributedOptimizer(comm, params, SGD(0.1, momentum=0.9))
    ref_p, buf = as64(params), None
    sent = comm.stats.bytes_sent
    for update in range(2):
        keep = [p.copy() for p in params]
        with opt.no_sync():
            for micro in range(2):
                opt.zero_grad()
                assert all(not g.any() for g in opt.grads)
                for mine, g in zip(opt.grads, grads_of(RANK, update * 3 + micro)):
                    mine += g
                assert opt.step() is False
        assert comm.stats.bytes_sent == sent or SIZE == 1
        assert all(np.array_equal(a, b) for a, b in zip(params, keep))
        assert opt.step(grads_of(RANK, update * 3 + 2)) is True
        sent = comm.stats.bytes_sent
        mean = [np.mean(x, axis=0) for x in zip(*[mean_grads(update * 3 + m) for m in range(3)])]
        buf = [m.copy() for m in mean] if buf is None else [0.9 * b + m for b, m in zip(buf, mean)]
        ref_p = [p - 0.1 * b for p, b in zip(ref_p, buf)]
        close(params, ref_p, what="no_sync update %d" % update)
    params = start()
    opt = commlib.DistributedOptimizer(comm, params, SGD(0.1), accumulate=2)
    results = []
    with opt.no_sync():
        results += [opt.step(grads_of(RANK, 0)), opt.step(grads_of(RANK, 1))]
    results += [opt.step(grads_of(RANK, 2)), opt.step(grads_of(RANK, 3)),
                opt.step(grads_of(RANK, 4))]
    assert results == [False, False, True, False, True], results
    want = as64(start())
    for steps in ([0, 1, 2], [3, 4]):
        mean = [np.mean(x, axis=0) for x in zip(*[mean_grads(s) for s in steps])]
        want = [p - 0.1 * m for p, m in zip(want, mean)]
    close(params, want, what="no_sync+accumulate")
    return {"updates": opt.steps}


def check_sampler(comm):
    """DistributedSampler at this size: the ranks' items (gathered) are the
    reference permutation of (seed, epoch) dealt round-robin, padded from its
    start, cut, or uneven; each epoch reshuffles; the same on every rank."""
    out = {}
    for n in (0, 1, 10, 11, 23):
        ref_orders = {}
        for epoch in (0, 1):
            order = np.random.default_rng([5, epoch]).permutation(n)
            ref_orders[epoch] = order
            for mode in ("pad", "drop", "uneven"):
                s = DistributedSampler(n, comm, seed=5, drop_last=mode == "drop",
                                       pad=mode == "pad")
                s.set_epoch(epoch)
                mine = s.indices()
                assert len(mine) == len(s) and list(s) == mine.tolist()
                every = WORLD.allgather(mine.tolist())
                if mode == "drop":
                    keep = order[:n // SIZE * SIZE]
                elif mode == "pad" and n % SIZE:
                    keep = np.concatenate([order] * SIZE)[:math.ceil(n / SIZE) * SIZE]
                else:
                    keep = order
                want = [keep[r::SIZE].tolist() for r in range(SIZE)]
                assert every == want, (n, epoch, mode, every, want)
                if mode == "pad":
                    assert len({len(e) for e in every}) <= 1
                batches = s.batches(3)
                assert [b.tolist() for b in batches] == [mine[i:i + 3].tolist()
                                                         for i in range(0, len(mine), 3)]
        if n > 3:
            assert not np.array_equal(ref_orders[0], ref_orders[1])
        out[str(n)] = len(DistributedSampler(n, comm, pad=False))
    s = DistributedSampler(6, comm, shuffle=False, pad=False)
    assert s.indices().tolist() == list(range(RANK, 6, SIZE))
    return {"lengths": out}


def check_join(comm):
    """join: rank r has 3 + r batches (SGD with momentum, a warm-up
    schedule stepped by each rank after its own updates, clipping); every
    update averages over the ranks that still have batches, every rank
    applies it (the ones that finished included), so all end identical
    and equal to the reference; the schedulers agree afterwards. Twice,
    as two epochs."""
    params = start()
    opt = commlib.DistributedOptimizer(comm, params, SGD(0.1, momentum=0.5), clip_norm=50.0)
    sched = LinearLR(opt, start_factor=0.5, total_iters=4)
    ref_p, buf, t, lrs = as64(params), None, 0, []
    for epoch in range(2):
        mine = 3 + RANK + epoch
        with opt.join():
            for k in range(mine):
                assert opt.step(grads_of(RANK, 100 * epoch + k)) is True
                sched.step()
        longest = 3 + SIZE - 1 + epoch
        for k in range(longest):
            active = [r for r in range(SIZE) if k < 3 + r + epoch]
            mean = mean_grads(100 * epoch + k, ranks=active)
            norm = math.sqrt(sum(float((m * m).sum()) for m in mean))
            coef = min(1.0, 50.0 / (norm + 1e-6))
            mean = [m * coef for m in mean]
            lr = 0.1 * (0.5 + 0.5 * min(t, 4) / 4)
            lrs.append(lr)
            buf = [m.copy() for m in mean] if buf is None else [0.5 * b + m
                                                               for b, m in zip(buf, mean)]
            ref_p = [p - lr * b for p, b in zip(ref_p, buf)]
            t += 1
        close(params, ref_p, what="join epoch %d" % epoch)
        assert sched.last_epoch == t and opt.steps == t, (sched.last_epoch, opt.steps, t)
        assert opt.param_groups[0]["lr"] == 0.1 * (0.5 + 0.5 * min(t, 4) / 4)
        opt.check_parameters()
    return {"updates": t, "own_batches": [3 + RANK, 4 + RANK]}


CHECKS = {"groups": check_groups, "schedules": check_schedules, "clip": check_clip,
          "agree": check_agree,
          "scaler": check_scaler, "scaler_residuals": check_scaler_residuals,
          "scaler_half": check_scaler_half, "nonfinite": check_nonfinite,
          "no_sync": check_no_sync, "sampler": check_sampler, "join": check_join}
NEEDS_DIR = ("groups", "schedules")


def main():
    names = sys.argv[1].split(",")
    comm = new_comm()
    for name in names:
        record = CHECKS[name](comm, sys.argv[2]) if name in NEEDS_DIR else CHECKS[name](comm)
        comm.barrier()
        print(json.dumps(dict(record, rank=RANK, size=SIZE, check=name)), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
