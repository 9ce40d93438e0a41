"""The order of the pool's devices (gpunode.node.dra.order): first fit over it is the placement policy's
choice, names never change, and the usage comes from ResourceClaims a tenant may have shaped."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from gpunode.contract import dra as names
from gpunode.contract.draclaims import DeviceUsage
from gpunode.contract.names import GIB
from gpunode.node.devices.base import Gpu
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.order import ClaimUsage, order_devices, order_pool
from gpunode.node.dra.slices import Pool, SlicePublisher, build_pool, gpu_device_name, shared_device_name
from gpunode.placement import GpuState, NodeState, Request, score_node
from tests.node.test_dra_slices import FakeApi

DRIVER = names.DEFAULT_DRIVER
NODE = "n1"


def gpus(profile: str) -> tuple[Gpu, ...]:
    return tuple(SimBackend.from_profile(profile).gpus())


def sharing(device: dict[str, Any]) -> str:
    return str(device["attributes"][names.ATTR_SHARING]["string"])


def first_fit(
    devices: tuple[dict[str, Any], ...], kind: str, usage: dict[str, DeviceUsage], want: int
) -> str:
    """What kube-scheduler's allocator takes: the first device of the class, in order, that fits."""
    held_gpu = {d["consumesCounters"][0]["counterSet"] for d in devices if d["name"] in usage}
    for d in devices:
        if sharing(d) != kind:
            continue
        gpu = d["consumesCounters"][0]["counterSet"]
        if kind == names.SHARING_WHOLE and gpu not in held_gpu:
            return str(d["name"])
        if kind == names.SHARING_SHARED:
            if usage.get(gpu_device_name_of(d, devices)) is not None:
                continue  # the GPU is held whole
            used = usage[d["name"]].memory_bytes if d["name"] in usage else 0
            if int(d["capacity"]["memory"]["value"]) - used >= want:
                return str(d["name"])
    return ""


def gpu_device_name_of(shared: dict[str, Any], devices: tuple[dict[str, Any], ...]) -> str:
    return str(shared["consumesCounters"][0]["counterSet"])


def test_without_usage_the_order_is_index_order_and_every_name_stays() -> None:
    t4 = gpus("t4")
    pool = build_pool(t4, unit_bytes=GIB)
    ordered = order_pool(pool, {})
    assert sorted(d["name"] for d in ordered.devices) == sorted(d["name"] for d in pool.devices)
    assert ordered.devices == pool.devices  # build_pool's order: a fresh node publishes nothing new
    assert ordered.counter_sets == pool.counter_sets
    assert {d["name"]: d for d in ordered.devices} == {d["name"]: d for d in pool.devices}  # content same


def test_shares_go_to_the_fullest_gpu_that_fits_and_whole_gpus_stay_free() -> None:
    t4 = gpus("t4")
    pool = build_pool(t4, unit_bytes=GIB)
    usage = {
        shared_device_name(t4[2].uuid): DeviceUsage(claims=2, memory_bytes=10 * GIB),
        shared_device_name(t4[0].uuid): DeviceUsage(claims=1, memory_bytes=4 * GIB),
        gpu_device_name(t4[1].uuid): DeviceUsage(claims=1),
    }
    ordered = order_pool(pool, usage).devices
    shared = [d["name"] for d in ordered if sharing(d) == names.SHARING_SHARED]
    # GPU 2 (5 GiB free), GPU 0 (11), GPU 3 (15, untouched); GPU 1 is held whole: last.
    assert shared == [shared_device_name(t4[i].uuid) for i in (2, 0, 3, 1)]
    whole = [d["name"] for d in ordered if sharing(d) == names.SHARING_WHOLE]
    assert whole[0] == gpu_device_name(t4[3].uuid)  # the only GPU nothing holds
    assert first_fit(ordered, names.SHARING_SHARED, usage, 5 * GIB) == shared_device_name(t4[2].uuid)
    assert first_fit(ordered, names.SHARING_SHARED, usage, 6 * GIB) == shared_device_name(t4[0].uuid)
    # Without the order, first fit takes GPU 0 for 5 GiB and leaves GPU 2's 5 GiB stranded.
    assert first_fit(pool.devices, names.SHARING_SHARED, usage, 5 * GIB) == shared_device_name(t4[0].uuid)


