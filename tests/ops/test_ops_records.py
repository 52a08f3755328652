"""commlib.ops.records on numpy (the twins the kernels are checked
against, tests/ops/test_kernels_cooperative.py): results against a
reference written here, argument errors naming the argument."""
import numpy as np
import pytest

from commlib.errors import ArgumentError, ArrayTypeError
from commlib.ops import records


def test_accumulate_finite():
    x = np.array([1.0, np.nan, 3e38, -np.inf, -0.0, 1e-45], np.float32)
    r = np.array([2.0, 1.0, 3e38, 1.0, 0.0, 1e-45], np.float32)
    acc = np.empty_like(x)
    header = np.full(5, 9, np.int32)
    records.accumulate_finite(r, x, acc, header, 11)
    want = np.array([3.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)     # 3e38 + 3e38 = inf
    want[5] = np.uint32(2).view(np.float32)                           # subnormals kept
    assert np.array_equal(acc.view(np.uint32), want.view(np.uint32))
    assert header.tolist() == [11, 3, 0, 0, 9]
    records.accumulate_finite(None, x, x, header, 0)                 # in place, no residual
    assert header[:4].tolist() == [0, 2, 0, 0] and x[2] == np.float32(3e38) and x[1] == 0


def _reference(idx, val, n):
    """[bad, unordered] of one rank's set, entry by entry."""
    bad = unordered = 0
    for j, (i, v) in enumerate(zip(idx.tolist(), val.tolist())):
        pad = i == -1 and v == 0
        bad += (not (0 <= i < n or pad)) or not np.isfinite(v)
        if j and not pad:
            p, pv = idx[j - 1], val[j - 1]
            unordered += (p == -1 and pv == 0) or i <= p
    return bad, unordered


@pytest.mark.parametrize("seed", range(6))
def test_split_records_against_a_reference(seed):
    rng = np.random.default_rng(seed)
    n, ranks = 50, int(rng.integers(1, 5))
    counts = [int(c) for c in rng.integers(0, 12, ranks)]
    sets = []
    for c in counts:
        idx = np.sort(rng.choice(n, c, replace=False)).astype(np.int32)
        val = rng.standard_normal(c).astype(np.float32)
        if c > 2:                                   # a fault or padding, by chance
            j = int(rng.integers(0, c))
            kind = int(rng.integers(0, 5))
            if kind == 0:
                idx[j] = n
            elif kind == 1:
                val[j] = np.inf
            elif kind == 2:
                idx[j:], val[j:] = -1, 0.0          # trailing padding: fine
            elif kind == 3:
                idx[j] = idx[j - 1]
        sets.append((idx, val))
    # records of different widths back to back, a gap between them
    src, layout, at = [], [], 0
    for idx, val in sets:
        layout.append((at + 4, at + 4 + idx.size, idx.size))
        src += [np.array([idx.size, 0, 0, 0], np.int32), idx, val.view(np.int32),
                np.full(3, 77, np.int32)]
        at += 4 + 2 * idx.size + 3
    src = np.concatenate(src)
    total = sum(counts)
    indices, values, reads = (np.empty(total, np.int32), np.empty(total, np.float32),
                              np.empty(2, np.int64))
    records.split_records(src, layout, n, indices, values, reads)
    assert np.array_equal(indices, np.concatenate([s[0] for s in sets]))
    assert np.array_equal(values.view(np.int32), np.concatenate([s[1] for s in sets]).view(np.int32))
    want = np.sum([_reference(i, v, n) for i, v in sets], axis=0).tolist() if sets else [0, 0]
    assert reads.tolist() == want


def test_split_records_headers():
    width, ranks = 4 + 2 * 3, 3
    src = np.arange(ranks * width, dtype=np.int32)
    src[[4 + r * width + j for r in range(ranks) for j in range(3)]] = [0, 1, 2] * ranks
    src[[7 + r * width + j for r in range(ranks) for j in range(3)]] = 0
    reads = np.empty(4 * ranks + 2, np.int64)
    records.split_records(src, [(r * width + 4, r * width + 7, 3) for r in range(ranks)], 9,
                          np.empty(9, np.int32), np.empty(9, np.float32), reads,
                          header_stride=width)
    assert reads.tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 0, 0]


def test_errors_name_the_argument():
    x = np.zeros(4, np.float32)
    with pytest.raises(ArgumentError, match="acc: length 3"):
        records.accumulate_finite(None, x, np.zeros(3, np.float32), np.zeros(4, np.int32), 0)
    with pytest.raises(ArgumentError, match="header: 3 elements"):
        records.accumulate_finite(None, x, x, np.zeros(3, np.int32), 0)
    with pytest.raises(ArrayTypeError, match="residual: expected dtype float32"):
        records.accumulate_finite(np.zeros(4), x, x, np.zeros(4, np.int32), 0)
    src = np.zeros(10, np.int32)
    i, v, r = np.zeros(3, np.int32), np.zeros(3, np.float32), np.zeros(2, np.int64)
    with pytest.raises(ArgumentError, match="rank 0's entries .* reach outside src's 10"):
        records.split_records(src, [(4, 8, 3)], 5, i, v, r)
    with pytest.raises(ArgumentError, match="expected 3 .the layout's entries"):
        records.split_records(src, [(0, 3, 3)], 5, np.zeros(2, np.int32), v, r)
    with pytest.raises(ArgumentError, match="reads: 2 elements, expected 6"):
        records.split_records(src, [(4, 7, 3)], 5, i, v, r, header_stride=10)
    with pytest.raises(ArgumentError, match="header_stride: 3"):
        records.split_records(src, [(4, 7, 3)], 5, i, v, np.zeros(6, np.int64), header_stride=3)
