"""Jobs and JobSets -> queued jobs: governed workloads admitted by resuming them. No I/O.

A `batch/v1` Job, or a JobSet (jobset.x-k8s.io/v1alpha2), is governed when it names a queue as a pod
does (the label gpunode.io/queue on it or on its pod template, kueue.x-k8s.io/queue-name with
kueue.queueNameLabel, or its namespace mapped by the configuration's `namespaces:`) and its pods ask
for GPUs. A governed workload is one job of its queue (named `<namespace>/Job/<name>` or
`<namespace>/JobSet/<name>`), waiting while it is suspended (`spec.suspend: true`, set by the webhook
at creation), whose gang is every pod it runs at once:

- a Job: min(parallelism, completions - succeeded) pods (parallelism alone without completions), each
  asking what its pod template asks; its progress is the Job controller's, kept across suspensions,
  so a re-admission plans only what remains;
- a JobSet: for each replicated job, (replicas - its succeeded Jobs) x the pods of one Job as above,
  all admitted as one gang, whole or not at all.

Its priority is its pod template's spec.priority, else the value of its priorityClassName (the
PriorityClasses the controller watches), else its queue's default; its runtime estimate the
annotation gpunode.io/runtime-estimate on the Job or JobSet.

Admission is one merge patch of the workload: the signed admission mark (gpunode.io/queue-admitted:
the plan's slots, each `[group, node, [GPUs]]`, signed with the admission key over the workload's
UID as a pod's mark is, the slots in its `gpus` field) and `spec.suspend: false`, together. Its pods
are then created by the Job controller, gated by the pod webhook; each gated pod of an admitted
workload takes a free slot of its group (a Job's group is "", a JobSet's the replicated job's name,
from its Job's label jobset.sigs.k8s.io/replicatedjob-name) and gets its own signed pod mark on that
slot, then is released there (gates.py). A live pod whose mark names the workload's job holds its slot;
a pod that succeeded or failed frees it for the pod the Job controller makes next. The whole plan is
held by the workload from its admission until it finishes or is suspended: no partial gang holds GPUs.

Preemption suspends: one patch sets `spec.suspend: true` and removes the mark and the notice; the
Job controller deletes the pods with their grace period. A suspended workload waits again once its
pods are gone. A workload found running without a mark (created while the webhook was down, or
resumed by someone else) is suspended again.

Which pods belong to which workload: a pod's controller owner is a Job (by UID); a Job's controller
owner may be a JobSet (by UID). A pod of a Job the controller has not seen yet is left alone (it is
gated, and the extender holds it) until the Job is seen.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.cluster.extender.pods import request_from_pod
from gpunode.cluster.extender.queued import json_mark, parse_time, queue_of, read_admitted
from gpunode.cluster.queuectl.jobs import NoticeMark, read_notice, rfc3339
from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.model import Job, Plan, PodPlacement
from gpunode.cluster.queuemark import MarkKey, signed_mark
from gpunode.contract.names import (
    GIB,
    JOBSET_API_VERSION,
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_LABEL,
    QUEUE_REASON_ANNOTATION,
    REPLICATED_JOB_LABEL,
    RUNTIME_ANNOTATION,
)
from gpunode.contract.reader import parse_duration
from gpunode.errors import GpunodeError, InvalidRequest

JOB, JOBSET = "Job", "JobSet"
API_VERSIONS = {JOB: "batch/v1", JOBSET: JOBSET_API_VERSION}
MAX_WORKLOAD_PODS = 1024  # as a gang's MAX_GANG: a workload asking more is refused, not waited on


@dataclass(frozen=True)
class Slot:
    """One pod's place in a workload's plan: its group (a JobSet's replicated job; "" for a Job)."""

    group: str
    node: str
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class WorkloadMark:
    """The admission written on a workload: its job, when, and every pod's slot."""

    job: str
    at: float
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class Group:
    """Pods of one kind in a workload: how many run at once now, and what each asks."""

    name: str
    count: int
    request: Any  # placement Request


@dataclass(frozen=True)
class Workload:
    """A governed Job or JobSet, as the controller sees it (see the module docstring)."""

    kind: str
    namespace: str
    name: str
    uid: str
    queue: str
    groups: tuple[Group, ...]
    priority: int | None
    runtime_s: float | None
    created: float
    suspended: bool
    finished: bool
    mark: WorkloadMark | None
    notice: NoticeMark | None
    reason: str  # its gpunode.io/queue-reason as it stands
    problem: str = ""
    foreign_mark: bool = False  # an admission annotation that is not the controller's for it

    @property
    def job_name(self) -> str:
        """The queue job's name: namespace/Kind/name."""
        return f"{self.namespace}/{self.kind}/{self.name}"

    @property
    def key(self) -> str:
        """namespace/name."""
        return f"{self.namespace}/{self.name}"

    @property
    def size(self) -> int:
        """Pods in its gang now."""
        return sum(g.count for g in self.groups)

    def job(self, config: QueueConfig) -> Job:
        """The queueing Job: one pod per slot, groups in order."""
        return Job(
            name=self.job_name,
            queue=self.queue,
            pods=tuple(g.request for g in self.groups for _ in range(g.count)),
            arrival=self.created,
            priority=self.priority if self.priority is not None else config.queues[self.queue].priority,
            runtime_estimate=self.runtime_s,
        )

    def slots_for(self, plan: Plan) -> tuple[Slot, ...]:
        """The plan's placements as slots (in the order of job())."""
        groups = [g.name for g in self.groups for _ in range(g.count)]
        return tuple(Slot(g, p.node, tuple(p.gpus)) for g, p in zip(groups, plan.pods, strict=True))


def plan_of(mark: WorkloadMark) -> Plan:
    """The plan a workload's mark records."""
    return Plan(pods=tuple(PodPlacement(node=s.node, gpus=s.gpus) for s in mark.slots))


def workload_mark_text(job: str, slots: Iterable[Slot], at: float, uid: str, *, key: MarkKey | None) -> str:
    """The gpunode.io/queue-admitted value of a workload: signed as a pod's mark is (queuemark), its slots
    carried in the signed `gpus` field (each the JSON of [group, node, [GPUs]]), `node` empty."""
    doc: dict[str, Any] = {
        "job": job,
        "uid": uid,
        "node": "",
        "gpus": [json.dumps([s.group, s.node, list(s.gpus)]) for s in slots],
        "at": rfc3339(at),
    }
    if key is not None:
        doc["gen"] = key.next_generation(uid)
    return signed_mark(doc, key)


def read_workload_mark(text: object, uid: str, key: MarkKey | None, *, where: str) -> WorkloadMark | None:
    """A workload's admission mark, or None when absent or not the controller's for this UID."""
    admitted = read_admitted(text, uid, key, where=where)
    if admitted is None or admitted.node:
        return None
    slots = []
    for entry in admitted.gpus:
        try:
            group, node, gpus = json.loads(entry)
        except (ValueError, TypeError):
            return None
        if not isinstance(group, str) or not isinstance(node, str) or not isinstance(gpus, list):
            return None
        if not all(isinstance(g, str) for g in gpus):
            return None
        slots.append(Slot(group, node, tuple(gpus)))
    return WorkloadMark(job=admitted.job, at=admitted.at, slots=tuple(slots))


def controller_owner(obj: Mapping[str, Any], kind: str) -> str | None:
    """The UID of the object's controller owner of `kind`, or None."""
    meta = obj.get("metadata") or {}
    for ref in (meta.get("ownerReferences") or ()) if isinstance(meta, Mapping) else ():
        if isinstance(ref, Mapping) and ref.get("controller") and ref.get("kind") == kind:
            uid = ref.get("uid")
            return uid if isinstance(uid, str) and uid else None
    return None


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _conditions(obj: Mapping[str, Any]) -> set[str]:
    status = obj.get("status") or {}
    conds = status.get("conditions") if isinstance(status, Mapping) else None
    return {
        str(c.get("type")) for c in conds or () if isinstance(c, Mapping) and str(c.get("status")) == "True"
    }


def job_pods_now(spec: Mapping[str, Any], succeeded: int) -> int:
    """Pods a Job runs at once from here: min(parallelism, completions - succeeded); parallelism alone
    without completions (a work queue: none more once one succeeded)."""
    parallelism = max(0, _int(spec.get("parallelism"), 1))
    completions = spec.get("completions")
    if isinstance(completions, int) and not isinstance(completions, bool):
        return max(0, min(parallelism, completions - succeeded))
    return parallelism if succeeded == 0 else 0


def _template_pod(template: object, namespace: str) -> dict[str, Any]:
    t: Mapping[str, Any] = template if isinstance(template, Mapping) else {}
    meta = t.get("metadata")
    return {
        "metadata": {**(meta if isinstance(meta, Mapping) else {}), "namespace": namespace},
        "spec": t.get("spec") or {},
    }


def _priority(pod: Mapping[str, Any], priorities: Mapping[str, int]) -> int | None:
    spec = pod.get("spec") or {}
    value = spec.get("priority")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    name = spec.get("priorityClassName")
    return priorities.get(name) if isinstance(name, str) else None


def _read_group(
    name: str, template: object, namespace: str, count: int, memory_unit_bytes: int
) -> tuple[Group | None, dict[str, Any], str]:
    pod = _template_pod(template, namespace)
    try:
        request = request_from_pod(pod, memory_unit_bytes=memory_unit_bytes)
    except GpunodeError as exc:
        return None, pod, f"its pod template{f' ({name})' if name else ''}: {exc}"
    if request is None:
        return None, pod, ""
    return Group(name, count, request), pod, ""


def workload_of(
    obj: Mapping[str, Any],
    kind: str,
    config: QueueConfig,
    priorities: Mapping[str, int],
    *,
    jobs_succeeded: Mapping[str, int] | None = None,
    memory_unit_bytes: int = GIB,
    mark_key: MarkKey | None = None,
) -> Workload | None:
    """The Job or JobSet (JSON) as a governed workload, or None when it is not one (no queue named, no GPU
    asked). `jobs_succeeded` (JobSets): replicated job name -> its Jobs that succeeded."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return None
    namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
    status = obj.get("status") or {}
    status = status if isinstance(status, Mapping) else {}
    if kind == JOB:
        parts = [("", spec.get("template"), job_pods_now(spec, _int(status.get("succeeded"), 0)))]
    else:
        done = jobs_succeeded or {}
        parts = []
        for rj in spec.get("replicatedJobs") or ():
            if not isinstance(rj, Mapping):
                continue
            jt = rj.get("template")
            job_template: Mapping[str, Any] = jt if isinstance(jt, Mapping) else {}
            js = job_template.get("spec")
            job_spec: Mapping[str, Any] = js if isinstance(js, Mapping) else {}
            rj_name = str(rj.get("name") or "")
            replicas = max(0, _int(rj.get("replicas"), 1) - done.get(rj_name, 0))
            parts.append((rj_name, job_spec.get("template"), replicas * job_pods_now(job_spec, 0)))
    queue = queue_of(obj, config.namespaces)
    problem = ""
    groups: list[Group] = []
    prios: list[int] = []
    for group_name, template, count in parts:
        group, pod, why = _read_group(group_name, template, namespace, count, memory_unit_bytes)
        queue = queue or queue_of(pod, config.namespaces)
        problem = problem or why
        if group is not None:  # kept with count 0: an admitted workload's slots still name its request
            groups.append(group)
        if (p := _priority(pod, priorities)) is not None:
            prios.append(p)
    if queue is None or (not groups and not problem):
        return None
    spec_q = config.queues.get(queue)
    if not problem and (spec_q is None or not spec_q.leaf):
        problem = f"queue {queue!r} is not a leaf queue of the queue configuration"
    if not problem and sum(g.count for g in groups) > MAX_WORKLOAD_PODS:
        problem = f"it runs {sum(g.count for g in groups)} pods at once, more than {MAX_WORKLOAD_PODS}"
    notes = meta.get("annotations") or {}
    notes = notes if isinstance(notes, Mapping) else {}
    runtime = None
    if RUNTIME_ANNOTATION in notes:
        try:
            runtime = parse_duration(
                notes[RUNTIME_ANNOTATION], where=f"annotation {RUNTIME_ANNOTATION}", error=InvalidRequest
            )
        except InvalidRequest as exc:
            problem = problem or str(exc)
    uid = str(meta.get("uid") or "")
    mark = read_workload_mark(
        notes.get(QUEUE_ADMITTED_ANNOTATION), uid, mark_key, where=f"{kind} {namespace}/{name}"
    )
    conds = _conditions(obj)
    finished = bool(conds & ({"Complete", "Failed"} if kind == JOB else {"Completed", "Failed"}))
    if kind == JOB and not finished and status.get("completionTime"):
        finished = True
    finished = finished or meta.get("deletionTimestamp") is not None  # being deleted: never resumed again
    return Workload(
        kind=kind,
        namespace=namespace,
        name=name,
        uid=uid,
        queue=queue,
        groups=tuple(groups),
        priority=max(prios) if prios else None,
        runtime_s=runtime,
        created=parse_time(meta.get("creationTimestamp")) or 0.0,
        suspended=spec.get("suspend") is True,
        finished=finished,
        mark=mark,
        notice=read_notice(notes.get(PREEMPTION_NOTICE_ANNOTATION)) if mark is not None else None,
        reason=str(notes.get(QUEUE_REASON_ANNOTATION) or ""),
        problem=problem,
        foreign_mark=mark is None and json_mark(notes.get(QUEUE_ADMITTED_ANNOTATION)) is not None,
    )


@dataclass(frozen=True)
class Owned:
    """Which workload a Job's pods belong to, and their group in it."""

    workload: str  # the workload's job name
    group: str


def workloads(
    jobs: Iterable[Mapping[str, Any]],
    jobsets: Iterable[Mapping[str, Any]],
    config: QueueConfig,
    priorities: Mapping[str, int],
    *,
    memory_unit_bytes: int = GIB,
    mark_key: MarkKey | None = None,
) -> tuple[dict[str, Workload], dict[str, Owned | None]]:
    """The governed workloads by job name, and every known Job's UID -> the workload its pods belong to
    (None: a Job that is not governed, whose pods are queued as pods are, if at all)."""
    jobs = list(jobs)
    succeeded: dict[str, dict[str, int]] = {}  # JobSet UID -> replicated job -> Jobs succeeded
    for j in jobs:
        if (owner := controller_owner(j, JOBSET)) is not None and JOB_COMPLETE in _conditions(j):
            rj = str(((j.get("metadata") or {}).get("labels") or {}).get(REPLICATED_JOB_LABEL) or "")
            by_rj = succeeded.setdefault(owner, {})
            by_rj[rj] = by_rj.get(rj, 0) + 1
    out: dict[str, Workload] = {}
    by_uid: dict[str, Workload] = {}
    for obj in jobsets:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        w = workload_of(
            obj,
            JOBSET,
            config,
            priorities,
            jobs_succeeded=succeeded.get(uid, {}),
            memory_unit_bytes=memory_unit_bytes,
            mark_key=mark_key,
        )
        if w is not None:
            out[w.job_name] = by_uid[w.uid] = w
    owners: dict[str, Owned | None] = {}
    for j in jobs:
        meta = j.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if (owner := controller_owner(j, JOBSET)) is not None:
            parent = by_uid.get(owner)
            rj = str((meta.get("labels") or {}).get(REPLICATED_JOB_LABEL) or "")
            owners[uid] = Owned(parent.job_name, rj) if parent is not None else None
            continue
        w = workload_of(j, JOB, config, priorities, memory_unit_bytes=memory_unit_bytes, mark_key=mark_key)
        if w is not None:
            out[w.job_name] = w
        owners[uid] = Owned(w.job_name, "") if w is not None else None
    return out, owners


JOB_COMPLETE = "Complete"


def template_label_patch(obj: Mapping[str, Any], kind: str, queue: str) -> list[dict[str, Any]]:
    """JSON patch operations (RFC 6902) that put gpunode.io/queue: `queue` on every pod template of a Job or
    JobSet being created that names no queue of its own, so its pods are governed (and gated) as pods."""
    spec = obj.get("spec") or {}
    paths: list[tuple[str, Any]] = []
    if kind == JOB:
        paths.append(("/spec/template", spec.get("template")))
    else:
        for i, rj in enumerate(spec.get("replicatedJobs") or ()):
            t = rj.get("template") if isinstance(rj, Mapping) else None
            js = t.get("spec") if isinstance(t, Mapping) else None
            paths.append((f"/spec/replicatedJobs/{i}/template/spec/template", (js or {}).get("template")))
    ops: list[dict[str, Any]] = []
    label = QUEUE_LABEL.replace("~", "~0").replace("/", "~1")
    for path, template in paths:
        if not isinstance(template, Mapping):
            continue
        meta = template.get("metadata")
        labels = meta.get("labels") if isinstance(meta, Mapping) else None
        if isinstance(labels, Mapping) and labels.get(QUEUE_LABEL):
            continue
        if not isinstance(meta, Mapping):
            ops.append({"op": "add", "path": f"{path}/metadata", "value": {"labels": {QUEUE_LABEL: queue}}})
        elif not isinstance(labels, Mapping):
            ops.append({"op": "add", "path": f"{path}/metadata/labels", "value": {QUEUE_LABEL: queue}})
        else:
            ops.append({"op": "add", "path": f"{path}/metadata/labels/{label}", "value": queue})
    return ops


def pod_group(pod: Mapping[str, Any], owners: Mapping[str, Owned | None]) -> Owned | bool | None:
    """The workload a pod belongs to; None when its Job is not governed or it has no Job; False when its Job
    has not been seen yet (the pod is left alone meanwhile)."""
    job_uid = controller_owner(pod, JOB)
    if job_uid is None:
        return None
    if job_uid not in owners:
        return False
    return owners[job_uid]
