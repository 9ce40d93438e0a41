"""Pods -> queued jobs: which pods wait in which queue, gangs, priorities, and the controller's own marks.

A pod belongs to a queue when it carries the label gpunode.io/queue (a leaf of the
queue configuration) or when its namespace is mapped to one (the configuration's `namespaces:`),
and it asks for GPUs (request_from_pod, the extender's reading of a pod). Pods with
the label gpunode.io/gang form one job, admitted all at once, once
gpunode.io/gang-size members exist; any other pod is a job of its own. A job's
priority is the highest spec.priority of its members (absent: its queue's default);
its runtime estimate the annotation gpunode.io/runtime-estimate (30m, 2h).

The controller marks a pod with two annotations (JSON): gpunode.io/queue-admitted
({"job", "uid", "node", "gpus", "at", "gen", "sig"}: where the admission's plan puts this member, signed with the
admission key when the controller has one: gpunode.cluster.queuemark) and
gpunode.io/preemption-notice ({"deadline" (RFC 3339), "preemptor", "reason"}).
It reads the node agent's gpunode.io/gpu-idle-since (RFC 3339) into JobPods.idle_since.
Everything here reads v1 Pod JSON; no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpunode.cluster.extender.pods import request_from_pod
from gpunode.cluster.extender.queued import Admitted, json_mark, parse_time, queue_of, read_admitted
from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.model import Job, Plan, PodPlacement
from gpunode.cluster.queuemark import MarkKey, signed_mark
from gpunode.contract.names import (
    ALLOCATED_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    GANG_LABEL,
    GANG_SIZE_LABEL,
    GIB,
    GPU_IDLE_ANNOTATION,
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    RUNTIME_ANNOTATION,
)
from gpunode.contract.reader import parse_duration
from gpunode.errors import GpunodeError, InvalidRequest

MAX_GANG = 1024  # members; far above any real gang, so a label cannot make the controller wait forever


@dataclass(frozen=True)
class NoticeMark:
    """The preemption notice written on one pod."""

    deadline: float
    preemptor: str
    reason: str


@dataclass(frozen=True)
class QueuedPod:
    """One pod of a queue, as the controller sees it. problem: why it cannot be queued (reported, skipped)."""

    namespace: str
    name: str
    uid: str
    queue: str
    job: str  # "namespace/gang" or "namespace/name"
    gang_size: int
    priority: int | None
    runtime_s: float | None
    node: str
    created: float
    finished: bool  # Succeeded or Failed: holds nothing any more
    deleting: bool
    admitted: Admitted | None
    notice: NoticeMark | None
    assigned: tuple[str, ...]  # GPUs the extender or the node recorded on a bound pod
    request: Any = None  # placement Request (None with a problem)
    problem: str = ""
    idle_since: float | None = None  # gpunode.io/gpu-idle-since (None: absent or unreadable)
    # an admission annotation that is not this pod's own (another UID, unreadable, unsigned or badly signed)
    foreign_mark: bool = False

    @property
    def key(self) -> str:
        """namespace/name."""
        return f"{self.namespace}/{self.name}"


def rfc3339(t: float) -> str:
    """Seconds since the epoch as RFC 3339 UTC."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def admitted_text(job: str, placement: PodPlacement, at: float, uid: str, *, key: MarkKey | None) -> str:
    """The gpunode.io/queue-admitted value for one member (its UID: a pod created with the annotation already
    on it, to skip the queue, cannot know the UID it will get, so its mark is not taken), signed with `key`
    (a tenant who patches its own pod's mark cannot sign it; None: unsigned). A signed mark carries a new
    generation (queuemark: a mark this one replaces is refused once the reader has seen this one)."""
    doc: dict[str, Any] = {
        "job": job,
        "uid": uid,
        "node": placement.node,
        "gpus": list(placement.gpus),
        "at": rfc3339(at),
    }
    if key is not None:
        doc["gen"] = key.next_generation(uid)
    return signed_mark(doc, key)


def notice_text(deadline: float, preemptor: str, reason: str) -> str:
    """The gpunode.io/preemption-notice value."""
    return json.dumps({"deadline": rfc3339(deadline), "preemptor": preemptor, "reason": reason})


def read_notice(text: object) -> NoticeMark | None:
    """The preemption notice annotation, or None."""
    data = json_mark(text)
    if data is None:
        return None
    deadline, preemptor = parse_time(data.get("deadline")), data.get("preemptor")
    if deadline is None or not isinstance(preemptor, str):
        return None
    return NoticeMark(deadline=deadline, preemptor=preemptor, reason=str(data.get("reason") or ""))


