"""The ResourceSlices build_pool makes from the simulated profiles, the taints health turns into, and the
publisher's bookkeeping against a recording stand-in of the API (the real API server validates the same
objects in tests/e2e/test_dra_slices.py)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from lightkube.resources.resource_v1 import ResourceSlice

from gpunode.config.health import XidPolicy
from gpunode.contract import dra as names
from gpunode.contract.names import GIB, MIB
from gpunode.errors import KubeNotFound
from gpunode.node.devices.base import Gpu
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.slices import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE,
    Pool,
    SlicePublisher,
    build_pool,
    build_slices,
    gpu_device_name,
    mig_device_name,
    semantic_version,
    shared_device_name,
)
from gpunode.node.dra.taints import DeviceTaint, device_taints, taint_for
from gpunode.node.health.evidence import Verdict
from gpunode.node.health.model import ECC_DBE, ECC_SBE, GPU_LOST, PROBE, XID

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def gpus(profile: str) -> tuple[Gpu, ...]:
    return SimBackend.from_profile(profile).gpus()


def attrs(device: dict[str, Any]) -> dict[str, Any]:
    return {k: next(iter(v.values())) for k, v in device["attributes"].items()}


def test_t4_whole_and_shared_devices_take_one_counter() -> None:
    """Every T4 gives a whole device and a shared one; both take the GPU's memory counter whole."""
    backend = SimBackend.from_profile("t4")
    pool = build_pool(backend.gpus(), unit_bytes=GIB, driver_version=backend.driver_version())
    assert len(pool.counter_sets) == 4 and len(pool.devices) == 8
    g0 = backend.gpus()[0]
    whole, shared = pool.devices[0], pool.devices[1]
    assert whole["name"] == gpu_device_name(g0.uuid) == g0.uuid.lower()
    assert shared["name"] == shared_device_name(g0.uuid)
    assert "allowMultipleAllocations" not in whole and shared["allowMultipleAllocations"] is True
    assert whole["capacity"] == {"memory": {"value": str(15360 * MIB)}}
    assert shared["capacity"]["memory"] == {
        "value": str(15 * GIB),
        "requestPolicy": {"default": str(GIB), "validRange": {"min": str(GIB), "step": str(GIB)}},
    }
    consumed = {"counterSet": whole["name"], "counters": {"memory": {"value": str(15360 * MIB)}}}
    assert whole["consumesCounters"] == shared["consumesCounters"] == [consumed]
    assert pool.counter_sets[0] == {
        "name": whole["name"],
        "counters": {"memory": {"value": str(15360 * MIB)}},
    }
    a = attrs(whole)
    assert a == {
        "uuid": g0.uuid,
        "productName": "Tesla T4",
        "index": 0,
        "pciBusID": "0000:3b:00.0",
        "architecture": "turing",
        "cudaComputeCapability": "7.5.0",
        "driverVersion": "535.161.8",
        "numaNode": 0,
        "type": "gpu",
        "sharing": "whole",
    }
    assert attrs(shared)["sharing"] == "shared"
    assert attrs(pool.devices[6])["numaNode"] == 1


def test_t4_fractional_unit_sets_the_step_and_a_gpu_too_small_to_share_is_whole_only() -> None:
    """The memory unit is the minimum, step and default of a share; under two units there is no shared device."""
    pool = build_pool(gpus("t4")[:1], unit_bytes=4 * GIB)
    policy = pool.devices[1]["capacity"]["memory"]
    assert policy["value"] == str(12 * GIB)  # three whole units of the 15 GiB
    assert policy["requestPolicy"]["validRange"] == {"min": str(4 * GIB), "step": str(4 * GIB)}
    small = build_pool(gpus("t4")[:1], unit_bytes=8 * GIB)
    assert [d["name"] for d in small.devices] == [gpu_device_name(gpus("t4")[0].uuid)]
    assert "fewer than two memory units" in small.warnings[0]


