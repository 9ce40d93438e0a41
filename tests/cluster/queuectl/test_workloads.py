"""Governed Jobs and JobSets: admission by resuming, pods on the plan's slots, preemption by suspension,
progress kept, refusals, a new leader finishing or undoing an admission, the webhook's patch and the
Kueue queue-name alias. The core is driven with v1 JSON as the watches give it; no I/O."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

from gpunode.cluster.extender.queued import queue_of, read_admitted
from gpunode.cluster.queuectl.core import QueueCore
from gpunode.cluster.queuectl.webhook import review_response
from gpunode.cluster.queuectl.workloads import (
    JOB,
    JOBSET,
    Slot,
    job_pods_now,
    read_workload_mark,
    workload_mark_text,
)
from gpunode.cluster.queuectl.writes import Actions, Patch
from gpunode.cluster.queuemark import MarkKey
from gpunode.contract.names import (
    ADMISSION_GATE,
    GPU_RESOURCE,
    JOBSET_API_VERSION,
    KUEUE_QUEUE_LABEL,
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_LABEL,
    QUEUE_REASON_ANNOTATION,
    REPLICATED_JOB_LABEL,
    RUNTIME_ANNOTATION,
)
from tests.cluster.queuectl.helpers import CONFIG_YAML, config, node

KEY = MarkKey(b"k" * 32, source="test")
T0 = 1_800_000_000.0


def template(gpus: int = 1, *, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"labels": dict(labels or {})},
        "spec": {
            "containers": [
                {"name": "main", "image": "x", "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}
            ],
            "restartPolicy": "Never",
            **spec,
        },
    }


def job(
    name: str,
    *,
    queue: str | None = "team-a",
    parallelism: int = 4,
    completions: int | None = 4,
    succeeded: int = 0,
    suspend: bool = True,
    gpus: int = 1,
    uid: str = "",
    **meta: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"parallelism": parallelism, "template": template(gpus), "suspend": suspend}
    if completions is not None:
        spec["completions"] = completions
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": uid or f"uid-{name}",
            "labels": {QUEUE_LABEL: queue} if queue else {},
            "annotations": {},
            "creationTimestamp": "2026-01-01T00:00:00Z",
            **meta,
        },
        "spec": spec,
        "status": {"succeeded": succeeded},
    }


def job_pod(owner: dict[str, Any], i: int, *, kind: str = JOB, gated: bool = True) -> dict[str, Any]:
    meta = owner["metadata"]
    t = copy.deepcopy(owner["spec"]["template"])
    spec = t["spec"]
    if gated:
        spec["schedulingGates"] = [{"name": ADMISSION_GATE}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{meta['name']}-{i}",
            "namespace": meta["namespace"],
            "uid": f"{meta['uid']}-pod-{i}",
            "labels": {**t["metadata"].get("labels", {}), QUEUE_LABEL: "team-a"},
            "annotations": {},
            "ownerReferences": [{"kind": kind, "name": meta["name"], "uid": meta["uid"], "controller": True}],
            "creationTimestamp": "2026-01-01T00:00:01Z",
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }


def new_core(text: str = CONFIG_YAML, nodes: int = 1) -> QueueCore:
    core = QueueCore(config(text), mark_key=KEY)
    core.replace_all([], [node(f"n{i}") for i in range(1, nodes + 1)])
    core.replace_workloads(JOB, [])
    core.replace_workloads(JOBSET, [])
    return core


def apply_patches(core: QueueCore, actions: Actions) -> None:
    """What the API server makes of the patches of Jobs and JobSets."""
    for p in actions.patch:
        kind = p.target.kind
        obj = core.workload_objects[kind][p.target.uid]
        notes = obj["metadata"].setdefault("annotations", {})  # type: ignore[index]
        for k, v in p.annotations.items():
            if v is None:
                notes.pop(k, None)
            else:
                notes[k] = v
        if p.suspend is not None:
            obj["spec"]["suspend"] = p.suspend  # type: ignore[index]


def apply_pod_writes(core: QueueCore, actions: Actions) -> None:
    for a in actions.annotate:
        notes = core.pods[a.pod.key]["metadata"].setdefault("annotations", {})  # type: ignore[index]
        for k, v in a.annotations.items():
            if v is None:
                notes.pop(k, None)
            else:
                notes[k] = v
    for r in actions.release:
        core.pods[r.pod.key]["spec"].update(r.spec)  # type: ignore[attr-defined]


def add_pods(core: QueueCore, *pods: dict[str, Any]) -> None:
    for p in pods:
        core.pod_changed(p)


def admit_job(core: QueueCore, j: dict[str, Any], now: float = T0) -> Patch:
    core.workload_changed(JOB, j)
    actions = core.reconcile(now)
    (patch,) = [p for p in actions.patch if p.target.name == j["metadata"]["name"]]
    apply_patches(core, actions)
    return patch


def test_a_suspended_job_is_one_gang_admitted_by_resuming_it_with_a_signed_mark() -> None:
    core = new_core()
    j = job("train", runtime="x")
    j["metadata"]["annotations"][RUNTIME_ANNOTATION] = "30m"
    patch = admit_job(core, j)
    assert patch.suspend is False and patch.event is not None and patch.event[0] == "QueueAdmitted"
    mark = read_workload_mark(patch.annotations[QUEUE_ADMITTED_ANNOTATION], "uid-train", KEY, where="t")
    assert mark is not None and mark.job == "ml/Job/train" and len(mark.slots) == 4
    gpus = [g for s in mark.slots for g in s.gpus]
    assert len(set(gpus)) == 4 and {s.node for s in mark.slots} == {"n1"}
    assert core.last_workloads["ml/Job/train"].runtime_s == 1800
    # the mark is the controller's alone: another UID, or a forged signature, is no admission
    assert (
        read_workload_mark(patch.annotations[QUEUE_ADMITTED_ANNOTATION], "uid-other", KEY, where="t") is None
    )
    forged = json.loads(str(patch.annotations[QUEUE_ADMITTED_ANNOTATION]))
    forged["sig"] = "A" * 43
    assert read_workload_mark(json.dumps(forged), "uid-train", KEY, where="t") is None
    # seen resumed with its mark: held, not admitted again
    again = core.reconcile(T0 + 1)
    assert not again.patch and not again.admitted_jobs
    assert "ml/Job/train" in core.sched.running  # type: ignore[union-attr]


def test_its_pods_are_created_gated_and_each_takes_a_slot_of_the_plan_and_is_released_there() -> None:
    core = new_core()
    j = job("train")
    patch = admit_job(core, j)
    mark = read_workload_mark(patch.annotations[QUEUE_ADMITTED_ANNOTATION], "uid-train", KEY, where="t")
    assert mark is not None
    pods = [job_pod(j, i) for i in range(4)]
    add_pods(core, *pods[:3])  # the Job controller creates them one by one
    first = core.reconcile(T0 + 1)
    assert len(first.annotate) == 3 and len(first.release) == 3
    apply_pod_writes(core, first)
    add_pods(core, pods[3])
    second = core.reconcile(T0 + 2)
    assert [a.pod.name for a in second.annotate] == ["train-3"] and len(second.release) == 1
    apply_pod_writes(core, second)
    taken = []
    for p in core.pods.values():
        m = read_admitted(p["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION], p["metadata"]["uid"], KEY)
        assert m is not None and m.job == "ml/Job/train"
        pinned = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert pinned["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [m.node]
        assert not p["spec"].get("schedulingGates")
        taken.append(Slot("", m.node, m.gpus))
    assert sorted(taken, key=repr) == sorted(mark.slots, key=repr)
    # a fifth pod (beyond the plan) gets nothing and stays gated
    add_pods(core, job_pod(j, 4))
    extra = core.reconcile(T0 + 3)
    assert not extra.annotate and not extra.release
    # not queued as pods: no pod job exists for them
    assert not core.last_jobs


def test_a_pod_that_succeeded_frees_its_slot_for_the_next_pod_of_the_job() -> None:
    core = new_core()
    j = job("train", parallelism=2, completions=3)
    admit_job(core, j)
    p0, p1 = job_pod(j, 0), job_pod(j, 1)
    add_pods(core, p0, p1)
    apply_pod_writes(core, core.reconcile(T0 + 1))
    core.pods["ml/train-0"]["status"] = {"phase": "Succeeded"}  # type: ignore[index]
    p2 = job_pod(j, 2)
    add_pods(core, p2)
    out = core.reconcile(T0 + 2)
    assert [a.pod.name for a in out.annotate] == ["train-2"]
    slot0 = read_admitted(
        core.pods["ml/train-0"]["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION],
        p0["metadata"]["uid"],
        KEY,
    )  # type: ignore[index]
    slot2 = read_admitted(out.annotate[0].annotations[QUEUE_ADMITTED_ANNOTATION], p2["metadata"]["uid"], KEY)
    assert slot0 is not None and slot2 is not None and slot2.gpus == slot0.gpus


def test_the_gang_is_what_remains_of_its_completions() -> None:
    assert job_pods_now({"parallelism": 4, "completions": 10}, 0) == 4
    assert job_pods_now({"parallelism": 4, "completions": 10}, 8) == 2
    assert job_pods_now({"parallelism": 4, "completions": 10}, 10) == 0
    assert job_pods_now({"parallelism": 3}, 0) == 3 and job_pods_now({"parallelism": 3}, 1) == 0
    assert job_pods_now({}, 0) == 1
    core = new_core()
    patch = admit_job(core, job("rest", parallelism=4, completions=6, succeeded=4))
    mark = read_workload_mark(patch.annotations[QUEUE_ADMITTED_ANNOTATION], "uid-rest", KEY, where="t")
    assert mark is not None and len(mark.slots) == 2


TWO_QUEUES = """
queues:
  - name: team-a
    guarantee: {gpu: 4}
  - name: team-b
    guarantee: {gpu: 4}
