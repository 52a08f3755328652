"""commlib.ops.pack: numpy path semantics, the launch plan of the CUDA path,
and (on a GPU) the batched kernels against the numpy twin, bit for bit."""
import json
from pathlib import Path

import numpy as np
import pytest

from commlib.errors import ArgumentError, ArrayTypeError
from commlib.ops import _pack_cuda
from commlib.ops.cast import cast
from commlib.ops.pack import copy_mode, offsets_of, pack, unpack
from test_ops_cast import STORE, adversarial

DATA = Path(__file__).resolve().parents[1] / "data"
SHAPES = [(3, 5), (0,), (64,), (1,), (7, 3, 3), (1000,), (17,), (2, 0), (5,)]


def resnet50_shapes():
    return [tuple(s) for s in json.loads((DATA / "resnet50.json").read_text())["shapes"]]


def make_arrays(shapes, fmt, seed):
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        a = rng.standard_normal(s).astype(np.float32)
        if fmt == "bfloat16":
            a = cast(a, "bfloat16")[0]
        out.append(a.astype(STORE[fmt], copy=False))
    return out


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


# ---------------------------------------------------------------- numpy path

def test_offsets_and_raw_round_trip():
    arrays = make_arrays(SHAPES, "float32", 0)
    offsets = offsets_of(arrays)
    assert offsets[0] == 0 and offsets[-1] == sum(a.size for a in arrays)
    bucket = np.full(offsets[-1] + 4, -1.0, np.float32)
    assert pack(arrays, bucket) is bucket
    np.testing.assert_array_equal(bucket[:-4], np.concatenate([a.ravel() for a in arrays]))
    assert np.all(bucket[-4:] == -1.0)                  # past the total: untouched
    outs = [np.zeros_like(a) for a in arrays]
    assert unpack(bucket, outs) is outs
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(a, o)


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.float64, np.complex64])
def test_raw_copies_any_dtype_exactly(dtype):
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 60000, s).astype(dtype) for s in SHAPES]
    bucket = np.empty(sum(a.size for a in arrays), dtype)
    pack(arrays, bucket)
    outs = [np.empty_like(a) for a in arrays]
    unpack(bucket, outs)
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(bits(a), bits(o))


def test_uint16_without_scale_is_a_bit_copy():
    # uint16 is read as bfloat16 only when arithmetic is involved
    a = np.array([0x7F81, 0xFFFF, 0x1234], np.uint16)      # NaN patterns stay as they are
    bucket = np.empty(3, np.uint16)
    pack([a], bucket)
    np.testing.assert_array_equal(bucket, a)


