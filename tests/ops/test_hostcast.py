"""The compiled host casts (commlib/native/hostcast.c via commlib.ops.hostcast)
against the numpy twin numpy_cast_into, bit for bit, on both code paths
(AVX2 + F16C and portable C): every float16 and bfloat16 pattern, float32
values at every float16/bfloat16 rounding tie and its neighbours, NaN
payloads, infinities, subnormals, -0, the float16 overflow boundary, scales,
accumulation, odd lengths, misaligned views and empty arrays."""
import numpy as np
import pytest

from commlib.ops import native, hostcast
from commlib.ops.cast import numpy_cast_into

pytestmark = pytest.mark.skipif(not native.available(), reason="compiled host loops not built: %s"
                                % native.unavailable_reason())
BEST = hostcast.level() if native.available() else None
LEVELS = [hostcast.PORTABLE, hostcast.AVX2]


@pytest.fixture(params=LEVELS, ids=["portable", "avx2"])
def level(request):
    if request.param > BEST:
        pytest.skip("this CPU lacks AVX2/F16C: only the portable path runs here")
    assert hostcast.level(request.param) == request.param
    yield request.param
    hostcast.level(hostcast.AVX2)


STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def bits(a):
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def all_halves():
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def adversarial_f32():
    """float32 bit patterns at and around every float16 and bfloat16 rounding
    tie, plus specials and random patterns over the whole range."""
    h = all_halves().view(np.float16)
    finite = np.sort(h[np.isfinite(h)].astype(np.float64))
    finite = np.unique(finite)
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)       # exact in float32
    mids = np.concatenate([mids, [65520.0, 65504.0, 2.0 ** -25, 2.0 ** -24]]).astype(np.float32)
    u = mids.view(np.uint32)
    bf_mid = (all_halves().astype(np.uint32) << 16) | 0x8000
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                        0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x00000001,
                        0x807FFFFF, 0x00800000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x7F7FFFFF,
                        0x7F7F7FFF, 0x7F7F8000, 0xFF7F8000, 0x33000000, 0x33000001, 0x38800000,
                        0x387FFFFF], dtype=np.uint32)
    rand = np.random.default_rng(5).integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    parts = [special, rand]
    for p in (u, bf_mid):
        parts += [p, p - 1, p + 1, p | 0x80000000]
    return np.concatenate(parts).view(np.float32)


def compiled_and_twin(x, dst, scale=1.0, accumulate=False, out_init=None):
    out_c = np.empty(x.shape, STORAGE[dst]) if out_init is None else out_init.copy()
    out_t = out_c.copy()
    count_c = hostcast.cast_into(x, out_c, np.float32(scale), accumulate)
    count_t = numpy_cast_into(x, out_t, np.float32(scale), accumulate)
    return out_c, out_t, count_c, count_t


def assert_same(x, dst, **kw):
    out_c, out_t, count_c, count_t = compiled_and_twin(x, dst, **kw)
    np.testing.assert_array_equal(bits(out_c), bits(out_t))
    assert count_c == count_t


@pytest.mark.parametrize("src", ["float16", "bfloat16"])
@pytest.mark.parametrize("dst", ["float32", "float16", "bfloat16"])
def test_every_half_pattern(level, src, dst):
    x = all_halves().view(STORAGE[src])
    assert_same(x, dst)
    assert_same(x, dst, scale=0.3)
    # accumulate onto every pattern reversed
    init = np.empty(x.size, STORAGE[dst])
    numpy_cast_into(x[::-1].copy(), init)
    assert_same(x, dst, accumulate=True, out_init=init)


@pytest.mark.parametrize("dst", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3, 3.0e5, 1e-30, -2.0])
def test_adversarial_float32(level, dst, scale):
    assert_same(adversarial_f32(), dst, scale=scale)


def test_float16_rounding_against_numpy_astype(level):
    """An independent reference: numpy's own float32 -> float16 conversion
    (round to nearest even), NaN made canonical."""
    x = adversarial_f32()
    out = np.empty(x.size, np.float16)
    count = hostcast.cast_into(x, out)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.astype(np.float16)
    ref[np.isnan(ref)] = np.float16(np.nan)
    ref_bits = bits(ref).copy()
    ref_bits[np.isnan(ref)] = 0x7E00
    np.testing.assert_array_equal(bits(out), ref_bits)
    assert count == int(np.count_nonzero(~np.isfinite(ref)))
    assert bits(out)[x.view(np.uint32) == 0x477FF000][0] == 0x7C00      # 65520 -> inf
    assert bits(out)[x.view(np.uint32) == 0x477FEFFF][0] == 0x7BFF      # just below -> 65504


@pytest.mark.parametrize("dst", ["float16", "bfloat16", "float32"])
def test_accumulate_with_specials(level, dst):
    x = adversarial_f32()
    rng = np.random.default_rng(1)
    init = np.empty(x.size, STORAGE[dst])
    numpy_cast_into(rng.permutation(x), init)
    assert_same(x, dst, scale=0.7, accumulate=True, out_init=init)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 511, 512, 513, 1023, 1025, 100003])
