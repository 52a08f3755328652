"""The bucket plan: which arrays are fused, which reduced in place."""
import numpy as np
import pytest

from commlib.collective import bucketing


def arrays_of(*specs):
    return [np.zeros(n, dtype=dt) for dt, n in specs]


def test_small_arrays_fill_buckets_in_order_and_large_go_direct():
    arrays = arrays_of(("float32", 10), ("float32", 300), ("float32", 20), ("float32", 5))
    plan = bucketing.plan_for(arrays, bucket_bytes=400)   # 100 floats per bucket
    assert plan.direct == (1,)
    assert [b.indices for b in plan.buckets] == [(0, 2, 3)]
    assert [b.size for b in plan.buckets] == [35]


def test_bucket_boundary_and_exact_fit():
    arrays = arrays_of(*[("float64", 25)] * 5)               # 200 bytes each
    plan = bucketing.plan_for(arrays, bucket_bytes=400)
    assert plan.direct == (4,)                                 # alone in its bucket
    assert [b.indices for b in plan.buckets] == [(0, 1), (2, 3)]
    plan = bucketing.plan_for(arrays, bucket_bytes=200)       # each fills a bucket: direct
    assert plan.direct == (0, 1, 2, 3, 4) and plan.buckets == ()


def test_dtypes_get_separate_buckets_and_empty_arrays_are_skipped():
    arrays = arrays_of(("float32", 3), ("int64", 2), ("float32", 0), ("float32", 4), ("int64", 1))
    plan = bucketing.plan_for(arrays, bucket_bytes=1 << 20)
    by_dtype = {str(b.dtype): b.indices for b in plan.buckets}
    assert by_dtype == {"float32": (0, 3), "int64": (1, 4)}
    assert all(2 not in b.indices for b in plan.buckets) and 2 not in plan.direct


def test_plan_is_cached_and_hashable_by_layout():
    a = arrays_of(("float32", 7), ("float32", 9))
    b = arrays_of(("float32", 7), ("float32", 9))
    p1, p2 = bucketing.plan_for(a, 4096), bucketing.plan_for(b, 4096)
    assert p1 is p2 and hash(p1.key) == hash(p2.key)
    assert bucketing.plan_for(a, 8192) is not p1


def test_prepared_list_pack_unpack_round_trip_with_scale():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (5,), (1, 1, 2), ())]
    arrays.append(rng.standard_normal(1000))                     # float64: own bucket
    before = [a.copy() for a in arrays]
    plan = bucketing.plan_for(arrays, 1 << 20)
    prepared = bucketing.PreparedList(arrays, plan, "numpy", writeable=True)
    assert prepared.floating and [b.indices for b in plan.buckets] == [(0, 1, 2, 3)]
    assert plan.direct == (4,)
    buf = prepared.pack(arrays, 0)
    assert np.array_equal(buf, np.concatenate([a.ravel() for a in before[:4]]))
    buf[:] = buf * 3
    prepared.unpack(arrays, 0, scale=0.5)
    for a, b in zip(arrays[:4], before):
        assert a.shape == b.shape and np.array_equal(a, (b * np.float32(3)) * np.float32(0.5))
    assert np.array_equal(arrays[4], before[4])


def test_fusion_cache_remembers_a_repeated_list_and_forgets_dead_arrays():
    cache = bucketing.FusionCache()
    arrays = [np.ones(4, np.float32), np.ones(3, np.int32)]
    plan = bucketing.plan_for(arrays, 1 << 20)
    key, hit = cache.lookup(arrays)
    assert hit is None
    cache.prepare(key, arrays, plan, "numpy", True)
    assert cache.lookup(arrays)[1] is None            # seen once: not kept
    prepared = cache.prepare(key, arrays, plan, "numpy", True)
    assert cache.lookup(arrays)[1] is prepared and not prepared.floating
    assert cache.lookup(arrays[:1])[1] is None
    del arrays[1]                                       # one array dies: entry dropped
    import gc
    gc.collect()
    assert cache.lookup([arrays[0], object()])[1] is None
    assert len(cache._entries) == 0


def test_fusion_cache_keeps_lists_used_in_turn():
    # two lists passed alternately (two models' gradients, say) are each
    # kept from their second call; a third list seen once is not
    cache = bucketing.FusionCache(max_entries=2)
    lists = [[np.ones(4, np.float32)], [np.ones(3, np.float32), np.ones(2, np.float32)]]
    made = {}
    for turn in range(3):
        for i, arrays in enumerate(lists):
            key, hit = cache.lookup(arrays)
            assert (hit is not None) == (turn >= 2), (turn, i)
            if hit is None:
                made[i] = cache.prepare(key, arrays, bucketing.plan_for(arrays, 1 << 20),
                                        "numpy", True)
            else:
                assert hit is made[i]
    once = [np.ones(5, np.float32)]
    key, hit = cache.lookup(once)
    cache.prepare(key, once, bucketing.plan_for(once, 1 << 20), "numpy", True)
    assert hit is None and cache.lookup(once)[1] is None
    assert cache.lookup(lists[0])[1] is made[0] and cache.lookup(lists[1])[1] is made[1]


