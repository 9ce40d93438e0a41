"""The compute share on the fake device: containers of client processes contend for one
timeline (tests/native/fake_timeline.c, which records each process's device time as
ground truth), and the achieved share of each container must hold to its target in
every window after warm-up. Windows here are 1 s after a 1.5 s warm-up to keep the
suite short; bench/compute_share.py runs the same scenarios with 10 s windows.

Tolerance: 5 percentage points, the issue's target. A client that synchronises after
every kernel cannot keep the device busy while it is between launches (on a loaded
machine its host-side gaps alone cost several points), so containers whose share is
large submit 32 kernels per synchronisation, and half shares 4 (the scenario says
so). One kernel per synchronisation is covered by the 20 ms kernels of 10/90 and by
30 alone; bench/compute_share.py also runs 50/50 with one 1 ms kernel per sync.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpunode.node import memcap
from gpunode.node.memcap.compute import ComputeMode, ShareWatch, read_compute, set_compute_share
from tests.native import fake_timeline as ft
from tests.native.fake_timeline import Container
from tests.native.harness import FAKE_TOTAL_BYTES, GIB, fake_uuid, interposer_env, run
from tests.native.toolchain import NativeBuild

HARD = ComputeMode.HARD
WORK_CONSERVING = ComputeMode.WORK_CONSERVING
TOLERANCE = 0.05
WARM_UP_S = 1.5
WINDOW_S = 1.0
WINDOWS = 3
HELD_WHEN_SHORT = 0.02


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ft.build_client(tmp_path_factory.mktemp("compute-client"))


def run_scenario(
    native_build: NativeBuild,
    client: Path,
    tmp_path: Path,
    containers: Sequence[Container],
    windows: int = WINDOWS,
) -> ft.Windows:
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, containers)
    try:
        time.sleep(WARM_UP_S)
        return ft.measure(timeline, containers, WINDOW_S, windows)
    finally:
        ft.stop(containers)


def assert_shares(result: ft.Windows, targets: dict[str, float]) -> None:
    """Every window within the tolerance of the target; or below it while the container's launches were
    not held back (at most HELD_WHEN_SHORT of the window): the shortfall was then its own demand (a client
    between its launches on a loaded machine), not the enforcement."""
    for name, target in targets.items():
        achieved = result.per_container[name]
        held = result.throttled_s.get(name, [0.0] * len(achieved))
        for a, h in zip(achieved, held, strict=True):
            said = f"{name}: target {target:.0%}, achieved {[f'{x:.1%}' for x in achieved]}, held {held}"
            assert a <= target + TOLERANCE, said
            assert a >= target - TOLERANCE or h <= HELD_WHEN_SHORT * result.seconds, said


@pytest.mark.parametrize(
    "containers",
    [
        pytest.param([Container("a", 500, per_sync=4), Container("b", 500, per_sync=4)], id="50/50-1ms"),
        pytest.param(
            [
                Container("a", 700, per_sync=32),
                Container("b", 250, per_sync=8),
                Container("c", 50, per_sync=8),
            ],
            id="70/25/5-1ms",
        ),
        pytest.param(
            [Container("a", 100, kernel_us=50, per_sync=500), Container("b", 900, kernel_us=20000)],
            id="10/90-50us-x500-vs-20ms",
        ),
        pytest.param([Container("a", 300)], id="30-alone"),
        pytest.param(
            [Container("a", 400, processes=3, per_sync=2), Container("b", 600, per_sync=32)],
            id="40(3-processes)/60",
        ),
    ],
)
def test_hard_shares_hold_in_every_window(
    native_build: NativeBuild, client: Path, tmp_path: Path, containers: list[Container]
) -> None:
    result = run_scenario(native_build, client, tmp_path, containers)
    assert_shares(result, {c.name: c.share_milli / 1000 for c in containers if c.share_milli})


@pytest.mark.parametrize(
    ("lookup", "kind"),
    [
        ("dlsym", "kernel"),
        ("procaddr", "kernel-ex"),
        ("procaddr-ptds", "kernel"),
        ("procaddr-ptds", "cooperative"),
        ("dlsym", "graph"),
        ("procaddr-ptds", "graph"),
    ],
)
def test_every_launch_path_is_held_to_the_share(
    native_build: NativeBuild, client: Path, tmp_path: Path, lookup: str, kind: str
) -> None:
    container = Container("a", 250, lookup=lookup, kind=kind, per_sync=4)
    result = run_scenario(native_build, client, tmp_path, [container], windows=2)
    assert_shares(result, {"a": 0.25})


def test_threads_launching_at_once_draw_on_one_budget(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    container = Container("a", 350, per_sync=4)
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, [container], extra_env={"COMPUTE_CLIENT_THREADS": "6"})
    try:
        time.sleep(WARM_UP_S)
        result = ft.measure(timeline, [container], WINDOW_S, 2)
    finally:
        ft.stop([container])
    assert_shares(result, {"a": 0.35})


def test_unthrottled_without_a_share_and_counted(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    """No share written: launches pass at full speed, and the region still shows the GPU time."""
    container = Container("a", None, per_sync=8)
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, [container])
    try:
        time.sleep(WARM_UP_S)
        result = ft.measure(timeline, [container], WINDOW_S, 2)
        assert container.region is not None
        report = read_compute(container.region)
        truth = ft.busy_by_pid(timeline)[container.procs[0].pid]
    finally:
        ft.stop([container])
    assert min(result.per_container["a"]) > 0.8
    assert report.throttled_ns == 0
    assert report.launches > 0
    # The region's GPU time trails the device's by what is in flight (a few ms).
    assert abs(report.busy_ns - truth) < 0.05 * truth


def test_launches_into_a_capturing_stream_are_not_charged(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    """Work captured into a graph does not run then: charging it would throttle for nothing."""
    container = Container("a", 100, per_sync=4)
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, [container], extra_env={"FAKE_CUDA_CAPTURING": "1"})
    try:
        time.sleep(WARM_UP_S)
        assert container.region is not None
        report = read_compute(container.region)
    finally:
        ft.stop([container])
    assert (report.launches, report.busy_ns, report.throttled_ns) == (0, 0, 0)


def test_share_changed_by_the_agent_applies_within_a_second(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    container = Container("a", 200, per_sync=4)
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, [container])
    try:
        time.sleep(WARM_UP_S)
        before = ft.measure(timeline, [container], WINDOW_S, 1)
        ft.set_share(container, 600)
        time.sleep(1.0)  # the change must be in force by now
        after = ft.measure(timeline, [container], WINDOW_S, 2)
    finally:
        ft.stop([container])
    assert_shares(before, {"a": 0.2})
    assert_shares(after, {"a": 0.6})


def test_work_conserving_uses_idle_time_and_yields_to_a_hard_neighbour(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    alone = [Container("a", 300, mode=WORK_CONSERVING, per_sync=8)]
    result = run_scenario(native_build, client, tmp_path / "alone", alone, windows=2)
    assert min(result.per_container["a"]) > 0.3 + TOLERANCE  # above its share: the GPU is idle otherwise
    pair = [Container("a", 300, mode=WORK_CONSERVING), Container("b", 700, per_sync=32)]
    result = run_scenario(native_build, client, tmp_path / "pair", pair)
    assert_shares(result, {"b": 0.7})
    assert min(result.device) >= 1.0 - TOLERANCE


def test_work_conserving_gives_back_within_a_second_when_a_neighbour_arrives(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    borrower = Container("a", 300, mode=WORK_CONSERVING, per_sync=8)
    neighbour = Container("b", 700, per_sync=32)
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, [borrower])
    try:
        time.sleep(WARM_UP_S)
        alone = ft.measure(timeline, [borrower], WINDOW_S, 1)
        ft.start(native_build, client, tmp_path, timeline, [neighbour])
        time.sleep(1.0)  # the borrower must be back at its share by now
        shared = ft.measure(timeline, [borrower, neighbour], WINDOW_S, 2)
    finally:
        ft.stop([borrower, neighbour])
    assert alone.per_container["a"][0] > 0.3 + TOLERANCE
    assert_shares(shared, {"b": 0.7})


def test_work_conserving_pair_keeps_the_device_busy(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    pair = [Container("a", 300, mode=WORK_CONSERVING, per_sync=4), Container("b", 300, per_sync=4)]
    result = run_scenario(native_build, client, tmp_path, pair)
    assert_shares(result, {"b": 0.3})
    assert min(result.device) >= 0.6 - TOLERANCE  # at least min(1, sum of targets) minus 5 points


# ---- attacks: a tenant that writes its region, or runs work the hooks never see ----

COMPUTE_OFFSET = 64 + 64 + 128 * 256  # struct gpunode_compute in the usage file (gpunode_memcap.h)
BUDGET_OFFSET = COMPUTE_OFFSET + 8
BUSY_OFFSET = COMPUTE_OFFSET + 24

SCRIBBLER = f"""
import mmap, os, struct, sys, time
path, what = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 0)

