"""Usage across processes: racing processes never pass the cap together, a
killed process's usage comes back (to the agent and to the next process), a
forked child is accounted on its own, and multi-GPU regions cap each GPU."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from gpunode.node import memcap
from tests.native.conftest import CAP_BYTES
from tests.native.harness import (
    FAKE_TOTAL_BYTES,
    MIB,
    fake_state_peak,
    fake_state_used,
    fake_uuid,
    interposer_env,
    run,
    snippet,
)
from tests.native.toolchain import NativeBuild

PROCESSES = 8
THREADS = 16
ITERATIONS = 20_000
MAX_CHUNK = 24 * MIB


def start_holder(native_build: NativeBuild, region: memcap.Region, nbytes: int) -> subprocess.Popen[str]:
    """A client that allocates nbytes, says "ready" and waits to be killed."""
    proc = subprocess.Popen(
        snippet(native_build, "direct", "hold", nbytes),
        env=interposer_env(native_build, region.path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line + (proc.stderr.read() if proc.stderr else "")
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    for stream in (proc.stdout, proc.stderr):
        if stream:
            stream.close()


def test_sigkilled_process_usage_is_reclaimed_by_the_agent(
    native_build: NativeBuild, region: memcap.Region
) -> None:
    holder = start_holder(native_build, region, 100 * MIB)
    live = memcap.read_usage(region)
    assert live.used_bytes == 100 * MIB
    assert [(p.used_bytes, p.alive) for p in live.per_process] == [(100 * MIB, True)]
    assert memcap.reclaim_dead(region) == 0  # a live process keeps its usage
    kill(holder)
    dead = memcap.read_usage(region)
    assert dead.used_bytes == 100 * MIB
    assert [(p.used_bytes, p.alive) for p in dead.per_process] == [(100 * MIB, False)]
    assert memcap.reclaim_dead(region) == 100 * MIB
    after = memcap.read_usage(region)
    assert (after.used_bytes, after.per_process) == (0, ())


def test_sigkilled_process_usage_is_reclaimed_by_the_next_process(
    native_build: NativeBuild, region: memcap.Region
) -> None:
    kill(start_holder(native_build, region, CAP_BYTES))
    assert memcap.read_usage(region).used_bytes == CAP_BYTES
    result = run(
        snippet(native_build, "direct", "expect", 0, CAP_BYTES), interposer_env(native_build, region.path)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert memcap.read_usage(region).used_bytes == 0


def _fd_targets(pid: int) -> dict[int, str]:
    fds = Path(f"/proc/{pid}/fd")
    return {int(fd.name): os.readlink(fd) for fd in fds.iterdir()}


@pytest.mark.parametrize("stdin", ["pipe", "closed"])
def test_the_program_keeps_its_standard_streams(
    native_build: NativeBuild, region: memcap.Region, stdin: str
) -> None:
    """The usage file never takes or closes fd 0-2. A program's stdin once became the usage file: the
    first region open closed fd 0 (a zeroed descriptor), so reading stdin read the region and closing
    it dropped the process's slot lock (its live usage then looked reclaimable)."""
    argv = snippet(native_build, "direct", "hold", 64 * MIB)
    if stdin == "closed":  # started with no stdin: the number must stay free for the program
        argv = ["/bin/sh", "-c", 'exec "$@" 0<&-', "sh", *argv]
    proc = subprocess.Popen(
        argv,
        env=interposer_env(native_build, region.path),
        stdin=subprocess.PIPE if stdin == "pipe" else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", line + (proc.stderr.read() if proc.stderr else "")
        fds = _fd_targets(proc.pid)
        usage = str(region.path / "usage")
        assert [fd for fd, target in fds.items() if target == usage] != []
        assert all(fd > 2 for fd, target in fds.items() if target == usage), fds
        if stdin == "pipe":
            assert fds[0].startswith("pipe:"), fds
        else:
            assert 0 not in fds, fds
        assert fds[1].startswith("pipe:") and fds[2].startswith("pipe:"), fds
        assert memcap.reclaim_dead(region) == 0
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        kill(proc)


def test_a_live_neighbour_is_not_reclaimed(native_build: NativeBuild, region: memcap.Region) -> None:
    holder = start_holder(native_build, region, CAP_BYTES // 2)
    try:
        result = run(
            snippet(native_build, "direct", "expect", 2, CAP_BYTES // 2 + 1),
            interposer_env(native_build, region.path),
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert memcap.read_usage(region).used_bytes == CAP_BYTES // 2
    finally:
        kill(holder)


def test_forked_child_is_accounted_on_its_own_and_reclaimed(
    native_build: NativeBuild, region: memcap.Region
) -> None:
    result = run(
        snippet(native_build, "direct", "fork", CAP_BYTES), interposer_env(native_build, region.path)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert memcap.read_usage(region).used_bytes == 0


class UsageWatcher(threading.Thread):
    """Reads the usage file as the agent's metrics would, while clients run."""

    def __init__(self, region: memcap.Region) -> None:
        super().__init__(daemon=True)
        self.region = region
        self.stop = threading.Event()
        self.samples = 0
        self.max_used = 0
        self.max_holders = 0  # processes holding memory at the same instant

    def run(self) -> None:
        while not self.stop.is_set():
            usage = memcap.read_usage(self.region)
            self.max_used = max(self.max_used, usage.used_bytes)
            self.max_holders = max(
                self.max_holders, sum(1 for p in usage.per_process if p.alive and p.used_bytes)
            )
            self.samples += 1


def test_racing_processes_and_threads_never_pass_the_cap(
    native_build: NativeBuild, region: memcap.Region, tmp_path: Path
) -> None:
    state = tmp_path / "fake-device-state"
    env = interposer_env(native_build, region.path, extra={"FAKE_CUDA_STATE": str(state)})
    watcher = UsageWatcher(region)
    watcher.start()
    procs = [
        subprocess.Popen(
            snippet(native_build, "direct", "stress", THREADS, ITERATIONS, seed, CAP_BYTES, MAX_CHUNK),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(1, PROCESSES + 1)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    watcher.stop.set()
    watcher.join()
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out + err
    counts = [tuple(map(int, re.findall(r"(?:allocs|refused)=(\d+)", out))) for out, _ in outputs]
    assert sum(a for a, _ in counts) > PROCESSES * THREADS  # they did allocate
    assert sum(r for _, r in counts) > 0  # and the cap was reached: the race was real
    assert fake_state_peak(state) <= CAP_BYTES  # the driver never held more than the cap
    assert watcher.samples > 0 and watcher.max_used <= CAP_BYTES
    assert watcher.max_holders >= 2  # processes really overlapped
    usage = memcap.read_usage(region)
    assert usage.used_bytes == 0 and fake_state_used(state) == 0
    assert (
        usage.registrations == PROCESSES
    )  # one slot claim per process (exited ones get reclaimed by later ones)
    assert not any(p.alive or p.used_bytes for p in usage.per_process)


def test_processes_killed_mid_flight_leave_nothing_behind(
    native_build: NativeBuild, region: memcap.Region
) -> None:
    # No shared fake-device state here: a real driver frees a killed process's memory, the fake cannot.
    env = interposer_env(native_build, region.path)
    watcher = UsageWatcher(region)
    procs = [
        subprocess.Popen(
            snippet(native_build, "direct", "stress", 4, 10_000_000, seed, CAP_BYTES, MAX_CHUNK),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for seed in range(4)
    ]
    deadline = time.monotonic() + 60
    while memcap.read_usage(region).registrations < len(procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.start()
    rng = random.Random(7)
    for proc in procs:
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait(timeout=30)
    watcher.stop.set()
    watcher.join()
    assert memcap.read_usage(region).registrations >= len(procs)
    assert watcher.samples > 0 and watcher.max_used <= CAP_BYTES
    memcap.reclaim_dead(region)
    usage = memcap.read_usage(region)
    assert (usage.used_bytes, usage.per_process) == (0, ())


@pytest.mark.parametrize(
    ("mode", "linked"), [("direct", True), ("procaddr", False)], ids=["linked", "getprocaddress"]
)
def test_multi_gpu_region_caps_each_gpu(
    native_build: NativeBuild, regions: Path, mode: str, linked: bool
) -> None:
    region = memcap.create_multi_gpu_region(
        regions,
        "two",
        devices=[
            memcap.DeviceCap(fake_uuid(0), 64 * MIB, FAKE_TOTAL_BYTES),
            memcap.DeviceCap(fake_uuid(1), 128 * MIB, FAKE_TOTAL_BYTES),
        ],
    )
    env = interposer_env(native_build, region.path, extra={"FAKE_CUDA_DEVICES": "2"})
    result = run(snippet(native_build, mode, "multidev", 64 * MIB, 128 * MIB, linked=linked), env)
    assert result.returncode == 0, result.stdout + result.stderr
    usage = memcap.read_usage(region)
    assert [d.used_bytes for d in usage.devices] == [0, 0]


def test_gpu_outside_a_multi_gpu_region_is_refused(native_build: NativeBuild, regions: Path) -> None:
    region = memcap.create_multi_gpu_region(
        regions,
        "elsewhere",
        devices=[
            memcap.DeviceCap(fake_uuid(6), 64 * MIB, FAKE_TOTAL_BYTES),
            memcap.DeviceCap(fake_uuid(7), 64 * MIB, FAKE_TOTAL_BYTES),
        ],
    )
    env = interposer_env(native_build, region.path, extra={"FAKE_CUDA_DEVICES": "2"})
    result = run(snippet(native_build, "direct", "expect", 2, MIB), env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert any("is not one of this region's devices" in line for line in result.log_lines)
