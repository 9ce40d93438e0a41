"""The cap holds on every path a program can take to the driver: linked calls,
dlopen + dlsym, cuGetProcAddress (CUDA 12 and 11.3 forms, per-thread stream
variants), Python ctypes and NVML; every allocator kind is accounted exactly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode.node import memcap
from tests.native.conftest import CAP_BYTES
from tests.native.harness import (
    FAKE_TOTAL_BYTES,
    OUT_OF_MEMORY,
    fake_uuid,
    interposer_env,
    python_client,
    run,
    snippet,
)
from tests.native.toolchain import SRC_HOOKS, NativeBuild

HERE = Path(__file__).parent

# (mode, linked build?) for every way the C client reaches the driver.
ACCESS_PATHS = [
    pytest.param("direct", True, id="linked"),
    pytest.param("dlopen", False, id="dlopen-dlsym"),
    pytest.param("procaddr", False, id="getprocaddress-dlopened"),
    pytest.param("procaddr", True, id="getprocaddress-linked"),
    pytest.param("procaddr-ptds", False, id="getprocaddress-per-thread-stream"),
    pytest.param("procaddr-v1", False, id="getprocaddress-cuda11.3-form"),
]


@pytest.mark.parametrize(("mode", "linked"), ACCESS_PATHS)
def test_cap_holds_and_memory_info_reports_it(
    native_build: NativeBuild, region: memcap.Region, mode: str, linked: bool
) -> None:
    result = run(
        snippet(native_build, mode, "cap", CAP_BYTES, linked=linked),
        interposer_env(native_build, region.path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok cap")
    usage = memcap.read_usage(region)
    assert usage.used_bytes == 0
    assert [p.alive for p in usage.per_process] == [False]  # the client exited; its slot awaits reclaim


@pytest.mark.parametrize(("mode", "linked"), ACCESS_PATHS)
def test_every_allocator_kind_is_accounted(
    native_build: NativeBuild, region: memcap.Region, mode: str, linked: bool
) -> None:
    result = run(
        snippet(native_build, mode, "kinds", CAP_BYTES, linked=linked),
        interposer_env(native_build, region.path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert memcap.read_usage(region).used_bytes == 0


def test_without_the_preload_the_same_client_passes_the_cap(
    native_build: NativeBuild, region: memcap.Region
) -> None:
    """The control: the scenarios above fail when nothing enforces the cap."""
    result = run(
        snippet(native_build, "direct", "cap", CAP_BYTES),
        interposer_env(native_build, region.path, preload=False),
    )
    assert result.returncode == 1
    assert f"cuMemGetInfo total: {FAKE_TOTAL_BYTES} != {CAP_BYTES}" in result.stdout


@pytest.mark.parametrize("align", [512, 1024, 2048, 4096], ids=lambda a: f"pitch-align-{a}")
def test_pitched_allocation_settles_on_the_drivers_pitch(
    native_build: NativeBuild, region: memcap.Region, align: int
) -> None:
    env = interposer_env(native_build, region.path, extra={"FAKE_CUDA_PITCH_ALIGN": str(align)})
    result = run(snippet(native_build, "direct", "pitch", CAP_BYTES, align), env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"ok pitch {max(align, 1024)}"


@pytest.mark.parametrize("linked", [True, False], ids=["linked", "dlopen"])
def test_dlsym_next_and_default_keep_glibc_semantics(
    native_build: NativeBuild, region: memcap.Region, linked: bool
) -> None:
    result = run(
        snippet(native_build, "direct" if linked else "dlopen", "dlsym"),
        interposer_env(native_build, region.path),
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("scenario", ["cap", "procaddr"], ids=["ctypes-dlsym", "ctypes-getprocaddress"])
def test_python_ctypes_client_is_capped(
    native_build: NativeBuild, region: memcap.Region, scenario: str
) -> None:
    result = run(
        python_client(HERE / "ctypes_client.py", scenario, CAP_BYTES),
        interposer_env(native_build, region.path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"ok {scenario}"


def test_nvml_memory_info_shows_the_cap_and_the_containers_usage(
    native_build: NativeBuild, region: memcap.Region
) -> None:
    result = run(
        python_client(HERE / "ctypes_client.py", "nvml", CAP_BYTES), interposer_env(native_build, region.path)
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_nvml_of_a_gpu_outside_the_region_is_untouched(native_build: NativeBuild, regions: Path) -> None:
    other = memcap.create_region(
        regions, "other", gpu_uuid=fake_uuid(5), limit_bytes=CAP_BYTES, device_total_bytes=FAKE_TOTAL_BYTES
    )
    code = (
        "import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0);"
        "print(pynvml.nvmlDeviceGetMemoryInfo(h).total)"
    )
    result = run([sys.executable, "-c", code], interposer_env(native_build, other.path))
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == FAKE_TOTAL_BYTES


def test_limit_above_the_real_device_reports_the_device(native_build: NativeBuild, regions: Path) -> None:
    """The agent clamps to what it was told; the library also clamps to what the driver says."""
    big = memcap.create_region(
        regions,
        "big",
        gpu_uuid=fake_uuid(0),
        limit_bytes=4 * FAKE_TOTAL_BYTES,
        device_total_bytes=4 * FAKE_TOTAL_BYTES,
    )
    result = run(
        snippet(native_build, "direct", "expect", 0, 1 << 20), interposer_env(native_build, big.path)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(rf"total={FAKE_TOTAL_BYTES}\b", result.stdout)


def test_library_links_only_libc_and_exports_only_the_hooks(native_build: NativeBuild) -> None:
    ldd = subprocess.run(
        ["ldd", str(native_build.preload)], capture_output=True, text=True, check=True
    ).stdout
    needed = {line.split()[0] for line in ldd.splitlines() if line.strip()}
    assert needed <= {
        "linux-vdso.so.1",
        "libc.so.6",
        "/lib64/ld-linux-x86-64.so.2",
        "ld-linux-x86-64.so.2",
    }, ldd
    assert "libc.so.6" in needed
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", str(native_build.preload)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if line.strip()}
    hooks = set(re.findall(r"^GN_HOOK\((\w+),", SRC_HOOKS.read_text(), re.MULTILINE))
    assert len(hooks) >= 30
    assert exported == hooks | {"dlsym", "dlvsym", "dlopen", "dlmopen"}


def test_refusal_returns_out_of_memory_constant(native_build: NativeBuild, region: memcap.Region) -> None:
    result = run(
        snippet(native_build, "direct", "expect", OUT_OF_MEMORY, CAP_BYTES + 1),
        interposer_env(native_build, region.path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert any("refused" in line for line in result.log_lines)


def test_installed_library_matches_the_sources(native_build: NativeBuild) -> None:
    """The package's library (built by pip install) exports what a fresh build of native/ does."""

    def exported(path: Path) -> set[str]:
        nm = subprocess.run(
            ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
        )
        return {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}

    assert exported(memcap.preload_library_path()) == exported(native_build.preload)
