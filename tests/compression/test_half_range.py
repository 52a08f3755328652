"""Values at the edges of the wire formats and of the average's scale:
float16 and bfloat16 overflow and underflow, averages of float32 values
near their largest and smallest, against numpy (bfloat16 through
ml_dtypes), bit for bit. Four ranks as threads (tests/inprocess.py): the
average's scale, 1/4, is exact, so every reference is exact too."""
import warnings

import numpy as np
import pytest

from commlib.compression import BF16, FP16
from commlib.errors import NonFiniteError
from inprocess import run_ranks

N = 4
F16_MAX = float(np.finfo(np.float16).max)          # 65504
F16_TINY = 2.0 ** -24                               # the smallest float16 subnormal
F32_MAX = float(np.finfo(np.float32).max)


def wire(fmt):
    """The numpy dtype of a wire format (bfloat16 from ml_dtypes)."""
    if fmt == "fp16":
        return np.dtype(np.float16)
    return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)


def half_reference(inputs, fmt, op):
    """What a half-precision all-reduce gives: each rank's values (times
    1/N when averaging) rounded to the wire format, reduced in rank order,
    each step widened to float32 and rounded back; then float32."""
    dt = wire(fmt)
    terms = [(x * np.float32(1.0 / N) if op == "avg" else x).astype(dt) for x in inputs]
    acc = terms[0]
    with np.errstate(over="ignore", invalid="ignore"):
        for t in terms[1:]:
            acc = (acc.astype(np.float32) + t.astype(np.float32)).astype(dt)
    return acc.astype(np.float32)


def reduce_all(values_by_rank, op, compression):
    """Each rank all-reduces its own values; returns per rank the result and
    the error (class name, counts, culprits, text) or None, and the texts
    of the RuntimeWarnings of all ranks (warnings' filters are process-wide:
    recorded around the threads)."""
    def body(comm):
        x = np.array(values_by_rank[comm.rank], np.float32)
        try:
            comm.all_reduce([x], op=op, compression=compression)
            error = None
        except NonFiniteError as exc:
            error = (type(exc).__name__, exc.counts, exc.culprits, str(exc))
        return x, error

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_ranks(N, body)
    return results, [str(w.message) for w in caught if w.category is RuntimeWarning]


def same_bits(got, want):
    return got.tobytes() == np.asarray(want, np.float32).tobytes()


@pytest.mark.parametrize("fmt, big", [("fp16", 60000.0), ("bf16", 3.0e38)])
def test_average_near_the_wire_maximum_is_divided_before_the_cast(fmt, big):
    """Each rank's value is near the format's largest: their sum is not
    representable, their average is; dividing first keeps it finite."""
    inputs = [np.full(5, big, np.float32) for _ in range(N)]
    want = half_reference(inputs, fmt, "avg")
    assert np.isfinite(want).all()
    results, warned = reduce_all(inputs, "avg", fmt)
    assert not warned
    for x, error in results:
        assert error is None and same_bits(x, want), (x, want, error)


@pytest.mark.parametrize("fmt, value", [("fp16", 20000.0), ("bf16", 1.0e38)])
def test_sum_beyond_the_wire_maximum(fmt, value):
    """The sum overflows the wire format: no rank sent a non-finite value,
    so nobody is blamed; with "raise" nothing is written, with "warn" the
    infinities are, on every rank."""
    inputs = [np.full(5, value, np.float32) for _ in range(N)]
    want = half_reference(inputs, fmt, "sum")
    assert np.isinf(want).all()
    strategy = {"fp16": FP16, "bf16": BF16}[fmt]
    results, warned = reduce_all(inputs, "sum", strategy())
    assert not warned
    for x, error in results:
        name, counts, culprits, text = error
        assert (name, counts, culprits) == ("NonFiniteError", (0,) * N, ()), error
        assert "holds 5 NaN or inf" in text and "overflowed" in text, text
        assert same_bits(x, inputs[0])
    results, warned = reduce_all(inputs, "sum", strategy(nonfinite="warn"))
    assert len(warned) == N and all("holds 5 NaN or inf" in w for w in warned), warned
    for x, error in results:
        assert error is None and same_bits(x, want), (x, error)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_values_below_the_wire_minimum(fmt):
    """Subnormal and too small values round to nearest even in the wire
    format (to zero below half its smallest subnormal), per rank, then sum."""
    tiny = F16_TINY if fmt == "fp16" else 2.0 ** -133       # bfloat16's smallest subnormal
    row = [tiny * 0.49, tiny * 0.5, tiny * 0.51, tiny, tiny * 1.5, tiny * 2.5, -tiny * 0.75,
           tiny * 1024]
    inputs = [np.array(row, np.float32) * np.float32(r + 1) for r in range(N)]
    for op in ("sum", "avg"):
        want = half_reference(inputs, fmt, op)
        results, warned = reduce_all(inputs, op, fmt)
        assert not warned
        for x, error in results:
            assert error is None and same_bits(x, want), (op, x, want)
    assert half_reference([inputs[0]] * N, fmt, "sum")[0] == 0.0       # 0.49 ulp: gone


def float32_average(inputs):
    """commlib's average: the float32 sum in rank order, times 1/N."""
    acc = inputs[0].copy()
    with np.errstate(over="ignore"):
        for x in inputs[1:]:
            acc = acc + x
    return acc * np.float32(1.0 / N)


@pytest.mark.parametrize("values", [
    [F32_MAX / 2] * N,                      # the sum overflows: inf, as the definition says
    [F32_MAX / 8] * N,                      # just fits
    [F32_MAX, -F32_MAX, F32_MAX, -F32_MAX],  # rank order keeps every partial sum finite
    [2.0 ** -149, 0.0, 0.0, 0.0],           # the smallest subnormal times 1/4: rounds to 0
    [2.0 ** -149] * N,                      # four of it times 1/4: itself
    [2.0 ** -126 * 3, 0.0, 0.0, 0.0],       # a normal number whose quarter is subnormal
], ids=["overflow", "fits", "cancels", "underflow", "subnormal", "to subnormal"])
def test_uncompressed_average_at_the_float32_limits(values):
    inputs = [np.full(7, v, np.float32) for v in values]
    want = float32_average(inputs)
    results, _ = reduce_all(inputs, "avg", None)
    for x, error in results:
        assert error is None and same_bits(x, want), (x, want)
