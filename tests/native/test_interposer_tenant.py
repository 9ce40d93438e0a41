"""A tenant cannot switch its cap off or swap it through its own environment.

The library used here is built with its fixed region path moved into a temporary
directory (-DGN_FIXED_REGION_DIR, test builds only), so the fixed-path rules can
be exercised without touching /var/run. Cases that need the agent's read-only bind
mount build it in a private mount namespace (`unshare -m`, root only)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from gpunode.node import memcap
from tests.native.conftest import CAP_BYTES
from tests.native.harness import (
    FAKE_TOTAL_BYTES,
    MIB,
    OUT_OF_MEMORY,
    Run,
    fake_uuid,
    interposer_env,
    run,
    snippet,
)
from tests.native.toolchain import TESTS_NATIVE, NativeBuild, build_native, build_program

OVER_CAP = CAP_BYTES + 64 * MIB


@dataclasses.dataclass(frozen=True)
class Fixed:
    build: NativeBuild  # the library with the moved fixed path
    root: Path  # the directory that holds the fixed path (a tmpfs in the namespace cases)
    dir: Path  # the fixed region directory itself
    rpath_snippet: Path  # the linked snippet, finding the fake driver without LD_LIBRARY_PATH


@pytest.fixture(scope="module")
def fixed(native_build: NativeBuild, tmp_path_factory: pytest.TempPathFactory) -> Fixed:
    root = tmp_path_factory.mktemp("fixed-root")
    fixed_dir = root / "memcap"
    out = tmp_path_factory.mktemp("fixed-build")
    lib = build_native.build_preload(
        out / build_native.LIBRARY_NAME, extra_cflags=(f'-DGN_FIXED_REGION_DIR="{fixed_dir}"',)
    )
    program = build_program(
        TESTS_NATIVE / "snippet.c",
        out / "snippet_rpath",
        link_cuda_dir=native_build.driver_dir,
        cflags=(f"-Wl,-rpath,{native_build.driver_dir}",),
    )
    return Fixed(dataclasses.replace(native_build, preload=lib), root, fixed_dir, program)


@pytest.fixture
def clean_fixed(fixed: Fixed) -> Iterator[Fixed]:
    shutil.rmtree(fixed.dir, ignore_errors=True)
    yield fixed
    shutil.rmtree(fixed.dir, ignore_errors=True)


def _region(root: Path, key: str, limit: int, *, fail_open: bool = False) -> memcap.Region:
    return memcap.create_region(
        root,
        key,
        gpu_uuid=fake_uuid(0),
        limit_bytes=limit,
        device_total_bytes=FAKE_TOTAL_BYTES,
        fail_open=fail_open,
    )


def _expect(build: NativeBuild, code: int, nbytes: int, region: Path | None, **extra: str) -> Run:
    result = run(snippet(build, "direct", "expect", code, nbytes), interposer_env(build, region, extra=extra))
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _namespaces_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make a read-only bind mount in a private mount namespace"
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"unshare -m is not permitted here: {probe.stderr.strip()}"


def _mounted(
    fixed: Fixed, agent: memcap.Region, argv: Sequence[object], env: dict[str, str], setup: str = ""
) -> Run:
    """argv in a private mount namespace where the agent's region is bind-mounted at the fixed path."""
    reason = _namespaces_usable()
    if reason:
        pytest.skip(reason)
    d = shlex.quote(str(fixed.dir))
    script = "; ".join(
        [
            "set -e",
            f"mount -t tmpfs gpunode-test {shlex.quote(str(fixed.root))}",
            f"mkdir {d}",
            f"touch {d}/limit {d}/usage",
            f"mount --bind -o ro {shlex.quote(str(agent.limit_path))} {d}/limit",
            f"mount --bind {shlex.quote(str(agent.usage_path))} {d}/usage",
            *([setup] if setup else []),
            'exec "$@"',
        ]
    )
    return run(["unshare", "-m", "sh", "-c", script, "sh", *map(str, argv)], env)


def test_fail_open_environment_variable_cannot_open_a_missing_region(
    clean_fixed: Fixed, tmp_path: Path
) -> None:
    for flag in ("1", "true", "yes"):
        result = _expect(
            clean_fixed.build, OUT_OF_MEMORY, 1 * MIB, tmp_path / "nowhere", GPUNODE_MEMCAP_FAIL_OPEN=flag
        )
        assert any("fail-closed" in line for line in result.log_lines), result.log_lines


