"""commlib.optim against PyTorch as the oracle: every scheduler alone and in
pairs stepped together (torch's chainable form), with a learning rate set by
hand between steps; clipping by the global norm of gradients whose float32
squares overflow or underflow (torch's clip_grad_norm_ on float64 copies);
and examples/torch_train.py, a torch model trained through
DistributedOptimizer on two ranks, against torch.optim.SGD on the average
of the ranks' gradients (DDP's semantics). Ranks are threads of this process
(tests/inprocess.py)."""
import itertools
import math

import numpy as np
import pytest

import commlib
from commlib.optim import (SGD, CosineAnnealingLR, ExponentialLR, LambdaLR, LinearLR,
                           LinearWarmup, SequentialLR, StepLR)
from inprocess import run_ranks
from mpirun import ROOT

torch = pytest.importorskip("torch")
tls = torch.optim.lr_scheduler

BASES = [0.1, 0.02]          # two parameter groups of their own base lr


def inverse(t):
    return 1.0 / (t + 1)


#: name -> (commlib maker, torch maker), each called with its optimizer. The
#: sequences restart a scheduler at each milestone at a value other than the
#: one the previous scheduler would have gone on to (and warm-up then cosine,
#: whose values meet there); the periodic ones are stepped over several periods.
SCHEDULERS = {
    "step": (lambda o: StepLR(o, 3, gamma=0.5), lambda o: tls.StepLR(o, 3, gamma=0.5)),
    "exp": (lambda o: ExponentialLR(o, 0.9), lambda o: tls.ExponentialLR(o, 0.9)),
    "cos": (lambda o: CosineAnnealingLR(o, 5, eta_min=0.001),
            lambda o: tls.CosineAnnealingLR(o, 5, eta_min=0.001)),
    "linear": (lambda o: LinearLR(o, 0.25, 0.9, total_iters=4),
               lambda o: tls.LinearLR(o, 0.25, 0.9, total_iters=4)),
    "warmup": (lambda o: LinearWarmup(o, 4), lambda o: tls.LinearLR(o, 0.25, 1.0, 3)),
    "lambda": (lambda o: LambdaLR(o, inverse), lambda o: tls.LambdaLR(o, inverse)),
    "seq": (lambda o: SequentialLR(o, [StepLR(o, 2, gamma=0.5), ExponentialLR(o, 0.8),
                                       LinearLR(o, 0.5, 1.0, total_iters=3)],
                                   milestones=[5, 9]),
            lambda o: tls.SequentialLR(o, [tls.StepLR(o, 2, gamma=0.5), tls.ExponentialLR(o, 0.8),
                                           tls.LinearLR(o, 0.5, 1.0, total_iters=3)],
                                       milestones=[5, 9])),
    "warmcos": (lambda o: SequentialLR(o, [LinearWarmup(o, 3), CosineAnnealingLR(o, 4)],
                                       milestones=[3]),
                lambda o: tls.SequentialLR(o, [tls.LinearLR(o, 1 / 3, 1.0, 2),
                                               tls.CosineAnnealingLR(o, 4)], milestones=[3])),
}
STEPS = 24
SET_AT = 13                  # an lr set by hand before this step (group 1: 0.07)


class TorchGroups(torch.optim.Optimizer):
    """What torch's schedulers need of an optimizer: its parameter groups
    and a step method (torch.optim.Optimizer's own constructor imports
    torch._dynamo, seconds of a test's time)."""

    def __init__(self, lrs):            # not Optimizer.__init__: see above
        self.param_groups = [{"params": [], "lr": lr} for lr in lrs]
        self.defaults, self.state = {}, {}

    def step(self, closure=None):
        return None


