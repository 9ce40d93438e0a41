"""Gangs admitted part-way: which repair a gang gets, and the plan that completes one. No I/O.

A gang is admitted part-way when some members carry the admission mark (or are bound
to a node) and others neither: an admission write that failed part-way, a leader that
stopped or lost the lead part-way, a member deleted and created again by its owner, or
marks written or removed by someone else. A partial gang never holds GPUs, so the
controller repairs every such gang, with one of two outcomes:

- completed: a member is already bound (its work has started: keep it), every member
  exists, the marks are one admission of this gang (each is the pod's own, names this
  job and the same moment `at`; each bound member is on the node its mark names), and
  the marked members' places still fit with the unmarked members placed beside them
  (placed now, off the nodes promised to preemptors). The unmarked members are marked
  on that plan with the same `at`, and the gang runs whole from then (adopted by the
  scheduler on the whole plan; its queue's quota is not checked again: it was admitted);
- undone: anything else. The marks of the unbound members are removed, the bound
  members are evicted, and the gang waits again whole, as one job.

A gang none of whose members is bound is always undone: nothing has started, and the
scheduler plans it again whole under the current quotas and order.

GangRepair (mixed into QueueCore) decides once per gang, logs one line and reports the
outcome in Actions.repairs (the metric), and keeps to an undo while the gang stays
partial: the marks of unbound members are removed once, the bound members evicted at
every reconcile until they are gone (a PodDisruptionBudget may refuse), as a stopping
job's are. Their GPUs are not counted meanwhile (as a stopping job's): a job admitted
onto them waits in the extender until they are free. A new leader, or a failed write of
the repair, decides again from what the pods say then.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from gpunode.cluster.queuectl.jobs import JobPods, NoticeMark, QueuedPod, admitted_text
from gpunode.cluster.queuectl.sched import Running
from gpunode.cluster.queuectl.writes import Actions, Annotate, ref
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import Job, Plan, PodPlacement
from gpunode.contract.names import QUEUE_ADMITTED_ANNOTATION, QUEUE_REASON_ANNOTATION
from gpunode.errors import GpunodeError

if TYPE_CHECKING:
    from gpunode.cluster.queueing.config import QueueConfig
    from gpunode.cluster.queuemark import MarkKey

log = logging.getLogger(__name__)

COMPLETED = "completed"
UNDONE = "undone"


def partly_marked(j: JobPods) -> bool:
    """Some member carries the admission or is bound, and some member neither."""
    return j.admitted and not j.marked


def distrust(j: JobPods) -> str:
    """Why a partly marked gang cannot be completed whatever the capacity ("" when its marks allow it)."""
    if j.problem:
        return j.problem
    for m in j.members:
        if m.foreign_mark:
            return f"pod {m.key} carries an admission mark that is not its own"
    for m in j.members:
        if m.admitted is not None and m.admitted.job != j.name:
            return f"the mark of pod {m.key} names job {m.admitted.job!r}"
    moments = {m.admitted.at for m in j.members if m.admitted is not None}
    if len(moments) > 1:
        return f"its marks record {len(moments)} different admissions"
    for m in j.members:
        if m.node and m.admitted is None:
            return f"pod {m.key} is bound to node {m.node} without an admission mark"
        if m.node and m.admitted is not None and m.admitted.node != m.node:
            return f"pod {m.key} is bound to node {m.node}, its mark names node {m.admitted.node}"
    if not j.complete:
        return f"{len(j.members)} of its {j.size} members exist"
    if not any(m.node for m in j.members):
        return "none of its members is bound yet"
    return ""


def complete_plan(sched: Scheduler, j: JobPods, job: Job) -> Plan | str:
    """The whole gang's plan: the marked members where their marks put them, the others placed now beside
    them; or why there is none. Nothing stays held on the scheduler's capacity."""
    members = j.members[: j.size]
    placed: dict[int, PodPlacement] = {}
    for k, m in enumerate(members):
        if m.admitted is not None:
            placed[k] = PodPlacement(node=m.admitted.node, gpus=m.admitted.gpus)
    fixed, free = sorted(placed), [k for k in range(len(members)) if k not in placed]
    cap = sched.cap
    if cap.in_trial:
        return "the scheduler's capacity is in use"
    with cap.trial():
        try:
            cap.commit(
                f"{job.name} (marked part)",
                replace(job, pods=tuple(job.pods[k] for k in fixed)),
                Plan(pods=tuple(placed[k] for k in fixed)),
            )
        except (GpunodeError, ValueError) as exc:
            return f"the marked members' places no longer fit: {exc}"
        rest = cap.plan(
            replace(job, pods=tuple(job.pods[k] for k in free)), exclude_nodes=sched.excluded_for_preemptors
        )
    if rest is None:
        return f"its {len(free)} unmarked member(s) do not fit beside the marked ones"
    placed.update(zip(free, rest.pods, strict=True))
    return Plan(pods=tuple(placed[k] for k in range(len(members))))


