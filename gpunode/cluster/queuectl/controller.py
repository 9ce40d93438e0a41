"""The live queue controller: watches, leadership, configuration reloads, and the writes QueueCore asks for.

QueueController runs on one asyncio loop with one gpunode.infra.kube.KubeClient:

- list+watch streams (all pods, all Nodes, and for governed workloads all Jobs, JobSets and
  PriorityClasses: JobSets only where their CRD is served) feed QueueCore; every replica
  watches, so a standby that takes over has the cluster in memory already;
- with an elector (a LeaderElector on a coordination.k8s.io Lease), only the
  leader reconciles and writes, and each write is preceded by a leadership check;
  losing the lead forgets the Scheduler, and the next leader rebuilds it from the
  pods (their admission and notice annotations), so nothing is admitted twice;
- a reconcile runs after changes (batched for `settle_s`), when a notice runs out,
  and every `resync_s`; its writes: patches of Jobs and JobSets (admission with `spec.suspend: false`,
  suspension, notices: suspension.py), annotations on pods, then the release of gated
  pods whose whole job's marks were written (their node pinned and the scheduling gate
  removed in one update: gates.py), then the Events, then evictions through the Eviction API (policy/v1: KubeClient.evict_pod), each stage
  with up to `max_in_flight` requests under way at once (one pod's writes stay in order). A failed admission write makes the core
  rebuild from what the pods say (a gang left marked part-way is completed there
  or undone, its bound members evicted: repair.py); a refused eviction (a PodDisruptionBudget) is tried again at the
  next reconcile;
- the queue configuration file is read again every `reload_s` when its content
  changed (a ConfigMap volume swaps the file); a bad file is logged with its
  message, counted, and the running configuration stays;
- with a UsageStore, the fair-share usage memory outlives the process: loaded on
  taking the lead before the first cycle, saved every `usage_save_s` and on stopping
  (usagestore.UsageKeeper).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

import msgspec
from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.resource_v1 import ResourceClaim

from gpunode.cluster.queuectl import kinds
from gpunode.cluster.queuectl.core import Actions, Annotate, PodRef, QueueCore
from gpunode.cluster.queuectl.metrics import QueueMetrics
from gpunode.cluster.queuectl.usagestore import UsageKeeper, UsageStore
from gpunode.cluster.queuectl.workloads import JOB, JOBSET
from gpunode.cluster.queuectl.writes import Patch, Release
from gpunode.cluster.queueing.config import MAX_FILE_BYTES, load_queue_config
from gpunode.config.files import read_regular
from gpunode.errors import EvictionBlocked, GpunodeError, KubeApiError, KubeError, KubeNotFound
from gpunode.infra.kube import DELETED, SYNC, KubeClient, LeaderElector, ObjectRef
from gpunode.infra.kube.client import STRATEGIC_MERGE_PATCH

log = logging.getLogger(__name__)
# each listed before a reconcile (resourceclaims: governed pods' DRA claims, queuectl/dra.py)
WATCHED = frozenset({"pods", "nodes", "jobs", "jobsets", "priorityclasses", "resourceclaims"})
ABSENT_RETRY_S = 60.0  # a kind not served (JobSet without its CRD) or not allowed: listed again after this


def _json(obj: Any) -> dict[str, Any]:
    out = msgspec.to_builtins(obj)
    return out if isinstance(out, dict) else {}


class QueueController:
    """One replica of `gpunode queue` (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        core: QueueCore,
        *,
        config_path: Path | None = None,
        elector: LeaderElector | None = None,
        resync_s: float = 30.0,
        settle_s: float = 0.2,
        reload_s: float = 10.0,
        identity: str = "",
        max_in_flight: int = 16,
        clock: Callable[[], float] = time.time,
        usage: UsageStore | None = None,
        usage_save_s: float = 30.0,
    ) -> None:
        self.client, self.core, self.elector = client, core, elector
        self.config_path = config_path
        self.resync_s, self.settle_s, self.reload_s = resync_s, settle_s, reload_s
        self.identity = identity
        self.max_in_flight = max(1, max_in_flight)
        self.clock = clock
        self.metrics = QueueMetrics(lambda: self.core, self.leading)
        self.config_error = ""  # the last refused configuration's message ("" when the file is good)
        self.reconciles = 0
        self._changed = asyncio.Event()
        self._synced: set[str] = set() if core.dra_driver else {"resourceclaims"}  # '': claims not watched
        self._config_digest = self._digest() if config_path is not None else b""
        self._was_leading = False
        self._failed_jobs: set[str] = set()  # jobs whose mark writes failed in the _apply under way
        self.usage = (  # the fair-share usage memory kept across processes (usagestore.py)
            UsageKeeper(
                usage,
                lambda: self.core,
                self.metrics,
                leading=self.leading,
                clock=clock,
                identity=identity,
                every_s=usage_save_s,
            )
            if usage is not None
            else None
        )

    def leading(self) -> bool:
        """Whether this replica may act now."""
        return self.elector is None or self.elector.is_leader()

    # ----- run -------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch, lead (when elected) and reconcile until cancelled."""
        tasks = [
            asyncio.create_task(self._watch(Pod, "pods")),
            asyncio.create_task(self._watch(Node, "nodes")),
            asyncio.create_task(self._watch_optional(kinds.Job, "jobs")),
            asyncio.create_task(self._watch_optional(kinds.JobSet, "jobsets")),
            asyncio.create_task(self._watch_optional(kinds.PriorityClass, "priorityclasses")),
        ]
        if self.core.dra_driver:
            tasks.append(asyncio.create_task(self._watch_optional(ResourceClaim, "resourceclaims")))
        if self.config_path is not None:
            tasks.append(asyncio.create_task(self._reload_loop()))
        if self.elector is not None:
            tasks.append(asyncio.create_task(self.elector.run()))
        if self.usage is not None:
            tasks.append(asyncio.create_task(self.usage.run()))
        try:
            await self._loop()
        finally:
            if self.usage is not None:  # on stopping (SIGTERM), while the Lease is still held
                await self.usage.final_save()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, resource: type[Any], what: str) -> None:
        stream = self.client.watch(resource)
        async with contextlib.aclosing(stream):
            async for event in stream:
                if event.type == SYNC:
                    items = [_json(o) for o in event.items]
                    if what == "pods":
                        self.core.replace_all(items, None)
                    elif what == "nodes":
                        self.core.replace_all(None, items)
                    elif what == "resourceclaims":
                        self.core.replace_claims(items)
                    elif what == "priorityclasses":
                        self.core.priorities.clear()
                        for o in items:
                            self.core.priority_class_changed(o)
                    else:
                        self.core.replace_workloads(JOB if what == "jobs" else JOBSET, items)
                    self._synced.add(what)
                elif event.object is not None:
                    obj = _json(event.object)
                    gone = event.type == DELETED
                    if what == "pods":
                        self.core.pod_changed(obj, deleted=gone)
                    elif what == "nodes":
                        self.core.node_changed(obj, deleted=gone)
                    elif what == "resourceclaims":
                        self.core.claim_changed(obj, deleted=gone)
                    elif what == "priorityclasses":
                        self.core.priority_class_changed(obj, deleted=gone)
                    else:
                        self.core.workload_changed(JOB if what == "jobs" else JOBSET, obj, deleted=gone)
                self._changed.set()

    async def _watch_optional(self, resource: type[Any], what: str) -> None:
        """Watch a kind the controller can do without: not served (no JobSet CRD) or not allowed (a chart
        without its rule), it counts as listed and empty, is logged once, and is listed again later."""
        told = False
        while True:
            try:
                await self._watch(resource, what)
                return
            except (KubeNotFound, KubeApiError) as exc:
                if isinstance(exc, KubeApiError) and not isinstance(exc, KubeNotFound) and exc.status != 403:
                    raise
                if not told:  # not served (JobSets without their CRD) is normal; not allowed is not
                    log.log(
                        logging.INFO if isinstance(exc, KubeNotFound) else logging.WARNING,
                        "queue controller: %s are not queued: %s (hint: %s)",
                        what,
                        exc,
                        "governed pods' DRA claims are not counted until the controller may list and watch "
                        "resource.k8s.io/v1 resourceclaims (Kubernetes 1.34+; the chart grants it)"
                        if what == "resourceclaims"
                        else "install the JobSet CRD, or give the controller list and watch on them (the chart does)",
                    )
                    told = True
                self._synced.add(what)
                self._changed.set()
            await asyncio.sleep(ABSENT_RETRY_S)

    async def _loop(self) -> None:
        while True:
            timeout = self.resync_s
            deadline = self.core.next_deadline()
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - self.clock()) + 0.05)
            if self.elector is not None and not self.leading():
                timeout = min(timeout, self.elector.config.retry_period_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            await asyncio.sleep(self.settle_s)  # let a burst of watch events land first
            self._changed.clear()
            await self.reconcile_once()

    async def reconcile_once(self) -> Actions | None:
        """One reconcile and its writes, when both watches have listed and this replica leads."""
        leading = self.leading()
        if self._was_leading and not leading:
            log.warning("queue controller %s no longer leads: its scheduler state is dropped", self.identity)
            self.core.reset()
            if self.usage is not None:
                self.usage.lost_lead()
        self._was_leading = leading
        if not leading or self._synced != WATCHED:
            return None
        if self.usage is not None:
            await self.usage.on_lead()  # the saved usage, before this leadership's first cycle
        actions = self.core.reconcile(self.clock())
        if self.usage is not None:
            self.usage.report()
        self.reconciles += 1
        await self._apply(actions)
        return actions

    # ----- writes ----------------------------------------------------------------------------------------

    async def _apply(self, actions: Actions) -> None:
        now = self.clock()
        for name in actions.admitted_jobs:
            j = self.core.last_jobs.get(name)
            if j is not None:
                self.metrics.admissions.labels(j.queue).inc()
                since = min((m.created for m in j.members), default=now)
                self.metrics.wait.labels(j.queue).observe(max(0.0, now - since))
            elif (w := self.core.last_workloads.get(name)) is not None:  # a Job or JobSet
                self.metrics.admissions.labels(w.queue).inc()
                since = self.core.waiting_since.get(name, now)
                self.metrics.wait.labels(w.queue).observe(max(0.0, now - since))
        for victim, reason in actions.preempted_jobs:
            j = self.core.last_jobs.get(victim)
            wl = self.core.last_workloads.get(victim)
            self.metrics.preemptions.labels(j.queue if j else wl.queue if wl else "", reason).inc()
        for _, outcome in actions.repairs:
            self.metrics.gang_repairs.labels(outcome).inc()
        by_pod: dict[str, list[Annotate]] = {}  # one pod's writes stay in order; pods go in parallel
        for a in actions.annotate:
            by_pod.setdefault(a.pod.key, []).append(a)
        told: dict[str, list[Annotate]] = {}  # the Events of the annotations written, by pod
        self._failed_jobs = set()
        await self._bounded(self._patch(p) for p in actions.patch)
        await self._bounded(self._annotate_pod(writes, told) for writes in by_pod.values())
        await self._bounded(self._release(r) for r in actions.release)
        await self._bounded(self._tell_pod(events) for events in told.values())
        if not self.leading():
            return
        await self._bounded(self._evict(ref) for ref in actions.evict)

    async def _bounded(self, calls: Iterable[Coroutine[Any, Any, None]]) -> None:
        """Run the calls with at most `max_in_flight` of them waiting on the API server at once (workers
        take the next call as they finish one: calls are made only when a worker is free for them)."""
        pending = iter(calls)

        async def worker() -> None:
            for call in pending:
                await call

        await asyncio.gather(*(worker() for _ in range(self.max_in_flight)))

    async def _annotate_pod(self, writes: list[Annotate], told: dict[str, list[Annotate]]) -> None:
        """One pod's annotations, in order, each preceded by a leadership check; the Events of those
        written go to `told`, to be posted once every pod's annotations are (the marks are the decisions)."""
        for i, a in enumerate(writes):
            if not self.leading():
                for rest in writes[i:]:
                    if rest.job:
                        self._failed_jobs.add(rest.job)
                        self.core.write_failed(rest.job)
                return
            try:
                if a.annotations:
                    await self.client.patch_pod_annotations(a.pod.namespace, a.pod.name, dict(a.annotations))
            except KubeError as exc:
                self.metrics.api_errors.labels("annotate").inc()
                log.warning("queue controller: %s (hint: %s)", exc, exc.hint)
                if a.job:
                    self._failed_jobs.add(a.job)
                    self.core.write_failed(a.job)
                continue
            if a.event is not None:
                told.setdefault(a.pod.key, []).append(a)

    async def _patch(self, p: Patch) -> None:
        """One patch of a Job or JobSet (suspend and annotations in one write), then its Event and condition."""
        if not self.leading():
            if p.job:
                self._failed_jobs.add(p.job)
                self.core.write_failed(p.job)
            return
        resource = kinds.Job if p.target.kind == JOB else kinds.JobSet
        body: dict[str, Any] = {"metadata": {"uid": p.target.uid, "annotations": dict(p.annotations)}}
        if p.suspend is not None:
            body["spec"] = {"suspend": p.suspend}
        try:
            await self.client.patch_json(resource, p.target.name, body, namespace=p.target.namespace)
        except KubeError as exc:
            self.metrics.api_errors.labels("patch").inc()
            log.warning("queue controller: %s (hint: %s)", exc, exc.hint)
            if p.job:
                self._failed_jobs.add(p.job)
                self.core.write_failed(p.job)
            return
        if p.event is not None:
            try:
                await self.client.post_event(
                    ObjectRef(
                        p.target.kind, p.target.name, p.target.namespace, p.target.uid, p.target.api_version
                    ),
                    reason=p.event[0],
                    message=p.event[1],
                    event_type="Warning" if p.warning else "Normal",
                    host=self.identity,
                )
            except KubeError as exc:
                self.metrics.api_errors.labels("event").inc()
                log.warning("queue controller: %s (hint: %s)", exc, exc.hint)
        if p.condition is not None:
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            condition = {
                "type": p.condition[0],
                "status": "True",
                "reason": p.condition[0],
                "message": p.condition[1][:1024],
                "lastProbeTime": now,
                "lastTransitionTime": now,
            }
            try:  # strategic merge: the Job controller's conditions stay (merged by type)
                await self.client.patch_json(
                    resource,
                    p.target.name,
                    {"status": {"conditions": [condition]}},
                    namespace=p.target.namespace,
                    subresource="status",
                    content_type=STRATEGIC_MERGE_PATCH,
                )
            except KubeError as exc:
                self.metrics.api_errors.labels("condition").inc()
                log.warning("queue controller: %s (hint: %s)", exc, exc.hint)

    async def _release(self, r: Release) -> None:
        """Pin a gated pod to its planned node and remove the admission gate, unless a mark of its job
        failed to be written in this reconcile (the core rebuilds then: repair.py) or the lead is lost."""
        if r.job in self._failed_jobs or not self.leading():
            self.core.release_failed(r.pod.uid)
            return
        try:
            await self.client.patch_pod_spec(r.pod.namespace, r.pod.name, r.spec, what="release")
        except KubeNotFound:
            self.core.release_failed(r.pod.uid)
        except KubeError as exc:  # sent again at the next reconcile that sees the pod still gated
            self.core.release_failed(r.pod.uid)
            self.metrics.api_errors.labels("release").inc()
            log.warning("queue controller: %s (hint: %s)", exc, exc.hint)

    async def _tell_pod(self, events: list[Annotate]) -> None:
        """One pod's Events, in order, each preceded by a leadership check."""
        for a in events:
            if not self.leading() or a.event is None:
                return
            try:
                await self.client.post_event(
                    ObjectRef("Pod", a.pod.name, a.pod.namespace, a.pod.uid),
                    reason=a.event[0],
                    message=a.event[1],
                    event_type="Warning" if a.warning else "Normal",
                    host=self.identity,
                )
            except KubeError as exc:  # an Event lost is only a message lost: nothing to repair
                self.metrics.api_errors.labels("event").inc()
                log.warning("queue controller: %s (hint: %s)", exc, exc.hint)

    async def _evict(self, ref: PodRef) -> None:
        if not self.leading():
            return
        try:
            await self.client.evict_pod(ref.namespace, ref.name, uid=ref.uid or None)
        except (KubeNotFound, EvictionBlocked) as exc:
            log.info("eviction of %s: %s", ref.key, exc)
        except KubeError as exc:
            self.metrics.api_errors.labels("evict").inc()
            log.warning("queue controller: %s (hint: %s)", exc, exc.hint)

    # ----- configuration ---------------------------------------------------------------------------------

    def _digest(self) -> bytes:
        assert self.config_path is not None
        try:
            return hashlib.sha256(read_regular(self.config_path, MAX_FILE_BYTES)).digest()
        except OSError:
            return b""

    def reload_config(self) -> bool:
        """Read the configuration file again if it changed; True when a new configuration was taken."""
        digest = self._digest()
        if digest == self._config_digest:
            return False
        self._config_digest = digest
        assert self.config_path is not None
        try:
            config = load_queue_config(self.config_path)
        except GpunodeError as exc:
            self.config_error = str(exc)
            self.metrics.config_refused.inc()
            log.error("queue configuration refused, the running one stays: %s (hint: %s)", exc, exc.hint)
            return False
        self.config_error = ""
        self.core.set_config(config)
        log.info("queue configuration reloaded from %s", self.config_path)
        self._changed.set()
        return True

    async def _reload_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reload_s)
            self.reload_config()
