"""Recognising a list of arrays seen before by the identity of its arrays.

A training loop passes the same gradient arrays at every step; what was
worked out for them once (a fusion plan and its buffers, a GPU copy table)
is kept in an :class:`IdentityCache` entry keyed by the arrays' ids, in
order, and an extra hashable key. An entry holds only weak references to
the arrays: it never keeps them alive, and it is dropped as soon as one of
them is garbage-collected (so a new array that happens to get a dead one's
id is never mistaken for it). Arrays that cannot be weakly referenced are
not cached. The least recently used entry goes first when the cache is full.
"""
import collections
import functools
import weakref


class IdentityCache:
    """At most ``max_entries`` values, each for one list of objects and an
    extra key."""

    def __init__(self, max_entries):
        self.max_entries = max_entries
        self._entries = collections.OrderedDict()     # key -> (weak refs, value)

    @staticmethod
    def key(items, extra=None):
        """The key of ``items`` (a list or tuple) with ``extra`` (hashable)."""
        return tuple(map(id, items)), extra

    def get(self, key):
        """The value stored under ``key`` (see :meth:`key`), or None."""
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found[1]

    def put(self, key, items, value):
        """Store ``value`` for ``items`` under ``key``; returns whether it was
        stored (False when an item cannot be weakly referenced)."""
        drop = functools.partial(self._entries.pop, key, None)
        try:
            refs = tuple(weakref.ref(a, lambda _, drop=drop: drop()) for a in items)
        except TypeError:
            return False
        self._entries[key] = (refs, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return True

    def entries(self):
        """(items still alive, value) of every entry, least recently used first."""
        return [(tuple(r() for r in refs), value) for refs, value in self._entries.values()]

    def clear(self):
        self._entries.clear()

    def __len__(self):
        return len(self._entries)
