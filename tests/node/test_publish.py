"""The agent publishes its GPU state on its Node: assignments from pod-resources, health, topology."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.config.agent import parse_config
from gpunode.contract.deviceids import memory_unit_id, replica_id
from gpunode.contract.names import GIB, GPU_MEMORY_RESOURCE, GPU_RESOURCE, MIB, Sharing
from gpunode.contract.nodestate import ANNOTATION_KEY, GpuRecord, MigInstance, decode, encode
from gpunode.node.agent import Agent
from gpunode.node.allocation.preferred import placement_node
from gpunode.node.devices.base import Gpu, MigDevice
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import build_inventory
from gpunode.node.kubelet.podresources import ContainerDevices
from gpunode.node.publish import node_gpu_state
from gpunode.node.state import Snapshot
from gpunode.placement import Request, TargetPod, TargetWorkload, place, unfit_reason
from gpunode.placement.published import node_state
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.apiserver import ApiServerStandIn
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn

NODE = "gpu-node-1"


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.add_node(NODE)
        yield server


def kubeconfig(path: Path, url: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def annotation(api: ApiServerStandIn) -> dict[str, Any] | None:
    text = api.node(NODE)["metadata"].get("annotations", {}).get(ANNOTATION_KEY)
    return None if text is None else json.loads(text)


def test_annotation_follows_assignment_and_health(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn
) -> None:
    doc = {
        "sharing": {
            "timeSlicing": {
                "renameByDefault": True,
                "resources": [{"name": "nvidia.com/gpu", "replicas": 4, "devices": [1]}],
            }
        },
        "gpunode": {
            "nodeName": NODE,
            "podResourcesSocket": str(sockdir / "pr.sock"),
            "nodeState": {"interval": "1s"},
            "remediation": {"mode": "off", "kubeconfig": str(kubeconfig(sockdir / "kubeconfig", api.url))},
            "health": {"recoveryWindow": "60s"},
        },
    }
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        pr.set_pods(
            [
                ContainerDevices("team-a", "train-0", "main", "nvidia.com/gpu", (gpus[0].uuid,)),
                ContainerDevices(
                    "team-b", "infer-1", "srv", "nvidia.com/gpu.shared", (f"{gpus[1].uuid}::0",)
                ),
            ]
        )
        cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
        with RunningAgent(Agent(cfg, backend=backend)):
            api.wait_for(lambda: annotation(api) is not None, what="the first annotation")
            state = decode(api.node(NODE)["metadata"]["annotations"][ANNOTATION_KEY], node=NODE)
            by_index = {g.index: g for g in state.gpus}
            assert by_index[0].milli_assigned == 1000 and by_index[0].pods == ("team-a/train-0",)
            assert by_index[1].sharing == "time-sliced" and by_index[1].milli_assigned == 250
            assert by_index[1].pods == ("team-b/infer-1",)
            assert by_index[2].milli_assigned == 0 and by_index[2].healthy
            assert by_index[0].numa_node == 0 and by_index[3].numa_node == 1
            first_generation = state.generation

            backend.inject_xid(gpus[2].uuid, 79)
            api.wait_for(
                lambda: not decode(json.dumps(annotation(api))).gpus[2].healthy, what="GPU 2 unhealthy"
            )
            after = decode(json.dumps(annotation(api)))
            assert after.generation > first_generation
            assert [g.healthy for g in after.gpus] == [True, True, False, True]

            patches = api.requests("PATCH", f"/api/v1/nodes/{NODE}$")
            assert patches, "the annotation is written with a PATCH of the Node"


def test_api_server_errors_are_retried(sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn) -> None:
    api.fail("PATCH", f"/api/v1/nodes/{NODE}$", 500, times=2)
    doc = {
        "gpunode": {
            "nodeName": NODE,
            "podResourcesSocket": str(sockdir / "missing.sock"),
            "remediation": {"mode": "off", "kubeconfig": str(kubeconfig(sockdir / "kubeconfig", api.url))},
        }
    }
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    ra = RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4")))
    with ra:
        kubelet.wait_for_resources(["nvidia.com/gpu"])
        publisher = ra.agent.publisher
        publisher.retry_initial_s = 0.05
        api.wait_for(
            lambda: annotation(api) is not None, timeout=15, what="the annotation after two failures"
        )
        assert publisher.failures >= 1
        state = decode(json.dumps(annotation(api)), node=NODE)
        assert len(state.gpus) == 4 and all(g.milli_assigned == 0 for g in state.gpus)


# -- what the annotation says per sharing mode (built from a snapshot, no API server) ----------------

MIG_MEMORY = {"1g.10gb": 9856 * MIB, "2g.20gb": 19968 * MIB, "3g.40gb": 40192 * MIB}


def hand_gpu(index: int, *, mig: list[str] | None = None, memory: int = 80 * GIB) -> Gpu:
    """An A100 built by hand; `mig` lists its MIG devices' profiles (None: MIG disabled)."""
    uuid = f"GPU-{index:08x}-0000-4000-8000-00000000a100"
    migs = tuple(
        MigDevice(
            uuid=f"MIG-{index:04x}{m:04x}-0000-4000-8000-00000000a100",
            parent_uuid=uuid,
            index=m,
            profile=profile,
            gi_id=m + 1,
            ci_id=0,
            slices=int(profile[0]),
            memory_total_bytes=MIG_MEMORY[profile],
        )
        for m, profile in enumerate(mig or ())
    )
    return Gpu(
        index=index,
        uuid=uuid,
        model="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=memory,
        pci_bus_id=f"00000000:{0x07 + 8 * index:02X}:00.0",
        numa_node=0,
        minor=index,
        mig_enabled=mig is not None,
        mig_devices=migs,
    )