def control(share, mode, generation):  # a well-formed word (gpunode_compute_pack): the layout is public
    x = ((share | mode << 16 | generation << 32) * 0x9E3779B97F4A7C15) % (1 << 64)
    return share | mode << 16 | (((x >> 56) ^ 0xA5) & 0xFF) << 24 | generation << 32

end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    if what == "budget":
        m[{BUDGET_OFFSET}:{BUDGET_OFFSET + 8}] = struct.pack("<q", 1 << 62)
    elif what == "counters":
        m[{BUSY_OFFSET}:{BUSY_OFFSET + 24}] = bytes(24)
    elif what == "control":
        m[{COMPUTE_OFFSET}:{COMPUTE_OFFSET + 8}] = struct.pack("<Q", control(1000, 0, 77))
    time.sleep(0.0005)
"""


def scribble(region_usage: Path, what: str, seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", SCRIBBLER, str(region_usage), what, str(seconds)])


@pytest.mark.parametrize("what", ["budget", "control"])
def test_tenant_writing_its_budget_or_share_is_held_or_flagged(
    native_build: NativeBuild, client: Path, tmp_path: Path, what: str
) -> None:
    """The tenant keeps writing a huge budget (or a share of the whole GPU) into its region while
    its launches run; the neighbour with a hard 70% share keeps it, or the agent's cross-check
    against the driver's per-process figures flags the tenant."""
    tenant = Container("tenant", 300, per_sync=8)
    neighbour = Container("neighbour", 700, per_sync=32)
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, [tenant, neighbour])
    assert tenant.region is not None
    attacker = scribble(tenant.region.usage_path, what, WARM_UP_S + 3 * WINDOW_S + 1)
    try:
        time.sleep(WARM_UP_S)
        result = ft.measure(timeline, [tenant, neighbour], WINDOW_S, 3)
    finally:
        attacker.kill()
        attacker.wait()
        ft.stop([tenant, neighbour])
    watch = ShareWatch(300, HARD, flag_after_s=2.0)
    for share in result.per_container["tenant"]:
        watch.observe(WINDOW_S, int(share * WINDOW_S * 1e9), 0)
    neighbour_held = min(result.per_container["neighbour"]) >= 0.7 - TOLERANCE
    assert neighbour_held or watch.flagged, result.per_container


