"""Reading the fake device's timeline file (tests/native/fake_timeline.c) and running
compute-share scenarios on it, for the tests and bench/compute_share.py.

The timeline records, per process, the device time it received: the ground truth the
accuracy tests assert on. A scenario starts client processes (compute_client.c) in
one or more containers (one region each, with its share and mode), samples the
ground truth every window, and returns the achieved share of each container per
window. Nothing here asserts; the callers do.
"""

from __future__ import annotations

import os
import struct
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpunode.errors import GpunodeError
from gpunode.node import memcap
from gpunode.node.memcap.compute import ComputeMode, read_compute, set_compute_share
from tests.native.harness import FAKE_TOTAL_BYTES, GIB, fake_uuid, interposer_env
from tests.native.toolchain import NativeBuild, build_program

TESTS_NATIVE = Path(__file__).resolve().parent
HEADER_BYTES = 152  # offsetof(struct tl_shared, procs), asserted in fake_timeline.c
PROCS = 64
EVENTS = 2048
ITEMS = 4096
PROC_BYTES = 40 + 16 * EVENTS + 32 * ITEMS


def build_client(root: Path) -> Path:
    return build_program(TESTS_NATIVE / "compute_client.c", root / "compute_client")


def busy_by_pid(timeline: Path) -> dict[int, int]:
    """Device time (ns) each process on the timeline has received so far."""
    out: dict[int, int] = {}
    with timeline.open("rb") as f:
        data = f.read(HEADER_BYTES + PROCS * PROC_BYTES)
    if len(data) < HEADER_BYTES + PROCS * PROC_BYTES:
        return out
    for i in range(PROCS):
        base = HEADER_BYTES + i * PROC_BYTES
        pid, _reserved, busy = struct.unpack_from("<iiQ", data, base)
        if pid:
            out[pid] = out.get(pid, 0) + busy
    return out


@dataclass
class Container:
    """One container of a scenario: its share (None: no share written), mode and client processes."""

    name: str
    share_milli: int | None
    mode: ComputeMode = ComputeMode.HARD
    processes: int = 1
    kernel_us: int = 1000
    per_sync: int = 1
    kind: str = "kernel"
    lookup: str = "dlsym"
    preload: bool = True
    region: memcap.Region | None = None
    procs: list[subprocess.Popen[str]] = field(default_factory=list)


@dataclass(frozen=True)
class Windows:
    """Achieved share (fraction of the device) per container per window, the device's own, and the
    seconds each container's launches were held back in each window (from its region)."""

    seconds: float
    per_container: dict[str, list[float]]
    device: list[float]
    throttled_s: dict[str, list[float]] = field(default_factory=dict)


def start(build: NativeBuild, client: Path, root: Path, timeline: Path, containers: Sequence[Container],
          extra_env: Mapping[str, str] | None = None) -> None:  # fmt: skip
    """Create each container's region, write its share and start its processes (each says "ready")."""
    for c in containers:
        c.region = memcap.create_region(
            root / "regions",
            c.name,
            gpu_uuid=fake_uuid(0),
            limit_bytes=4 * GIB,
            device_total_bytes=FAKE_TOTAL_BYTES,
        )
        if c.share_milli is not None:
            set_compute_share(c.region, c.share_milli, c.mode)
        env = interposer_env(
            build, c.region.path, preload=c.preload, extra={"FAKE_CUDA_TIMELINE": str(timeline)}
        )
        if extra_env:
            env.update(extra_env)
        for _ in range(c.processes):
            argv = [str(client), c.lookup, c.kind, str(c.kernel_us), str(c.per_sync), "0"]
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            c.procs.append(proc)
    for c in containers:
        for proc in c.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                err = proc.stderr.read() if proc.stderr else ""
                raise RuntimeError(f"client of {c.name} did not start: {line!r} {err}")


def stop(containers: Sequence[Container]) -> None:
    for c in containers:
        for proc in c.procs:
            proc.kill()
        for proc in c.procs:
            proc.wait(timeout=30)
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()
        c.procs.clear()


def sample(timeline: Path, containers: Sequence[Container]) -> tuple[float, dict[str, int]]:
    busy = busy_by_pid(timeline)
    return time.monotonic(), {c.name: sum(busy.get(p.pid, 0) for p in c.procs) for c in containers}


def throttled(containers: Sequence[Container]) -> dict[str, int]:
    """Each container's held-back time so far (ns), as its region says (0 where it cannot be read)."""
    out: dict[str, int] = {}
    for c in containers:
        try:
            out[c.name] = read_compute(c.region).throttled_ns if c.region is not None else 0
        except GpunodeError:
            out[c.name] = 0
    return out


def measure(timeline: Path, containers: Sequence[Container], window_s: float, windows: int) -> Windows:
    """Achieved share of each container in `windows` consecutive windows of window_s seconds."""
    per: dict[str, list[float]] = {c.name: [] for c in containers}
    held: dict[str, list[float]] = {c.name: [] for c in containers}
    device: list[float] = []
    t0, b0 = sample(timeline, containers)
    h0 = throttled(containers)
    for _ in range(windows):
        time.sleep(window_s)
        t1, b1 = sample(timeline, containers)
        h1 = throttled(containers)
        wall = (t1 - t0) * 1e9
        total = 0.0
        for c in containers:
            share = (b1[c.name] - b0[c.name]) / wall
            per[c.name].append(share)
            held[c.name].append(max(0, h1[c.name] - h0[c.name]) / 1e9)
            total += share
        device.append(total)
        t0, b0, h0 = t1, b1, h1
    return Windows(window_s, per, device, held)


def set_share(container: Container, share_milli: int, mode: ComputeMode | None = None) -> None:
    assert container.region is not None
    container.share_milli = share_milli
    if mode is not None:
        container.mode = mode
    set_compute_share(container.region, share_milli, container.mode)


def environ_without_preload() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
