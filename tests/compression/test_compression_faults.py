"""Faults in compressed all-reduce: the ``nonfinite=`` setting and payload
validation. Unit tests of the helpers here; whole calls on 1-4 real MPI
ranks through tests/compression/compression_fault_checks.py (with cupy arrays on a GPU)."""
import re

import numpy as np
import pytest

from commlib.compression import BF16, FP16, HalfPrecision, Partial, Threshold, TopK
from commlib.compression import nonfinite, _payload
from commlib.errors import ArgumentError, NonFiniteError, PayloadError
from commlib.ops.sparse import scatter_add
from mpirun import assert_each_rank, run_mpi

CODE = ("import sys, compression_fault_checks\n"
        "compression_fault_checks.main(sys.argv[1], sys.argv[2])\n")
F32, I32 = np.float32, np.int32


# --- settings ----------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda m: TopK(0.1, nonfinite=m),
                                  lambda m: Threshold(0.5, nonfinite=m),
                                  lambda m: FP16(nonfinite=m), lambda m: BF16(nonfinite=m),
                                  lambda m: HalfPrecision("float16", m)])
def test_nonfinite_setting(make):
    assert make("raise").nonfinite == "raise" and make("warn").nonfinite == "warn"
    assert make("raise").name != make("warn").name          # told apart by the fingerprint
    for bad in ("Raise", "ignore", None, 1, True):
        with pytest.raises(ArgumentError, match="nonfinite must be 'raise' or 'warn'"):
            make(bad)


@pytest.mark.parametrize("ratio", [1e-9, 0.5, 1, 1.0])
def test_topk_ratio_in_zero_one(ratio):
    assert TopK(ratio).ratio == float(ratio)
    assert TopK(ratio).k_for(1000) == min(1000, max(1, int(np.ceil(ratio * 1000))))


@pytest.mark.parametrize("ratio", [0, 0.0, -0.5, 1.0000001, 2, float("nan"), True, "0.5", None])
def test_topk_ratio_outside_zero_one(ratio):
    with pytest.raises(ArgumentError, match=r"^TopK: ratio must be a number in \(0, 1\], got "
                                            r"%s$" % re.escape(repr(ratio))):
        TopK(ratio)


@pytest.mark.parametrize("threshold", [0, 0.0, 1e-30, 3, 3.4e38])
def test_threshold_finite_and_not_negative(threshold):
    assert Threshold(threshold).threshold == float(threshold)


@pytest.mark.parametrize("threshold", [-1e-30, -1, float("inf"), float("nan"), True, "1", None])
def test_threshold_negative_infinite_or_no_number(threshold):
    with pytest.raises(ArgumentError, match=r"^Threshold: threshold must be a finite number >= "
                                            r"0, got %s$" % re.escape(repr(threshold))):
        Threshold(threshold)


def test_names():
    assert TopK().nonfinite == "raise" and TopK().name == \
        "topk(ratio=0.01,error_feedback=True,nonfinite='raise')"
    assert Threshold(0.5, nonfinite="warn").name == \
        "threshold(0.5,error_feedback=True,nonfinite='warn')"
    # the defaults keep the names of the compression= strings
    assert FP16().name == "fp16" and BF16().name == "bf16"
    assert FP16(nonfinite="warn").name == "fp16(nonfinite='warn')"
    assert not hasattr(Partial(0.5), "nonfinite")


def test_drop_zeroes_and_counts():
    acc = np.array([1.5, np.nan, -np.inf, -0.0, np.inf, 3e38], F32)
    keep = acc.copy()
    count = nonfinite.drop(acc)
    assert count == 3 and type(count) is int          # an int for numpy, not a numpy integer
    assert acc.tobytes() == np.array([1.5, 0, 0, -0.0, 0, 3e38], F32).tobytes()
    assert nonfinite.drop(acc) == 0 and acc[0] == keep[0]


def test_error_counts_and_culprits():
    exc = nonfinite.error("x", [0, 2, 0, 1])
    assert isinstance(exc, NonFiniteError) and isinstance(exc, FloatingPointError)
    assert exc.counts == (0, 2, 0, 1) and exc.culprits == (1, 3)
    assert nonfinite.ranks([0, 2, 0, 1]) == "rank 1 (2 values), rank 3 (1 value)"


# --- records and headers --------------------------------------------------------------

def header_of(indices, values, nonfinite=0, slots=None):
    return _payload.encode(np, indices, values, nonfinite, slots)[:_payload.HEADER]