def test_tenant_zeroing_its_counters_is_flagged(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    tenant = Container("tenant", 300, per_sync=4)
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, [tenant])
    assert tenant.region is not None
    attacker = scribble(tenant.region.usage_path, "counters", 10)
    try:
        time.sleep(WARM_UP_S)
        r0, (t0, b0) = read_compute(tenant.region).busy_ns, ft.sample(timeline, [tenant])
        time.sleep(2 * WINDOW_S)
        r1, (t1, b1) = read_compute(tenant.region).busy_ns, ft.sample(timeline, [tenant])
    finally:
        attacker.kill()
        attacker.wait()
        ft.stop([tenant])
    watch = ShareWatch(300, HARD, flag_after_s=1.0)
    check = watch.observe(t1 - t0, b1["tenant"] - b0["tenant"], max(0, r1 - r0))
    assert check.under_reported and watch.flagged
    assert abs(check.driver_share - 0.3) <= TOLERANCE  # and its launches were still held to the share


def test_bypass_launcher_is_flagged_and_neighbour_keeps_share(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    """A process of the tenant's container runs without the interposer: the region shows none of its
    GPU time, the driver does, and the cross-check flags the container."""
    tenant = Container("tenant", 200, per_sync=4)
    bypass = Container("tenant-bypass", None, per_sync=4, preload=False)
    neighbour = Container("neighbour", 500, per_sync=8)
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, [tenant, bypass, neighbour])
    assert tenant.region is not None
    try:
        time.sleep(WARM_UP_S)
        r0, (t0, b0) = read_compute(tenant.region).busy_ns, ft.sample(timeline, [tenant, bypass, neighbour])
        time.sleep(2 * WINDOW_S)
        r1, (t1, b1) = read_compute(tenant.region).busy_ns, ft.sample(timeline, [tenant, bypass, neighbour])
    finally:
        ft.stop([tenant, bypass, neighbour])
    window = t1 - t0
    container_driver = (b1["tenant"] - b0["tenant"]) + (b1["tenant-bypass"] - b0["tenant-bypass"])
    watch = ShareWatch(200, HARD, flag_after_s=1.0)
    check = watch.observe(window, container_driver, r1 - r0)
    assert check.over_share and check.under_reported and watch.flagged
    assert "evict" in watch.reason()


