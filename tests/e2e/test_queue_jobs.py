"""batch/v1 Jobs governed by a queue, on the real control plane: the real Job controller of
kube-controller-manager 1.36 makes and deletes their pods (docs/queueing.md, "Jobs and JobSets").

The cluster of tests.e2e.queue (the extender with its hold, kube-scheduler, two simulated nodes of four
GPUs), with the chart rendered with queue.gate.enabled: two `gpunode queue` replicas with the
Deployment's arguments serve the webhook, and the chart's MutatingWebhookConfiguration (pods, Jobs and
JobSets), both ValidatingAdmissionPolicies and their bindings are applied to the real API server; the
chart's RBAC for the controller is the one in force. A tenant holds the pod and Job rights of the `edit`
role in the namespace. Pods on simulated nodes do not run: the test marks them Succeeded through the
pods' status, as the node's kubelet would, then deletes them once the Job controller counted them (the
kubelet then gives their devices back: the Reaper of tests.e2e.queue).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from gpunode.contract.names import (
    ASSIGNMENT_ANNOTATION,
    GPU_RESOURCE,
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_LABEL,
    QUEUE_REASON_ANNOTATION,
)
from tests.e2e import chart
from tests.e2e.api import STRATEGIC, Api, ApiError, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import ControlPlane
from tests.e2e.objects import get_pod
from tests.e2e.queue import (
    CHART_VALUES,
    LEASE,
    NAMESPACE,
    NOTICE_S,
    WAIT_S,
    build_queue_cluster,
    delete_all_pods,
    event_text,
    stop_queue_cluster,
)
from tests.e2e.test_queue_gates import (
    BINDINGS,
    BLOCK_MESSAGE,
    HOOK_NAME,
    HOOKS,
    POLICIES,
    POLICY_NAME,
    Gates,
    bound,
    check_released_as_planned,
    gate_of,
    hold_back_releases,
    mark_of,
)
from tests.ports import free_port

JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
SUSPENSION = f"{LEASE}-suspension"
TENANT = "e2e-jobs-tenant"
TENANT_ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "Role",
    "metadata": {"name": TENANT, "namespace": NAMESPACE},
    "rules": [  # the pod and Job rights of the `edit` ClusterRole
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
    ],
}  # fmt: skip
TENANT_BINDING = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "RoleBinding",
    "metadata": {"name": TENANT, "namespace": NAMESPACE},
    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": TENANT},
    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": E2E_USERS["nobody"].name}],
}
RESUME_REFUSED = "only the queue controller resumes a Job or JobSet its queue governs"
LABEL_REFUSED = "the queue label of a suspended Job or JobSet its queue governs is kept"
BLOCK = "e2e-jobs-block-release"


def job_body(
    name: str, queue: str | None, parallelism: int, completions: int, gpus: int = 1
) -> dict[str, Any]:
    """A Job of `parallelism` pods at once, `completions` in all, each asking `gpus` whole GPUs, labelled
    with `queue` (on the Job only: the webhook labels its pod template)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: queue} if queue else {}},
        "spec": {
            "parallelism": parallelism,
            "completions": completions,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.invalid/train:1",
                            "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                        }
                    ],
                }
            },
        },
    }


def get_job(api: Api, name: str) -> dict[str, Any]:
    return dict(api.get(f"{JOBS}/{name}"))


def pods_of(api: Api, job: str) -> list[dict[str, Any]]:
    """The Job's pods that are not being deleted, by name."""
    items = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=batch.kubernetes.io/job-name%3D{job}")
    return sorted(
        (p for p in items["items"] if not p["metadata"].get("deletionTimestamp")),
        key=lambda p: p["metadata"]["name"],
    )


def job_events(api: Api, name: str, reason: str) -> list[dict[str, Any]]:
    query = f"fieldSelector=involvedObject.kind%3DJob,involvedObject.name%3D{name}"
    items = api.get(f"/api/v1/namespaces/{NAMESPACE}/events?{query}")["items"]
    return [e for e in items if e.get("reason") == reason]


