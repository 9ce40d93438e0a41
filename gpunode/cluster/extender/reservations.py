"""GPUs the extender handed out that the nodes' annotations do not show yet.

Reservations are kept per pod UID and applied on top of a node's annotation, so
two pods placed between two annotation updates never take the same GPU share.

- A provisional reservation (filter with one node passing, prioritize's best
  node) lasts `ttl_s` (--reservation-ttl): it only steers other pods away until
  the pod's bind decides. Whoever reaches the extender can POST filter bodies for
  pods made up on the spot, so one is made only for a pod that the API server has,
  with the UID and GPU request of the body, pending and not yet bound (PendingPods,
  read through the API and remembered briefly), and each namespace holds at most
  `max_provisional_per_namespace` of them (a newer one replaces its namespace's
  oldest): a tenant's real pods that wait forever cannot hold every GPU either.
- A bound pod's reservation (made at bind, or rebuilt by a new leader) lasts
  until the node's annotation lists the pod, or the pod is gone (deleted,
  finished, bound elsewhere: `gone_reason`, checked through the API by
  kubeapi.check_reservations); `bound_ttl_s` (--bound-reservation-max-age) is
  only a safety bound for a pod that never shows up, and a warning is logged
  when it fires.

The annotation names pods by namespace/name (the kubelet's pod-resources API
gives no UIDs), so an annotation counts as listing the pod only when it is not
the very annotation the reservation was made over: a name still listed for an
earlier pod of that name does not end the new pod's reservation. Thread safe;
no I/O but PendingPods' reads through the function it is given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.cluster.extender.nodes import NodeView
from gpunode.errors import InvalidState, KubeError
from gpunode.placement import NodeState, Request, apply_request

log = logging.getLogger(__name__)
DEFAULT_BOUND_TTL_S = 900.0
DEFAULT_PROVISIONAL_PER_NAMESPACE = 8  # kube-scheduler has a few pods between prioritize and bind at once
PENDING_CACHE_S = 5.0  # how long a pod read for a provisional reservation is taken as read
PENDING_CACHE_PODS = 8192
_FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Reservation:
    """GPUs handed to one pod on one node, counted until the node's annotation lists the pod."""

    pod_uid: str
    pod_key: str  # namespace/name
    node: str
    gpu_uuids: tuple[str, ...]
    request: Request
    expires_at: float  # monotonic seconds
    final: bool  # made at bind (True) or provisional from filter or prioritize (False)
    annotation: str | None = None  # fingerprint of the node annotation it was made over (None: unknown)
    made_at: float = 0.0  # monotonic seconds

    def reflected_by(self, pods: frozenset[str], annotation: str | None) -> bool:
        """Whether an annotation (its pods, its fingerprint) lists this pod, and is not the one reserved over."""
        if self.pod_key not in pods:
            return False
        return annotation is None or self.annotation is None or annotation != self.annotation


