"""Memory shared by the ranks of one node: a file in ``/dev/shm`` that every
rank maps.

One rank creates the file (zero-filled, ``nbytes`` long), the others open it
by name, and once every rank has mapped it the name is removed, so nothing is
left behind when the processes end, however they end. Releasing a segment
(:meth:`SharedSegment.close`) only unmaps this rank's view: it never waits
for the other ranks, so it is safe after a failure or from a garbage
collector.
"""
import mmap
import os
import secrets

import numpy as np

from ..errors import BackendUnavailableError

#: where segments are created (a tmpfs on Linux)
ROOT = "/dev/shm"
PREFIX = "commlib-"


def available():
    """Whether shared segments can be made here."""
    return os.path.isdir(ROOT) and os.access(ROOT, os.W_OK)


def new_name():
    """A fresh segment name (random: no two jobs share one)."""
    return PREFIX + secrets.token_hex(12)


class SharedSegment:
    """``nbytes`` of memory shared with the other ranks of this node that open
    the same ``name``; :attr:`array` is a writeable uint8 numpy view of it,
    page-aligned. ``create=True`` makes the file (it must not exist); else the
    file is opened, and made if it does not exist yet (``exist_ok``: ranks
    that derive the name from a shared secret open it in any order)."""

    def __init__(self, name, nbytes, create=False, exist_ok=False):
        if "/" in name or not name.startswith(PREFIX):
            raise BackendUnavailableError("commlib: bad shared segment name %r" % (name,))
        self.name, self.nbytes = name, int(nbytes)
        self.path = os.path.join(ROOT, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        if exist_ok:
            flags |= os.O_CREAT
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise BackendUnavailableError("commlib: cannot open shared memory %s: %s"
                                          % (self.path, exc)) from exc
        try:
            if create or exist_ok:
                if os.fstat(fd).st_size < self.nbytes:
                    os.ftruncate(fd, self.nbytes)
            elif os.fstat(fd).st_size < self.nbytes:
                raise BackendUnavailableError("commlib: shared memory %s is smaller than %d bytes"
                                              % (self.path, self.nbytes))
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise BackendUnavailableError("commlib: cannot map shared memory %s: %s"
                                          % (self.path, exc)) from exc
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def unlink(self):
        """Remove the name (the memory lives on while mapped). Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self):
        """Unmap this rank's view (local; the other ranks keep theirs).
        Views of :attr:`array` must no longer be used. Idempotent."""
        if self._map is None:
            return
        self.array = None
        try:
            self._map.close()
        except BufferError:     # a view is still exported: let the GC unmap it
            pass
        self._map = None
