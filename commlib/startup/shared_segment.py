"""Memory shared by the ranks of one node: a file in ``/dev/shm`` that every
rank maps.

One rank creates the file exclusively (zero-filled, ``nbytes`` long, mode
0600), the others open it by name (never through a symlink) and check that
it is this user's and closed to others; once every rank has mapped it the
name is removed, so nothing is left behind when the processes end, however
they end. Releasing a segment
(:meth:`SharedSegment.close`) only unmaps this rank's view: it never waits
for the other ranks, so it is safe after a failure or from a garbage
collector.
"""
import mmap
import os
import secrets
import stat

import numpy as np

from ..errors import BackendUnavailableError

#: where segments are created (a tmpfs on Linux)
ROOT = "/dev/shm"
PREFIX = "commlib-"


def available():
    """Whether shared segments can be made here."""
    return os.path.isdir(ROOT) and os.access(ROOT, os.W_OK)


def foreign(info):
    """Why a file of ``info`` (``os.stat_result``) is not one a rank of this
    user made for the others (a regular file of this user's, mode 0600 or
    less), or None when it is."""
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.geteuid():
        return ("it belongs to uid %d, not to this process's uid %d (planted by another "
                "user?)" % (info.st_uid, os.geteuid()))
    if info.st_mode & 0o077:
        return "its mode is %04o: others may read or write it (expected 0600)" % (
            info.st_mode & 0o7777)
    return None


def new_name():
    """A fresh segment name (random: no two jobs share one)."""
    return PREFIX + secrets.token_hex(12)


class SharedSegment:
    """``nbytes`` of memory shared with the other ranks of this node that open
    the same ``name``; :attr:`array` is a writeable uint8 numpy view of it,
    page-aligned.

    ``create=True`` makes the file exclusively (``O_CREAT | O_EXCL``, mode
    0600; it must not exist). Otherwise an existing file is opened, never
    through a symlink, and taken only when it is a regular file of this
    user's with no permission for anyone else (what a rank of this user
    made): one another user planted under the name (``/dev/shm`` is shared)
    is refused. ``exist_ok`` (ranks that derive the name from a shared
    secret and open it in any order): the first to come makes it
    exclusively, the others open it as above.

    Raises:
        BackendUnavailableError: the name is malformed, or the file cannot
            be made, opened, checked or mapped (saying why).
    """

    def __init__(self, name, nbytes, create=False, exist_ok=False):
        if "/" in name or not name.startswith(PREFIX):
            raise BackendUnavailableError("commlib: bad shared segment name %r" % (name,))
        self.name, self.nbytes = name, int(nbytes)
        self.path = os.path.join(ROOT, name)
        fd, made = self._open(create, exist_ok)
        try:
            if made or exist_ok:
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

    def _open(self, create, exist_ok):
        """(file descriptor, whether this call made the file)."""
        # O_NONBLOCK: a FIFO planted under the name does not block the open
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        if create or exist_ok:
            try:
                return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
            except FileExistsError:
                if create:
                    raise BackendUnavailableError("commlib: cannot make shared memory %s: it "
                                                  "exists already" % self.path) from None
            except OSError as exc:
                raise BackendUnavailableError("commlib: cannot make shared memory %s: %s"
                                              % (self.path, exc)) from exc
        try:
            fd = os.open(self.path, flags)
        except OSError as exc:
            raise BackendUnavailableError("commlib: cannot open shared memory %s: %s"
                                          % (self.path, exc)) from exc
        problem = foreign(os.fstat(fd))
        if problem is not None:
            os.close(fd)
            raise BackendUnavailableError("commlib: refused shared memory %s: %s" % (
                self.path, problem))
        return fd, False

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
