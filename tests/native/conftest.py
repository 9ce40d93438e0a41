"""Fixtures for the interposer tests: the native build (once per session) and regions."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.node import memcap
from tests.native.harness import FAKE_TOTAL_BYTES, MIB, fake_uuid
from tests.native.toolchain import NativeBuild, asan_runtime, build_all, build_native

CAP_BYTES = 256 * MIB
ASAN_CFLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")


@pytest.fixture(scope="session")
def native_build(tmp_path_factory: pytest.TempPathFactory) -> NativeBuild:
    """The preload library, fake driver and C clients, built from the working tree."""
    try:
        return build_all(tmp_path_factory.mktemp("memcap-native"))
    except build_native.NativeBuildError as exc:
        pytest.fail(f"the native build failed:\n{exc}")


@pytest.fixture(scope="session")
def asan_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[NativeBuild, Path]:
    """The same, compiled with AddressSanitizer, and the ASan runtime to preload first."""
    runtime = asan_runtime()
    if runtime is None:
        pytest.skip("the C compiler has no AddressSanitizer runtime (libasan.so)")
    try:
        return build_all(tmp_path_factory.mktemp("memcap-asan"), cflags=ASAN_CFLAGS), runtime
    except build_native.NativeBuildError as exc:
        pytest.fail(f"the AddressSanitizer build failed:\n{exc}")


@pytest.fixture
def regions(tmp_path: Path) -> Path:
    return tmp_path / "regions"


@pytest.fixture
def region(regions: Path) -> memcap.Region:
    """A 256 MiB cap on the fake driver's device 0."""
    return memcap.create_region(
        regions, "ctr", gpu_uuid=fake_uuid(0), limit_bytes=CAP_BYTES, device_total_bytes=FAKE_TOTAL_BYTES
    )
