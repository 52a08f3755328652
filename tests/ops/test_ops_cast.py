"""commlib.ops.cast: the numpy twin against independent references, and (on a
GPU) the CUDA kernels against the twin, bit for bit."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from commlib.errors import ArgumentError, ArrayTypeError
from commlib.ops.cast import FORMATS, cast, format_of, storage_dtype

STORE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
CANONICAL_NAN = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}
BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}

# float32 bit patterns at the edges that matter
EDGES = np.array([
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,          # +-0, +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF,  # NaNs (quiet, signalling)
    0x00000001, 0x807FFFFF, 0x00800000, 0x00008000, 0x00018000,  # fp32 subnormals, min normal
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0xC77FF000,  # fp16 max 65504 .. 65520
    0x33000000, 0x33000001, 0x337FFFFF, 0x33800000, 0x33C00000,  # fp16 subnormal edge 2^-25
    0x387FC000, 0x387FE000, 0x38800000, 0x38FFF000,              # fp16 subnormal/normal edge
    0x3F802000, 0x3F803000, 0x3F801000, 0x3F805000,              # fp16 rounding ties near 1
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000,  # bf16 ties near 1
    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0x7F7EFFFF,  # bf16 overflow edge
], dtype=np.uint32)


def adversarial(fmt, n, seed):
    """n values of format ``fmt`` (storage dtype): random bit patterns, normal
    values and the EDGES (for float32) mixed together."""
    rng = np.random.default_rng(seed)
    if fmt == "float32":
        bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        normal = rng.standard_normal(n).astype(np.float32).view(np.uint32)
        bits = np.where(rng.random(n) < 0.5, normal, bits)
        pick = rng.random(n) < 0.2
        bits[pick] = rng.choice(EDGES, int(pick.sum()))
        return bits.view(np.float32)
    bits = rng.integers(0, 2**16, n, dtype=np.uint32).astype(np.uint16)
    return bits.view(np.float16) if fmt == "float16" else bits


# ---------------------------------------------------------------- references

def widen64(a, fmt):
    """float64 values of an array of format ``fmt``."""
    with np.errstate(invalid="ignore"):         # signalling NaNs
        if fmt == "bfloat16":
            return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return a.astype(np.float64)


def ref_round(v, fmt):
    """Round float64 ``v`` to format ``fmt`` with round-to-nearest-even, in
    float64 arithmetic (frexp / rint / ldexp), independent of numpy casts."""
    p, emin, emax = {"float16": (11, -14, 15), "bfloat16": (8, -126, 127),
                     "float32": (24, -126, 127)}[fmt]
    v = np.asarray(v, np.float64)
    out = v.copy()
    fin = np.isfinite(v)
    _, e = np.frexp(v[fin])
    q = np.maximum(e - p, emin - p + 1)           # exponent of one ulp
    r = np.ldexp(np.rint(np.ldexp(v[fin], -q)), q)
    big = np.abs(r) > (2 - 2.0 ** (1 - p)) * 2.0 ** emax
    r[big] = np.copysign(np.inf, r[big])
    out[fin] = r
    return out


def assert_matches_reference(out, fmt, want):
    """``out`` (format ``fmt``) holds ``want`` (float64), NaNs canonical."""
    got = widen64(out, fmt)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert np.all(out.view(BITS[fmt])[nan] == CANONICAL_NAN[fmt])
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


def expected(x, fmt, scale=1.0, out=None, accumulate=False):
    """Reference result (float64 values) and non-finite count of cast()."""
    xf = np.float32(widen64(x, format_of(x.dtype)).astype(np.float32) * np.float32(scale))
    v = xf.astype(np.float32)
    if accumulate:
        v = (widen64(out, fmt).astype(np.float32) + v).astype(np.float32)
    want = ref_round(v.astype(np.float64), fmt)
    return want, int(np.count_nonzero(~np.isfinite(want)))


# ---------------------------------------------------------------- twin, CPU

@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "float32"])
def test_float32_to_narrow_matches_reference(fmt):
    x = np.concatenate([EDGES.view(np.float32), adversarial("float32", 5000, 0)])
    with np.errstate(all="ignore"):
        want, count = expected(x, fmt)
    out, nonfinite = cast(x, fmt)
    assert out.dtype == STORE[fmt] and out.shape == x.shape
    assert_matches_reference(out, fmt, want)
    assert isinstance(nonfinite, np.ndarray) and nonfinite.shape == () \
        and nonfinite.dtype == np.int64
    assert int(nonfinite) == count


def test_float16_matches_numpy_astype():
    x = adversarial("float32", 20000, 1)
    out, _ = cast(x, "float16")
    with np.errstate(all="ignore"):
        ref = x.astype(np.float16)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(out.view(np.uint16)[~nan], ref.view(np.uint16)[~nan])
    assert np.all(out.view(np.uint16)[nan] == 0x7E00)


@pytest.mark.parametrize("bits,want", [
    (0x3F808000, 0x3F80), (0x3F818000, 0x3F82), (0x3F808001, 0x3F81), (0x3F807FFF, 0x3F80),
    (0xBF808000, 0xBF80), (0x7F7F7FFF, 0x7F7F), (0x7F7F8000, 0x7F80), (0xFF7F8000, 0xFF80),
    (0x7F800000, 0x7F80), (0x7F800001, 0x7FC0), (0xFFFFFFFF, 0x7FC0), (0x00008000, 0x0000),
    (0x00018000, 0x0002), (0x80000000, 0x8000), (0x00000001, 0x0000)])
def test_bfloat16_ties_overflow_nan(bits, want):
    out, count = cast(np.array([bits], np.uint32).view(np.float32), "bfloat16")
    assert hex(int(out[0])) == hex(want)
    assert int(count) == int((want & 0x7F80) == 0x7F80)


@pytest.mark.parametrize("value,want,nonfinite", [
    (65504.0, 0x7BFF, 0), (65519.99, 0x7BFF, 0), (65520.0, 0x7C00, 1), (-65520.0, 0xFC00, 1),
    (2.0 ** -24, 0x0001, 0), (2.0 ** -25, 0x0000, 0), (1.5 * 2.0 ** -25, 0x0001, 0),
    (3 * 2.0 ** -25, 0x0002, 0), (2.0 ** -14, 0x0400, 0), (1 + 2.0 ** -11, 0x3C00, 0),
    (1 + 3 * 2.0 ** -11, 0x3C02, 0), (float("inf"), 0x7C00, 1), (float("nan"), 0x7E00, 1)])
def test_float16_edges(value, want, nonfinite):
    out, count = cast(np.array([value], np.float32), "float16")
    assert hex(int(out.view(np.uint16)[0])) == hex(want)
    assert int(count) == nonfinite


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_every_narrow_value_round_trips(fmt):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(np.float16) if fmt == "float16" else bits
    wide, count = cast(x, "float32")
    exp_mask = 0x7C00 if fmt == "float16" else 0x7F80
    special = (bits & exp_mask) == exp_mask
    assert int(count) == int(special.sum())
    np.testing.assert_array_equal(widen64(x, fmt)[~special], wide[~special])
    back, _ = cast(wide, fmt)
    nan = (bits & 0x7FFF) > exp_mask
    np.testing.assert_array_equal(back.view(np.uint16)[~nan], bits[~nan])
    assert np.all(back.view(np.uint16)[nan] == CANONICAL_NAN[fmt])


@pytest.mark.parametrize("src", FORMATS)
@pytest.mark.parametrize("dst", FORMATS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "acc"])
def test_all_pairs_scale_accumulate_views(src, dst, accumulate):
    xb = adversarial(src, 600, 2)
    ob = adversarial(dst, 600, 3)
    for n, lo, hi in [(0, 0, 0), (1, 0, 1), (7, 1, 8), (513, 3, 516), (590, 3, -2)]:
        x = xb[lo:hi] if hi else xb[lo:]
        for scale in (1.0, 0.5, -3.0, 1e-30, 7e4):
            out = ob[-x.size:].copy() if x.size else ob[:0].copy()
            with np.errstate(all="ignore"):
                want, count = expected(x, dst, scale, out, accumulate)
            res, nonfinite = cast(x, dst, scale=scale, out=out, accumulate=accumulate)
            assert res is out
            assert_matches_reference(out, dst, want)
            assert int(nonfinite) == count


def test_subnormals_are_kept():
    tiny = np.array([0x00000001, 0x00400000, 0x807FFFFF], np.uint32).view(np.float32)
    out, _ = cast(tiny, "float32", scale=2.0)
    np.testing.assert_array_equal(out, tiny * np.float32(2))
    assert np.all(out != 0)
    bf = np.array([0x0001, 0x8040, 0x007F], np.uint16)             # bf16 subnormals
    wide, count = cast(bf, "float32")
    assert int(count) == 0 and np.all(wide != 0)
    back, _ = cast(wide, "bfloat16")
    np.testing.assert_array_equal(back, bf)


def test_in_place_and_shapes():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out, _ = cast(x, "float32", scale=0.5, out=x)
    assert out is x and x[2, 3] == 5.5
    h, _ = cast(x, np.float16)
    assert h.shape == (3, 4) and h.dtype == np.float16
    zero_d, _ = cast(np.full((), 3.0, np.float32), "bfloat16")
    assert zero_d.shape == () and int(zero_d) == 0x4040


def test_counter_accumulates():
    counter = np.zeros((), np.int64)
    x = np.array([1.0, np.inf, 7e4], np.float32)
    _, c1 = cast(x, "float16", nonfinite=counter)
    _, c2 = cast(x, "bfloat16", nonfinite=counter)
    assert c1 is counter and c2 is counter
    assert int(counter) == 2 + 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=64),
       st.sampled_from(["float16", "bfloat16"]),
       st.sampled_from([1.0, 0.25, 3.0, -1e-3, 1e20]),
       st.integers(0, 3))
def test_random_bit_patterns(bits, fmt, scale, offset):
    x = np.array([0] * offset + bits, np.uint32).view(np.float32)[offset:]
    with np.errstate(all="ignore"):
        want, count = expected(x, fmt, scale)
    out, nonfinite = cast(x, fmt, scale=scale)
    assert_matches_reference(out, fmt, want)
    assert int(nonfinite) == count


def test_argument_errors():
    x = np.ones(4, np.float32)
    with pytest.raises(ArrayTypeError, match="x: expected dtype"):
        cast(np.ones(4), "float16")
    with pytest.raises(ArrayTypeError, match="x: expected a numpy or cupy array"):
        cast([1.0, 2.0], "float16")
    with pytest.raises(ArgumentError, match="dtype: expected one of"):
        cast(x, "int8")
    with pytest.raises(ArgumentError, match="dtype"):
        cast(x, np.uint16)              # ambiguous: name bfloat16 explicitly
    with pytest.raises(ArgumentError, match="accumulate=True needs out"):
        cast(x, "float16", accumulate=True)
    with pytest.raises(ArgumentError, match="out: expected shape"):
        cast(x, "float16", out=np.empty(5, np.float16))
    with pytest.raises(ArrayTypeError, match="out: expected dtype"):
        cast(x, "bfloat16", out=np.empty(4, np.float16))
    with pytest.raises(ArrayTypeError, match="C-contiguous"):
        cast(np.ones(8, np.float32)[::2], "float16")
    with pytest.raises(ArgumentError, match="scale"):
        cast(x, "float16", scale=float("inf"))
    with pytest.raises(ArgumentError, match="scale"):
        cast(x, "float16", scale="2")
    with pytest.raises(ArrayTypeError, match="nonfinite"):
        cast(x, "float16", nonfinite=np.zeros(1, np.int64))
    assert storage_dtype("bfloat16") == np.uint16
    assert format_of(np.float64) is None


# ---------------------------------------------------------------- kernels, GPU

def _gpu_vs_twin(cp, x_np, dst, scale, accumulate, lo=0, hi=None, out_np=None):
    """Run the kernel on a (possibly misaligned) cupy view and the twin on
    numpy; compare every bit and the count."""
    x_dev = cp.asarray(x_np)[lo:hi]
    x_host = x_np[lo:hi]
    if out_np is None:
        out_np = np.zeros(x_host.shape, STORE[dst])
    out_dev = cp.asarray(np.concatenate([out_np[:1], out_np]))[1:] if lo % 2 else \
        cp.asarray(out_np)
    out_host = out_np.copy()
    _, c_dev = cast(x_dev, dst, scale=scale, out=out_dev, accumulate=accumulate)
    _, c_host = cast(x_host, dst, scale=scale, out=out_host, accumulate=accumulate)
    assert isinstance(c_dev, cp.ndarray) and c_dev.shape == () and c_dev.dtype == np.int64
    np.testing.assert_array_equal(cp.asnumpy(out_dev).view(np.uint8), out_host.view(np.uint8))
    assert int(c_dev) == int(c_host)


@pytest.mark.gpu
@pytest.mark.parametrize("src", FORMATS)
@pytest.mark.parametrize("dst", FORMATS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "acc"])
def test_gpu_kernel_equals_twin(src, dst, accumulate):
    import cupy as cp
    x = adversarial(src, 100_003, 10)
    for lo, hi in [(0, None), (1, None), (3, -2), (5, 6), (0, 0), (2, 9)]:
        n = x[lo:hi].size
        out = adversarial(dst, n, 11) if accumulate else None
        for scale in (1.0, 0.125, -7e4):
            _gpu_vs_twin(cp, x, dst, scale, accumulate, lo, hi, out)


@pytest.mark.gpu
@pytest.mark.parametrize("src,dst,accumulate", [
    ("float32", "float16", False), ("float32", "bfloat16", False),
    ("float16", "float32", True), ("bfloat16", "float32", True)])
def test_gpu_large_misaligned(src, dst, accumulate):
    import cupy as cp
    n = 10_000_003
    x = adversarial(src, n + 3, 12)
    out = adversarial(dst, n, 13) if accumulate else None
    _gpu_vs_twin(cp, x, dst, 0.5, accumulate, 3, None, out)


@pytest.mark.gpu
def test_gpu_counter_stays_on_device_and_accumulates():
    import cupy as cp
    x = cp.asarray(np.array([1.0, np.inf, np.nan, 7e4, 3.4e38], np.float32))
    counter = cp.zeros((), cp.int64)
    cast(x, "float16", nonfinite=counter)
    cast(x, "bfloat16", nonfinite=counter)
    assert isinstance(counter, cp.ndarray)
    assert int(counter) == 4 + 3
    with pytest.raises(ArrayTypeError):
        cast(x, "float16", out=np.empty(5, np.float16))