def schedules(comm, names):
    """The lrs of every group after construction and after each step, of
    commlib's schedulers ``names`` and torch's, made in that order on
    optimizers of two groups and stepped together."""
    opt = commlib.DistributedOptimizer(
        comm, [{"params": [np.zeros(2)], "lr": BASES[0]}, {"params": [np.zeros(1)],
                                                          "lr": BASES[1]}], SGD(0.1))
    topt = TorchGroups(BASES)
    ours = [SCHEDULERS[n][0](opt) for n in names]
    theirs = [SCHEDULERS[n][1](topt) for n in names]
    got, want = [[g["lr"] for g in opt.param_groups]], [[g["lr"] for g in topt.param_groups]]
    for step in range(1, STEPS):
        if step == SET_AT:
            opt.param_groups[1]["lr"] = topt.param_groups[1]["lr"] = 0.07
        topt.step()
        for a, b in zip(ours, theirs):
            a.step()
            b.step()
            assert a.get_last_lr() == b.get_last_lr()
            assert a.last_epoch == b.last_epoch
        got.append([g["lr"] for g in opt.param_groups])
        want.append([g["lr"] for g in topt.param_groups])
    return got, want


def check_schedules(cases):
    def body(comm):
        return [schedules(comm, names) for names in cases]
    for names, (got, want) in zip(cases, run_ranks(1, body)[0]):
        for step, (g, w) in enumerate(zip(got, want)):
            assert g == w, (names, step, got, want)      # the same floats


def test_each_scheduler_alone_matches_torch_at_every_step():
    """Every step of 24 (milestones, period boundaries, the hand-set lr
    continued from) for both groups."""
    check_schedules([(n,) for n in SCHEDULERS])


def test_schedulers_stepped_together_compose_like_torch():
    """Two schedulers on one optimizer, every ordered pair: e.g.
    ExponentialLR(0.9) and StepLR(3, 0.5) give 0.081 after two steps."""
    check_schedules(list(itertools.permutations(SCHEDULERS, 2)))

    def body(comm):
        opt = commlib.DistributedOptimizer(comm, [np.zeros(3)], SGD(0.1))
        a, b = ExponentialLR(opt, 0.9), StepLR(opt, 3, gamma=0.5)
        for _ in range(2):
            a.step()
            b.step()
        return opt.lr
    assert run_ranks(1, body)[0] == pytest.approx(0.081, rel=1e-14)


def test_a_scheduler_refuses_a_torch_optimizer_before_writing_into_it():
    topt = TorchGroups([0.1])
    with pytest.raises(TypeError, match="StepLR: optimizer must be a commlib.DistributedOptimizer"
                                        ", got test_against_torch.TorchGroups"):
        StepLR(topt, 3)
    with pytest.raises(TypeError, match="SequentialLR: optimizer must be a commlib"):
        SequentialLR(topt, [], milestones=[])
    assert topt.param_groups == [{"params": [], "lr": 0.1}] and not hasattr(topt, "schedulers")


# -- clipping: float32 squares that overflow or underflow ---------------------------------------

def torch_clipped(grads, clip):
    """torch.nn.utils.clip_grad_norm_ on float64 copies: (clipped, norm)."""
    tensors = [torch.tensor(np.asarray(g, np.float64)) for g in grads]
    for t in tensors:
        t.grad = t.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(tensors, clip))
    return [t.grad.numpy() for t in tensors], norm


@pytest.mark.parametrize("scale, clip", [(1e20, 1.0), (1e20, 1e30), (1e-30, 5e-7),
                                         (1e-30, 1.0)], ids=["overflow-clipped", "overflow",
                                                             "underflow-clipped", "underflow"])
