"""Shared pytest configuration.

``@pytest.mark.gpu`` tests need cupy and a CUDA device; on a machine without
them they are skipped with the reason, never counted as passed.
"""
import pytest

from commlib import gpu


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs cupy and a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    reason = gpu.unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason="no GPU: " + reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
