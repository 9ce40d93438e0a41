"""HealthMonitor on the simulated backend: counters, probe timeouts, faults handed to the remediator, threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from gpunode.config.agent import parse_config
from gpunode.config.health import HealthConfig
from gpunode.errors import BackendError
from gpunode.node.devices.base import DeviceEvent, EventKind, GpuProbe
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.health.model import Fault
from gpunode.node.health.monitor import HealthMonitor
from gpunode.node.inventory import build_inventory
from gpunode.node.state import DeviceState

FAST = HealthConfig(probe_interval_s=0.02, probe_timeout_s=0.2, recovery_window_s=0.1)


class CountingSim(SimBackend):
    """The simulated node, counting probe calls per GPU and failing them on demand."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.probe_calls: dict[str, int] = {}
        self.raise_on: set[str] = set()

    def probe(self, uuid: str) -> GpuProbe:
        self.probe_calls[uuid] = self.probe_calls.get(uuid, 0) + 1
        if uuid in self.raise_on:
            raise BackendError(f"NVML error on {uuid}")
        return super().probe(uuid)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, str], list[Fault]]] = []

    def notify(self, unhealthy: Mapping[str, str], faults: Sequence[Fault]) -> None:
        self.calls.append((dict(unhealthy), list(faults)))


def setup(
    profile: str = "dgx-h100", config: dict[str, Any] | None = None, health: HealthConfig = FAST
) -> Any:
    from gpunode.node.devices.simnode.profile import load_profile

    backend = CountingSim(load_profile(profile))
    cfg = parse_config(config or {}, "t")
    state = DeviceState(build_inventory(backend.gpus(), cfg))
    recorder = Recorder()
    monitor = HealthMonitor(backend=backend, state=state, config=health, remediator=recorder)
    return backend, state, monitor, recorder


def test_counters_count_every_xid_including_ignored_ones() -> None:
    backend, _, monitor, _ = setup()
    g0, g1 = (g.uuid for g in backend.gpus()[:2])
    for event in (
        DeviceEvent(EventKind.XID, g0, xid=13),
        DeviceEvent(EventKind.XID, g0, xid=13),
        DeviceEvent(EventKind.XID, g1, xid=79),
        DeviceEvent(EventKind.ECC_SBE, g1, count=5),
        DeviceEvent(EventKind.ECC_DBE, g0, count=2),
        DeviceEvent(EventKind.GPU_LOST, g1),
    ):
        monitor.handle_event(event)
    c = monitor.counters()
    assert c.xid_total == {(g0, 13): 2, (g1, 79): 1}
    assert (c.ecc_sbe_events, c.ecc_dbe_events, c.gpu_lost_events) == ({g1: 5}, {g0: 2}, {g1: 1})
    assert set(c.unhealthy) == {g0, g1}
    assert c.became_unhealthy == {g0: 1, g1: 1}


def test_disabled_health_counts_but_marks_nothing() -> None:
    backend, state, monitor, recorder = setup(health=HealthConfig(enabled=False))
    g0 = backend.gpus()[0].uuid
    monitor.handle_event(DeviceEvent(EventKind.XID, g0, xid=79))
    assert monitor.counters().xid_total == {(g0, 79): 1}
    assert state.snapshot().unhealthy == {} and recorder.calls == []

    async def scenario() -> None:
        ready = asyncio.Event()
        await asyncio.wait_for(monitor.run(ready=ready), 5)  # returns at once
        assert ready.is_set()

    asyncio.run(scenario())
    assert backend.probe_calls == {}


def test_fault_names_every_advertised_device_of_the_gpu() -> None:
    sliced = {
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 3, "devices": [2]}]}}
    }
    backend, _, monitor, recorder = setup(config=sliced)
    g2 = backend.gpus()[2].uuid
    monitor.handle_event(DeviceEvent(EventKind.XID, g2, xid=48))
    ((level, (fault,)),) = recorder.calls
    assert level == {g2: fault.reason}
    assert (fault.target_uuid, fault.gpu_uuid, fault.mig_uuid, fault.kind, fault.xid) == (
        g2,
        g2,
        None,
        "xid",
        48,
    )
    assert fault.device_ids == (f"{g2}::0", f"{g2}::1", f"{g2}::2")
    assert "Double Bit ECC Error" in fault.reason


