"""The queue controller on the real control plane: admission, holding, reclaim with notice, failover, reload.

Real here: etcd, kube-apiserver (RBAC, audit log), kube-scheduler 1.36 with the extender's entry,
`gpunode extender --queue-config`, two `gpunode queue` replicas electing a leader on the chart's Lease
with the chart's RBAC, and two nodes whose GPUs a real `gpunode agent --backend sim` publishes
(tests.e2e.queue). Every check reads the API server: the controller's marks, kube-scheduler's bindings
and events, the audit log's evictions, the Lease.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable, Iterator
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from gpunode.contract.names import (
    ASSIGNMENT_ANNOTATION,
    GPU_RESOURCE,
    NODE_STATE_ANNOTATION,
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_REASON_ANNOTATION,
)
from gpunode.contract.nodestate import decode
from tests.e2e.api import Api, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import ControlPlane
from tests.e2e.objects import get_pod
from tests.e2e.queue import (
    BAD_QUEUE_CONFIG,
    NAMESPACE,
    NODES,
    QUEUE_CONFIG,
    REFUSED_LINE,
    WAIT_S,
    QueueCluster,
    bound_published,
    build_queue_cluster,
    delete_all_pods,
    event_source,
    event_text,
    events,
    held_gpus,
    queued_pod,
    stop_queue_cluster,
    submit,
)

CONTROLLERS = ("queue-1", "queue-2")


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QueueCluster]:
    """The cluster of tests.e2e.queue with both controllers running and one of them leading."""
    qc = build_queue_cluster(control_plane, tmp_path_factory.mktemp("queue"))
    try:
        for identity in CONTROLLERS:
            qc.start_controller(identity)
        eventually(lambda: qc.leader() in CONTROLLERS, timeout_s=WAIT_S, what="a controller leading")
        yield qc
    finally:
        stop_queue_cluster(qc)


@pytest.fixture(autouse=True)
def _clean(cluster: QueueCluster) -> Iterator[None]:
    yield
    delete_all_pods(cluster)


def _mark(pod: dict[str, Any]) -> dict[str, Any] | None:
    text = pod["metadata"].get("annotations", {}).get(QUEUE_ADMITTED_ANNOTATION)
    return json.loads(text) if text else None


def _bound(api: Api, name: str) -> dict[str, Any] | None:
    """The pod once kube-scheduler bound it and the extender recorded its GPUs."""
    pod = get_pod(api, NAMESPACE, name)
    if pod["spec"].get("nodeName") and pod["metadata"].get("annotations", {}).get(ASSIGNMENT_ANNOTATION):
        return pod
    return None


def _assigned(pod: dict[str, Any]) -> list[str]:
    return [g for g in pod["metadata"]["annotations"][ASSIGNMENT_ANNOTATION].split(",") if g]


def _check_placed_as_marked(cluster: QueueCluster, pod: dict[str, Any]) -> dict[str, Any]:
    """The pod is bound to the node of its admission mark, on exactly the mark's GPUs; returns the mark."""
    mark = _mark(pod)
    assert mark is not None and mark["uid"] == pod["metadata"]["uid"], pod["metadata"]
    assert pod["spec"]["nodeName"] == mark["node"], (pod["spec"]["nodeName"], mark)
    assert sorted(_assigned(pod)) == sorted(mark["gpus"]), (_assigned(pod), mark)
    return mark


def _carried_out(cluster: QueueCluster, pod: dict[str, Any]) -> list[str] | None:
    """The device IDs the node's kubelet part allocated to the pod (once it admitted it)."""
    admitter = cluster.nodes[pod["spec"]["nodeName"]].admitter
    assert admitter is not None
    record = admitter.admissions.get(pod["metadata"]["uid"])
    if record is None:
        return None
    assert not record.error, record.error
    return sorted(record.devices.get(GPU_RESOURCE, []))


def _one_admission(api: Api, name: str) -> dict[str, Any]:
    """The pod's QueueAdmitted events: exactly one (a pod is never admitted twice); returns it."""
    found = events(api, name, "QueueAdmitted")
    assert len(found) == 1 and int(found[0].get("count") or 1) == 1, found
    return found[0]