class Reservations:
    """In-flight GPU hand-outs per pod UID, applied over node annotations until these catch up."""

    def __init__(
        self,
        *,
        ttl_s: float = 60.0,
        bound_ttl_s: float = DEFAULT_BOUND_TTL_S,
        max_provisional_per_namespace: int = DEFAULT_PROVISIONAL_PER_NAMESPACE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.bound_ttl_s = bound_ttl_s
        self.max_provisional_per_namespace = max_provisional_per_namespace
        self._clock = clock
        self._lock = threading.Lock()
        self._by_pod: dict[str, Reservation] = {}
        self._by_node: dict[str, dict[str, Reservation]] = {}
        self._provisional: dict[str, OrderedDict[str, None]] = {}  # namespace -> pod UIDs, oldest first

    def reserve(
        self,
        *,
        pod_uid: str,
        pod_key: str,
        node: str,
        gpu_uuids: tuple[str, ...],
        request: Request,
        final: bool,
        annotation: str | None = None,
    ) -> Reservation:
        """Record (or move) the pod's reservation; a provisional one never replaces a final one.

        `annotation` is the fingerprint of the node annotation the decision was made over. A provisional
        reservation beyond its namespace's max_provisional_per_namespace ends the namespace's oldest.
        """
        with self._lock:
            now = self._clock()
            old = self._by_pod.get(pod_uid)
            if old is not None and old.final and not final and old.expires_at > now:
                return old
            self._drop(pod_uid)
            ttl = self.bound_ttl_s if final else self.ttl_s
            r = Reservation(pod_uid, pod_key, node, gpu_uuids, request, now + ttl, final, annotation, now)
            self._by_pod[pod_uid] = r
            self._by_node.setdefault(node, {})[pod_uid] = r
            if not final:
                held = self._provisional.setdefault(_namespace(pod_key), OrderedDict())
                held[pod_uid] = None
                while len(held) > self.max_provisional_per_namespace:
                    self._drop(next(iter(held)))
            return r

    def _drop(self, pod_uid: str) -> None:
        old = self._by_pod.pop(pod_uid, None)
        if old is not None:
            per_node = self._by_node.get(old.node, {})
            per_node.pop(pod_uid, None)
            if not per_node:
                self._by_node.pop(old.node, None)
            if not old.final:
                namespace = _namespace(old.pod_key)
                held = self._provisional.get(namespace)
                if held is not None:
                    held.pop(pod_uid, None)
                    if not held:
                        del self._provisional[namespace]

    def release(self, pod_uid: str, *, only: Reservation | None = None) -> bool:
        """Forget the pod's reservation (with `only`: if it is still that one); returns whether one was."""
        with self._lock:
            held = self._by_pod.get(pod_uid)
            if held is None or (only is not None and held is not only):
                return False
            self._drop(pod_uid)
            return True

    def clear(self) -> None:
        """Forget every reservation (a replica that stops leading, or starts to and rebuilds them)."""
        with self._lock:
            self._by_pod.clear()
            self._by_node.clear()
            self._provisional.clear()

    def on_node(
        self, node: str, *, reflected: frozenset[str] = frozenset(), annotation: str | None = None
    ) -> list[Reservation]:
        """Live reservations on the node; drops the expired ones and those the annotation lists.

        `reflected` are the pods (namespace/name) the node's annotation lists, `annotation` its
        fingerprint (see Reservation.reflected_by).
        """
        now = self._clock()
        expired: list[Reservation] = []
        with self._lock:
            live = []
            for r in list(self._by_node.get(node, {}).values()):
                if r.expires_at <= now or r.reflected_by(reflected, annotation):
                    self._drop(r.pod_uid)
                    if r.expires_at <= now and r.final:
                        expired.append(r)
                else:
                    live.append(r)
        for r in expired:
            log.warning(
                "reservation of pod %s on node %s (GPUs %s) dropped after %.0f s: the node's annotation "
                "never listed the pod (bound reservation max age; is the gpunode agent on %s publishing?)",
                r.pod_key,
                r.node,
                ",".join(r.gpu_uuids) or "-",
                now - r.made_at,
                r.node,
            )
        return live

    def final_of(self, pod_uid: str) -> Reservation | None:
        """The pod's unexpired reservation made at bind, if it has one."""
        with self._lock:
            r = self._by_pod.get(pod_uid)
            return r if r is not None and r.final and r.expires_at > self._clock() else None

    def bound(self) -> list[Reservation]:
        """The reservations made at bind (final), for the check that their pods still exist."""
        with self._lock:
            return [r for r in self._by_pod.values() if r.final]

    def get(self, pod_uid: str) -> Reservation | None:
        """The pod's reservation, expired or not; None when it has none."""
        with self._lock:
            return self._by_pod.get(pod_uid)

    def nodes(self) -> frozenset[str]:
        """The nodes that hold reservations now (expired ones included until next looked at)."""
        with self._lock:
            return frozenset(self._by_node)

    def provisional_in(self, namespace: str) -> int:
        """How many provisional reservations the namespace's pods hold (expired ones included)."""
        with self._lock:
            return len(self._provisional.get(namespace, ()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_pod)


def _namespace(pod_key: str) -> str:
    return pod_key.partition("/")[0]


PodRead = Callable[[str, str], Mapping[str, Any] | None]  # (namespace, name) -> v1 Pod, None: not found


def pending_reason(pod: Mapping[str, Any] | None, key: str, uid: str) -> str | None:
    """Why the pod (as the API server has it, None: not found) may not get a provisional reservation for
    the request of UID `uid`, None when it may: it exists with that UID and waits to be scheduled."""
    if pod is None:
        return f"pod {key} does not exist"
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping) or not isinstance(status, Mapping):
        return f"pod {key} has no readable metadata, spec or status"
    if meta.get("uid") != uid:
        return f"pod {key} has UID {meta.get('uid')!r}, not {uid!r}"
    if meta.get("deletionTimestamp"):
        return f"pod {key} is being deleted"
    if spec.get("nodeName"):
        return f"pod {key} is already bound to node {spec.get('nodeName')}"
    if status.get("phase") not in (None, "", "Pending"):
        return f"pod {key} is {status.get('phase')}, not Pending"
    return None


class PendingPods:
    """Pods read through the API for provisional reservations, each remembered for `cache_s` seconds.

    kube-scheduler calls filter and then prioritize for the same pod, and retries a pod that fits nowhere:
    one read serves them all. At most `max_pods` pods are remembered (the oldest go first). After a failed
    read no pod is read for `cache_s` seconds (no reservation meanwhile): an API server that is down costs
    a request one timeout, not each request one. Thread safe.
    """

    def __init__(
        self,
        read: PodRead,
        *,
        cache_s: float = PENDING_CACHE_S,
        max_pods: int = PENDING_CACHE_PODS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.cache_s, self._max_pods, self._clock = cache_s, max_pods, clock
        self._lock = threading.Lock()
        self._pods: OrderedDict[str, tuple[float, Mapping[str, Any] | None]] = OrderedDict()
        self._down_until = 0.0
        self._down_why = ""
        self.reads = 0  # API reads made (for tests and the benchmark)

    def get(self, key: str) -> Mapping[str, Any] | str | None:
        """The pod namespace/name as recently read (None: not found), or why it cannot be read now."""
        now = self._clock()
        with self._lock:
            cached = self._pods.get(key)
            if cached is not None and now - cached[0] < self.cache_s:
                return cached[1]
            if now < self._down_until:
                return self._down_why
        namespace, _, name = key.partition("/")
        try:
            self.reads += 1
            pod = self._read(namespace, name)
        except KubeError as exc:
            why = f"cannot read pods through the API: {exc}"
            with self._lock:
                self._down_until, self._down_why = self._clock() + self.cache_s, why
            log.warning(
                "provisional reservations paused for %.0f s: %s (hint: %s)", self.cache_s, why, exc.hint
            )
            return why
        with self._lock:
            self._pods[key] = (now, pod)
            self._pods.move_to_end(key)
            while len(self._pods) > self._max_pods:
                self._pods.popitem(last=False)
        return pod

    def forget(self, key: str) -> None:
        """Drop what was read of the pod (it was bound, or its reservation refused)."""
        with self._lock:
            self._pods.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pods)


def reserved_state(state: NodeState, live: Iterable[Reservation]) -> NodeState:
    """The node state with these reservations taken out of its free share."""
    for r in live:
        try:
            state = apply_request(state, r.request, r.gpu_uuids)
        except InvalidState:
            # The GPUs no longer have the room: the annotation already counts this pod
            # (without listing it) or the GPUs changed; keep the more conservative state.
            continue
    return state


def live_on(view: NodeView, reservations: Reservations) -> list[Reservation]:
    """The live reservations on the node of `view`, judged against its annotation."""
    return reservations.on_node(view.name, reflected=view.pods, annotation=view.fingerprint)


def apply_reservations(view: NodeView, reservations: Reservations, *, skip_pod: str = "") -> NodeState | None:
    """The node state with its live reservations (except the pod's own) taken out of the free share."""
    if view.state is None:
        return None
    live = [r for r in live_on(view, reservations) if r.pod_uid != skip_pod]
    return reserved_state(view.state, live)


def gone_reason(pod: Mapping[str, Any] | None, r: Reservation) -> str | None:
    """Why a bound pod's reservation can go (the pod as the API server has it, None: not found), else None."""
    if pod is None:
        return "the pod was deleted"
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping) or not isinstance(status, Mapping):
        return None
    uid = meta.get("uid")
    if "/" not in r.pod_uid and isinstance(uid, str) and uid and uid != r.pod_uid:
        return f"the pod was deleted (a pod of that name now has UID {uid})"
    if status.get("phase") in _FINISHED:
        return f"the pod has finished ({status.get('phase')})"
    node = spec.get("nodeName")
    if isinstance(node, str) and node and node != r.node:
        return f"the pod is bound to node {node}"
    return None
