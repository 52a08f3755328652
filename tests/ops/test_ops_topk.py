"""commlib.ops.topk: the numpy twin against a brute-force reference, the
argument checks, and (gpu) the CUDA kernels against the twin bit for bit."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from commlib.errors import ArgumentError, ArrayTypeError
from commlib.ops import topk as topk_mod
from commlib.ops.topk import topk

F32 = np.float32
DENORMAL = np.array([1e-45, 3e-42, 1e-39, 1.1e-38], dtype=F32)  # last one is normal


def reference(x, k):
    """Sort the non-NaN elements by (-|x|, index) with Python floats."""
    keyed = sorted((-abs(float(v)), i) for i, v in enumerate(x) if not math.isnan(float(v)))
    kk = min(k, len(x))
    chosen = sorted(i for _, i in keyed[:kk])
    idx = np.full(kk, -1, np.int32)
    val = np.zeros(kk, F32)
    idx[:len(chosen)] = chosen
    val[:len(chosen)] = x[chosen]
    return idx, val


def assert_same(got, want):
    gi, gv = (np.asarray(a) for a in got)
    wi, wv = want
    assert gi.dtype == np.int32 and gv.dtype == F32
    np.testing.assert_array_equal(gi, wi)
    np.testing.assert_array_equal(gv.view(np.uint32), wv.view(np.uint32))


def make(kind, n, seed=0):
    """Adversarial float32 inputs of length n."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "below_one":  # every |x| < 1, all distinct magnitudes
        x = rng.permutation(np.linspace(1e-6, 0.999, n)) * rng.choice([-1, 1], n)
    elif kind == "ties":
        x = rng.integers(-3, 4, n).astype(F32)
        x[rng.random(n) < 0.2] = -0.0
    elif kind == "equal":
        x = np.full(n, -0.5)
    elif kind == "signed_zero":
        x = rng.choice(np.array([0.0, -0.0], F32), n)
        x[rng.random(n) < 0.05] = 1e-30
    elif kind == "special":
        pool = np.concatenate([[np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0],
                               DENORMAL, -DENORMAL]).astype(F32)
        x = rng.choice(pool, n)
    elif kind == "denormal":
        x = rng.choice(np.concatenate([DENORMAL[:3], -DENORMAL[:3], [0.0]]).astype(F32), n)
    elif kind == "mostly_nan":
        x = rng.standard_normal(n)
        x[rng.random(n) < 0.9] = np.nan
    elif kind == "all_nan":
        x = np.full(n, np.nan)
    else:
        raise ValueError(kind)
    return np.ascontiguousarray(x, dtype=F32)


KINDS = ["normal", "below_one", "ties", "equal", "signed_zero", "special", "denormal",
         "mostly_nan", "all_nan"]
SIZES = [0, 1, 2, 3, 5, 31, 97, 1009, 4099]


