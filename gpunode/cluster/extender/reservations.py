"""GPUs the extender handed out that the nodes' annotations do not show yet.

Reservations are kept per pod UID and applied on top of a node's annotation, so
two pods placed between two annotation updates never take the same GPU share.

- A provisional reservation (filter with one node passing, prioritize's best
  node) lasts `ttl_s` (--reservation-ttl): it only steers other pods away until
  the pod's bind decides.
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
no I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.cluster.extender.nodes import NodeView
from gpunode.errors import InvalidState
from gpunode.placement import NodeState, Request, apply_request

log = logging.getLogger(__name__)
DEFAULT_BOUND_TTL_S = 900.0
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.bound_ttl_s = bound_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_pod: dict[str, Reservation] = {}
        self._by_node: dict[str, dict[str, Reservation]] = {}

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

        `annotation` is the fingerprint of the node annotation the decision was made over.
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
            return r

    def _drop(self, pod_uid: str) -> None:
        old = self._by_pod.pop(pod_uid, None)
        if old is not None:
            per_node = self._by_node.get(old.node, {})
            per_node.pop(pod_uid, None)
            if not per_node:
                self._by_node.pop(old.node, None)

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

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_pod)


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