def _marked(m: QueuedPod) -> bool:
    return m.admitted is not None or m.foreign_mark


def _state(j: JobPods) -> str:
    marked = sum(1 for m in j.members if m.admitted is not None)
    bound = sum(1 for m in j.members if m.node)
    return f"{marked} of {j.size} members marked, {bound} bound, {len(j.members)} present"


class GangRepair:
    """The repairs of gangs admitted part-way, for QueueCore (see the module docstring)."""

    if TYPE_CHECKING:
        config: QueueConfig
        mark_key: MarkKey | None
        sched: Scheduler | None
        written: dict[str, Running]
        noticed: dict[str, NoticeMark]
        _undoing: dict[str, set[str]]

    def _repair(self, partial: dict[str, JobPods], now: float, out: Actions) -> None:
        """Complete or undo each gang admitted part-way: decided once, then kept to while it stays partial
        (marks that appear later on unbound members are removed too; bound members are evicted at every
        reconcile until they are gone). Without a scheduler (no node to plan on) a gang that could be
        completed waits for one."""
        for name in sorted(partial):
            j = partial[name]
            if name not in self._undoing:
                why = distrust(j)
                if not why and self.sched is None:
                    continue
                if not why and not (why := self._complete(j, now, out)):
                    continue
                self._undo(j, why, out)
            sent = self._undoing[name]
            if todo := [m for m in j.members if not m.node and m.key not in sent and _marked(m)]:
                sent.update(m.key for m in todo)
                message = f"{j.name} was admitted part-way and undone: it waits again whole"
                out.annotate.extend(
                    Annotate(
                        ref(m), {QUEUE_ADMITTED_ANNOTATION: None}, ("QueueAdmissionUndone", message), job=name
                    )
                    for m in todo
                )
            out.evict.extend(ref(m) for m in j.members if m.node)

    def _complete(self, j: JobPods, now: float, out: Actions) -> str:
        """Mark the unmarked members of a partly marked gang on the plan its marks began, when the rest fits
        beside them; "" when done, else why not (then the gang is undone)."""
        assert self.sched is not None
        job = j.job(self.config)
        plan = complete_plan(self.sched, j, job)
        if not isinstance(plan, Plan):
            return plan
        at = min(m.admitted.at for m in j.members if m.admitted is not None)
        notice = j.notice or self.noticed.get(j.name)
        try:
            self.sched.adopt(
                job,
                plan,
                at,
                now,
                notice_deadline=notice.deadline if notice is not None else None,
                preemptor=notice.preemptor if notice is not None else None,
            )
        except (GpunodeError, ValueError) as exc:
            return f"the scheduler does not take its plan: {exc}"
        todo = [(m, p) for m, p in zip(j.members, plan.pods, strict=True) if m.admitted is None]
        for m, p in todo:
            gpus = ",".join(p.gpus) or "no GPU"
            message = f"admitted in {j.queue} with the rest of {j.name}: node {p.node}, GPUs {gpus}"
            out.annotate.append(
                Annotate(
                    ref(m),
                    {
                        QUEUE_ADMITTED_ANNOTATION: admitted_text(j.name, p, at, m.uid, key=self.mark_key),
                        QUEUE_REASON_ANNOTATION: None,
                    },
                    ("QueueAdmissionCompleted", message),
                    job=j.name,
                )
            )
        self.written[j.name] = Running(job=job, plan=plan, start=at, notice=notice)
        out.repairs.append((j.name, COMPLETED))
        log.warning(
            "gang %s was admitted part-way (%s): completed, %d member(s) marked on its plan",
            j.name,
            _state(j),
            len(todo),
        )
        return ""

    def _undo(self, j: JobPods, why: str, out: Actions) -> None:
        """Undo a partly marked gang: each unbound member loses its mark and gets the reason, each bound member
        an Event saying it is evicted (by _repair); the gang then waits again whole."""
        reason = f"{j.name} was admitted part-way and undone ({why}): it waits again whole"
        evicted = f"{reason}; this member is evicted: a partial gang holds no GPUs"
        removed = [m for m in j.members if not m.node and _marked(m)]
        self._undoing[j.name] = {m.key for m in removed}
        for m in j.members:
            if m.node:
                out.annotate.append(Annotate(ref(m), {}, ("QueueAdmissionUndone", evicted), warning=True))
            elif _marked(m):
                notes = {QUEUE_ADMITTED_ANNOTATION: None, QUEUE_REASON_ANNOTATION: reason}
                out.annotate.append(Annotate(ref(m), notes, ("QueueAdmissionUndone", reason), job=j.name))
            else:
                out.annotate.append(Annotate(ref(m), {QUEUE_REASON_ANNOTATION: reason}))  # a message only
        out.repairs.append((j.name, UNDONE))
        log.warning(
            "gang %s was admitted part-way (%s): undone (%s): %d mark(s) removed, %d bound member(s) evicted",
            j.name,
            _state(j),
            why,
            len(removed),
            sum(1 for m in j.members if m.node),
        )
