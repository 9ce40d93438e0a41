"""GPUs served through DRA in the queue controller: governed pods' ResourceClaims counted in their queue's
quota and fair share, gated DRA pods admitted by quota, and hostile claims (JSON objects, no API server)."""

from __future__ import annotations

from typing import Any

import pytest

from gpunode.cluster.queuectl import dra
from gpunode.cluster.queuectl.core import QueueCore
from gpunode.cluster.queueing.model import GPU, GPU_MEMORY
from gpunode.contract import dra as names
from gpunode.contract.draclaims import gpu_device_name, shared_device_name
from gpunode.contract.names import (
    ADMISSION_GATE,
    GIB,
    NODE_STATE_ANNOTATION,
    QUEUE_LABEL,
    QUEUE_REASON_ANNOTATION,
    Sharing,
)
from gpunode.contract.nodestate import GpuRecord, NodeGpuState, encode
from tests.cluster.queuectl.helpers import config, node

DRIVER = names.DEFAULT_DRIVER
DRA_NODE = "d1"


def dra_node(name: str = DRA_NODE, gpus: int = 4) -> dict[str, Any]:
    """A Node whose GPUs (80 GiB H100s) are all served through DRA."""
    records = tuple(
        GpuRecord(
            uuid=f"GPU-{name}-{i}",
            index=i,
            model="H100",
            memory_total_bytes=80 * GIB,
            milli_assigned=0,
            memory_assigned_bytes=0,
            sharing=Sharing.DRA,
        )
        for i in range(gpus)
    )
    text = encode(NodeGpuState(node=name, updated=0.0, generation=1, gpus=records))
    return {"metadata": {"name": name, "annotations": {NODE_STATE_ANNOTATION: text}}}


def claim(
    name: str,
    *,
    namespace: str = "ml",
    cls: str = names.CLASS_WHOLE,
    count: int | str = 1,
    memory: str | None = None,
    results: list[Any] | None = None,
    reserved: list[str] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls, "count": count}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    out: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        "status": {},
    }
    if results is not None:
        out["status"]["allocation"] = {"devices": {"results": results}}
        out["status"]["reservedFor"] = [{"resource": "pods", "name": r, "uid": f"pod-{r}"} for r in reserved]
    return out


def whole(gpu: int, node: str = DRA_NODE, driver: str = DRIVER) -> dict[str, Any]:
    return {"request": "gpu", "driver": driver, "pool": node, "device": gpu_device_name(f"GPU-{node}-{gpu}")}


def share(gpu: int, memory: str, node: str = DRA_NODE) -> dict[str, Any]:
    return {
        "request": "gpu",
        "driver": DRIVER,
        "pool": node,
        "device": shared_device_name(f"GPU-{node}-{gpu}"),
        "consumedCapacity": {"memory": memory},
    }


def dra_pod(
    name: str,
    claims: list[str],
    *,
    queue: str = "team-b",
    namespace: str = "ml",
    gated: bool = False,
    created: str = "2026-01-01T00:00:00Z",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {"name": "main", "image": "x", "resources": {"claims": [{"name": c} for c in claims]}}
        ],
        "resourceClaims": [{"name": c, "resourceClaimName": c} for c in claims],
    }
    if gated:
        spec["schedulingGates"] = [{"name": ADMISSION_GATE}]
    else:
        spec["nodeName"] = DRA_NODE
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"pod-{name}",
            "labels": {QUEUE_LABEL: queue},
            "creationTimestamp": created,
        },
        "spec": spec,
        "status": {"phase": "Running" if not gated else "Pending"},
    }


def make_core(*objs: dict[str, Any]) -> QueueCore:
    core = QueueCore(config())  # team-b: guaranteed 4 GPUs, may borrow none; team-a: 4 + 4
    core.node_changed(node("n1", 4))  # 4 device-plugin GPUs
    core.node_changed(dra_node())
    for o in objs:
        if o["kind"] == "Pod":
            core.pod_changed(o)
        else:
            core.claim_changed(o)
    return core


def held(core: QueueCore, queue: str) -> dict[str, int]:
    assert core.sched is not None
    return core.sched.allocated_by_queue()[queue]