def node_state(t4: tuple[Gpu, ...], usage: dict[str, DeviceUsage]) -> NodeState:
    """Placement's view of the same node: memory taken by shares, GPUs held whole fully taken."""
    out = []
    for g in t4:
        whole = gpu_device_name(g.uuid) in usage
        used = usage[shared_device_name(g.uuid)].memory_bytes if shared_device_name(g.uuid) in usage else 0
        total = 15 * GIB
        out.append(
            GpuState(
                uuid=g.uuid,
                index=g.index,
                model=g.model,
                milli_free=0 if whole else 1000,
                memory_total_bytes=total,
                memory_free_bytes=0 if whole else total - used,
                numa_node=g.numa_node,
                serves_whole=not used,
            )
        )
    return NodeState(NODE, tuple(out), cpu_milli_free=64_000, memory_free_bytes=256 * GIB)


def test_first_fit_over_the_order_is_the_bestfit_policys_gpu_on_random_states() -> None:
    t4 = gpus("t4")
    pool = build_pool(t4, unit_bytes=GIB)
    rng = random.Random(7)
    agree = disagree_without = 0
    for _ in range(300):
        usage: dict[str, DeviceUsage] = {}
        for g in t4:
            roll = rng.random()
            if roll < 0.15:
                usage[gpu_device_name(g.uuid)] = DeviceUsage(claims=1)
            elif roll < 0.75:
                usage[shared_device_name(g.uuid)] = DeviceUsage(
                    claims=1, memory_bytes=rng.randint(1, 14) * GIB
                )
        want = rng.randint(1, 8) * GIB
        ordered = order_pool(pool, usage).devices
        got = first_fit(ordered, names.SHARING_SHARED, usage, want)
        choice = score_node(node_state(t4, usage), Request(gpu_memory_bytes=want), policy="bestfit")
        expected = shared_device_name(choice.gpu_uuids[0]) if choice is not None else ""
        assert got == expected, (usage, want)
        agree += 1
        disagree_without += first_fit(pool.devices, names.SHARING_SHARED, usage, want) != expected
    assert agree == 300 and disagree_without > 30  # the order is what makes them agree


def test_mig_placements_of_the_gpu_with_fewest_free_of_the_profile_come_first() -> None:
    a100 = gpus("a100-mig")
    # Every placement (dynamic partitioning around instances gpunode made), so both GPUs offer them all.
    pool = build_pool(a100[:2], unit_bytes=GIB, mig_owned={m.uuid for g in a100[:2] for m in g.mig_devices})
    held = next(
        d["name"]
        for d in pool.devices
        if d["name"].startswith(gpu_device_name(a100[1].uuid)) and d["name"].endswith("mig-3g40gb-4")
    )
    ordered = order_devices(pool.devices, {held: DeviceUsage(claims=1)})
    first_1g = next(d for d in ordered if d["attributes"][names.ATTR_MIG_PROFILE]["string"] == "1g.10gb")
    assert first_1g["consumesCounters"][0]["counterSet"] == gpu_device_name(a100[1].uuid)
    # GPU 1's 7g.80gb overlaps the held placement: it no longer fits and goes after GPU 0's.
    sevens = [d["name"] for d in ordered if d["name"].endswith("mig-7g80gb-0")]
    assert sevens == [f"{gpu_device_name(a100[i].uuid)}-mig-7g80gb-0" for i in (0, 1)]
    assert ordered[-1]["consumesCounters"][0]["counterSet"] == gpu_device_name(a100[1].uuid)


