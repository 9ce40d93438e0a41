"""Remediation on Kubernetes: evict the pods on a failed device, tell people, mark the node.

For each new Fault, KubeRemediator asks the kubelet (pod-resources List) which
containers hold the fault's device IDs, and evicts each of their pods once
through the Eviction API (policy/v1), so PodDisruptionBudgets are honoured: a
429 is retried with backoff until the eviction deadline, after which the pod is
optionally deleted. It posts a Warning Event on the node and on each pod
naming the GPU and the fault, and keeps the node annotation
`gpunode.io/unhealthy-gpus` (JSON: UUID -> reason) equal to the current set of
unhealthy GPUs and MIG instances. Dry-run posts the Events (marked dry-run) and
logs what it would do, and changes nothing else.

Everything runs in its own tasks on the agent's event loop, each API call
bounded by the client's request timeout, so an API server that is slow or down
never delays health marking, the device plugin or the metrics. A node-wide rate
limit bounds how many evictions start per interval; a pod (by UID) is evicted
at most once, so a flapping GPU cannot cause an eviction storm.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from gpunode.config.health import RemediationConfig
from gpunode.contract.names import UNHEALTHY_GPUS_ANNOTATION
from gpunode.errors import EvictionBlocked, KubeConflict, KubeError, KubeNotFound
from gpunode.infra.kube import KubeClient, ObjectRef, PodInfo, is_retryable
from gpunode.node.devices.base import Backend
from gpunode.node.health.actions import ActionRecord, Backoff, Journal, Memory, RateLimiter, fault_fields
from gpunode.node.health.baremetal import BareMetalRemediator
from gpunode.node.health.model import Fault
from gpunode.node.kubelet.podresources import list_container_devices

log = logging.getLogger("gpunode.node.health")

POD_RESOURCES_TIMEOUT_S = 5.0
EVENT_DEADLINE_S = 120.0  # an Event is worth retrying this long, no longer

T = TypeVar("T")


class KubeRemediator:
    """Evicts the pods holding failed devices, posts Events and annotates the node. See the module docstring."""

    def __init__(
        self,
        config: RemediationConfig,
        *,
        node_name: str,
        pod_resources_socket: str,
        client_factory: Callable[[], KubeClient] | None = None,
        journal: Journal | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.node_name = node_name
        self.pod_resources_socket = pod_resources_socket
        self.journal = journal or Journal()
        self._client_factory = client_factory or (
            lambda: KubeClient.from_environment(
                kubeconfig=config.kubeconfig, request_timeout_s=config.request_timeout_s
            )
        )
        self._client: KubeClient | None = None
        self._clock = clock
        self._lock = threading.Lock()
        self._pending_faults: deque[Fault] = deque()
        self._pending_level: dict[str, str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._node_dirty: asyncio.Event | None = None
        self._desired: dict[str, str] = {}
        self._level: dict[str, str] = {}
        self._evicted = Memory()  # pod UIDs evicted (or being evicted) once already
        self._in_progress: set[tuple[str, str]] = set()
        self._limiter = RateLimiter(config.max_evictions, config.eviction_interval_s, clock=clock)
        self._tasks: set[asyncio.Task[None]] = set()
        self._notes: dict[str, tuple[str, str]] = {}  # device -> (Event reason, message) for its recovery

    def note_recovery(self, uuid: str, reason: str, message: str) -> None:
        """Say why a device is about to be reported healthy (a reset, an operator's clear) in its Node Event."""
        with self._lock:
            self._notes[uuid] = (reason, message)

    # -- input (any thread) -----------------------------------------------------------------------

    def notify(self, unhealthy: Mapping[str, str], faults: Sequence[Fault]) -> None:
        """Queue the current unhealthy devices and new faults for the run loop (thread-safe)."""
        with self._lock:
            self._pending_level = dict(unhealthy)
            self._pending_faults.extend(faults)
            loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    # -- the long-running part ------------------------------------------------------------------

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Process notified health changes and faults until cancelled; sets ready once started."""
        wake, dirty = asyncio.Event(), asyncio.Event()
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._wake, self._node_dirty = wake, dirty
            wake.set()  # pick up anything notified before we started
        if not self.node_name:
            log.warning(
                "remediation: the node name is not set (gpunode.nodeName or NODE_NAME): pods are still "
                "evicted, but no node Event is posted and the node is not annotated"
            )
        dirty.set()  # make the annotation match (clears one left by an earlier run)
        self._spawn(self._mark_node())
        if ready is not None:
            ready.set()
        try:
            while True:
                await wake.wait()
                wake.clear()
                with self._lock:
                    level, self._pending_level = self._pending_level, None
                    faults = list(self._pending_faults)
                    self._pending_faults.clear()
                if level is not None:
                    self._level_changed(level)
                for fault in faults:
                    self._spawn(self._remediate(fault))
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._client is not None:
                await self._client.close()
                self._client = None
            with self._lock:
                self._loop = self._wake = self._node_dirty = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("remediation task failed", exc_info=task.exception())

    # -- API calls, with retries -----------------------------------------------------------------

    async def _call(self, fn: Callable[[KubeClient], Awaitable[T]]) -> T:
        """One call with the client, made on first use (a KubeError if there are no credentials)."""
        if self._client is None:
            self._client = self._client_factory()
        return await fn(self._client)

    async def _retry(self, fn: Callable[[KubeClient], Awaitable[T]], *, deadline: float) -> tuple[T, int]:
        """Call until it succeeds, a non-retryable error, or the deadline; returns (result, attempts)."""
        backoff = Backoff(self.config.retry_initial_s, self.config.retry_max_s)
        attempts = 0
        while True:
            attempts += 1
            try:
                return await self._call(fn), attempts
            except KubeError as exc:
                left = deadline - self._clock()
                if not is_retryable(exc) or left <= 0:
                    raise
                await asyncio.sleep(min(backoff.next_delay(), left))

    # -- the node ---------------------------------------------------------------------------------

    def _level_changed(self, level: dict[str, str]) -> None:
        recovered = [u for u in self._level if u not in level]
        self._level = level
        for uuid in recovered:
            with self._lock:
                reason, why = self._notes.pop(
                    uuid, ("GpuHealthy", "its probes passed for the recovery window")
                )
            if self.config.post_events and self.node_name:
                message = f"GPU device {uuid} is healthy again: {why}"
                self._spawn(self._post_event(ObjectRef("Node", self.node_name), reason, message, "Normal"))
        if self._desired != level and self._node_dirty is not None:
            self._desired = dict(level)
            self._node_dirty.set()

    async def _mark_node(self) -> None:
        assert self._node_dirty is not None
        applied: dict[str, str] | None = None
        backoff = Backoff(self.config.retry_initial_s, self.config.retry_max_s)
        while True:
            await self._node_dirty.wait()
            self._node_dirty.clear()
            desired = dict(self._desired)
            if desired == applied or not self.config.mark_node or not self.node_name:
                continue
            value = json.dumps(desired, sort_keys=True) if desired else None
            what = f"{UNHEALTHY_GPUS_ANNOTATION}={value or '(removed)'}"
            if self.config.dry_run:
                self.journal.add(ActionRecord("annotate-node", "dry-run", detail=what, dry_run=True))
                applied = desired
                continue
            try:
                _, attempts = await self._retry(
                    functools.partial(self._annotate, value),
                    deadline=self._clock() + self.config.retry_max_s,
                )
            except KubeError as exc:
                self.journal.add(ActionRecord("annotate-node", "failed", detail=f"{what}: {exc}"))
                await asyncio.sleep(backoff.next_delay())
                self._node_dirty.set()
                continue
            backoff = Backoff(self.config.retry_initial_s, self.config.retry_max_s)
            applied = desired
            self.journal.add(ActionRecord("annotate-node", "done", attempts=attempts, detail=what))

    async def _annotate(self, value: str | None, client: KubeClient) -> None:
        await client.patch_node_annotations(self.node_name, {UNHEALTHY_GPUS_ANNOTATION: value})

    async def _post_event(
        self, about: ObjectRef, reason: str, message: str, event_type: str = "Warning"
    ) -> None:
        if self.config.dry_run:
            message = f"[dry-run] {message}"
        target = f"{about.kind} {about.namespace + '/' if about.namespace else ''}{about.name}"
        try:
            _, attempts = await self._retry(
                lambda c: c.post_event(
                    about, reason=reason, message=message, event_type=event_type, host=self.node_name
                ),
                deadline=self._clock() + min(EVENT_DEADLINE_S, self.config.eviction_deadline_s),
            )
        except KubeError as exc:
            self.journal.add(ActionRecord("event", "failed", detail=f"{reason} on {target}: {exc}"))
            return
        self.journal.add(
            ActionRecord(
                "event",
                "done",
                attempts=attempts,
                detail=f"{reason} on {target}",
                dry_run=self.config.dry_run,
            )
        )

    def _event(self, about: ObjectRef, reason: str, message: str) -> None:
        """Post a Warning Event in its own task, when Events are on."""
        if self.config.post_events:
            self._spawn(self._post_event(about, reason, message))

    # -- one fault ----------------------------------------------------------------------------

    async def _remediate(self, fault: Fault) -> None:
        fields = fault_fields(fault)
        if self.config.post_events and self.node_name:
            action = "no pod is evicted" if self.config.dry_run else "its pods are evicted"
            message = f"{fault.describe()}; {action}"
            self._spawn(self._post_event(ObjectRef("Node", self.node_name), "GpuUnhealthy", message))
        try:
            holders = await list_container_devices(
                self.pod_resources_socket, timeout_s=POD_RESOURCES_TIMEOUT_S
            )
        except KubeError as exc:
            self.journal.add(ActionRecord("lookup", "failed", detail=str(exc), **fields))
            log.error("cannot find the pods on %s: %s (hint: %s)", fault.target_uuid, exc, exc.hint)
            return
        failed = set(fault.device_ids)
        pods: dict[tuple[str, str], list[str]] = {}
        for c in holders:
            held = [i for i in c.device_ids if i in failed]
            if held:
                pods.setdefault((c.namespace, c.pod), []).extend(held)
        self.journal.add(
            ActionRecord(
                "lookup",
                "done",
                detail=f"{len(pods)} pod(s) hold {len({i for ids in pods.values() for i in ids})} failed device(s)",
                **fields,
            )
        )
        for (namespace, name), ids in pods.items():
            self._spawn(self._evict(fault, namespace, name, tuple(ids)))

    async def _evict(self, fault: Fault, namespace: str, name: str, device_ids: tuple[str, ...]) -> None:
        key = (namespace, name)
        fields: dict[str, Any] = {
            **fault_fields(fault),
            "namespace": namespace,
            "pod": name,
            "dry_run": self.config.dry_run,
        }
        if key in self._in_progress:
            self.journal.add(
                ActionRecord("evict", "skipped", detail="an eviction is already under way", **fields)
            )
            return
        self._in_progress.add(key)
        try:
            await self._evict_once(fault, namespace, name, device_ids, fields)
        finally:
            self._in_progress.discard(key)

    async def _evict_once(
        self, fault: Fault, namespace: str, name: str, device_ids: tuple[str, ...], fields: dict[str, Any]
    ) -> None:
        """Read the pod, evict it (retrying a PodDisruptionBudget's 429 until the deadline), then maybe delete it."""
        deadline = self._clock() + self.config.eviction_deadline_s
        pod = await self._pod_to_evict(namespace, name, deadline, fields)
        if pod is None:
            return
        ref = ObjectRef("Pod", name, namespace, pod.uid)
        devices = ", ".join(device_ids)
        if self.config.dry_run:
            self._event(
                ref, "GpuFaultEviction", f"would evict the pod: {fault.describe()} (devices {devices})"
            )
            self.journal.add(ActionRecord("evict", "dry-run", detail=f"devices {devices}", **fields))
            return
        await self._limiter.acquire()
        self._event(ref, "GpuFaultEviction", f"evicting the pod: {fault.describe()} (devices {devices})")
        overdue = await self._request_eviction(pod, deadline, devices, fields)
        if overdue is not None:
            await self._after_deadline(fault, pod, ref, *overdue, fields)

    async def _pod_to_evict(
        self, namespace: str, name: str, deadline: float, fields: dict[str, Any]
    ) -> PodInfo | None:
        """The pod, unless it is gone, unreadable, terminating or evicted once already (each journaled)."""
        try:
            pod, _ = await self._retry(lambda c: c.get_pod(namespace, name), deadline=deadline)
        except KubeNotFound:
            self.journal.add(ActionRecord("evict", "gone", detail="the pod no longer exists", **fields))
            return None
        except KubeError as exc:
            self.journal.add(ActionRecord("evict", "failed", detail=f"reading the pod: {exc}", **fields))
            return None
        if pod.uid in self._evicted:
            detail = f"pod UID {pod.uid} was evicted once already"
            self.journal.add(ActionRecord("evict", "skipped", detail=detail, **fields))
            return None
        self._evicted.add(pod.uid)
        if pod.deleting:
            self.journal.add(
                ActionRecord("evict", "skipped", detail="the pod is already terminating", **fields)
            )
            return None
        return pod

    async def _request_eviction(
        self, pod: PodInfo, deadline: float, devices: str, fields: dict[str, Any]
    ) -> tuple[int, int] | None:
        """Ask for the eviction until it is accepted, refused or the deadline passes.

        Returns None when it is settled (journaled), (attempts, 429 answers) when the deadline passed.
        """
        cfg = self.config
        backoff = Backoff(cfg.retry_initial_s, cfg.retry_max_s)
        attempts, blocked = 0, 0
        while True:
            attempts += 1
            try:
                await self._call(
                    lambda c: c.evict_pod(
                        pod.namespace, pod.name, uid=pod.uid, grace_period_s=cfg.pod_grace_period_s
                    )
                )
            except (KubeNotFound, KubeConflict):
                detail = "the pod is gone or was replaced"
                self.journal.add(ActionRecord("evict", "gone", attempts=attempts, detail=detail, **fields))
                return None
            except EvictionBlocked as exc:
                blocked += 1
                if blocked == 1:
                    self.journal.add(
                        ActionRecord("evict", "blocked", attempts=attempts, detail=str(exc), **fields)
                    )
                delay = exc.retry_after_s if exc.retry_after_s is not None else backoff.next_delay()
            except KubeError as exc:
                if not is_retryable(exc):
                    self.journal.add(
                        ActionRecord("evict", "failed", attempts=attempts, detail=str(exc), **fields)
                    )
                    return None
                delay = backoff.next_delay()
            else:
                detail = f"devices {devices}"
                self.journal.add(
                    ActionRecord("evict", "requested", attempts=attempts, detail=detail, **fields)
                )
                return None
            left = deadline - self._clock()
            if left <= 0:
                return attempts, blocked
            await asyncio.sleep(min(delay, left))

    async def _after_deadline(
        self, fault: Fault, pod: PodInfo, ref: ObjectRef, attempts: int, blocked: int, fields: dict[str, Any]
    ) -> None:
        """The eviction did not happen in time: give up, or delete the pod when configured to."""
        cfg = self.config
        why = f"not evicted within {cfg.eviction_deadline_s:g} s ({blocked} answer(s) from a PodDisruptionBudget)"
        if not cfg.delete_after_deadline:
            self.journal.add(ActionRecord("evict", "failed", attempts=attempts, detail=why, **fields))
            self._event(ref, "GpuFaultEvictionFailed", f"{why}; the pod keeps running on {fault.describe()}")
            return
        try:
            _, n = await self._retry(
                lambda c: c.delete_pod(
                    pod.namespace, pod.name, uid=pod.uid, grace_period_s=cfg.pod_grace_period_s
                ),
                deadline=self._clock() + cfg.retry_max_s,
            )
        except (KubeNotFound, KubeConflict):
            detail = "the pod is gone or was replaced"
            self.journal.add(ActionRecord("delete", "gone", detail=detail, **fields))
            return
        except KubeError as exc:
            self.journal.add(ActionRecord("delete", "failed", detail=str(exc), **fields))
            return
        self.journal.add(ActionRecord("delete", "done", attempts=n, detail=why, **fields))
        self._event(ref, "GpuFaultDeleted", f"deleted the pod: {why}; {fault.describe()}")


def build_remediator(
    config: RemediationConfig,
    *,
    backend: Backend,
    node_name: str,
    pod_resources_socket: str,
) -> KubeRemediator | BareMetalRemediator | None:
    """The remediator the configuration asks for (None for mode: off)."""
    if config.mode == "kubernetes":
        return KubeRemediator(config, node_name=node_name, pod_resources_socket=pod_resources_socket)
    if config.mode == "baremetal":
        return BareMetalRemediator(config, backend=backend)
    return None
