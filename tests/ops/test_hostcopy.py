"""commlib.ops.hostcopy: batched gather / scatter between many numpy arrays
and one flat buffer, against numpy concatenation."""
import numpy as np
import pytest

from commlib.errors import ArrayTypeError
from commlib.ops import hostcopy

pytestmark = pytest.mark.skipif(not hostcopy.available(), reason="the host loops are not "
                                "built: %s" % hostcopy.unavailable_reason())


def test_gather_then_scatter_round_trip_with_shapes_and_empty_arrays():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              [(0,), (1,), (3, 5), (256,), (17,), (0, 4), (10, 10, 10), (5,), ()]]
    want = np.concatenate(arrays, axis=None)
    out = np.full(want.size + 9, -1.0, np.float32)
    assert hostcopy.gather(arrays, out)
    assert (out[:want.size] == want).all() and (out[want.size:] == -1).all()
    new = rng.standard_normal(out.size).astype(np.float32)
    assert hostcopy.scatter(new, tuple(arrays))
    assert (np.concatenate(arrays, axis=None) == new[:want.size]).all()


@pytest.mark.parametrize("skip", [(0, 0), (0, 5), (3, 300), (256, 257), (301, 310), (0, 310),
                                  (310, 310)])
def test_skip_window_is_left_untouched(skip):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype(np.float64) for s in [(3,), (0,), (16, 16), (1,),
                                                                 (50,)]]
    flat = np.concatenate(arrays, axis=None)
    begin, end = skip
    out = np.full(flat.size, -7.0)
    assert hostcopy.gather(arrays, out, skip)
    want = flat.copy()
    want[begin:end] = -7.0
    assert out.tobytes() == want.tobytes()
    before = [a.copy() for a in arrays]
    src = rng.standard_normal(flat.size)
    assert hostcopy.scatter(src, arrays, skip)
    got = np.concatenate(arrays, axis=None)
    want = src.copy()
    want[begin:end] = np.concatenate(before, axis=None)[begin:end]
    assert got.tobytes() == want.tobytes()


def test_gather_any_and_scatter_any_fall_back_to_numpy():
    class Sub(np.ndarray):          # not an exact ndarray: the C loop declines
        pass

    rng = np.random.default_rng(3)
    plain = [rng.standard_normal(s).astype(np.float32) for s in [(3,), (4, 5), (0,), (7,)]]
    for arrays in (plain, [a.view(Sub) for a in plain]):
        out = np.full(40, -1.0, np.float32)
        hostcopy.gather_any(arrays, out)
        assert (out[:30] == np.concatenate([np.asarray(a).reshape(-1) for a in arrays])).all()
        assert (out[30:] == -1).all()
        src = rng.standard_normal(30).astype(np.float32)
        hostcopy.scatter_any(src, arrays)
        assert (np.concatenate([np.asarray(a).reshape(-1) for a in arrays]) == src).all()


def test_misaligned_arrays_and_buffer():
    raw = np.zeros(4 * 600 + 3, np.uint8)
    arrays = [raw[1:1 + 4 * 300].view(np.uint8), raw[1 + 4 * 300:1 + 4 * 300 + 7]]
    for i, a in enumerate(arrays):
        a[...] = np.arange(a.size) % 251 + i
    backing = np.zeros(4 * 300 + 7 + 1, np.uint8)
    out = backing[1:]
    assert hostcopy.gather(arrays, out)
    assert (out == np.concatenate(arrays)).all()


def test_nothing_copied_when_an_array_does_not_qualify():
    a, b = np.ones(10, np.float32), np.ones(6, np.float32)
    out = np.zeros(15, np.float32)
    assert not hostcopy.gather([a, b], out)                      # does not fit
    assert (out == 0).all()
    assert not hostcopy.scatter(np.full(15, 7, np.float32), [a, b])
    assert (a == 1).all() and (b == 1).all()
    big = np.zeros(100, np.float32)
    assert not hostcopy.gather([a, b.astype(np.float64)], big)    # mixed dtypes
    assert not hostcopy.gather([a, np.ones((4, 4), np.float32)[:, 1]], big)   # strided
    assert not hostcopy.gather([a, [1.0, 2.0]], big)               # not an array
    readonly = np.ones(3, np.float32)
    readonly.flags.writeable = False
    assert hostcopy.gather([readonly], big)                        # reading is fine
    assert not hostcopy.scatter(big, [a, readonly])                # writing is not
    assert (a == 1).all() and (big == np.r_[1, 1, 1, np.zeros(97)]).all()


def test_resized_array_is_read_at_its_new_size():
    a = np.arange(8, dtype=np.float64)
    out = np.zeros(20, np.float64)
    assert hostcopy.gather([a], out)
    a.resize(12, refcheck=False)                 # may move the data
    a[8:] = 9
    assert hostcopy.gather([a], out)
    assert (out[:12] == np.r_[np.arange(8), [9] * 4]).all()
    a.resize(40, refcheck=False)
    assert not hostcopy.gather([a], out)         # no longer fits: nothing copied


def test_flat_buffer_checks():
    with pytest.raises(ArrayTypeError):
        hostcopy.gather([np.ones(2)], np.zeros(8)[::2])
    readonly = np.zeros(8)
    readonly.flags.writeable = False
    with pytest.raises(ArrayTypeError):
        hostcopy.gather([np.ones(2)], readonly)
    assert hostcopy.scatter(readonly, [np.ones(2)])


def test_copy_lets_other_threads_run():
    """A long copy on one thread leaves the GIL to the others: while it runs,
    the main thread's Python loop gets CPU time of its own, about as much as
    the copy's thread (a copy holding the GIL would leave it none: it would
    wait for the GIL for the whole call). CPU time, not pauses: a busy
    machine that deschedules either thread changes neither share much."""
    import threading
    import time
    parts = [np.ones(16 << 20, np.float32) for _ in range(4)]     # 256 MiB
    out = np.empty(64 << 20, np.float32)
    hostcopy.gather(parts, out)                                   # pages in
    calls = []

    def copy():
        for _ in range(3):
            start, cpu = time.perf_counter(), time.thread_time()
            assert hostcopy.gather(parts, out)
            calls.append((start, time.perf_counter(), time.thread_time() - cpu))

    thread = threading.Thread(target=copy)
    ticks = []
    thread.start()
    while thread.is_alive():
        ticks.append((time.perf_counter(), time.thread_time()))
    thread.join()
    copying = sum(cpu for _, _, cpu in calls)
    assert copying > 0.03, "the copies were too short to tell (%.3f s of CPU)" % copying
    beside = 0.0                  # the main thread's CPU time inside the calls
    for start, end, _ in calls:
        inside = [cpu for t, cpu in ticks if start <= t <= end]
        if inside:
            beside += inside[-1] - inside[0]
    assert beside > copying / 3, (beside, copying)
