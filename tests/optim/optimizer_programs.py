"""Rank programs of tests/optim/test_optimizer.py: commlib.DistributedOptimizer on
real MPI ranks against numpy references written here, independently of
commlib.optim (float64 arithmetic on every rank's inputs, which each rank
regenerates from their seeds, or gathers with plain mpi4py).

    mpiexec -n N python -c "import optimizer_programs as p; p.main()" CHECK[,CHECK...] DIR

Each check raises AssertionError on a wrong result (ending the job); every
rank prints "rank R ok" at the end.
"""
import math
import os
import sys

import numpy as np
from mpi4py import MPI

import commlib
from commlib.compression import Partial
from commlib.optim import SGD, Adam

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
#: parameter shapes with odd, empty and 0-d members, and their dtypes
SHAPES = [(3, 5), (), (0,), (7,), (1001,), (2, 2, 3)]
DTYPES = ["float32", "float32", "float32", "float64", "float32", "float64"]


def new_comm():
    """A communicator of its own (compression state is per communicator)."""
    return commlib.Communicator.from_mpi(WORLD)


def start(shapes=SHAPES, dtypes=DTYPES, seed=0):
    """The same initial parameters on every rank."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(d) for s, d in zip(shapes, dtypes)]


def grads_of(rank, step, shapes=SHAPES, dtypes=DTYPES, seed=1):
    """Rank ``rank``'s gradients at ``step``."""
    rng = np.random.default_rng([seed, step, rank])
    return [rng.standard_normal(s).astype(d) for s, d in zip(shapes, dtypes)]


def mean_grads(step, **kw):
    """float64 mean over the ranks of grads_of(r, step)."""
    every = [grads_of(r, step, **kw) for r in range(SIZE)]
    return [np.mean([e[i].astype(np.float64) for e in every], axis=0)
            for i in range(len(every[0]))]


def install(opt, grads):
    for mine, g in zip(opt.grads, grads):
        mine[...] = g


def close(got, want, rtol=2e-5, atol=2e-6, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=rtol, atol=atol,
                                   err_msg="%s rank %d array %d" % (what, RANK, i))


# -- float64 references of the rules ------------------------------------------------------

