"""Fixtures for the tests that need a real NVIDIA GPU; every test here is marked `gpu`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode.node.devices.nvml.backend import NvmlBackend

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="module")
def nvml() -> Iterator[NvmlBackend]:
    backend = NvmlBackend(probe_timeout_s=10.0)
    yield backend
    backend.close()