def test_encode_layout():
    i, v = np.array([3, 7], I32), np.array([1.5, -2.0], F32)
    rec = _payload.encode(np, i, v, 4)
    assert rec.dtype == I32 and rec[:4].tolist() == [2, 4, 0, 0]
    assert rec[4:6].tolist() == [3, 7] and rec[6:].view(F32).tolist() == [1.5, -2.0]
    rec = _payload.encode(np, i, v, 0, slots=3)              # fixed width, count kept
    assert rec.size == 4 + 6 and rec[0] == 2 and rec[4:7].tolist() == [3, 7, 0]
    rec = _payload.encode(np, i, v, 0, slots=1)
    assert rec.size == 4 + 2 and rec[0] == 2 and rec[4] == 3


@pytest.mark.parametrize("indices,values,text", [
    (np.array([1, 2], np.int64), np.ones(2, F32), "indices of dtype int64 (expected int32)"),
    (np.array([1, 2], np.uint32), np.ones(2, F32), "indices of dtype uint32"),
    (np.array([1, 2], I32), np.ones(2), "values of dtype float64 (expected float32)"),
    (np.array([1, 2], I32), np.ones(2, np.float16), "values of dtype float16"),
    ([1, 2], np.ones(2, F32), "indices that are not a 1-D array"),
    (np.array([[1, 2]], I32), np.ones(2, F32), "indices that are not a 1-D array"),
    (np.array([1, 2], I32), np.ones((2, 1), F32), "values that are not a 1-D array"),
    (np.array([1, 2, 3], I32), np.ones(2, F32), "3 indices but 2 values"),
])
def test_malformed_selection_travels_in_the_header(indices, values, text):
    header = header_of(indices, values)
    assert header[2] != 0
    found = _payload.check_headers(np.stack([header_of(np.zeros(2, I32), np.ones(2, F32)),
                                             header]), n=10)
    assert list(found) == [1] and found[1].startswith("sent " + text), found


def test_check_headers():
    ok = [2, 0, 0, 0]
    assert _payload.check_headers(np.array([ok, ok]), n=5) == {}
    assert _payload.check_headers(np.array([ok, ok]), n=5, slots=2) == {}
    found = _payload.check_headers(np.array([ok, [3, 0, 0, 0], [-1, 0, 0, 0], [6, 0, 0, 0],
                                             [2, 6, 0, 0], [2, -1, 0, 0]]), n=5, slots=2)
    assert found == {1: "sent 3 entries where every rank sends 2",
                     2: "sent an entry count of -1 outside [0, 5]",
                     3: "sent an entry count of 6 outside [0, 5]",
                     4: "sent a non-finite count of 6 outside [0, 5]",
                     5: "sent a non-finite count of -1 outside [0, 5]"}
    assert _payload.check_headers(np.array([[5, 5, 0, 0]]), n=5) == {}


# --- entries ---------------------------------------------------------------------------

def entries(*sets):
    idx = np.concatenate([np.asarray(i, I32) for i, _ in sets] or [np.zeros(0, I32)])
    val = np.concatenate([np.asarray(v, F32) for _, v in sets] or [np.zeros(0, F32)])
    return idx, val, [len(i) for i, _ in sets]


@pytest.mark.parametrize("sets", [
    [], [([], [])], [([0, 4, 9], [1, 2, 3])], [([9, 0, 4], [1, 2, 3]), ([4], [-1])],
    [([2, 5, -1, -1], [1, 1, 0, -0.0]), ([5, 2], [1, 1])],      # top-K padding, then a set
    [([-1, 3, -1], [0, 1, 0])], [([], []), ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], np.arange(10))],
])
def test_valid_entries(sets):
    assert _payload.check_entries(*entries(*sets), n=10) == {}


@pytest.mark.parametrize("sets,found", [
    ([([0, 10], [1, 1])], {0: "sent index 10 outside [0, 10)"}),
    ([([1, 2], [1, 1]), ([-5, 3, 2 ** 31 - 1], [1, 1, 1])],
     {1: "sent index -5 outside [0, 10) (and 1 more bad indices)"}),
    ([([3], [1]), ([1, -1], [1, 2.5])], {1: "sent padding index -1 with value 2.5"}),
    ([([1, 4, 1], [1, 1, 1])], {0: "sent index 1 2 times"}),                # not adjacent
    ([([7, 7, 7], [1, 1, 1]), ([2, 3], [1, 1])], {0: "sent index 7 3 times"}),
    ([([2], [1]), ([3, -1, 3], [1, 0, 1])], {1: "sent index 3 2 times"}),   # after padding
    ([([0, 1], [1, 1]), ([2, 3], [np.nan, 1]), ([4], [np.inf])],
     {1: "sent the non-finite value nan at index 2",
      2: "sent the non-finite value inf at index 4"}),
    ([([4, 4, 12], [1, 1, np.inf])],
     {0: "sent index 12 outside [0, 10), the non-finite value inf at index 12, index 4 2 times"}),
])
def test_bad_entries_named_by_rank(sets, found):
    idx, val, counts = entries(*sets)
    assert _payload.check_entries(idx, val, counts, n=10) == found


