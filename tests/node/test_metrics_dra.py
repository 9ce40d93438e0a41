"""The metrics charge DRA claims: the kubelet's pod-resources `dynamic_resources`, joined to the claims the
DRA plugin prepared (by the CDI device IDs it returned), label the devices and the claims' regions with
dcgm-exporter's DRA labels and the pod.

Real parts: the DRA plugin's Preparer (regions, CDI specs and records on disk, as on a node), the
pod-resources client over a real Unix socket to the kubelet stand-in, memory-cap regions charged by a
process through the interposer's accounting (CappedProcess), the collector and its exposition.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.config.agent import Config
from gpunode.contract import dra as names
from gpunode.node.devices.base import Gpu
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.claims import ClaimRef
from gpunode.node.dra.devices import DeviceDirectory
from gpunode.node.dra.prepare import Preparer
from gpunode.node.dra.slices import gpu_device_name, shared_device_name
from gpunode.node.kubelet.podresources import ClaimDevice, ContainerClaim, list_pod_resources
from gpunode.node.metrics import MetricsCollector
from tests.fakes import CappedProcess
from tests.fakes.podresources import Claim, Container, Pod, PodResourcesStandIn
from tests.node.dra_world import claim as claim_body
from tests.node.dra_world import dra_config, new_uid
from tests.node.test_metrics_collector import needs_memcap, scrape

HOST = "node-a"
DRIVER = names.DEFAULT_DRIVER
GIB = 2**30
DRA_LABELS = ("dra_claim_name", "dra_claim_namespace", "dra_device_name", "dra_driver_name", "dra_pool_name")


@pytest.fixture
def kubelet() -> Iterator[PodResourcesStandIn]:
    short = tempfile.mkdtemp(prefix="gpn-dm-", dir="/tmp")
    with PodResourcesStandIn(os.path.join(short, "kubelet.sock")) as standin:
        yield standin
    shutil.rmtree(short, ignore_errors=True)


def _slices(gpus: tuple[Gpu, ...]) -> list[dict[str, Any]]:
    devices = []
    for g in gpus:
        for name, sharing in ((gpu_device_name(g.uuid), "whole"), (shared_device_name(g.uuid), "shared")):
            attrs = {"uuid": {"string": g.uuid}, "type": {"string": "gpu"}, "sharing": {"string": sharing}}
            devices.append({"name": name, "attributes": attrs})
    spec = {"driver": DRIVER, "nodeName": HOST, "pool": {"name": HOST}, "devices": devices}
    return [{"metadata": {"name": f"{HOST}-{DRIVER}"}, "spec": spec}]


class Node:
    """A simulated dgx-h100 with the DRA plugin's Preparer and the claims it was asked to prepare."""

    def __init__(self, root: Path) -> None:
        self.backend = SimBackend.from_profile("dgx-h100")
        self.gpus = self.backend.gpus()
        self.config: Config = dra_config(root)
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}

        async def fetch(ref: ClaimRef) -> dict[str, Any]:
            return self.claims[(ref.namespace, ref.name)]

        async def lister() -> list[dict[str, Any]]:
            return _slices(self.gpus)

        self.preparer = Preparer(
            config=self.config,
            fetch_claim=fetch,
            directory=DeviceDirectory(lister, driver=DRIVER, node=HOST),
            gpus=lambda: self.gpus,
            with_device_nodes=False,
        )

    def prepare(
        self,
        name: str,
        device: str,
        memory: str | None,
        namespace: str = "team-a",
        compute: str | None = None,
    ) -> ClaimDevice:
        """Allocate and prepare a claim of one device (consuming `compute` too, when given); the device
        as the kubelet then lists it."""
        body = claim_body(
            name,
            namespace=namespace,
            device=device,
            memory=memory,
            pool=HOST,
            share=new_uid() if memory is not None else None,
        )
        if compute is not None:
            body["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["compute"] = compute
        self.claims[(namespace, name)] = body
        meta = body["metadata"]
        prepared = asyncio.run(self.preparer.prepare(ClaimRef(namespace, meta["uid"], name)))
        return ClaimDevice(DRIVER, HOST, device, None, prepared.cdi_ids)

    def region(self, device: ClaimDevice) -> Path:
        parsed = names.claim_of_cdi_id(DRIVER, device.cdi_ids[0])
        assert parsed is not None
        return self.config.state_dir / "dra" / "memcap" / names.claim_region_key(parsed[0])

    def collector(self, kubelet: PodResourcesStandIn) -> MetricsCollector:
        from gpunode.node.kubelet.podresources import PodAttribution

        return MetricsCollector(
            backend=self.backend,
            hostname=HOST,
            attribution=PodAttribution(kubelet.socket_path),
            regions_root=self.config.state_dir / "memcap",
            dra_driver=DRIVER,
            dra_root=self.config.state_dir / "dra",
        )


def test_the_kubelet_lists_each_containers_claims_and_their_devices(kubelet: PodResourcesStandIn) -> None:
    dev = ClaimDevice(DRIVER, "pool-a", "gpu-0-shared", "7f3c", (f"{DRIVER}/claim=x-0",))
    other = ClaimDevice("net.example.com", "pool-b", "nic-1", None, ())
    kubelet.set_pods(
        [
            Pod(
                "team-a",
                "trainer",
                (
                    Container("main", {}, (Claim("gpu", "team-a", (dev, other)),)),
                    Container("sidecar", {}, (Claim("empty", "team-a"),)),  # no devices: left out
                ),
            )
        ]
    )
    containers, claims = asyncio.run(list_pod_resources(kubelet.socket_path))
    assert containers == ()
    assert claims == (ContainerClaim("team-a", "trainer", "main", "gpu", "team-a", (dev, other)),)


@needs_memcap
def test_a_shared_claim_is_charged_to_its_pod_and_a_whole_gpu_claim_labels_the_gpu(
    tmp_path: Path, kubelet: PodResourcesStandIn
) -> None:
    node = Node(tmp_path)
    gpu1, gpu2 = node.gpus[1], node.gpus[2]
    share = node.prepare("notebook-gpu", shared_device_name(gpu1.uuid), "4Gi")
    whole = node.prepare("trainer-gpu", gpu_device_name(gpu2.uuid), None, namespace="team-b")
    kubelet.set_pods(
        [
            Pod(
                "team-a",
                "notebook",
                (Container("jupyter", {}, (Claim("notebook-gpu", "team-a", (share,)),)),),
            ),
            Pod("team-b", "trainer", (Container("main", {}, (Claim("trainer-gpu", "team-b", (whole,)),)),)),
        ]
    )
    collector = node.collector(kubelet)
    with CappedProcess(node.region(share), {0: GIB + 512 * 2**20}):
        asyncio.run(collector.collect_once())
    out = scrape(collector)

    used = out.one("gpunode_container_memory_used_bytes", dra_claim_name="notebook-gpu")
    assert used.value == GIB + 512 * 2**20
    assert out.one("gpunode_container_memory_limit_bytes", dra_claim_name="notebook-gpu").value == 4 * GIB
    assert {k: used.labels[k] for k in (*DRA_LABELS, "namespace", "pod", "container", "UUID")} == {
        "dra_claim_name": "notebook-gpu",
        "dra_claim_namespace": "team-a",
        "dra_device_name": shared_device_name(gpu1.uuid),
        "dra_driver_name": DRIVER,
        "dra_pool_name": HOST,
        "namespace": "team-a",
        "pod": "notebook",
        "container": "jupyter",
        "UUID": gpu1.uuid,
    }
    # The shared GPU's own series carry no pod: several claims may hold shares of it.
    temp1 = out.one("DCGM_FI_DEV_GPU_TEMP", UUID=gpu1.uuid)
    assert "pod" not in temp1.labels and "dra_claim_name" not in temp1.labels

    # The whole GPU's dcgm-exporter series carry the claim and the pod, in dcgm-exporter's order.
    temp2 = out.one("DCGM_FI_DEV_GPU_TEMP", UUID=gpu2.uuid)
    assert temp2.labels["dra_claim_name"] == "trainer-gpu" and temp2.labels["pod"] == "trainer"
    assert temp2.labels["dra_device_name"] == gpu_device_name(gpu2.uuid)
    tail = temp2.label_order[temp2.label_order.index("DCGM_FI_DRIVER_VERSION") + 1 :]
    assert tail == ("container", *DRA_LABELS, "namespace", "pod")
    # No region for a whole GPU: nothing to charge but the GPU itself.
    assert not out.named("gpunode_container_memory_used_bytes", dra_claim_name="trainer-gpu")


@needs_memcap
def test_a_claim_used_by_two_containers_is_charged_once_to_its_pod(
    tmp_path: Path, kubelet: PodResourcesStandIn
) -> None:
    node = Node(tmp_path)
    share = node.prepare("pair", shared_device_name(node.gpus[0].uuid), "8Gi")
    both = (Claim("pair", "team-a", (share,)),)
    kubelet.set_pods([Pod("team-a", "duo", (Container("a", {}, both), Container("b", {}, both)))])
    collector = node.collector(kubelet)
    with CappedProcess(node.region(share), {0: GIB}):
        asyncio.run(collector.collect_once())
    [used] = scrape(collector).named("gpunode_container_memory_used_bytes", dra_claim_name="pair")
    assert used.value == GIB and used.labels["pod"] == "duo"
    assert "container" not in used.labels  # two containers use it: the claim is charged, not each of them


@needs_memcap
def test_ids_the_plugin_did_not_prepare_charge_nobody(tmp_path: Path, kubelet: PodResourcesStandIn) -> None:
    """The kubelet's list is joined to this node's own records: an ID of another driver, of a claim not
    prepared here, naming another device, or that is no UID at all attributes nothing to anyone."""
    node = Node(tmp_path)
    gpu = node.gpus[3]
    share = node.prepare("real", shared_device_name(gpu.uuid), "2Gi")
    stolen = share.cdi_ids[0]
    unknown = names.claim_cdi_id(DRIVER, new_uid(), 0)
    impostors = (
        ClaimDevice("evil.example.com", HOST, share.device, None, (stolen,)),  # our ID, another driver
        ClaimDevice(DRIVER, HOST, share.device, None, (unknown,)),  # a claim never prepared here
        ClaimDevice(DRIVER, HOST, gpu_device_name(gpu.uuid), None, (stolen,)),  # our ID, another device
        ClaimDevice(DRIVER, HOST, share.device, None, (f"{DRIVER}/claim=../../etc/passwd-0",)),
        ClaimDevice(DRIVER, HOST, share.device, None, (stolen.replace("-0", "-9"),)),  # no such result
    )
    kubelet.set_pods(
        [
            Pod("team-x", "thief", (Container("c", {}, (Claim("steal", "team-x", impostors),)),)),
            Pod("team-a", "owner", (Container("c", {}, (Claim("real", "team-a", (share,)),)),)),
        ]
    )
    collector = node.collector(kubelet)
    with CappedProcess(node.region(share), {0: GIB}):
        asyncio.run(collector.collect_once())
    out = scrape(collector)
    [used] = out.named("gpunode_container_memory_used_bytes", UUID=gpu.uuid)
    assert (used.labels["pod"], used.labels["dra_claim_name"]) == ("owner", "real")
    assert not [s for s in out.samples if s.labels.get("pod") == "thief"]
    assert "pod" not in out.one("DCGM_FI_DEV_GPU_TEMP", UUID=gpu.uuid).labels


@needs_memcap
def test_an_unprepared_claim_is_no_longer_charged(tmp_path: Path, kubelet: PodResourcesStandIn) -> None:
    node = Node(tmp_path)
    whole = node.prepare("gone", gpu_device_name(node.gpus[4].uuid), None)
    kubelet.set_pods([Pod("team-a", "p", (Container("c", {}, (Claim("gone", "team-a", (whole,)),)),))])
    collector = node.collector(kubelet)
    asyncio.run(collector.collect_once())
    assert scrape(collector).one("DCGM_FI_DEV_GPU_TEMP", UUID=node.gpus[4].uuid).labels["pod"] == "p"
    parsed = names.claim_of_cdi_id(DRIVER, whole.cdi_ids[0])
    assert parsed is not None
    asyncio.run(node.preparer.unprepare(ClaimRef("team-a", parsed[0], "gone")))
    collector._attribution.ttl_s = 0.0  # type: ignore[union-attr]  # ask the kubelet again
    asyncio.run(collector.collect_once())
    # The kubelet may still list the pod a moment after unprepare: only what this node holds is charged.
    assert "pod" not in scrape(collector).one("DCGM_FI_DEV_GPU_TEMP", UUID=node.gpus[4].uuid).labels


def test_a_mig_placement_held_by_a_claim_labels_its_instance(
    tmp_path: Path, kubelet: PodResourcesStandIn
) -> None:
    from gpunode.node.kubelet.podresources import PodAttribution
    from tests.node.test_dra_mig import MigNode

    node = MigNode(tmp_path, with_device_nodes=False)
    gpu = node.gpus[4]
    [mig] = [m for m in gpu.mig_devices if m.gi_id == 2]  # 3g.40gb at memory slice 4
    ref = node.claim("mig", gpu, "3g.40gb", 4)
    prepared = asyncio.run(node.preparer.prepare(ref))
    device = prepared.plan.devices[0]
    held = ClaimDevice(DRIVER, device.pool, device.device, None, prepared.cdi_ids)
    kubelet.set_pods([Pod("team-a", "infer", (Container("c", {}, (Claim("mig", "team-a", (held,)),)),))])
    collector = MetricsCollector(
        backend=node.backend,
        hostname=HOST,
        attribution=PodAttribution(kubelet.socket_path),
        dra_driver=DRIVER,
        dra_root=node.config.state_dir / "dra",
    )
    asyncio.run(collector.collect_once())
    out = scrape(collector)
    [used] = out.named("DCGM_FI_DEV_FB_USED", UUID=gpu.uuid, GPU_I_ID="2")
    assert (used.labels["pod"], used.labels["dra_claim_name"]) == ("infer", "mig")
    assert used.labels["dra_device_name"] == device.device and used.labels["GPU_I_PROFILE"] == "3g.40gb"
    # the GPU's other instance and the GPU itself are not the claim's
    assert "pod" not in out.one("DCGM_FI_DEV_FB_USED", UUID=gpu.uuid, GPU_I_ID="1").labels
    assert mig.uuid == device.mig_uuid
