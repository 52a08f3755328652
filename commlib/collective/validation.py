"""Argument checks shared by every collective.

Checks run before any communication, so bad input raises a specific error on
the rank that passed it (and, with the consistency check on, on every rank)
instead of a hang or garbage. Per-array checks use C-level ``map`` passes and
only fall back to a Python loop to name the offending array.
"""
import operator

import numpy as np

from ..core import dtypes
from .. import interop
from ..errors import ArgumentError, ArrayTypeError, DeviceMismatchError
from ..ops import native
from ..ops.arrays import address, is_cupy

_KINDS = {"numpy": "numpy.ndarray", "cupy": "cupy.ndarray"}


def as_list(arrays, what="arrays", rank=None, writeable=False):
    """(list_of_arrays, was_single): accept one array or a list/tuple.

    Arrays of other frameworks (torch, JAX, any DLPack producer) come back
    as numpy or cupy views of their memory (:mod:`commlib.interop`);
    ``writeable``: the caller writes its result into them (immutable
    arrays raise ArrayTypeError)."""
    if isinstance(arrays, (list, tuple)):
        return interop.native_list(list(arrays), rank=rank, what=what, writeable=writeable), False
    if _kind(arrays) is None and not interop.is_foreign(arrays):
        raise ArrayTypeError("%s%s: expected a numpy/cupy array (or a torch, JAX or other "
                             "DLPack array) or a list of them, got %s"
                             % ("" if rank is None else "rank %d: " % rank, what,
                                type(arrays).__name__))
    return [interop.native(arrays, rank=rank, what=what, writeable=writeable)], True


def _kind(a):
    if is_cupy(a) and hasattr(a, "data"):      # first: a stand-in cupy may subclass numpy's
        return "cupy"
    if isinstance(a, np.ndarray):
        return "numpy"
    return None


def _first(arrays, bad):
    """Index of the first array for which ``bad(a)`` is true."""
    return next(i for i, a in enumerate(arrays) if bad(a))


class Whole(str):
    """The name of an argument that is one array, not a list (``recv(array)
    from rank 0``): errors name it without an index."""


def _item(what, i):
    """How errors name array ``i`` of the argument ``what``: ``arrays[2]``."""
    return what if isinstance(what, Whole) else "%s[%d]" % (what, i)


def check_arrays(arrays, *, rank, device=None, writeable=True, floating=False,
                 what="arrays"):
    """Validate a list of arrays for one collective call.

    Returns the kind (``"numpy"`` or ``"cupy"``; ``None`` for an empty list).
    ``device`` (int or None) is the communicator's GPU; ``writeable`` demands
    writeable C-contiguous memory (in-place collectives); ``floating``
    demands floating dtypes (``avg`` and ``division=True``).
    """
    if not arrays:
        return None
    kind = _check_kind(arrays, rank, what)
    _check_dtypes(arrays, rank, what, floating)
    if writeable:
        _check_writeable(arrays, rank, what, kind)
    if kind == "cupy" and device is not None:
        devs = set(a.device.id for a in arrays)
        if devs != {device}:
            i = _first(arrays, lambda a: a.device.id != device)
            raise DeviceMismatchError(
                "rank %d: %s is on GPU %d but this communicator uses GPU %d"
                % (rank, _item(what, i), arrays[i].device.id, device))
    return kind


def _check_kind(arrays, rank, what):
    """The kind of every array (``"numpy"`` or ``"cupy"``), the same for all."""
    types = set(map(type, arrays))
    if len(types) == 1:
        kind = _kind(arrays[0])
        if kind is None:
            raise ArrayTypeError(_not_an_array("rank %d: %s[0]" % (rank, what), arrays[0]))
        return kind
    kinds = [_kind(a) for a in arrays]
    if None in kinds:
        i = kinds.index(None)
        raise ArrayTypeError(_not_an_array("rank %d: %s" % (rank, _item(what, i)), arrays[i]))
    kind = kinds[0]
    if len(set(kinds)) > 1:
        i = next(i for i, k in enumerate(kinds) if k != kind)
        raise ArrayTypeError(
            "rank %d: %s is a %s but %s is a %s; one call takes arrays of one kind"
            % (rank, _item(what, i), _KINDS[kinds[i]], _item(what, 0), _KINDS[kind]))
    return kind


def _not_an_array(where, item):
    """The message for ``item``, at ``where``, that is no array commlib takes."""
    hint = (" (a list of numbers is not an array: pass numpy.asarray(values))"
            if isinstance(item, (int, float, complex, np.number)) else "")
    return ("%s: expected a numpy/cupy array (or a torch, JAX or other DLPack array), got %s%s"
            % (where, type(item).__name__, hint))