def test_flat_arrays_are_fused_without_a_copy():
    arrays = bucketing.flat_arrays([(3, 4), (5,), (2, 2)], dtype="float32")
    base = arrays[0].base
    assert all(a.base is base for a in arrays) and [a.shape for a in arrays] == [(3, 4), (5,), (2, 2)]
    for i, a in enumerate(arrays):
        a[...] = i + 1
    plan = bucketing.plan_for(arrays, 1 << 20)
    prepared = bucketing.PreparedList(arrays, plan, "numpy", writeable=True)
    buf = prepared.pack(arrays, 0)
    assert np.shares_memory(buf, arrays[0]) and buf.size == 21
    buf *= 10                                   # what a collective would do in place
    prepared.unpack(arrays, 0, scale=0.5)
    for i, a in enumerate(arrays):
        assert (a == (i + 1) * 5).all()


def test_views_with_gaps_or_out_of_order_are_copied():
    flat = np.zeros(100, np.float32)
    gaps = [flat[0:10], flat[20:30]]
    swapped = [flat[10:20], flat[0:10]]
    for arrays in (gaps, swapped):
        prepared = bucketing.PreparedList(arrays, bucketing.plan_for(arrays, 1 << 20), "numpy", True)
        buf = prepared.pack(arrays, 0)
        assert not np.shares_memory(buf, flat)


# -- at, before and after the bucket cap ----------------------------------------------------

CAP = 4096          # bytes: 1024 float32


@pytest.mark.parametrize("size, direct", [(1023, False), (1024, True), (1025, True)])
def test_an_array_below_the_cap_is_fused_at_or_above_it_reduced_in_place(size, direct):
    arrays = arrays_of(("float32", size), ("float32", 1), ("float32", 1))
    plan = bucketing.plan_for(arrays, bucket_bytes=CAP)
    if direct:
        assert plan.direct == (0,) and [(b.indices, b.size) for b in plan.buckets] == [((1, 2), 2)]
    else:      # 1023 + 1 fill the bucket; the third opens one alone, reduced in place
        assert plan.direct == (2,) and [(b.indices, b.size) for b in plan.buckets] == [
            ((0, 1), 1024)]


@pytest.mark.parametrize("last, buckets, direct", [
    (399, [(0, 1, 2)], ()),              # 1023 floats: one bucket
    (400, [(0, 1, 2)], ()),              # 1024 floats: exactly full, still one
    (401, [(0, 1)], (2,)),               # 1025: the last opens a bucket alone, reduced in place
])
def test_a_bucket_fills_up_to_the_cap_exactly(last, buckets, direct):
    arrays = arrays_of(("float32", 300), ("float32", 324), ("float32", last))
    plan = bucketing.plan_for(arrays, bucket_bytes=CAP)
    assert [b.indices for b in plan.buckets] == buckets and plan.direct == direct
    assert all(b.size * 4 <= CAP for b in plan.buckets)


def test_results_at_the_bucket_boundaries_equal_numpy():
    """Thread ranks: lists that fill a bucket to one element below, at and
    one above the cap, and arrays one below, at and one above it, reduced
    (sum and avg) against numpy on every rank's inputs."""
    from inprocess import run_ranks

    layouts = [[300, 324, 399], [300, 324, 400], [300, 324, 401], [1023, 2], [1024, 2],
               [1025, 2], [1, 1023], [1, 1024, 1]]

    def inputs(rank, layout, seed):
        rng = np.random.default_rng([seed, rank])
        return [rng.integers(-20, 21, n).astype(np.float32) for n in layout]

    def body(comm):
        out = []
        for seed, layout in enumerate(layouts):
            for op in ("sum", "avg"):
                arrays = inputs(comm.rank, layout, seed)
                comm.all_reduce(arrays, op=op)
                out.append(arrays)
        return out

    n = 3
    results = run_ranks(n, body, bucket_bytes=CAP)
    k = 0
    for seed, layout in enumerate(layouts):
        everyone = [inputs(r, layout, seed) for r in range(n)]
        for op in ("sum", "avg"):
            for i in range(len(layout)):
                want = (everyone[0][i] + everyone[1][i]) + everyone[2][i]
                if op == "avg":
                    want = want * np.float32(1.0 / n)
                for r in range(n):
                    got = results[r][k][i]
                    assert got.tobytes() == want.tobytes(), (layout, op, i, r)
            k += 1


def test_default_caps_are_the_documented_ones():
    """docs/api.md: 1 MiB over MPI (and shared memory and threads), 25 MiB
    over NCCL (and the one-process transport); another name gets MPI's."""
    mib = 1 << 20
    assert {name: bucketing.default_bucket_bytes(name)
            for name in ("mpi", "shm", "threads", "nccl", "local", "another")} == {
        "mpi": mib, "shm": mib, "threads": mib, "nccl": 25 * mib, "local": 25 * mib,
        "another": mib}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_same_items_is_identity_in_order(compiled, monkeypatch):
    """The fusion cache's test for the very list it hit last: the compiled
    scan and its Python twin alike."""
    from commlib.ops import native
    if not compiled:
        monkeypatch.setattr(native, "module", lambda: None)
    elif native.module() is None:
        pytest.skip("compiled host loops not built")
    a, b, c = np.zeros(2), np.zeros(2), np.zeros(3)
    assert bucketing._same_items([a, b, c], (a, b, c)) is True
    assert bucketing._same_items([], ()) is True
    for other in ([a, b.copy(), c], [a, c, b], [a, b], [a, b, c, a]):
        assert bucketing._same_items([a, b, c], tuple(other)) is False, other