def test_tenant_truncating_its_region_does_not_touch_the_neighbour(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    """Truncating (or unmapping) the usage file can only hurt the tenant's own processes."""
    tenant = Container("tenant", 300, per_sync=4)
    neighbour = Container("neighbour", 500, per_sync=8)
    timeline = tmp_path / "timeline"
    ft.start(native_build, client, tmp_path, timeline, [tenant, neighbour])
    assert tenant.region is not None
    try:
        time.sleep(0.5)
        os.truncate(tenant.region.usage_path, 0)
        time.sleep(WARM_UP_S)
        result = ft.measure(timeline, [tenant, neighbour], WINDOW_S, 2)
    finally:
        ft.stop([tenant, neighbour])
    assert_shares(result, {"neighbour": 0.5})


def test_region_layout_offsets_match_the_header() -> None:
    """The attack scripts above write at fixed offsets; they must be the compute block's."""
    from gpunode import _memcap  # type: ignore[attr-defined]

    assert _memcap.lib.gpunode_memcap_usage_size() == COMPUTE_OFFSET + 64


@pytest.mark.parametrize(
    ("lookup", "kind", "threads"),
    [("dlsym", "kernel", "1"), ("procaddr-ptds", "graph", "1"), ("dlsym", "kernel", "6")],
)
def test_launch_hooks_under_address_sanitizer(
    asan_build: tuple[NativeBuild, Path], client: Path, tmp_path: Path, lookup: str, kind: str, threads: str
) -> None:
    build, runtime = asan_build
    region = memcap.create_region(
        tmp_path / "regions",
        "asan",
        gpu_uuid=fake_uuid(0),
        limit_bytes=GIB,
        device_total_bytes=FAKE_TOTAL_BYTES,
    )
    set_compute_share(region, 300, HARD)
    env = interposer_env(
        build,
        region.path,
        asan_runtime=runtime,
        extra={"FAKE_CUDA_TIMELINE": str(tmp_path / "timeline"), "COMPUTE_CLIENT_THREADS": threads},
    )
    result = run([str(client), lookup, kind, "500", "4", "2"], env, timeout_s=120)
    assert "AddressSanitizer" not in result.stderr and "LeakSanitizer" not in result.stderr, result.stderr
    assert result.returncode == 0 and result.stdout.splitlines()[-1].startswith("ok"), (
        result.stdout + result.stderr
    )
    report = read_compute(region)
    assert report.launches > 0 and report.throttled_ns > 0
