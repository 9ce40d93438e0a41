"""The background collector on a simulated node: what it reads, what it leaves out, what it tells about itself."""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpunode.config.metrics import MetricsConfig
from gpunode.errors import BackendError
from gpunode.node.devices.base import DeviceEvent, EventKind, Gpu, GpuProbe, GpuProcess, GpuSample
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import region_key
from gpunode.node.kubelet.podresources import ContainerDevices, PodAttribution
from gpunode.node.metrics import MetricsCollector
from tests.fakes import CappedProcess
from tests.fakes.podresources import PodResourcesStandIn
from tests.node.test_metrics_render import Exposition, inventory_for, parse_exposition

HOST = "node-7"
GIB = 2**30
MIB = 2**20

try:
    memcap: Any = importlib.import_module("gpunode.node.memcap")
    importlib.import_module("gpunode._memcap")
except ImportError:
    memcap = None
needs_memcap = pytest.mark.skipif(
    memcap is None, reason="gpunode.node.memcap or its native module is not built"
)


class GatedBackend:
    """A simulated node whose calls can be made to fail or to hang, as a sick driver does."""

    def __init__(self, inner: SimBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.fail_gpus = False
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()

    def driver_version(self) -> str | None:
        return self.inner.driver_version()

    def gpus(self) -> tuple[Gpu, ...]:
        if self.fail_gpus:
            raise BackendError("nvmlDeviceGetCount failed: Unknown Error")
        return self.inner.gpus()

    def sample(self, uuid: str) -> GpuSample:
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait()
        return self.inner.sample(uuid)

    def processes(self, uuid: str) -> tuple[GpuProcess, ...]:
        return self.inner.processes(uuid)

    def probe(self, uuid: str) -> GpuProbe:
        return self.inner.probe(uuid)

    def wait_event(self, timeout_s: float) -> DeviceEvent | None:
        return self.inner.wait_event(timeout_s)

    def close(self) -> None:
        self.inner.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def scrape(collector: MetricsCollector) -> Exposition:
    return parse_exposition(collector.render().decode())


def test_a_collection_serves_the_node_and_says_so() -> None:
    backend = SimBackend.from_profile("dgx-h100")
    collector = MetricsCollector(backend=backend, hostname=HOST)
    snap = asyncio.run(collector.collect_once())
    out = scrape(collector)
    assert len(snap.entities) == 8
    assert len(out.named("DCGM_FI_DEV_GPU_TEMP")) == 8
    assert out.one("DCGM_FI_DEV_GPU_TEMP", gpu="0").labels["Hostname"] == HOST
    assert out.one("gpunode_metrics_collections_total", result="ok").value == 1
    assert out.one("gpunode_metrics_collection_duration_seconds_count").value == 1
    assert out.one("gpunode_metrics_sample_age_seconds").value >= 0
    assert out.one("process_resident_memory_bytes").value > 10 * MIB, "the agent's own memory is visible"
    assert collector.health_status()[0]


def test_config_hostname_and_label_spelling_apply() -> None:
    backend = SimBackend.from_profile("t4")
    cfg = MetricsConfig(hostname_label="hostname", hostname="override-1")
    collector = MetricsCollector(backend=backend, hostname=HOST, config=cfg)
    asyncio.run(collector.collect_once())
    s = scrape(collector).one("DCGM_FI_DEV_GPU_TEMP", gpu="0")
    assert s.labels["hostname"] == "override-1" and "Hostname" not in s.labels


def test_a_lost_gpu_loses_its_values_not_the_others() -> None:
    backend = SimBackend.from_profile("dgx-h100")
    collector = MetricsCollector(backend=backend, hostname=HOST)
    asyncio.run(collector.collect_once())
    before = scrape(collector).one("gpunode_gpu_last_sample_timestamp_seconds", gpu="5").value
    lost = backend.gpus()[5].uuid
    backend.lose_gpu(lost)
    asyncio.run(collector.collect_once())
    out = scrape(collector)
    assert not out.named("DCGM_FI_DEV_POWER_USAGE", UUID=lost), "no value is carried over for a lost GPU"
    assert len(out.named("DCGM_FI_DEV_POWER_USAGE")) == 7
    assert out.one("gpunode_backend_errors_total", call="sample", error="gpu_lost").value == 1
    assert out.one("gpunode_metrics_collections_total", result="partial").value == 1
    assert out.one("gpunode_gpu_last_sample_timestamp_seconds", gpu="5").value == before, "its age shows"


def test_xid_events_show_at_once_by_code() -> None:
    backend = SimBackend.from_profile("a100-mig")
    collector = MetricsCollector(backend=backend, hostname=HOST)
    asyncio.run(collector.collect_once())
    gpus = backend.gpus()
    mig_gpu = next(g for g in gpus if g.mig_enabled)
    plain = next(g for g in gpus if not g.mig_enabled)
    mig = mig_gpu.mig_devices[3]
    for ev in (
        backend.inject_xid(plain.uuid, 48),
        backend.inject_xid(plain.uuid, 48),
        backend.inject_xid(plain.uuid, 79),
        backend.inject_xid(mig_gpu.uuid, 31, mig_uuid=mig.uuid),
        DeviceEvent(EventKind.ECC_SBE, gpus[1].uuid, count=3),
    ):
        collector.record_event(ev)
    out = scrape(collector)  # no collection in between: the events are visible on the next scrape
    assert out.one("DCGM_FI_DEV_XID_ERRORS", UUID=plain.uuid).value == 79
    assert out.one("gpunode_xid_errors_total", UUID=plain.uuid, code="48").value == 2
    assert out.one("gpunode_xid_errors_total", UUID=plain.uuid, code="79").value == 1
    # The parent of the MIG instance also shows the last XID it saw; no other instance does.
    parent = [s for s in out.named("DCGM_FI_DEV_XID_ERRORS", UUID=mig_gpu.uuid) if "GPU_I_ID" not in s.labels]
    assert [s.value for s in parent] == [31]
    assert out.one("DCGM_FI_DEV_XID_ERRORS", UUID=mig_gpu.uuid, GPU_I_ID=str(mig.gi_id)).value == 31
    assert (
        out.one("DCGM_FI_DEV_XID_ERRORS", UUID=mig_gpu.uuid, GPU_I_ID=str(mig_gpu.mig_devices[0].gi_id)).value
        == 0
    )
    assert out.one("gpunode_metrics_device_events_total", kind="xid").value == 4
    assert out.one("gpunode_metrics_device_events_total", kind="ecc_sbe").value == 1


def test_xid_counts_survive_the_gpu_leaving() -> None:
    backend = SimBackend.from_profile("t4")
    collector = MetricsCollector(backend=backend, hostname=HOST)
    asyncio.run(collector.collect_once())
    gone = backend.gpus()[2]
    collector.record_event(backend.inject_xid(gone.uuid, 79))
    backend.remove_gpu(gone.uuid)
    asyncio.run(collector.collect_once())
    s = scrape(collector).one("gpunode_xid_errors_total", UUID=gone.uuid, code="79")
    assert s.value == 1 and s.labels["gpu"] == "2", "the counter keeps its labels, so rate() does not break"


def test_nothing_is_served_as_current_once_collections_stop_succeeding() -> None:
    gated = GatedBackend(SimBackend.from_profile("t4"))
    clock = FakeClock()
    collector = MetricsCollector(
        backend=gated, hostname=HOST, clock=clock, config=MetricsConfig(interval_s=5)
    )
    assert not collector.health_status()[0]
    asyncio.run(collector.collect_once())
    gated.fail_gpus = True
    clock.now += 10
    with pytest.raises(BackendError):
        asyncio.run(collector.collect_once())
    out = scrape(collector)
    assert out.named("DCGM_FI_DEV_GPU_TEMP"), "younger than stale_after: the last good values are served"
    assert out.one("gpunode_metrics_sample_age_seconds").value == 10
    assert out.one("gpunode_metrics_collections_total", result="failed").value == 1
    assert out.one("gpunode_backend_errors_total", call="gpus", error="error").value == 1
    clock.now += collector.stale_after_s
    out = scrape(collector)
    assert not [s for s in out.samples if s.name.startswith("DCGM_")], "stale values are withdrawn"
    assert out.one("gpunode_metrics_sample_age_seconds").value == 10 + collector.stale_after_s
    ok, detail = collector.health_status()
    assert not ok and "nvmlDeviceGetCount failed" in detail


@pytest.mark.timeout(30)
def test_a_scrape_never_waits_for_a_hanging_driver() -> None:
    gated = GatedBackend(SimBackend.from_profile("dgx-h100"))
    collector = MetricsCollector(backend=gated, hostname=HOST, config=MetricsConfig(interval_s=1))

    async def scenario() -> None:
        ready = asyncio.Event()
        task = asyncio.create_task(collector.run(ready=ready))
        await ready.wait()
        gated.gate.clear()  # the next sample() call hangs, as a wedged NVML call does
        await asyncio.to_thread(gated.blocked.wait)
        out = scrape(collector)  # would deadlock here if a scrape waited on the backend
        assert len(out.named("DCGM_FI_DEV_GPU_TEMP")) == 8
        # The agent can stop while the driver call still hangs: nothing waits for it.
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(scenario())
    finally:
        gated.gate.set()


def test_devices_health_and_allocation_come_from_the_providers() -> None:
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    inv = inventory_for(gpus, {})
    unhealthy = {gpus[1].uuid: "XID 79"}
    collector = MetricsCollector(
        backend=backend, hostname=HOST, inventory=lambda: inv, health=lambda: unhealthy
    )
    asyncio.run(collector.collect_once())
    out = scrape(collector)
    assert out.one("gpunode_device_healthy", device_id=gpus[1].uuid).value == 0
    assert out.one("gpunode_device_healthy", device_id=gpus[0].uuid).value == 1
    unhealthy.clear()
    asyncio.run(collector.collect_once())
    assert scrape(collector).one("gpunode_device_healthy", device_id=gpus[1].uuid).value == 1, "it recovers"


@pytest.fixture
def kubelet() -> Iterator[PodResourcesStandIn]:
    d = tempfile.mkdtemp(prefix="gpn-mc-", dir="/tmp")
    with PodResourcesStandIn(os.path.join(d, "kubelet.sock")) as standin:
        yield standin
    shutil.rmtree(d, ignore_errors=True)


def test_pod_labels_follow_the_kubelet(kubelet: PodResourcesStandIn) -> None:
    backend = SimBackend.from_profile("dgx-h100")
    gpus = backend.gpus()
    inv = inventory_for(gpus, {})
    kubelet.set_pods([ContainerDevices("ml", "train-0", "main", "nvidia.com/gpu", (gpus[4].uuid,))])
    attribution = PodAttribution(kubelet.socket_path, ttl_s=0.0)
    collector = MetricsCollector(
        backend=backend, hostname=HOST, inventory=lambda: inv, attribution=attribution
    )
    asyncio.run(collector.collect_once())
    out = scrape(collector)
    assert out.one("DCGM_FI_DEV_FB_USED", gpu="4").labels["pod"] == "train-0"
    assert out.one("gpunode_device_allocated", device_id=gpus[4].uuid).labels["namespace"] == "ml"
    assert out.one("gpunode_pod_attribution_age_seconds").value >= 0

    # The kubelet stops answering: the last answer keeps labelling, the error is counted.
    kubelet.fail_with(grpc.StatusCode.UNAVAILABLE)
    asyncio.run(collector.collect_once())
    out = scrape(collector)
    assert out.one("DCGM_FI_DEV_FB_USED", gpu="4").labels["pod"] == "train-0"
    assert out.one("gpunode_pod_attribution_errors_total").value == 1

    # It answers again, and the pod has gone.
    kubelet.fail_with(None)
    kubelet.set_pods([])
    asyncio.run(collector.collect_once())
    assert "pod" not in scrape(collector).one("DCGM_FI_DEV_FB_USED", gpu="4").labels


def test_pod_labels_can_be_switched_off(kubelet: PodResourcesStandIn) -> None:
    backend = SimBackend.from_profile("t4")
    gpu = backend.gpus()[0]
    kubelet.set_pods([ContainerDevices("ml", "p", "c", "nvidia.com/gpu", (gpu.uuid,))])
    collector = MetricsCollector(
        backend=backend,
        hostname=HOST,
        attribution=PodAttribution(kubelet.socket_path),
        config=MetricsConfig(pod_labels=False),
    )
    asyncio.run(collector.collect_once())
    assert "pod" not in scrape(collector).one("DCGM_FI_DEV_GPU_TEMP", gpu="0").labels
    assert kubelet.call_count("List") == 0


def test_run_collects_until_cancelled() -> None:
    backend = SimBackend.from_profile("t4")
    collector = MetricsCollector(backend=backend, hostname=HOST, config=MetricsConfig(interval_s=1))

    async def scenario() -> float:
        ready = asyncio.Event()
        task = asyncio.create_task(collector.run(ready=ready))
        await asyncio.wait_for(ready.wait(), 10)
        first = collector.snapshot
        assert first is not None
        while collector.snapshot is first:  # the next tick replaces the snapshot
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return scrape(collector).one("gpunode_metrics_collections_total", result="ok").value

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) >= 2