def test_gang_of_four_is_admitted_together_and_bound_where_planned(cluster: QueueCluster) -> None:
    admin = cluster.cp.api()
    members = [f"gang-{i}" for i in range(4)]
    submit(admin, *(queued_pod(n, "team-a", 1, gang="train", size=4) for n in members[:3]))
    # A single job created after three members: once it is admitted, the controller has reconciled with
    # those three in view, and an incomplete gang is not admitted.
    submit(admin, queued_pod("single", "team-a", 1))
    single = eventually(partial(_bound, admin, "single"), timeout_s=WAIT_S, what="single bound")
    for name in members[:3]:
        pod = get_pod(admin, NAMESPACE, name)
        assert _mark(pod) is None and not pod["spec"].get("nodeName"), pod["metadata"]
    submit(admin, queued_pod(members[3], "team-a", 1, gang="train", size=4))
    pods = [eventually(partial(_bound, admin, n), timeout_s=WAIT_S, what=f"{n} bound") for n in members]
    marks = [_check_placed_as_marked(cluster, p) for p in pods]
    assert {m["job"] for m in marks} == {f"{NAMESPACE}/train"}
    assert len({m["at"] for m in marks}) == 1, marks  # admitted at once, in one reconcile
    gpus = [g for p in [*pods, single] for g in _assigned(p)]
    assert len(gpus) == len(set(gpus)) == 5, gpus
    for name in members:
        admitted = _one_admission(admin, name)
        assert "admitted in team-a" in event_text(admitted), admitted
    # The node's device plugin (the agent) carried the plan out: the kubelet allocated the marked GPUs.
    for pod, mark in zip(pods, marks, strict=True):
        got = eventually(
            partial(_carried_out, cluster, pod), timeout_s=WAIT_S, what="the kubelet's allocation"
        )
        assert got == sorted(mark["gpus"]), (got, mark)


def test_queue_over_its_quota_is_held_with_the_reason_in_its_events(cluster: QueueCluster) -> None:
    admin = cluster.cp.api()
    submit(admin, queued_pod("c-1", "team-c", 1))
    _check_placed_as_marked(cluster, eventually(partial(_bound, admin, "c-1"), timeout_s=WAIT_S, what="c-1"))
    submit(admin, queued_pod("c-2", "team-c", 1))  # team-c may hold 1 GPU at most, and holds it

    def held_with_reason() -> dict[str, Any] | None:
        for event in events(admin, "c-2", "FailedScheduling"):
            if "queued in team-c" in event_text(event):
                return event
        return None

    event = eventually(held_with_reason, timeout_s=WAIT_S, what="kube-scheduler showing the queue's reason")
    message = event_text(event)
    assert "team-c is over its quota" in message, message
    by = event.get("reportingComponent") or (event.get("source") or {}).get("component")
    assert by == "default-scheduler", event  # kube-scheduler's own event
    pod = get_pod(admin, NAMESPACE, "c-2")
    reason = pod["metadata"]["annotations"][QUEUE_REASON_ANNOTATION]
    assert reason.startswith("queued in team-c, position 1: team-c is over its quota"), reason
    # --queue-hold error: the extender's filter answers the reason as an Error, which kube-scheduler shows
    # as it is (no "0/2 nodes are available: ..." around it: it is a scheduling error, not a fit failure)
    assert message == reason, (reason, message)
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    assert _mark(pod) is None
    assert any(reason == event_text(e) for e in events(admin, "c-2", "Queued")), "the controller's event"


# The pod rights of the `edit` ClusterRole (aggregated by kube-controller-manager, which is not run here).
TENANT_ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "Role",
    "metadata": {"name": "e2e-tenant-edit", "namespace": NAMESPACE},
    "rules": [
        {
            "apiGroups": [""],
            "resources": ["pods"],
            "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
        }
    ],
}
TENANT_BINDING = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "RoleBinding",
    "metadata": {"name": "e2e-tenant-edit", "namespace": NAMESPACE},
    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "e2e-tenant-edit"},
    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": E2E_USERS["nobody"].name}],
}


def _attempts(cluster: QueueCluster, name: str) -> int:
    """kube-scheduler's scheduling attempts of the pod that the extender's filter answered with an Error."""
    lines = cluster.scheduler.log.read_text(errors="replace").splitlines()
    return sum(
        1 for ln in lines if "Error scheduling pod; retrying" in ln and f'pod="{NAMESPACE}/{name}"' in ln
    )


def _free_gpu(api: Api) -> tuple[str, str]:
    """(node, UUID) of a GPU the nodes publish as held by no pod."""
    for node in NODES:
        text = api.get(f"/api/v1/nodes/{node}")["metadata"]["annotations"][NODE_STATE_ANNOTATION]
        for gpu in decode(text, node=node).gpus:
            if not gpu.pods:
                return node, gpu.uuid
    raise AssertionError("no free GPU")