preemption: {notice: 30s, minRuntime: 0s, reclaim: true, priority: false}
backfill: {enabled: false}
"""


def test_a_victim_job_gets_notice_then_is_suspended_and_waits_again_with_its_progress() -> None:
    core = new_core(TWO_QUEUES)
    base = job("base", parallelism=4, completions=4)
    victim = job("borrow", parallelism=4, completions=8)
    victim["metadata"]["creationTimestamp"] = "2026-01-01T00:00:05Z"
    admit_job(core, base)
    admit_job(core, victim, T0 + 1)  # team-a borrows team-b's 4
    add_pods(core, *(job_pod(j, i) for j in (base, victim) for i in range(4)))
    apply_pod_writes(core, core.reconcile(T0 + 2))
    for p in core.pods.values():
        p["spec"]["nodeName"] = "n1"  # type: ignore[index]
    owner = job("claim", queue="team-b", parallelism=4, completions=4)
    core.workload_changed(JOB, owner)
    out = core.reconcile(T0 + 10)
    notices = [p for p in out.patch if PREEMPTION_NOTICE_ANNOTATION in p.annotations]
    assert [p.target.name for p in notices] == ["borrow"] and notices[0].warning
    assert notices[0].event is not None and "suspended then" in notices[0].event[1]
    assert len([a for a in out.annotate if PREEMPTION_NOTICE_ANNOTATION in a.annotations]) == 4  # pods see it
    assert not [p for p in out.patch if p.suspend is False]  # the claimant waits for the notice
    apply_patches(core, out)
    apply_pod_writes(core, out)
    quiet = core.reconcile(T0 + 20)
    assert not [p for p in quiet.patch if p.suspend is not None] and not quiet.evict
    stop = core.reconcile(T0 + 41)
    suspended = [p for p in stop.patch if p.suspend is True]
    assert [p.target.name for p in suspended] == ["borrow"]
    assert suspended[0].annotations[QUEUE_ADMITTED_ANNOTATION] is None
    assert suspended[0].annotations[PREEMPTION_NOTICE_ANNOTATION] is None
    assert not stop.evict  # suspension, not eviction: the Job controller deletes the pods
    resumed = [p for p in stop.patch if p.suspend is False]
    assert [p.target.name for p in resumed] == ["claim"]  # admitted onto the room made
    apply_patches(core, stop)
    assert not [p for p in core.reconcile(T0 + 42).patch if p.suspend is not None]  # sent once
    # the Job controller deletes the pods; 3 had succeeded: the Job waits again for the 5 that remain
    for i in range(4):
        core.pod_changed(core.pods[f"ml/borrow-{i}"], deleted=True)
    core.workload_objects[JOB]["uid-borrow"]["status"]["succeeded"] = 3  # type: ignore[index]
    again = core.reconcile(T0 + 43)
    assert not [p for p in again.patch if p.target.name == "borrow" and p.suspend is False]
    w = core.last_workloads["ml/Job/borrow"]
    assert w.suspended and w.mark is None and w.size == 4  # min(parallelism 4, 8 - 3)
    assert "ml/Job/borrow" in core.waiting_since


def test_a_job_that_cannot_be_queued_is_reported_once_with_a_condition() -> None:
    core = new_core(nodes=2)
    core.workload_changed(JOB, job("nowhere", queue="no-such-queue"))
    core.workload_changed(JOB, job("wide", parallelism=1, completions=1, gpus=9))
    core.workload_changed(JOB, job("many", parallelism=17, completions=17))
    refused: dict[str, Patch] = {}
    for t in range(3):  # the cluster's size is known from the first reconcile on
        out = core.reconcile(T0 + t)
        assert not [p for p in out.patch if p.suspend is False]  # never resumed
        for p in out.patch:
            if p.event and p.event[0] == "QueueRefused":
                assert p.target.name not in refused, "reported twice"
                refused[p.target.name] = p
        apply_patches(core, out)
    assert set(refused) == {"nowhere", "wide", "many"}
    for p in refused.values():
        assert (
            p.warning and p.condition is not None and p.annotations[QUEUE_REASON_ANNOTATION] == p.condition[1]
        )
    assert "no-such-queue" in refused["nowhere"].condition[1]  # type: ignore[index]
    assert refused["wide"].condition[1] == "a pod asks for 9 GPUs, the largest node has 8"  # type: ignore[index]
    assert refused["many"].condition[1] == "it asks for 17 GPUs at once, the cluster has 16"  # type: ignore[index]
    # a new leader, from the same objects (their reason says they were reported): no second Event
    fresh = new_core(nodes=2)
    fresh.replace_workloads(JOB, list(core.workload_objects[JOB].values()))
    for t in range(3):
        assert not [p for p in fresh.reconcile(T0 + 10 + t).patch if p.event and p.event[0] == "QueueRefused"]
    assert not core._pending & {"ml/Job/nowhere", "ml/Job/wide", "ml/Job/many"}  # none waits in a queue


def test_a_job_that_cannot_be_queued_found_running_is_suspended_with_its_reason() -> None:
    core = new_core()
    core.workload_changed(JOB, job("lost", queue="no-such-queue", suspend=False))
    out = core.reconcile(T0)
    patches = [p for p in out.patch if p.target.name == "lost"]
    assert [p.event[0] for p in patches if p.event] == ["QueueRefused"]
    assert [p.suspend for p in patches if p.suspend is not None] == [True]
    assert {p.annotations[QUEUE_REASON_ANNOTATION] for p in patches} == {patches[0].condition[1]}  # type: ignore[index]


def test_a_governed_job_running_without_a_mark_is_suspended() -> None:
    core = new_core()
    core.workload_changed(JOB, job("sneak", suspend=False))
    out = core.reconcile(T0)
    (p,) = [q for q in out.patch if q.target.name == "sneak"]
    assert p.suspend is True and p.event is not None and p.event[0] == "QueueSuspended" and p.warning
    assert not core.reconcile(T0 + 1).patch  # sent once until seen


def test_a_new_leader_finishes_an_admission_from_the_jobs_mark() -> None:
    core = new_core()
    j = job("train")
    admit_job(core, j)
    add_pods(core, *(job_pod(j, i) for i in range(4)))
    objects = copy.deepcopy(core.workload_objects[JOB])
    pods = copy.deepcopy(list(core.pods.values()))
    fresh = new_core()  # the next leader: the Job resumed with its mark, its pods gated and unmarked
    fresh.replace_workloads(JOB, list(objects.values()))
    fresh.replace_all(pods, None)
    out = fresh.reconcile(T0 + 5)
    assert not out.patch and not out.admitted_jobs
    assert len(out.annotate) == 4 and len(out.release) == 4


def test_a_new_leader_undoes_an_admission_whose_plan_no_longer_fits() -> None:
    core = new_core(nodes=2)
    j = job("train", parallelism=8, completions=8)
    admit_job(core, j)
    mark = core.workload_objects[JOB]["uid-train"]["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION]  # type: ignore[index]
    fresh = new_core(nodes=0)
    fresh.replace_all([], [node("n9")])  # its nodes are gone
    fresh.replace_workloads(JOB, list(copy.deepcopy(core.workload_objects[JOB]).values()))
    assert mark
    out = fresh.reconcile(T0 + 5)
    (p,) = [q for q in out.patch if q.target.name == "train"]
    assert p.suspend is True and p.annotations[QUEUE_ADMITTED_ANNOTATION] is None


def jobset(name: str = "js") -> dict[str, Any]:
    def rj(rj_name: str, replicas: int, parallelism: int) -> dict[str, Any]:
        return {
            "name": rj_name,
            "replicas": replicas,
            "template": {
                "spec": {"parallelism": parallelism, "completions": parallelism, "template": template()}
            },
        }

    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": f"uid-{name}",
            "labels": {QUEUE_LABEL: "team-a"},
            "annotations": {},
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"suspend": True, "replicatedJobs": [rj("leader", 1, 1), rj("workers", 1, 3)]},
    }


def child_job(js: dict[str, Any], rj: str, parallelism: int) -> dict[str, Any]:
    j = job(
        f"{js['metadata']['name']}-{rj}-0", queue="team-a", parallelism=parallelism, completions=parallelism
    )
    j["metadata"]["labels"][REPLICATED_JOB_LABEL] = rj
    j["metadata"]["ownerReferences"] = [
        {"kind": "JobSet", "name": js["metadata"]["name"], "uid": js["metadata"]["uid"], "controller": True}
    ]
    return j


def test_a_jobset_is_one_gang_of_all_its_replicated_jobs_and_its_pods_take_their_groups_slots() -> None:
    core = new_core()
    js = jobset()
    core.workload_changed(JOBSET, js)
    leader, workers = child_job(js, "leader", 1), child_job(js, "workers", 3)
    core.workload_changed(JOB, leader)  # its Jobs are not queued on their own
    core.workload_changed(JOB, workers)
    out = core.reconcile(T0)
    assert [(p.target.kind, p.target.name, p.suspend) for p in out.patch] == [("JobSet", "js", False)]
    mark = read_workload_mark(out.patch[0].annotations[QUEUE_ADMITTED_ANNOTATION], "uid-js", KEY, where="t")
    assert mark is not None and sorted(s.group for s in mark.slots) == [
        "leader",
        "workers",
        "workers",
        "workers",
    ]
    apply_patches(core, out)
    add_pods(core, job_pod(leader, 0), *(job_pod(workers, i) for i in range(4)))
    placed = core.reconcile(T0 + 1)
    assert sorted(a.pod.name for a in placed.annotate) == [
        "js-leader-0-0",
        "js-workers-0-0",
        "js-workers-0-1",
        "js-workers-0-2",
    ]
    assert len(placed.release) == 4  # the fourth worker pod: no slot of its group is left


def test_a_jobset_too_big_for_the_cluster_is_admitted_whole_or_not_at_all() -> None:
    core = new_core("""
