"""ReduceState: compression state (error-feedback residuals) and fusion
plans owned by the caller, kept apart between lists of the same layout;
its name is compared between ranks."""
import numpy as np
import pytest

import commlib
from commlib.compression import TopK
from inprocess import run_ranks

SHAPES = [(7,), (3, 5), (11,)]


def grads(rank, step, salt):
    rng = np.random.default_rng(1000 * salt + 10 * step + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def reduce_steps(comm, lists, states, steps=3):
    """Steps of top-K all-reduces of each model's list, interleaved; returns
    each model's results per step."""
    out = {m: [] for m in lists}
    for step in range(steps):
        for m in lists:
            arrays = grads(comm.rank, step, m)
            comm.all_reduce(arrays, op="avg", compression=TopK(0.3), state=states.get(m))
            out[m].append([a.copy() for a in arrays])
    return out


def test_two_models_with_their_own_state_match_each_model_alone():
    def both(comm):
        return reduce_steps(comm, [1, 2], {1: commlib.ReduceState("model 1"),
                                           2: commlib.ReduceState("model 2")})

    def alone(model):
        return lambda comm: reduce_steps(comm, [model], {})

    together = run_ranks(2, both)
    for model in (1, 2):
        by_itself = run_ranks(2, alone(model))
        for rank in range(2):
            for step in range(3):
                for a, b in zip(together[rank][model][step], by_itself[rank][model][step]):
                    assert np.array_equal(a, b), (model, rank, step)


def test_without_states_the_same_layout_shares_residuals():
    # the reason ReduceState exists: the communicator's own tables are per layout
    together = run_ranks(2, lambda comm: reduce_steps(comm, [1, 2], {}))
    by_itself = run_ranks(2, lambda comm: reduce_steps(comm, [1], {}))
    assert not all(np.array_equal(a, b) for a, b in zip(together[0][1][1], by_itself[0][1][1]))


def test_a_state_name_that_differs_between_ranks_is_a_mismatch():
    def body(comm):
        x = [np.ones(5, np.float32)]
        with pytest.raises(commlib.ConsistencyError,
                           match=r"^rank %d: ranks disagree on all_reduce #1:\n  ranks \[0\]: "
                                 r".*state=rank 0's\) 1 numpy arrays: float32\(5,\)\n  ranks "
                                 r"\[1\]: .*state=rank 1's\) " % comm.rank) as info:
            comm.all_reduce(x, compression=TopK(0.5),
                            state=commlib.ReduceState("rank %d's" % comm.rank))
        assert info.value.culprits == (1,)
        comm.all_reduce(x)               # usable afterwards
        return float(x[0][0])
    assert run_ranks(2, body) == [2.0, 2.0]


def test_bad_states_are_refused_on_every_rank():
    def body(comm):
        with pytest.raises(commlib.ArgumentError, match="state must be a commlib.ReduceState"):
            comm.all_reduce([np.ones(3, np.float32)], state="mine")
        return True
    assert run_ranks(2, body) == [True, True]
    with pytest.raises(commlib.ArgumentError, match="name"):
        commlib.ReduceState("")
    with pytest.raises(commlib.ArgumentError, match="lists"):
        commlib.ReduceState("x", lists=0)