def snapshot_of(gpus: list[Gpu], text: str) -> Snapshot:
    inv = build_inventory(gpus, parse_config(yaml.safe_load(text) or {}, "node.yaml"))
    return Snapshot(version=1, inventory=inv)


def published(snapshot: Snapshot, holders: dict[str, str]) -> dict[int, GpuRecord]:
    """The records the agent publishes, by GPU index, after checking they survive the extender's decode."""
    state = node_gpu_state(snapshot, node=NODE, holders=holders)
    assert decode(encode(state), node=NODE) == state
    return {g.index: g for g in state.gpus}


def test_mig_instances_held_directly_or_through_a_replica_are_assigned() -> None:
    m0 = hand_gpu(0, mig=["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])
    m1 = hand_gpu(1, mig=["1g.10gb"] * 2)
    text = """
flags: {migStrategy: mixed}
sharing: {timeSlicing: {resources: [{name: nvidia.com/mig-1g.10gb, replicas: 2, devices: [1]}]}}
"""
    snap = snapshot_of([m0, m1], text)
    g3, g2, g1a, g1b = m0.mig_devices
    s1 = m1.mig_devices[1]
    holders = {
        g3.uuid: "team-a/train-0",
        g1b.uuid: "team-b/infer-0",
        replica_id(s1.uuid, 1): "team-c/notebook",  # one replica of the second instance of GPU 1
    }
    by_index = published(snap, holders)

    first = by_index[0]
    assert first.sharing == Sharing.MIG
    assert first.mig == (
        MigInstance("3g.40gb", g3.uuid, True),
        MigInstance("2g.20gb", g2.uuid, False),
        MigInstance("1g.10gb", g1a.uuid, False),
        MigInstance("1g.10gb", g1b.uuid, True),
    )
    assert first.milli_assigned == (3 + 1) * 1000 // 7
    assert first.memory_assigned_bytes == MIG_MEMORY["3g.40gb"] + MIG_MEMORY["1g.10gb"]
    assert first.pods == ("team-a/train-0", "team-b/infer-0")

    second = by_index[1]
    assert [m.assigned for m in second.mig] == [False, True]
    assert (second.milli_assigned, second.memory_assigned_bytes) == (1000 // 7, MIG_MEMORY["1g.10gb"])
    assert second.pods == ("team-c/notebook",)

    view = node_state(node_gpu_state(snap, node=NODE, holders=holders), cpu_milli_free=0, memory_free_bytes=0)
    assert dict(view.gpus[0].mig_free) == {"3g.40gb": 0, "2g.20gb": 1, "1g.10gb": 1}
    assert dict(view.gpus[1].mig_free) == {"1g.10gb": 1}


def test_fractional_units_assigned_and_free() -> None:
    g0, g1, g2 = hand_gpu(0), hand_gpu(1), hand_gpu(2, memory=15 * GIB)
    snap = snapshot_of([g0, g1, g2], "gpunode: {fractional: {devices: [0, 2], unit: 4Gi}}")
    holders = {
        memory_unit_id(g0.uuid, 0): "team-a/a",
        memory_unit_id(g0.uuid, 1): "team-a/a",
        memory_unit_id(g0.uuid, 7): "team-b/b",
        g1.uuid: "team-c/whole",
        **{memory_unit_id(g2.uuid, n): "team-d/d" for n in range(3)},  # all 3 units of 4 GiB
    }
    by_index = published(snap, holders)

    frac = by_index[0]
    assert frac.sharing == Sharing.FRACTIONAL and frac.mig == ()
    assert frac.memory_assigned_bytes == 3 * 4 * GIB
    assert frac.milli_assigned == 12 * 1000 // 80  # the compute share follows memory, rounded down
    assert frac.pods == ("team-a/a", "team-b/b")

    whole = by_index[1]
    assert whole.sharing == Sharing.WHOLE
    assert (whole.milli_assigned, whole.memory_assigned_bytes) == (1000, 80 * GIB)

    full = by_index[2]
    assert full.memory_assigned_bytes == 12 * GIB and full.milli_assigned == 800
    view = node_state(node_gpu_state(snap, node=NODE, holders=holders), cpu_milli_free=0, memory_free_bytes=0)
    # Free is total - assigned: the 3 GiB under one unit stays free memory, though no unit is left.
    assert view.gpus[2].memory_free_bytes == 3 * GIB and view.gpus[2].milli_free == 200
    assert view.gpus[0].memory_free_bytes == 68 * GIB and view.gpus[0].milli_free == 850


@pytest.mark.parametrize(
    ("cap", "held", "milli", "memory"),
    [
        pytest.param("", 1, 250, 20 * GIB, id="uncapped-share-of-memory"),
        pytest.param("gpunode: {replicaMemoryCap: equal}", 3, 750, 60 * GIB, id="equal-caps"),
        pytest.param("gpunode: {replicaMemoryCap: 10Gi}", 2, 500, 20 * GIB, id="fixed-caps"),
        pytest.param("", 0, 0, 0, id="nothing-held"),
    ],
)
def test_time_sliced_share_follows_the_held_replicas(cap: str, held: int, milli: int, memory: int) -> None:
    g0 = hand_gpu(0)
    text = "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}\n" + cap
    snap = snapshot_of([g0], text)
    holders = {replica_id(g0.uuid, n): f"team/p{n}" for n in range(held)}
    record = published(snap, holders)[0]
    assert record.sharing == Sharing.TIME_SLICED
    assert (record.milli_assigned, record.memory_assigned_bytes) == (milli, memory)
    assert record.pods == tuple(f"team/p{n}" for n in range(held))


def test_unhealthy_gpus_and_nvlink_peers_are_published() -> None:
    g0, g1 = hand_gpu(0), hand_gpu(1)
    g0 = replace(g0, nvlink_peers=(g0.uuid, g1.uuid))  # a peer list may name the GPU itself
    inv = build_inventory([g0, g1], parse_config({}, "node.yaml"))
    snap = Snapshot(version=1, inventory=inv, unhealthy={g1.uuid: "XID 79"})
    by_index = published(snap, {})
    assert by_index[0].healthy and not by_index[1].healthy
    assert by_index[0].nvlink_peers == (g1.uuid,)


def test_preferred_allocation_sees_what_the_node_publishes() -> None:
    """GetPreferredAllocation counts what the kubelet does not offer as held; with the same devices
    held, its view equals the extender's view of the published annotation."""
    g0, g1, g2 = hand_gpu(0), hand_gpu(1), hand_gpu(2)
    snap = snapshot_of([g0, g1, g2], "gpunode: {fractional: {devices: [0, 1], unit: 10Gi}}")
    units = [d.id for d in snap.inventory.by_resource(GPU_MEMORY_RESOURCE)]
    held = {memory_unit_id(g0.uuid, n) for n in (0, 3)} | {memory_unit_id(g1.uuid, n) for n in range(8)}
    offered = [u for u in units if u not in held]
    node_view = placement_node(snap, resource=GPU_MEMORY_RESOURCE, offered=offered)
    published_view = node_state(
        node_gpu_state(snap, node="this-node", holders=dict.fromkeys(held, "")),
        cpu_milli_free=0,
        memory_free_bytes=0,
    )
    assert node_view == published_view
    assert [g.memory_free_bytes for g in node_view.gpus] == [60 * GIB, 0, 80 * GIB]

    whole_view = placement_node(snap, resource=GPU_RESOURCE, offered=[])
    assert [g.milli_free for g in whole_view.gpus] == [1000, 1000, 0]  # GPU 2 not offered: held


def test_fractional_gpus_are_published_as_not_serving_whole_requests() -> None:
    """A GPU the agent shares in memory units is advertised only as units, never as nvidia.com/gpu, so its
    record says that whole-GPU requests do not take it; the extender, reading the annotation, then offers
    a whole-GPU pod only the GPUs the node advertises whole, and says why when they are too few."""
    gpus = [hand_gpu(0), hand_gpu(1), hand_gpu(2), hand_gpu(3)]
    text = """
gpunode: {fractional: {devices: [0, 1], unit: 10Gi}}
sharing: {timeSlicing: {renameByDefault: true, resources: [{name: nvidia.com/gpu, replicas: 2, devices: [3]}]}}
"""
    snap = snapshot_of(gpus, text)
    assert {d.gpu_uuid for d in snap.inventory.by_resource(GPU_RESOURCE)} == {gpus[2].uuid}
    by_index = published(snap, {})
    assert [by_index[i].sharing for i in range(4)] == [
        Sharing.FRACTIONAL,
        Sharing.FRACTIONAL,
        Sharing.WHOLE,
        Sharing.TIME_SLICED,
    ]
    assert [by_index[i].serves_whole for i in range(4)] == [False, False, True, False]
    text_out = encode(node_gpu_state(snap, node=NODE, holders={}))
    assert [g["servesWhole"] for g in json.loads(text_out)["gpus"]] == [False, False, True, False]

    view = node_state(decode(text_out, node=NODE), cpu_milli_free=64_000, memory_free_bytes=2**36)
    assert all(g.fully_free for g in view.gpus)
    for policy in ("gpunode", "bestfit", "packing", "spread"):
        workload = TargetWorkload(
            (TargetPod(cpu_milli=0, gpu_milli=1000, gpus=1, gpu_models=None, weight=1),)
        )
        choice = place([view], Request(gpus=1), policy=policy, workload=workload)
        assert choice is not None and choice.gpu_uuids == (gpus[2].uuid,), policy
    assert unfit_reason(view, Request(gpus=2)) == (
        "insufficient whole GPUs: 1 free, 2 requested; 2 more free but shared by memory only (not offered whole)"
    )
    assert unfit_reason(view, Request(gpu_memory_bytes=10 * GIB)) is None  # the units still serve fractions