def _patch_and_stay_held(cluster: QueueCluster, tenant: Api, name: str, mark: dict[str, Any]) -> None:
    """The tenant patches `mark` onto its pod; kube-scheduler tries the pod again (when the backoff of its
    last failed try ends: the update does not requeue it sooner), and it is not bound and the controller
    does not admit it."""
    admin = cluster.cp.api()
    start = _attempts(cluster, name)
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{name}"
    tenant.patch(path, {"metadata": {"annotations": {QUEUE_ADMITTED_ANNOTATION: json.dumps(mark)}}})
    eventually(  # tried and held again, or (the attack succeeding) bound
        lambda: _attempts(cluster, name) > start or get_pod(admin, NAMESPACE, name)["spec"].get("nodeName"),
        timeout_s=WAIT_S,
        what=f"kube-scheduler trying {name} again",
    )
    pod = get_pod(admin, NAMESPACE, name)
    assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending", pod["metadata"]
    assert not events(admin, name, "QueueAdmitted") and not events(admin, name, "Scheduled")
    reason = pod["metadata"]["annotations"].get(QUEUE_REASON_ANNOTATION, "")
    assert "team-c is over its quota" in reason, reason  # still waiting in its queue, by the controller
    # the leader counts c-1 alone as admitted in team-c, holding its 1 GPU; c-2 waits
    leader = cluster.leader()
    counted = {
        m: cluster.metric(leader, f"gpunode_queue_{m}", "team-c")
        for m in ("admitted_jobs", "pending_jobs", "gpus_used")
    }
    assert counted == {"admitted_jobs": 1.0, "pending_jobs": 1.0, "gpus_used": 1.0}, counted


def test_a_tenant_patching_an_admission_mark_onto_its_own_held_pod_stays_held(cluster: QueueCluster) -> None:
    """The pod's owner (the `edit` ClusterRole: it may patch its pods) reads its pod's UID and patches on a
    mark naming it, with a made-up signature; then copies the valid signed mark of an admitted pod."""
    admin, tenant = cluster.cp.api(), cluster.cp.api("nobody")
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}"
    admin.apply(f"{rbac}/roles", TENANT_ROLE)
    admin.apply(f"{rbac}/rolebindings", TENANT_BINDING)
    try:
        submit(admin, queued_pod("c-1", "team-c", 1))
        c1 = eventually(partial(_bound, admin, "c-1"), timeout_s=WAIT_S, what="c-1 bound")
        valid = _check_placed_as_marked(cluster, c1)
        assert isinstance(valid.get("sig"), str), valid  # the controller signs its marks
        submit(admin, queued_pod("c-2", "team-c", 1))  # team-c may hold 1 GPU at most, and holds it
        eventually(
            lambda: (
                "over its quota"
                in get_pod(admin, NAMESPACE, "c-2")["metadata"]
                .get("annotations", {})
                .get(QUEUE_REASON_ANNOTATION, "")
            ),
            timeout_s=WAIT_S,
            what="c-2 waiting over team-c's quota",
        )
        uid = get_pod(tenant, NAMESPACE, "c-2")["metadata"]["uid"]  # the tenant reads its own pod
        node, gpu = _free_gpu(admin)
        forged = {"job": f"{NAMESPACE}/c-2", "uid": uid, "node": node, "gpus": [gpu], "at": valid["at"]}
        # a try of kube-scheduler's after each patch (up to its 10 s backoff): made-up signatures, the
        # valid signature of c-1's mark, malformed ones
        for sig in ("A" * 43, "B" * 43, valid["sig"], "forged", 42, "C" * 100000, None):
            _patch_and_stay_held(cluster, tenant, "c-2", {**forged, "sig": sig})
        # c-1's valid signed mark as it is (another pod's UID), with an unsigned field changed per try
        for attempt in range(3):
            _patch_and_stay_held(cluster, tenant, "c-2", {**valid, "try": attempt})
        # both sides read the forged marks and refused them, each process saying so once at most
        said = {}
        for proc in (cluster.extender, *cluster.controllers.values()):
            lines = proc.log.read_text(errors="replace").splitlines()
            said[proc.log.name] = [
                ln for ln in lines if f"admission mark on pod {NAMESPACE}/c-2 refused" in ln
            ]
        assert all(len(lines) <= 1 for lines in said.values()), said
        assert said[cluster.extender.log.name] and sum(map(len, said.values())) >= 2, said  # the leader too
        # the control: once c-1 is gone, the controller admits c-2 itself (its signed mark replaces the
        # forged one) and kube-scheduler binds it where that mark says
        admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/c-1?gracePeriodSeconds=0")
        c2 = eventually(partial(_bound, admin, "c-2"), timeout_s=WAIT_S, what="c-2 admitted and bound")
        mark = _check_placed_as_marked(cluster, c2)
        assert mark["sig"] not in ("A" * 43, valid["sig"], "forged") and mark["uid"] == uid
    finally:
        admin.delete(f"{rbac}/rolebindings/{TENANT_BINDING['metadata']['name']}")
        admin.delete(f"{rbac}/roles/{TENANT_ROLE['metadata']['name']}")