def job_mark(job: dict[str, Any]) -> dict[str, Any] | None:
    text = (job["metadata"].get("annotations") or {}).get(QUEUE_ADMITTED_ANNOTATION)
    return json.loads(text) if text else None


def slots_of(mark: dict[str, Any]) -> Counter[tuple[str, tuple[str, ...]]]:
    """The plan's (node, GPUs) of a Job's mark (each slot is [group, node, GPUs])."""
    return Counter((node, tuple(gpus)) for _, node, gpus in (json.loads(s) for s in mark["gpus"]))


def admitted_running(api: Api, name: str) -> dict[str, Any] | None:
    job = get_job(api, name)
    return job if job["spec"].get("suspend") is False and job_mark(job) else None


def all_bound(api: Api, name: str, count: int) -> list[dict[str, Any]] | None:
    pods = pods_of(api, name)
    live = [p for p in pods if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
    if len(live) != count:
        return None
    done = [bound(api, p["metadata"]["name"]) for p in live]
    # bound and running: the node's kubelet stand-in reported it started (a pod marked Succeeded before
    # then could be reported Running again by a stand-in that listed it before)
    running = [p for p in done if p and p.get("status", {}).get("phase") == "Running"]
    return running if len(running) == count else None


def succeed(api: Api, pods: list[dict[str, Any]]) -> None:
    """Mark the pods Succeeded, as the node's kubelet reports a container that exited 0."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for p in pods:
        api.patch(
            f"/api/v1/namespaces/{NAMESPACE}/pods/{p['metadata']['name']}/status",
            {
                "status": {
                    "phase": "Succeeded",
                    "containerStatuses": [
                        {
                            "name": "main",
                            "image": "registry.invalid/train:1",
                            "imageID": "",
                            "ready": False,
                            "restartCount": 0,
                            "state": {
                                "terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now}
                            },
                        }
                    ],
                }
            },
            content_type=STRATEGIC,
        )


def counted_and_removed(api: Api, job: str, pods: list[dict[str, Any]], succeeded: int) -> None:
    """Wait until the Job controller counted the pods (status.succeeded, its tracking finalizer off them),
    then delete them: the kubelet gives their devices back (the Reaper)."""
    eventually(
        lambda: get_job(api, job).get("status", {}).get("succeeded", 0) >= succeeded,
        timeout_s=WAIT_S,
        what=f"{job}: {succeeded} counted",
    )
    for p in pods:
        name = p["metadata"]["name"]

        def untracked(name: str = name) -> bool:
            return not [
                f for f in get_pod(api, NAMESPACE, name)["metadata"].get("finalizers") or () if "job" in f
            ]

        eventually(untracked, timeout_s=WAIT_S, what=f"{name} no longer tracked by the Job controller")
        api.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}?gracePeriodSeconds=0")


@pytest.fixture(scope="module")
def jobs(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gates]:
    tmp = tmp_path_factory.mktemp("queue-jobs")
    qc = build_queue_cluster(control_plane, tmp)
    admin = control_plane.api()
    try:
        values = copy.deepcopy(CHART_VALUES)
        values["queue"]["gate"] = {"enabled": True}
        (tmp / "gate").mkdir()
        g = Gates(qc, chart.render(values, tmp / "gate"))
        host = f"{HOOK_NAME}.{chart.NAMESPACE}.svc"
        for identity in ("jobs-1", "jobs-2"):
            g.certs[identity] = control_plane.issue(
                identity, common_name=host, server=True, hosts=("127.0.0.1",)
            )
            g.start_controller(identity)
        admin.apply(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles", TENANT_ROLE)
        admin.apply(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/rolebindings", TENANT_BINDING)
        for name in (POLICY_NAME, SUSPENSION):
            admin.apply(POLICIES, g.doc("ValidatingAdmissionPolicy", name))
            admin.apply(BINDINGS, g.doc("ValidatingAdmissionPolicyBinding", name))
        g.point_webhook(g.webhook_ports["jobs-1"])
        g.webhook_in_force()
        eventually(
            partial(_created_suspended, admin), timeout_s=WAIT_S, what="the webhook suspending a new Job"
        )
        _delete_jobs(admin)
        delete_all_pods(qc)
        yield g
    finally:
        for path in (f"{HOOKS}/{HOOK_NAME}", f"{BINDINGS}/{BLOCK}", f"{POLICIES}/{BLOCK}"):
            admin.delete(path)
        for name in (POLICY_NAME, SUSPENSION):
            admin.delete(f"{BINDINGS}/{name}")
            admin.delete(f"{POLICIES}/{name}")
        admin.delete(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/rolebindings/{TENANT}")
        admin.delete(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles/{TENANT}")
        _delete_jobs(admin)
        stop_queue_cluster(qc)


def _created_suspended(admin: Api) -> bool:
    """Create a governed Job (asking more GPUs than a node has: never admitted) without spec.suspend, under
    a new name each call: whether it was created suspended."""
    name = f"probe-{len(admin.get(JOBS)['items'])}"
    created = admin.create(JOBS, job_body(name, "team-a", 1, 1, gpus=8))
    return created["spec"].get("suspend") is True


def _delete_jobs(admin: Api) -> None:
    for j in admin.get(JOBS)["items"]:
        admin.delete(f"{JOBS}/{j['metadata']['name']}?propagationPolicy=Background")
    eventually(lambda: not admin.get(JOBS)["items"], timeout_s=WAIT_S, what="every Job deleted")


@pytest.fixture(autouse=True)
def _clean(jobs: Gates) -> Iterator[None]:
    yield
    admin = jobs.qc.cp.api()
    _delete_jobs(admin)
    delete_all_pods(jobs.qc)


def test_a_job_of_four_is_created_suspended_admitted_as_one_gang_and_bound_to_its_plan(jobs: Gates) -> None:
    admin, tenant = jobs.qc.cp.api(), jobs.qc.cp.api("nobody")
    created = tenant.create(JOBS, job_body("train", "team-a", 4, 4))
    assert created["spec"]["suspend"] is True  # the webhook
    assert created["spec"]["template"]["metadata"]["labels"][QUEUE_LABEL] == "team-a"
    job = eventually(partial(admitted_running, admin, "train"), timeout_s=WAIT_S, what="train resumed")
    mark = job_mark(job)
    assert (
        mark is not None and mark["job"] == f"{NAMESPACE}/Job/train" and mark["uid"] == job["metadata"]["uid"]
    )
    pods = eventually(partial(all_bound, admin, "train", 4), timeout_s=WAIT_S, what="train's 4 pods bound")
    marks = [check_released_as_planned(p) for p in pods]
    assert {m["job"] for m in marks} == {f"{NAMESPACE}/Job/train"}
    assert Counter((m["node"], tuple(m["gpus"])) for m in marks) == slots_of(mark)  # exactly the plan
    gpus = [g for m in marks for g in m["gpus"]]
    assert len(set(gpus)) == 4
    assert len(job_events(admin, "train", "QueueAdmitted")) == 1
    succeed(admin, pods)
    counted_and_removed(admin, "train", pods, 4)
    done = eventually(
        lambda: get_job(admin, "train") if "Complete" in _conditions(get_job(admin, "train")) else None,
        timeout_s=WAIT_S,
        what="train complete",
    )
    assert done["status"]["succeeded"] == 4


def _conditions(job: dict[str, Any]) -> set[str]:
    return {c["type"] for c in job.get("status", {}).get("conditions") or () if c.get("status") == "True"}


def test_a_reclaiming_job_suspends_a_borrowing_one_after_the_notice_which_resumes_later_and_counts_once(
    jobs: Gates,
) -> None:
    admin = jobs.qc.cp.api()
    admin.create(JOBS, job_body("base", "team-a", 4, 4))
    base = eventually(partial(all_bound, admin, "base", 4), timeout_s=WAIT_S, what="base bound")
    admin.create(JOBS, job_body("borrow", "team-a", 4, 6))  # team-a borrows team-b's four
    first = eventually(partial(all_bound, admin, "borrow", 4), timeout_s=WAIT_S, what="borrow bound")
    # two of borrow's pods finish: the Job controller makes two more, on the slots they free
    succeed(admin, first[:2])
    counted_and_removed(admin, "borrow", first[:2], 2)
    eventually(partial(all_bound, admin, "borrow", 4), timeout_s=WAIT_S, what="borrow's next two bound")
    plan = slots_of(job_mark(get_job(admin, "borrow")) or {})
    now = [check_released_as_planned(p) for p in pods_of(admin, "borrow")]
    assert Counter((m["node"], tuple(m["gpus"])) for m in now) == plan

    admin.create(JOBS, job_body("claim", "team-b", 4, 4))  # team-b reclaims its guarantee
    noticed = eventually(
        lambda: (
            get_job(admin, "borrow")
            if (get_job(admin, "borrow")["metadata"].get("annotations") or {}).get(
                PREEMPTION_NOTICE_ANNOTATION
            )
            else None
        ),
        timeout_s=WAIT_S,
        what="the notice on borrow",
    )
    notice = json.loads(noticed["metadata"]["annotations"][PREEMPTION_NOTICE_ANNOTATION])
    assert notice["preemptor"] == f"{NAMESPACE}/Job/claim"
    (event,) = job_events(admin, "borrow", "Preempting")
    assert "suspended then" in event_text(event)
    for p in pods_of(admin, "borrow"):  # the pods see the notice (a downward API volume)
        assert p["metadata"]["annotations"].get(PREEMPTION_NOTICE_ANNOTATION)
    assert noticed["spec"]["suspend"] is False  # not before the deadline
    suspended = eventually(
        lambda: get_job(admin, "borrow") if get_job(admin, "borrow")["spec"].get("suspend") else None,
        timeout_s=WAIT_S + NOTICE_S,
        what="borrow suspended after its notice",
    )
    assert job_mark(suspended) is None
    assert not (suspended["metadata"].get("annotations") or {}).get(PREEMPTION_NOTICE_ANNOTATION)
    assert len(job_events(admin, "borrow", "QueueSuspended")) == 1
    evictions = [
        e for e in jobs.qc.cp.audit_events() if e.get("objectRef", {}).get("subresource") == "eviction"
    ]
    assert not [e for e in evictions if e["objectRef"].get("name", "").startswith("borrow")]  # no eviction
    claim = eventually(partial(all_bound, admin, "claim", 4), timeout_s=WAIT_S, what="claim bound")
    eventually(lambda: not pods_of(admin, "borrow"), timeout_s=WAIT_S, what="borrow's pods gone")
    assert get_job(admin, "borrow")["status"].get("succeeded") == 2  # progress kept across the suspension
    reason = eventually(
        lambda: (get_job(admin, "borrow")["metadata"].get("annotations") or {}).get(QUEUE_REASON_ANNOTATION),
        timeout_s=WAIT_S,
        what="borrow's reason while it waits",
    )
    assert "team-a" in reason

    # base and claim finish: borrow resumes with what remains (4 of its 6) and completes with 6, not 8
    for name, pods in (("base", base), ("claim", claim)):
        succeed(admin, pods)
        counted_and_removed(admin, name, pods, 4)
    eventually(partial(admitted_running, admin, "borrow"), timeout_s=WAIT_S, what="borrow resumed")
    second = eventually(partial(all_bound, admin, "borrow", 4), timeout_s=WAIT_S, what="borrow bound again")
    for p in second:
        check_released_as_planned(p)
    assert len(slots_of(job_mark(get_job(admin, "borrow")) or {}).values()) >= 1
    assert sum(slots_of(job_mark(get_job(admin, "borrow")) or {}).values()) == 4
    succeed(admin, second)
    counted_and_removed(admin, "borrow", second, 6)
    done = eventually(
        lambda: get_job(admin, "borrow") if "Complete" in _conditions(get_job(admin, "borrow")) else None,
        timeout_s=WAIT_S,
        what="borrow complete",
    )
    assert done["status"]["succeeded"] == 6


def test_a_leader_killed_between_resuming_a_job_and_releasing_its_pods_is_finished_by_the_next(
    jobs: Gates,
) -> None:
    """The window held open by a policy of the test's own refusing every removal of the gate: the leader
    resumes the Job, its pods are created gated and marked, their releases refused; both controllers are
    SIGKILLed, the policy deleted, and a controller started: it releases the pods on the Job's plan without
    admitting the Job again."""
    qc = jobs.qc
    admin = qc.cp.api()
    hold_back_releases(admin, BLOCK)
    try:
        probe = jobs.probe(keep=True)
        controller = qc.cp.api("queue")
        eventually(
            lambda: _release_refused(controller, probe["metadata"]["name"]),
            timeout_s=WAIT_S,
            what="the test's policy refusing releases",
        )
        admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{probe['metadata']['name']}?gracePeriodSeconds=0")
        admin.create(JOBS, job_body("k", "team-a", 4, 4))

        def resumed_pods_marked_and_gated() -> list[dict[str, Any]] | None:
            if admitted_running(admin, "k") is None:
                return None
            pods = pods_of(admin, "k")
            return pods if len(pods) == 4 and all(mark_of(p) and gate_of(p) for p in pods) else None

        eventually(
            resumed_pods_marked_and_gated, timeout_s=WAIT_S, what="k resumed, its pods marked and gated"
        )
        leader = qc.leader()
        log = qc.controllers[leader].log
        eventually(
            lambda: BLOCK_MESSAGE in log.read_text(errors="replace"),
            timeout_s=WAIT_S,
            what="a release refused",
        )
        for identity in ("jobs-1", "jobs-2"):
            popen = qc.controllers[identity].popen
            assert popen is not None
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(30)
    finally:
        admin.delete(f"{BINDINGS}/{BLOCK}")
        admin.delete(f"{POLICIES}/{BLOCK}")
    planted = get_job(admin, "k")
    plan = job_mark(planted)
    assert plan is not None and planted["spec"]["suspend"] is False
    for p in pods_of(admin, "k"):  # nothing moved while no controller ran
        assert gate_of(p) and not p["spec"].get("nodeName")
    jobs.start_controller("jobs-1")
    jobs.start_controller("jobs-2")
    pods = eventually(partial(all_bound, admin, "k", 4), timeout_s=WAIT_S, what="k's pods bound")
    marks = [check_released_as_planned(p) for p in pods]
    assert Counter((m["node"], tuple(m["gpus"])) for m in marks) == slots_of(plan)
    assert job_mark(get_job(admin, "k")) == plan  # finished, not admitted again
    assert len(job_events(admin, "k", "QueueAdmitted")) == 1


def _release_refused(api: Api, pod: str) -> bool:
    try:
        api.patch(
            f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}?dryRun=All", {"spec": {"schedulingGates": None}}
        )
    except ApiError as exc:
        return BLOCK_MESSAGE in exc.body
    return False


def test_the_tenant_cannot_resume_its_governed_job_and_a_job_that_cannot_be_queued_says_why(
    jobs: Gates,
) -> None:
    admin, tenant = jobs.qc.cp.api(), jobs.qc.cp.api("nobody")
    tenant.create(JOBS, job_body("big", "team-c", 2, 2))  # team-c may hold one GPU: it waits
    eventually(
        lambda: (get_job(admin, "big")["metadata"].get("annotations") or {}).get(QUEUE_REASON_ANNOTATION),
        timeout_s=WAIT_S,
        what="big waiting with its reason",
    )
    for attack, body in (
        ("resume", {"spec": {"suspend": False}}),
        ("drop the queue label", {"spec": {"template": {"metadata": {"labels": {QUEUE_LABEL: None}}}}}),
        ("move to another queue", {"metadata": {"labels": {QUEUE_LABEL: "team-a"}}}),
    ):
        with pytest.raises(ApiError) as refused:
            tenant.patch(f"{JOBS}/big", body)
        assert refused.value.status in (403, 422), (attack, refused.value)
        want = RESUME_REFUSED if attack == "resume" else LABEL_REFUSED
        assert want in refused.value.body, (attack, refused.value.body)
    job = get_job(admin, "big")
    assert job["spec"]["suspend"] is True and not pods_of(admin, "big")
    # a Job no queue governs is the tenant's to suspend and resume
    free = job_body("free", None, 1, 1)
    free["spec"]["suspend"] = True
    free["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "10m"}}
    tenant.create(JOBS, free)
    tenant.patch(f"{JOBS}/free", {"spec": {"suspend": False}})
    assert get_job(admin, "free")["spec"]["suspend"] is False

    # unknown queue, and more GPUs than the cluster has: one Warning Event each, the reason and a condition
    tenant.create(JOBS, job_body("lost", "no-such-queue", 1, 1))
    tenant.create(JOBS, job_body("huge", "team-a", 9, 9))
    for name, text in (("lost", "no-such-queue"), ("huge", "it asks for 9 GPUs at once, the cluster has 8")):
        event = eventually(
            lambda name=name: next(iter(job_events(admin, name, "QueueRefused")), None),  # type: ignore[misc]
            timeout_s=WAIT_S,
            what=f"{name} refused",
        )
        assert event["type"] == "Warning" and text in event_text(event)
        job = eventually(
            lambda name=name: (
                get_job(admin, name)  # type: ignore[misc]
                if "QueueRefused" in _conditions(get_job(admin, name))
                else None
            ),
            timeout_s=WAIT_S,
            what=f"{name}'s QueueRefused condition",
        )
        (cond,) = [c for c in job["status"]["conditions"] if c["type"] == "QueueRefused"]
        assert text in cond["message"] and job["spec"]["suspend"] is True
        assert text in job["metadata"]["annotations"][QUEUE_REASON_ANNOTATION]
    eventually(
        lambda: all(len(job_events(admin, n, "QueueRefused")) == 1 for n in ("lost", "huge")),
        timeout_s=WAIT_S,
        what="one QueueRefused each",
    )
    time.sleep(3)  # several reconciles (resync 1 s): still one each
    assert [len(job_events(admin, n, "QueueRefused")) for n in ("lost", "huge")] == [1, 1]


def test_webhook_down_a_governed_job_created_running_is_suspended_then_admitted_on_its_plan(
    jobs: Gates,
) -> None:
    """failurePolicy Ignore with the webhook's Service down: the Job (its pod template labelled with the queue
    too, as docs/queueing.md asks for this second line) is created unsuspended and its pods ungated; the
    controller suspends it (its pods, held by the extender meanwhile, never ran), then admits it, and its
    new pods, still ungated, are marked on the plan and placed there by the extender."""
    admin = jobs.qc.cp.api()
    try:
        jobs.point_webhook(free_port())  # no one listens there
        eventually(
            lambda: not _created_suspended(admin), timeout_s=WAIT_S, what="the webhook down and ignored"
        )
        _delete_jobs(admin)
        body = job_body("open", "team-a", 2, 2)
        body["spec"]["template"]["metadata"] = {"labels": {QUEUE_LABEL: "team-a"}}
        created = admin.create(JOBS, body)
        assert created["spec"].get("suspend") is not True
        event = eventually(
            lambda: next(iter(job_events(admin, "open", "QueueSuspended")), None),
            timeout_s=WAIT_S,
            what="open suspended by the controller",
        )
        assert event["type"] == "Warning" and "without an admission" in event_text(event)
        eventually(partial(admitted_running, admin, "open"), timeout_s=WAIT_S, what="open admitted")
        pods = eventually(partial(all_bound, admin, "open", 2), timeout_s=WAIT_S, what="open's pods bound")
        assert all(p["metadata"]["creationTimestamp"] >= event["firstTimestamp"] for p in pods)  # made anew
        plan = slots_of(job_mark(get_job(admin, "open")) or {})
        marks = [mark_of(p) for p in pods]
        assert all(m is not None for m in marks)
        assert Counter((m["node"], tuple(m["gpus"])) for m in marks if m) == plan
        for p in pods:  # ungated all along: the extender placed each on exactly its mark's node and GPUs
            mark = mark_of(p) or {}
            assert p["spec"]["nodeName"] == mark.get("node") and not gate_of(p)
            assigned = p["metadata"]["annotations"][ASSIGNMENT_ANNOTATION].split(",")
            assert sorted(g for g in assigned if g) == sorted(mark["gpus"])
    finally:
        jobs.point_webhook(jobs.webhook_ports["jobs-1"])
        jobs.webhook_in_force()