def claim(ns: str, name: str, results: Any, *, driver: str = DRIVER) -> dict[str, Any]:
    if isinstance(results, list):
        results = [{"driver": driver, **r} if isinstance(r, dict) else r for r in results]
    return {
        "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}"},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def test_claim_usage_counts_this_pool_only_and_hostile_claims_break_nothing() -> None:
    t4 = gpus("t4")
    shared0 = shared_device_name(t4[0].uuid)
    usage = ClaimUsage(client_factory=lambda: None, node_name=NODE, driver=DRIVER)  # type: ignore[arg-type,return-value]
    pool = build_pool(t4, unit_bytes=GIB)
    assert usage.order(pool) is pool  # before the first list: build_pool's order
    changed = usage.replace_all(
        [
            claim("a", "c1", [{"pool": NODE, "device": shared0, "consumedCapacity": {"memory": "4Gi"}}]),
            claim(
                "a", "other-node", [{"pool": "n2", "device": shared0, "consumedCapacity": {"memory": "8Gi"}}]
            ),
            claim("a", "other-driver", [{"pool": NODE, "device": shared0}], driver="gpu.example.com"),
            # A tenant's (or a forged status's) worst: wrong types, huge numbers, bad names, too many results.
            claim(
                "t",
                "bad-memory",
                [{"pool": NODE, "device": shared0, "consumedCapacity": {"memory": "1e400"}}],
            ),
            claim(
                "t", "negative", [{"pool": NODE, "device": shared0, "consumedCapacity": {"memory": "-4Gi"}}]
            ),
            claim("t", "huge", [{"pool": NODE, "device": shared0, "consumedCapacity": {"memory": "9Ei"}}]),
            claim("t", "not-a-map", [{"pool": NODE, "device": shared0, "consumedCapacity": ["4Gi"]}]),
            claim(
                "t",
                "bad-name",
                [{"pool": NODE, "device": "../../etc", "consumedCapacity": {"memory": "1Gi"}}],
            ),
            claim("t", "results-not-list", {"pool": NODE}),
            claim("t", "result-not-map", ["x", 3, None]),
            claim(
                "t", "many", [{"pool": NODE, "device": shared0, "consumedCapacity": {"memory": "1Gi"}}] * 40
            ),
            {"metadata": "x", "status": []},
        ]
    )
    assert changed
    u = usage.usage()
    # c1's 4 GiB and the first 32 of "many" (the API's limit), 1 GiB each; nothing else.
    assert u[shared0].memory_bytes == 36 * GIB and u[shared0].claims == 33
    assert usage.problems >= 6
    ordered = usage.order(pool)  # usage beyond capacity: free clamps at 0, the order is still made
    assert sorted(d["name"] for d in ordered.devices) == sorted(d["name"] for d in pool.devices)
    # Changes: a claim released, one of another pool changed (no change here), one deleted.
    assert usage.claim_changed(claim("t", "many", [])) is True
    assert usage.claim_changed(claim("a", "other-node", [{"pool": "n3", "device": shared0}])) is False
    assert usage.claim_changed(claim("a", "c1", []), deleted=True) is True
    assert usage.usage() == {}


def test_the_publisher_writes_the_new_order_as_a_new_generation_and_keeps_the_names() -> None:
    api = FakeApi()
    t4 = gpus("t4")
    pool = build_pool(t4, unit_bytes=GIB)
    usage = ClaimUsage(client_factory=lambda: api, node_name=NODE, driver=DRIVER)  # type: ignore[arg-type,return-value]
    publisher = SlicePublisher(
        client_factory=lambda: api,  # type: ignore[arg-type,return-value]
        node_name=NODE,
        driver=DRIVER,
        pool=lambda: pool,
        order=usage,
    )
    usage.replace_all([])
    assert asyncio.run(publisher.publish_once()) is True
    names_before = {d["name"] for s in api.slices.values() for d in s["spec"].get("devices") or ()}
    shared3 = shared_device_name(t4[3].uuid)
    usage.replace_all(
        [claim("a", "c", [{"pool": NODE, "device": shared3, "consumedCapacity": {"memory": "2Gi"}}])]
    )
    assert asyncio.run(publisher.publish_once()) is True
    devices = [d for s in api.slices.values() for d in s["spec"].get("devices") or ()]
    assert {d["name"] for d in devices} == names_before
    assert next(d["name"] for d in devices if sharing(d) == names.SHARING_SHARED) == shared3
    assert {s["spec"]["pool"]["generation"] for s in api.slices.values()} == {2}
    assert asyncio.run(publisher.publish_once()) is False  # the same usage: nothing written


