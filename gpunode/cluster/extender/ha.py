"""The extender's high-availability mode: several replicas, one leader elected on a Lease.

Reservations (GPUs promised to pods the nodes' annotations do not show yet) and filter answers
live in one process's memory, so two replicas answering at once could promise one GPU share
twice. With --leader-elect only the replica holding the Lease (gpunode.infra.kube.lease) answers
filter, prioritize and bind; the others answer 503 with Retry-After and close the connection, so
that kube-scheduler retries the pod and its next connection reaches the leader.

Routing: every replica is Ready (the Deployment can roll and a PodDisruptionBudget can count
them); the leader labels its own pod gpunode.io/extender-role=leader, and removes that label from
any other pod of its namespace, and the chart's Service selects that label. A replica that stops
leading, or starts (a restart after a crash), removes the label from its own pod.

Taking over: a new leader starts with no filter answers (a bind for a pod another replica
filtered is refused once; kube-scheduler then retries the pod, and the leader filters it) and
rebuilds its reservations from the API server before it serves: every pod bound to a node, not
finished, asking for GPUs, that the node's annotation does not list yet, is reserved on the GPUs
its gpunode.io/gpu-assigned annotation names (or, without one, on the GPUs the bestfit policy
would pick), held as bind's are: until the annotation lists it or the pod is gone (reservations.py).

A leader writes to the API server (bind) only while no other replica can have taken the Lease
over: a bind starts only with at least MIN_BIND_WINDOW_S of that time left, and is abandoned when
it runs out (LeaderBinder).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from gpunode.cluster.extender.core import Extender
from gpunode.cluster.extender.kubeapi import KubeApi
from gpunode.cluster.extender.pods import pod_key, request_from_pod
from gpunode.cluster.extender.reservations import apply_reservations
from gpunode.contract.names import ASSIGNMENT_ANNOTATION, EXTENDER_ROLE_LABEL
from gpunode.errors import InvalidState, KubeError, NotLeader, PlacementError
from gpunode.infra.kube import ElectionConfig, LeaderElector, LeaseLock
from gpunode.placement import NodeState, Request, apply_request, score_node

log = logging.getLogger(__name__)
LEADER = "leader"
MIN_BIND_WINDOW_S = 2.0
_FINISHED = ("Succeeded", "Failed")


class Leadership:
    """Whether this replica may serve filter, prioritize and bind now: the server's gate; thread safe."""

    def __init__(self, elector: LeaderElector) -> None:
        self.elector = elector
        self._serving = threading.Event()  # set once a new leader has rebuilt its state

    def serve(self, on: bool) -> None:
        """Start (True) or stop (False) answering the verbs."""
        if on:
            self._serving.set()
        else:
            self._serving.clear()

    def refusal(self) -> str | None:
        """None when this replica leads and has rebuilt its state, else why it does not answer."""
        if self._serving.is_set() and self.elector.is_leader():
            return None
        me, leader = self.elector.config.identity, self.elector.leader
        if leader == me:
            return f"this extender replica ({me}) is taking over as leader; retry"
        return (
            f"this extender replica ({me}) is a standby; the leader is {leader or 'not elected yet'}; retry"
        )

    def status(self) -> dict[str, str]:
        """The role and the leader, for /healthz and /readyz."""
        return {"role": LEADER if self.refusal() is None else "standby", "leader": self.elector.leader}

    def seconds_left(self) -> float:
        """How long this replica may still write as leader: until another could have taken over."""
        if not self._serving.is_set():
            return 0.0
        return self.elector.takeover_in()


