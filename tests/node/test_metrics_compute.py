"""The compute share in the metrics: each container's share, its achieved share over the last
10 s, its GPU time and the time its launches were held back, from its region."""

from __future__ import annotations

import asyncio
import mmap
import struct
from pathlib import Path

import pytest

from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.memcap.compute import ComputeMode, set_compute_share
from gpunode.node.metrics import MetricsCollector
from gpunode.node.metrics.regions import ComputeHistory, RegionReading
from tests.node.test_metrics_collector import GIB, HOST, memcap, needs_memcap, scrape

COMPUTE_OFFSET = 64 + 64 + 128 * 256  # struct gpunode_compute in the usage file


def reading(busy_s: float, share: int = 250, throttled_s: float = 0.0) -> RegionReading:
    return RegionReading("k", "GPU-x", 0, GIB, share, int(busy_s * 1e9), int(throttled_s * 1e9))


def test_achieved_share_is_over_the_last_ten_seconds() -> None:
    history = ComputeHistory()
    assert history.update(100.0, [reading(0.0)])["k"].achieved_share is None  # one reading: no rate yet
    got = history.update(105.0, [reading(1.25)])["k"]
    assert got.achieved_share == pytest.approx(0.25)
    for t in range(110, 161, 5):  # 25% for a while, then the container goes idle at t=140
        busy = 1.25 + 0.25 * (min(t, 140) - 105)
        got = history.update(float(t), [reading(busy)])["k"]
    assert got.achieved_share == pytest.approx(0.0)  # the last 10 s were idle
    assert (got.share_milli, got.busy_s) == (250, pytest.approx(1.25 + 0.25 * 35))


def test_a_busy_counter_going_back_restarts_the_history() -> None:
    history = ComputeHistory()
    history.update(0.0, [reading(5.0)])
    history.update(5.0, [reading(6.0)])
    assert history.update(10.0, [reading(0.5)])["k"].achieved_share is None  # zeroed by its container
    assert history.update(15.0, [reading(1.5)])["k"].achieved_share == pytest.approx(0.2)


def test_regions_gone_are_forgotten() -> None:
    history = ComputeHistory()
    history.update(0.0, [reading(1.0)])
    assert history.update(5.0, []) == {}
    assert history.update(10.0, [reading(3.0)])["k"].achieved_share is None


@needs_memcap
def test_collector_exports_share_achieved_busy_and_throttled(tmp_path: Path) -> None:
    backend = SimBackend.from_profile("t4")
    gpu = backend.gpus()[0]
    region = memcap.create_region(
        tmp_path, "c" * 20, gpu_uuid=gpu.uuid, limit_bytes=GIB, device_total_bytes=gpu.memory_total_bytes
    )
    set_compute_share(region, 300, ComputeMode.HARD)
    now = [1000.0]
    collector = MetricsCollector(backend=backend, hostname=HOST, regions_root=tmp_path, clock=lambda: now[0])

    def interposer_reports(busy_s: float, throttled_s: float) -> None:
        with region.usage_path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            struct.pack_into("<Q", m, COMPUTE_OFFSET + 24, int(busy_s * 1e9))
            struct.pack_into("<Q", m, COMPUTE_OFFSET + 32, int(throttled_s * 1e9))

    interposer_reports(2.0, 1.0)
    asyncio.run(collector.collect_once())
    first = scrape(collector)
    assert first.one("gpunode_container_compute_share", region=region.key).value == pytest.approx(0.3)
    assert not first.named("gpunode_container_compute_achieved_share")  # no rate from one reading
    now[0] += 10.0
    interposer_reports(5.0, 4.5)
    asyncio.run(collector.collect_once())
    out = scrape(collector)
    assert out.one("gpunode_container_compute_achieved_share", region=region.key).value == pytest.approx(0.3)
    assert out.one("gpunode_container_compute_busy_seconds_total", region=region.key).value == pytest.approx(
        5.0
    )
    assert out.one(
        "gpunode_container_compute_throttled_seconds_total", region=region.key
    ).value == pytest.approx(4.5)
