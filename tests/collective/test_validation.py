"""The argument checks' own loops, compiled and in Python alike: overlapping
arrays and arrays made read-only between two calls with the same list."""
import itertools
import re

import numpy as np
import pytest

from commlib.collective import validation
from commlib.errors import ArgumentError, ArrayTypeError
from commlib.ops import native
from inprocess import communicators

PATHS = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])


def use(compiled, monkeypatch):
    if not compiled:
        monkeypatch.setattr(native, "module", lambda: None)
    elif native.module() is None:
        pytest.skip("compiled host loops not built")


def overlapping_pairs(arrays):
    """Every (i, j), i < j, of arrays whose byte ranges meet, worked out
    from their addresses pair by pair."""
    ranges = [(a.__array_interface__["data"][0], a.nbytes) for a in arrays]
    return {(i, j) for i, j in itertools.combinations(range(len(arrays)), 2)
            if ranges[i][1] and ranges[j][1] and ranges[i][0] < ranges[j][0] + ranges[j][1]
            and ranges[j][0] < ranges[i][0] + ranges[i][1]}


@PATHS
def test_first_overlap_finds_a_meeting_pair_exactly_when_there_is_one(compiled, monkeypatch):
    use(compiled, monkeypatch)
    rng = np.random.default_rng(5)
    base = np.zeros(64, np.float32)
    for _ in range(200):
        arrays = []
        for _ in range(int(rng.integers(1, 6))):
            if rng.random() < 0.3:
                arrays.append(np.zeros(int(rng.integers(0, 4)), np.float32))  # memory of its own
            else:
                start = int(rng.integers(0, 64))
                arrays.append(base[start:start + int(rng.integers(0, 12))])   # may be empty
        expected = overlapping_pairs(arrays)
        found = validation.first_overlap(arrays)
        if expected:
            assert found in expected, (found, expected)
        else:
            assert found is None, (found, [(a.__array_interface__["data"][0], a.nbytes)
                                           for a in arrays])
    arrays = [base[10:20], base[0:5], base[30:40], base[15:16], base[35:50]]
    assert overlapping_pairs(arrays) == {(0, 3), (2, 4)}
    assert validation.first_overlap(arrays) in {(0, 3), (2, 4)}


@PATHS
@pytest.mark.parametrize("culprit", [0, 2])
def test_an_array_made_read_only_since_the_last_call_is_named(compiled, culprit, monkeypatch):
    use(compiled, monkeypatch)
    arrays = [np.arange(4.0) for _ in range(3)]
    validation.check_still_writeable(arrays, rank=3)        # all writeable: no error
    arrays[culprit].setflags(write=False)
    with pytest.raises(ArrayTypeError, match=r"^rank 3: arrays\[%d\] is read-only" % culprit):
        validation.check_still_writeable(arrays, rank=3)
    # through the communicator: a list it knows (prepared at the second
    # call, recognised at the third) and one of its arrays made read-only
    comm, = communicators(1)
    arrays = [np.full(5, float(i)) for i in range(3)]
    for _ in range(3):
        comm.all_reduce(arrays)
    arrays[culprit].setflags(write=False)
    with pytest.raises(ArrayTypeError, match=r"^rank 0: arrays\[%d\] is read-only" % culprit):
        comm.all_reduce(arrays)
    assert all(np.array_equal(a, np.full(5, float(i))) for i, a in enumerate(arrays))
    comm.close()


@pytest.mark.parametrize("root", [True, False, 1.0, "1", None])
def test_a_root_that_is_no_int_is_refused(root):
    with pytest.raises(ArgumentError, match=r"^rank 2: root must be an int, got %s$"
                       % re.escape(repr(root))):
        validation.check_root(root, 4, rank=2)


@pytest.mark.parametrize("root,size", [(-1, 4), (4, 4), (1, 1)])
def test_a_root_out_of_range_is_refused(root, size):
    with pytest.raises(ArgumentError, match=r"^rank 0: root=%d is out of range for a "
                       r"communicator of size %d \(expected 0 <= root < %d\)$"
                       % (root, size, size)):
        validation.check_root(root, size, rank=0)


def test_roots_in_range_pass():
    for size in (1, 3):
        for root in range(size):
            validation.check_root(root, size, rank=0)
            validation.check_root(np.int64(root), size, rank=0)


@pytest.mark.parametrize("agree", [None, (), ("a", 1, 2.5, True, None), (("x", (1, None)), -3)])
def test_agree_of_plain_values_passes(agree):
    validation.check_agree(agree, 1, "all_reduce")


@pytest.mark.parametrize("agree", [[1], "step", 3, ("a", [1]), (object(),), (("x", {1}),),
                                   (np.float32(1),)])
def test_agree_of_anything_else_is_refused(agree):
    with pytest.raises(ArgumentError, match=r"^rank 1: all_reduce: agree must be None or a "
                       r"tuple of str, int, float, bool, None and tuples of them, got "):
        validation.check_agree(agree, 1, "all_reduce")