class RefSGD:
    def __init__(self, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
        self.lr, self.mu, self.nesterov, self.wd = lr, momentum, nesterov, weight_decay
        self.buf = None

    def __call__(self, p, g):
        if self.buf is None:
            self.buf = [np.zeros_like(x) for x in p]
        out = []
        for i, (x, d) in enumerate(zip(p, g)):
            d = d + self.wd * x
            if self.mu:
                self.buf[i] = self.mu * self.buf[i] + d
                d = d + self.mu * self.buf[i] if self.nesterov else self.buf[i]
            out.append(x - self.lr * d)
        return out


class RefAdam:
    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.m = self.v = None
        self.t = 0

    def __call__(self, p, g):
        if self.m is None:
            self.m = [np.zeros_like(x) for x in p]
            self.v = [np.zeros_like(x) for x in p]
        self.t += 1
        b1, b2 = self.betas
        out = []
        for i, (x, d) in enumerate(zip(p, g)):
            d = d + self.wd * x
            self.m[i] = b1 * self.m[i] + (1 - b1) * d
            self.v[i] = b2 * self.v[i] + (1 - b2) * d * d
            m_hat = self.m[i] / (1 - b1 ** self.t)
            v_hat = self.v[i] / (1 - b2 ** self.t)
            out.append(x - self.lr * m_hat / (np.sqrt(v_hat) + self.eps))
        return out


def user_rule(params, grads):
    """A rule given as a plain callable."""
    for p, g in zip(params, grads):
        p -= 0.25 * g * g


def ref_user_rule(p, g):
    return [x - 0.25 * d * d for x, d in zip(p, g)]


RULES = [
    (lambda: SGD(0.1), lambda: RefSGD(0.1)),
    (lambda: SGD(0.05, momentum=0.9), lambda: RefSGD(0.05, 0.9)),
    (lambda: SGD(0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
     lambda: RefSGD(0.05, 0.8, True, 0.01)),
    (lambda: Adam(0.01), lambda: RefAdam(0.01)),
    (lambda: Adam(0.002, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
     lambda: RefAdam(0.002, (0.8, 0.99), 1e-6, 0.1)),
    (lambda: user_rule, lambda: ref_user_rule),
]


def check_rules(comm):
    """Every rule, 4 steps, gradients marked ready in a rank-dependent order
    (or not at all), one-bucket and many-bucket layouts, lr changed
    midway: parameters match the float64 reference on the mean gradient."""
    for which, (make, make_ref) in enumerate(RULES):
        for bucket_bytes, ready in ((None, False), (64, True), (4096, True)):
            params = start()
            rule = make()
            opt = commlib.DistributedOptimizer(comm, params, rule, bucket_bytes=bucket_bytes)
            assert opt.params is not params and opt.params[0] is params[0]
            ref, want = make_ref(), [p.astype(np.float64) for p in params]
            for step in range(4):
                if step == 2 and hasattr(rule, "lr"):
                    opt.lr = rule.lr / 2
                    ref.lr /= 2
                install(opt, grads_of(RANK, step))
                if ready:
                    order = np.random.default_rng([step, RANK]).permutation(len(params))
                    for i in order:
                        opt.grad_ready(int(i))
                assert opt.step() is True
                want = ref(want, mean_grads(step))
                assert all(p.dtype == np.dtype(d) for p, d in zip(params, DTYPES))
                close(params, want, what="rule %d bucket_bytes %s step %d" % (
                    which, bucket_bytes, step))
            assert opt.steps == 4 and opt.stats["steps"] == 4
            # what was averaged is what the rule saw: the mean of the last step's gradients
            close(opt.grads, mean_grads(3), rtol=1e-5, atol=1e-6, what="grads")


def check_step_grads(comm):
    """step(grads) and update(grads) with the caller's own arrays equal the
    reference; opt.grads gets the averages, the caller's arrays stay."""
    params = start()
    opt = commlib.DistributedOptimizer(comm, params, SGD(0.1, momentum=0.5), overlap=False)
    ref, want = RefSGD(0.1, 0.5), [p.astype(np.float64) for p in params]
    for step in range(3):
        mine = grads_of(RANK, step)
        keep = [g.copy() for g in mine]
        assert (opt.step(mine) if step % 2 else opt.update(mine)) is True
        want = ref(want, mean_grads(step))
        close(params, want, what="step(grads) step %d" % step)
        assert all(np.array_equal(a, b) for a, b in zip(mine, keep))


# -- a real model: softmax regression ------------------------------------------------------

D, C, BATCH = 13, 5, 6        # features, classes, examples per rank and step


def dataset(n):
    rng = np.random.default_rng(42)
    x = rng.standard_normal((n, D)).astype(np.float32)
    y = rng.integers(0, C, n)
    return x, y


def softmax_grads(w, b, x, y):
    """Gradients of the mean cross-entropy of softmax(x @ w + b) (float64)."""
    z = x.astype(np.float64) @ w + b
    z -= z.max(axis=1, keepdims=True)
    prob = np.exp(z)
    prob /= prob.sum(axis=1, keepdims=True)
    prob[np.arange(len(y)), y] -= 1
    prob /= len(y)
    return [x.T.astype(np.float64) @ prob, prob.sum(axis=0)]


def check_model(comm, accumulate=1):
    """Each rank its shard of every global batch (with ``accumulate``
    micro-batches per shard) equals one process on the whole batch."""
    steps = 5
    n = steps * BATCH * SIZE
    x, y = dataset(n)
    params = commlib.flat_arrays([(D, C), (C,)])
    opt = commlib.DistributedOptimizer(comm, params, SGD(0.5, momentum=0.9),
                                       accumulate=accumulate)
    if RANK == 0:
        params[0][...] = np.random.default_rng(7).standard_normal((D, C)) * 0.1
    opt.broadcast_parameters(root=0)
    ref, want = RefSGD(0.5, 0.9), [p.astype(np.float64) for p in params]
    for step in range(steps):
        batch = slice(step * BATCH * SIZE, (step + 1) * BATCH * SIZE)
        bx, by = x[batch], y[batch]
        shard = commlib.partition(len(by), RANK, SIZE)
        sx, sy = bx[shard], by[shard]
        for micro in range(accumulate):
            part = commlib.partition(len(sy), micro, accumulate)
            for i, g in reversed(list(enumerate(softmax_grads(params[0], params[1],
                                                              sx[part], sy[part])))):
                opt.grads[i][...] = g
                opt.grad_ready(i)
            assert opt.step() is (micro == accumulate - 1)
        want = ref(want, softmax_grads(want[0], want[1], bx, by))
        close(params, want, rtol=1e-4, atol=1e-5, what="model step %d" % step)
    opt.check_parameters()


def check_model_accumulate(comm):
    check_model(comm, accumulate=2)


def check_accumulate(comm):
    """accumulate=3: two calls only accumulate (False, parameters
    untouched), the third applies SGD to the mean of the 3 micro-batches of
    every rank; step(grads), grad_ready and plain opt.grads mixed."""
    params = start()
    opt = commlib.DistributedOptimizer(comm, params, SGD(0.1, momentum=0.9, weight_decay=0.1),
                                       accumulate=3, bucket_bytes=256)
    ref, want = RefSGD(0.1, 0.9, weight_decay=0.1), [p.astype(np.float64) for p in params]
    for update in range(3):
        for micro in range(3):
            before = [p.copy() for p in params]
            step = update * 3 + micro
            if micro == 0:
                done = opt.step(grads_of(RANK, step))
            else:
                install(opt, grads_of(RANK, step))
                if micro == 2:
                    for i in range(len(params) - 1, -1, -2):
                        opt.grad_ready(i)
                done = opt.step()
            assert done is (micro == 2)
            if micro < 2:
                assert all(np.array_equal(a, b) for a, b in zip(params, before))
        means = [mean_grads(update * 3 + m) for m in range(3)]
        want = ref(want, [np.mean(g, axis=0) for g in zip(*means)])
        close(params, want, what="accumulate update %d" % update)
    assert opt.steps == 3


# -- SINGA's variants -----------------------------------------------------------------------

def check_half(comm):
    """update_half: from zero parameters with lr=1 the parameters are minus
    the average, which came through float16 (every value a float16 number)
    and is within float16 rounding of the exact mean."""
    shapes, dtypes = [(501,), (3, 7)], ["float32", "float32"]
    params = [np.zeros(s, np.float32) for s in shapes]
    opt = commlib.DistributedOptimizer(comm, params, SGD(1.0))
    assert opt.update_half(grads_of(RANK, 0, shapes, dtypes)) is True
    want = mean_grads(0, shapes=shapes, dtypes=dtypes)
    biggest = max(np.abs(g).max() for g in want)
    for p, w in zip(params, want):
        got = -p
        assert np.array_equal(got.astype(np.float16).astype(np.float32), got)
        np.testing.assert_allclose(got, w, rtol=0, atol=biggest * 2.0 ** -9)
        if SIZE > 1:     # the float32 average is not float16-representable everywhere
            assert not np.array_equal(got, w.astype(np.float32))


def partial_window(n, fraction, call):
    width = max(1, math.ceil(fraction * n))
    count = math.ceil(n / width)
    start = (call % count) * width
    return start, min(n, start + width)


def check_partial(comm):
    """update_partial: each rank SGD-updates with its own gradients, then a
    rotating window of the concatenated parameters is averaged; the
    reference tracks every rank's parameters. Also compression=Partial with
    step(), on a layout of its own."""
    for shapes, use_step in (([(5,), (3, 4), (10,)], False), ([(4, 4), (9,)], True)):
        dtypes = ["float32"] * len(shapes)
        params = [p for p in start(shapes, dtypes)]
        fraction = 0.3
        if use_step:
            opt = commlib.DistributedOptimizer(comm, params, SGD(0.1),
                                               compression=Partial(fraction))
        else:
            opt = commlib.DistributedOptimizer(comm, params, SGD(0.1))
        sizes = [int(np.prod(s)) for s in shapes]
        flat = np.concatenate([p.reshape(-1) for p in params]).astype(np.float64)
        ranks = [flat.copy() for _ in range(SIZE)]
        for call in range(7):
            every = [np.concatenate([g.reshape(-1) for g in grads_of(r, call, shapes, dtypes)])
                     for r in range(SIZE)]
            ranks = [x - 0.1 * g for x, g in zip(ranks, every)]
            lo, hi = partial_window(len(flat), fraction, call)
            mean = np.mean([x[lo:hi] for x in ranks], axis=0)
            for x in ranks:
                x[lo:hi] = mean
            mine = grads_of(RANK, call, shapes, dtypes)
            done = opt.step(mine) if use_step else opt.update_partial(mine, fraction=fraction)
            assert done is True
            got = np.concatenate([p.reshape(-1) for p in params])
            np.testing.assert_allclose(got, ranks[RANK], rtol=1e-5, atol=1e-6,
                                       err_msg="partial call %d" % call)
        assert sum(sizes) == len(flat)


def sparse_reference(accs, spars, topk):
    """(sent per rank, sum of the sent vectors): top-K (k = ceil(spars * n),
    largest magnitude, lowest index on ties) or |value| > spars."""
    sent = []
    for acc in accs:
        keep = np.zeros(acc.size, bool)
        if topk:
            k = min(acc.size, max(1, math.ceil(spars * acc.size)))
            keep[np.argsort(-np.abs(acc), kind="stable")[:k]] = True
        else:
            keep = np.abs(acc) > spars
        sent.append(np.where(keep, acc, 0.0))
    return sent, np.sum(sent, axis=0)


def check_sparse(comm):
    """update_sparse with top-K and threshold, with and without error
    feedback: the averaged sparse sum matches the reference, whose residuals
    this check tracks for every rank itself."""
    shapes, dtypes = [(37, 29), (29,)], ["float32", "float32"]
    for topk, spars in ((True, 0.05), (False, 1.5)):
        for corr in (True, False):
            params = [np.zeros(s, np.float32) for s in shapes]
            opt = commlib.DistributedOptimizer(comm, params, SGD(1.0))
            n = sum(int(np.prod(s)) for s in shapes)
            residual = [np.zeros(n) for _ in range(SIZE)]
            total = np.zeros(n)
            for step in range(4):
                every = [np.concatenate([g.reshape(-1).astype(np.float64) for g in
                                         grads_of(r, step, shapes, dtypes)])
                         for r in range(SIZE)]
                accs = [res + g for res, g in zip(residual, every)] if corr else every
                sent, summed = sparse_reference(accs, spars, topk)
                if corr:
                    residual = [a - s for a, s in zip(accs, sent)]
                total -= summed / SIZE
                assert opt.update_sparse(grads_of(RANK, step, shapes, dtypes), spars,
                                         topK=topk, corr=corr) is True
                got = np.concatenate([p.reshape(-1) for p in params])
                np.testing.assert_allclose(got, total, rtol=1e-5, atol=1e-5,
                                           err_msg="sparse topK=%s corr=%s step %d"
                                           % (topk, corr, step))
                # the averaged gradient itself is sparse: only what was sent
                avg = np.concatenate([g.reshape(-1) for g in opt.grads])
                assert np.array_equal(avg != 0, summed != 0)


# -- parameters and checkpoints ---------------------------------------------------------------

def check_parameters(comm):
    """broadcast_parameters makes every rank's parameters root's;
    check_parameters passes when equal and names exactly the ranks that
    differ (on every rank) when one or two ranks' one parameter differs."""
    for root in sorted({0, SIZE - 1}):
        params = start(seed=100 + RANK)
        commlib.broadcast_parameters(comm, params, root=root)
        want = start(seed=100 + root)
        assert all(np.array_equal(p, w) for p, w in zip(params, want))
        commlib.check_parameters(comm, params)
    opt = commlib.DistributedOptimizer(comm, start(seed=200 + RANK), SGD(0.1))
    opt.broadcast_parameters(root=SIZE - 1)
    opt.check_parameters()
    if SIZE < 2:
        return
    cases = {2: [([1], 3)], 3: [([2], 3), ([0], 1)]}.get(SIZE, [([2], 3), ([1, 3], 4),
                                                               ([0], 0)])
    for bad, where in cases:
        params = start(seed=300)
        if RANK in bad:
            params[where].reshape(-1)[RANK % params[where].size] += 1e-3 * (RANK + 1)
        try:
            commlib.check_parameters(comm, params)
        except commlib.ConsistencyError as exc:
            assert exc.culprits == tuple(bad), (exc.culprits, bad)
            text = str(exc)
            assert "rank %d:" % RANK in text and "params[%d]" % where in text, text
            assert ("ranks %s differ" % ", ".join(map(str, bad)) if len(bad) > 1
                    else "rank %d differ" % bad[0]) in text, text
        else:
            raise AssertionError("check_parameters passed with ranks %s differing" % bad)
    # a dtype that differs is a difference too, though the bytes are equal: rank 1
    # (at 2 ranks, a tie, the majority is the lowest rank's)
    params = [np.zeros(4, np.float32 if RANK != 1 else np.int32)]
    try:
        commlib.check_parameters(comm, params)
    except commlib.ConsistencyError as exc:
        assert exc.culprits == (1,), exc.culprits
        assert "rank 1 differ" in str(exc) and "params[0]" in str(exc), exc
    else:
        raise AssertionError("check_parameters passed with dtypes differing")


def check_state(comm, directory):
    """save on rank 0, load on every rank into a fresh optimizer with other
    parameters: continuing gives bit-identical parameters to uninterrupted
    training; load_state_dict with rank 0's dict only; a dict that does not
    fit raises ArgumentError on every rank."""
    path = os.path.join(directory, "checkpoint")        # saved under exactly this name
    for make in (lambda: Adam(0.01, weight_decay=0.01), lambda: SGD(0.1, momentum=0.9),
                 lambda: user_rule):
        params = start()
        a = commlib.DistributedOptimizer(comm, params, make())
        for step in range(3):
            a.step(grads_of(RANK, step))
        if RANK == 0:
            commlib.optim.save(path, a)
            assert sorted(os.listdir(directory)) == ["checkpoint"], os.listdir(directory)
        comm.barrier()
        fresh = [np.array(p + RANK + 1) for p in start()]
        b = commlib.DistributedOptimizer(comm, fresh, make())
        commlib.optim.load(path, b)
        assert b.steps == 3 and all(np.array_equal(x, y) for x, y in zip(fresh, params))
        c = commlib.DistributedOptimizer(comm, [np.array(p * 0) for p in start()], make())
        c.load_state_dict(a.state_dict() if RANK == 0 else None)
        for step in range(3, 6):
            for opt in (a, b, c):
                opt.step(grads_of(RANK, step))
        for other in (b, c):
            assert all(np.array_equal(x, y) for x, y in zip(other.params, params))
        state = a.state_dict()
        assert state["steps"] == 6 and all(
            np.array_equal(state["params.%d" % i], p) for i, p in enumerate(params))
        state["params.0"] += 1                  # a copy: the optimizer is unchanged
        assert not np.array_equal(state["params.0"], params[0])
        comm.barrier()
    bad = a.state_dict()
    del bad["params.1"]
    try:
        a.load_state_dict(bad if RANK == 0 else None)
    except commlib.ArgumentError as exc:
        assert "rank %d:" % RANK in str(exc) and "rank 0's state" in str(exc), exc
        assert RANK != 0 or "params.1" in str(exc), exc
    else:
        raise AssertionError("a state without params.1 was loaded")


def check_overlap(comm):
    """overlap=True (buckets started by grad_ready, in rank-dependent
    orders, some never marked) gives bit-identical parameters to
    overlap=False, per step, for several compressions and with
    accumulation."""
    cases = [(None, 1), ("fp16", 1), (lambda: commlib.compression.TopK(0.2), 1), (None, 3)]
    for compression, accumulate in cases:
        runs = []
        for overlap in (True, False):
            c = new_comm()
            params = start()
            strategy = compression() if callable(compression) else compression
            opt = commlib.DistributedOptimizer(c, params, SGD(0.1, momentum=0.9),
                                               compression=strategy, overlap=overlap,
                                               bucket_bytes=128, accumulate=accumulate)
            assert len(opt._reducer_for(opt.compression).buckets) > 2
            history = []
            for step in range(4 * accumulate):
                install(opt, grads_of(RANK, step))
                if overlap:
                    order = np.random.default_rng([step, RANK, 5]).permutation(len(params))
                    for i in order[: len(order) - step % 2]:
                        opt.grad_ready(int(i))
                if opt.step():
                    history.append([p.copy() for p in params])
            c.close()
            runs.append(history)
        assert len(runs[0]) == len(runs[1]) == 4
        for step, (x, y) in enumerate(zip(*runs)):
            for i, (p, q) in enumerate(zip(x, y)):
                assert p.tobytes() == q.tobytes(), (compression, accumulate, step, i)


CHECKS = {"rules": check_rules, "step_grads": check_step_grads, "model": check_model,
          "model_accumulate": check_model_accumulate, "accumulate": check_accumulate,
          "half": check_half, "partial": check_partial, "sparse": check_sparse,
          "parameters": check_parameters, "state": check_state, "overlap": check_overlap}


def main():
    names = sys.argv[1].split(",")
    comm = new_comm()
    for name in names:
        if name == "state":
            check_state(comm, sys.argv[2])
        else:
            CHECKS[name](comm)
        comm.barrier()
    comm.close()
    print("rank %d ok" % RANK, flush=True)


if __name__ == "__main__":
    main()