def test_forged_region_at_the_fixed_path_is_refused(clean_fixed: Fixed, tmp_path: Path) -> None:
    """The tenant writes a valid-looking region (correct checksum, whole GPU, fail-open) where the
    agent's mount would be: not a read-only mount, so it is refused, and the environment cannot
    point elsewhere either."""
    forged = _region(clean_fixed.root, "memcap", FAKE_TOTAL_BYTES, fail_open=True)
    assert forged.path == clean_fixed.dir
    elsewhere = _region(tmp_path, "other", FAKE_TOTAL_BYTES, fail_open=True)
    for region in (None, elsewhere.path):
        result = _expect(clean_fixed.build, OUT_OF_MEMORY, 1 * MIB, region)
        refused = [line for line in result.log_lines if "is refused" in line]
        assert len(refused) == 1 and "not on a read-only mount" in refused[0], result.log_lines
    forged.usage_path.unlink()  # with no usage file, the forged fail-open flag would open it: it must not
    _expect(clean_fixed.build, OUT_OF_MEMORY, 1 * MIB, None)


def test_dangling_link_at_the_fixed_path_fails_closed(clean_fixed: Fixed, tmp_path: Path) -> None:
    """Anything at the fixed path disables the environment variable: a tenant cannot fall back to it."""
    clean_fixed.dir.mkdir()
    (clean_fixed.dir / "limit").symlink_to(tmp_path / "missing")
    decoy = _region(tmp_path, "decoy", FAKE_TOTAL_BYTES)
    _expect(clean_fixed.build, OUT_OF_MEMORY, 1 * MIB, decoy.path)


def test_environment_region_is_used_where_nothing_is_mounted(
    clean_fixed: Fixed, region: memcap.Region
) -> None:
    """Hosts, tests and development: no fixed region, so GPUNODE_MEMCAP_REGION is honoured."""
    _expect(clean_fixed.build, 0, CAP_BYTES, region.path)
    _expect(clean_fixed.build, OUT_OF_MEMORY, OVER_CAP, region.path)


def test_agent_region_holds_against_a_forged_environment_region(
    clean_fixed: Fixed, region: memcap.Region, tmp_path: Path
) -> None:
    forged = _region(tmp_path, "forged", FAKE_TOTAL_BYTES, fail_open=True)
    env = interposer_env(
        clean_fixed.build,
        forged.path,
        extra={"GPUNODE_MEMCAP_LOG_LEVEL": "info", "GPUNODE_MEMCAP_FAIL_OPEN": "1"},
    )
    result = _mounted(clean_fixed, region, snippet(clean_fixed.build, "direct", "cap", CAP_BYTES), env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok cap")
    assert any(f"ignoring GPUNODE_MEMCAP_REGION={forged.path}" in line for line in result.log_lines)
    over = _mounted(
        clean_fixed, region, snippet(clean_fixed.build, "direct", "expect", OUT_OF_MEMORY, OVER_CAP), env
    )
    assert over.returncode == 0, over.stdout + over.stderr


def test_cleared_environment_under_ld_so_preload_still_finds_the_region(
    clean_fixed: Fixed, region: memcap.Region, tmp_path: Path
) -> None:
    """/etc/ld.so.preload names the library; `env -i` leaves no LD_PRELOAD, no region variable."""
    work = tmp_path / "etc-overlay"
    (work / "up").mkdir(parents=True)
    (work / "work").mkdir()
    lib = shlex.quote(str(clean_fixed.build.preload))
    setup = (
        f"mount -t overlay gpunode-etc -o lowerdir=/etc,upperdir={work}/up,workdir={work}/work /etc "
        f"|| {{ echo 'overlay mounts are not permitted here' >&2; exit 77; }}; echo {lib} > /etc/ld.so.preload"
    )
    argv = ["env", "-i", clean_fixed.rpath_snippet, "direct", "cap", CAP_BYTES]
    result = _mounted(clean_fixed, region, argv, clean_fixed.build.env(), setup)
    if result.returncode == 77:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok cap")