def test_h100_nvlink_domain_and_capability() -> None:
    """The DGX H100's eight GPUs share one NVLink domain; Hopper is compute capability 9.0."""
    pool = build_pool(gpus("dgx-h100"), unit_bytes=GIB, driver_version="550.90.07")
    assert len(pool.devices) == 16
    assert {attrs(d)["nvlinkDomain"] for d in pool.devices} == {0}
    assert {attrs(d)["cudaComputeCapability"] for d in pool.devices} == {"9.0.0"}
    assert attrs(pool.devices[0])["driverVersion"] == "550.90.7"
    assert all("nvlinkDomain" not in attrs(d) for d in build_pool(gpus("t4"), unit_bytes=GIB).devices)
    slices = build_slices(pool, node="n", driver=names.DEFAULT_DRIVER, generation=3)
    assert [list(s["spec"])[-1] for s in slices] == ["sharedCounters", "devices"]
    assert all(s["spec"]["pool"] == {"name": "n", "generation": 3, "resourceSliceCount": 2} for s in slices)


def test_a100_mig_placements_consume_their_slices() -> None:
    """A GPU in MIG mode: 7 compute and 8 memory-slice counters, one device per placement of each profile;
    the GPU with MIG disabled is whole and shared; the slices keep the API's limits."""
    all_gpus = gpus("a100-mig")
    # Every placement, as dynamic partitioning publishes them when gpunode made every instance there is.
    pool = build_pool(all_gpus, unit_bytes=GIB, mig_owned=created(all_gpus))
    g0 = all_gpus[0]
    counters = pool.counter_sets[0]["counters"]
    assert counters["compute-slices"] == {"value": "7"}
    assert sorted(k for k in counters if k.startswith("memory-slice-")) == [
        f"memory-slice-{i}" for i in range(8)
    ]
    mine = [d for d in pool.devices if attrs(d)["uuid"] == g0.uuid]
    assert len(mine) == 18  # 7 + 4 + 3 + 2 + 1 + 1 placements
    seven = next(d for d in mine if d["name"] == mig_device_name(g0.uuid, "7g.80gb", 0))
    used = seven["consumesCounters"][0]["counters"]
    assert used["compute-slices"] == {"value": "7"} and len(used) == 9
    three = next(d for d in mine if d["name"] == mig_device_name(g0.uuid, "3g.40gb", 4))
    assert sorted(three["consumesCounters"][0]["counters"]) == [
        "compute-slices",
        "memory-slice-4",
        "memory-slice-5",
        "memory-slice-6",
        "memory-slice-7",
    ]
    assert attrs(three)["profile"] == "3g.40gb" and attrs(three)["memorySliceStart"] == 4
    assert three["capacity"]["memory"]["value"] == str(40192 * MIB)
    last = [d for d in pool.devices if attrs(d)["uuid"] == all_gpus[7].uuid]
    assert [attrs(d)["sharing"] for d in last] == ["whole", "shared"]
    names_seen = [d["name"] for d in pool.devices]
    assert len(set(names_seen)) == len(names_seen) == 7 * 18 + 2
    assert all(DNS_LABEL.fullmatch(n) and len(n) <= 63 for n in names_seen)
    slices = build_slices(pool, node="n", driver=names.DEFAULT_DRIVER, generation=1)
    assert len(slices) == 3
    for s in slices:
        assert len(s["spec"].get("devices", ())) <= MAX_DEVICES_PER_SLICE
        assert len(s["spec"].get("sharedCounters", ())) <= MAX_COUNTER_SETS_PER_SLICE


def test_names_are_stable_and_valid_for_any_uuid() -> None:
    """The same UUID gives the same names on every build; a UUID that is no DNS label gets a digest."""
    assert gpu_device_name("GPU-ABC") == "gpu-abc"
    odd = gpu_device_name("GPU_weird/uuid")
    assert DNS_LABEL.fullmatch(odd) and odd == gpu_device_name("GPU_weird/uuid")
    assert mig_device_name("GPU-x", "1g.10gb+me", 6) == "gpu-x-mig-1g10gbme-6"
    assert semantic_version("535.183.01") == "535.183.1"
    assert semantic_version("8.0") == "8.0.0"
    assert semantic_version("r535") is None


# -- taints --------------------------------------------------------------------------------------------


def verdict(kind: str, *, xid: int | None = None, target: str = "GPU-a", mig: str | None = None) -> Verdict:
    return Verdict(target_uuid=mig or target, gpu_uuid=target, mig_uuid=mig, kind=kind, reason="r", xid=xid)


