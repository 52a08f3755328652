"""Fixtures of the cooperative host build (tests/ops/cuda_host_build.py), imported
by the test modules that use them (a conftest.py here would shadow tests/conftest.py
for ``import conftest``)."""
import pytest

import cuda_host_build as chb


@pytest.fixture(scope="module")
def kernels():
    """Every kernel of kernels/ built for the host (cached per session)."""
    return chb.build()


@pytest.fixture
def gpu(kernels, monkeypatch):
    """The host build's stand-in cupy, installed for the test."""
    host = chb.HostCupy(kernels)
    host.install(monkeypatch)
    return host
