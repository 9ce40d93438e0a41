"""GPUs the extender handed out that the nodes' annotations do not show yet.

Reservations are kept per pod UID and applied on top of a node's annotation
until it lists the pod or a TTL passes, so two pods placed between two
annotation updates never take the same GPU share. Thread safe; no I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpunode.cluster.extender.nodes import NodeView
from gpunode.errors import InvalidState
from gpunode.placement import NodeState, Request, apply_request


@dataclass(frozen=True)
class Reservation:
    """GPUs handed to one pod on one node, counted until the node's annotation lists the pod."""

    pod_uid: str
    pod_key: str  # namespace/name
    node: str
    gpu_uuids: tuple[str, ...]
    request: Request
    expires_at: float  # monotonic seconds
    final: bool  # made at bind (True) or provisional from prioritize (False)


class Reservations:
    """In-flight GPU hand-outs per pod UID, applied over node annotations until these catch up."""

    def __init__(self, *, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
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
    ) -> Reservation:
        """Record (or move) the pod's reservation; a provisional one never replaces a final one."""
        with self._lock:
            old = self._by_pod.get(pod_uid)
            if old is not None and old.final and not final and old.expires_at > self._clock():
                return old
            self._drop(pod_uid)
            r = Reservation(pod_uid, pod_key, node, gpu_uuids, request, self._clock() + self.ttl_s, final)
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

    def release(self, pod_uid: str) -> None:
        """Forget the pod's reservation, if any."""
        with self._lock:
            self._drop(pod_uid)

    def on_node(self, node: str, *, reflected: frozenset[str] = frozenset()) -> list[Reservation]:
        """Live reservations on the node; drops the expired ones and those the annotation lists (by pod key)."""
        now = self._clock()
        with self._lock:
            live = []
            for r in list(self._by_node.get(node, {}).values()):
                if r.expires_at <= now or r.pod_key in reflected:
                    self._drop(r.pod_uid)
                else:
                    live.append(r)
            return live

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


def apply_reservations(view: NodeView, reservations: Reservations, *, skip_pod: str = "") -> NodeState | None:
    """The node state with its live reservations (except the pod's own) taken out of the free share."""
    if view.state is None:
        return None
    live = [r for r in reservations.on_node(view.name, reflected=view.pods) if r.pod_uid != skip_pod]
    return reserved_state(view.state, live)