@pytest.mark.parametrize("afmt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bfmt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("scale", [None, 0.25, 3e4])
def test_cast_pack_equals_cast_of_concatenation(afmt, bfmt, scale):
    arrays = make_arrays(SHAPES, afmt, 2)
    arrays[0].reshape(-1)[:] = adversarial(afmt, 15, 3)
    flat = np.concatenate([a.ravel() for a in arrays])
    want, want_count = cast(flat, bfmt, scale=1.0 if scale is None else scale)
    bucket = np.empty(flat.size, STORE[bfmt])
    counter = np.zeros((), np.int64)
    pack(arrays, bucket, scale, nonfinite=counter)
    np.testing.assert_array_equal(bits(bucket), bits(want))
    assert int(counter) == int(want_count)


@pytest.mark.parametrize("afmt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bfmt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "acc"])
def test_cast_unpack_equals_per_array_cast(afmt, bfmt, accumulate):
    bucket = adversarial(bfmt, sum(int(np.prod(s)) for s in SHAPES), 4)
    outs = make_arrays(SHAPES, afmt, 5)
    want = [o.copy() for o in outs]
    counter = np.zeros((), np.int64)
    unpack(bucket, outs, 0.5, accumulate, nonfinite=counter)
    total, lo = 0, 0
    for w in want:
        _, c = cast(bucket[lo:lo + w.size].reshape(w.shape), afmt, scale=0.5, out=w,
                    accumulate=accumulate)
        lo += w.size
        total += int(c)
    for o, w in zip(outs, want):
        np.testing.assert_array_equal(bits(o), bits(w))
    assert int(counter) == total


@pytest.mark.parametrize("mode", ["raw", "cast", "generic"])
def test_a_non_zero_guard_writes_and_counts_nothing(mode):
    dtype = {"raw": np.float32, "cast": np.float16, "generic": np.float64}[mode]
    arrays = make_arrays(SHAPES, "float32", 8)
    arrays[0].reshape(-1)[0] = np.inf
    bucket = np.full(sum(a.size for a in arrays), 7, dtype)
    keep = [a.copy() for a in arrays]
    counter = np.zeros((), np.int64)
    for flag in (1, -3):
        pack(arrays, bucket, nonfinite=counter, unless=np.array(flag, np.int64))
        unpack(bucket, arrays, 0.5, nonfinite=counter, unless=np.array(flag, np.int64))
        assert (bucket == 7).all() and int(counter) == 0
        for a, k in zip(arrays, keep):
            np.testing.assert_array_equal(bits(a), bits(k))
    pack(arrays, bucket, nonfinite=counter, unless=np.zeros((), np.int64))
    assert int(counter) == 1
    np.testing.assert_array_equal(bucket, np.concatenate([a.ravel() for a in keep]).astype(dtype))


@pytest.mark.parametrize("unless", [1, np.array([0], np.int64), np.array(0, np.int32)])
def test_a_guard_must_be_a_0d_int64_array(unless):
    arrays = make_arrays(SHAPES, "float32", 9)
    bucket = np.zeros(sum(a.size for a in arrays), np.float32)
    with pytest.raises(ArrayTypeError, match="unless: expected a 0-d int64"):
        pack(arrays, bucket, unless=unless)
    with pytest.raises(ArrayTypeError, match="unless: expected a 0-d int64"):
        unpack(bucket, arrays, unless=unless)


def test_mixed_dtypes_into_bfloat16_bucket():
    arrays = make_arrays([(10,), (3, 3)], "float32", 6) + make_arrays([(5,)], "float16", 7)
    bucket = np.empty(24, np.uint16)
    pack(arrays, bucket, 2.0)
    want = np.concatenate([cast(a.ravel(), "bfloat16", scale=2.0)[0] for a in arrays])
    np.testing.assert_array_equal(bucket, want)


def test_non_contiguous_numpy_arrays():
    base = np.arange(40, dtype=np.float32).reshape(4, 10)
    arrays = [base[:, ::2], base[1:3, 1]]
    bucket = np.empty(22, np.float16)
    pack(arrays, bucket, 0.5)
    np.testing.assert_array_equal(bucket, np.concatenate([a.ravel() * 0.5 for a in arrays]))
    unpack(bucket, arrays, 2.0, accumulate=True)
    np.testing.assert_array_equal(base[:, ::2], 2 * np.arange(40, dtype=np.float32)
                                  .reshape(4, 10)[:, ::2])


def test_generic_dtypes_keep_numpy_rules():
    arrays = [np.arange(6, dtype=np.float64).reshape(2, 3), np.ones(2)]
    bucket = np.empty(8, np.float64)
    counter = np.zeros((), np.int64)
    pack(arrays, bucket, 0.5, nonfinite=counter)
    np.testing.assert_array_equal(bucket, [0, .5, 1, 1.5, 2, 2.5, .5, .5])
    assert int(counter) == 0
    ints = [np.arange(4, dtype=np.int32)]
    unpack(np.array([1, 2, 3, 4], np.int32), ints, accumulate=True)
    np.testing.assert_array_equal(ints[0], [1, 3, 5, 7])


def test_copy_mode():
    f32, f16, u16, f64 = (np.dtype(t) for t in (np.float32, np.float16, np.uint16, np.float64))
    assert copy_mode([f32, f32], f32) == "raw"
    assert copy_mode([f64], f64) == "raw"
    assert copy_mode([f32], f32, scale=0.5) == "cast"
    assert copy_mode([f32], f32, counting=True) == "cast"
    assert copy_mode([f32, f16], u16) == "cast"
    assert copy_mode([f32], f32, accumulate=True) == "cast"
    assert copy_mode([f64], f64, scale=2.0) == "generic"
    assert copy_mode([f64], f32) == "generic"


def test_argument_errors():
    arrays = make_arrays([(4,), (3,)], "float32", 8)
    with pytest.raises(ArgumentError, match="at least 7"):
        pack(arrays, np.empty(6, np.float32))
    with pytest.raises(ArgumentError, match="1-D"):
        pack(arrays, np.empty((7, 1), np.float32))
    with pytest.raises(ArrayTypeError, match=r"arrays\[1\]"):
        pack([arrays[0], [1.0, 2.0]], np.empty(7, np.float32))
    with pytest.raises(ArgumentError, match="at least 7"):
        unpack(np.empty(5, np.float32), arrays)
    with pytest.raises(ArrayTypeError, match="nonfinite"):
        pack(arrays, np.empty(7, np.float32), nonfinite=np.zeros((), np.int32))
    with pytest.raises(ArgumentError, match="scale"):
        pack(arrays, np.empty(7, np.float16), scale=float("nan"))


def test_resnet50_numpy_round_trip():
    shapes = resnet50_shapes()
    assert len(shapes) == 161
    arrays = make_arrays(shapes, "float32", 9)
    bucket = np.empty(sum(a.size for a in arrays), np.float16)
    pack(arrays, bucket, 1 / 4)
    outs = [np.zeros_like(a) for a in arrays]
    unpack(bucket, outs, 4.0)
    for a, o in zip(arrays[:20], outs[:20]):
        np.testing.assert_allclose(o, a, rtol=2e-3, atol=1e-4)


# ---------------------------------------------------------------- launch plan

def test_plan_one_launch_for_resnet50():
    shapes = resnet50_shapes()
    sizes = [int(np.prod(s)) for s in shapes]
    addresses = [4096 * (i + 1) for i in range(len(sizes))]
    launches = _pack_cuda.plan("pack", [np.float32] * len(sizes), sizes, addresses,
                               np.float16, 1 << 20, "cast")
    assert len(launches) == 1 and launches[0].kernel == "pack_f32_f16"
    table, nchunks = _pack_cuda.build_table(launches[0].segments, launches[0].chunk)
    n = len(sizes)
    assert table.dtype == np.int64 and table.size == 4 * n + 1
    np.testing.assert_array_equal(table[:n], addresses)
    np.testing.assert_array_equal(table[n:2 * n], offsets_of([np.empty(s) for s in sizes])[:-1])
    np.testing.assert_array_equal(table[2 * n:3 * n], sizes)
    chunk = launches[0].chunk
    assert nchunks == table[-1] == sum(-(-s // chunk) for s in sizes)


def test_plan_groups_dtypes_skips_empty_and_picks_units():
    plan = _pack_cuda.plan
    launches = plan("unpack", [np.float32, np.float16, np.float32], [5, 0, 7], [64, 0, 128],
                    np.uint16, 256, "cast", accumulate=True)
    assert [launch.kernel for launch in launches] == ["unpack_bf16_f32_acc"]
    assert launches[0].segments == ((64, 0, 5), (128, 5, 7))
    launches = plan("pack", [np.float32, np.float16], [5, 3], [64, 96], np.float32, 0, "cast")
    assert [launch.kernel for launch in launches] == ["pack_f32_f32", "pack_f16_f32"]
    assert plan("pack", [np.int8], [3], [1], np.int8, 0, "raw")[0].kernel == "pack_raw1"
    assert plan("pack", [np.float64], [3], [8], np.float64, 16, "raw")[0].kernel == "pack_raw8"
    raw = plan("pack", [np.complex128], [3], [16], np.complex128, 0, "raw")[0]
    assert raw.kernel == "pack_raw8" and raw.segments == ((16, 0, 6),)
    assert plan("pack", [np.int32], [3], [6], np.int32, 0, "raw")[0].kernel == "pack_raw2"
    assert plan("pack", [np.float32], [0], [0], np.float32, 0, "raw") == []


# ---------------------------------------------------------------- kernels, GPU

def _device_arrays(cp, arrays_np, views):
    """Device copies of ``arrays_np``; with ``views``, as views into one flat
    device buffer at odd offsets."""
    if not views:
        return [cp.asarray(a) for a in arrays_np]
    flat = cp.asarray(np.concatenate([np.zeros(1, arrays_np[0].dtype)]
                                     + [a.ravel() for a in arrays_np]))
    arrays, lo = [], 1
    for a in arrays_np:
        arrays.append(flat[lo:lo + a.size].reshape(a.shape))
        lo += a.size
    return arrays


def _check_gpu_pack(cp, arrays_np, bfmt, scale, views=False, bucket_offset=0):
    """pack + unpack(accumulate) on the GPU vs the numpy twin, all bits."""
    total = sum(a.size for a in arrays_np)
    arrays = _device_arrays(cp, arrays_np, views)
    base = cp.zeros(total + 8, STORE[bfmt])
    bucket = base[bucket_offset:bucket_offset + total + 2]
    bucket_np = cp.asnumpy(bucket)
    c_dev = cp.zeros((), cp.int64)
    c_np = np.zeros((), np.int64)
    pack(arrays, bucket, scale, nonfinite=c_dev)
    pack(arrays_np, bucket_np, scale, nonfinite=c_np)
    np.testing.assert_array_equal(bits(cp.asnumpy(bucket)), bits(bucket_np))
    assert int(c_dev) == int(c_np)
    for accumulate in (False, True):
        unpack(bucket, arrays, scale, accumulate, nonfinite=c_dev)
        unpack(bucket_np, arrays_np, scale, accumulate, nonfinite=c_np)
        for a, a_np in zip(arrays, arrays_np):
            np.testing.assert_array_equal(bits(cp.asnumpy(a)), bits(a_np))
        assert int(c_dev) == int(c_np)


@pytest.mark.gpu
@pytest.mark.parametrize("afmt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bfmt", ["float32", "float16", "bfloat16"])
def test_gpu_small_lists_all_pairs(afmt, bfmt):
    import cupy as cp
    arrays = make_arrays(SHAPES + [(9000,), (8193,)], afmt, 10)
    arrays[2].reshape(-1)[:] = adversarial(afmt, 64, 11)
    for scale in (None, 0.5, -3e4):
        for views, bucket_offset in ((False, 0), (True, 0), (True, 1), (False, 3)):
            _check_gpu_pack(cp, [a.copy() for a in arrays], bfmt, scale, views, bucket_offset)


@pytest.mark.gpu
@pytest.mark.parametrize("bfmt,scale", [("float32", None), ("float16", 0.25), ("bfloat16", 0.5),
                                        ("float32", 0.125)])
def test_gpu_resnet50_one_launch(bfmt, scale):
    import cupy as cp
    arrays_np = make_arrays(resnet50_shapes(), "float32", 12)
    arrays = [cp.asarray(a) for a in arrays_np]
    mode = copy_mode([a.dtype for a in arrays], STORE[bfmt], scale)
    launches = _pack_cuda.plan("pack", [a.dtype for a in arrays], [a.size for a in arrays],
                               [a.data.ptr for a in arrays], STORE[bfmt], 0, mode)
    assert len(launches) == 1                      # 161 arrays, one kernel
    _check_gpu_pack(cp, arrays_np, bfmt, scale)
    _check_gpu_pack(cp, arrays_np, bfmt, scale, views=True, bucket_offset=1)


@pytest.mark.gpu
def test_gpu_table_is_cached_for_a_repeated_list():
    import cupy as cp
    arrays = [cp.ones(s, cp.float32) for s in [(100,), (3, 7), (5000,)]]
    bucket = cp.empty(5121, cp.float16)
    pack(arrays, bucket, 0.5)

    def mine():
        return [p for items, p in _pack_cuda._prepared.entries() if items[0] is arrays[0]]

    n, entries, first = len(_pack_cuda._tables), len(_pack_cuda._prepared), mine()
    for _ in range(3):
        pack(arrays, bucket, 0.5)
    assert len(_pack_cuda._tables) == n and len(_pack_cuda._prepared) == entries
    assert len(first) == 1 and mine() == first          # the same entry, reused
    assert first[0].mode == "cast" and len(first[0].launches) == 1
    assert float(bucket[-1]) == 0.5


@pytest.mark.gpu
def test_gpu_fresh_arrays_are_never_mistaken_for_cached_ones():
    import cupy as cp
    for trial in range(6):     # freed arrays' ids and addresses get reused
        sizes = [(10 + trial,), (3,), (trial,)]
        arrays = [cp.full(s, trial + i, cp.float32) for i, s in enumerate(sizes)]
        total = sum(a.size for a in arrays)
        bucket = cp.zeros(total + 1, cp.float32)
        pack(arrays, bucket, 2.0)
        want = np.concatenate([np.full(s, 2.0 * (trial + i), np.float32)
                               for i, s in enumerate(sizes)] + [np.zeros(1, np.float32)])
        np.testing.assert_array_equal(cp.asnumpy(bucket), want)
        del arrays


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.float64, np.uint16])
def test_gpu_raw_and_generic_dtypes(dtype):
    import cupy as cp
    rng = np.random.default_rng(13)
    arrays_np = [rng.integers(0, 100, s).astype(dtype) for s in SHAPES + [(70001,)]]
    for views, off in ((False, 0), (True, 1)):
        _check_raw(cp, [a.copy() for a in arrays_np], views, off)
    if dtype == np.float64:                         # generic path: scale on float64
        arrays = [cp.asarray(a) for a in arrays_np]
        bucket = cp.empty(sum(a.size for a in arrays), cp.float64)
        bucket_np = np.empty(bucket.size, np.float64)
        pack(arrays, bucket, 0.5)
        pack(arrays_np, bucket_np, 0.5)
        np.testing.assert_array_equal(cp.asnumpy(bucket), bucket_np)


def _check_raw(cp, arrays_np, views, bucket_offset):
    total = sum(a.size for a in arrays_np)
    dtype = arrays_np[0].dtype
    arrays = _device_arrays(cp, arrays_np, views)
    bucket = cp.zeros(total + 4, dtype)[bucket_offset:]
    pack(arrays, bucket)
    np.testing.assert_array_equal(cp.asnumpy(bucket[:total]),
                                  np.concatenate([a.ravel() for a in arrays_np]))
    outs = [cp.zeros_like(a) for a in arrays]
    unpack(bucket, outs)
    for o, a in zip(outs, arrays_np):
        np.testing.assert_array_equal(cp.asnumpy(o), a)


@pytest.mark.gpu
def test_gpu_argument_errors():
    import cupy as cp
    arrays = [cp.ones(4, cp.float32), cp.ones(3, cp.float32)]
    with pytest.raises(ArgumentError, match="at least 7"):
        pack(arrays, cp.empty(6, cp.float32))
    with pytest.raises(ArrayTypeError, match=r"arrays\[1\]"):
        pack([arrays[0], np.ones(3, np.float32)], cp.empty(7, cp.float32))
    with pytest.raises(ArrayTypeError, match="C-contiguous"):
        pack([cp.ones(8, cp.float32)[::2]], cp.empty(7, cp.float32))
    with pytest.raises(ArrayTypeError, match="contiguous 1-D"):
        pack(arrays, cp.empty((7, 2), cp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bucket_dtype,scale", [
    (np.float32, np.float32, None), (np.float32, np.float16, 0.25),
    (np.int32, np.int32, None), (np.float64, np.float64, 0.5)])     # raw, cast, raw, generic
def test_gpu_bound_copies_repeat_pack_and_unpack(dtype, bucket_dtype, scale):
    # a bound copy, checked and planned once, reads the arrays' values as
    # they are at each call, exactly as pack / unpack would
    import cupy as cp
    from commlib.ops.pack import bound
    rng = np.random.default_rng(5)
    shapes = [(37,), (3, 5), (0,), (1001,)]
    arrays = [cp.asarray(rng.integers(-50, 50, s).astype(dtype)) for s in shapes]
    total = sum(a.size for a in arrays)
    bucket = cp.zeros(total + 3, bucket_dtype)[1:]
    do_pack, do_unpack = bound("pack", arrays, bucket, scale), bound("unpack", arrays, bucket)
    for step in range(3):
        for a in arrays:
            a += dtype(step + 1)
        want_np = np.zeros(bucket.size, bucket_dtype)
        pack([cp.asnumpy(a) for a in arrays], want_np, scale)
        do_pack()
        np.testing.assert_array_equal(cp.asnumpy(bucket), want_np)
        bucket *= bucket_dtype(2)
        outs_np = [np.zeros(a.shape, dtype) for a in arrays]
        unpack(cp.asnumpy(bucket), outs_np)
        do_unpack()
        for a, o in zip(arrays, outs_np):
            np.testing.assert_array_equal(cp.asnumpy(a), o)


@pytest.mark.gpu
def test_gpu_bound_copy_checks_once_and_refuses_numpy():
    import cupy as cp
    from commlib.ops.pack import bound
    arrays = [cp.ones(4, cp.float32), cp.ones(3, cp.float32)]
    with pytest.raises(ArgumentError, match="at least 7"):
        bound("pack", arrays, cp.empty(6, cp.float32))
    with pytest.raises(ArrayTypeError, match="buf: expected a cupy array"):
        bound("pack", arrays, np.empty(7, np.float32))
