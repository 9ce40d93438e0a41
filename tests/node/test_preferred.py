"""GetPreferredAllocation's policy per kind of device, without gRPC (the e2e tests run it through the plugin)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gpunode.config.agent import parse_config
from gpunode.contract.deviceids import memory_unit_id, replica_id
from gpunode.contract.names import GPU_MEMORY_RESOURCE, GPU_RESOURCE, mig_resource_name
from gpunode.errors import AllocationError
from gpunode.node.allocation.preferred import preferred_allocation
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import build_inventory
from gpunode.node.state import Snapshot


def snapshot(profile: str, text: str, *, unhealthy: dict[str, str] | None = None) -> Snapshot:
    gpus = SimBackend.from_profile(profile).gpus()
    inv = build_inventory(gpus, parse_config(yaml.safe_load(text) or {}, "node.yaml"))
    return Snapshot(version=1, inventory=inv, unhealthy=unhealthy or {})


SHARED = "nvidia.com/gpu.shared"
SLICED = "sharing: {timeSlicing: {renameByDefault: true, resources: [{name: nvidia.com/gpu, replicas: 4}]}}"


@pytest.mark.parametrize("mode", ["spread", "pack"])
def test_replicas_spread_or_pack(mode: str) -> None:
    snap = snapshot("t4", SLICED)
    gpus = snap.inventory.gpus
    # GPU 3 has one replica left, the others all four.
    available = [replica_id(g.uuid, n) for g in gpus[:3] for n in range(4)] + [replica_id(gpus[3].uuid, 3)]
    chosen = preferred_allocation(snap, SHARED, available, [], 3, replica_placement=mode)
    index = {g.uuid: g.index for g in gpus}
    assert len(chosen) == 3 and len(set(chosen)) == 3
    got = [index[snap.inventory.by_id(c).gpu_uuid] for c in chosen]
    if mode == "spread":
        assert sorted(got) == [0, 1, 2]  # one each from the GPUs with the most free replicas
    else:
        # Packing starts on the fullest GPU (3, one replica left), then the next fullest.
        assert got[0] == 3 and len(set(got[1:])) == 1


def test_must_include_is_kept_and_memory_units_stay_on_one_gpu() -> None:
    snap = snapshot("t4", "gpunode: {fractional: {devices: all, unit: 1Gi}}")
    g0, g1 = snap.inventory.gpus[:2]
    available = [
        d.id for d in snap.inventory.by_resource(GPU_MEMORY_RESOURCE) if d.gpu_uuid in (g0.uuid, g1.uuid)
    ]
    must = memory_unit_id(g1.uuid, 9)
    chosen = preferred_allocation(snap, GPU_MEMORY_RESOURCE, available, [must], 3)
    assert chosen == [must, memory_unit_id(g1.uuid, 0), memory_unit_id(g1.uuid, 1)]
    with pytest.raises(AllocationError, match="span GPUs"):
        preferred_allocation(snap, GPU_MEMORY_RESOURCE, available, [must, memory_unit_id(g0.uuid, 0)], 3)


def test_mig_devices_keep_must_include_then_take_the_lowest_ids() -> None:
    snap = snapshot("a100-mig", "flags: {migStrategy: mixed}")
    resource = mig_resource_name("1g.10gb")
    ids = [d.id for d in snap.inventory.by_resource(resource)]
    last = sorted(ids, key=lambda i: (snap.inventory.by_id(i).gpu_uuid, i))[-1]
    chosen = preferred_allocation(snap, resource, ids, [last], 3)
    assert chosen[0] == last and len(chosen) == 3
    rest = sorted(
        (d for d in snap.inventory.by_resource(resource) if d.id != last), key=lambda d: (d.gpu_uuid, d.id)
    )
    assert chosen[1:] == [d.id for d in rest[:2]]


def test_unknown_and_unhealthy_devices() -> None:
    snap = snapshot("t4", "", unhealthy={})
    gpus = snap.inventory.gpus
    with pytest.raises(AllocationError, match="unknown device ID 'GPU-nope'"):
        preferred_allocation(snap, GPU_RESOURCE, ["GPU-nope"], [], 1)
    sick = snapshot("t4", "", unhealthy={gpus[0].uuid: "XID 79", gpus[1].uuid: "XID 48"})
    with pytest.raises(AllocationError, match="3 devices asked for, only 2 healthy ones offered"):
        preferred_allocation(sick, GPU_RESOURCE, [g.uuid for g in gpus], [], 3)
    with pytest.raises(AllocationError, match="allocation_size must be at least 1, got 0"):
        preferred_allocation(sick, GPU_RESOURCE, [g.uuid for g in gpus], [], 0)
    assert set(preferred_allocation(sick, GPU_RESOURCE, [g.uuid for g in gpus], [], 2)) == {
        gpus[2].uuid,
        gpus[3].uuid,
    }


# -- hostile requests: refused the same way on every path -----------------------------------------

PATHS = {
    "whole": ("dgx-h100", "", GPU_RESOURCE),
    "mig": ("a100-mig", "flags: {migStrategy: mixed}", mig_resource_name("1g.10gb")),
    "replicas": ("t4", SLICED, SHARED),
    "memory-units": ("t4", "gpunode: {fractional: {devices: all, unit: 1Gi}}", GPU_MEMORY_RESOURCE),
}


def offered(path: str) -> tuple[Snapshot, str, list[str]]:
    profile, text, resource = PATHS[path]
    snap = snapshot(profile, text)
    return snap, resource, [d.id for d in snap.inventory.by_resource(resource)]


@pytest.mark.parametrize("path", list(PATHS))
def test_must_include_longer_than_the_size_is_refused(path: str) -> None:
    """The reported case: 13 required IDs (17 on MIG) for a size-1 request gave them all back."""
    snap, resource, ids = offered(path)
    must = ids[:17] if path == "mig" else ids[:13]
    assert len(must) >= 8  # all 8 GPUs of the DGX on the whole path
    with pytest.raises(AllocationError, match=rf"names {len(must)} devices but allocation_size is 1"):
        preferred_allocation(snap, resource, ids, must, 1)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    ("available", "must", "size", "message"),
    [
        pytest.param(
            lambda ids: ids, lambda ids: [], 0, "allocation_size must be at least 1, got 0", id="zero"
        ),
        pytest.param(
            lambda ids: ids, lambda ids: [], -1, "allocation_size must be at least 1, got -1", id="negative"
        ),
        pytest.param(
            lambda ids: ids,
            lambda ids: [],
            10**6,
            r"1000000 devices asked for, only \d+ healthy",
            id="over-available",
        ),
        pytest.param(
            lambda ids: [ids[0], *ids],
            lambda ids: [],
            1,
            "available_deviceIDs lists .* more than once",
            id="dup-available",
        ),
        pytest.param(
            lambda ids: ids,
            lambda ids: [ids[1], ids[1]],
            2,
            "must_include_deviceIDs lists .* more than once",
            id="dup-must",
        ),
        pytest.param(
            lambda ids: [*ids, "GPU-nope"], lambda ids: [], 1, "unknown device ID 'GPU-nope'", id="unknown"
        ),
        pytest.param(
            lambda ids: ids, lambda ids: ["MIG-nope"], 1, "unknown device ID 'MIG-nope'", id="unknown-must"
        ),
    ],
)
def test_bad_requests_are_refused_on_every_path(
    path: str, available: Any, must: Any, size: int, message: str
) -> None:
    snap, resource, ids = offered(path)
    with pytest.raises(AllocationError, match=message):
        preferred_allocation(snap, resource, available(ids), must(ids), size)
