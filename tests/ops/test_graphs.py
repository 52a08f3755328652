"""commlib.ops.graphs on the cooperative host build's stand-in cupy, whose
streams capture like cupy's (kernel launches and memsets become nodes, and
any other device work during a capture raises): a fixed launch sequence
runs directly, then is captured, then is launched as a graph, with the
results of running it directly every time; a capture that fails costs
nothing but the graph; and the sparsifiers' replayed buckets give the bits
of the numpy path call after call."""
import gc
import weakref

import numpy as np
import pytest

import commlib
import cuda_host_build as chb
from host_fixtures import gpu, kernels  # noqa: F401 -- fixtures
import gpu_checks
from commlib.compression import TopK
from commlib.ops import _launch, graphs
from commlib.ops import topk as topk_mod

pytestmark = pytest.mark.skipif(chb.GXX is None or chb.OBJCOPY is None,
                                reason="g++ or objcopy not found on PATH")


@pytest.fixture(autouse=True)
def graphs_on(monkeypatch):
    monkeypatch.delenv("COMMLIB_CUDA_GRAPHS", raising=False)


def _topk_sequence(gpu, n=20000, k=37, seed=0):
    """A device vector ``x``, output buffers, and ``issue()``: a memset of
    the outputs and the top-K of x into them (six launches, a memset of its
    own)."""
    xp = gpu.module
    rng = np.random.default_rng(seed)
    x = xp.asarray(rng.standard_normal(n).astype(np.float32))
    idx, val = xp.empty(k, np.int32), xp.empty(k, np.float32)

    def issue():
        _launch.memset0(idx)
        topk_mod.topk(x, k, out=(idx, val))
    return x, idx, val, issue


def _check(x, idx, val, k):
    want_idx, want_val = topk_mod.topk(np.asarray(x).view(np.ndarray).copy(), k)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(val).view(np.uint32), want_val.view(np.uint32))


def test_replay_runs_directly_then_captures_then_launches_the_graph(gpu):
    x, idx, val, issue = _topk_sequence(gpu)
    store = {}
    rng = np.random.default_rng(1)
    stream = gpu.module.cuda.Stream()
    ways = []
    for call in range(5):
        # new values in the same memory: the graph reads them at launch
        x.view(np.ndarray)[:] = rng.standard_normal(x.size).astype(np.float32)
        idx.view(np.ndarray)[:] = -7
        before = (len(gpu.launches), gpu.graph_launches)
        with stream if call % 2 else gpu.module.cuda.Stream.null:
            ways.append(graphs.replay(store, ("topk", x.data.ptr), issue))
        _check(x, idx, val, 37)
        ran = len(gpu.launches) - before[0]
        assert ran >= 5, (call, ran)        # the kernels ran, whichever way
    # one key per stream: each runs directly once, is captured, then launched
    assert ways == ["direct", "direct", "captured", "captured", "graph"], ways
    assert gpu.graph_launches == 3 and graphs.failure(store) is None
    assert len(store) == 2


def test_a_capture_that_fails_runs_directly_from_then_on(gpu, monkeypatch):
    xp = gpu.module
    x, idx, val, issue = _topk_sequence(gpu, seed=2)

    def allocating():
        issue()
        xp.empty(3, np.float32)          # no allocation may happen in a capture
    store = {}
    monkeypatch.setattr(graphs, "_warned", [])
    with pytest.warns(RuntimeWarning, match="a CUDA graph capture failed .*allocation"):
        ways = [graphs.replay(store, "k", allocating) for _ in range(4)]
    assert ways == ["direct"] * 4, ways
    err = graphs.failure(store)
    assert isinstance(err, RuntimeError) and "allocation" in str(err), err
    assert gpu.capture is None and gpu.graph_launches == 0
    _check(x, idx, val, 37)


def test_an_error_in_a_captured_function_is_raised_when_it_runs_directly(gpu, monkeypatch):
    x, idx, val, issue = _topk_sequence(gpu, seed=3)
    calls = []

    def failing():
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("bad argument")
        issue()
    store = {}
    graphs.replay(store, "k", failing)
    monkeypatch.setattr(graphs, "_warned", [])
    with pytest.raises(ValueError, match="bad argument"), pytest.warns(RuntimeWarning):
        graphs.replay(store, "k", failing)
    assert len(calls) == 3 and gpu.capture is None   # captured, then run directly


