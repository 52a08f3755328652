"""commlib.transport.store_mode: the choice between plain and streaming
stores follows the measured costs and is a function of the reports alone."""
from commlib.transport.store_mode import StoreModeChooser

MIB = 1 << 20


def feed(chooser, cost_of, calls, nbytes=MIB):
    """Run ``calls`` calls whose busy time is ``cost_of(mode)`` ns per byte;
    returns the modes used, in order."""
    used = []
    for _ in range(calls):
        mode = chooser.mode
        used.append(mode)
        chooser.observe(mode, nbytes, cost_of(mode) * nbytes)
    return used


def test_fixed_modes_never_change():
    for fixed in (False, True):
        chooser = StoreModeChooser(fixed=fixed)
        assert feed(chooser, lambda m: 1.0 if m == fixed else 0.1, 100) == [fixed] * 100


def test_measures_both_then_keeps_the_cheaper_and_explores_now_and_then():
    chooser = StoreModeChooser(explore_every=10, samples=3, warmup=2)
    used = feed(chooser, lambda m: 0.5 if m else 0.1, 100)     # plain is cheaper
    assert used[:2] == [False, False]                           # warm-up
    assert used[2:8].count(True) == 3                           # turns until 3 samples each
    assert 9 <= used.count(True) <= 14                          # then one call in 10 explores
    assert not any(a and b for a, b in zip(used[8:], used[9:]))  # one call at a time
    chooser = StoreModeChooser(explore_every=10, warmup=2)
    used = feed(chooser, lambda m: 0.1 if m else 0.5, 100)     # streaming is cheaper
    assert used.count(False) <= 2 + 3 + 10 and used[-1] is True


def test_plain_stores_throughout_the_warm_up():
    chooser = StoreModeChooser()
    assert feed(chooser, lambda m: 0.1 if m else 0.5, 32) == [False] * 32


def test_follows_a_change_of_costs():
    chooser = StoreModeChooser(explore_every=8, warmup=2)
    feed(chooser, lambda m: 0.5 if m else 0.1, 50)
    assert chooser.best is False
    used = feed(chooser, lambda m: 0.1 if m else 0.9, 60)      # plain became expensive
    assert chooser.best is True and used[-20:].count(True) >= 17


def test_small_calls_are_not_measured():
    chooser = StoreModeChooser(min_bytes=1024)
    feed(chooser, lambda m: 5.0, 20, nbytes=1000)
    assert chooser.cost == [None, None] and chooser.measured == 0 and chooser.mode is False
    chooser.observe(False, 4096, 0)          # 0 ns: a rank did not measure
    assert chooser.cost == [None, None] and chooser.measured == 0


def test_warm_up_and_single_outliers_do_not_decide():
    chooser = StoreModeChooser(explore_every=4, warmup=1, samples=3)
    chooser.observe(False, MIB, 100.0 * MIB)    # first call: page faults, not counted
    assert chooser.cost == [None, None]
    feed(chooser, lambda m: 0.2 if m else 0.1, 12)
    assert chooser.best is False and chooser.cost == [0.1, 0.2]
    chooser.observe(True, MIB, 0.01 * MIB)      # one cheap outlier of the other mode
    assert chooser.best is False                # the median of its samples is still 0.2
    used = feed(chooser, lambda m: 0.2 if m else 0.1, 12)
    assert chooser.best is False and used.count(True) <= 4


def test_close_costs_do_not_flip_the_mode():
    chooser = StoreModeChooser(explore_every=4, warmup=2)
    used = feed(chooser, lambda m: 0.09 if m else 0.1, 40)     # streaming only 10 % cheaper
    assert chooser.best is False and used[-8:].count(True) <= 2
    used = feed(chooser, lambda m: 0.05 if m else 0.1, 40)     # half the cost: switch
    assert chooser.best is True and used[-8:].count(True) >= 6


def test_same_reports_same_choices():
    a, b = StoreModeChooser(), StoreModeChooser()
    costs = [0.3, 0.1, 0.2, 0.7, 0.05, 0.4] * 30
    for i, c in enumerate(costs):
        assert a.mode == b.mode
        mode = a.mode
        a.observe(mode, MIB + i, c * (1 + mode) * MIB)
        b.observe(mode, MIB + i, c * (1 + mode) * MIB)
    assert a.cost == b.cost
