"""commlib.compression.Partial at the edges of its windows: widths that
are exact, just under and just over a whole number of values, the last
window shorter, one-value and empty buckets, fraction 1; calls before, at
and after the period wraps. The windows are written out by hand from the
documented rule (windows of ``ceil(fraction * size)`` values in turn); the
reduced values are checked against numpy on every rank's inputs (ranks as
threads, tests/inprocess.py)."""
import re

import numpy as np
import pytest

from commlib.compression import Partial
from commlib.errors import ArgumentError
from inprocess import run_ranks

#: (fraction, size): the windows call 0, 1, ... reduces, one period
WINDOWS = {
    (0.25, 8): [(0, 2), (2, 4), (4, 6), (6, 8)],        # 2.0: exact
    (0.25, 7): [(0, 2), (2, 4), (4, 6), (6, 7)],        # 1.75 -> 2, the last shorter
    (0.25, 9): [(0, 3), (3, 6), (6, 9)],                # 2.25 -> 3, fewer windows
    (0.5, 3): [(0, 2), (2, 3)],
    (0.45, 10): [(0, 5), (5, 10)],                      # the module's example
    (0.25, 1): [(0, 1)],
    (0.25, 0): [(0, 0)],
    (1.0, 5): [(0, 5)],
    (1e-9, 3): [(0, 1), (1, 2), (2, 3)],                # at least one value per window
}


@pytest.mark.parametrize("fraction, size", list(WINDOWS))
def test_period_and_windows_before_at_and_after_the_wrap(fraction, size):
    strategy = Partial(fraction)
    windows = WINDOWS[fraction, size]
    assert strategy.period(size) == len(windows)
    for call in range(2 * len(windows) + 1):
        assert strategy.window(size, call) == windows[call % len(windows)], call


@pytest.mark.parametrize("bad", [0, -0.5, 1.0000001, float("nan"), True, "0.5", None])
def test_fraction_outside_zero_one(bad):
    with pytest.raises(ArgumentError, match=r"^Partial: fraction must be a number in \(0, 1\], "
                                            r"got %s$" % re.escape(repr(bad))):
        Partial(bad)


def test_reduced_windows_equal_numpy_across_the_wrap():
    """Three ranks, buckets of the sizes above (each two arrays, one bucket),
    op avg and max, calls up to one past the second wrap: each call's
    window holds the reduction of every rank's values there, the rest the
    rank's own."""
    n = 3
    cases = [(f, s) for (f, s) in WINDOWS if s]

    def inputs(rank, size, call):
        rng = np.random.default_rng([size, call, rank])
        return rng.integers(-50, 50, size).astype(np.float32)

    def body(comm, op):           # a communicator per op: the call count is per layout
        got = {}
        for fraction, size in cases:
            strategy = Partial(fraction)
            for call in range(2 * len(WINDOWS[fraction, size]) + 1):
                x = inputs(comm.rank, size, call)
                # two arrays of their own (not views of one buffer): the bucket is
                # gathered into a flat copy and scattered back, across their border
                parts = [x[:size // 2].copy(), x[size // 2:].copy()]
                comm.all_reduce(parts, op=op, compression=strategy)
                got[op, fraction, size, call] = np.concatenate(parts)
        return got

    by_op = [run_ranks(n, lambda comm: body(comm, op)) for op in ("avg", "max")]
    results = [{**by_op[0][r], **by_op[1][r]} for r in range(n)]
    for (op, fraction, size, call), _ in results[0].items():
        start, stop = WINDOWS[fraction, size][call % len(WINDOWS[fraction, size])]
        everyone = [inputs(r, size, call) for r in range(n)]
        if op == "avg":
            reduced = ((everyone[0] + everyone[1]) + everyone[2]) * np.float32(1.0 / n)
        else:
            reduced = np.maximum(np.maximum(everyone[0], everyone[1]), everyone[2])
        for r in range(n):
            want = everyone[r].copy()
            want[start:stop] = reduced[start:stop]
            got = results[r][op, fraction, size, call]
            assert got.tobytes() == want.tobytes(), (op, fraction, size, call, r)
