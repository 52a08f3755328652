"""Shared pytest configuration.

``@pytest.mark.gpu`` tests need cupy and a CUDA device; on a machine without
them they are skipped with the reason, never counted as passed.
"""
import compileall
import os
import signal
import sys
from pathlib import Path

import pytest

from mpirun import IMPORT_DIRS
from commlib.core import gpu


# every test folder's helpers importable from any test, as in rank programs
sys.path[1:1] = [str(d) for d in IMPORT_DIRS if str(d) not in sys.path]

# one BLAS thread in every process the tests start (MPI ranks, examples,
# nested runs) unless the caller chose: on a machine where two test workers
# each run a job of up to 4 ranks, a BLAS thread pool per rank only
# oversubscribes the cores (and spinning pool threads take CPU time from the
# ranks); OpenBLAS reads this before OMP_NUM_THREADS, which the launcher's
# tests check
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def pytest_configure(config):
    # a run started in the background of a non-interactive shell (`cmd &`,
    # nohup) ignores Ctrl-C, and so would every process it starts: the tests
    # of what Ctrl-C does (tests/transport/test_shaped_link.py, test_nodes.py)
    # need it delivered, here (KeyboardInterrupt) and in their children
    # (a Python handler is reset to the default at exec, an ignored signal
    # stays ignored)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput"):    # once, in the controlling process
        _compile_sources()
    config.addinivalue_line("markers", "gpu: needs cupy and a CUDA GPU")
    # pytest-xdist's --dist loadgroup runs a group's tests in one worker:
    # "nvrtc" shares one NVRTC build per library (tests/ops/nvrtc_builds.py)
    config.addinivalue_line("markers", "xdist_group(name): run in one pytest-xdist worker")


def _compile_sources():
    """Write the bytecode of commlib and of the tests' helpers once, before
    the run: every rank of every MPI job imports them, and where bytecode is
    not written on import (PYTHONDONTWRITEBYTECODE, set on some machines)
    each of those processes would compile about 70 modules again (0.18 s of
    a 2-rank job's 0.5 s). A folder that cannot be written is left as it is."""
    root = Path(__file__).resolve().parents[1]
    for folder in ("commlib", "tests", "benchmarks", "examples"):
        compileall.compile_dir(str(root / folder), quiet=2, workers=1)


def pytest_collection_modifyitems(config, items):
    reason = gpu.unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason="no GPU: " + reason)
    for item in items:
        # the marker, not the keyword: every test under tests/gpu/ has the
        # folder's name among its keywords, the CPU checks of the GPU tools too
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
