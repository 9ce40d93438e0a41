from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.kubelet import KubeletStandIn, short_socket_dir


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory for Unix sockets (paths must stay under 108 bytes)."""
    d = short_socket_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(sockdir: Path) -> Iterator[KubeletStandIn]:
    with KubeletStandIn(sockdir / "device-plugins") as k:
        yield k


pytest_plugins = ["tests.native.conftest"]
