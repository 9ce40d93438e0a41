"""NVIDIA's `sharing.mps`, carried by gpunode's own enforcement: each replica a memory cap of 1/replicas of
the GPU and a hard compute share of 1/replicas, with NVIDIA's meaning of the section's keys.

The configuration cases follow NVIDIA's parser tests for replicated resources (api/config/v1/
replicas_test.go: names, renames, replica counts, device lists) and its plugin's MPS refusals (MIG
devices, migStrategy mixed), written down here as gpunode reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from gpunode.config.agent import parse_config, shared_resource_name
from gpunode.errors import ConfigError
from gpunode.node import memcap
from gpunode.node.agent import Agent
from gpunode.node.allocation.shares import plan_shares
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import build_inventory, region_key
from gpunode.node.memcap.checkpoint import CapRecord
from gpunode.node.memcap.compute import ComputeMode, read_compute
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn

GPU_UUID = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"
SHARED = "nvidia.com/gpu.shared"


def mps(*resources: dict[str, Any], **section: Any) -> dict[str, Any]:
    return {"sharing": {"mps": {"resources": list(resources), **section}}}


def gpu(**resource: Any) -> dict[str, Any]:
    return {"name": "nvidia.com/gpu", "replicas": 2, **resource}


def refused(doc: dict[str, Any], *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(doc, "cfg.yaml")
    message = str(info.value)
    assert message.startswith("cfg.yaml: ") and "\n" not in message and info.value.hint, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --- what NVIDIA's parser accepts ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resource", "devices"),
    [
        pytest.param(gpu(), "all GPUs", id="replicas-only"),
        pytest.param(gpu(devices="all"), "all GPUs", id="devices-all"),
        pytest.param(gpu(name="gpu"), "all GPUs", id="bare-name-gets-the-nvidia-prefix"),
        pytest.param(gpu(devices=[0]), "index 0", id="device-index"),
        pytest.param(gpu(devices=["0"]), "index 0", id="device-index-as-text"),
        pytest.param(gpu(devices=[GPU_UUID]), GPU_UUID, id="gpu-uuid"),
    ],
)
def test_mps_resources_nvidia_accepts(resource: dict[str, Any], devices: str) -> None:
    cfg = parse_config(mps(resource), "c")
    assert cfg.time_slicing.mps
    (res,) = cfg.time_slicing.resources
    assert (res.name, res.replicas, res.devices.describe()) == ("nvidia.com/gpu", 2, devices)


@pytest.mark.parametrize(
    ("doc", "advertised"),
    [
        pytest.param(mps(gpu()), "nvidia.com/gpu", id="plain"),
        pytest.param(mps(gpu(), renameByDefault=True), SHARED, id="rename-by-default"),
        pytest.param(mps(gpu(rename="gpu-mps")), "nvidia.com/gpu-mps", id="rename"),
        pytest.param(mps(gpu(rename="valid"), renameByDefault=True), "nvidia.com/valid", id="rename-wins"),
    ],
)
def test_mps_resources_are_advertised_under_nvidias_names(doc: dict[str, Any], advertised: str) -> None:
    cfg = parse_config(doc, "c")
    assert shared_resource_name(cfg, cfg.time_slicing.resources[0]) == advertised


def test_mps_root_is_accepted_with_mps() -> None:
    cfg = parse_config({"flags": {"mpsRoot": "/run/nvidia/mps"}, **mps(gpu(replicas=4))}, "c")
    assert cfg.time_slicing.mps and cfg.time_slicing.resources[0].replicas == 4


# --- what NVIDIA refuses, and what gpunode refuses with MPS ---------------------------------------------


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        pytest.param(mps(gpu(replicas=1)), "must be at least 2", id="one-replica"),
        pytest.param(mps(gpu(replicas=0)), "must be at least 2", id="zero-replicas"),
        pytest.param(mps(gpu(replicas=-1)), "must be at least 2", id="negative-replicas"),
        pytest.param(mps({"name": "nvidia.com/gpu"}), "replicas", id="no-replicas"),
        pytest.param(mps({"name": "nvidia.com/gpu", "devices": "all"}), "replicas", id="devices-no-replicas"),
        pytest.param(mps(gpu(name="$invalid$")), "$invalid$", id="invalid-name"),
        pytest.param(mps(gpu(rename="$invalid$")), "$invalid$", id="invalid-rename"),
        pytest.param(mps(gpu(devices=["GPU-UUID"])), "GPU-UUID", id="malformed-uuid"),
        pytest.param(mps(gpu(devices=[-1])), "-1", id="negative-index"),
        pytest.param(mps(gpu(devices="not-all")), "not-all", id="not-all"),
        pytest.param(mps(), "no resources listed", id="no-resources"),
        pytest.param({"sharing": {"mps": {}}}, "no resources listed", id="empty-section"),
        pytest.param({"sharing": {"mps": None}}, "present but empty", id="key-left-empty"),
        pytest.param(mps(gpu(), gpu()), "listed twice under mps.resources", id="listed-twice"),
        pytest.param(
            mps(gpu(name="nvidia.com/mig-1g.10gb")), "MPS is not supported for MIG devices", id="mig-profile"
        ),
        pytest.param(
            {"flags": {"migStrategy": "mixed"}, **mps(gpu())},
            "migStrategy mixed is not supported with MPS",
            id="mig-strategy-mixed",
        ),
        pytest.param(
            {"sharing": {"timeSlicing": {"resources": [gpu()]}, "mps": {"resources": [gpu()]}}},
            "timeSlicing and mps are both given",
            id="mixed-with-time-slicing",
        ),
        pytest.param(
            {"gpunode": {"replicaMemoryCap": "10Gi"}, **mps(gpu())},
            "MPS replicas are each capped at 1/replicas",
            id="another-replica-cap",
        ),
    ],
)
def test_mps_cases_that_are_refused(doc: dict[str, Any], fragment: str) -> None:
    refused(doc, fragment)


def test_mps_on_mig_devices_through_mig_strategy_single_is_refused() -> None:
    backend = SimBackend.from_profile("a100-mig")
    cfg = parse_config({"flags": {"migStrategy": "single"}, **mps(gpu())}, "cfg.yaml")
    with pytest.raises(ConfigError, match="sharing using MPS is not supported for MIG devices"):
        build_inventory(backend.gpus()[:2], cfg)  # two GPUs with seven 1g.10gb devices each


def test_each_replica_is_an_equal_part_of_the_gpus_memory() -> None:
    backend = SimBackend.from_profile("t4")
    cfg = parse_config({**mps(gpu(replicas=3)), "gpunode": {"replicaMemoryCap": "equal"}}, "c")
    inventory = build_inventory(backend.gpus(), cfg)
    first = backend.gpus()[0]
    replicas = [d for d in inventory.devices if d.gpu_uuid == first.uuid]
    assert len(replicas) == 3 and {d.kind for d in replicas} == {"replica"}
    assert {d.memory_cap_bytes for d in replicas} == {first.memory_total_bytes // 3}
    assert "MPS-shared" in replicas[0].reason


def test_an_mps_replicas_share_is_fixed_whatever_its_pod_asks() -> None:
    recs = [CapRecord(k, SHARED, (k,), "G0", 4, 16, False, 1.0) for k in ("a", "b")]
    planned, refused_asks = plan_shares(
        recs, {"a": "ns/a", "b": "ns/b"}, {"ns/a": 900}, {}, now=2.0, fixed={"a"}
    )
    assert {p.key: (p.share_milli, p.explicit) for p in planned} == {"a": (250, False), "b": (250, False)}
    assert refused_asks == []


# --- Allocate: the cap and the hard share land in the region -----------------------------------------


def test_allocate_of_an_mps_replica_writes_its_cap_and_a_hard_share(
    sockdir: Path, kubelet: KubeletStandIn
) -> None:
    doc = {**mps(gpu(replicas=4), renameByDefault=True, failRequestsGreaterThanOne=True)}
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    with RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4"))) as ra:
        kubelet.wait_for_resources([SHARED])
        assert "nvidia.com/gpu" not in kubelet.plugins  # renameByDefault: only the .shared resource
        target = ra.agent.backend.gpus()[2]
        assert len([i for i in kubelet.healthy(SHARED) if i.startswith(target.uuid)]) == 4
        dev = f"{target.uuid}::1"
        resp = kubelet.allocate(SHARED, [dev])
        region = memcap.load_region(sockdir / "state" / "memcap" / region_key([dev]))
        assert region.devices[0].limit_bytes == target.memory_total_bytes // 4  # MPS's pinned memory limit
        compute = read_compute(region)
        assert (compute.share_milli, compute.mode) == (
            250,
            ComputeMode.HARD,
        )  # active threads: 100/replicas %
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == target.uuid
        assert resp.envs["LD_PRELOAD"].endswith("libgpunode-preload.so")
        assert not any("CUDA_MPS" in k for k in resp.envs), (
            "no MPS daemon: its pipe directory is not handed out"
        )
        with pytest.raises(grpc.RpcError) as err:  # failRequestsGreaterThanOne, as NVIDIA's plugin
            kubelet.allocate(SHARED, [f"{target.uuid}::2", f"{target.uuid}::3"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sharing.mps.failRequestsGreaterThanOne" in (err.value.details() or "")