queues:
  - name: team-a
""")
    js = jobset()
    js["spec"]["replicatedJobs"][1]["replicas"] = 3  # 1 + 9 pods, 8 GPUs
    core.workload_changed(JOBSET, js)
    out = core.reconcile(T0)
    assert not [p for p in out.patch if p.suspend is False] and not out.admitted_jobs
    assert core.last_workloads["ml/JobSet/js"].size == 10


def review(obj: dict[str, Any], group: str, kind: str, namespaces: Any = None) -> list[dict[str, Any]]:
    req = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r1",
            "kind": {"group": group, "version": "v1", "kind": kind},
            "operation": "CREATE",
            "namespace": "ml",
            "object": obj,
        },
    }
    resp = review_response(req, namespaces if namespaces is not None else {})["response"]
    assert resp["allowed"] is True
    return json.loads(base64.b64decode(resp["patch"])) if "patch" in resp else []


def test_the_webhook_creates_governed_jobs_and_jobsets_suspended_with_their_pods_labelled() -> None:
    j = job("train", suspend=False)
    del j["spec"]["suspend"]
    ops = review(j, "batch", "Job")
    assert {"op": "add", "path": "/spec/suspend", "value": True} in ops
    assert {"op": "add", "path": "/spec/template/metadata/labels/gpunode.io~1queue", "value": "team-a"} in ops
    js = jobset()
    js["spec"]["suspend"] = False
    ops = review(js, "jobset.x-k8s.io", "JobSet")
    assert {"op": "add", "path": "/spec/suspend", "value": True} in ops
    assert len([o for o in ops if o["path"].endswith("gpunode.io~1queue")]) == 2
    # a Job of a JobSet is the JobSet's; a Job naming no queue, or asking no GPU, is not governed
    assert review(child_job(jobset(), "leader", 1), "batch", "Job") == []
    assert review(job("free", queue=None), "batch", "Job") == []
    cpu = job("cpu")
    cpu["spec"]["template"]["spec"]["containers"][0]["resources"] = {}
    assert review(cpu, "batch", "Job") == []
    # a mapped namespace governs an unlabelled Job
    assert {"op": "add", "path": "/spec/suspend", "value": True} in review(
        job("mapped", queue=None, suspend=False), "batch", "Job", {"ml": "team-b"}
    )


KUEUE_YAML = CONFIG_YAML + "kueue: {queueNameLabel: true}\n"


def test_the_kueue_queue_name_label_names_a_queue_only_when_configured_and_ours_wins() -> None:
    on, off = config(KUEUE_YAML).namespaces, config().namespaces
    assert on.kueue_label and not off.kueue_label
    kueue = {"metadata": {"namespace": "x", "labels": {KUEUE_QUEUE_LABEL: "team-b"}}}
    both = {"metadata": {"namespace": "x", "labels": {KUEUE_QUEUE_LABEL: "team-b", QUEUE_LABEL: "team-a"}}}
    assert queue_of(kueue, on) == "team-b" and queue_of(kueue, off) is None
    assert queue_of(both, on) == "team-a"
    core = new_core(KUEUE_YAML)
    j = job("kq", queue=None)
    j["metadata"]["labels"] = {KUEUE_QUEUE_LABEL: "team-b"}
    core.workload_changed(JOB, j)
    out = core.reconcile(T0)
    assert [p.target.name for p in out.patch if p.suspend is False] == ["kq"]
    assert core.last_workloads["ml/Job/kq"].queue == "team-b"


def test_priority_comes_from_the_templates_priority_class() -> None:
    core = new_core()
    core.priority_class_changed({"metadata": {"name": "high"}, "value": 1000})
    j = job("prio")
    j["spec"]["template"]["spec"]["priorityClassName"] = "high"
    core.workload_changed(JOB, j)
    core.reconcile(T0)
    assert core.last_workloads["ml/Job/prio"].priority == 1000
    text = workload_mark_text("ml/Job/prio", [Slot("", "n1", ("GPU-n1-0",))], T0, "uid-prio", key=KEY)
    assert read_workload_mark(text, "uid-prio", KEY, where="t") is not None


def test_the_queue_gauges_count_jobs_waiting_and_admitted() -> None:
    from gpunode.cluster.queuectl.metrics import QueueMetrics

    core = new_core()
    admit_job(core, job("run", parallelism=8, completions=8))
    core.workload_changed(JOB, job("wait", parallelism=2, completions=2))
    core.reconcile(T0 + 1)
    registry = QueueMetrics(lambda: core, lambda: True).registry
    assert registry.get_sample_value("gpunode_queue_admitted_jobs", {"queue": "team-a"}) == 1
    assert registry.get_sample_value("gpunode_queue_pending_jobs", {"queue": "team-a"}) == 1


def test_a_jobset_victim_is_suspended_whole_after_its_notice_and_waits_for_what_remains() -> None:
    core = new_core(
        """
