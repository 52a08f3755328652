"""commlib.ops.arrays.to_host on numpy arrays (the cupy side runs on the
host build: tests/ops/test_kernels_cooperative.py)."""
import numpy as np
import pytest

from commlib.errors import ArrayTypeError
from commlib.ops.arrays import to_host


def test_numpy_arrays_pass_through_as_they_are():
    a, b = np.array(3, np.int64), np.arange(6, dtype=np.int32).reshape(2, 3)
    got = to_host([(a,), (), (b, a)])
    assert got == [(a,), (), (b, a)] and got[2][0] is b


def test_empty_groups():
    assert to_host([]) == [] and to_host([(), ()]) == [(), ()]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_refuses_arrays_that_are_not_integers(dtype):
    with pytest.raises(ArrayTypeError, match="expected integer arrays, got dtype"):
        to_host([(np.array(1, np.int64), np.zeros(2, dtype))])
