"""Running programs under the interposer against the fake driver, for the tests.

Each run gets a minimal environment: the fake driver on LD_LIBRARY_PATH, the
preload library (or none), the region, and the fake's device size. Helpers
here only start processes and read what they print; assertions stay in the
tests.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.native.toolchain import NativeBuild

GIB = 1 << 30
MIB = 1 << 20
FAKE_TOTAL_BYTES = 16 * GIB
OUT_OF_MEMORY = 2
LOG_PREFIX = "[gpunode-memcap]"


def fake_uuid(device: int) -> str:
    """The fake driver's default UUID of a device (fa ce 00 .. 00 <device>)."""
    return f"GPU-face0000-0000-0000-0000-0000000000{device:02x}"


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def log_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith(LOG_PREFIX)]


def interposer_env(
    build: NativeBuild,
    region: Path | str | None,
    *,
    preload: bool = True,
    asan_runtime: Path | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    env = build.env(FAKE_CUDA_TOTAL_BYTES=str(FAKE_TOTAL_BYTES), GPUNODE_MEMCAP_LOG_LEVEL="warn")
    if region is not None:
        env["GPUNODE_MEMCAP_REGION"] = str(region)
    if preload:
        libs = [str(build.preload)]
        if asan_runtime is not None:
            libs.insert(0, str(asan_runtime))  # the ASan runtime must come first
            env["ASAN_OPTIONS"] = "detect_leaks=1:halt_on_error=1:abort_on_error=0"
        env["LD_PRELOAD"] = " ".join(libs)
    if extra:
        env.update(extra)
    return env


def run(argv: Sequence[str | os.PathLike[str]], env: Mapping[str, str], timeout_s: float = 60.0) -> Run:
    proc = subprocess.run(
        [os.fspath(a) for a in argv],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def snippet(build: NativeBuild, mode: str, *args: object, linked: bool | None = None) -> list[str]:
    """argv of the C client: the linked build for direct mode, the dlopen build otherwise."""
    use_linked = mode == "direct" if linked is None else linked
    program = build.snippet_linked if use_linked else build.snippet_dlopen
    return [str(program), mode, *(str(a) for a in args)]


def python_client(script: Path, *args: object) -> list[str]:
    return [sys.executable, str(script), *(str(a) for a in args)]


def fake_state_peak(state_file: Path, device: int = 0) -> int:
    """The fake driver's peak bytes in use on a device (node-wide), from its state file."""
    data = state_file.read_bytes()
    offset = 8 * 8 + 8 * device  # after used[8]
    return int(struct.unpack_from("<Q", data, offset)[0])


def fake_state_used(state_file: Path, device: int = 0) -> int:
    return int(struct.unpack_from("<Q", state_file.read_bytes(), 8 * device)[0])