queues:
  - name: team-a
  - name: team-b
    guarantee: {gpu: 8}
preemption: {notice: 30s, minRuntime: 0s, reclaim: true, priority: false}
backfill: {enabled: false}
"""
    )
    js = jobset()
    js["spec"]["replicatedJobs"][1]["replicas"] = 2  # 1 leader + 2 x 3 workers = 7 pods
    core.workload_changed(JOBSET, js)
    leader, w0 = child_job(js, "leader", 1), child_job(js, "workers", 3)
    w1 = child_job(js, "workers", 3)
    w1["metadata"].update(name="js-workers-1", uid="uid-js-workers-1")
    for j in (leader, w0, w1):
        core.workload_changed(JOB, j)
    out = core.reconcile(T0)
    apply_patches(core, out)
    pods = [job_pod(leader, 0), *(job_pod(w, i) for w in (w0, w1) for i in range(3))]
    add_pods(core, *pods)
    placed = core.reconcile(T0 + 1)
    assert len(placed.release) == 7
    apply_pod_writes(core, placed)
    core.workload_changed(JOB, job("claim", queue="team-b", parallelism=2, completions=2))
    noticed = core.reconcile(T0 + 5)
    assert [
        (p.target.kind, p.target.name) for p in noticed.patch if PREEMPTION_NOTICE_ANNOTATION in p.annotations
    ] == [("JobSet", "js")]
    apply_patches(core, noticed)
    stop = core.reconcile(T0 + 40)
    assert [(p.target.kind, p.suspend) for p in stop.patch if p.suspend is not None] == [
        ("JobSet", True),
        ("Job", False),
    ]
    apply_patches(core, stop)
    # its Jobs' pods go away; the first workers Job had completed: 1 + 3 pods remain to run
    for p in pods:
        core.pod_changed(p, deleted=True)
    core.workload_objects[JOB]["uid-js-workers-0"]["status"]["conditions"] = [  # type: ignore[index]
        {"type": "Complete", "status": "True"}
    ]
    core.reconcile(T0 + 41)
    assert core.last_workloads["ml/JobSet/js"].size == 4 and "ml/JobSet/js" in core.waiting_since


def test_the_extender_holds_a_pod_named_by_kueues_label_only_with_the_controllers_file() -> None:
    from gpunode.cluster.extender.queued import queue_hold

    p = {"metadata": {"name": "p", "namespace": "x", "uid": "u", "labels": {KUEUE_QUEUE_LABEL: "team-b"}}}
    hold = queue_hold(p, config(KUEUE_YAML).namespaces, KEY)
    assert hold is not None and hold.queue == "team-b" and hold.admitted is None
    assert queue_hold(p, {}, KEY) is None  # without --queue-config the alias is off: not the queue's


def test_pods_seen_before_their_job_wait_for_it_and_are_never_queued_as_pods() -> None:
    """The pods' watch may deliver a Job's pods before the Jobs' watch delivers the Job (a JobSet's Job made
    while the JobSet is resumed, say): they are left alone until it comes, not admitted one by one."""
    core = new_core()
    js = jobset()
    core.workload_changed(JOBSET, js)
    apply_patches(core, core.reconcile(T0))  # resumed
    leader, workers = child_job(js, "leader", 1), child_job(js, "workers", 3)
    add_pods(core, job_pod(leader, 0), *(job_pod(workers, i) for i in range(3)))
    early = core.reconcile(T0 + 1)
    assert not early.annotate and not early.release and not core.last_jobs
    core.workload_changed(JOB, leader)
    core.workload_changed(JOB, workers)
    placed = core.reconcile(T0 + 2)
    assert len(placed.release) == 4
    assert {a.annotations[QUEUE_ADMITTED_ANNOTATION] is not None for a in placed.annotate} == {True}
    # where Jobs are not listed at all (no rights), a Job's pods are queued as pods, as before
    bare = QueueCore(config(), mark_key=KEY)
    bare.replace_all([job_pod(leader, 0)], [node("n1")])
    assert bare.reconcile(T0).admitted_jobs == ["ml/js-leader-0-0"]


def test_a_workload_being_deleted_holds_nothing_and_its_pods_gpus_stay_taken_until_they_are_gone() -> None:
    core = new_core(nodes=1)
    j = job("train", parallelism=8, completions=8)
    admit_job(core, j)
    add_pods(core, *(job_pod(j, i) for i in range(8)))
    apply_pod_writes(core, core.reconcile(T0 + 1))
    held = {i: f"ml/train-{i}" for i in range(8)}  # the node publishes its GPUs held by the Job's pods
    core.replace_all(None, [node("n1", held=held)])
    core.reconcile(T0 + 2)
    assert "ml/Job/train" in core.sched.running  # type: ignore[union-attr]
    # deleted (foreground): finished, never suspended or resumed; its pods' GPUs are not given back
    core.workload_objects[JOB]["uid-train"]["metadata"]["deletionTimestamp"] = "2026-01-01T01:00:00Z"  # type: ignore[index]
    core.workload_changed(JOB, job("next", parallelism=1, completions=1))
    out = core.reconcile(T0 + 3)
    assert not [p for p in out.patch if p.target.name == "train"]
    assert "ml/Job/train" not in core.sched.running  # type: ignore[union-attr]
    assert not [p for p in out.patch if p.target.name == "next" and p.suspend is False]  # no GPU is free yet
