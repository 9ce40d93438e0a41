"""Fixtures for the tests that need a real NVIDIA GPU; every test here is marked `gpu`."""

from __future__ import annotations

import subprocess
import sys
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


def torch_with_cuda() -> bool:
    """Whether this Python's PyTorch sees a CUDA device (asked in a subprocess, so nothing is loaded here)."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False).returncode == 0
