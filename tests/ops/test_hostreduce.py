"""commlib.ops.hostreduce: one rank's share of a shared-memory all-reduce,
read from its arrays, against numpy's ufunc reduction in rank order."""
import numpy as np
import pytest

from commlib.errors import CommlibError
from commlib.ops import hostcast, hostreduce

pytestmark = pytest.mark.skipif(not hostreduce.supports(np.dtype(np.float32), "sum"),
                                reason="compiled host loops unavailable")

UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
DTYPES = ["float32", "float64", "int32", "int64", "uint8"]
SIZES = [0, 1, 7, 256, 0, 3, 64, 13, 1, 100]       # parts of a bucket, odd and empty


def contributions(dtype, n, count, rng):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        x = (rng.standard_normal((n, count)) * 3).astype(dtype)
        x.flat[rng.integers(0, x.size, 5)] = np.nan       # NaN propagation of max/min
        x.flat[rng.integers(0, x.size, 3)] = np.inf
        x.flat[rng.integers(0, x.size, 3)] = -0.0
        return x
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, (n, count), dtype=dtype, endpoint=True)  # wraps


def split(flat, sizes, shapes=True):
    """Arrays of ``sizes`` elements (some 2-D) holding consecutive pieces of ``flat``."""
    out, at = [], 0
    for k, size in enumerate(sizes):
        piece = flat[at:at + size].copy()
        out.append(piece.reshape(size // 4, 4) if shapes and size % 4 == 0 and size and k % 2
                   else piece)
        at += size
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(UFUNCS))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_rank_share_matches_numpy(dtype, op, n):
    rng = np.random.default_rng(hash((dtype, op, n)) % 2**32)
    count = sum(SIZES)
    x = contributions(dtype, n, count, rng)
    with np.errstate(all="ignore"):
        want = x[0].copy()
        for q in range(1, n):
            want = UFUNCS[op](want, x[q])
    for rank in range(n):
        lo, hi = count * rank // n, count * (rank + 1) // n
        slots = [x[q].copy() for q in range(n)]
        slots[rank][:] = 0                 # never read: this rank's data is in its parts
        parts = split(x[rank], SIZES)
        result = np.full(count + 5, 99, dtype=dtype)
        hostreduce.reduce_share(parts, tuple(slots), rank, result, lo, hi, op)
        assert result[lo:hi].tobytes() == want[lo:hi].tobytes(), (rank, op)
        assert (result[:lo] == 99).all() and (result[hi:] == 99).all()
        got = np.concatenate(parts, axis=None)
        expect = x[rank].copy()
        expect[lo:hi] = want[lo:hi]
        assert got.tobytes() == expect.tobytes()


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "bfloat16 bits"])
@pytest.mark.parametrize("op", list(UFUNCS))
@pytest.mark.parametrize("n", [2, 3])
def test_half_formats_round_as_the_numpy_twin_at_every_step(fmt, op, n):
    """float16 and bfloat16 (an ml_dtypes array, or uint16 bits with
    fmt="bfloat16"): each element is the rank-order reduction of the numpy
    twin of the MPI operators (hostcast.numpy_reduce_into: widened to
    float32, op, rounded back to nearest even with the canonical NaN, at
    every step), NaN, inf and signed zeros included."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(hash((fmt, op, n)) % 2**32)
    count = sum(SIZES)
    wide = contributions("float32", n, count, rng) * np.float32(1 + 1 / 3)
    wide[0, :4] = (65504, -65504, 3e38, 1e-8)                  # overflow and underflow
    dtype = np.float16 if fmt == "float16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):
        x = wide.astype(dtype)
    bits = fmt == "bfloat16 bits"
    want = x[0].copy()
    raw = (lambda a: a.view(np.uint16)) if fmt != "float16" else (lambda a: a)
    with np.errstate(over="ignore"):
        for q in range(1, n):
            hostcast.numpy_reduce_into(raw(x[q]), raw(want), op)
    for rank in range(n):
        lo, hi = count * rank // n, count * (rank + 1) // n
        slots = [(x[q].view(np.uint16) if bits else x[q]).copy() for q in range(n)]
        parts = split(x[rank].view(np.uint16) if bits else x[rank], SIZES)
        result = np.zeros(count, np.uint16 if bits else dtype)
        hostreduce.reduce_share(parts, tuple(slots), rank, result, lo, hi, op,
                                fmt="bfloat16" if bits else None)
        assert result[lo:hi].tobytes() == want[lo:hi].tobytes(), (rank, op)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scale_is_applied_in_the_element_type(dtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 1001)).astype(dtype)
    scale = 1.0 / 3
    want = ((x[0] + x[1]) + x[2]) * np.dtype(dtype).type(scale)
    parts = split(x[1], [500, 0, 501], shapes=False)
    result = np.zeros(1001, dtype)
    hostreduce.reduce_share(parts, tuple(x), 1, result, 0, 1001,
                            "sum", scale)
    assert result.tobytes() == want.tobytes()
    assert np.concatenate(parts).tobytes() == want.tobytes()


def test_subnormals_are_not_flushed():
    tiny = np.float32(1e-40)
    x = np.full((2, 8), tiny, np.float32)
    parts = [x[0].copy()]
    result = np.zeros(8, np.float32)
    hostreduce.reduce_share(parts, tuple(x), 0, result, 0, 8, "sum")
    assert (result == tiny + tiny).all() and result[0] != 0


def test_unsupported_inputs_write_nothing():
    x = np.ones((2, 16), np.float32)
    table = tuple(x)
    result = np.zeros(16, np.float32)
    part = np.full(16, 5, np.float32)
    readonly = part.copy()
    readonly.flags.writeable = False
    for parts, op in [([part[::2], part[::2]], "sum"),         # strided
                      ([readonly], "sum"),                      # read-only
                      ([part.astype(np.float64)], "sum"),       # another dtype
                      ([part[:8]], "sum"),                       # shorter than the range
                      ([part], "avg")]:                          # not an op
        with pytest.raises(CommlibError):
            hostreduce.reduce_share(parts, table, 0, result, 0, 16, op)
        assert (result == 0).all() and (part == 5).all()
    for slots, out in [(table, result[:8]),                       # result shorter than the range
                       ((x[0], x[1][:8]), result),                 # a slot shorter than the range
                       ((x[0],), result),                          # one rank only
                       ((x[0], x[1].astype(np.float64)), result)]:   # a slot of another dtype
        with pytest.raises(CommlibError):
            hostreduce.reduce_share([part], slots, 0, out, 0, 16, "sum")
        assert (result == 0).all() and (part == 5).all()
    assert hostreduce.supports(np.dtype(np.float16), "sum")
    assert not hostreduce.supports(np.dtype(np.uint16), "sum")          # bits of what?
    assert hostreduce.supports(np.dtype(np.uint16), "sum", fmt="bfloat16")
    assert not hostreduce.supports(np.dtype(np.float32), "sum", fmt="bfloat16")
    assert not hostreduce.supports(np.dtype(">f4"), "sum")
    assert not hostreduce.supports(np.dtype(np.float32), "avg")


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_own_float32_share_is_cast_in_the_reduction(fmt, op, n):
    """cast_own: this rank's float32 parts times the scale, rounded to the
    half format (the numpy twin cast, as into a slot), take part in the
    rank-order reduction; the parts are only read; the counts are the NaN
    and inf the rounding gave and those in the reduced range, counted here
    by numpy on the twin's bits."""
    storage = np.float16 if fmt == "float16" else np.uint16
    rng = np.random.default_rng(hash((fmt, op, n)) % 2**32)
    count, scale = sum(SIZES), np.float32(1 / 3)
    wide = (rng.standard_normal((n, count)) * 100).astype(np.float32)
    wide[:, 5] = np.nan                                  # in every rank's cast
    wide[:, 7] = 3e5 if fmt == "float16" else 3e38       # inf once cast and scaled (float16)
    wide[:, count - 3] = 60000 * 3                       # 60000 each: the float16 sum overflows
    # and inside the long parts, which the vector loops take eight at a time:
    # one rank's NaN, every rank's inf, a sum that overflows (float16)
    for k, at in enumerate(range(9, count - 2, 41)):
        wide[k % n, at] = np.nan
        wide[:, at + 1] = 3e5 if fmt == "float16" else 3e38
        wide[:, at + 2] = 60000 * 3 if k % 2 else wide[:, at + 2]
    half = np.empty((n, count), storage)
    with np.errstate(over="ignore", invalid="ignore"):
        for q in range(n):
            hostcast.numpy_cast_into(wide[q], half[q], scale)
        want = half[0].copy()
        for q in range(1, n):
            hostcast.numpy_reduce_into(half[q], want, op)
    exponent = 0x7C00 if fmt == "float16" else 0x7F80

    def nonfinite(bits):
        return int(((bits.view(np.uint16) & exponent) == exponent).sum())

    for rank in range(n):
        lo, hi = count * rank // n, count * (rank + 1) // n
        slots = [half[q].copy() for q in range(n)]
        slots[rank][:] = 0                        # never read: cast from the parts
        parts = split(wide[rank], SIZES)
        before = [p.copy() for p in parts]
        result = np.full(count + 3, 7, storage)
        got = hostreduce.reduce_share(parts, tuple(slots), rank, result, lo, hi, op, None,
                                      False, "bfloat16" if fmt == "bfloat16" else None,
                                      cast_own=scale)
        assert result[lo:hi].tobytes() == want[lo:hi].tobytes(), (rank, op)
        assert (result[:lo] == 7).all() and (result[hi:] == 7).all()
        assert got == (nonfinite(half[rank][lo:hi]), nonfinite(want[lo:hi])), (rank, got)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(parts, before))


def test_cast_own_refuses_what_it_cannot_cast():
    """Parts that are not aligned float32, or a result that is not a half
    format: CommlibError, nothing written."""
    table = tuple(np.ones((2, 16), np.float16))
    result = np.zeros(16, np.float16)
    raw = np.zeros(16 * 4 + 1, np.uint8)
    unaligned = raw[1:].view(np.float32)
    for parts, out in [([np.ones(16, np.float64)], result),         # not float32
                       ([unaligned], result),                       # not aligned
                       ([np.ones(8, np.float32)], result),          # shorter than the range
                       ([np.ones(16, np.float32)], np.zeros(16, np.float32))]:  # not half
        slots = table if out.dtype == np.float16 else tuple(np.ones((2, 16), np.float32))
        with pytest.raises(CommlibError, match="aligned float32"):
            hostreduce.reduce_share(parts, slots, 0, out, 0, 16, "sum", cast_own=1.0)
        assert (out == 0).all()
