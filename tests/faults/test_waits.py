"""The flag waits' results: "every rank arrived" never reads as "rank r
left", for every r, in the compiled wait and its Python twin alike."""
import numpy as np
import pytest

from commlib.core import waiting
from commlib.ops import native

NRANKS = 4


def _compiled(words, target, gone, seq, rank):
    ext = native.module()
    return ext.wait_flags(words, rank, NRANKS, 1, target, False, None, 0.01, gone, 1, seq)


def _python(words, target, gone, seq, rank):
    return waiting.spin_py(words, target, gone, seq, rank, 0.01)


WAITS = [pytest.param(_python, id="python"),
         pytest.param(_compiled, id="compiled",
                      marks=pytest.mark.skipif(not native.available(),
                                               reason="compiled host loops not built"))]


@pytest.mark.parametrize("wait", WAITS)
def test_all_arrived_is_zero(wait):
    words = np.full(NRANKS, 7, np.int64)
    assert wait(words, 7, np.zeros(NRANKS, np.int64), 7, 0) == 0


@pytest.mark.parametrize("wait", WAITS)
@pytest.mark.parametrize("left", range(1, NRANKS))
def test_a_rank_that_left_is_named(wait, left):
    words = np.full(NRANKS, 7, np.int64)
    words[left] = 6                      # it never arrived ...
    gone = np.zeros(NRANKS, np.int64)
    gone[left] = 7                       # ... because it left in collective 7
    code = wait(words, 7, gone, 7, 0)
    assert code <= -2 and -2 - code == left, code


@pytest.mark.parametrize("wait", WAITS)
def test_a_late_rank_is_waited_for(wait):
    words = np.full(NRANKS, 7, np.int64)
    words[2] = 6
    assert wait(words, 7, np.zeros(NRANKS, np.int64), 7, 0) == -1