@pytest.mark.parametrize(
    ("v", "value", "effect"),
    [
        (verdict(XID, xid=79), "xid-79", "NoExecute"),  # fatal: held until a reset
        (verdict(XID, xid=94, mig="MIG-b"), "xid-94", "NoExecute"),  # fatal to the instance
        (verdict(XID, xid=63), "xid-63", "NoSchedule"),  # counted past its threshold
        (verdict(GPU_LOST), "gpu-lost", "NoExecute"),
        (verdict(ECC_DBE), "ecc-dbe", "NoExecute"),
        (verdict(ECC_SBE), "ecc-sbe", "NoSchedule"),
        (verdict(PROBE), "probe", "NoSchedule"),
    ],
)
def test_health_verdicts_become_taints(v: Verdict, value: str, effect: str) -> None:
    assert taint_for(v, XidPolicy()) == DeviceTaint(names.TAINT_KEY, value, effect)


def test_a_gpu_taint_marks_every_device_of_the_gpu_and_only_those() -> None:
    t4 = gpus("t4")
    taints = device_taints({t4[1].uuid: verdict(XID, xid=79, target=t4[1].uuid)}, XidPolicy())
    pool = build_pool(t4, unit_bytes=GIB, taints=taints)
    marked = [d["name"] for d in pool.devices if d.get("taints")]
    assert marked == [gpu_device_name(t4[1].uuid), shared_device_name(t4[1].uuid)]
    assert pool.devices[2]["taints"] == [{"key": names.TAINT_KEY, "value": "xid-79", "effect": "NoExecute"}]


def test_a_mig_instance_taint_marks_the_placements_that_overlap_it() -> None:
    """XID 94 on the 3g.40gb instance of GPU 2 (its layout puts it on memory slices 4-7, GPU instance 2)
    taints the placements that overlap those slices, not the others."""
    g2 = gpus("a100-mig")[2]
    inst = next(m for m in g2.mig_devices if m.profile == "3g.40gb")
    assert inst.gi_id == 2  # the second half of the GPU
    taints = device_taints({inst.uuid: verdict(XID, xid=94, target=g2.uuid, mig=inst.uuid)}, XidPolicy())
    pool = build_pool([g2], unit_bytes=GIB, taints=taints, mig_owned=created([g2]))
    marked = {d["name"] for d in pool.devices if d.get("taints")}
    for profile, start in (("3g.40gb", 4), ("1g.10gb", 4), ("1g.20gb", 6), ("2g.20gb", 4), ("7g.80gb", 0)):
        assert mig_device_name(g2.uuid, profile, start) in marked
    for profile, start in (("3g.40gb", 0), ("1g.10gb", 3), ("4g.40gb", 0), ("2g.20gb", 2)):
        assert mig_device_name(g2.uuid, profile, start) not in marked


def created(gpus: Any) -> set[str]:
    """Every MIG instance of the GPUs, as if gpunode had created them for claims."""
    return {m.uuid for g in gpus for m in g.mig_devices}


# -- the publisher -----------------------------------------------------------------------------------------


