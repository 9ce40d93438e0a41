"""What the idle-GPU watch measures per pod: whole GPUs, MIG devices, shared GPUs, several GPUs."""

from __future__ import annotations

from typing import Any

from gpunode.config.agent import parse_config
from gpunode.node.devices.base import GpuSample, MigSample
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.idle import parse_rfc3339, pod_utilisation, pods_of, rfc3339
from gpunode.node.inventory import Inventory, build_inventory
from gpunode.node.kubelet.podresources import ContainerDevices


def inventory(profile: str, doc: dict[str, Any]) -> Inventory:
    return build_inventory(SimBackend.from_profile(profile).gpus(), parse_config(doc, "c.yaml"))


def test_whole_gpus_and_several_gpus_per_pod() -> None:
    inv = inventory("t4", {})
    g0, g1 = inv.gpus[0].uuid, inv.gpus[1].uuid
    held = pods_of(
        [
            ContainerDevices("ns", "two", "a", "nvidia.com/gpu", (g0,)),
            ContainerDevices("ns", "two", "b", "nvidia.com/gpu", (g1,)),
            ContainerDevices("ns", "other", "a", "example.com/fpga", (g0,)),  # not ours: ignored
            ContainerDevices("ns", "ghost", "a", "nvidia.com/gpu", ("GPU-not-here",)),  # unknown ID
        ],
        inv,
    )
    assert list(held) == [("ns", "two")]
    targets = held[("ns", "two")]
    assert [t.gpu_uuid for t in targets] == [g0, g1] and not any(t.shared for t in targets)
    assert targets[0].name == f"GPU 0 ({g0})"
    idle, busy = GpuSample(g0, gpu_util=0.01), GpuSample(g1, gpu_util=0.6)
    # Idle only when every GPU of the pod is: the busiest one decides.
    assert pod_utilisation({g0: idle, g1: busy}, targets) == 0.6
    assert pod_utilisation({g0: idle, g1: GpuSample(g1, gpu_util=0.02)}, targets) == 0.02
    # A GPU that could not be read leaves the pod unjudged.
    assert pod_utilisation({g0: idle, g1: None}, targets) is None
    assert pod_utilisation({g0: idle}, targets) is None
    # No utilisation from the driver: the graphics-engine activity stands in.
    assert pod_utilisation({g0: idle, g1: GpuSample(g1, gr_engine_active=0.3)}, targets) == 0.3


def test_a_shared_gpu_is_measured_as_a_whole() -> None:
    doc = {
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4, "devices": [1]}]}}
    }
    inv = inventory("t4", doc)
    g1 = inv.gpus[1].uuid
    replicas = [d for d in inv.devices if d.gpu_uuid == g1]
    assert len(replicas) == 4
    held = pods_of(
        [
            ContainerDevices("ns", "a", "c", replicas[0].resource, (replicas[0].id,)),
            ContainerDevices("ns", "b", "c", replicas[1].resource, (replicas[1].id,)),
        ],
        inv,
    )
    (ta,), (tb,) = held[("ns", "a")], held[("ns", "b")]
    assert ta.shared and tb.shared and ta.gpu_uuid == tb.gpu_uuid == g1
    # Pod b's work shows on the GPU: neither sharer is idle while the GPU is busy.
    sample = {g1: GpuSample(g1, gpu_util=0.4)}
    assert pod_utilisation(sample, (ta,)) == pod_utilisation(sample, (tb,)) == 0.4


def test_a_mig_device_is_measured_by_its_own_activity() -> None:
    inv = inventory("a100-mig", {"flags": {"migStrategy": "mixed"}})
    mig = next(d for d in inv.devices if d.kind == "mig")
    assert mig.mig_uuid is not None
    held = pods_of([ContainerDevices("ns", "m", "c", mig.resource, (mig.id,))], inv)
    (target,) = held[("ns", "m")]
    assert target.mig_uuid == mig.mig_uuid and "MIG device" in target.name
    sample = GpuSample(
        mig.gpu_uuid,
        gpu_util=None,  # a MIG-enabled GPU reports no utilisation of its own
        mig=(MigSample("MIG-other", gr_engine_active=0.9), MigSample(mig.mig_uuid, gr_engine_active=0.02)),
    )
    assert pod_utilisation({mig.gpu_uuid: sample}, (target,)) == 0.02
    no_profiling = GpuSample(mig.gpu_uuid, mig=(MigSample(mig.mig_uuid),))
    assert pod_utilisation({mig.gpu_uuid: no_profiling}, (target,)) is None


def test_annotation_times() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00Z"
    assert parse_rfc3339("2026-11-24T12:42:08Z") == 1795524128.0
    assert parse_rfc3339("2026-11-24T12:42:08") is None  # no zone: not RFC 3339
    assert parse_rfc3339("yesterday") is None
    assert parse_rfc3339("9" * 100_000) is None
