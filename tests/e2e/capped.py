"""The image a capped container runs on the real node, and reading what it and the agent report.

The image holds tests/e2e/capprobe.c built against the tests' fake libcuda.so.1 (tests/native), the fake
driver at /lib/x86_64-linux-gnu/libcuda.so.1, and the host's shared libraries the program, the driver
and the interposer need (found with ldd, packed at the same paths). The interposer itself is not in
the image: the kubelet mounts it from Allocate's answer, with the region.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpunode.errors import MemcapError
from gpunode.node.memcap import preload_library_path
from tests.e2e.controlplane import ROOT

CAPPED_IMAGE = "gpunode.local/capprobe:1"
DRIVER_IN_IMAGE = "/lib/x86_64-linux-gnu/libcuda.so.1"
PROBE_IN_IMAGE = "/capprobe"
_LDD_PATH = re.compile(r"(/\S+) \(0x[0-9a-f]+\)$")


def toolchain_missing_reason() -> str | None:
    """Why the capped image cannot be built here, or None."""
    from tests.native.toolchain import build_native

    for tool in (build_native.compiler()[0], "ldd"):
        if shutil.which(tool) is None:
            return f"no {tool} to build the capped-container image (a C compiler and libc6-dev)"
    try:
        preload_library_path()
    except MemcapError as exc:
        return f"no interposer to mount into the capped container: {exc}"
    return None


def _shared_libraries(binary: Path, driver_dir: Path) -> set[str]:
    out = subprocess.run(
        ["ldd", str(binary)],
        capture_output=True,
        text=True,
        check=True,
        env={"LD_LIBRARY_PATH": str(driver_dir), "PATH": "/usr/bin:/bin"},
    ).stdout
    found = set()
    for line in out.splitlines():
        m = _LDD_PATH.search(line.strip())
        if m and not m.group(1).startswith(str(driver_dir)):
            found.add(m.group(1))
    return found


def build_capped_image(workdir: Path) -> Path:
    """Build the program and the fake driver and pack the image; returns the `docker save` tarball."""
    from tests.native.toolchain import build_fake_driver, build_program

    driver_dir = build_fake_driver(workdir / "driver")
    probe = build_program(
        ROOT / "tests" / "e2e" / "capprobe.c", workdir / "capprobe", link_cuda_dir=driver_dir
    )
    libraries = set()
    for binary in (probe, driver_dir / "libcuda.so.1", preload_library_path()):
        libraries |= _shared_libraries(binary, driver_dir)
    pairs = [f"{PROBE_IN_IMAGE}={probe}", f"{DRIVER_IN_IMAGE}={driver_dir / 'libcuda.so.1'}"]
    pairs += [f"{lib}={lib}" for lib in sorted(libraries)]
    tarball = workdir / "capprobe.tar"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "kube" / "mkimage.py"),
            "--files",
            str(tarball),
            CAPPED_IMAGE,
            *pairs,
        ],
        check=True,
        capture_output=True,
    )
    return tarball


@dataclass(frozen=True)
class ProbeReport:
    """The line capprobe prints once the driver API refused an allocation."""

    uuid: str
    allocated: int
    refused_with: int
    total: int


def probe_report(log: str) -> ProbeReport | None:
    """capprobe's report from a container log, or None before it is there."""
    m = re.search(r"uuid=(\S*) allocated=(\d+) refused_with=(-?\d+) info=0 free=\d+ total=(\d+)", log)
    if m is None:
        return None
    return ProbeReport(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))


def container_memory(metrics_url: str, pod: str) -> tuple[float, float] | None:
    """(used, limit) bytes the agent's metrics charge to `pod`'s memory-cap region, or None if not listed."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("pod") == pod and sample.name.startswith("gpunode_container_memory_"):
                found[sample.name] = sample.value
    used = found.get("gpunode_container_memory_used_bytes")
    limit = found.get("gpunode_container_memory_limit_bytes")
    return (used, limit) if used is not None and limit is not None else None