def test_a_store_keeps_the_latest_max_graphs_keys(gpu):
    x, idx, val, issue = _topk_sequence(gpu, seed=4)
    store = {}
    for key in range(graphs.MAX_GRAPHS + 3):
        assert [graphs.replay(store, key, issue) for _ in range(3)] == \
            ["direct", "captured", "graph"], key
    assert len(store) == graphs.MAX_GRAPHS
    # the oldest were dropped: seen again, they start over
    assert graphs.replay(store, 0, issue) == "direct"
    assert graphs.replay(store, graphs.MAX_GRAPHS + 2, issue) == "graph"
    # keys that never repeat (arrays that move at every call) run directly
    assert {graphs.replay(store, ("moved", i), issue) for i in range(20)} == {"direct"}
    _check(x, idx, val, 37)


def test_graphs_are_off_with_the_setting(gpu, monkeypatch):
    x, idx, val, issue = _topk_sequence(gpu, seed=5)
    monkeypatch.setenv("COMMLIB_CUDA_GRAPHS", "0")
    store = {}
    assert [graphs.replay(store, "k", issue) for _ in range(3)] == ["direct"] * 3
    assert gpu.graph_launches == 0 and not store
    _check(x, idx, val, 37)
    monkeypatch.setenv("COMMLIB_CUDA_GRAPHS", "maybe")
    with pytest.raises(commlib.ArgumentError, match="COMMLIB_CUDA_GRAPHS"):
        graphs.replay(store, "k", issue)


def test_a_graph_uses_and_keeps_the_launch_streams_workspaces(gpu):
    # the capture happens on a private stream, but the workspaces are those
    # of the stream the graph runs on; dropping the caches does not free
    # what a graph uses
    x, idx, val, issue = _topk_sequence(gpu, seed=6)
    store = {}
    graphs.replay(store, "k", issue)
    (ws_key,) = [k for k in _launch._workspaces if k[2] == "topk"]
    ws = weakref.ref(_launch._workspaces[ws_key][1])
    assert graphs.replay(store, "k", issue) == "captured"
    assert [k for k in _launch._workspaces if k[2] == "topk"] == [ws_key]
    _launch.clear()
    gc.collect()
    assert ws() is not None
    x.view(np.ndarray)[:] = -x.view(np.ndarray)
    assert graphs.replay(store, "k", issue) == "graph"
    _check(x, idx, val, 37)


def _against_numpy(gpu, sizes, compression, **kwargs):
    """tests/gpu/gpu_checks.py's check against numpy on the stand-in's
    arrays; returns the graphs launched."""
    before = gpu.graph_launches
    gpu_checks.against_numpy(sizes, compression, **kwargs)
    return gpu.graph_launches - before


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("sizes", [(5003,), (700, 1, 2900, 41, 6000)], ids=["one", "five"])
def test_topk_buckets_replayed_give_the_numpy_paths_bits(gpu, op, sizes):
    # error feedback carried from call to call; two graphs per bucket and
    # call once steady (select, sum)
    assert _against_numpy(gpu, sizes, TopK(0.02), op=op, seed=len(sizes)) >= 2 * 3


class SelectingAnew(TopK):
    """Top-K through ``select``, new arrays at every call (as a user's
    subclass that overrides it), not into the record that travels."""

    def select(self, acc):
        return super().select(acc)


def test_a_selection_made_anew_at_every_call_gives_the_numpy_paths_bits(gpu):
    # only the accumulation is replayed; the sum and the residual's update
    # use this call's selection, not the one a graph captured
    assert _against_numpy(gpu, (5003, 700), SelectingAnew(0.02), op="sum", seed=3) > 0


@pytest.mark.parametrize("strategy", ["fp16", "bf16", "topk"])
def test_a_nan_in_a_replayed_bucket_raises_and_writes_nothing(gpu, strategy):
    # the calls before and after run from graphs; the next call after the
    # NaN is right again (error feedback: the residual untouched by the
    # failed call)
    compression = TopK(0.05) if strategy == "topk" else strategy
    assert _against_numpy(gpu, (3001, 17, 800), compression, calls=8, nan_at=5,
                          seed=11) >= 2 * 4


