"""commlib.ops.sparse.scatter_add: the numpy twin against a per-entry
reference, the argument checks, and (gpu) the CUDA kernel against the twin
bit for bit, including run-to-run determinism."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from commlib.errors import ArgumentError, ArrayTypeError
from commlib.ops.sparse import scatter_add

F32 = np.float32


def reference(dense, indices, values, alpha):
    """One float32 multiply and one float32 add per entry, in order."""
    out = dense.copy()
    bad = 0
    a = F32(alpha)
    for j, v in zip(indices.tolist(), values):
        if j == -1:
            continue
        if not 0 <= j < out.size:
            bad += 1
            continue
        out[j] = F32(out[j] + F32(a * v))
    return out, bad


def make_sets(n, per_rank, ranks, seed, bad=0, pad=0):
    """Concatenated per-rank sets: unique indices within a rank, overlapping
    across ranks, values spread over many magnitudes so order matters."""
    rng = np.random.default_rng(seed)
    idx, val = [], []
    for _ in range(ranks):
        i = rng.choice(n, per_rank, replace=False).astype(np.int32)
        v = (rng.standard_normal(per_rank) * 10.0 ** rng.integers(-8, 8, per_rank)).astype(F32)
        if bad:
            i[rng.choice(per_rank, bad, replace=False)] = rng.choice(
                [-2, -2 ** 31, n, n + 7, 2 ** 31 - 1], bad)
        if pad:
            i[-pad:] = -1
            v[-pad:] = 0
        idx.append(i)
        val.append(v)
    return np.concatenate(idx), np.concatenate(val), [per_rank] * ranks


@pytest.mark.parametrize("alpha", [1.0, -1.0, 0.3])
@pytest.mark.parametrize("ranks,bad,pad", [(1, 0, 0), (4, 0, 3), (4, 5, 0), (3, 2, 2)])
def test_twin_matches_reference(alpha, ranks, bad, pad):
    n = 101
    idx, val, seg = make_sets(n, 40, ranks, seed=ranks, bad=bad, pad=pad)
    dense0 = np.random.default_rng(0).standard_normal(n).astype(F32)
    want, want_bad = reference(dense0, idx, val, alpha)
    dense = dense0.copy()
    got_bad = scatter_add(dense, idx, val, alpha=alpha, segments=seg)
    assert got_bad.shape == () and got_bad.dtype == np.int64 and int(got_bad) == want_bad
    np.testing.assert_array_equal(dense.view(np.uint32), want.view(np.uint32))


def test_duplicates_across_segments_apply_in_segment_order():
    dense = np.zeros(2, F32)
    idx = np.array([0, 0, 0], np.int32)
    val = np.array([1e8, 1.0, -1e8], F32)
    scatter_add(dense, idx, val, segments=[1, 1, 1])
    assert dense[0] == F32(F32(F32(1e8) + F32(1.0)) - F32(1e8))  # 0.0: order matters


def test_padding_skipped_and_bad_counted_not_written():
    dense = np.arange(4, dtype=F32)
    idx = np.array([-1, 4, -2, 2, 2 ** 31 - 1, -1], np.int32)
    val = np.ones(6, F32)
    bad = scatter_add(dense, idx, val, segments=np.array([3, 3]))
    assert int(bad) == 3
    np.testing.assert_array_equal(dense, [0, 1, 3, 3])


@pytest.mark.parametrize("bad_index", [-2, -7, -2 ** 31, 5, 6, 2 ** 31 - 1])
def test_every_kind_of_bad_index_reported(bad_index):
    """One bad index in the middle segment: counted (never dropped
    silently), never written; the other entries are applied."""
    dense = np.zeros(5, F32)
    idx = np.array([0, 1, bad_index, 2, 4], np.int32)
    bad = scatter_add(dense, idx, np.ones(5, F32), segments=[2, 2, 1])
    assert bad.shape == () and bad.dtype == np.int64 and int(bad) == 1
    np.testing.assert_array_equal(dense, [1, 1, 1, 0, 1])


def test_alpha_minus_one_is_the_residual_update():
    dense = np.array([1.5, 2.0, -3.0], F32)
    scatter_add(dense, np.array([0, 2], np.int32), np.array([1.5, -3.0], F32), alpha=-1)
    np.testing.assert_array_equal(dense, [0.0, 2.0, 0.0])


def test_product_rounded_before_add_and_subnormals_kept():
    dense = np.array([1e-45, 1.0], F32)
    val = np.array([1e-45, 1.0 + 2.0 ** -23], F32)
    scatter_add(dense, np.array([0, 1], np.int32), val, alpha=1.0 + 2.0 ** -23)
    assert dense[0] == F32(1e-45) * 2
    assert dense[1] == F32(1.0) + F32(F32(1.0 + 2.0 ** -23) * F32(1.0 + 2.0 ** -23))


def test_empty_sets():
    dense = np.ones(3, F32)
    e_i, e_v = np.zeros(0, np.int32), np.zeros(0, F32)
    assert int(scatter_add(dense, e_i, e_v)) == 0
    assert int(scatter_add(dense, e_i, e_v, segments=[0, 0])) == 0
    assert int(scatter_add(np.zeros(0, F32), np.array([0, -1], np.int32), np.ones(2, F32))) == 1
    np.testing.assert_array_equal(dense, 1)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=st.integers(1, 40), ranks=st.integers(1, 5),
       alpha=st.floats(-4, 4, width=32))
def test_twin_property(data, n, ranks, alpha):
    idx, val, seg = [], [], []
    for _ in range(ranks):
        m = data.draw(st.integers(0, n))
        i = data.draw(st.permutations(range(n)))[:m]
        i = [data.draw(st.sampled_from([j, j, j, -1, -3, n + 2])) for j in i]
        i = [j for k, j in enumerate(i) if j not in i[:k] or j < 0 or j >= n]
        idx += i
        val += data.draw(st.lists(st.floats(width=32, allow_nan=False), min_size=len(i),
                                  max_size=len(i)))
        seg.append(len(i))
    idx = np.array(idx, np.int32)
    val = np.array(val, F32)
    dense0 = np.array(data.draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=n,
                                         max_size=n)), F32)
    with np.errstate(over="ignore", invalid="ignore"):
        want, want_bad = reference(dense0, idx, val, alpha)
    dense = dense0.copy()
    assert int(scatter_add(dense, idx, val, alpha=alpha, segments=seg)) == want_bad
    np.testing.assert_array_equal(dense.view(np.uint32), want.view(np.uint32))


def test_argument_errors():
    d, i, v = np.zeros(8, F32), np.zeros(3, np.int32), np.ones(3, F32)
    with pytest.raises(ArrayTypeError, match="dense: expected dtype float32, got float64"):
        scatter_add(np.zeros(8), i, v)
    with pytest.raises(ArrayTypeError, match="indices: expected dtype int32, got int64"):
        scatter_add(d, i.astype(np.int64), v)
    with pytest.raises(ArrayTypeError, match="values"):
        scatter_add(d, i, v.astype(np.float16))
    with pytest.raises(ArgumentError, match="1-D"):
        scatter_add(np.zeros((2, 4), F32), i, v)
    with pytest.raises(ArgumentError, match="values: length 2"):
        scatter_add(d, i, v[:2])
    with pytest.raises(ArgumentError, match="segments: counts sum to 4"):
        scatter_add(d, i, v, segments=[2, 2])
    with pytest.raises(ArgumentError, match="segments"):
        scatter_add(d, i, v, segments=[4, -1])
    with pytest.raises(ArgumentError, match="segments"):
        scatter_add(d, i, v, segments=[1.5, 1.5])
    with pytest.raises(ArrayTypeError, match="contiguous"):
        scatter_add(np.zeros(16, F32)[::2], i, v)


# --- CUDA kernel against the twin -----------------------------------------------

@pytest.fixture
def cp():
    import cupy
    return cupy


def gpu_vs_twin(cp, n, idx, val, seg, alpha, offset=0, repeats=2):
    base = np.random.default_rng(1).standard_normal(n + offset).astype(F32)
    want = base[offset:].copy()
    want_bad = int(scatter_add(want, idx, val, alpha=alpha, segments=seg))
    idx_d, val_d = cp.asarray(idx), cp.asarray(val)
    for _ in range(repeats):
        dense_d = cp.asarray(base)[offset:]
        bad = scatter_add(dense_d, idx_d, val_d, alpha=alpha, segments=seg)
        assert bad.shape == () and int(bad) == want_bad
        np.testing.assert_array_equal(cp.asnumpy(dense_d).view(np.uint32), want.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", [1.0, -1.0, 0.37])
@pytest.mark.parametrize("ranks,bad,pad,offset", [(1, 0, 0, 0), (4, 0, 9, 1), (4, 13, 0, 3),
                                                  (7, 2, 2, 2)])
def test_gpu_matches_twin(cp, alpha, ranks, bad, pad, offset):
    n = 20_011
    idx, val, seg = make_sets(n, 3000, ranks, seed=ranks + bad, bad=bad, pad=pad)
    gpu_vs_twin(cp, n, idx, val, seg, alpha, offset)


@pytest.mark.gpu
def test_gpu_subnormals_kept(cp):
    idx = np.array([0, 1, 0], np.int32)
    val = np.array([1e-45, 3e-39, 2e-45], F32)
    gpu_vs_twin(cp, 4, idx, val, [2, 1], 1.0)
    gpu_vs_twin(cp, 4, idx, val, [2, 1], 0.5)


@pytest.mark.gpu
def test_gpu_empty_segments_and_no_dense(cp):
    idx = np.array([3, 1, 1, -1, 9], np.int32)
    val = np.arange(5, dtype=F32)
    gpu_vs_twin(cp, 5, idx, val, [0, 2, 0, 3, 0], 2.0)
    bad = scatter_add(cp.zeros(0, dtype=cp.float32), cp.asarray(idx), cp.asarray(val))
    assert int(bad) == 4


@pytest.mark.gpu
def test_gpu_large_deterministic(cp):
    n = 25_000_000
    idx, val, seg = make_sets(n, n // 100, 4, seed=17, bad=10, pad=100)
    gpu_vs_twin(cp, n, idx, val, seg, -1.0, offset=1, repeats=3)