def test_clipping_float32_gradients_whose_squares_overflow_or_underflow(scale, clip):
    """float32 gradients of 1e20 (squares beyond float32) and of 1e-30
    (squares below it), averaged over two ranks beside a float64 array:
    the norm and the clipped gradients are torch's on float64 copies, where
    float32 squares would give inf (every gradient zeroed) or 0."""
    shapes = [(40, 25), (7,), (3,)]
    dtypes = [np.float32, np.float32, np.float64]

    def grads_of(rank):
        rng = np.random.default_rng([5, rank])
        out = [rng.standard_normal(s) for s in shapes]
        out[0] *= scale
        out[1] *= scale
        out[2] *= scale if scale > 1 else 1e-31      # float64: its own, small part
        return [g.astype(d) for g, d in zip(out, dtypes)]

    def body(comm):
        opt = commlib.DistributedOptimizer(comm, [np.zeros(s, d) for s, d in zip(shapes, dtypes)],
                                           SGD(0.0), clip_norm=clip)
        opt.step(grads_of(comm.rank))
        return [g.copy() for g in opt.grads], opt.last_grad_norm
    mean = [(a.astype(np.float64) + b) / 2 for a, b in zip(grads_of(0), grads_of(1))]
    want, norm = torch_clipped(mean, clip)
    assert math.isfinite(norm) and norm > 0
    for got, got_norm in run_ranks(2, body):
        assert got_norm == pytest.approx(norm, rel=1e-6, abs=0)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.astype(np.float64), w, rtol=2e-6, atol=0)


def test_clipping_float16_gradients_by_a_tiny_coefficient():
    """float16 gradients of about 3e4 clipped to 1e-2 by a coefficient
    (1e-8) below float16's smallest number (6e-8): scaled in float32, not
    zeroed."""
    def body(comm):
        opt = commlib.DistributedOptimizer(comm, [np.zeros(1000, np.float16)], SGD(0.0),
                                           clip_norm=1e-2)
        opt.step([np.full(1000, 30000.0 - 1024 * comm.rank, np.float16)])
        return opt.grads[0].copy(), opt.last_grad_norm
    mean = [np.full(1000, (30000.0 + 28976.0) / 2)]
    want, norm = torch_clipped(mean, 1e-2)
    for got, got_norm in run_ranks(2, body):
        assert got_norm == pytest.approx(norm, rel=1e-6, abs=0)
        assert (got != 0).all()
        np.testing.assert_allclose(got.astype(np.float64), want[0], rtol=1e-3)


# -- the torch example --------------------------------------------------------------------------

def test_torch_example_trains_like_torch_sgd_on_the_mean_gradient(monkeypatch):
    """examples/torch_train.py's train() on two ranks: every rank's model
    equals one torch model trained by SGD with momentum (torch.optim.SGD's
    update, written out: its constructor would import torch._dynamo) on the
    average of the ranks' shard gradients (DDP's semantics), step by step;
    the loop in docs/training.md is the example's, line for line."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import torch_train
    steps, batch, lr, mu = 6, 8, 0.05, 0.9
    results = run_ranks(2, lambda comm: torch_train.train(comm, steps=steps, batch=batch, lr=lr,
                                                          momentum=mu))
    model = torch_train.make_model(0)
    loss_fn = torch.nn.MSELoss()
    bufs = None
    for x, y in torch_train.batches(steps, batch):
        mean = None
        for rank in range(2):
            shard = commlib.partition(batch, rank, 2)
            model.zero_grad()
            loss_fn(model(x[shard]), y[shard]).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            mean = grads if mean is None else [(a + b) / 2 for a, b in zip(mean, grads)]
        bufs = mean if bufs is None else [mu * b + g for b, g in zip(bufs, mean)]
        with torch.no_grad():
            for p, b in zip(model.parameters(), bufs):
                p -= lr * b
    for trained, losses in results:
        assert len(losses) == steps and losses[-1] < losses[0]
        for p, q in zip(trained.parameters(), model.parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5,
                                       atol=1e-6)
    # the documentation shows the example's own loop
    doc = (ROOT / "docs" / "training.md").read_text()
    block = doc.split("<!-- examples/torch_train.py -->", 1)[1].split("```python", 1)[1]
    block = block.split("```", 1)[0]
    source = [line.strip() for line in (ROOT / "examples" / "torch_train.py").read_text()
              .splitlines()]
    at = 0
    for line in (x.strip() for x in block.splitlines()):
        if line:
            assert line in source[at:], (line, "not in examples/torch_train.py in this order")
            at = source.index(line, at) + 1
