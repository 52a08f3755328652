"""commlib.ops.threshold: the numpy twin against a brute-force reference, the
argument checks, and (gpu) the CUDA kernel against the twin bit for bit."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from commlib.errors import ArgumentError, ArrayTypeError
from commlib.ops.threshold import threshold

F32 = np.float32
DENORMAL = np.array([1e-45, 3e-42, 1e-39], dtype=F32)


def reference(x, t):
    """Indices with |x| > t, compared exactly in Python floats."""
    return [i for i, v in enumerate(x) if not math.isnan(float(v)) and abs(float(v)) > t]


def check(got, x, t, capacity=None):
    idx, val, count = (np.asarray(a) for a in got)
    want = reference(x, t)
    cap = len(x) if capacity is None else capacity
    assert idx.shape == (cap,) and val.shape == (cap,)
    assert idx.dtype == np.int32 and val.dtype == F32
    assert count.shape == () and count.dtype == np.int64 and int(count) == len(want)
    m = min(len(want), cap)
    np.testing.assert_array_equal(idx[:m], want[:m])
    np.testing.assert_array_equal(val[:m].view(np.uint32), x[want[:m]].view(np.uint32))


def make(kind, n, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "ties":
        x = rng.integers(-3, 4, n).astype(F32) * F32(0.5)
    elif kind == "special":
        pool = np.concatenate([[np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 0.1, -0.1,
                                1.0, -1.0, 3e38], DENORMAL, -DENORMAL])
        x = rng.choice(pool.astype(F32), n)
    elif kind == "dense":  # almost everything qualifies
        x = rng.standard_normal(n) + 10.0
    else:
        raise ValueError(kind)
    return np.ascontiguousarray(x, dtype=F32)


THRESHOLDS = [0.0, -0.0, 1e-45, 1e-50, 0.1, 0.5, 1.0, 2.5, 3e38, 1e300, math.inf]


@pytest.mark.parametrize("kind", ["normal", "ties", "special", "dense"])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 31, 97, 1009, 4099])
def test_twin_matches_reference(kind, n):
    x = make(kind, n)
    for t in THRESHOLDS:
        check(threshold(x, t), x, t)


def test_threshold_is_exact_not_rounded_to_float32():
    x = np.array([0.1, -0.1, 0.2], F32)  # float32(0.1) > 0.1 as doubles
    idx, _, count = threshold(x, 0.1)
    assert int(count) == 3
    idx, _, count = threshold(x, float(F32(0.1)))
    assert int(count) == 1 and idx[0] == 2


def test_nan_never_selected_and_inf_always():
    x = np.array([np.nan, np.inf, -np.inf, -np.nan, 5.0], F32)
    idx, val, count = threshold(x, 1e30)
    assert int(count) == 2
    np.testing.assert_array_equal(idx[:2], [1, 2])
    assert int(threshold(x, math.inf)[2]) == 0


@pytest.mark.parametrize("capacity", [0, 1, 7, 50, 51, 52, 200])
def test_capacity(capacity):
    x = make("normal", 150, seed=3)
    got = threshold(x, 0.5, capacity=capacity)
    check(got, x, 0.5, capacity)


def test_misaligned_view():
    base = make("normal", 1000)
    check(threshold(base[3:], 1.0), base[3:], 1.0)


finite_or_not = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=150, deadline=None)
@given(x=hnp.arrays(F32, st.integers(0, 120), elements=finite_or_not),
       t=st.floats(min_value=0, allow_infinity=True, allow_subnormal=True),
       cap=st.one_of(st.none(), st.integers(0, 130)))
def test_twin_property(x, t, cap):
    check(threshold(x, t, capacity=cap), x, t, cap)


def test_twin_large():
    x = np.random.default_rng(1).standard_normal(25_000_007, dtype=F32)
    idx, val, count = threshold(x, 2.5)
    c = int(count)
    want = np.flatnonzero(np.abs(x) > F32(2.5))
    assert c == want.size
    np.testing.assert_array_equal(idx[:c], want)
    np.testing.assert_array_equal(val[:c], x[want])


def test_argument_errors():
    x = np.ones(8, F32)
    with pytest.raises(ArrayTypeError, match="x: expected dtype float32, got int32"):
        threshold(np.ones(8, np.int32), 0.5)
    with pytest.raises(ArgumentError, match="1-D"):
        threshold(np.ones((2, 4), F32), 0.5)
    with pytest.raises(ArrayTypeError, match="contiguous"):
        threshold(np.ones(16, F32)[::2], 0.5)
    for bad in (-1.0, -1e-30, math.nan, -math.inf):
        with pytest.raises(ArgumentError, match="t"):
            threshold(x, bad)
    with pytest.raises(ArgumentError, match="t"):
        threshold(x, "big")
    with pytest.raises(ArgumentError, match="capacity"):
        threshold(x, 0.5, capacity=-1)
    with pytest.raises(ArgumentError, match="capacity"):
        threshold(x, 0.5, capacity=2.5)


# --- CUDA kernel against the twin -----------------------------------------------

@pytest.fixture
def cp():
    import cupy
    return cupy


def gpu_vs_twin(cp, base, offset, t, capacity=None):
    x = base[offset:]
    want = threshold(x, t, capacity=capacity)
    got = threshold(cp.asarray(base)[offset:], t, capacity=capacity)
    c = int(want[2])
    assert int(got[2]) == c
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    m = min(c, want[0].size)
    np.testing.assert_array_equal(cp.asnumpy(got[0])[:m], want[0][:m])
    np.testing.assert_array_equal(cp.asnumpy(got[1])[:m].view(np.uint32),
                                  want[1][:m].view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "ties", "special", "dense"])
@pytest.mark.parametrize("n", [1, 3, 4093, 4099, 40_013])
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_gpu_matches_twin(cp, kind, n, offset):
    base = make(kind, n + offset, seed=n)
    for t in [0.0, 1e-45, 0.1, 1.0, 3e38, math.inf]:
        gpu_vs_twin(cp, base, offset, t)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [0, 1, 100, 4096, 9000, 50_000])
def test_gpu_capacity(cp, capacity):
    base = make("normal", 50_001, seed=4)
    gpu_vs_twin(cp, base, 1, 0.5, capacity)


@pytest.mark.gpu
def test_gpu_empty(cp):
    idx, val, count = threshold(cp.zeros(0, dtype=cp.float32), 0.5)
    assert idx.shape == (0,) and int(count) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "dense"])
def test_gpu_large(cp, kind):
    base = make(kind, 25_000_008, seed=9)
    for offset in (0, 1):
        gpu_vs_twin(cp, base, offset, 2.5)
