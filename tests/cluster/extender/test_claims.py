"""What DRA claims hold of GPUs served through DRA, in the extender's and the queue controller's view
(gpunode.cluster.extender.claims), from ResourceClaims as JSON, hostile ones included."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gpunode.cluster.extender.claims import ClaimView
from gpunode.cluster.extender.nodes import NodeCache
from gpunode.contract.dra import DEFAULT_DRIVER
from gpunode.contract.draclaims import gpu_device_name, gpu_of_device, shared_device_name
from gpunode.contract.names import GIB, NODE_STATE_ANNOTATION, Sharing
from gpunode.contract.nodestate import encode
from gpunode.placement import GpuState, NodeState
from gpunode.placement.published import published_state

NODE = "gpu-1"
UUIDS = ("GPU-5d0e3e4c-0000-0000-0000-000000000000", "GPU-5d0e3e4c-0000-0000-0000-000000000001")
PLUGIN_UUID = "GPU-5d0e3e4c-0000-0000-0000-000000000002"


def state() -> NodeState:
    """Two GPUs served through DRA and one shared by the device plugin, 16 GiB each."""
    gpus = [
        GpuState(
            uuid=u,
            index=i,
            model="Tesla T4",
            milli_free=1000,
            memory_total_bytes=16 * GIB,
            memory_free_bytes=16 * GIB,
            numa_node=0,
            sharing=Sharing.DRA,
            serves_whole=False,
        )
        for i, u in enumerate(UUIDS)
    ]
    gpus.append(
        GpuState(
            uuid=PLUGIN_UUID,
            index=2,
            model="Tesla T4",
            milli_free=1000,
            memory_total_bytes=16 * GIB,
            memory_free_bytes=16 * GIB,
            numa_node=0,
            serves_whole=False,
        )
    )
    return NodeState(NODE, tuple(gpus), cpu_milli_free=8000, memory_free_bytes=64 * GIB)


def claim(name: str, results: Any, *, ns: str = "team-a") -> dict[str, Any]:
    if isinstance(results, list):
        results = [
            {"driver": DEFAULT_DRIVER, "pool": NODE, **r} if isinstance(r, dict) else r for r in results
        ]
    return {
        "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}"},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def share(uuid: str, memory: object) -> dict[str, Any]:
    return {"device": shared_device_name(uuid), "consumedCapacity": {"memory": memory}}


def test_shares_take_memory_and_a_whole_claim_takes_the_gpu_on_dra_gpus_only() -> None:
    view = ClaimView()
    view.replace_all(
        [
            claim("a", [share(UUIDS[0], "4Gi")]),
            claim("b", [share(UUIDS[0], "2Gi")]),
            claim("c", [{"device": gpu_device_name(UUIDS[1])}]),
            # A device the device plugin serves is not DRA's to count, whatever a claim names.
            claim("d", [{"device": gpu_device_name(PLUGIN_UUID)}]),
        ]
    )
    out = view.apply(state())
    g0, g1, g2 = out.gpus
    assert (g0.memory_free_bytes, g0.milli_free) == (10 * GIB, 1000)
    assert (g1.memory_free_bytes, g1.milli_free) == (0, 0)
    assert g2 == state().gpus[2]
    version = view.version
    view.claim_changed(claim("a", []), deleted=True)
    assert view.apply(state()).gpus[0].memory_free_bytes == 14 * GIB and view.version == version + 1
    view.claim_changed(claim("x", [share(UUIDS[0], "1Gi")], ns="other"))
    view.claim_changed(claim("x", [], ns="other"))  # deallocated: results gone
    assert view.apply(state()).gpus[0].memory_free_bytes == 14 * GIB


HOSTILE = {
    "memory beyond a PiB": [share(UUIDS[0], "9Ei")],
    "memory not a quantity": [share(UUIDS[0], "lots")],
    "negative memory": [share(UUIDS[0], "-8Gi")],
    "a 400-digit exponent": [share(UUIDS[0], "1e400")],
    "memory of the wrong type": [share(UUIDS[0], {"a": 1})],
    "consumedCapacity a list": [{"device": shared_device_name(UUIDS[0]), "consumedCapacity": ["1Gi"]}],
    "a device that is no DNS label": [{"device": "../" + gpu_device_name(UUIDS[0])}],
    "a device of 10,000 characters": [{"device": "a" * 10_000}],
    "a pool that is not a string": [{"device": gpu_device_name(UUIDS[0]), "pool": ["gpu-1"]}],
    "results not a list": {"device": gpu_device_name(UUIDS[0])},
    "results of other types": [1, "x", None, []],
}


@pytest.mark.parametrize("results", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_claim_is_skipped_and_the_others_still_count(results: Any) -> None:
    view = ClaimView()
    view.replace_all([claim("hostile", results), claim("fine", [share(UUIDS[1], "3Gi")])])
    out = view.apply(state())
    assert out.gpus[0] == state().gpus[0]  # the hostile claim took nothing
    assert out.gpus[1].memory_free_bytes == 13 * GIB  # the well-formed one counts


def test_more_results_than_the_api_allows_and_more_memory_than_the_gpu_has_are_bounded() -> None:
    view = ClaimView()
    view.replace_all([claim("many", [share(UUIDS[0], "1Gi")] * 1000), {"metadata": 3, "status": "x"}, "junk"])  # type: ignore[list-item]
    u = view.node_usage(NODE)[shared_device_name(UUIDS[0])]
    assert u.claims == 32 and u.memory_bytes == 32 * GIB  # the API's limit of 32 results
    assert view.apply(state()).gpus[0].memory_free_bytes == 0  # clamped: never negative, the view stays valid
    assert view.problems >= 1


def test_device_names_map_to_their_gpu_and_no_other() -> None:
    assert gpu_of_device(shared_device_name(UUIDS[1]), UUIDS) == UUIDS[1]
    assert gpu_of_device(f"{gpu_device_name(UUIDS[0])}-mig-1g10gb-3", UUIDS) == UUIDS[0]
    assert gpu_of_device(gpu_device_name(UUIDS[0]) + "0", UUIDS) is None  # a prefix is not enough
    odd = "GPU with spaces and CAPITALS that is far too long for a DNS label"
    assert gpu_of_device(shared_device_name(odd), [odd]) == odd


def node_json(s: NodeState) -> dict[str, Any]:
    text = encode(published_state(s, updated=time.time()))
    return {
        "metadata": {"name": s.name, "annotations": {NODE_STATE_ANNOTATION: text}},
        "status": {"allocatable": {"cpu": "8", "memory": "64Gi"}},
    }


def test_the_extenders_node_cache_shows_what_dra_claims_hold() -> None:
    cache = NodeCache()
    cache.update([node_json(state())])
    before = cache.get(NODE).state
    assert before is not None and before.gpus[0].memory_free_bytes == 16 * GIB
    cache.dra = ClaimView()
    cache.dra.replace_all([claim("a", [share(UUIDS[0], "6Gi")])])
    got = cache.get(NODE).state
    assert got is not None and got.gpus[0].memory_free_bytes == 10 * GIB
    cache.dra.claim_changed(claim("a", []), deleted=True)
    got = cache.get(NODE).state
    assert got is not None and got.gpus[0].memory_free_bytes == 16 * GIB


def test_a_time_sliced_replica_takes_no_memory_and_a_mig_placement_takes_the_gpu() -> None:
    view = ClaimView()
    view.replace_all(
        [
            claim("ts", [{"device": f"{gpu_device_name(UUIDS[0])}-timesliced"}]),
            claim("mig", [{"device": f"{gpu_device_name(UUIDS[1])}-mig-1g10gb-3"}]),
        ]
    )
    g0, g1, _ = view.apply(state()).gpus
    assert g0 == state().gpus[0]
    assert (g1.memory_free_bytes, g1.milli_free) == (0, 0)
