"""The compiled selection loops (commlib/native/hostselect.c via
commlib.ops.hostselect) against the numpy twins of commlib.ops.topk,
threshold and sparse, bit for bit, on both code paths (AVX2 and portable):
ties (lowest index wins), NaN never selected, -1/0 padding, +-inf, -0,
samples that mislead the bound, residual updates, odd lengths, misaligned
views, empty and large inputs."""
import numpy as np
import pytest

from commlib.compression import nonfinite
from commlib.errors import ArgumentError
from commlib.ops import native, hostcast, hostselect
from commlib.ops import sparse as sparse_ops
from commlib.ops import threshold as threshold_ops
from commlib.ops import topk as topk_ops

pytestmark = pytest.mark.skipif(not native.available(), reason="compiled host loops not built: %s"
                                % native.unavailable_reason())


@pytest.fixture(params=[hostcast.PORTABLE, hostcast.AVX2], ids=["portable", "avx2"])
def level(request):
    best = hostcast.level()
    if request.param > best:
        pytest.skip("this CPU lacks AVX2: only the portable path runs here")
    assert hostcast.level(request.param) == request.param
    yield request.param
    hostcast.level(hostcast.AVX2)


def bits(a):
    return a.view(np.uint32)


def twin_topk(x, k, residual=None):
    return topk_ops._topk_numpy(x, min(k, x.size), residual)


def assert_topk_same(x, k, residual=None):
    r_c = None if residual is None else residual.copy()
    r_t = None if residual is None else residual.copy()
    i_c, v_c = hostselect.topk(x, k, residual=r_c)
    i_t, v_t = twin_topk(x, k, r_t)
    np.testing.assert_array_equal(i_c, i_t)
    np.testing.assert_array_equal(bits(v_c), bits(v_t))
    assert i_c.dtype == np.int32 and v_c.dtype == np.float32
    if residual is not None:     # NaN payloads may differ; everything else alike
        nan = np.isnan(r_t)
        np.testing.assert_array_equal(np.isnan(r_c), nan)
        np.testing.assert_array_equal(bits(r_c)[~nan], bits(r_t)[~nan])
    return i_c, v_c


