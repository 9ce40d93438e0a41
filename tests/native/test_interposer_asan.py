"""The C paths once more with AddressSanitizer: the preload library, the fake
driver and the clients are built with -fsanitize=address and the ASan runtime
is preloaded first. Any invalid access, overflow or leak fails the run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpunode.node import memcap
from tests.native.conftest import CAP_BYTES
from tests.native.harness import OUT_OF_MEMORY, interposer_env, run, snippet
from tests.native.test_interposer_faults import flip_limit_byte
from tests.native.toolchain import NativeBuild

SCENARIOS = [
    pytest.param(("direct", "cap", CAP_BYTES), id="cap-linked"),
    pytest.param(("dlopen", "cap", CAP_BYTES), id="cap-dlopen"),
    pytest.param(("procaddr", "cap", CAP_BYTES), id="cap-getprocaddress"),
    pytest.param(("direct", "kinds", CAP_BYTES), id="kinds-linked"),
    pytest.param(("procaddr-ptds", "kinds", CAP_BYTES), id="kinds-per-thread-stream"),
    pytest.param(("procaddr-v1", "kinds", CAP_BYTES), id="kinds-cuda11.3-form"),
    pytest.param(("direct", "pitch", CAP_BYTES, 2048), id="pitch-settle"),
    pytest.param(("direct", "dlsym"), id="dlsym"),
    pytest.param(("direct", "fork", CAP_BYTES), id="fork"),
    pytest.param(("direct", "stress", 8, 3000, 5, CAP_BYTES, 16 << 20), id="stress"),
]


def assert_clean(result_stdout: str, result_stderr: str, returncode: int) -> None:
    assert "AddressSanitizer" not in result_stderr, result_stderr
    assert "LeakSanitizer" not in result_stderr, result_stderr
    assert returncode == 0, result_stdout + result_stderr


def test_the_sanitized_library_is_instrumented(asan_build: tuple[NativeBuild, Path]) -> None:
    build, _ = asan_build
    nm = subprocess.run(["nm", "-D", str(build.preload)], capture_output=True, text=True, check=True).stdout
    assert "__asan_init" in nm or "__asan_report_load8" in nm


@pytest.mark.parametrize("argv", SCENARIOS)
def test_scenario_under_address_sanitizer(
    asan_build: tuple[NativeBuild, Path], region: memcap.Region, argv: tuple[object, ...]
) -> None:
    build, runtime = asan_build
    mode, *rest = argv
    extra = {"FAKE_CUDA_PITCH_ALIGN": str(rest[2])} if rest[0] == "pitch" else {}
    result = run(
        snippet(build, str(mode), *rest, linked=mode == "direct"),
        interposer_env(build, region.path, asan_runtime=runtime, extra=extra),
        timeout_s=240,
    )
    assert_clean(result.stdout, result.stderr, result.returncode)
    assert result.stdout.startswith("ok")
    assert memcap.read_usage(region).used_bytes == 0


def test_fail_closed_path_under_address_sanitizer(
    asan_build: tuple[NativeBuild, Path], region: memcap.Region
) -> None:
    build, runtime = asan_build
    flip_limit_byte(region)
    result = run(
        snippet(build, "direct", "expect", OUT_OF_MEMORY, 1 << 20),
        interposer_env(build, region.path, asan_runtime=runtime),
    )
    assert_clean(result.stdout, result.stderr, result.returncode)
    assert any("checksum" in line for line in result.log_lines)
