"""commlib.optim: the DistributedOptimizer's results on real MPI jobs of 1 to
4 ranks against numpy references (tests/optim/optimizer_programs.py), and its
argument checks, partition and rules in this process (ranks as threads,
tests/inprocess.py)."""
import math

import numpy as np
import pytest

import commlib
from commlib.compression import Partial
from commlib.errors import ArgumentError
from commlib.optim import SGD, Adam
from inprocess import errors_of, run_ranks
from mpirun import run_mpi

SIZES = [1, 2, 3, 4]
CODE = "import optimizer_programs\noptimizer_programs.main()\n"


#: rank programs (optimizer_programs.CHECKS) and the world sizes they run at:
#: rules against float64 references of the mean gradient, step(grads); a
#: softmax regression on shards against one process on the whole batch
#: (also accumulated); accumulation against one step on the mean; SINGA's
#: half, partial and sparse updates; overlap against no overlap, bit for
#: bit; parameter broadcast and check; checkpoints continued
PROGRAMS = [("rules,step_grads", SIZES), ("model,model_accumulate", SIZES),
            ("accumulate", [1, 3, 4]), ("half,partial,sparse", SIZES),
            ("overlap", [2, 3, 4]), ("parameters", SIZES), ("state", [1, 2, 3])]


@pytest.mark.parametrize("checks, n", [(c, n) for c, sizes in PROGRAMS for n in sizes],
                         ids=["%s-%d" % (c, n) for c, sizes in PROGRAMS for n in sizes])
def test_rank_programs_match_numpy_references(checks, n, tmp_path):
    proc = run_mpi(n, CODE, timeout=180, args=[checks, str(tmp_path)])
    assert all("rank %d ok" % r in proc.stdout for r in range(n)), proc.stdout