def _evictions(cp: ControlPlane, pod: str) -> list[dict[str, Any]]:
    return [
        e
        for e in cp.audit_events()
        if e.get("objectRef", {}).get("subresource") == "eviction"
        and e["objectRef"].get("name") == pod
        and e["objectRef"].get("namespace") == NAMESPACE
    ]


def _time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_borrowed_gpus_are_reclaimed_with_notice_then_eviction(cluster: QueueCluster) -> None:
    admin = cluster.cp.api()
    cp = cluster.cp
    # team-a is guaranteed 4 GPUs and takes all 8: it borrows team-b's idle guarantee.
    submit(admin, queued_pod("a-1", "team-a", 4), queued_pod("a-2", "team-a", 4))
    a_pods = {
        n: eventually(partial(_bound, admin, n), timeout_s=WAIT_S, what=f"{n} bound") for n in ("a-1", "a-2")
    }
    for pod in a_pods.values():
        _check_placed_as_marked(cluster, pod)
    submit(admin, queued_pod("b-1", "team-b", 4))  # within team-b's guarantee: reclaimed from team-a

    def victim() -> str | None:
        gone = [n for n in a_pods if f"{NAMESPACE}/{n}" in cluster.reaper.terminated]
        return gone[0] if gone else None

    name = eventually(victim, timeout_s=WAIT_S, what="one of team-a's jobs evicted")
    survivor = "a-2" if name == "a-1" else "a-1"
    b1 = eventually(partial(_bound, admin, "b-1"), timeout_s=WAIT_S, what="b-1 bound")
    mark = _check_placed_as_marked(cluster, b1)
    assert mark["node"] == a_pods[name]["spec"]["nodeName"], "b-1 takes the GPUs its victim held"
    assert sorted(mark["gpus"]) == sorted(_assigned(a_pods[name]))

    # The notice: on the pod (as it was when evicted) and as an Event naming the preemptor.
    last = cluster.reaper.terminated[f"{NAMESPACE}/{name}"]
    notice = json.loads(last["metadata"]["annotations"][PREEMPTION_NOTICE_ANNOTATION])
    assert notice["preemptor"] == f"{NAMESPACE}/b-1", notice
    warned = events(admin, name, "Preempting")
    assert len(warned) == 1 and warned[0]["type"] == "Warning", warned
    assert f"to make room for {NAMESPACE}/b-1" in event_text(warned[0]), warned
    # The eviction: through the Eviction API, by the controller's service account, after the deadline.
    queue_user = E2E_USERS["queue"].name
    evicted = _evictions(cp, name)
    # One request, accepted (201), policy/v1: no refused request, no fallback.
    assert len(evicted) == 1 and evicted[0]["responseStatus"]["code"] == 201, json.dumps(evicted)
    accepted = evicted
    assert accepted[0]["user"]["username"] == queue_user, json.dumps(evicted)
    assert accepted[0]["requestObject"]["apiVersion"] == "policy/v1", json.dumps(evicted)
    assert _time(accepted[0]["requestReceivedTimestamp"]) >= _time(notice["deadline"]), (notice, accepted)

    # The job that was not chosen keeps running, without a notice and never evicted.
    kept = get_pod(admin, NAMESPACE, survivor)
    assert kept["spec"]["nodeName"] and PREEMPTION_NOTICE_ANNOTATION not in kept["metadata"]["annotations"]
    assert not _evictions(cp, survivor) and not events(admin, survivor, "Preempting")
    gpus = [g for p in (kept, b1) for g in _assigned(p)]
    assert len(gpus) == len(set(gpus)) == 8, gpus


