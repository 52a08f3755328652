"""The ``nonfinite=`` setting of the lossy strategies (top-K, threshold,
half precision): what to do when a bucket holds NaN or +-inf.

* ``"raise"`` (the default): every rank raises
  :class:`~commlib.errors.NonFiniteError` (``counts``: per rank, how many;
  ``culprits``: the ranks with a non-zero count) and nothing of that
  bucket is written: its arrays and error-feedback residuals stay as they
  were, so the caller can skip the step, as a loss scaler does. The call's
  other buckets complete as ``docs/compression.md`` says (half precision:
  every finite bucket is written, before and after the failing one).
* ``"warn"``: the call completes and every rank emits one
  ``RuntimeWarning`` naming the ranks and counts (Python's warning filters
  decide whether repeats are shown).

Every rank decides from the same data (counts exchanged in the sparse
records, or the bit-identical reduced half-precision result), so every rank
raises or warns alike.
"""
import warnings

import numpy as np

from ..errors import ArgumentError, NonFiniteError
from ..ops.arrays import array_module

MODES = ("raise", "warn")


def check_mode(nonfinite, owner):
    """``nonfinite`` if it is one of :data:`MODES`; ArgumentError naming
    ``owner`` otherwise."""
    if not isinstance(nonfinite, str) or nonfinite not in MODES:
        raise ArgumentError("%s: nonfinite must be 'raise' or 'warn', got %r"
                            % (owner, nonfinite))
    return nonfinite


def drop(acc):
    """Set the NaN and +-inf entries of ``acc`` (1-D float32, numpy or cupy)
    to 0, in place; returns how many there were: an int for numpy, a 0-d
    device array for cupy (no host synchronisation)."""
    xp = array_module(acc)
    bad = ~xp.isfinite(acc)
    count = xp.count_nonzero(bad)
    if xp is np:
        if count:
            acc[bad] = 0
        return int(count)
    xp.copyto(acc, 0.0, where=bad)
    return count


def ranks(counts):
    """``"rank 1 (2 values), rank 3 (1 value)"``: the ranks with non-zero
    ``counts`` (per rank)."""
    return ", ".join("rank %d (%d value%s)" % (r, c, "" if c == 1 else "s")
                     for r, c in enumerate(counts) if c)


def error(text, counts):
    """NonFiniteError with ``text``, ``counts`` and the ranks with a
    non-zero count as culprits."""
    counts = [int(c) for c in counts]
    return NonFiniteError(text, counts=counts, culprits=[r for r, c in enumerate(counts) if c])


def warn(text):
    """One RuntimeWarning with ``text``."""
    warnings.warn(text, RuntimeWarning, stacklevel=2)