def gaussian(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("n", [0, 1, 7, 16, 17, 1000, 65535, 65536 + 5, 262147, 1 << 21])
def test_topk_gaussian(level, n):
    x = gaussian(n, n)
    for k in sorted({0, 1, 2, 5, max(1, n // 1000), max(1, n // 100), n // 8, n // 8 + 1,
                     max(n - 1, 0), n, n + 5}):
        assert_topk_same(x, k)


def test_topk_selects_the_largest_magnitudes(level):
    """An independent reference: sort by (-|x|, index) and take k."""
    x = gaussian(300001, 9)
    x[::7] = -x[::7]
    k = 3001
    i, v = hostselect.topk(x, k)
    order = np.lexsort((np.arange(x.size), -np.abs(x)))[:k]
    np.testing.assert_array_equal(i, np.sort(order))
    np.testing.assert_array_equal(v, x[np.sort(order)])


@pytest.mark.parametrize("n", [1000, 300007])
def test_topk_ties_nan_inf_zero(level, n):
    rng = np.random.default_rng(n)
    ints = rng.integers(-3, 4, n).astype(np.float32)       # masses of ties
    assert_topk_same(ints, n // 3)
    assert_topk_same(ints, n // 100)
    zeros = np.zeros(n, np.float32)
    zeros[::2] = -0.0                                     # -0 ties with +0
    i, v = assert_topk_same(zeros, 10)
    assert i.tolist() == list(range(10))
    special = gaussian(n, 1)
    special[rng.integers(0, n, n // 10)] = np.nan
    special.view(np.uint32)[rng.integers(0, n, 50)] = 0xFFC00001     # NaN payloads
    special[rng.integers(0, n, 20)] = np.inf
    special[rng.integers(0, n, 20)] = -np.inf
    for k in (1, 15, 100, n // 100, n - n // 20, n):
        i, v = assert_topk_same(special, k)
        assert not np.isnan(v).any()
    allnan = np.full(n, np.nan, np.float32)
    i, v = assert_topk_same(allnan, 5)
    assert i.tolist() == [-1] * 5 and bits(v).tolist() == [0] * 5


def test_topk_padding_when_nan_leaves_too_few(level):
    x = np.array([np.nan, 2.0, np.nan, -3.0, np.nan], np.float32)
    i, v = assert_topk_same(x, 4)
    assert i.tolist() == [1, 3, -1, -1]
    assert v.tolist() == [2.0, -3.0, 0.0, 0.0]


def test_topk_misleading_samples(level):
    """Samples sit at floor(j * n / 8192): data built so the sampled bound
    is too high (too few candidates) or too low (too many): the exact bound
    takes over and the result stays the twin's."""
    n = 1 << 20
    grid = (np.arange(8192) * n) // 8192
    high = np.full(n, 0.5, np.float32)
    high[grid] = 100.0                # only the sampled positions are large
    assert_topk_same(high, 10000)
    low = np.full(n, 100.0, np.float32)
    low[grid] = 0.001                 # every sample small: the bound lets everything in
    low += gaussian(n, 3) * 1e-3
    low[grid] = 0.001
    assert_topk_same(low, 5000)


def test_topk_residual(level):
    n = 500003
    x = gaussian(n, 4)
    residual = gaussian(n, 5) * 0.1
    residual[::1000] = np.nan
    assert_topk_same(x, n // 100, residual)
    r = residual.copy()
    i, v = hostselect.topk(x, 5000, residual=r)
    with np.errstate(invalid="ignore"):
        acc = residual + x
    np.testing.assert_array_equal(bits(v), bits(acc[i]))
    assert (r[i] == 0).all()
    rest = np.setdiff1d(np.arange(n), i)
    np.testing.assert_array_equal(np.isnan(r[rest]), np.isnan(acc[rest]))


def test_topk_misaligned_and_unqualified_views(level):
    base = gaussian(100010, 6)
    for off in (1, 3):
        assert_topk_same(base[off:off + 100003], 1000)
    raw = np.zeros(4 * 5001 + 1, np.uint8)
    x = raw[1:].view(np.float32)
    x[...] = gaussian(5001, 7)
    ext = native.module()
    assert ext.topk(x, None, 10, np.empty(10, np.int32), np.empty(10, np.float32)) == -1
    assert_topk_same(x, 10)            # the twin answers
    with pytest.raises(ArgumentError, match=r"^k: expected >= 0, got -1$"):
        hostselect.topk(x, -1)


def test_threshold(level):
    rng = np.random.default_rng(8)
    x = gaussian(400009, 8)
    x[rng.integers(0, x.size, 100)] = np.nan
    x[rng.integers(0, x.size, 10)] = np.inf
    x[rng.integers(0, x.size, 10)] = -np.inf
    for t in (0.0, 0.1, 1e-30, 2.5, 4.0, 3.4e38, float(np.float32(2.5)) + 1e-9):
        i_c, v_c = hostselect.threshold(x, t)
        i_t, v_t, count = threshold_ops._threshold_numpy(x, threshold_ops.threshold_key(t),
                                                         x.size)
        m = int(count)
        np.testing.assert_array_equal(i_c, i_t[:m])
        np.testing.assert_array_equal(bits(v_c), bits(v_t[:m]))
        ref = np.flatnonzero(np.abs(x) > t)          # independent: numpy comparison
        np.testing.assert_array_equal(i_c, ref)
    for n in (0, 1, 15, 16, 17, 33):
        y = gaussian(n + 1, n)[1:]                    # odd lengths, misaligned
        i_c, v_c = hostselect.threshold(y, 0.5)
        np.testing.assert_array_equal(i_c, np.flatnonzero(np.abs(y) > 0.5))


def test_scatter_add(level):
    rng = np.random.default_rng(9)
    n = 10007
    dense = gaussian(n, 10)
    idx = rng.integers(0, n, 3000).astype(np.int32)   # repeats (across "segments")
    idx[::50] = -1
    idx[1::97] = n + 3                                 # out of range: counted, skipped
    idx[2::101] = -7
    vals = gaussian(3000, 11)
    for alpha in (1.0, -1.0, 0.37):
        d_c, d_t = dense.copy(), dense.copy()
        bad_c = hostselect.scatter_add(d_c, idx, vals, alpha=alpha, segments=[1000, 2000])
        bad_t = sparse_ops._scatter_add_numpy(d_t, idx, vals, np.float32(alpha))
        np.testing.assert_array_equal(bits(d_c), bits(d_t))
        assert int(bad_c) == int(bad_t) > 0
    untouched = dense.copy()
    with pytest.raises(ArgumentError, match=r"^segments: counts sum to 3, but indices holds "
                                            r"3000 entries$"):
        hostselect.scatter_add(untouched, idx, vals, segments=[1, 2])
    np.testing.assert_array_equal(bits(untouched), bits(dense))     # checked before writing


def test_accumulate_finite(level):
    n = 100003
    x = gaussian(n, 12).clip(-3, 3) * np.float32(1e38)
    residual = gaussian(n, 13).clip(-3, 3) * np.float32(1e38)
    residual[::7] = np.float32(3e38)                   # sums overflow to inf
    x[::101] = np.nan
    residual[::203] = -np.inf
    for r in (residual, None):
        acc = np.empty(n, np.float32)
        count = hostselect.accumulate_finite(r, x, acc)
        with np.errstate(over="ignore", invalid="ignore"):
            ref = x.copy() if r is None else np.add(r, x)
        ref_count = nonfinite.drop(ref)
        assert count == ref_count > 0
        np.testing.assert_array_equal(bits(acc), bits(ref))


def test_large_topk_matches_twin(level):
    x = gaussian(25_000_003, 14)
    assert_topk_same(x, 250_001)


@pytest.mark.parametrize("scale", [None, 0.5, 1 / 3, -0.25, 0.0])
def test_sparse_sum(level, scale):
    """Zero, scatter-add every segment, scale: the compiled call scales only
    the entries written (a non-negative scale); bits as the three numpy
    steps."""
    rng = np.random.default_rng(15)
    n = 50021
    first = np.sort(rng.choice(n, 700, replace=False)).astype(np.int32)
    second = np.sort(rng.choice(n, 900, replace=False)).astype(np.int32)   # overlaps first
    idx = np.concatenate([first, second, np.array([-1, -1, n, -5], np.int32)])
    vals = np.concatenate([gaussian(1600, 16), np.array([0, 0, 1, 1], np.float32)])
    vals[5] = -vals[5]
    idx[5], idx[700 + 3] = 17, 17                    # a sum of v and -v: +0
    vals[700 + 3] = -vals[5]
    dense_c = gaussian(n, 17)                        # overwritten
    dense_t = np.zeros(n, np.float32)
    bad_c = hostselect.sparse_sum(dense_c, idx, vals, scale, segments=[700, 904])
    bad_t = sparse_ops._scatter_add_numpy(dense_t, idx, vals, np.float32(1))
    if scale is not None:
        dense_t *= np.float32(scale)
    np.testing.assert_array_equal(bits(dense_c), bits(dense_t))
    assert int(bad_c) == int(bad_t) == 2


def test_the_build_has_every_loop_the_wrappers_use():
    """A stale build would send the wrappers to the numpy twins silently."""
    for name in ("cast", "count_nonfinite", "cast_level", "topk", "topk_accumulate",
                 "threshold", "scatter", "accumulate_finite"):
        assert hostselect.compiled(name) is not None, name


def reference_accumulate(residual, x):
    with np.errstate(over="ignore", invalid="ignore"):
        acc = x.copy() if residual is None else np.add(residual, x)
    return nonfinite.drop(acc), acc


@pytest.mark.parametrize("n", [0, 1, 17, 70001, 262147, 1 << 21])
@pytest.mark.parametrize("with_residual", [True, False])
def test_topk_accumulate(level, n, with_residual):
    rng = np.random.default_rng(n + with_residual)
    x = gaussian(n, n)
    residual = gaussian(n, n + 1) if with_residual else None
    if n > 100:
        x[rng.integers(0, n, n // 50)] = np.nan
        x[rng.integers(0, n, 10)] = np.float32(3e38)
        if with_residual:
            residual[rng.integers(0, n, 10)] = np.float32(3e38)     # sums overflow
            residual[rng.integers(0, n, 10)] = -np.inf
    count_ref, acc_ref = reference_accumulate(residual, x)
    for k in sorted({0, 1, max(1, n // 100), n // 8 + 1, n}):
        acc = np.full(n, 7.0, np.float32)
        count, i_c, v_c = hostselect.topk_accumulate(residual, x, acc, k)
        i_t, v_t = twin_topk(acc_ref, k)
        assert count == count_ref
        np.testing.assert_array_equal(bits(acc), bits(acc_ref))
        np.testing.assert_array_equal(i_c, i_t)
        np.testing.assert_array_equal(bits(v_c), bits(v_t))


def test_topk_accumulate_misleading_samples(level):
    n = 1 << 20
    grid = (np.arange(8192) * n) // 8192
    x = np.full(n, 0.5, np.float32)
    x[grid] = 100.0                   # the sampled bound is too high
    residual = np.zeros(n, np.float32)
    for k in (10000, 3):
        acc = np.empty(n, np.float32)
        count, i_c, v_c = hostselect.topk_accumulate(residual, x, acc, k)
        i_t, v_t = twin_topk(x, k)
        assert count == 0
        np.testing.assert_array_equal(bits(acc), bits(x))
        np.testing.assert_array_equal(i_c, i_t)
        np.testing.assert_array_equal(bits(v_c), bits(v_t))
    x = np.full(n, 100.0, np.float32)
    x[grid] = 0.001                   # too low: too many candidates
    acc = np.empty(n, np.float32)
    count, i_c, v_c = hostselect.topk_accumulate(None, x, acc, 5000)
    np.testing.assert_array_equal(i_c, twin_topk(x, 5000)[0])


@pytest.mark.parametrize("with_residual", [True, False])
def test_threshold_accumulate(level, with_residual):
    n = 300007
    rng = np.random.default_rng(18)
    x = gaussian(n, 19)
    residual = gaussian(n, 20) if with_residual else None
    x[rng.integers(0, n, 300)] = np.nan
    x[rng.integers(0, n, 10)] = np.float32(3e38)
    if with_residual:
        residual[rng.integers(0, n, 10)] = np.float32(3e38)
    count_ref, acc_ref = reference_accumulate(residual, x)
    for t in (0.0, 1.0, 2.576, 1e30):
        acc = np.full(n, 7.0, np.float32)
        count, i_c, v_c = hostselect.threshold_accumulate(residual, x, acc, t)
        assert count == count_ref > 0
        np.testing.assert_array_equal(bits(acc), bits(acc_ref))
        i_t, v_t = hostselect.threshold(acc_ref, t)
        np.testing.assert_array_equal(i_c, np.flatnonzero(np.abs(acc_ref) > t))
        np.testing.assert_array_equal(i_c, i_t)
        np.testing.assert_array_equal(bits(v_c), bits(acc_ref[i_c]))