def queued_pod(
    pod: Mapping[str, Any],
    config: QueueConfig,
    *,
    memory_unit_bytes: int = GIB,
    mark_key: MarkKey | None = None,
) -> QueuedPod | None:
    """The pod as a member of a queue, or None when it is not queued (no queue, or no GPU asked).
    `mark_key`: the key its admission mark must be signed with (None: any mark naming its UID counts)."""
    queue = queue_of(pod, config.namespaces)
    if queue is None:
        return None
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
    problem = ""
    try:
        request = request_from_pod(pod, memory_unit_bytes=memory_unit_bytes)
    except GpunodeError as exc:
        request, problem = None, str(exc)
    if request is None and not problem:
        return None
    spec_q = config.queues.get(queue)
    if not problem and (spec_q is None or not spec_q.leaf):
        problem = f"queue {queue!r} is not a leaf queue of the queue configuration"
    gang, size = labels.get(GANG_LABEL), 1
    if gang:
        try:
            size = int(str(labels.get(GANG_SIZE_LABEL, "")))
            if not 1 <= size <= MAX_GANG:
                raise ValueError
        except ValueError:
            problem = problem or f"label {GANG_SIZE_LABEL}: expected 1..{MAX_GANG} members for gang {gang!r}"
            size = 1
    runtime = None
    if RUNTIME_ANNOTATION in notes:
        try:
            runtime = parse_duration(
                notes[RUNTIME_ANNOTATION], where=f"annotation {RUNTIME_ANNOTATION}", error=InvalidRequest
            )
        except InvalidRequest as exc:
            problem = problem or str(exc)
    priority = spec.get("priority")
    admitted = read_admitted(
        notes.get(QUEUE_ADMITTED_ANNOTATION),
        str(meta.get("uid") or ""),
        mark_key,
        where=f"{namespace}/{name}",
    )
    assigned = str(notes.get(ALLOCATED_ANNOTATION) or notes.get(ASSIGNMENT_ANNOTATION) or "")
    return QueuedPod(
        namespace=namespace,
        name=name,
        uid=str(meta.get("uid") or ""),
        queue=queue,
        job=f"{namespace}/{gang}" if gang else f"{namespace}/{name}",
        gang_size=size,
        priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else None,
        runtime_s=runtime,
        node=str(spec.get("nodeName") or ""),
        created=parse_time(meta.get("creationTimestamp")) or 0.0,
        finished=status.get("phase") in ("Succeeded", "Failed"),
        deleting=meta.get("deletionTimestamp") is not None,
        admitted=admitted,
        notice=read_notice(notes.get(PREEMPTION_NOTICE_ANNOTATION)) if admitted is not None else None,
        assigned=tuple(g.strip() for g in assigned.split(",") if g.strip()),
        request=request,
        problem=problem,
        idle_since=parse_time(notes.get(GPU_IDLE_ANNOTATION)),
        foreign_mark=admitted is None and bool(notes.get(QUEUE_ADMITTED_ANNOTATION)),
    )


@dataclass(frozen=True)
class JobPods:
    """The live pods of one job (members by name), and what they say about it."""

    name: str
    queue: str
    size: int
    members: tuple[QueuedPod, ...]

    @property
    def complete(self) -> bool:
        """All its members exist."""
        return len(self.members) >= self.size

    @property
    def admitted(self) -> bool:
        """Some member carries the admission or is bound to a node: the job holds GPUs."""
        return any(m.admitted is not None or m.node for m in self.members)

    @property
    def marked(self) -> bool:
        """Every member carries the admission or is bound: none was left out of the job's admission."""
        return all(m.admitted is not None or m.node for m in self.members)

    @property
    def problem(self) -> str:
        """Why it cannot be queued ("" when it can)."""
        for m in self.members:
            if m.problem:
                return f"pod {m.key}: {m.problem}"
        if len(self.members) > self.size:
            return f"gang {self.name} has {len(self.members)} pods, more than its {GANG_SIZE_LABEL} of {self.size}"
        queues = {m.queue for m in self.members}
        if len(queues) > 1:
            return f"gang {self.name}: its members name different queues ({', '.join(sorted(queues))})"
        return ""

    @property
    def notice(self) -> NoticeMark | None:
        """The preemption notice its members carry, if any."""
        return next((m.notice for m in self.members if m.notice is not None), None)

    @property
    def idle_since(self) -> float | None:
        """When the job went idle: every member flagged idle, the latest of their times (else None)."""
        times = [m.idle_since for m in self.members]
        if not times or any(t is None for t in times):
            return None
        return max(t for t in times if t is not None)

    def job(self, config: QueueConfig) -> Job:
        """The queueing Job (members in name order; arrival: the earliest creation)."""
        members = self.members[: self.size]
        prios = [m.priority for m in members if m.priority is not None]
        runtimes = [m.runtime_s for m in members if m.runtime_s is not None]
        return Job(
            name=self.name,
            queue=self.queue,
            pods=tuple(m.request for m in members),
            arrival=min(m.created for m in members),
            priority=max(prios) if prios else config.queues[self.queue].priority,
            runtime_estimate=max(runtimes) if runtimes else None,
        )

    def plan(self) -> Plan:
        """Where the admitted members are: their admission, else their node and recorded GPUs."""
        out = []
        for m in self.members[: self.size]:
            if m.admitted is not None:
                out.append(PodPlacement(node=m.admitted.node, gpus=m.admitted.gpus))
            else:
                out.append(PodPlacement(node=m.node, gpus=m.assigned))
        return Plan(pods=tuple(out))


def group_jobs(pods: Iterable[QueuedPod]) -> dict[str, JobPods]:
    """Live queued pods (not finished, not being deleted) grouped into jobs."""
    members: dict[str, list[QueuedPod]] = {}
    for p in pods:
        if not p.finished and not p.deleting:
            members.setdefault(p.job, []).append(p)
    out = {}
    for name, ms in members.items():
        ms.sort(key=lambda m: m.name)
        out[name] = JobPods(
            name=name, queue=ms[0].queue, size=max(m.gang_size for m in ms), members=tuple(ms)
        )
    return out