def _check_dtypes(arrays, rank, what, floating):
    """Supported dtypes in native byte order; floating ones where ``floating``."""
    for dt in set(map(operator.attrgetter("dtype"), arrays)):
        if not dtypes.is_supported(dt):
            i = _first(arrays, lambda a: a.dtype == dt)
            order = "" if dt.isnative else " in non-native byte order (%s)" % dt.str
            raise ArrayTypeError("rank %d: %s has dtype %s%s; supported dtypes: %s, in "
                                 "native byte order" % (rank, _item(what, i), dtypes.name_of(dt),
                                                        order, ", ".join(dtypes.SUPPORTED)))
        if floating and not dtypes.is_floating(dt):
            i = _first(arrays, lambda a: a.dtype == dt)
            raise ArrayTypeError(
                "rank %d: %s has integer dtype %s; op='avg' and division=True need a "
                "floating dtype (use op='sum' and divide yourself)"
                % (rank, _item(what, i), dtypes.name_of(dt)))


def _check_writeable(arrays, rank, what, kind):
    """C-contiguous, writeable (numpy) arrays, each given once."""
    if not all(map(operator.attrgetter("flags.c_contiguous"), arrays)):
        i = _first(arrays, lambda a: not a.flags.c_contiguous)
        raise ArrayTypeError(
            "rank %d: %s (shape %s, strides %s) is not C-contiguous; in-place "
            "collectives need contiguous memory" % (rank, _item(what, i), arrays[i].shape,
                                                    arrays[i].strides))
    if kind == "numpy" and not all(map(operator.attrgetter("flags.writeable"), arrays)):
        i = _first(arrays, lambda a: not a.flags.writeable)
        raise ArrayTypeError("rank %d: %s is read-only; in-place collectives write "
                             "their result into it" % (rank, _item(what, i)))
    shared = first_overlap(arrays)
    if shared is not None:
        i, j = shared
        how = ("is the same array as" if arrays[i] is arrays[j] else
               "shares memory with")
        raise ArgumentError("rank %d: %s %s %s; in-place collectives write each "
                            "element once, so every array must have memory of its own (pass "
                            "each array once, and no overlapping views)"
                            % (rank, _item(what, j), how, _item(what, i)))


def first_overlap(arrays):
    """``(i, j)``, ``i < j``, of the first two of ``arrays`` (C-contiguous
    numpy or cupy arrays of one kind) whose memory meets, or None (empty
    arrays hold none): one compiled pass for numpy arrays."""
    ext = native.module()
    if ext is not None and not is_cupy(arrays[0]):
        found = ext.first_overlap(arrays)
        if not isinstance(found, int):
            return found
    extents = sorted((address(a), address(a) + a.nbytes, i)
                     for i, a in enumerate(arrays) if a.nbytes)
    furthest = None
    for start, end, i in extents:
        if furthest is not None and start < furthest[1]:
            return min(i, furthest[2]), max(i, furthest[2])
        if furthest is None or end > furthest[1]:
            furthest = (start, end, i)
    return None


def check_still_writeable(arrays, rank, what="arrays"):
    """Of a list of numpy arrays checked before (a list passed again), raise
    ArrayTypeError naming the first one made read-only since, before
    anything is written (one compiled pass where it is built)."""
    ext = native.module()
    first = ext.first_readonly(arrays) if ext is not None else -2
    if first == -2:
        first = next((i for i, a in enumerate(arrays) if not a.flags.writeable), -1)
    if first >= 0:
        raise ArrayTypeError("rank %d: %s is read-only; in-place collectives write "
                             "their result into it" % (rank, _item(what, first)))


def check_op(op, division, rank):
    if op not in dtypes.OPS:
        raise ArgumentError("rank %d: op=%r is not supported; expected one of %s"
                            % (rank, op, ", ".join(dtypes.OPS)))
    if not isinstance(division, (bool, np.bool_)):
        raise ArgumentError("rank %d: division must be True or False, got %r" % (rank, division))
    if division and op not in ("sum", "avg"):
        raise ArgumentError("rank %d: division=True goes with op='sum' (it averages); got op=%r"
                            % (rank, op))


def check_root(root, size, rank):
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise ArgumentError("rank %d: root must be an int, got %r" % (rank, root))
    if not 0 <= root < size:
        raise ArgumentError("rank %d: root=%d is out of range for a communicator of size %d "
                            "(expected 0 <= root < %d)" % (rank, root, size, size))


def plain(value):
    """Whether ``value`` is a plain value: None, bool, int, float, str, or a
    tuple of plain values (what a call's fingerprint may hold)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, tuple) and all(map(plain, value))


def check_agree(agree, rank, name):
    """``agree`` (see ``Communicator.all_reduce``): None or a tuple of plain values."""
    if agree is not None and not (isinstance(agree, tuple) and plain(agree)):
        raise ArgumentError("rank %d: %s: agree must be None or a tuple of str, int, float, "
                            "bool, None and tuples of them, got %r" % (rank, name, agree))