def test_an_allocated_dra_claim_counts_in_its_queue_and_fair_share() -> None:
    core = make_core(
        claim("c1", count=2, results=[whole(0), whole(1)], reserved=["p1"]),
        claim("c2", cls=names.CLASS_SHARED, memory="20Gi", results=[share(2, "20Gi")], reserved=["p2"]),
        dra_pod("p1", ["c1"]),
        dra_pod("p2", ["c2"], queue="team-a"),
    )
    core.reconcile(1000.0)
    b, a = held(core, "team-b"), held(core, "team-a")
    assert b[GPU] == 2000 and b[GPU_MEMORY] == 160 * GIB and b["gpu/H100"] == 2000
    assert a[GPU] == 250 and a[GPU_MEMORY] == 20 * GIB  # a quarter of an 80 GiB GPU
    # the DRA GPUs are capacity for the fair shares, and the usage memory is charged
    assert core.sched is not None and core.sched._capacity[GPU] == 8000
    core.reconcile(1100.0)
    usage = core.sched.usage_memory(1100.0)
    assert usage is not None and usage[0]["team-b"][GPU] > 0
    # the pod deleted: its queue holds nothing any more
    core.pod_changed(dra_pod("p1", ["c1"]), deleted=True)
    core.reconcile(1200.0)
    assert held(core, "team-b").get(GPU, 0) == 0


def test_a_gated_dra_pod_is_admitted_within_quota_and_held_over_it() -> None:
    core = make_core(
        claim("run", count=3, results=[whole(0), whole(1), whole(2)], reserved=["running"]),
        dra_pod("running", ["run"]),
        claim("small"),
        claim("big", count=2),
        dra_pod("p-small", ["small"], gated=True, created="2026-01-01T00:01:00Z"),
        dra_pod("p-big", ["big"], gated=True, created="2026-01-01T00:02:00Z"),
    )
    actions = core.reconcile(1000.0)
    # team-b holds 3 of its 4: the one-GPU pod is admitted (the gate removed, no node pinned)
    assert [r.pod.name for r in actions.release] == ["p-small"]
    assert actions.release[0].spec == {"schedulingGates": None}
    assert held(core, "team-b")[GPU] == 4000
    reasons = {a.pod.name: a.annotations.get(QUEUE_REASON_ANNOTATION) for a in actions.annotate}
    assert "team-b is over its quota: it holds 4 GPUs of at most 4 GPUs" in str(reasons["p-big"])
    # the next reconcile (the gate's removal not yet seen) neither admits it twice nor the big one
    pod = core.pods["ml/p-big"]
    pod["metadata"]["annotations"] = {QUEUE_REASON_ANNOTATION: reasons["p-big"]}
    again = core.reconcile(1001.0)
    assert again.release == [] and held(core, "team-b")[GPU] == 4000
    assert not any(a.pod.name == "p-big" for a in again.annotate)  # its reason is already written


def test_device_plugin_admission_counts_dra_usage_against_the_quota() -> None:
    from tests.cluster.queuectl.helpers import pod

    core = make_core(
        claim("run", count=4, results=[whole(i) for i in range(4)], reserved=["running"]),
        dra_pod("running", ["run"]),
    )
    core.pod_changed(pod("dp", queue="team-b", gpus=1))
    actions = core.reconcile(1000.0)
    assert actions.admitted_jobs == []
    assert "team-b is over its quota" in core.sched.waiting()[0].reason  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (claim("x", count=10**9), "count 1000000000 is not 1..32"),
        (claim("x", count="2"), "count 2 is not 1..32"),
        (claim("x", cls=names.CLASS_SHARED), "without capacity.requests.memory"),
        (claim("x", cls=names.CLASS_SHARED, memory="1e40"), ""),
        (
            {
                **claim("x"),
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "g",
                                "exactly": {"deviceClassName": names.CLASS_WHOLE, "allocationMode": "All"},
                            }
                        ]
                    }
                },
            },
            "asks for all devices",
        ),
        ({**claim("x"), "spec": {"devices": {"requests": "everything"}}}, "is not a list"),
    ],
)
def test_a_claim_whose_demand_cannot_be_read_keeps_its_pod_gated(bad: dict[str, Any], problem: str) -> None:
    core = make_core(bad, dra_pod("p", ["x"], gated=True))
    actions = core.reconcile(1000.0)
    assert actions.release == []
    reason = next(a.annotations[QUEUE_REASON_ANNOTATION] for a in actions.annotate if a.pod.name == "p")
    assert problem in str(reason) and reason
    assert held(core, "team-b").get(GPU, 0) == 0