def test_a_stream_that_captures_already_gets_the_launches_themselves(gpu):
    # a caller capturing its whole step: replay issues into that capture
    x, idx, val, issue = _topk_sequence(gpu, seed=7)
    store = {}
    for _ in range(2):
        graphs.replay(store, "k", issue)
    launched = gpu.graph_launches     # the second replay's capture launched one
    outer = gpu.module.cuda.Stream()
    with outer:
        issue()                 # its workspaces made, as a warm-up step would
        outer.begin_capture()
        assert graphs.replay(store, "k", issue) == "direct"
        step = outer.end_capture()
    assert gpu.graph_launches == launched and len(step.nodes) >= 6
    idx.view(np.ndarray)[:] = -5
    step.launch()
    _check(x, idx, val, 37)


# a call's buckets issued together (Compression.reduce_all): two buckets of
# several arrays and two arrays reduced in place, at 4 KiB buckets
TOGETHER = dict(sizes=(700, 1, 2900, 41, 6000, 333, 5), bucket_bytes=4096)


@pytest.mark.parametrize("compression", ["topk", "fp16", "bf16", "anew"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_buckets_issued_together_give_the_numpy_paths_bits(gpu, compression, op):
    strategy = {"topk": TopK(0.02), "anew": SelectingAnew(0.02)}.get(compression, compression)
    launched = _against_numpy(gpu, TOGETHER["sizes"], strategy, op=op, seed=12,
                              bucket_bytes=TOGETHER["bucket_bytes"])
    # a selection made anew at every call replays only the entries' check
    assert launched >= (4 if compression == "anew" else 2 * 4), launched


@pytest.mark.parametrize("compression", ["topk", "fp16"])
def test_a_nan_in_a_later_bucket_of_a_call_writes_the_ones_before(gpu, compression):
    # both paths raise at the bucket of array 4 (in place, after the two
    # buckets): what came before is written alike, bit for bit
    strategy = TopK(0.05) if compression == "topk" else compression
    assert _against_numpy(gpu, TOGETHER["sizes"], strategy, calls=8, nan_at=5, nan_in=(4,),
                          seed=13, bucket_bytes=TOGETHER["bucket_bytes"]) >= 2 * 4


@pytest.mark.parametrize("compression,per_call", [("topk", 3), ("fp16", 2)])
def test_a_steady_call_is_a_few_graphs_and_one_collective(gpu, compression, per_call,
                                                          monkeypatch):
    # whatever the number of buckets: top-K the selections, the entries'
    # checks and the sums, fp16 the casts in and back; one all-gather or
    # all-reduce
    from commlib.compression import base
    strategy = TopK(0.02) if compression == "topk" else compression
    xp = gpu.module
    arrays = [xp.ones(n, np.float32) for n in TOGETHER["sizes"]]
    collectives = []
    for name in ("all_gather", "all_reduce"):
        def counted(self, *args, _name=name, _f=getattr(base.Bucket, name), **kw):
            collectives.append(_name)
            return _f(self, *args, **kw)
        monkeypatch.setattr(base.Bucket, name, counted)
    with commlib.Communicator.single(device=0, bucket_bytes=TOGETHER["bucket_bytes"]) as comm:
        for _ in range(6):
            comm.all_reduce(arrays, op="sum", compression=strategy)
        before, collectives[:] = gpu.graph_launches, []
        comm.all_reduce(arrays, op="sum", compression=strategy)
        assert gpu.graph_launches - before == per_call
        assert len(collectives) == 1, collectives


def test_a_plan_of_buckets_issued_together_keeps_no_array_alive(gpu, monkeypatch):
    # the plan is found by the arrays' identity and holds none of them: a
    # loop that makes new gradient arrays every step frees the old ones.
    # (A CUDA graph holds addresses only, but the stand-in's graph nodes
    # and launch log hold the arguments themselves: no graphs here, and
    # the log emptied)
    monkeypatch.setenv("COMMLIB_CUDA_GRAPHS", "0")
    xp = gpu.module
    with commlib.Communicator.single(device=0, bucket_bytes=TOGETHER["bucket_bytes"]) as comm:
        for compression in (TopK(0.02), "fp16"):
            arrays = [xp.ones(n, np.float32) for n in TOGETHER["sizes"]]
            for _ in range(4):
                comm.all_reduce(arrays, op="sum", compression=compression)
            refs = [weakref.ref(a) for a in arrays]
            del arrays
            # the communicator lets go of the last list it saw at a call with another
            comm.all_reduce([xp.ones(3, np.float32)], op="sum", compression=compression)
            del gpu.launches[:]
            gc.collect()
            assert [r() is None for r in refs] == [True] * len(refs), compression


@pytest.mark.parametrize("compression", ["topk", "fp16"])
def test_ranks_that_pass_numpy_and_cupy_to_a_compressed_call_disagree(gpu, compression):
    # cupy buckets go together, numpy ones one by one: a different exchange,
    # so the kind is compared between ranks, and both raise naming it
    from inprocess import run_ranks
    strategy = TopK(0.02) if compression == "topk" else compression

    def body(comm):
        xp = gpu.module if comm.rank == 1 else np
        arrays = [xp.ones(n, np.float32) for n in TOGETHER["sizes"]]
        with pytest.raises(commlib.ConsistencyError) as info:
            comm.all_reduce(arrays, op="sum", compression=strategy)
        return str(info.value)
    for text in run_ranks(2, body, bucket_bytes=TOGETHER["bucket_bytes"]):
        assert "numpy arrays" in text and "cupy arrays" in text, text


@pytest.mark.parametrize("compression", ["topk", "fp16"])
def test_a_warned_nan_in_buckets_issued_together_warns_and_writes_as_numpy(gpu, compression):
    # nonfinite="warn": the call that holds a NaN (in a later unit) warns
    # with the numpy path's words and writes its bits, before and after
    from commlib.compression import FP16
    import warnings
    strategy = TopK(0.3, nonfinite="warn") if compression == "topk" else FP16(nonfinite="warn")
    sizes = TOGETHER["sizes"]
    rng = np.random.default_rng(21)
    host = [np.zeros(n, np.float32) for n in sizes]
    dev = [gpu.module.zeros(n, np.float32) for n in sizes]
    comms = [commlib.Communicator.single(bucket_bytes=TOGETHER["bucket_bytes"]),
             commlib.Communicator.single(device=0, bucket_bytes=TOGETHER["bucket_bytes"])]
    try:
        for call in range(7):
            for i, (h, d) in enumerate(zip(host, dev)):
                h[:] = rng.standard_normal(h.size).astype(np.float32)
                if call in (3, 5) and i == 4:
                    h[h.size // 2] = np.nan
                d.set(h)
            texts = []
            for c, arrays in zip(comms, (host, dev)):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    c.all_reduce(arrays, op="avg", compression=strategy)
                texts.append([str(w.message) for w in caught])
            assert texts[0] == texts[1] and len(texts[0]) == (call in (3, 5)), texts
            for h, d in zip(host, dev):
                assert np.array_equal(h.view(np.uint32), d.view(np.ndarray).view(np.uint32))
    finally:
        for c in comms:
            c.close()


# dense calls of a cupy list (no compression): float32 arrays in two buckets
# and two in place, float64 ones in a bucket (scaled by a cupy operation,
# not a kernel, when averaging: copied outside the graphs), int32 ones
# where the op allows them
def _dense_list(xp, rank, call, op):
    rng = np.random.default_rng(1000 * call + rank)
    made = [rng.integers(-50, 50, n).astype(np.float32) for n in TOGETHER["sizes"]]
    made += [rng.integers(-50, 50, n).astype(np.float64) for n in (3, 10)]
    if op != "avg":
        made += [rng.integers(-50, 50, n).astype(np.int32) for n in (4, 7)]
    return [xp.asarray(a) for a in made]


def _dense_expected(size, call, op, root, rank):
    """The result rank ``rank`` must hold, from every rank's inputs."""
    inputs = [_dense_list(np, r, call, op) for r in range(size)]
    if root is not None and rank != root:
        return inputs[rank]
    reduce = {"sum": np.sum, "avg": np.sum, "max": np.max}[op]
    out = [reduce(np.stack(parts), axis=0).astype(parts[0].dtype) for parts in zip(*inputs)]
    if op == "avg":
        out = [(o * o.dtype.type(1.0 / size)).astype(o.dtype) for o in out]
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("op,root", [("sum", None), ("avg", None), ("max", None),
                                     ("avg", "last"), ("sum", 0)], ids=str)
def test_dense_buckets_issued_together_give_the_reduced_values(gpu, size, op, root):
    # every bucket packed by one launch sequence and unpacked by another,
    # replayed as graphs from the second call; each rank's results are the
    # reduction of every rank's inputs, and the numpy path's bits
    from inprocess import run_ranks
    root = size - 1 if root == "last" else root
    calls = 4
    before = gpu.graph_launches

    def body(comm):
        # the same arrays at every call, as a training loop's gradients
        dev, host = _dense_list(gpu.module, comm.rank, 0, op), _dense_list(np, comm.rank, 0, op)
        for call in range(calls):
            for d, h, new in zip(dev, host, _dense_list(np, comm.rank, call, op)):
                h[...] = new
                d.set(new)
            for arrays in (dev, host):
                if root is None:
                    comm.all_reduce(arrays, op=op)
                else:
                    comm.reduce(arrays, root=root, op=op)
            for d, h, e in zip(dev, host, _dense_expected(comm.size, call, op, root,
                                                          comm.rank)):
                got = d.view(np.ndarray)
                assert got.dtype == h.dtype and np.array_equal(got, h), (call, d.size)
                if op == "avg":
                    np.testing.assert_allclose(h, e, rtol=1e-6)
                else:
                    assert np.array_equal(h, e), (call, h.size)
        return comm.rank, comm.size
    reports = run_ranks(size, body, bucket_bytes=TOGETHER["bucket_bytes"])
    assert reports == [(r, size) for r in range(size)]
    # packs and, where a rank receives, unpacks: each rank's calls after the first
    receiving = size if root is None else 1
    assert gpu.graph_launches - before >= (calls - 2) * (size + receiving)


def test_a_steady_dense_call_is_two_graphs_and_a_collective_per_unit(gpu, monkeypatch):
    xp = gpu.module
    arrays = [xp.ones(n, np.float32) for n in TOGETHER["sizes"]]
    with commlib.Communicator.single(device=0, bucket_bytes=TOGETHER["bucket_bytes"]) as comm:
        for _ in range(3):
            comm.all_reduce(arrays, op="avg")
        before, launches, replayed = gpu.graph_launches, len(gpu.launches), gpu.replayed
        operations = []
        ufunc = xp.ndarray.__array_ufunc__
        monkeypatch.setattr(xp.ndarray, "__array_ufunc__",
                            lambda self, *a, **k: operations.append(a[0]) or ufunc(self, *a, **k))
        comm.all_reduce(arrays, op="avg")
        # the two buckets' packs in one graph; their unpacks and the two
        # in-place arrays' scaling in another; no kernel launched one by
        # one, no cupy operation
        assert gpu.graph_launches - before == 2
        assert len(gpu.launches) - launches == gpu.replayed - replayed > 0
        assert operations == [], operations
        assert all(np.array_equal(a.view(np.ndarray), np.ones(a.size, np.float32))
                   for a in arrays)


def test_dense_units_issued_together_are_a_bucket_event_each_while_tracing(gpu, monkeypatch):
    import types
    from commlib.collective import collectives
    events = []
    monkeypatch.setattr(collectives, "trace", types.SimpleNamespace(
        ON=True, now=lambda: 1.0, bucket=lambda *a, **k: events.append((a, k))))
    xp = gpu.module
    arrays = [xp.ones(n, np.float32) for n in TOGETHER["sizes"]]
    with commlib.Communicator.single(device=0, bucket_bytes=TOGETHER["bucket_bytes"]) as comm:
        comm.all_reduce(arrays, op="sum")
    # rank 0, each unit's label and bytes, no strategy: 4 KiB buckets of
    # arrays 0, 1, 3 (742 floats) and 5, 6 (338); arrays 2 and 4 in place
    assert [(a[0], a[2], a[3], a[4]) for a, _ in events] == \
        [(0, 0, 4 * 742, None), (0, 1, 4 * 338, None), (0, "direct 2", 4 * 2900, None),
         (0, "direct 4", 4 * 6000, None)], events
