"""Exception hierarchy of commlib.

Every error commlib raises derives from :class:`CommlibError`. Argument
errors also derive from the matching built-in (``TypeError``/``ValueError``)
so existing ``except ValueError`` code keeps working.

Errors that involve other ranks carry ``culprits``: the ranks the error
blames (a peer that never arrived, left, died or sent a bad payload), as a
tuple of ints, empty when no rank is to blame or it is not known. The
launcher reports them.
"""


def ranks_text(ranks):
    """How messages name ranks: ``rank 3``, ``ranks 0, 2``."""
    ranks = list(ranks)
    return ("rank %s" if len(ranks) == 1 else "ranks %s") % ", ".join(map(str, ranks))


def rank_name(r, world=None):
    """How messages name rank ``r``: ``rank 3``; ``rank 1 (world rank 3)``
    in a communicator made by ``split``, whose rank r is rank
    ``world[r]`` of the communicator it was split from (``world``: that
    list, None for a communicator that was not split)."""
    return "rank %d" % r if world is None else "rank %d (world rank %d)" % (r, world[r])


def ranks_name(ranks, world=None):
    """How messages name a list of ranks: ``ranks [0, 2]``, or ``ranks
    [0, 2] (world ranks [1, 3])`` (see :func:`rank_name`)."""
    ranks = list(ranks)
    return "ranks %s" % ranks if world is None else "ranks %s (world ranks %s)" % (
        ranks, [world[r] for r in ranks])


class CommlibError(Exception):
    """Base class of every commlib error.

    ``culprits``: tuple of the ranks this error blames (may be empty).
    """

    def __init__(self, *args, culprits=()):
        super().__init__(*args)
        self.culprits = tuple(int(r) for r in culprits)


class ArgumentError(CommlibError, ValueError):
    """An argument has a wrong value (root out of range, bad op, bad length)."""


class ArrayTypeError(CommlibError, TypeError):
    """An array has the wrong kind (numpy vs cupy), dtype or layout."""


class DeviceMismatchError(ArrayTypeError):
    """A cupy array lives on another GPU than the communicator's."""


class BackendUnavailableError(CommlibError, RuntimeError):
    """A transport (NCCL, MPI, CUDA kernels) was asked for but cannot be used here."""


class LaunchError(CommlibError, RuntimeError):
    """The job is not what its launcher said: a rank's MPI world has another
    size than the launcher started (an mpiexec of another MPI than mpi4py's
    makes every rank a job of size 1), or no mpiexec of mpi4py's MPI was
    found."""


class ClosedError(CommlibError, RuntimeError):
    """The communicator was used after :meth:`Communicator.close`, or after a
    failure left it unusable."""


class ConsistencyError(CommlibError, RuntimeError):
    """Ranks called different collectives (op, dtype, shape, settings or
    sequence differ), or another rank rejected its arguments."""


class CollectiveTimeoutError(CommlibError, TimeoutError):
    """A collective did not complete before its deadline (a peer hangs, died,
    or never called it); ``culprits`` are the ranks that had not arrived."""


class PeerError(CommlibError, RuntimeError):
    """A peer left while this rank waits for it: it closed the communicator
    (uneven number of steps), exited, died, or gave up on this collective
    after an error of its own."""


class TransportError(CommlibError, RuntimeError):
    """The MPI or NCCL library reported an error during a collective."""


class NonFiniteError(CommlibError, FloatingPointError):
    """A compressed all-reduce met NaN or infinite values (``counts``: per
    rank, how many)."""

    def __init__(self, *args, counts=(), culprits=()):
        super().__init__(*args, culprits=culprits)
        self.counts = tuple(int(c) for c in counts)


class PayloadError(CommlibError, RuntimeError):
    """A rank's compressed payload (counts, indices) is malformed; no array
    was written."""