def ks_for(n):
    return sorted({0, 1, max(n - 1, 0), n, n + 5, max(1, n // 100)})


# --- numpy twin -------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_twin_matches_reference(kind, n):
    x = make(kind, n)
    keep = x.copy()
    for k in ks_for(n):
        assert_same(topk(x, k), reference(x, k))
    np.testing.assert_array_equal(x.view(np.uint32), keep.view(np.uint32))  # input untouched


def test_values_below_one_are_ordered_not_truncated():
    x = np.array([0.1, -0.7, 0.3, 0.69, -0.05], F32)
    idx, val = topk(x, 2)
    np.testing.assert_array_equal(idx, [1, 3])
    np.testing.assert_array_equal(val, x[[1, 3]])


def test_ties_take_lowest_index_and_signed_zeros_tie():
    x = np.array([-0.0, 2.0, 0.0, -2.0, 0.0, 2.0], F32)
    np.testing.assert_array_equal(topk(x, 2)[0], [1, 3])
    idx, val = topk(x, 5)
    np.testing.assert_array_equal(idx, [0, 1, 2, 3, 5])
    assert np.signbit(val[0]) and not np.signbit(val[2])


def test_infinities_rank_highest_and_nan_pads():
    x = np.array([np.nan, 1.0, -np.inf, np.nan, 3e38, np.inf], F32)
    idx, val = topk(x, 3)
    np.testing.assert_array_equal(idx, [2, 4, 5])
    idx, val = topk(x, 6)
    np.testing.assert_array_equal(idx, [1, 2, 4, 5, -1, -1])
    np.testing.assert_array_equal(val[4:], [0.0, 0.0])


def test_empty_and_zero_k():
    for x, k in [(np.zeros(0, F32), 3), (np.ones(4, F32), 0)]:
        idx, val = topk(x, k)
        assert idx.shape == (0,) and idx.dtype == np.int32
        assert val.shape == (0,) and val.dtype == F32


def test_misaligned_view():
    base = make("normal", 1001)
    assert_same(topk(base[1:], 17), reference(base[1:], 17))


finite_or_not = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=150, deadline=None)
@given(x=hnp.arrays(F32, st.integers(0, 120), elements=finite_or_not),
       k=st.integers(0, 130))
def test_twin_property(x, k):
    assert_same(topk(x, k), reference(x, k))


# --- error feedback ----------------------------------------------------------

def check_feedback(x, r0, k, got, r1):
    """sent + residual_after == residual_before + x, exactly, entry by entry
    (compared as floats: a sent -0.0 leaves +0.0 behind)."""
    with np.errstate(over="ignore", invalid="ignore"):
        acc = r0 + x
    idx, val = (np.asarray(a) for a in got)
    want = reference(acc, k)
    assert_same((idx, val), want)
    sel = idx[idx >= 0]
    sent = np.zeros_like(acc)
    sent[sel] = val[:sel.size]
    assert not np.any(r1[sel])
    ok = ~np.isnan(acc)
    np.testing.assert_array_equal((sent + r1)[ok], acc[ok])
    np.testing.assert_array_equal(np.isnan(r1), np.isnan(acc))


@pytest.mark.parametrize("kind", ["normal", "ties", "special", "denormal"])
@pytest.mark.parametrize("k", [0, 1, 50, 499, 500, 600])
def test_residual_feedback(kind, k):
    x = make(kind, 500, seed=1)
    r0 = make(kind, 500, seed=2) * F32(0.5)
    r1 = r0.copy()
    got = topk(x, k, residual=r1)
    check_feedback(x, r0, k, got, r1)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(0, 80), k=st.integers(0, 90))
def test_residual_property(data, n, k):
    x = data.draw(hnp.arrays(F32, n, elements=finite_or_not))
    r0 = data.draw(hnp.arrays(F32, n, elements=finite_or_not))
    r1 = r0.copy()
    check_feedback(x, r0, k, topk(x, k, residual=r1), r1)


# --- large input: twin speed and exactness via O(N) properties --------------

def test_twin_large():
    n = 25_000_007
    k = n // 100
    x = np.random.default_rng(3).standard_normal(n, dtype=F32)
    x[::1000] = np.round(x[::1000])  # some exact ties
    idx, val = topk(x, k)
    assert idx.size == k and np.all(np.diff(idx) > 0)
    np.testing.assert_array_equal(val, x[idx])
    mask = np.zeros(n, bool)
    mask[idx] = True
    smallest = np.abs(val).min()
    assert np.abs(x[~mask]).max() <= smallest
    tied_out = np.flatnonzero(~mask & (np.abs(x) == smallest))
    tied_in = idx[np.abs(val) == smallest]
    assert tied_out.size == 0 or tied_out.min() > tied_in.max()


# --- argument checks -----------------------------------------------------------

def test_argument_errors():
    x = np.ones(8, F32)
    with pytest.raises(ArrayTypeError, match="x: expected dtype float32, got float64"):
        topk(np.ones(8), 2)
    with pytest.raises(ArrayTypeError, match="x"):
        topk([1.0, 2.0], 1)
    with pytest.raises(ArgumentError, match="1-D"):
        topk(np.ones((2, 4), F32), 2)
    with pytest.raises(ArrayTypeError, match="contiguous"):
        topk(np.ones(16, F32)[::2], 2)
    with pytest.raises(ArgumentError, match="k"):
        topk(x, -1)
    with pytest.raises(ArgumentError, match="k"):
        topk(x, 1.5)
    with pytest.raises(ArrayTypeError, match="residual: expected dtype float32"):
        topk(x, 2, residual=np.ones(8, np.float16))
    with pytest.raises(ArgumentError, match="residual: length 7"):
        topk(x, 2, residual=np.ones(7, F32))


# --- CUDA kernels against the twin ---------------------------------------------

@pytest.fixture
def cp():
    import cupy
    return cupy


def gpu_vs_twin(cp, base, offset, k):
    x = base[offset:]
    xd = cp.asarray(base)[offset:]
    want = topk(x, k)
    got = topk(xd, k)
    assert_same((cp.asnumpy(got[0]), cp.asnumpy(got[1])), want)
    again = topk(xd, k)
    assert_same((cp.asnumpy(again[0]), cp.asnumpy(again[1])), want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "below_one", "ties", "equal", "signed_zero",
                                  "special", "mostly_nan", "all_nan"])