class FakeApi:
    """Records the publisher's calls and stores slices as the API server would (resourceVersion, 404)."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self._version = 0

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        stored = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self._version)}}
        self.slices[body["metadata"]["name"]] = stored
        return stored

    async def list_json(self, resource: type[Any], **_: Any) -> tuple[list[dict[str, Any]], str]:
        assert resource is ResourceSlice
        self.calls.append(("list", ""))
        return list(self.slices.values()), str(self._version)

    async def get_node(self, name: str) -> Any:
        class Meta:
            uid = "node-uid"

        class Node:
            metadata = Meta()

        return Node()

    async def create_json(self, resource: type[Any], body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("create", body["metadata"]["name"]))
        return self._store(body)

    async def replace_json(self, resource: type[Any], body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("replace", body["metadata"]["name"]))
        assert (
            body["metadata"]["resourceVersion"]
            == self.slices[body["metadata"]["name"]]["metadata"]["resourceVersion"]
        )
        return self._store(body)

    async def delete_json(self, resource: type[Any], name: str, **_: Any) -> None:
        self.calls.append(("delete", name))
        if self.slices.pop(name, None) is None:
            raise KubeNotFound(f"delete resourceslice {name}: not found", status=404)

    async def close(self) -> None:
        pass


def publisher(api: FakeApi, pool: list[Pool]) -> SlicePublisher:
    return SlicePublisher(
        client_factory=lambda: api,  # type: ignore[arg-type,return-value]
        node_name="n1",
        driver=names.DEFAULT_DRIVER,
        pool=lambda: pool[0],
    )


def test_publisher_bumps_the_generation_on_change_and_a_restart_keeps_it() -> None:
    api = FakeApi()
    t4, a100 = gpus("t4"), gpus("a100-mig")
    pool = [build_pool(t4, unit_bytes=GIB)]
    first = publisher(api, pool)
    assert asyncio.run(first.publish_once()) is True
    assert first.generation == 1 and sorted(api.slices) == ["n1-gpu.gpunode.io-0", "n1-gpu.gpunode.io-1"]
    assert api.slices["n1-gpu.gpunode.io-0"]["metadata"]["ownerReferences"][0]["uid"] == "node-uid"
    assert asyncio.run(first.publish_once()) is False  # nothing changed: nothing written
    # A restarted agent reads the server's copy: the same pool is not written again, the generation stays.
    api.calls.clear()
    second = publisher(api, pool)
    assert asyncio.run(second.publish_once()) is False
    assert second.generation == 1 and [c[0] for c in api.calls] == ["list"]
    # A taint is a change: a new generation, every slice of the pool at it.
    pool[0] = build_pool(
        t4, unit_bytes=GIB, taints={t4[0].uuid: DeviceTaint(names.TAINT_KEY, "xid-79", "NoExecute")}
    )
    assert asyncio.run(second.publish_once()) is True
    assert {s["spec"]["pool"]["generation"] for s in api.slices.values()} == {2}
    # Fewer slices: the extra one is deleted, the count in the pool is the new one.
    pool[0] = build_pool(a100, unit_bytes=GIB, mig_owned=created(a100))
    asyncio.run(second.publish_once())
    assert len(api.slices) == 3
    pool[0] = build_pool(t4[:1], unit_bytes=GIB)
    api.calls.clear()
    asyncio.run(second.publish_once())
    assert ("delete", "n1-gpu.gpunode.io-2") in api.calls
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in api.slices.values()} == {2}
    assert {s["spec"]["pool"]["generation"] for s in api.slices.values()} == {4}


def test_publisher_writes_again_what_someone_deleted_on_resync() -> None:
    api = FakeApi()
    pool = [build_pool(gpus("t4"), unit_bytes=GIB)]
    pub = publisher(api, pool)
    asyncio.run(pub.publish_once())
    del api.slices["n1-gpu.gpunode.io-1"]  # the kubelet wiped it, or an operator deleted it
    assert asyncio.run(pub.publish_once()) is False  # without a resync the publisher trusts its own copy
    assert asyncio.run(pub.publish_once(resync=True)) is True
    assert sorted(api.slices) == ["n1-gpu.gpunode.io-0", "n1-gpu.gpunode.io-1"]
    assert pub.generation == 2


def test_publisher_keeps_the_time_a_taint_was_added() -> None:
    """Rewriting a slice keeps timeAdded of a taint that stays (tolerationSeconds count from it)."""
    api = FakeApi()
    t4 = gpus("t4")
    taint = {t4[0].uuid: DeviceTaint(names.TAINT_KEY, "xid-79", "NoExecute")}
    pool = [build_pool(t4, unit_bytes=GIB, taints=taint)]
    pub = publisher(api, pool)
    asyncio.run(pub.publish_once())
    stored = api.slices["n1-gpu.gpunode.io-1"]["spec"]["devices"][0]["taints"][0]
    stored["timeAdded"] = "2026-01-01T00:00:00Z"  # as the API server sets it
    asyncio.run(pub.publish_once(resync=True))  # read back
    pool[0] = build_pool(t4, unit_bytes=2 * GIB, taints=taint)  # another change: rewritten
    asyncio.run(pub.publish_once())
    assert (
        api.slices["n1-gpu.gpunode.io-1"]["spec"]["devices"][0]["taints"][0]["timeAdded"]
        == "2026-01-01T00:00:00Z"
    )