def test_the_hostname_label_is_never_empty() -> None:
    import socket

    collector = MetricsCollector(backend=SimBackend.from_profile("t4"), hostname="")
    asyncio.run(collector.collect_once())
    assert scrape(collector).one("DCGM_FI_DEV_GPU_TEMP", gpu="0").labels["Hostname"] == socket.gethostname()


@needs_memcap
def test_each_container_on_a_shared_gpu_gets_its_own_memory(
    tmp_path: Path, kubelet: PodResourcesStandIn
) -> None:
    backend = SimBackend.from_profile("dgx-h100")
    gpus = backend.gpus()
    gpu = gpus[1]
    inv = inventory_for(gpus, {"gpunode": {"fractional": {"devices": [1]}}})
    units = [d.id for d in inv.devices if d.gpu_uuid == gpu.uuid]
    a = ContainerDevices("team-a", "notebook", "jupyter", "gpunode.io/gpu-memory", tuple(units[:2]))
    b = ContainerDevices("team-b", "batch", "worker", "gpunode.io/gpu-memory", tuple(units[2:6]))
    kubelet.set_pods([a, b])
    total = gpu.memory_total_bytes
    ra = memcap.create_region(
        tmp_path, region_key(a.device_ids), gpu_uuid=gpu.uuid, limit_bytes=2 * GIB, device_total_bytes=total
    )
    rb = memcap.create_region(
        tmp_path, region_key(b.device_ids), gpu_uuid=gpu.uuid, limit_bytes=4 * GIB, device_total_bytes=total
    )
    broken = memcap.create_region(
        tmp_path, "f" * 20, gpu_uuid=gpu.uuid, limit_bytes=GIB, device_total_bytes=total
    )
    broken.usage_path.write_bytes(b"not a usage file")
    collector = MetricsCollector(
        backend=backend,
        hostname=HOST,
        inventory=lambda: inv,
        attribution=PodAttribution(kubelet.socket_path),
        regions_root=tmp_path,
    )
    with (
        CappedProcess(ra.path, {0: 512 * MIB}),
        CappedProcess(rb.path, {0: 3 * GIB}),
        CappedProcess(rb.path, {0: 256 * MIB}),
    ):
        asyncio.run(collector.collect_once())
    out = scrape(collector)
    assert out.one("gpunode_container_memory_used_bytes", pod="notebook").value == 512 * MIB
    assert out.one("gpunode_container_memory_used_bytes", pod="batch").value == 3 * GIB + 256 * MIB
    assert out.one("gpunode_container_memory_limit_bytes", pod="notebook").value == 2 * GIB
    assert out.one("gpunode_container_memory_limit_bytes", pod="batch").value == 4 * GIB
    assert out.one("gpunode_container_memory_used_bytes", pod="batch").labels["namespace"] == "team-b"
    # A broken region is left out (memcap logs it), never served with made-up numbers.
    assert not out.named("gpunode_container_memory_used_bytes", region="f" * 20)