@pytest.mark.parametrize("dst", ["float16", "bfloat16"])
def test_odd_lengths_and_misaligned_views(level, n, dst):
    base = np.random.default_rng(n).standard_normal(n + 3).astype(np.float32) * 1e4
    for off in (0, 1, 3):
        x = base[off:off + n]
        assert_same(x, dst, scale=0.25)
        wire = np.empty(n + 3, STORAGE[dst])[off:off + n]
        hostcast.cast_into(x, wire, np.float32(0.25))
        back_c, back_t = np.empty(n, np.float32), np.empty(n, np.float32)
        hostcast.cast_into(wire, back_c)
        numpy_cast_into(wire, back_t)
        np.testing.assert_array_equal(bits(back_c), bits(back_t))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 511, 512, 513, 100003])
@pytest.mark.parametrize("dst", ["float16", "bfloat16"])
def test_streaming_stores_write_the_same_bits(level, n, dst):
    """A cast with non-temporal stores (the shared-memory slots' writes)
    writes what the plain one writes, from every start within 16 bytes
    (plain stores up to the first aligned one), and nothing outside."""
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 3e4
    x[::97] = np.inf
    x[5::101] = np.nan
    want = np.empty(n, STORAGE[dst])
    sent = hostcast.cast_into(x, want, np.float32(0.5))
    for off in range(9):
        guard = np.full(n + 16, 0x5A5A, np.uint16).view(STORAGE[dst])
        got = guard[off:off + n]
        assert hostcast.cast_into(x, got, np.float32(0.5), streaming=True) == sent
        np.testing.assert_array_equal(bits(got), bits(want))
        assert (guard.view(np.uint16)[:off] == 0x5A5A).all()
        assert (guard.view(np.uint16)[off + n:] == 0x5A5A).all()


def test_byte_misaligned_arrays_take_the_twin():
    raw = np.zeros(4 * 1001 + 1, np.uint8)
    x = raw[1:].view(np.float32)                  # not 4-byte aligned
    x[...] = np.linspace(-70000, 70000, 1001, dtype=np.float32)
    assert not x.flags.aligned
    ext = native.module()
    out = np.empty(1001, np.float16)
    assert ext.cast(x, out, None, 0) == -1        # refused, nothing written
    assert_same(x, "float16")


def test_the_compiled_loop_runs():
    """The wrapper must not silently be the twin: the C entry point takes
    qualifying arrays and refuses the others."""
    ext = native.module()
    x = np.array([1.0, np.inf, np.nan, 70000.0], np.float32)
    out = np.empty(4, np.float16)
    assert ext.cast(x, out, None, 0) == 3
    assert bits(out).tolist() == [0x3C00, 0x7C00, 0x7E00, 0x7C00]
    assert ext.cast(x, np.empty(3, np.float16), None, 0) == -1           # sizes differ
    assert ext.cast(x, np.empty(4, np.float64), None, 0) == -1           # not a cast format
    assert ext.cast(x, x.view(np.uint16)[:4], None, 0) == -1             # overlapping memory
    assert ext.cast(x[::2], np.empty(2, np.float16), None, 0) == -1      # not contiguous
    ro = np.empty(4, np.float16)
    ro.flags.writeable = False
    assert ext.cast(x, ro, None, 0) == -1


def test_in_place(level):
    x = adversarial_f32()
    a, b = x.copy(), x.copy()
    count_c = hostcast.cast_into(a, a, np.float32(3.0), True)
    count_t = numpy_cast_into(b, b, np.float32(3.0), True)
    np.testing.assert_array_equal(bits(a), bits(b))
    assert count_c == count_t


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
def test_reduce_into_every_pattern(level, fmt, op):
    a = all_halves().view(STORAGE[fmt])
    b = np.random.default_rng(2).permutation(a)
    b_c, b_t = b.copy(), b.copy()
    hostcast.reduce_into(a, b_c, op)
    hostcast.numpy_reduce_into(a, b_t, op)
    np.testing.assert_array_equal(bits(b_c), bits(b_t))
    # independent check on the finite pairs: float32 op rounded back
    wa, wb = np.empty(a.size, np.float32), np.empty(a.size, np.float32)
    numpy_cast_into(a, wa)
    numpy_cast_into(b, wb)
    with np.errstate(all="ignore"):
        ref = {"sum": wb + wa, "prod": wb * wa, "max": np.maximum(wb, wa),
               "min": np.minimum(wb, wa)}[op]
    back = np.empty(a.size, np.float32)
    numpy_cast_into(b_c, back)
    fin = np.isfinite(ref)
    expect = np.empty(a.size, STORAGE[fmt])
    numpy_cast_into(ref, expect)
    np.testing.assert_array_equal(bits(b_c)[fin], bits(expect)[fin])


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16"])
def test_count_nonfinite(fmt):
    x = adversarial_f32()
    a = np.empty(x.size, STORAGE[fmt])
    numpy_cast_into(x, a)
    exponent = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}[fmt]
    expect = int(np.count_nonzero((bits(a) & exponent) == exponent))
    assert expect > 100
    assert hostcast.count_nonfinite(a, fmt) == expect
    assert hostcast.count_nonfinite(a[:0], fmt) == 0
    big = np.zeros(200003, STORAGE[fmt])          # past the 16-bit piece counters
    bits(big)[::3] = exponent
    assert hostcast.count_nonfinite(big, fmt) == 66668


def test_empty(level):
    for dst in STORAGE:
        assert hostcast.cast_into(np.empty(0, np.float32), np.empty(0, STORAGE[dst])) == 0
