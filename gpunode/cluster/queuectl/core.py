"""The queue controller's decisions, without I/O: pods and nodes in, writes to make out.

QueueCore keeps the pods and Nodes the watches report (v1 JSON) and, at each
reconcile(now), turns them into jobs (jobs.py), keeps one Scheduler in step with
them and runs its cycle. What to write comes back as Actions: the admission
annotation for every member of an admitted job, preemption notices, evictions,
why jobs still wait, and pods that cannot be queued (each reported once). A member
that carries the scheduling gate gpunode.io/admission is released (pinned to its
planned node, the gate removed: gates.py) once its whole job is marked: in the
reconcile that admits it, or, when the marks were written by an earlier leader that
stopped before releasing, in the first reconcile that sees them all.

The Scheduler is rebuilt from the pods (sched.build) at the start, after a
configuration change and when the nodes' capacity changes; otherwise it follows
them by its own calls: jobs that appear are submitted, jobs whose pods are gone
finished, waiting jobs whose pods vanish withdrawn (victims stopping for them keep
running: their notice is removed), jobs admitted by someone else adopted. A job whose
notice ran out is "stopping": it is evicted (again at every reconcile while its pods
remain, for a PodDisruptionBudget may refuse) and neither admitted nor counted. A
gang admitted part-way is completed or undone before the cycle (repair.GangRepair).

Governed Jobs and JobSets (workloads.py) are jobs too, admitted by resuming them and preempted by
suspending them (suspension.WorkloadQueue); their pods are placed on their admission's slots, and are
not queued as pods.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from gpunode.cluster.extender.workload import WorkloadTracker
from gpunode.cluster.queuectl import dra
from gpunode.cluster.queuectl.gates import gated, release_spec
from gpunode.cluster.queuectl.jobs import (
    JobPods,
    NoticeMark,
    QueuedPod,
    admitted_text,
    group_jobs,
    notice_text,
    queued_pod,
    rfc3339,
)
from gpunode.cluster.queuectl.nodes import ClusterView, cluster_view
from gpunode.cluster.queuectl.repair import GangRepair, partly_marked
from gpunode.cluster.queuectl.sched import Running, adopt, build, follow_idle, settle_heap
from gpunode.cluster.queuectl.suspension import WorkloadQueue
from gpunode.cluster.queuectl.usage import Outcome, SavedUsage, seed, snapshot
from gpunode.cluster.queuectl.workloads import JOB, JOBSET, Owned, Slot, Workload, pod_group, workloads
from gpunode.cluster.queuectl.writes import Actions, Annotate, PodRef, Release, ref
from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import Decisions, Job
from gpunode.cluster.queuemark import MarkKey
from gpunode.contract.dra import DEFAULT_DRIVER
from gpunode.contract.names import (
    GIB,
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_REASON_ANNOTATION,
)
from gpunode.placement.model import NodeState

log = logging.getLogger(__name__)


def _ref(m: QueuedPod) -> PodRef:
    return ref(m)


class QueueCore(GangRepair, WorkloadQueue):
    """The controller's state and decisions (see the module docstring)."""

    def __init__(
        self,
        config: QueueConfig,
        *,
        memory_unit_bytes: int = GIB,
        mark_key: MarkKey | None = None,
        dra_driver: str = DEFAULT_DRIVER,
    ) -> None:
        """`mark_key`: signs the admission marks written, and checks those read (None: unsigned, by UID).
        `dra_driver`: the DRA driver whose claims governed pods are charged for (dra.py)."""
        self.config = config
        self.memory_unit_bytes = memory_unit_bytes
        self.mark_key = mark_key
        self.pods: dict[str, Mapping[str, Any]] = {}  # namespace/name -> v1 Pod
        self.nodes: dict[str, Mapping[str, Any]] = {}
        self.sched: Scheduler | None = None
        self.workload = WorkloadTracker(memory_reference_bytes=80 * GIB)
        self._observed: set[str] = set()
        self.rebuilds = 0
        self._now = 0.0
        self.waiting_since: dict[str, float] = {}  # job -> when it was first seen waiting
        self.last_jobs: dict[str, JobPods] = {}
        self.view: ClusterView | None = None
        self._signature: tuple[object, ...] | None = None
        self._stale = True
        self._reported: dict[str, str] = {}  # job -> the problem already reported
        self._lost: set[str] = set()
        self._pending: set[str] = set()  # the jobs submitted and still waiting in the scheduler
        # written but perhaps not yet seen through the watch: read back from here until it is
        self.written: dict[str, Running] = {}
        self.noticed: dict[str, NoticeMark] = {}
        self._undoing: dict[str, set[str]] = {}  # gang being undone -> members whose mark removal was sent
        self._node_views: dict[str, tuple[object, NodeState]] = {}  # cluster_view's, kept between reconciles
        self._usage_seed: tuple[SavedUsage, str] | None = None  # saved usage for the next Scheduler
        self._usage_seeded: Outcome | None = None
        self.released: set[str] = set()  # UIDs of gated pods whose release was sent (until it fails)
        self.workload_objects: dict[str, dict[str, Mapping[str, Any]]] = {JOB: {}, JOBSET: {}}  # by UID
        self.workloads_listed: set[str] = set()  # the kinds listed (replace_workloads) at least once
        self.priorities: dict[str, int] = {}  # PriorityClass name -> value (a pod template's priority)
        self.last_workloads: dict[str, Workload] = {}
        self._suspend_sent: set[str] = set()  # workloads whose suspension (or mark removal) was sent
        self._pod_slots: dict[str, tuple[str, Slot]] = {}  # pod UID -> (workload, slot) marked, not yet seen
        self._workload_pod_keys: frozenset[str] = frozenset()
        self._wpods: dict[str, list[tuple[Mapping[str, Any], str]]] = {}
        self._view_size: tuple[ClusterView | None, int, int] = (None, 0, 0)  # view, largest node, GPUs
        self.dra_driver = dra_driver
        self.claims: dict[str, dra.DraClaim] = {}  # namespace/name -> what its ResourceClaim holds and asks
        self.dra: dra.DraUsage = dra.DraUsage()  # governed pods' DRA claims at the last reconcile
        self._dra_pods: list[dra.DraPod] = []

    # ----- inputs --------------------------------------------------------------------------------------

    def set_config(self, config: QueueConfig) -> None:
        """A new queue configuration: the next reconcile rebuilds the Scheduler with it."""
        self.config, self._stale = config, True

    def write_failed(self, job: str) -> None:
        """Writing a job's admission or notice failed: forget it and rebuild from the pods next time."""
        self.written.pop(job, None)
        self.noticed.pop(job, None)
        self._undoing.pop(job, None)
        self._forget_pod_slots(job)
        self._stale = True

    def release_failed(self, uid: str) -> None:
        """Releasing a gated pod failed: send it again at the next reconcile that sees it gated."""
        self.released.discard(uid)

    def _release(self, m: QueuedPod, node: str, job: str, out: Actions) -> None:
        pod = self.pods.get(m.key)
        if pod is None or not gated(pod) or m.uid in self.released:
            return
        self.released.add(m.uid)
        out.release.append(Release(_ref(m), node, release_spec(pod, node), job=job))

    def reset(self) -> None:
        """Forget the Scheduler (on losing leadership): the next leader rebuilds from the API server."""
        self.sched, self._stale = None, True
        self._usage_seed = None
        self.written.clear()
        self.noticed.clear()
        self._undoing.clear()
        self.released.clear()
        self._pod_slots.clear()
        self._suspend_sent.clear()

    def seed_usage(self, state: SavedUsage, where: str) -> None:
        """Saved fair-share usage (checked by usage.decode): into the Scheduler now, or the next one built."""
        self._usage_seed = (state, where)
        if self.sched is not None:
            self._seed()

    def _seed(self) -> None:
        if self._usage_seed is not None and self.sched is not None:
            state, where = self._usage_seed
            self._usage_seed = None
            state.at = min(state.at, self._now)  # never after the scheduler's time (a clock stepped back)
            self._usage_seeded = seed(self.sched, state, self.config, where)

    def take_seeded(self) -> Outcome | None:
        """What became of the saved usage last put into a Scheduler (once; None when nothing new)."""
        out, self._usage_seeded = self._usage_seeded, None
        return out

    def usage_state(self, now: float, identity: str) -> SavedUsage | None:
        """The Scheduler's fair-share usage charged up to `now`, to save; None without a Scheduler."""
        if self.sched is None:
            return None
        now = self._now = max(now, self._now)  # the scheduler's time may not go back
        return snapshot(self.sched, now, identity)

    def pod_changed(self, pod: Mapping[str, Any], *, deleted: bool = False) -> None:
        """A pod added, changed or deleted."""
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        if deleted:
            self.pods.pop(key, None)
        else:
            self.pods[key] = pod

    def node_changed(self, node: Mapping[str, Any], *, deleted: bool = False) -> None:
        """A Node added, changed or deleted."""
        name = str((node.get("metadata") or {}).get("name") or "")
        if deleted:
            self.nodes.pop(name, None)
        else:
            self.nodes[name] = node

    def workload_changed(self, kind: str, obj: Mapping[str, Any], *, deleted: bool = False) -> None:
        """A Job or JobSet (kind JOB or JOBSET) added, changed or deleted."""
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if deleted:
            self.workload_objects[kind].pop(uid, None)
        else:
            self.workload_objects[kind][uid] = obj

    def replace_workloads(self, kind: str, items: Sequence[Mapping[str, Any]]) -> None:
        """A fresh list of Jobs or JobSets."""
        self.workloads_listed.add(kind)
        self.workload_objects[kind] = {}
        for obj in items:
            self.workload_changed(kind, obj)

    def claim_changed(self, obj: Mapping[str, Any], *, deleted: bool = False) -> None:
        """A ResourceClaim added, changed or deleted (kept as dra.read_claim reads it)."""
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        claim = None if deleted else dra.read_claim(obj, self.dra_driver)
        if claim is None:
            self.claims.pop(key, None)
        else:
            self.claims[key] = claim

    def replace_claims(self, items: Sequence[Mapping[str, Any]]) -> None:
        """A fresh list of ResourceClaims."""
        self.claims = {}
        for obj in items:
            self.claim_changed(obj)

    def priority_class_changed(self, obj: Mapping[str, Any], *, deleted: bool = False) -> None:
        """A PriorityClass added, changed or deleted (a Job's pod template names one)."""
        name = str((obj.get("metadata") or {}).get("name") or "")
        value = obj.get("value")
        if deleted or not isinstance(value, int) or isinstance(value, bool):
            self.priorities.pop(name, None)
        else:
            self.priorities[name] = value

    def replace_all(
        self, pods: Sequence[Mapping[str, Any]] | None, nodes: Sequence[Mapping[str, Any]] | None
    ) -> None:
        """A fresh list of pods and/or nodes (a watch's SYNC)."""
        if pods is not None:
            self.pods = {}
            for p in pods:
                self.pod_changed(p)
        if nodes is not None:
            self.nodes = {}
            for n in nodes:
                self.node_changed(n)

    # ----- the reconcile --------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When a notice runs out (reconcile then), or None."""
        return self.sched.next_deadline() if self.sched is not None else None

    def reconcile(self, now: float) -> Actions:
        """Bring the Scheduler in step with the pods, run one cycle, and say what to write."""
        now = self._now = max(now, self._now)  # the wall clock may step back; the scheduler's time may not
        out = Actions()
        wls, owners = workloads(
            self.workload_objects[JOB].values(),
            self.workload_objects[JOBSET].values(),
            self.config,
            self.priorities,
            memory_unit_bytes=self.memory_unit_bytes,
            mark_key=self.mark_key,
        )
        wpods: dict[str, list[tuple[Mapping[str, Any], str]]] = {}
        queued = []
        dra_pods: list[dra.DraPod] = []
        for pod in self.pods.values():
            # a pod of a Job not seen yet is left alone (its Job's watch event may come after the pod's);
            # where Jobs are not listed at all (not allowed), pods of Jobs are queued as pods
            owned = pod_group(pod, owners) if JOB in self.workloads_listed else None
            if isinstance(owned, Owned):
                wpods.setdefault(owned.workload, []).append((pod, owned.group))
            elif owned is None and (
                q := queued_pod(
                    pod, self.config, memory_unit_bytes=self.memory_unit_bytes, mark_key=self.mark_key
                )
            ):
                queued.append(q)
            if (
                owned is None
                and (pod.get("spec") or {}).get("resourceClaims")
                and (dp := dra.dra_pod(pod, self.config, device_plugin=q is not None)) is not None
            ):
                dra_pods.append(dp)
        self._wpods = wpods
        self._workload_pod_keys = frozenset(  # their GPUs are the workloads' plans (none once finished)
            f"{(p.get('metadata') or {}).get('namespace') or 'default'}/{(p.get('metadata') or {}).get('name')}"
            for name, ps in wpods.items()
            if name in wls and not wls[name].finished
            for p, _ in ps
        )
        for q in queued:
            if q.request is not None and q.uid not in self._observed:
                self._observed.add(q.uid)
                self.workload.observe(q.request)
        self._observed &= {q.uid for q in queued}
        self.released &= {q.uid for q in queued} | {d.uid for d in dra_pods}
        self._dra_pods = dra_pods
        jobs = group_jobs(queued)
        self.last_jobs = jobs
        stopping = {n for n, j in jobs.items() if (nt := j.notice) is not None and nt.deadline <= now}
        for name in sorted(stopping):
            out.evict.extend(_ref(m) for m in jobs[name].members)
        running: dict[str, Running] = {}
        waiting: dict[str, Job] = {}
        partial: dict[str, JobPods] = {}
        for name, j in jobs.items():
            problem, partly = j.problem, partly_marked(j)
            if problem:
                if self._reported.get(name) != problem:
                    self._reported[name] = problem
                    out.annotate.extend(
                        Annotate(_ref(m), {}, ("QueueRefused", problem), warning=True) for m in j.members
                    )
                if not partly:  # a partial gang holds no GPUs, with a problem or not: repaired below
                    continue
            if name in stopping:
                continue
            if not problem and name in self.written and not j.marked:  # written, not all seen yet
                running[name] = self.written[name]
                continue
            self.written.pop(name, None)
            if partly:  # admitted part-way: completed or undone (_repair), never left holding GPUs
                partial[name] = j
                continue
            notice = j.notice or self.noticed.get(name)
            if j.notice is not None:
                self.noticed.pop(name, None)
            if j.admitted:
                for m in j.members:  # marked whole (else partly, above): release the members still gated
                    if m.admitted is not None:
                        self._release(m, m.admitted.node, name, out)
                start = min((m.admitted.at for m in j.members if m.admitted is not None), default=now)
                running[name] = Running(job=j.job(self.config), plan=j.plan(), start=start, notice=notice)
            elif j.complete:
                waiting[name] = j.job(self.config)
                self.waiting_since.setdefault(name, now)
        w_running, w_waiting, w_stopping = self._workload_step(wls, wpods, now, out)
        running.update(w_running)
        waiting.update(w_waiting)
        stopping |= w_stopping
        self._undoing = {n: sent for n, sent in self._undoing.items() if n in partial}
        for gone in set(self.waiting_since) - set(waiting):
            del self.waiting_since[gone]
        for gone in (set(self.written) | set(self.noticed)) - set(jobs) - set(wls):
            self.written.pop(gone, None)
            self.noticed.pop(gone, None)
        self._sync(running, waiting, now, out)
        self._dra_step(now, out)
        self._repair(partial, now, out)
        self._undo_lost(w_running, wpods, out)
        if self.sched is None:
            return out
        follow_idle(self.sched, jobs)
        d = self.sched.cycle(now)
        self._act(d, jobs, stopping, now, out)
        self._workload_decisions(d, wpods, out)
        return out

    def _sync(self, running: dict[str, Running], waiting: dict[str, Job], now: float, out: Actions) -> None:
        view = cluster_view(
            self.nodes.values(),
            frozenset(m.key for j in self.last_jobs.values() for m in j.members) | self._workload_pod_keys,
            self._node_views,
        )
        self.view = view
        sched = self.sched
        if self._stale or sched is None or view.signature != self._signature:
            if not view.nodes:
                self.sched = None
                return
            self.sched, lost = build(
                self.config,
                view.nodes,
                list(running.values()),
                list(waiting.values()),
                now,
                self.workload.workload(),
            )
            self._lost = set(lost)
            self._pending = set(waiting)
            self._signature, self._stale = view.signature, False
            self.rebuilds += 1
            if sched is not None:  # the last window's usage survives the rebuild (same fair-share settings)
                self.sched.inherit_usage(sched, now)
            sched = None  # the old Scheduler: nothing may hold it now, so settle_heap collects it
            self._seed()  # saved usage loaded on taking the lead goes into its first Scheduler
            settle_heap()  # the rebuilt state is long-lived: keep GC pauses off the admission path
            log.info(
                "queue scheduler rebuilt: %d running, %d waiting jobs, %d nodes",
                len(running),
                len(waiting),
                len(view.nodes),
            )
            return
        for name in list(sched.running):
            if name not in running:
                sched.finished(name, now)
        for name in sorted(
            self._pending - set(waiting)
        ):  # its pods were deleted, or it was admitted elsewhere
            self._withdraw(name, now, out)
        for name, r in running.items():
            if name not in sched.running and name not in self._lost and not adopt(sched, r, now):
                self._lost.add(name)
        for name, job in waiting.items():
            if name not in self._pending and name not in sched.running:
                sched.submit(job, now)
                self._pending.add(name)

    def _dra_step(self, now: float, out: Actions) -> None:
        """Governed pods' DRA claims: charged to their queues, gated DRA pods admitted by quota (dra.step)."""
        nodes = self.view.nodes if self.view is not None else ()
        self.dra = dra.step(
            self.sched, nodes, self._dra_pods, self.claims, self.pods, self.released, now, out
        )

    def _withdraw(self, name: str, now: float, out: Actions) -> None:
        """Take a job off the pending ones; victims stopping for it keep running: their notice is removed."""
        assert self.sched is not None
        self._pending.discard(name)
        for victim in self.sched.withdraw(name, now):
            self.noticed.pop(victim, None)
            if (wl := self.last_workloads.get(victim)) is not None:
                self._lift_workload_notice(wl, self._wpods.get(victim, ()), name, out)
                continue
            j = self.last_jobs.get(victim)
            for m in j.members if j is not None else ():
                out.annotate.append(
                    Annotate(
                        _ref(m),
                        {PREEMPTION_NOTICE_ANNOTATION: None},
                        ("PreemptionLifted", f"{name} no longer waits: the notice is lifted"),
                        job=victim,
                    )
                )

    def _act(
        self, d: Decisions, jobs: dict[str, JobPods], stopping: set[str], now: float, out: Actions
    ) -> None:
        killed = set(d.kill)
        for name in d.kill:  # requeued by the scheduler: its pods are being evicted, it does not wait
            self._pending.add(name)
            self._withdraw(name, now, out)
        for a in d.admit:
            self._pending.discard(a.job.name)
            if (wl := self.last_workloads.get(a.job.name)) is not None:
                if a.job.name in killed or a.job.name in stopping or wl.mark is not None or wl.problem:
                    assert self.sched is not None
                    self.sched.finished(a.job.name, now)
                else:
                    self._admit_workload(wl, a.job, a.plan, now, out)
                continue
            j = jobs.get(a.job.name)
            if j is None or a.job.name in killed or a.job.name in stopping or j.admitted:
                assert self.sched is not None
                self.sched.finished(a.job.name, now)  # not ours to start (gone, stopping, or already held)
                continue
            for m, placement in zip(j.members, a.plan.pods, strict=False):
                text = admitted_text(a.job.name, placement, now, m.uid, key=self.mark_key)
                gpus = ",".join(placement.gpus) or "no GPU"
                out.annotate.append(
                    Annotate(
                        _ref(m),
                        {QUEUE_ADMITTED_ANNOTATION: text, QUEUE_REASON_ANNOTATION: None},
                        ("QueueAdmitted", f"admitted in {a.job.queue}: node {placement.node}, GPUs {gpus}"),
                        job=a.job.name,
                    )
                )
                self._release(m, placement.node, a.job.name, out)
            out.admitted_jobs.append(a.job.name)
            self.written[a.job.name] = Running(job=a.job, plan=a.plan, start=now, notice=None)
        for n in d.notices:
            if (wl := self.last_workloads.get(n.victim)) is not None:
                self._notice_workload(wl, self._wpods.get(n.victim, ()), n, out)
                continue
            j = jobs.get(n.victim)
            if j is None:
                continue
            text = notice_text(n.deadline, n.preemptor, n.reason)
            message = (
                f"preempted ({n.reason}) to make room for {n.preemptor}: stop or checkpoint by "
                f"{rfc3339(n.deadline)}; evicted then"
            )
            out.annotate.extend(
                Annotate(
                    _ref(m),
                    {PREEMPTION_NOTICE_ANNOTATION: text},
                    ("Preempting", message),
                    warning=True,
                    job=n.victim,
                )
                for m in j.members
            )
            out.preempted_jobs.append((n.victim, n.reason))
            self.noticed[n.victim] = NoticeMark(deadline=n.deadline, preemptor=n.preemptor, reason=n.reason)
        for name in d.kill:
            j = jobs.get(name)
            if j is not None and name not in stopping:
                out.evict.extend(_ref(m) for m in j.members)
        for w in [*d.waiting, *d.timed_out]:
            j = jobs.get(w.job)
            if j is None:
                continue
            out.annotate.extend(
                Annotate(_ref(m), {QUEUE_REASON_ANNOTATION: w.reason}, ("Queued", w.reason))
                for m in j.members
            )