class LeaderBinder:
    """The Binder of a leading replica: binds through the API only while no other replica can lead."""

    def __init__(self, api: KubeApi, leadership: Leadership) -> None:
        self.api, self.leadership = api, leadership

    def read_pod(self, *, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod as v1 JSON (KubeApi.read_pod)."""
        return self.api.read_pod(namespace=namespace, name=name)

    def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
        """KubeApi.bind, within the time this replica surely leads; NotLeader when too little is left."""
        left = self.leadership.seconds_left()
        if left < MIN_BIND_WINDOW_S:
            raise NotLeader(
                f"this extender replica no longer leads long enough to bind pod {namespace}/{name}"
            )
        self.api.bind(namespace=namespace, name=name, uid=uid, node=node, gpu_uuids=gpu_uuids, timeout_s=left)


def _assigned(pod: Mapping[str, Any], state: NodeState, request: Request) -> tuple[str, ...] | None:
    """The GPUs to reserve for a bound pod: those it records, else bestfit's choice; None: none fit."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    text = annotations.get(ASSIGNMENT_ANNOTATION) if isinstance(annotations, Mapping) else None
    if isinstance(text, str) and text.strip():
        gpus = tuple(g.strip() for g in text.split(",") if g.strip())
        try:
            apply_request(state, request, gpus)
        except InvalidState:
            return None  # no room there: the node's annotation counts the pod already (or the GPUs changed)
        return gpus
    choice = score_node(state, request, policy="bestfit")
    return choice.gpu_uuids if choice is not None else None


def reserve_bound_pods(extender: Extender, pods: Iterable[Mapping[str, Any]]) -> int:
    """Reserve, for every bound, unfinished GPU pod that its node's annotation does not list, its GPUs.

    Returns how many reservations were made. A pod with an unreadable request, on a node without a
    usable annotation, or whose GPUs have no room left is skipped.
    """
    made = 0
    for pod in pods:
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        if not isinstance(spec, Mapping) or not isinstance(status, Mapping):
            continue
        node = spec.get("nodeName")
        if not isinstance(node, str) or not node or status.get("phase") in _FINISHED:
            continue
        try:
            uid, key = pod_key(pod)
            request = request_from_pod(pod, memory_unit_bytes=extender.config.memory_unit_bytes)
        except PlacementError:
            continue
        view = extender.nodes.get(node)
        if request is None or key in view.pods:
            continue
        state = apply_reservations(view, extender.reservations, skip_pod=uid)
        gpus = _assigned(pod, state, request) if state is not None else None
        if gpus is None:
            log.info(
                "takeover: pod %s on node %s: nothing to reserve (%s)", key, node, view.reason or "no room"
            )
            continue
        extender.reservations.reserve(
            pod_uid=uid,
            pod_key=key,
            node=node,
            gpu_uuids=gpus,
            request=request,
            final=True,
            annotation=view.fingerprint,
        )
        made += 1
    return made


class HighAvailability:
    """Leader election for one extender replica: the gate, the takeover and the role label of its pod."""

    def __init__(
        self, extender: Extender, api: KubeApi, config: ElectionConfig, *, pod_name: str = ""
    ) -> None:
        self.extender, self.api, self.config, self.pod_name = extender, api, config, pod_name
        self.elector = LeaderElector(
            LeaseLock(api.client, config.namespace, config.name),
            config,
            on_started=self._lead,
            on_stopped=self._stand_by,
        )
        self.leadership = Leadership(self.elector)
        if extender.binder is not None:
            extender.binder = LeaderBinder(api, self.leadership)
        self._labelling: set[asyncio.Task[None]] = set()

    def _forget(self) -> None:
        self.extender.reservations.clear()
        self.extender.filtered.clear()

    async def _lead(self) -> None:
        """Rebuild (node states, reservations), label the pod, then serve; retried while leading."""
        while True:
            self._forget()
            try:
                self.extender.refresh_nodes(await self.api.list_nodes_async())
                pods = await self.api.list_pods_async(field_selector="spec.nodeName!=")
                made = reserve_bound_pods(self.extender, pods)
                await self._label_leader()
            except KubeError as exc:
                log.warning("takeover: %s (hint: %s); retrying", exc, exc.hint)
                await asyncio.sleep(self.config.retry_period_s)
                continue
            self.leadership.serve(True)
            log.info("takeover: %s serves, with %d reservations rebuilt", self.config.identity, made)
            return

    def _stand_by(self) -> None:
        self.leadership.serve(False)
        self._forget()
        if self.pod_name:
            task = asyncio.get_running_loop().create_task(self._unlabel_self())
            self._labelling.add(task)
            task.add_done_callback(self._labelling.discard)

    async def _label_leader(self) -> None:
        if not self.pod_name:
            return
        ns = self.config.namespace
        await self.api.label_pod_async(namespace=ns, name=self.pod_name, labels={EXTENDER_ROLE_LABEL: LEADER})
        for pod in await self.api.list_pods_async(
            namespace=ns, label_selector=f"{EXTENDER_ROLE_LABEL}={LEADER}"
        ):
            meta = pod.get("metadata") or {}
            labels = meta.get("labels") or {}
            name = meta.get("name")
            if name != self.pod_name and isinstance(name, str) and labels.get(EXTENDER_ROLE_LABEL) == LEADER:
                await self.api.label_pod_async(namespace=ns, name=name, labels={EXTENDER_ROLE_LABEL: None})

    async def _unlabel_self(self) -> None:
        try:
            await self.api.label_pod_async(
                namespace=self.config.namespace, name=self.pod_name, labels={EXTENDER_ROLE_LABEL: None}
            )
        except KubeError as exc:
            log.warning("could not remove the leader label from pod %s: %s", self.pod_name, exc)

    async def run(self) -> None:
        """Campaign and lead until cancelled (then the Lease is released and the label removed)."""
        if self.pod_name:
            await self._unlabel_self()  # a restarted replica starts as a standby
        try:
            await self.elector.run()
        finally:
            self.leadership.serve(False)
            if self.pod_name:
                async with asyncio.timeout(self.api.timeout_s):
                    await self._unlabel_self()