# -- partition ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 10, 13, 1001])
def test_partition_covers_every_item_once_or_equal_shards(size, n):
    shards = [commlib.partition(n, r, size, drop_remainder=False) for r in range(size)]
    items = np.concatenate([np.arange(n)[s] for s in shards])
    assert items.tolist() == list(range(n))
    lengths = [len(range(n)[s]) for s in shards]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    equal = [range(n)[commlib.partition(n, r, size)] for r in range(size)]
    assert all(len(s) == n // size for s in equal)
    flat = [i for s in equal for i in s]
    assert flat == list(range(n // size * size))       # contiguous, in rank order


@pytest.mark.parametrize("args, fragment", [
    ((-1, 0, 2), "n must be >= 0"), ((5, 2, 2), "0 <= rank < size"),
    ((5, 0, 0), "0 <= rank < size"), ((5.0, 0, 2), "n must be an int"),
    ((5, True, 2), "rank must be an int")])
def test_partition_rejects_bad_arguments(args, fragment):
    with pytest.raises(ArgumentError, match=fragment):
        commlib.partition(*args)


# -- argument checks --------------------------------------------------------------------------

def params_of(xp=np):
    return commlib.flat_arrays([(3, 4), (5,)], xp=xp)


def opt_of(comm, **kw):
    return commlib.DistributedOptimizer(comm, params_of(), SGD(0.1), **kw)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("make, fragments", [
    (lambda c: commlib.DistributedOptimizer(c, [], SGD(0.1)), ["params", "empty"]),
    (lambda c: commlib.DistributedOptimizer(c, np.zeros(3), SGD(0.1)), ["params"]),
    (lambda c: commlib.DistributedOptimizer(c, params_of(), "sgd"), ["rule"]),
    (lambda c: opt_of(c, accumulate=0), ["accumulate", "got 0"]),
    (lambda c: opt_of(c, accumulate=1.5), ["accumulate"]),
    (lambda c: opt_of(c, accumulate=True), ["accumulate"]),
    (lambda c: opt_of(c, overlap="yes"), ["overlap"]),
    (lambda c: opt_of(c, bucket_bytes=0), ["bucket_bytes"]),
    (lambda c: opt_of(c, compression="zip"), ["compression='zip'"]),
    (lambda c: opt_of(c).step([np.zeros((3, 4), np.float32)]), ["grads", "list of 2"]),
    (lambda c: opt_of(c).step(np.zeros(3)), ["grads", "list of 2"]),
    (lambda c: opt_of(c).step([np.zeros((3, 4), np.float32), np.zeros(6, np.float32)]),
     ["grads[1]", "shape (6,)", "params[1]", "shape (5,)"]),
    (lambda c: opt_of(c).step([np.zeros((3, 4), np.float64), np.zeros(5, np.float32)]),
     ["grads[0]", "float64", "params[0]", "float32"]),
    (lambda c: opt_of(c).grad_ready(2), ["grad_ready", "[0, 2)", "got 2"]),
    (lambda c: opt_of(c).grad_ready(-1), ["grad_ready", "got -1"]),
    (lambda c: [opt.grad_ready(1) for opt in [opt_of(c, overlap=False)] for _ in range(2)],
     ["grad_ready(1)", "already"]),
    (lambda c: setattr(opt_of(c), "lr", -0.1), ["lr", ">= 0", "-0.1"]),
    (lambda c: setattr(opt_of(c), "lr", float("nan")), ["lr", "nan"]),
    (lambda c: setattr(opt_of(c), "lr", "0.1"), ["lr", "'0.1'"]),
    (lambda c: setattr(commlib.DistributedOptimizer(c, params_of(), lambda p, g: None),
                       "lr", 0.1), ["lr", "no learning rate"]),
    (lambda c: [(opt.step(), opt.state_dict()) for opt in [opt_of(c, accumulate=2)]],
     ["state_dict", "1 of 2 micro-batches"]),
])
def test_argument_errors_name_the_argument_and_rank(n, make, fragments):
    for rank, text in enumerate(errors_of(n, make)):
        assert ("rank %d:" % rank) in text, text
        for fragment in fragments:
            assert fragment in text, (fragment, text)


def test_a_rejected_step_changes_nothing():
    def body(comm):
        opt = opt_of(comm)
        before = [p.copy() for p in opt.params]
        with pytest.raises(ArgumentError):
            opt.step([np.ones((3, 4), np.float32), np.ones(4, np.float32)])
        assert all(np.array_equal(p, b) for p, b in zip(opt.params, before))
        assert opt.steps == 0
        opt.step([np.ones((3, 4), np.float32), np.ones(5, np.float32)])
        return [p.copy() for p in opt.params], [b - 0.1 for b in before]
    for got, want in run_ranks(2, body):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("make, fragment", [
    (lambda: SGD(-1), "SGD: lr"), (lambda: SGD(math.inf), "SGD: lr"),
    (lambda: SGD(0.1, momentum=-0.5), "momentum"), (lambda: SGD(0.1, nesterov=True),
                                                    "nesterov=True needs momentum"),
    (lambda: SGD(0.1, nesterov=1), "nesterov must be True or False"),
    (lambda: SGD(0.1, weight_decay=-1), "weight_decay"),
    (lambda: Adam(betas=(0.9, 1.0)), "betas[1]"), (lambda: Adam(betas=0.9), "betas"),
    (lambda: Adam(eps=-1e-8), "eps"), (lambda: Adam(lr=None), "Adam: lr")])
def test_rules_reject_bad_hyperparameters(make, fragment):
    with pytest.raises(ArgumentError) as info:
        make()
    assert fragment in str(info.value)


def test_lr_may_change_between_steps_and_zero_stops_training():
    def body(comm):
        opt = opt_of(comm)
        opt.lr = 0
        opt.step([np.ones((3, 4), np.float32), np.ones(5, np.float32)])
        zero = [p.copy() for p in opt.params]
        opt.rule.lr = 0.5
        opt.step([np.ones((3, 4), np.float32), np.ones(5, np.float32)])
        return zero, [p.copy() for p in opt.params], opt.lr
    for zero, after, lr in run_ranks(2, body):
        assert all((z == 0).all() for z in zero) and all((a == -0.5).all() for a in after)
        assert lr == 0.5


def test_grads_are_flat_views_like_params_per_dtype():
    def body(comm):
        params = [np.zeros(3, np.float32), np.zeros((2, 2)), np.zeros(4, np.float32),
                  np.zeros((), np.float16)]
        opt = commlib.DistributedOptimizer(comm, params, SGD(0.1))
        return [(g.shape, g.dtype, g.base is not None, (g == 0).all()) for g in opt.grads], \
            opt.grads[0].base is opt.grads[2].base
    (layout, shared), = run_ranks(1, body)
    assert [(s, d) for s, d, _, _ in layout] == [((3,), np.float32), ((2, 2), np.float64),
                                                  ((4,), np.float32), ((), np.float16)]
    assert all(view and zero for _, _, view, zero in layout) and shared


def test_partial_compression_makes_step_a_partial_update():
    """compression=Partial(f): step() updates locally and averages a window
    of the parameters, the same as update_partial(fraction=f)."""
    def body(comm):
        runs = []
        for use_step in (True, False):
            params = [np.zeros(8, np.float32), np.zeros(2, np.float32)]
            if not use_step:
                params.append(np.zeros(1, np.float32))       # a layout (window count) of its own
            opt = commlib.DistributedOptimizer(
                comm, params, SGD(1.0), compression=Partial(0.5) if use_step else None)
            g = [np.full(p.shape, comm.rank + 1.0, np.float32) for p in params]
            opt.step(g) if use_step else opt.update_partial(g, fraction=0.5)
            runs.append(np.concatenate(params))
        return runs
    for rank, (stepped, updated) in enumerate(run_ranks(2, body)):
        # 10 values, windows of 5: the first five are the average -1.5, the rest -(rank+1)
        want = np.array([-1.5] * 5 + [-(rank + 1.0)] * 5, np.float32)
        assert np.array_equal(stepped, want), stepped
        # 11 values, windows of 6
        want = np.array([-1.5] * 6 + [-(rank + 1.0)] * 5, np.float32)
        assert np.array_equal(updated, want), updated


@pytest.mark.parametrize("compression, itemsize", [(None, 4), ("fp16", 2)])
def test_stats_count_steps_time_and_bytes_after_compression(compression, itemsize):
    def body(comm):
        opt = opt_of(comm, compression=compression)
        for _ in range(3):
            opt.step([np.ones((3, 4), np.float32), np.ones(5, np.float32)])
        comm.all_reduce(np.ones(100))               # not the optimizer's
        return opt.stats
    for stats in run_ranks(2, body):
        assert stats["steps"] == 3 and stats["comm_seconds"] > 0
        assert stats["bytes_sent"] == 3 * 17 * itemsize, stats


def test_a_started_overlapped_update_must_finish_with_step():
    """After grad_ready started the buckets with the constructor's
    compression, update_half is refused without touching anything, and
    step() completes the update."""
    def body(comm):
        opt = opt_of(comm, bucket_bytes=16)
        for g in opt.grads:
            g[...] = comm.rank + 1.0
        opt.grad_ready(1)
        opt.grad_ready(0)
        with pytest.raises(ArgumentError, match="finish it with step"):
            opt.update_half()
        assert opt.steps == 0 and opt.step() is True
        return [p.copy() for p in opt.params]
    for params in run_ranks(2, body):
        assert all((p == -0.15).all() for p in params), params


class RecordingReducer:
    """Stands in for the optimizer's BackwardReducer: what grads[i] held
    when ready(i) was called, and the wait() calls."""

    def __init__(self, grads):
        self.grads, self.readies, self.waits = grads, [], 0

    def ready(self, i):
        self.readies.append((i, self.grads[i].copy()))

    def wait(self):
        self.waits += 1
        return self.grads


@pytest.mark.parametrize("overlap", [True, False])
def test_grad_ready_hands_the_reducer_final_means_on_the_last_micro_batch(overlap):
    """The reducer (whose asynchronous all-reduce reads the array) sees
    grads[i] only once it is the mean of the micro-batches, and only on
    the last micro-batch; without overlap it is only waited for."""
    def body(comm):
        opt = opt_of(comm, accumulate=2, overlap=overlap)
        spy = opt._reducers[None] = RecordingReducer(opt.grads)
        a = [np.full((3, 4), 1.0, np.float32), np.full(5, 2.0, np.float32)]
        b = [np.full((3, 4), 3.0, np.float32), np.full(5, 6.0, np.float32)]
        install = lambda gs: [g.__setitem__(Ellipsis, x) for g, x in zip(opt.grads, gs)]
        install(a)
        opt.grad_ready(1)
        opt.grad_ready(0)
        assert opt.step() is False and not spy.readies and spy.waits == 0
        install(b)
        opt.grad_ready(1)
        readies = list(spy.readies)
        assert opt.step() is True and spy.waits == 1
        return readies, [g.copy() for g in opt.grads]
    (readies, grads), = run_ranks(1, body)
    if overlap:
        assert len(readies) == 1 and readies[0][0] == 1
        assert (readies[0][1] == 4.0).all()
    else:
        assert readies == []
    assert (grads[0] == 2.0).all() and (grads[1] == 4.0).all()


def test_a_non_finite_gradient_skips_the_update_on_every_rank():
    """With fp16 compression an inf on one rank raises NonFiniteError on
    every rank, the parameters and step count stay, and the next update
    works (a loss scaler's skipped step)."""
    def body(comm):
        opt = opt_of(comm, compression="fp16", bucket_bytes=16)
        before = [p.copy() for p in opt.params]
        bad = [np.ones((3, 4), np.float32), np.ones(5, np.float32)]
        if comm.rank == 1:
            bad[0][1, 2] = np.inf
        with pytest.raises(commlib.NonFiniteError) as info:
            opt.step(bad)
        assert info.value.culprits == (1,)
        unchanged = all(np.array_equal(p, b) for p, b in zip(opt.params, before))
        assert opt.step([np.full((3, 4), comm.rank + 1.0, np.float32),
                         np.full(5, comm.rank + 1.0, np.float32)]) is True
        return unchanged, opt.steps, [p.copy() for p in opt.params]
    for unchanged, steps, params in run_ranks(2, body):
        assert unchanged and steps == 1
        assert all((p == np.float32(-0.1 * 1.5)).all() for p in params), params


def test_checkpoint_of_bfloat16_parameters_round_trips(tmp_path):
    """.npz files store bfloat16 as raw 2-byte records; load takes them
    back as the parameters' dtype."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 on numpy needs ml_dtypes")

    def body(comm):
        params = [np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16),
                  np.ones(3, np.float32)]
        opt = commlib.DistributedOptimizer(comm, params, SGD(0.5, momentum=0.9))
        opt.step([np.ones(6, ml_dtypes.bfloat16), np.ones(3, np.float32)])
        commlib.optim.save(str(tmp_path / "bf16.npz"), opt)
        other = commlib.DistributedOptimizer(
            comm, [np.zeros(6, ml_dtypes.bfloat16), np.zeros(3, np.float32)],
            SGD(0.5, momentum=0.9))
        commlib.optim.load(str(tmp_path / "bf16.npz"), other)
        return opt.state_dict(), other.state_dict()
    (want, got), = run_ranks(1, body)
    assert sorted(want) == sorted(got)
    for name in want:
        assert want[name].dtype == got[name].dtype and want[name].tobytes() == got[name].tobytes()
    assert want["params.0"].dtype == ml_dtypes.bfloat16 and want["steps"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("make", [lambda: SGD(0.05, momentum=0.9, nesterov=True,
                                              weight_decay=0.01), lambda: Adam(0.01)])
def test_cupy_parameters_follow_the_numpy_rules(make, tmp_path):
    """The rules on cupy arrays (one GPU, one rank) give the parameters the
    same rules give on numpy; checkpoints and the parameter check on cupy."""
    import cupy
    comm = commlib.Communicator.single()
    rng = np.random.default_rng(3)
    host = [rng.standard_normal(s).astype(np.float32) for s in [(33, 7), (7,), (1001,)]]
    gpu = commlib.flat_arrays([h.shape for h in host], xp=cupy)
    for g, h in zip(gpu, host):
        g.set(h)
    on_host = commlib.DistributedOptimizer(comm, host, make())
    on_gpu = commlib.DistributedOptimizer(comm, gpu, make())
    for step in range(4):
        grads = [rng.standard_normal(h.shape).astype(np.float32) for h in host]
        on_host.step(grads)
        on_gpu.step([cupy.asarray(g) for g in grads])
    for g, h in zip(gpu, host):
        np.testing.assert_allclose(g.get(), h, rtol=1e-5, atol=1e-6)
    on_gpu.check_parameters()
    commlib.optim.save(str(tmp_path / "gpu.npz"), on_gpu)
    again = commlib.DistributedOptimizer(
        comm, commlib.flat_arrays([h.shape for h in host], xp=cupy), make())
    commlib.optim.load(str(tmp_path / "gpu.npz"), again)
    for a, b in zip(again.params, gpu):
        assert isinstance(a, cupy.ndarray) and bool((a == b).all())
    comm.close()


@pytest.mark.parametrize("make", [lambda: SGD(0.1), lambda: SGD(0.05, momentum=0.9,
                                                                 nesterov=True,
                                                                 weight_decay=0.1),
                                  lambda: Adam(0.01, weight_decay=0.01)])
def test_flat_parameters_update_as_one_array_with_the_same_bits_and_state(make, tmp_path):
    """Parameters that are flat_arrays views (updated run by run as one
    array) and separate arrays of the same values get the same bits and
    the same per-parameter state, and checkpoints move between them."""
    shapes = [(3, 5), (), (0,), (7,), (2, 2)]

    def body(comm):
        rng = np.random.default_rng(11)
        values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        flat = commlib.flat_arrays(shapes)
        flat.insert(2, np.array(values[1], np.float64))       # a dtype run of its own
        separate = [np.array(v) for v in values]
        separate.insert(2, np.array(values[1], np.float64))
        for f, v in zip(flat, separate):
            f[...] = v
        opts = [commlib.DistributedOptimizer(comm, ps, make()) for ps in (flat, separate)]
        # the empty array is a run of its own (no memory to lie in)
        assert opts[0]._runs == [[0, 1], [2], [3], [4, 5]]
        assert opts[1]._runs == [[i] for i in range(len(separate))]
        for step in range(3):
            grads = [rng.standard_normal(p.shape).astype(p.dtype) for p in separate]
            for opt in opts:
                opt.step(grads)
        states = [opt.state_dict() for opt in opts]
        commlib.optim.save(str(tmp_path / "flat"), opts[0])
        other = commlib.DistributedOptimizer(comm, [np.zeros_like(p) for p in separate], make())
        commlib.optim.load(str(tmp_path / "flat"), other)
        grads = [rng.standard_normal(p.shape).astype(p.dtype) for p in separate]
        for opt in opts + [other]:
            opt.step(grads)
        return [[p.tobytes() for p in opt.params] for opt in opts + [other]], states
    (params, (fused, plain)), = run_ranks(1, body)
    assert params[0] == params[1] == params[2]
    assert sorted(fused) == sorted(plain)
    assert all(fused[k].tobytes() == plain[k].tobytes() and fused[k].shape == plain[k].shape
               for k in fused)


def test_a_rule_keeps_the_state_of_one_list_of_arrays():
    rule = SGD(0.1, momentum=0.9)
    p, g = [np.ones(3), np.ones(2)], [np.ones(3), np.ones(2)]
    rule(p, g)
    assert sorted(rule.state(p)) == ["momentum.0", "momentum.1"]
    assert (rule.state(p)["momentum.0"] == 1).all() and (p[0] == 0.9).all()
    with pytest.raises(ArgumentError, match="holds state for 2 arrays, called with 1"):
        rule(p[:1], g[:1])
    adam = Adam(0.1)
    adam(p, g)
    assert adam.t == 1 and sorted(adam.state(p)) == ["m.0", "m.1", "t", "v.0", "v.1"]


class CountingRule:
    """A callable rule with state: p -= g / (calls so far + 1)."""

    def __init__(self):
        self.calls = np.zeros((), np.int64)

    def __call__(self, params, grads):
        self.calls += 1
        for p, g in zip(params, grads):
            p -= g / float(self.calls)

    def state(self, params):
        return {"calls": self.calls}


def test_a_callable_rule_with_state_is_checkpointed(tmp_path):
    def body(comm):
        opt = commlib.DistributedOptimizer(comm, params_of(), CountingRule())
        ones = [np.ones((3, 4), np.float32), np.ones(5, np.float32)]
        for _ in range(2):
            opt.step(ones)
        if comm.rank == 0:
            commlib.optim.save(str(tmp_path / "counting"), opt)
        comm.barrier()
        other = commlib.DistributedOptimizer(comm, params_of(), CountingRule())
        commlib.optim.load(str(tmp_path / "counting"), other)
        for o in (opt, other):
            o.step(ones)
        return int(other.rule.calls), [p.copy() for p in other.params]
    for calls, params in run_ranks(2, body):
        assert calls == 3
        want = np.float32(-1.0) - np.float32(0.5) - np.float32(1 / 3)
        assert all(np.allclose(p, want, rtol=1e-6) for p in params), params
