"""commlib.core.caches: a list recognised by its arrays' identity, never
by a dead array's recycled id, never keeping arrays alive."""
import gc

import numpy as np

from commlib.core.caches import IdentityCache


def test_hit_only_for_the_very_same_arrays_in_order():
    cache = IdentityCache(4)
    a, b = np.ones(3), np.zeros(3)
    key = IdentityCache.key([a, b], "x")
    assert cache.get(key) is None
    assert cache.put(key, [a, b], "value")
    assert cache.get(IdentityCache.key([a, b], "x")) == "value"
    assert cache.get(IdentityCache.key([b, a], "x")) is None          # order matters
    assert cache.get(IdentityCache.key([a, b], "y")) is None          # so does the extra key
    assert cache.get(IdentityCache.key([a, np.ones(3)], "x")) is None


def test_entry_dies_with_any_of_its_arrays_and_never_keeps_them_alive():
    cache = IdentityCache(4)
    a, b = np.ones(3), np.ones(3)
    key = IdentityCache.key([a, b])
    cache.put(key, [a, b], 1)
    assert len(cache) == 1 and cache.entries()[0][0] == (a, b)
    del b
    gc.collect()
    assert len(cache) == 0 and cache.get(key) is None


def test_least_recently_used_goes_first_and_unreferenceable_items_are_not_kept():
    cache = IdentityCache(2)
    arrays = [np.ones(1) for _ in range(3)]
    keys = [IdentityCache.key([x]) for x in arrays]
    cache.put(keys[0], [arrays[0]], 0)
    cache.put(keys[1], [arrays[1]], 1)
    assert cache.get(keys[0]) == 0                # 0 is now the most recent
    cache.put(keys[2], [arrays[2]], 2)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) == 0 and cache.get(keys[2]) == 2
    assert not cache.put(IdentityCache.key([1, 2]), [1, 2], "ints")   # no weak references
    assert len(cache) == 2