def test_order_is_deterministic_for_equal_usage() -> None:
    pool: Pool = build_pool(gpus("dgx-h100"), unit_bytes=GIB)
    usage = {shared_device_name(gpus("dgx-h100")[5].uuid): DeviceUsage(claims=1, memory_bytes=GIB)}
    assert order_devices(pool.devices, usage) == order_devices(pool.devices, dict(usage))


def test_a_restarted_publisher_with_the_same_usage_writes_nothing_and_waits_for_the_list() -> None:
    api = FakeApi()
    t4 = gpus("t4")
    pool = build_pool(t4, unit_bytes=GIB)
    held = [
        claim(
            "a",
            "c",
            [{"pool": NODE, "device": shared_device_name(t4[2].uuid), "consumedCapacity": {"memory": "3Gi"}}],
        )
    ]

    def publisher_with(usage: ClaimUsage) -> SlicePublisher:
        return SlicePublisher(
            client_factory=lambda: api,  # type: ignore[arg-type,return-value]
            node_name=NODE,
            driver=DRIVER,
            pool=lambda: pool,
            order=usage,
        )

    first = ClaimUsage(client_factory=lambda: api, node_name=NODE, driver=DRIVER)  # type: ignore[arg-type,return-value]
    first.replace_all(held)
    assert asyncio.run(publisher_with(first).publish_once()) is True
    # The restarted agent: before its claims are listed it would publish index order; once listed, the
    # same usage gives the same order as the server has, so nothing is written.
    second = ClaimUsage(client_factory=lambda: api, node_name=NODE, driver=DRIVER)  # type: ignore[arg-type,return-value]
    assert asyncio.run(second.wait_synced(0.05)) is False
    second.replace_all(held)
    assert asyncio.run(second.wait_synced(0.05)) is True
    api.calls.clear()
    assert asyncio.run(publisher_with(second).publish_once()) is False
    assert [c[0] for c in api.calls] == ["list"]


def test_time_sliced_replicas_keep_build_pools_order() -> None:
    t4 = gpus("t4")
    pool = build_pool(t4, unit_bytes=GIB, time_sliced={g.uuid: 4 for g in t4[2:]})
    kinds = [sharing(d) for d in pool.devices]
    assert names.SHARING_TIME_SLICED in kinds
    usage = {f"{gpu_device_name(t4[3].uuid)}-timesliced": DeviceUsage(claims=2)}
    ordered = order_devices(pool.devices, usage)
    sliced = [d["name"] for d in ordered if sharing(d) == names.SHARING_TIME_SLICED]
    assert sliced == [d["name"] for d in pool.devices if sharing(d) == names.SHARING_TIME_SLICED]
    assert [sharing(d) for d in ordered] == kinds  # every kind keeps its places


def test_a_gpu_whose_replicas_are_in_use_offers_its_share_last() -> None:
    t4 = gpus("t4")
    pool = build_pool(t4, unit_bytes=GIB, time_sliced={t4[0].uuid: 4})
    usage = {
        f"{gpu_device_name(t4[0].uuid)}-timesliced": DeviceUsage(claims=1),
        shared_device_name(t4[1].uuid): DeviceUsage(claims=1, memory_bytes=2 * GIB),
    }
    shared = [d["name"] for d in order_devices(pool.devices, usage) if sharing(d) == names.SHARING_SHARED]
    assert shared[0] == shared_device_name(t4[1].uuid)
    assert shared_device_name(t4[0].uuid) not in shared  # a time-sliced GPU offers replicas, not shares