def test_mig_fault_names_only_the_instance_devices() -> None:
    backend, _, monitor, recorder = setup("a100-mig", {"flags": {"migStrategy": "mixed"}})
    gpu = backend.gpus()[4]
    monitor.handle_event(DeviceEvent(EventKind.XID, gpu.uuid, mig_uuid=gpu.mig_devices[1].uuid, xid=94))
    ((_, (fault,)),) = recorder.calls
    assert (fault.target_uuid, fault.mig_uuid, fault.device_ids) == (
        gpu.mig_devices[1].uuid,
        gpu.mig_devices[1].uuid,
        (gpu.mig_devices[1].uuid,),
    )


def test_hanging_probe_fails_once_per_round_and_is_not_stacked() -> None:
    backend, state, monitor, recorder = setup()
    hung = backend.gpus()[1].uuid
    backend.set_probe_delay(hung, 1.0)

    async def scenario() -> None:
        for _ in range(4):
            await monitor.probe_once()

    asyncio.run(scenario())
    assert backend.probe_calls[hung] == 1  # one call, still hanging: no second one on top of it
    assert all(n == 4 for u, n in backend.probe_calls.items() if u != hung)
    assert set(state.snapshot().unhealthy) == {hung}
    assert "no answer within 0.2 s" in state.snapshot().unhealthy[hung]
    assert monitor.counters().probe_failures == {hung: 4}
    assert [f.kind for f in recorder.calls[0][1]] == ["probe"]


def test_probe_errors_are_failures_and_removed_gpus_are_skipped() -> None:
    backend, state, monitor, _ = setup("t4")
    broken, removed = backend.gpus()[0].uuid, backend.gpus()[3].uuid
    backend.raise_on.add(broken)
    backend.remove_gpu(removed)  # still in the inventory until rediscovery

    asyncio.run(monitor.probe_once())
    assert set(state.snapshot().unhealthy) == {broken}
    assert "NVML error" in state.snapshot().unhealthy[broken]
    assert monitor.counters().probe_failures == {broken: 1}


def test_recovery_through_the_probe_loop() -> None:
    backend, state, monitor, recorder = setup()
    lost = backend.gpus()[6].uuid

    async def scenario() -> None:
        task = asyncio.create_task(monitor.run())
        backend.lose_gpu(lost)
        while lost not in state.snapshot().unhealthy:
            await asyncio.sleep(0.01)
        backend.reset_gpu(lost)
        while state.snapshot().unhealthy:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert monitor.counters().recovered == {lost: 1}
    assert recorder.calls[-1] == ({}, [])  # the remediator hears about the recovery (the level)


def test_events_from_many_threads_while_probing() -> None:
    backend, state, monitor, _ = setup()
    uuids = [g.uuid for g in backend.gpus()]

    def hammer(n: int) -> None:
        for i in range(200):
            monitor.handle_event(DeviceEvent(EventKind.XID, uuids[(n + i) % len(uuids)], xid=13))

    async def scenario() -> None:
        task = asyncio.create_task(monitor.run())
        threads = [threading.Thread(target=hammer, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            await asyncio.to_thread(t.join)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert sum(monitor.counters().xid_total.values()) == 800
    assert state.snapshot().unhealthy == {}


def test_a_gpu_that_leaves_the_inventory_is_forgotten() -> None:
    backend, state, monitor, _ = setup("t4")
    gone = backend.gpus()[1].uuid
    monitor.handle_event(DeviceEvent(EventKind.XID, gone, xid=79))
    assert gone in state.snapshot().unhealthy
    backend.remove_gpu(gone)
    state.set_inventory(build_inventory(backend.gpus(), parse_config({}, "t"), strict=False))
    state.forget_vanished()
    assert monitor.evaluate() == {}
    assert state.snapshot().unhealthy == {}
