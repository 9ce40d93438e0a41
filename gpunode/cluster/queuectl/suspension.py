"""Governed Jobs and JobSets in the reconcile: admitted by resuming, preempted by suspending. No I/O.

WorkloadQueue (mixed into QueueCore) turns the workloads of workloads.py into the scheduler's running and
waiting jobs, and says what to write for them:

- waiting (suspended, no mark, none of its pods left): submitted as one job; its reason as its
  gpunode.io/queue-reason and a `Queued` Event, as a waiting pod's;
- admitted: one patch writes the signed mark and `spec.suspend: false` together (written below, kept
  as running until the watch shows it); then each of its pods the Job controller makes takes a free
  slot of the plan: the pod's own signed mark, then its release from the gate on the slot's node. A new
  leader does the same from the workload's mark, so a controller killed between resuming a workload
  and releasing its pods is finished by the next; a mark whose plan no longer fits the cluster is undone
  (the workload suspended again, its mark removed);
- a victim: the notice (annotation and Event) on the workload and its pods; when it runs out, the
  workload is suspended (mark and notice removed in the same patch) and waits again once the Job
  controller has deleted its pods with their grace period;
- running without a mark (created while the webhook was down, or resumed by someone other than the
  controller): suspended, with one Warning Event;
- marked but suspended (its owner suspended it): the mark is removed and it waits again;
- one that cannot be queued (unknown queue, a template that asks for something no node has, more GPUs
  than the cluster has): one Warning Event `QueueRefused`, its gpunode.io/queue-reason, and on a Job the
  status condition QueueRefused; it is suspended when it runs unadmitted.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpunode.cluster.extender.queued import read_admitted
from gpunode.cluster.queuectl.gates import gated, release_spec
from gpunode.cluster.queuectl.jobs import NoticeMark, admitted_text, notice_text, rfc3339
from gpunode.cluster.queuectl.sched import Running
from gpunode.cluster.queuectl.workloads import (
    API_VERSIONS,
    JOB,
    Slot,
    Workload,
    plan_of,
    workload_mark_text,
)
from gpunode.cluster.queuectl.writes import Actions, Annotate, Patch, PodRef, Release, WorkloadRef
from gpunode.cluster.queueing.model import Job, PodPlacement
from gpunode.contract.names import (
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_REASON_ANNOTATION,
)

if TYPE_CHECKING:
    from gpunode.cluster.queuectl.nodes import ClusterView
    from gpunode.cluster.queueing.config import QueueConfig
    from gpunode.cluster.queueing.engine import Scheduler
    from gpunode.cluster.queueing.model import Decisions
    from gpunode.cluster.queuemark import MarkKey

log = logging.getLogger(__name__)

REFUSED = "QueueRefused"


def target(w: Workload) -> WorkloadRef:
    """The object to patch for a workload."""
    return WorkloadRef(w.kind, API_VERSIONS[w.kind], w.namespace, w.name, w.uid)


def _pod_ref(pod: Mapping[str, Any]) -> PodRef:
    meta = pod.get("metadata") or {}
    return PodRef(
        str(meta.get("namespace") or "default"), str(meta.get("name") or ""), str(meta.get("uid") or "")
    )


def _done(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def running_job(w: Workload, config: QueueConfig) -> Job:
    """The queueing Job of an admitted workload: one pod per slot of its mark (what it was admitted with)."""
    assert w.mark is not None
    fresh = w.job(config)
    requests = {g.name: g.request for g in w.groups}
    fallback = fresh.pods[0] if fresh.pods else None
    pods = tuple(r for s in w.mark.slots if (r := requests.get(s.group, fallback)) is not None)
    return Job(
        name=fresh.name,
        queue=fresh.queue,
        pods=pods,
        arrival=fresh.arrival,
        priority=fresh.priority,
        runtime_estimate=fresh.runtime_estimate,
    )


class WorkloadQueue:
    """The Jobs and JobSets of QueueCore (see the module docstring)."""

    if TYPE_CHECKING:
        config: QueueConfig
        mark_key: MarkKey | None
        sched: Scheduler | None
        written: dict[str, Running]
        noticed: dict[str, NoticeMark]
        released: set[str]
        waiting_since: dict[str, float]
        _reported: dict[str, str]
        _suspend_sent: set[str]
        _lost: set[str]
        view: ClusterView | None
        _view_size: tuple[ClusterView | None, int, int]
        _pod_slots: dict[str, tuple[str, Slot]]
        last_workloads: dict[str, Workload]

    def _workload_step(
        self,
        wls: Mapping[str, Workload],
        wpods: Mapping[str, Sequence[tuple[Mapping[str, Any], str]]],
        now: float,
        out: Actions,
    ) -> tuple[dict[str, Running], dict[str, Job], set[str]]:
        """The workloads' running and waiting jobs, and those stopping now (their suspension sent)."""
        running: dict[str, Running] = {}
        waiting: dict[str, Job] = {}
        stopping: set[str] = set()
        wls = {n: replace(w, problem=w.problem or self._too_big(w)) for n, w in wls.items()}
        for name in sorted(wls):
            w = wls[name]
            pods = wpods.get(name, ())
            live = [(p, g) for p, g in pods if not _done(p)]
            marked = w.mark is not None and w.mark.job == name
            if w.problem:
                # once per problem: the reason on the object says it was reported (by a previous leader too)
                if self._reported.get(name) != w.problem and w.reason != w.problem:
                    out.patch.append(
                        Patch(
                            target(w),
                            {QUEUE_REASON_ANNOTATION: w.problem},
                            event=(REFUSED, w.problem),
                            warning=True,
                            condition=(REFUSED, w.problem) if w.kind == JOB else None,
                        )
                    )
                self._reported[name] = w.problem
                if not w.suspended and not marked and not w.finished:
                    self._suspend(w, f"it cannot be queued: {w.problem}", out, event=False, reason=w.problem)
                continue
            self._reported.pop(name, None)
            if w.finished:
                continue
            if not marked and name in self.written:  # admitted here, not seen through the watch yet
                if w.suspended:
                    running[name] = self.written[name]
                    continue
                self.written.pop(name, None)  # resumed and seen, its mark not yet: the mark comes with it
            if marked and not w.suspended:
                self.written.pop(name, None)
                self._suspend_sent.discard(name)
                notice = w.notice or self.noticed.get(name)
                if w.notice is not None:
                    self.noticed.pop(name, None)
                if notice is not None and notice.deadline <= now:
                    stopping.add(name)
                    self._suspend(
                        w,
                        f"preempted ({notice.reason}) for {notice.preemptor}: its notice ran out",
                        out,
                        event=True,
                    )
                    continue
                assert w.mark is not None
                running[name] = Running(
                    job=running_job(w, self.config), plan=plan_of(w.mark), start=w.mark.at, notice=notice
                )
                self._place_pods(w, live, out)
                continue
            if marked:  # suspended by its owner while admitted: it waits again, once its mark is gone
                if name not in self._suspend_sent:
                    self._suspend_sent.add(name)
                    out.patch.append(
                        Patch(
                            target(w),
                            {QUEUE_ADMITTED_ANNOTATION: None, PREEMPTION_NOTICE_ANNOTATION: None},
                            event=("QueueAdmissionWithdrawn", f"{w.key} was suspended: it waits again"),
                            job=name,
                        )
                    )
                continue
            if not w.suspended:  # running without the controller's admission
                self._suspend(w, "it was resumed without an admission by its queue", out, event=True)
                continue
            self._suspend_sent.discard(name)
            if live or w.size == 0:  # its pods are still going away, or nothing is left to run
                continue
            waiting[name] = w.job(self.config)
            self.waiting_since.setdefault(name, now)
        self.last_workloads = dict(wls)
        live_uids = {str((p.get("metadata") or {}).get("uid") or "") for ps in wpods.values() for p, _ in ps}
        self._pod_slots = {u: v for u, v in self._pod_slots.items() if u in live_uids}
        self._suspend_sent &= set(wls)
        return running, waiting, stopping

    def _too_big(self, w: Workload) -> str:
        """Why the workload can never run on the cluster as published ("" when it can, or no node is known):
        a pod asking more whole GPUs than the largest node has, or more GPUs at once than the cluster has."""
        view = self.view
        if view is None or not view.nodes or w.mark is not None:
            return ""
        if self._view_size[0] is not view:  # figured once per view, not per workload
            self._view_size = (
                view,
                max(len(n.gpus) for n in view.nodes),
                sum(len(n.gpus) for n in view.nodes),
            )
        _, largest, total = self._view_size
        for g in w.groups:
            if g.count and g.request.gpus > largest:
                return f"a pod asks for {g.request.gpus} GPUs, the largest node has {largest}"
        asked = sum(g.count * g.request.gpus for g in w.groups)
        if asked > total:
            return f"it asks for {asked} GPUs at once, the cluster has {total}"
        return ""

    def _suspend(self, w: Workload, why: str, out: Actions, *, event: bool, reason: str = "") -> None:
        """Suspend the workload, its mark and notice removed in the same patch (sent once until seen);
        `reason`: its gpunode.io/queue-reason (default: why, and that it waits again)."""
        name = w.job_name
        if name in self._suspend_sent:
            return
        self._suspend_sent.add(name)
        reason = reason or f"suspended: {why}; it waits in {w.queue} again"
        out.patch.append(
            Patch(
                target(w),
                {
                    QUEUE_ADMITTED_ANNOTATION: None,
                    PREEMPTION_NOTICE_ANNOTATION: None,
                    QUEUE_REASON_ANNOTATION: reason,
                },
                suspend=True,
                event=("QueueSuspended", reason) if event else None,
                warning=True,
                job=name,
            )
        )
        log.info("%s %s", w.key, reason)

    def _place_pods(self, w: Workload, live: Sequence[tuple[Mapping[str, Any], str]], out: Actions) -> None:
        """Give each live pod of an admitted workload its slot: the pods marked on a slot keep it (and are
        released when still gated); the others take a free slot of their group, in name order."""
        assert w.mark is not None
        name = w.job_name
        free = Counter(w.mark.slots)
        todo: list[tuple[Mapping[str, Any], str]] = []
        for pod, group in sorted(live, key=lambda pg: str((pg[0].get("metadata") or {}).get("name"))):
            meta = pod.get("metadata") or {}
            uid = str(meta.get("uid") or "")
            admitted = read_admitted(
                (meta.get("annotations") or {}).get(QUEUE_ADMITTED_ANNOTATION),
                uid,
                self.mark_key,
                where=f"{meta.get('namespace')}/{meta.get('name')}",
            )
            slot: Slot | None = None
            if admitted is not None and admitted.job == name:
                slot = Slot(group, admitted.node, admitted.gpus)
            elif (sent := self._pod_slots.get(uid)) is not None and sent[0] == name:
                slot = sent[1]  # marked here, not seen through the watch yet
            if slot is not None and free[slot] > 0:
                free[slot] -= 1
                if admitted is not None:
                    self._pod_slots.pop(uid, None)
                    self._release_pod(pod, slot.node, name, out)
                continue
            if (pod.get("spec") or {}).get("nodeName"):
                continue  # bound without a mark of this admission: not ours to place
            todo.append((pod, group))
        for pod, group in todo:
            slot = next((s for s, n in free.items() if n > 0 and s.group == group), None)
            if slot is None:
                continue  # more pods than the plan has slots for: they stay gated
            free[slot] -= 1
            ref = _pod_ref(pod)
            placement = PodPlacement(node=slot.node, gpus=slot.gpus)
            text = admitted_text(name, placement, w.mark.at, ref.uid, key=self.mark_key)
            gpus = ",".join(slot.gpus) or "no GPU"
            out.annotate.append(
                Annotate(
                    ref,
                    {QUEUE_ADMITTED_ANNOTATION: text, QUEUE_REASON_ANNOTATION: None},
                    ("QueueAdmitted", f"admitted in {w.queue} with {w.key}: node {slot.node}, GPUs {gpus}"),
                    job=name,
                )
            )
            self._pod_slots[ref.uid] = (name, slot)
            self._release_pod(pod, slot.node, name, out)

    def _release_pod(self, pod: Mapping[str, Any], node: str, job: str, out: Actions) -> None:
        ref = _pod_ref(pod)
        if not gated(pod) or ref.uid in self.released:
            return
        self.released.add(ref.uid)
        out.release.append(Release(ref, node, release_spec(pod, node), job=job))

    def _undo_lost(
        self,
        running: Mapping[str, Running],
        wpods: Mapping[str, Sequence[tuple[Mapping[str, Any], str]]],
        out: Actions,
    ) -> None:
        """An admitted workload whose plan the scheduler could not take back (its nodes or GPUs gone), none
        of whose pods is bound yet (a leader stopped between resuming it and releasing its pods, say): it
        is suspended, its mark removed, and waits again whole. One with pods bound keeps running, as pods
        do."""
        for name in sorted(set(running) & self._lost):
            w = self.last_workloads.get(name)
            if w is None or w.mark is None:
                continue
            if any((p.get("spec") or {}).get("nodeName") for p, _ in wpods.get(name, ()) if not _done(p)):
                continue
            self._suspend(w, "its admission's plan no longer fits the cluster", out, event=True)

    def _forget_pod_slots(self, job: str) -> None:
        """A write of `job` failed: its pods' slots are read again from what the pods say."""
        self._pod_slots = {u: v for u, v in self._pod_slots.items() if v[0] != job}
        self._suspend_sent.discard(job)

    # ----- the scheduler's decisions about workloads ---------------------------------------------------

    def _admit_workload(self, w: Workload, job: Job, plan: Any, now: float, out: Actions) -> None:
        slots = w.slots_for(plan)
        text = workload_mark_text(w.job_name, slots, now, w.uid, key=self.mark_key)
        nodes = sorted({s.node for s in slots})
        out.patch.append(
            Patch(
                target(w),
                {
                    QUEUE_ADMITTED_ANNOTATION: text,
                    QUEUE_REASON_ANNOTATION: None,
                    PREEMPTION_NOTICE_ANNOTATION: None,
                },
                suspend=False,
                event=(
                    "QueueAdmitted",
                    f"admitted in {w.queue}: {len(slots)} pod(s) on node(s) {', '.join(nodes)}; resumed",
                ),
                job=w.job_name,
            )
        )
        out.admitted_jobs.append(w.job_name)
        self.written[w.job_name] = Running(job=job, plan=plan, start=now, notice=None)

    def _notice_workload(
        self, w: Workload, pods: Sequence[tuple[Mapping[str, Any], str]], n: Any, out: Actions
    ) -> None:
        text = notice_text(n.deadline, n.preemptor, n.reason)
        message = (
            f"preempted ({n.reason}) to make room for {n.preemptor}: stop or checkpoint by "
            f"{rfc3339(n.deadline)}; suspended then, it waits again and resumes with its progress"
        )
        out.patch.append(
            Patch(target(w), {PREEMPTION_NOTICE_ANNOTATION: text}, event=("Preempting", message), warning=True,
                  job=w.job_name)
        )  # fmt: skip
        out.annotate.extend(  # the pods see it too (a downward API volume), without an Event each
            Annotate(_pod_ref(p), {PREEMPTION_NOTICE_ANNOTATION: text}) for p, _ in pods if not _done(p)
        )
        out.preempted_jobs.append((w.job_name, n.reason))
        self.noticed[w.job_name] = NoticeMark(deadline=n.deadline, preemptor=n.preemptor, reason=n.reason)

    def _lift_workload_notice(
        self, w: Workload, pods: Sequence[tuple[Mapping[str, Any], str]], preemptor: str, out: Actions
    ) -> None:
        out.patch.append(
            Patch(
                target(w),
                {PREEMPTION_NOTICE_ANNOTATION: None},
                event=("PreemptionLifted", f"{preemptor} no longer waits: the notice is lifted"),
                job=w.job_name,
            )
        )
        out.annotate.extend(
            Annotate(_pod_ref(p), {PREEMPTION_NOTICE_ANNOTATION: None}) for p, _ in pods if not _done(p)
        )

    def _workload_decisions(
        self,
        d: Decisions,
        wpods: Mapping[str, Sequence[tuple[Mapping[str, Any], str]]],
        out: Actions,
    ) -> None:
        """Kills (suspend) and waiting reasons of the workloads among the scheduler's decisions."""
        for name in d.kill:
            w = self.last_workloads.get(name)
            if w is not None:
                self._suspend(w, "requeued by its queue", out, event=True)
        for wt in [*d.waiting, *d.timed_out]:
            w = self.last_workloads.get(wt.job)
            if w is not None and w.reason != wt.reason:
                out.patch.append(
                    Patch(target(w), {QUEUE_REASON_ANNOTATION: wt.reason}, event=("Queued", wt.reason))
                )
