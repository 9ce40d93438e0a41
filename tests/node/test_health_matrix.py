"""Fault-injection matrix: a simulated node, the real device plugins, the health monitor and remediation.

Each case injects one fault into the simulated backend and checks, through
the kubelet stand-in's ListAndWatch streams over real Unix sockets, that
exactly the devices of the failed GPU or MIG instance turn Unhealthy; through
the API server stand-in, that exactly the pods the pod-resources stand-in
lists on those devices are evicted; and that everything is Healthy again once
the GPU is reset and its probes pass for the recovery window.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpunode.config.agent import parse_config
from gpunode.infra.kube import KubeClient
from gpunode.node.devices.base import Gpu
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.health.monitor import HealthMonitor
from gpunode.node.health.remediation import KubeRemediator
from gpunode.node.inventory import AdvertisedDevice, Inventory, build_inventory
from gpunode.node.kubelet.deviceplugin import PluginManager
from gpunode.node.kubelet.podresources import ContainerDevices
from gpunode.node.state import DeviceState
from tests.fakes.apiserver import ApiServerStandIn
from tests.fakes.kubelet import KubeletStandIn, short_socket_dir
from tests.fakes.podresources import PodResourcesStandIn

NODE = "node-a"
HEALTH = {
    "probeInterval": "50ms",
    "probeTimeout": "300ms",
    "recoveryWindow": "200ms",
    "xid": {"countThreshold": 3, "countWindow": "1s"},
    "ecc": {"singleBitThreshold": 10, "singleBitWindow": "1s"},
}
REMEDIATION = {"retryInitial": "20ms", "retryMax": "100ms", "evictionDeadline": "5s", "requestTimeout": "1s"}


def target_of(device: AdvertisedDevice) -> str:
    """A readable name of the GPU or MIG instance a device comes from: "g1" or "g2m0"."""
    return device.mig_uuid or device.gpu_uuid


class Node:
    """One simulated GPU node with every part of the health path running."""

    def __init__(self, profile: str, config: dict[str, Any], directory: Path) -> None:
        self.dir = directory
        doc = {
            **config,
            "gpunode": {**config.get("gpunode", {}), "kubeletDir": str(directory), "health": HEALTH},
        }
        doc["gpunode"]["remediation"] = {**REMEDIATION, **config.get("gpunode", {}).get("remediation", {})}
        self.config = parse_config(doc, "matrix.yaml")
        self.backend = SimBackend.from_profile(profile)
        self.gpus: tuple[Gpu, ...] = self.backend.gpus()
        self.inventory: Inventory = build_inventory(self.gpus, self.config)
        self.state = DeviceState(self.inventory)
        self.kubelet = KubeletStandIn(directory)
        self.podres = PodResourcesStandIn(str(directory / "pr.sock"))
        self.api = ApiServerStandIn()
        self.remediator = KubeRemediator(
            self.config.remediation,
            node_name=NODE,
            pod_resources_socket=self.podres.socket_path,
            client_factory=lambda: KubeClient.for_host(self.api.url, request_timeout_s=1.0),
        )
        self.monitor = HealthMonitor(
            backend=self.backend,
            state=self.state,
            config=self.config.health,
            remediator=self.remediator,
        )
        self.pods: dict[str, list[str]] = {}  # pod name -> device IDs

    def gpu(self, index: int) -> Gpu:
        return self.gpus[index]

    def place_pods(self) -> None:
        """Two pods per GPU or MIG instance where it is shared, one where it is whole."""
        by_target: dict[str, list[AdvertisedDevice]] = {}
        for d in self.inventory.devices:
            by_target.setdefault(target_of(d), []).append(d)
        records = []
        for devices in by_target.values():
            for n, d in enumerate(devices[: 2 if len(devices) > 1 else 1]):
                name = self.pod_name(d, n)
                self.pods[name] = [d.id]
                self.api.add_pod("team", name, node_name=NODE)
                records.append(ContainerDevices("team", name, "main", d.resource, (d.id,)))
        self.podres.set_pods(records)

    def pod_name(self, d: AdvertisedDevice, n: int) -> str:
        gpu = next(g for g in self.gpus if g.uuid == d.gpu_uuid)
        name = f"g{gpu.index}"
        if d.mig_uuid:
            name += f"m{next(m.index for m in gpu.mig_devices if m.uuid == d.mig_uuid)}"
        return name + (f"-{n}" if d.kind in ("replica", "memory") else "")

    def devices_of(self, *targets: str) -> set[str]:
        return {d.id for d in self.inventory.devices if d.gpu_uuid in targets or d.mig_uuid in targets}

    def unhealthy_seen(self) -> set[str]:
        return {i for r in self.inventory.resources() for i in self.kubelet.unhealthy(r)}

    async def wait(self, predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        """Poll (the kubelet stand-in's own wait only wakes on ListAndWatch updates)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            await asyncio.sleep(0.01)

    async def pump(self) -> None:
        while True:
            event = await asyncio.to_thread(self.backend.wait_event, 0.05)
            if event is not None:
                self.monitor.handle_event(event)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Node]:
        self.kubelet.start()
        self.podres.start()
        self.api.start()
        self.api.add_node(NODE)
        self.place_pods()
        plugins = PluginManager(config=self.config, state=self.state)
        ready = [asyncio.Event() for _ in range(3)]
        tasks = [
            asyncio.create_task(plugins.run(ready=ready[0])),
            asyncio.create_task(self.monitor.run(ready=ready[1])),
            asyncio.create_task(self.remediator.run(ready=ready[2])),
            asyncio.create_task(self.pump()),
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), 10)
            await asyncio.to_thread(self.kubelet.wait_for_resources, self.inventory.resources())
            yield self
        finally:
            self.kubelet.stop()  # first: the plugins then stop without waiting for open streams
            for t in tasks:
                t.cancel()
            _, stuck = await asyncio.wait(tasks, timeout=15)
            for t in stuck:  # say where a part hangs instead of waiting for the suite's timeout
                t.print_stack()
            assert not stuck, f"{len(stuck)} part(s) did not stop within 15 s of being cancelled"
            self.backend.close()
            self.api.stop()
            self.podres.stop()


