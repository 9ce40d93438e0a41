"""Bad regions never crash the application and never run it unbounded unless
told to: a corrupt, wrong-version, mismatched or missing region fails closed
(allocations refused, one log line), and fail-open works where the limit file says so."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.node import memcap
from tests.native.conftest import CAP_BYTES
from tests.native.harness import (
    FAKE_TOTAL_BYTES,
    LOG_PREFIX,
    MIB,
    OUT_OF_MEMORY,
    fake_uuid,
    interposer_env,
    run,
    snippet,
)
from tests.native.toolchain import NativeBuild

OVER_CAP = CAP_BYTES + 64 * MIB


def _patch(path: Path, offset: int, data: bytes) -> None:
    path.chmod(0o644)
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)


def flip_limit_byte(region: memcap.Region) -> None:
    limit = region.limit_path.read_bytes()
    _patch(region.limit_path, 100, bytes([limit[100] ^ 0x55]))  # inside device 0's UUID


def raise_limit_without_resealing(region: memcap.Region) -> None:
    """What a container would try: raise its own cap. The checksum catches it."""
    offset = 32 + 96  # header, then device 0's uuid, then limit_bytes
    _patch(region.limit_path, offset, struct.pack("<Q", FAKE_TOTAL_BYTES))


def wrong_limit_version(region: memcap.Region) -> None:
    _patch(region.limit_path, 8, struct.pack("<I", 99))


def wrong_usage_version(region: memcap.Region) -> None:
    _patch(region.usage_path, 8, struct.pack("<I", 99))


def wrong_usage_magic(region: memcap.Region) -> None:
    _patch(region.usage_path, 0, b"NOTUSAGE")


def truncated_usage(region: memcap.Region) -> None:
    os.truncate(region.usage_path, 4096)


def usage_of_another_region(region: memcap.Region) -> None:
    other = memcap.create_region(
        region.path.parent,
        "other",
        gpu_uuid=fake_uuid(0),
        limit_bytes=CAP_BYTES,
        device_total_bytes=FAKE_TOTAL_BYTES,
    )
    region.usage_path.write_bytes(other.usage_path.read_bytes())


def missing_usage(region: memcap.Region) -> None:
    region.usage_path.unlink()


# (damage, what the log line says, whether a fail-open flag in the limit file may apply)
LIMIT_DAMAGE = [
    pytest.param(flip_limit_byte, "checksum", id="limit-corrupt"),
    pytest.param(raise_limit_without_resealing, "checksum", id="limit-raised-by-container"),
    pytest.param(wrong_limit_version, "unsupported layout version", id="limit-wrong-version"),
]
USAGE_DAMAGE = [
    pytest.param(wrong_usage_version, "unsupported layout version", id="usage-wrong-version"),
    pytest.param(wrong_usage_magic, "bad magic", id="usage-bad-magic"),
    pytest.param(truncated_usage, "wrong size", id="usage-truncated"),
    pytest.param(usage_of_another_region, "does not belong", id="usage-of-another-region"),
    pytest.param(missing_usage, "input/output error", id="usage-missing"),
]


def _expect(
    native_build: NativeBuild, region_dir: Path | str, code: int, nbytes: int, **env: str
) -> list[str]:
    result = run(
        snippet(native_build, "direct", "expect", code, nbytes),
        interposer_env(native_build, region_dir, extra=env),
    )
    assert result.returncode == 0, result.stdout + result.stderr  # no crash, the expected answer
    return result.log_lines


@pytest.mark.parametrize(("damage", "message"), LIMIT_DAMAGE + USAGE_DAMAGE)
def test_unusable_region_fails_closed_with_one_log_line(
    native_build: NativeBuild, region: memcap.Region, damage: Callable[[memcap.Region], None], message: str
) -> None:
    damage(region)
    lines = _expect(native_build, region.path, OUT_OF_MEMORY, 1 * MIB)
    errors = [line for line in lines if "unusable" in line]
    assert len(errors) == 1, lines
    assert message in errors[0] and "fail-closed" in errors[0]


@pytest.mark.parametrize(("damage", "message"), USAGE_DAMAGE)
def test_fail_open_flag_in_the_limit_file_passes_through(
    native_build: NativeBuild, regions: Path, damage: Callable[[memcap.Region], None], message: str
) -> None:
    region = memcap.create_region(
        regions,
        "open",
        gpu_uuid=fake_uuid(0),
        limit_bytes=CAP_BYTES,
        device_total_bytes=FAKE_TOTAL_BYTES,
        fail_open=True,
    )
    damage(region)
    lines = _expect(native_build, region.path, 0, OVER_CAP)
    assert any(message in line and "fail-open" in line for line in lines), lines


@pytest.mark.parametrize(("damage", "message"), LIMIT_DAMAGE)
def test_fail_open_flag_of_a_corrupt_limit_file_is_not_trusted(
    native_build: NativeBuild, regions: Path, damage: Callable[[memcap.Region], None], message: str
) -> None:
    region = memcap.create_region(
        regions,
        "open",
        gpu_uuid=fake_uuid(0),
        limit_bytes=CAP_BYTES,
        device_total_bytes=FAKE_TOTAL_BYTES,
        fail_open=True,
    )
    damage(region)
    _expect(native_build, region.path, OUT_OF_MEMORY, 1 * MIB)


@pytest.mark.parametrize(
    ("env", "code", "message"),
    [
        pytest.param({}, OUT_OF_MEMORY, "fail-closed", id="closed-by-default"),
        pytest.param({"GPUNODE_MEMCAP_FAIL_OPEN": "1"}, OUT_OF_MEMORY, "fail-closed", id="env-cannot-open"),
        pytest.param({"GPUNODE_MEMCAP_FAIL_OPEN": "no"}, OUT_OF_MEMORY, "fail-closed", id="env-not-true"),
    ],
)
def test_missing_region(
    native_build: NativeBuild, tmp_path: Path, env: dict[str, str], code: int, message: str
) -> None:
    lines = _expect(native_build, tmp_path / "nowhere", code, OVER_CAP, **env)
    assert len(lines) == 1 and "no memory-cap region" in lines[0] and message in lines[0], lines


def test_fail_open_env_does_not_override_a_present_but_corrupt_region(
    native_build: NativeBuild, region: memcap.Region
) -> None:
    flip_limit_byte(region)
    _expect(native_build, region.path, OUT_OF_MEMORY, 1 * MIB, GPUNODE_MEMCAP_FAIL_OPEN="1")


def test_closed_library_reports_no_free_memory(native_build: NativeBuild, tmp_path: Path) -> None:
    result = run(
        snippet(native_build, "direct", "expect", OUT_OF_MEMORY, 1),
        interposer_env(native_build, tmp_path / "x"),
    )
    assert result.returncode == 0
    assert f"free=0 total={FAKE_TOTAL_BYTES}" in result.stdout


@pytest.mark.parametrize(
    ("level", "expect_info", "expect_warn"),
    [
        pytest.param("debug", True, True, id="debug"),
        pytest.param("info", True, True, id="info"),
        pytest.param("warn", False, True, id="warn"),
        pytest.param("error", False, False, id="error"),
        pytest.param("off", False, False, id="off"),
    ],
)
def test_log_level(
    native_build: NativeBuild, region: memcap.Region, level: str, expect_info: bool, expect_warn: bool
) -> None:
    lines = _expect(native_build, region.path, OUT_OF_MEMORY, OVER_CAP, GPUNODE_MEMCAP_LOG_LEVEL=level)
    assert all(line.startswith(LOG_PREFIX) for line in lines)
    assert any(" info: " in line and "registered" in line for line in lines) == expect_info, lines
    assert any(" warn: " in line and "refused" in line for line in lines) == expect_warn, lines


def test_unknown_log_level_is_reported_and_warn_is_used(
    native_build: NativeBuild, region: memcap.Region
) -> None:
    lines = _expect(native_build, region.path, OUT_OF_MEMORY, OVER_CAP, GPUNODE_MEMCAP_LOG_LEVEL="verbose")
    assert any("GPUNODE_MEMCAP_LOG_LEVEL=verbose is not one of" in line for line in lines), lines
    assert any("refused" in line for line in lines)