def test_hostile_allocations_are_bounded_and_foreign_drivers_ignored() -> None:
    results = (
        [whole(0, driver="other.example.com")]  # another driver's device: not ours to count
        + ["not a result", {"driver": DRIVER, "pool": "../x", "device": "Bad Name"}]  # malformed
        + [share(1, "500Gi")]  # more memory than the GPU has: clamped to its 80 GiB
        + [share(1, "1Ei")]  # beyond any GPU (1 PiB): skipped as malformed
        + [whole(2, node="nowhere")] * 100  # beyond the API's 32 results: cut at 32
    )
    core = make_core(claim("h", results=results, reserved=["p"]), dra_pod("p", ["h"]))
    core.reconcile(1000.0)
    b = held(core, "team-b")
    # the share clamped to one GPU; 27 whole devices on an unknown node (nominal 80 GiB each)
    assert b[GPU] == 1000 + 27 * 1000 and b[GPU_MEMORY] == 80 * GIB + 27 * 80 * GIB
    c = dra.read_claim(claim("h", results=results), DRIVER)
    assert c is not None and c.said  # the malformed results are named


def test_a_claim_is_never_charged_to_another_tenant() -> None:
    core = make_core(
        # team-a's pod in namespace ml-a reserves claim "shared"
        claim("shared", namespace="ml-a", count=2, results=[whole(0), whole(1)], reserved=["owner"]),
        dra_pod("owner", ["shared"], queue="team-a", namespace="ml-a"),
        # team-b's pod in another namespace names a claim of the same name: its own namespace's, absent
        dra_pod("thief", ["shared"], queue="team-b", namespace="ml-b", gated=True),
        # a pod of team-b in ml-a names the claim reserved for team-a's pod: charged to its reserver only
        dra_pod("sharer", ["shared"], queue="team-b", namespace="ml-a", created="2025-01-01T00:00:00Z"),
    )
    actions = core.reconcile(1000.0)
    assert held(core, "team-a")[GPU] == 2000 and held(core, "team-b").get(GPU, 0) == 0
    assert core.dra.charged == {"ml-a/shared": "ml-a/owner"}
    reason = next(a.annotations[QUEUE_REASON_ANNOTATION] for a in actions.annotate if a.pod.name == "thief")
    assert "waiting for its ResourceClaim 'shared' to exist" in str(reason)


def test_claims_of_ungoverned_pods_and_foreign_classes_count_nowhere() -> None:
    free = dra_pod("free", ["c"])
    del free["metadata"]["labels"][QUEUE_LABEL]
    foreign = claim("f", cls="other-gpu.example.com")
    core = make_core(
        claim("c", results=[whole(0)], reserved=["free"]),
        free,
        foreign,
        dra_pod("p", ["f"], gated=True),
    )
    actions = core.reconcile(1000.0)
    assert all(not v.get(GPU) for v in core.sched.allocated_by_queue().values())  # type: ignore[union-attr]
    assert [r.pod.name for r in actions.release] == ["p"]  # nothing of ours asked: nothing to hold it for


def test_the_webhook_gates_governed_pods_that_name_claims() -> None:
    from gpunode.cluster.queuectl.webhook import governed

    p = dra_pod("p", ["c"], gated=True)
    del p["spec"]["schedulingGates"]
    assert governed(p, {})
    del p["metadata"]["labels"][QUEUE_LABEL]
    assert not governed(p, {})


def test_a_gated_dra_pod_naming_no_leaf_queue_says_so() -> None:
    core = make_core(claim("c"), dra_pod("p", ["c"], queue="nowhere", gated=True))
    actions = core.reconcile(1000.0)
    assert actions.release == []
    reason = next(a.annotations[QUEUE_REASON_ANNOTATION] for a in actions.annotate if a.pod.name == "p")
    assert reason == "queue 'nowhere' is not a leaf queue of the queue configuration"