@pytest.mark.parametrize("n", [1, 5, 4093, 4097, 20011])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_gpu_matches_twin(cp, kind, n, offset):
    base = make(kind, n + offset, seed=n)
    for k in sorted({0, 1, max(1, n // 100), n - 1, n, n + 5}):
        gpu_vs_twin(cp, base, offset, k)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", ["none", "all"])
@pytest.mark.parametrize("kind", ["normal", "ties", "special", "below_one"])
def test_gpu_candidate_paths(cp, monkeypatch, capacity, kind):
    # Force the fallback (no candidate buffer) or a buffer that always fits.
    cap = (lambda n, k: 0) if capacity == "none" else (lambda n, k: -(-n // 4) * 4)
    monkeypatch.setattr(topk_mod, "_candidate_capacity", cap)
    base = make(kind, 60_003, seed=7)
    for offset, k in [(0, 1), (1, 600), (2, 6000), (3, 59_000)]:
        gpu_vs_twin(cp, base, offset, k)


@pytest.mark.gpu
@pytest.mark.parametrize("trap", ["blind", "too_high"])
def test_gpu_misleading_sample(cp, trap):
    # Sampled positions hold zeros (bound too low: the gather overflows) or
    # one large value (bound too high: too few keys gathered); the selection
    # must fall back and stay exact.
    n = 60_001
    base = make("normal", n + 1, seed=8)
    x = base[1:]
    sampled = np.arange(topk_mod.SAMPLES, dtype=np.int64) * n // topk_mod.SAMPLES
    x[sampled] = 0.0 if trap == "blind" else 100.0
    for k in [1, 600, 20_000]:
        gpu_vs_twin(cp, base, 1, k)


def gpu_feedback(cp, x_base, r_base, xoff, roff, n, k):
    x = x_base[xoff:xoff + n]
    r0 = r_base[roff:roff + n].copy()
    r_host = r0.copy()
    want = topk(x, k, residual=r_host)
    rd_base = cp.asarray(r_base)
    rd = rd_base[roff:roff + n]
    got = topk(cp.asarray(x_base)[xoff:xoff + n], k, residual=rd)
    got = (cp.asnumpy(got[0]), cp.asnumpy(got[1]))
    assert_same(got, want)
    r_dev = cp.asnumpy(rd)
    np.testing.assert_array_equal(np.isnan(r_dev), np.isnan(r_host))
    ok = ~np.isnan(r_host)
    np.testing.assert_array_equal(r_dev[ok].view(np.uint32), r_host[ok].view(np.uint32))
    check_feedback(x, r0, k, got, r_dev)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "ties", "special", "denormal"])
@pytest.mark.parametrize("xoff,roff", [(0, 0), (1, 1), (0, 1), (3, 2)])
def test_gpu_residual(cp, kind, xoff, roff):
    n = 30_011
    x_base = make(kind, n + 4, seed=11)
    r_base = make(kind, n + 4, seed=12) * F32(0.75)
    for k in [0, 1, 300, n]:
        gpu_feedback(cp, x_base, r_base, xoff, roff, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "uniform", "ties"])
def test_gpu_large(cp, kind):
    n = 25_000_007
    rng = np.random.default_rng(5)
    if kind == "normal":
        base = rng.standard_normal(n + 1, dtype=F32)
    elif kind == "uniform":
        base = rng.random(n + 1, dtype=F32)
    else:
        base = rng.integers(-8, 9, n + 1).astype(F32)
    for offset in (0, 1):
        gpu_vs_twin(cp, base, offset, n // 100)


@pytest.mark.gpu
def test_gpu_large_residual(cp):
    n = 25_000_007
    rng = np.random.default_rng(6)
    x_base = rng.standard_normal(n + 1, dtype=F32)
    r_base = rng.standard_normal(n + 1, dtype=F32) * F32(0.1)
    gpu_feedback(cp, x_base, r_base, 1, 1, n, n // 100)
    gpu_feedback(cp, x_base, r_base, 0, 1, n, n // 100)


@pytest.mark.gpu
def test_gpu_argument_errors(cp):
    with pytest.raises(ArrayTypeError, match="residual"):
        topk(cp.ones(8, dtype=cp.float32), 2, residual=np.ones(8, F32))
    with pytest.raises(ArrayTypeError, match="x: expected dtype float32"):
        topk(cp.ones(8, dtype=cp.float64), 2)
