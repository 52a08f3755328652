"""Process-wide lifetime of communicators: the registry of those not closed
yet, and the hooks that keep a job from hanging when a rank ends.

* On an uncaught exception every open communicator tells its peers that
  this rank is gone (the status board), then, in an MPI job of several
  ranks, ``MPI_Abort`` ends the job (unless ``COMMLIB_ABORT_ON_ERROR=0``),
  so that no rank stays blocked in a collective.
* At interpreter exit, the communicators still open are closed, the newest
  first (the same order on every rank, so no two ranks wait for each other
  on different communicators).

A communicator takes part through a :class:`Registration` it owns, made
with the two callables the hooks need; the registry holds registrations
weakly and their callables as weak methods, so it never keeps a
communicator alive.
"""
import atexit
import itertools
import sys
import time
import weakref

from .. import settings
from ..errors import CommlibError

ABORT_DRAIN_S = 0.25   # seconds between printing the traceback and MPI_Abort
_live = weakref.WeakSet()   # Registrations of communicators not closed yet
_made = itertools.count()   # creation order (the same on every rank: creation is collective)
_hooks_installed = False


class Registration:
    """A communicator's entry in the registry.

    Args:
        abandon: ``abandon(text)``, called on an uncaught exception: leave
            without waiting for anyone, telling the peers ``text``.
        close: ``close()``, called at interpreter exit.
    """

    def __init__(self, abandon, close):
        self.serial = next(_made)
        self._abandon = weakref.WeakMethod(abandon)
        self._close = weakref.WeakMethod(close)

    def open(self):
        """Enter the registry (and install the hooks)."""
        _live.add(self)
        install_hooks()

    def closed(self):
        """Leave the registry."""
        _live.discard(self)

    def abandon(self, text):
        fn = self._abandon()
        if fn is not None:
            fn(text)

    def close(self):
        fn = self._close()
        if fn is not None:
            fn()


def install_hooks():
    """Install the uncaught-exception hook and the exit hook (once)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    previous = sys.excepthook

    def hook(kind, value, tb):
        for entry in list(_live):
            entry.abandon("%s: %s" % (kind.__name__, value))
        previous(kind, value, tb)
        sys.stderr.flush()
        MPI = sys.modules.get("mpi4py.MPI")
        if (MPI is not None and abort_on_error()
                and MPI.Is_initialized() and not MPI.Is_finalized()
                and MPI.COMM_WORLD.Get_size() > 1):
            time.sleep(ABORT_DRAIN_S)   # mpiexec drops output still in its pipes at an abort
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
    atexit.register(close_at_exit)


def abort_on_error():
    """``COMMLIB_ABORT_ON_ERROR`` (default on), for the exception hook, which
    must not raise: a value made invalid after the communicator checked it
    counts as on (the job ends rather than hangs), and says so."""
    try:
        return settings.flag(settings.ABORT_ON_ERROR, True)
    except CommlibError as exc:
        print("commlib: %s; aborting the job as if it were on" % exc, file=sys.stderr,
              flush=True)
        return True


def close_at_exit():
    """Close the communicators still open, the newest first; a peer still
    inside a collective is told this rank exited."""
    for entry in sorted(_live, key=lambda e: e.serial, reverse=True):
        try:
            entry.close()
        except CommlibError as exc:
            print("commlib: at exit: %s" % exc, file=sys.stderr, flush=True)