def test_entries_agree_with_scatter_add_bad_count():
    """check_entries flags exactly the ranks whose sets hold indices that
    scatter_add counts as bad (and never writes)."""
    rng = np.random.default_rng(3)
    n = 50
    for trial in range(40):
        sets = []
        for r in range(4):
            i = rng.choice(n, 8, replace=False).astype(I32)
            if rng.random() < 0.4:
                i[rng.integers(8)] = rng.choice([-7, -2 ** 31, n, n + 3, 2 ** 31 - 1])
            v = rng.standard_normal(8).astype(F32)
            if rng.random() < 0.3:
                i[-1], v[-1] = -1, 0.0
            sets.append((i, v))
        idx, val, counts = entries(*sets)
        dense = np.zeros(n, F32)
        bad = int(scatter_add(dense, idx, val, segments=counts))
        flagged = _payload.check_entries(idx, val, counts, n)
        out = [int(((i < -1) | (i >= n)).sum()) for i, _ in sets]
        assert bad == sum(out) and sorted(flagged) == [r for r, c in enumerate(out) if c]


def test_fail_names_every_culprit():
    exc = _payload.fail("rank 0: compression x", {2: "sent index 1000017 outside [0, 1000000)",
                                                  1: "sent 3 entries where every rank sends 2"},
                        "in a bucket; nothing was written")
    assert isinstance(exc, PayloadError) and exc.culprits == (1, 2)
    assert str(exc) == ("rank 0: compression x: rank 1 sent 3 entries where every rank sends "
                        "2; rank 2 sent index 1000017 outside [0, 1000000) in a bucket; "
                        "nothing was written")


# --- whole calls on real ranks ----------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_nonfinite_on_every_rank(n):
    """NaN / inf on one and on several ranks, for TopK, Threshold, FP16 and
    BF16, with "raise" and "warn"."""
    proc = run_mpi(n, CODE, args=["nonfinite", "numpy"], timeout=60)
    assert_each_rank(proc.stdout, r"faults nonfinite rank (?P<rank>\d+) ok", n)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_tampered_payloads(n):
    proc = run_mpi(n, CODE, args=["tampered", "numpy"], timeout=60)
    assert_each_rank(proc.stdout, r"faults tampered rank (?P<rank>\d+) ok", n)


@pytest.mark.parametrize("which", ["nonfinite", "tampered"])
def test_faults_without_shared_memory_or_compiled_loops(which):
    proc = run_mpi(2, CODE, args=[which, "numpy"], timeout=60,
                   env={"COMMLIB_SHM": "0", "COMMLIB_NATIVE": "0"})
    assert_each_rank(proc.stdout, r"faults %s rank (?P<rank>\d+) ok" % which, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["nonfinite", "tampered"])
def test_faults_cupy_world_size_1(which):
    proc = run_mpi(1, CODE, args=[which, "cupy"], timeout=240)
    assert "faults %s rank 0 ok" % which in proc.stdout


@pytest.mark.parametrize("culprit", [0, 2])
def test_half_precision_nonfinite_in_a_later_bucket_on_thread_ranks(culprit):
    """FP16, three buckets: one rank's NaN in the second bucket raises
    NonFiniteError on every rank, naming that rank and its count; that
    bucket's arrays stay as they were, the finite buckets before and after
    it are written (docs/compression.md)."""
    from inprocess import run_ranks
    n, shapes = 3, [(20,), (30,), (40,)]        # at 80 bytes a bucket: one bucket apiece

    def inputs(rank):
        arrays = [np.full(s, rank + 1.0 + i, F32) for i, s in enumerate(shapes)]
        if rank == culprit:
            arrays[1][7] = np.nan
        return arrays

    def body(comm):
        arrays = inputs(comm.rank)
        with pytest.raises(NonFiniteError) as info:
            comm.all_reduce(arrays, compression=FP16(), op="sum")
        same = arrays[1].tobytes() == inputs(comm.rank)[1].tobytes() and \
            (arrays[0] == 1 + 2 + 3).all() and (arrays[2] == 3 + 4 + 5).all()
        return info.value.counts, info.value.culprits, str(info.value), same

    counts = [1 if r == culprit else 0 for r in range(n)]
    for r, (got, culprits, text, same) in enumerate(run_ranks(n, body, bucket_bytes=80)):
        assert (got, culprits, same) == (tuple(counts), (culprit,), True), (r, text)
        assert text.startswith("rank %d: compression fp16: the reduced float16 result holds 1 "
                               "NaN or inf, in a bucket of 30 float32 values (1 array); sent by "
                               "rank %d (1 value)" % (r, culprit)), text
