"""Settings and messages a newcomer meets: nnabla's watch-dog variables as
aliases of commlib's, and the partial-synchronisation period as documented."""
import math
import re
from pathlib import Path

import pytest

from commlib import settings
from commlib.compression import Partial
from commlib.errors import ArgumentError

COMPRESSION_DOC = Path(__file__).resolve().parents[2] / "docs" / "compression.md"
NAMES = ("COMMLIB_WATCHDOG_ENABLE", "COMMLIB_WATCHDOG_TIMEOUT",
         "NNABLA_MPI_WATCH_DOG_ENABLE", "NNABLA_MPI_WATCH_DOG_TIMEOUT")


@pytest.mark.parametrize("env,expected", [
    ({}, settings.DEFAULT_TIMEOUT),
    ({"NNABLA_MPI_WATCH_DOG_TIMEOUT": "30"}, 30.0),
    ({"NNABLA_MPI_WATCH_DOG_ENABLE": "1", "NNABLA_MPI_WATCH_DOG_TIMEOUT": "12.5"}, 12.5),
    ({"NNABLA_MPI_WATCH_DOG_ENABLE": "7"}, settings.DEFAULT_TIMEOUT),
    ({"NNABLA_MPI_WATCH_DOG_ENABLE": "0", "NNABLA_MPI_WATCH_DOG_TIMEOUT": "30"}, None),
    # commlib's own names win where both are set
    ({"COMMLIB_WATCHDOG_TIMEOUT": "5", "NNABLA_MPI_WATCH_DOG_TIMEOUT": "30"}, 5.0),
    ({"COMMLIB_WATCHDOG_ENABLE": "1", "NNABLA_MPI_WATCH_DOG_ENABLE": "0"},
     settings.DEFAULT_TIMEOUT),
    ({"COMMLIB_WATCHDOG_ENABLE": "0", "NNABLA_MPI_WATCH_DOG_ENABLE": "1"}, None),
])
def test_nnabla_watch_dog_variables_are_aliases(monkeypatch, env, expected):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert settings.timeout() == expected


def test_a_bad_nnabla_timeout_names_the_variable(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NNABLA_MPI_WATCH_DOG_TIMEOUT", "soon")
    with pytest.raises(ArgumentError, match="NNABLA_MPI_WATCH_DOG_TIMEOUT"):
        settings.timeout()


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.3, 0.45, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("size", [1, 2, 7, 10, 100, 1001])
def test_partial_period_is_the_calls_that_cover_every_value(fraction, size):
    p = Partial(fraction)
    covered, calls = set(), 0
    while len(covered) < size:
        start, stop = p.window(size, calls)
        assert set(range(start, stop)).isdisjoint(covered)
        covered.update(range(start, stop))
        calls += 1
    assert calls == p.period(size) == math.ceil(size / math.ceil(fraction * size))
    assert p.period(size) <= math.ceil(1 / fraction)
    assert p.window(size, calls) == p.window(size, 0)       # and it starts over


def test_the_docs_state_the_real_partial_period():
    text = " ".join(COMPRESSION_DOC.read_text().split())
    assert "once every `ceil(N / ceil(fraction * N))` calls" in text
    assert not re.search(r"once every `ceil\(1 / fraction\)` calls", text)
    assert Partial(0.45).period(10) == 2 and "2 calls for fraction 0.45 of 10 values" in text