@pytest.fixture
def directory() -> Any:
    d = short_socket_dir("gnh")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@dataclass(frozen=True)
class Case:
    profile: str
    fault: Callable[[Node], None]
    failed: Callable[[Node], tuple[str, ...]]  # the GPU/MIG UUIDs whose devices must turn unhealthy
    evicted: frozenset[str]  # pod names
    config: dict[str, Any] = field(default_factory=dict)
    repair: Callable[[Node], None] = lambda node: None


MIXED = {"flags": {"migStrategy": "mixed"}}
SLICED = {"sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4, "rename": "nvidia.com/gpu.shared", "devices": [1, 2]}]}}}  # fmt: skip
FRACTIONAL = {"gpunode": {"fractional": {"devices": [1, 2], "unit": "20Gi"}}}


def g(i: int) -> Callable[[Node], tuple[str, ...]]:
    return lambda node: (node.gpu(i).uuid,)


def mig(i: int, m: int) -> Callable[[Node], tuple[str, ...]]:
    return lambda node: (node.gpu(i).mig_devices[m].uuid,)


def none(node: Node) -> tuple[str, ...]:
    return ()


def xid(i: int, code: int, times: int = 1, m: int | None = None) -> Callable[[Node], None]:
    def inject(node: Node) -> None:
        gpu = node.gpu(i)
        for _ in range(times):
            node.backend.inject_xid(gpu.uuid, code, mig_uuid=None if m is None else gpu.mig_devices[m].uuid)

    return inject


def reset(i: int) -> Callable[[Node], None]:
    return lambda node: node.backend.reset_gpu(node.gpu(i).uuid)


CASES = {
    "xid-13-ignored": Case("dgx-h100", xid(1, 13), none, frozenset()),
    "xid-43-ignored": Case("dgx-h100", xid(1, 43), none, frozenset()),
    "xid-79-fatal": Case("dgx-h100", xid(1, 79), g(1), frozenset({"g1"}), repair=reset(1)),
    "xid-119-fatal": Case("dgx-h100", xid(3, 119), g(3), frozenset({"g3"}), repair=reset(3)),
    "xid-counted-below-threshold": Case("dgx-h100", xid(1, 150, times=2), none, frozenset()),
    "xid-counted-at-threshold": Case("dgx-h100", xid(1, 150, times=3), g(1), frozenset({"g1"})),
    "ecc-double-bit": Case("dgx-h100", lambda n: n.backend.inject_ecc(n.gpu(1).uuid, True), g(1), frozenset({"g1"}), repair=reset(1)),
    "ecc-single-bit-below-threshold": Case("dgx-h100", lambda n: n.backend.inject_ecc(n.gpu(1).uuid, False, 9), none, frozenset()),
    "ecc-single-bit-at-threshold": Case("dgx-h100", lambda n: n.backend.inject_ecc(n.gpu(1).uuid, False, 10), g(1), frozenset({"g1"}), repair=reset(1)),
    "gpu-lost": Case("dgx-h100", lambda n: n.backend.lose_gpu(n.gpu(5).uuid), g(5), frozenset({"g5"}), repair=reset(5)),
    "probe-hangs": Case("dgx-h100", lambda n: n.backend.set_probe_delay(n.gpu(2).uuid, 1.0), g(2), frozenset({"g2"}), repair=reset(2)),
    "row-remap-pending": Case("dgx-h100", lambda n: n.backend.set_row_remap(n.gpu(0).uuid, pending=True), g(0), frozenset({"g0"}), repair=reset(0)),
    "retired-pages-pending": Case("t4", lambda n: n.backend.set_retired_pages_pending(n.gpu(3).uuid, True), g(3), frozenset({"g3"}), repair=reset(3)),
    "mig-instance-xid-94": Case("a100-mig", xid(2, 94, m=1), mig(2, 1), frozenset({"g2m1"}), MIXED),
    "mig-instance-counted": Case("a100-mig", xid(3, 150, times=3, m=0), mig(3, 0), frozenset({"g3m0"}), MIXED),
    "mig-instance-xid-79-takes-the-gpu": Case("a100-mig", xid(2, 79, m=1), g(2), frozenset({"g2m0", "g2m1", "g2m2", "g2m3"}), MIXED, repair=reset(2)),
    "mig-instance-ignored-xid": Case("a100-mig", xid(2, 31, m=0), none, frozenset(), MIXED),
    "time-sliced-replicas": Case("dgx-h100", xid(1, 79), g(1), frozenset({"g1-0", "g1-1"}), SLICED, repair=reset(1)),
    "fractional-memory-units": Case("dgx-h100", xid(2, 48), g(2), frozenset({"g2-0", "g2-1"}), FRACTIONAL, repair=reset(2)),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fault_marks_exactly_the_right_devices_and_evicts_exactly_their_pods(
    case: Case, directory: Path
) -> None:
    async def scenario() -> None:
        node = Node(case.profile, case.config, directory)
        async with node.running():
            failed = case.failed(node)
            expected = node.devices_of(*failed)
            assert expected or not failed, "the case names a device the inventory does not advertise"
            events_before = sum(node.monitor.counters().xid_total.values())
            case.fault(node)
            if not failed:
                # Nothing must happen: wait until the monitor has seen the fault and probed twice.
                probes = node.monitor.counters().probes
                await node.wait(
                    lambda: (
                        sum(node.monitor.counters().xid_total.values()) > events_before
                        or node.monitor.counters().ecc_sbe_events != {}
                    ),
                    "the monitor to see the fault",
                )
                await node.wait(
                    lambda: node.monitor.counters().probes >= probes + 2 * len(node.gpus), "two probe rounds"
                )
                assert node.unhealthy_seen() == set()
                assert node.remediator.journal.records() == [] or all(
                    r.action == "annotate-node" for r in node.remediator.journal.records()
                )
                assert node.api.evictions() == []
                return
            await node.wait(
                lambda: node.unhealthy_seen() == expected, f"exactly {len(expected)} unhealthy devices"
            )
            await node.wait(
                lambda: (
                    len([r for r in node.remediator.journal.records("evict") if r.result == "requested"])
                    >= len(case.evicted)
                ),
                "the evictions",
            )
            assert {pod for _, pod in node.api.evictions()} == set(case.evicted)
            assert len(node.api.evictions()) == len(case.evicted)
            # Recovery: the repair clears the fault, the probes pass, the devices come back.
            case.repair(node)
            await node.wait(lambda: node.unhealthy_seen() == set(), "every device healthy again")
            assert node.monitor.unhealthy == {}

    asyncio.run(scenario())


def test_missing_pod_resources_socket_is_reported_and_marking_goes_on(directory: Path) -> None:
    async def scenario() -> None:
        node = Node("dgx-h100", {}, directory)
        async with node.running():
            node.podres.stop()
            node.backend.inject_xid(node.gpu(0).uuid, 74)
            await node.wait(
                lambda: node.unhealthy_seen() == node.devices_of(node.gpu(0).uuid), "the unhealthy GPU"
            )
            await node.wait(
                lambda: [r.result for r in node.remediator.journal.records("lookup")] == ["failed"],
                "the report",
            )
            assert "pod-resources socket" in node.remediator.journal.records("lookup")[0].detail
            node.backend.reset_gpu(node.gpu(0).uuid)  # XID 74 is fatal: held until the GPU is reset
            await node.wait(lambda: node.unhealthy_seen() == set(), "the recovery")
            assert node.api.evictions() == []

    asyncio.run(scenario())


@pytest.mark.parametrize("outage", ["down", "hanging"])
def test_api_server_outage_does_not_hold_up_list_and_watch(directory: Path, outage: str) -> None:
    async def scenario() -> None:
        node = Node("dgx-h100", {}, directory)
        async with node.running():
            await node.wait(
                lambda: node.remediator.journal.records("annotate-node") != [], "the first annotation"
            )
            if outage == "down":
                node.api.stop()
            else:
                node.api.hang(".", 30.0)
            node.backend.inject_xid(node.gpu(4).uuid, 79)
            await node.wait(
                lambda: node.unhealthy_seen() == node.devices_of(node.gpu(4).uuid), "the unhealthy GPU"
            )
            assert [r for r in node.remediator.journal.records("evict") if r.result == "requested"] == []
            if outage == "down":
                node.api.start()
            else:
                node.api.clear_faults()
            await node.wait(lambda: node.api.evictions() == [("team", "g4")], "the eviction after the outage")

    asyncio.run(scenario())


def test_dry_run_marks_devices_but_evicts_nothing(directory: Path) -> None:
    async def scenario() -> None:
        node = Node("dgx-h100", {"gpunode": {"remediation": {"dryRun": True}}}, directory)
        async with node.running():
            node.backend.inject_xid(node.gpu(6).uuid, 95)
            await node.wait(
                lambda: node.unhealthy_seen() == node.devices_of(node.gpu(6).uuid), "the unhealthy GPU"
            )
            await node.wait(
                lambda: (
                    [r.pod for r in node.remediator.journal.records("evict") if r.result == "dry-run"]
                    == ["g6"]
                ),
                "the dry-run record",
            )
            await node.wait(lambda: len(node.api.events()) == 2, "the node and pod Events")
            assert all(e["message"].startswith("[dry-run]") for e in node.api.events())
            assert node.api.evictions() == []
            assert "gpunode.io/unhealthy-gpus" not in node.api.node(NODE)["metadata"]["annotations"]

    asyncio.run(scenario())


def test_a_flapping_gpu_evicts_each_pod_once(directory: Path) -> None:
    async def scenario() -> None:
        node = Node("dgx-h100", {}, directory)
        async with node.running():
            node.api.set_termination(60.0)  # evicted pods keep terminating for the whole test
            gpu = node.gpu(7).uuid
            for _ in range(3):
                node.backend.inject_xid(gpu, 79)
                await node.wait(lambda: node.unhealthy_seen() == node.devices_of(gpu), "the unhealthy GPU")
                node.backend.reset_gpu(gpu)  # XID 79 is held until a reset
                await node.wait(lambda: node.unhealthy_seen() == set(), "the recovery")
            await node.wait(
                lambda: (
                    len([r for r in node.remediator.journal.records("evict") if r.result == "skipped"]) == 2
                ),
                "the repeats to be skipped",
            )
            assert node.api.evictions() == [("team", "g7")]
            assert node.monitor.counters().became_unhealthy == {gpu: 3}

    asyncio.run(scenario())