def _usage_saved(cluster: QueueCluster, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """The saved fair-share usage once `check` holds for it, else None."""
    usage = cluster.saved_usage()
    return usage if usage is not None and check(usage) else None


def test_standby_takes_over_from_a_killed_leader_without_double_admission(cluster: QueueCluster) -> None:
    admin = cluster.cp.api()
    submit(admin, *(queued_pod(f"k1-{i}", "team-a", 1, gang="k1", size=2) for i in range(2)))
    before = {
        n: _check_placed_as_marked(cluster, eventually(partial(_bound, admin, n), timeout_s=WAIT_S, what=n))
        for n in ("k1-0", "k1-1")
    }
    leader = cluster.leader()
    standby = next(c for c in CONTROLLERS if c != leader)
    # The leader saves team-a's fair-share usage every second; wait for 3 s of the gang's 2 GPUs.
    saved = eventually(
        partial(_usage_saved, cluster, lambda u: u["usage"].get("team-a", {}).get("gpu", 0) >= 6000),
        timeout_s=WAIT_S,
        what="team-a's usage saved",
    )
    assert saved["savedBy"] == leader, saved
    proc = cluster.controllers[leader]
    assert proc.popen is not None
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(30)
    submit(admin, queued_pod("k2", "team-b", 2), queued_pod("k3", "team-a", 1))
    eventually(lambda: cluster.leader() == standby, timeout_s=WAIT_S, what=f"{standby} holding the Lease")
    after = {
        n: eventually(partial(_bound, admin, n), timeout_s=WAIT_S, what=f"{n} bound")
        for n in ("k1-0", "k1-1", "k2", "k3")
    }
    for name, pod in after.items():
        mark = _check_placed_as_marked(cluster, pod)
        writer = event_source(_one_admission(admin, name))  # one admission each: none admitted twice
        if name in before:
            assert mark == before[name], "the new leader kept the old leader's admission"
            assert writer in CONTROLLERS, writer
        else:
            assert writer == standby, (name, writer)  # the killed one can write nothing more
    gpus = [g for p in after.values() for g in _assigned(p)]
    assert len(gpus) == len(set(gpus)) == 5, gpus
    # The nodes agree, once they publish all four: no GPU held by two pods.
    eventually(partial(bound_published, admin), timeout_s=WAIT_S, what="every bound pod published")
    holders = held_gpus(admin)
    assert sorted(g for g, pods in holders.items() if len(pods) == 1) == sorted(gpus), holders
    # The standby went on from the usage the killed leader saved last, decayed by the half-life: not from 0.
    log = cluster.controllers[standby].log.read_text(errors="replace")
    assert re.search(r"fair-share usage of [1-9]\d* queue\(s\) loaded from ConfigMap", log), log[-2000:]
    resumed = eventually(
        partial(_usage_saved, cluster, lambda u: u["savedBy"] == standby),
        timeout_s=WAIT_S,
        what=f"{standby} saving the usage",
    )
    decay = 2 ** (-(resumed["at"] - saved["at"]) / resumed["halfLifeSeconds"])
    assert resumed["usage"]["team-a"]["gpu"] >= saved["usage"]["team-a"]["gpu"] * decay * (1 - 1e-9)
    # The killed replica comes back as the standby.
    cluster.start_controller(f"{leader}-restarted")


def _refusals(cluster: QueueCluster, identity: str) -> int:
    return cluster.controllers[identity].log.read_text(errors="replace").count(REFUSED_LINE)


def _refused(cluster: QueueCluster, identity: str) -> bool:
    return _refusals(cluster, identity) >= 1


def _write(path: Path, text: str) -> None:
    """Replace the file at once, as a ConfigMap volume swaps its files."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(path)


def test_bad_queue_configuration_is_refused_and_the_running_one_stays(cluster: QueueCluster) -> None:
    admin = cluster.cp.api()
    live = [i for i, p in cluster.controllers.items() if p.running()]
    assert len(live) == 2, live
    _write(cluster.config, BAD_QUEUE_CONFIG)
    try:
        for identity in live:
            eventually(partial(_refused, cluster, identity), timeout_s=WAIT_S, what=f"{identity} refusing")
        # team-c exists only in the running configuration: its pod is admitted under it.
        submit(admin, queued_pod("after-refusal", "team-c", 1))
        pod = eventually(
            partial(_bound, admin, "after-refusal"), timeout_s=WAIT_S, what="after-refusal bound"
        )
        _check_placed_as_marked(cluster, pod)
        assert "admitted in team-c" in event_text(_one_admission(admin, "after-refusal"))
        for identity in live:
            log = cluster.controllers[identity].log.read_text(errors="replace")
            lines = [ln for ln in log.splitlines() if REFUSED_LINE in ln]
            assert len(lines) == 1, lines  # one line, not one per reload period
            assert "weight" in lines[0] and "hint:" in lines[0], lines
    finally:
        _write(cluster.config, QUEUE_CONFIG)


def test_no_error_lines_but_the_refusal(cluster: QueueCluster) -> None:
    errors = {
        log: [ln for ln in lines if REFUSED_LINE not in ln] for log, lines in cluster.error_lines().items()
    }
    assert not any(errors.values()), errors
    assert not cluster.reaper.errors, cluster.reaper.errors
    for node in cluster.nodes.values():
        assert node.admitter is not None
        assert not node.admitter.errors, node.admitter.errors
