"""What the extender knows between requests: pods' GPU requests, node states, reservations, the workload.

- request_from_pod(): a v1.Pod (JSON) to a placement Request, from its containers'
  resources (nvidia.com/gpu, gpunode.io/gpu-memory in units of a configured size,
  nvidia.com/mig-<profile>, cpu, memory) and the annotations gpunode.io/gpu-milli
  (compute share) and gpunode.io/gpu-model (accepted models, `|`-separated; the
  node selector key of the same name works too).
- NodeCache: decoded node GPU states keyed by node name and annotation text, fed
  with Node objects (from each request, or from a refresher when kube-scheduler
  sends only names). We do not run an informer: kube-scheduler already sends the
  nodes, and a refresher function that lists nodes is enough for the names-only
  mode; no watch connection, no extra memory per node beyond the decoded state.
- Reservations: GPUs the extender handed out that the node's annotation does not
  show yet (per pod UID), applied on top of the annotation until it lists the pod
  or a TTL passes, so two pods placed between two annotation updates never take
  the same GPU share.
- WorkloadTracker: the target workload for fgd/gpunode, learned from the pods
  seen (the most frequent request shapes), or fixed from a trace.
(extender_table.NodeTable keeps the known nodes in placement's batch form.)

Thread safe; no I/O.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from gpunode.contract.nodestate import ANNOTATION_KEY, NodeGpuState, NodeStateError, decode
from gpunode.placement import (
    MILLI_PER_GPU,
    InvalidRequest,
    InvalidState,
    NodeCapacity,
    NodeState,
    Request,
    TargetPod,
    TargetWorkload,
    apply_request,
)
from gpunode.placement.frag import shapes_with_counts

RESOURCE_GPU = "nvidia.com/gpu"
RESOURCE_GPU_MEMORY = "gpunode.io/gpu-memory"
MIG_PREFIX = "nvidia.com/mig-"
ANNOTATION_GPU_MILLI = "gpunode.io/gpu-milli"
ANNOTATION_GPU_MODEL = "gpunode.io/gpu-model"
GIB = 2**30
_UNKNOWN_NODE = "node unknown to the extender's cache (no refresh has seen it yet)"

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+))?([a-zA-Z]*)$")
_SUFFIXES = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}


def parse_quantity(value: object, *, where: str) -> Decimal:
    """A Kubernetes resource quantity ("500m", "2", "1.5Gi", "1e3") as a Decimal."""
    if isinstance(value, bool):
        raise InvalidRequest(f"{where}: expected a quantity, got {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}: expected a quantity, got {value!r}")
    m = _QUANTITY.match(value.strip())
    if not m or m.group(3) not in _SUFFIXES or (m.group(2) and m.group(3)):
        raise InvalidRequest(f"{where}: {value!r} is not a resource quantity (e.g. 500m, 2, 16Gi)")
    try:
        number = Decimal(m.group(1)) * (Decimal(10) ** int(m.group(2) or 0)) * _SUFFIXES[m.group(3)]
    except InvalidOperation:
        raise InvalidRequest(f"{where}: {value!r} is not a resource quantity") from None
    if number < 0:
        raise InvalidRequest(f"{where}: a resource quantity cannot be negative, got {value!r}")
    return number


def _ceil(d: Decimal) -> int:
    return int(d.to_integral_value(rounding="ROUND_CEILING"))


def _container_resources(container: object, where: str) -> dict[str, Decimal]:
    """limits where given, else requests (extended resources must have limits == requests)."""
    if not isinstance(container, Mapping):
        raise InvalidRequest(f"{where}: expected an object")
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise InvalidRequest(f"{where}.resources: expected an object")
    out: dict[str, Decimal] = {}
    for section in ("requests", "limits"):
        values = resources.get(section) or {}
        if not isinstance(values, Mapping):
            raise InvalidRequest(f"{where}.resources.{section}: expected an object")
        for name, qty in values.items():
            out[str(name)] = parse_quantity(qty, where=f"{where}.resources.{section}.{name}")
    return out


def _pod_totals(spec: Mapping[str, Any]) -> dict[str, Decimal]:
    """Effective pod resources: the larger of the containers' sum and any single init container."""
    total: dict[str, Decimal] = {}
    containers = spec.get("containers") or []
    if not isinstance(containers, list):
        raise InvalidRequest("spec.containers: expected a list")
    for i, c in enumerate(containers):
        for k, v in _container_resources(c, f"spec.containers[{i}]").items():
            total[k] = total.get(k, Decimal(0)) + v
    inits = spec.get("initContainers") or []
    if not isinstance(inits, list):
        raise InvalidRequest("spec.initContainers: expected a list")
    for i, c in enumerate(inits):
        for k, v in _container_resources(c, f"spec.initContainers[{i}]").items():
            total[k] = max(total.get(k, Decimal(0)), v)
    return total


def pod_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    """(uid, "namespace/name") of a v1.Pod."""
    meta = pod.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise InvalidRequest("Pod.metadata: expected an object")
    name, namespace = meta.get("name"), meta.get("namespace") or "default"
    if not isinstance(name, str) or not name:
        raise InvalidRequest("Pod.metadata.name: required")
    uid = meta.get("uid")
    key = f"{namespace}/{name}"
    return (uid if isinstance(uid, str) and uid else key), key


def request_from_pod(pod: Mapping[str, Any], *, memory_unit_bytes: int = GIB) -> Request | None:
    """The pod's GPU request, or None when it asks for none of our GPU resources."""
    if not isinstance(pod, Mapping):
        raise InvalidRequest("Pod: expected an object")
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    if not isinstance(spec, Mapping) or not isinstance(meta, Mapping):
        raise InvalidRequest("Pod.spec and Pod.metadata must be objects")
    totals = _pod_totals(spec)
    annotations = meta.get("annotations") or {}
    selector = spec.get("nodeSelector") or {}
    if not isinstance(annotations, Mapping) or not isinstance(selector, Mapping):
        raise InvalidRequest("Pod.metadata.annotations and Pod.spec.nodeSelector must be objects")
    gpus = _ceil(totals.get(RESOURCE_GPU, Decimal(0)))
    memory_units = totals.get(RESOURCE_GPU_MEMORY, Decimal(0))
    mig = {k[len(MIG_PREFIX) :]: v for k, v in totals.items() if k.startswith(MIG_PREFIX) and v > 0}
    milli_text = annotations.get(ANNOTATION_GPU_MILLI)
    milli = 0
    if milli_text is not None:
        try:
            milli = int(str(milli_text))
        except ValueError:
            raise InvalidRequest(
                f"annotation {ANNOTATION_GPU_MILLI}: expected 1..999, got {milli_text!r}"
            ) from None
        if not 0 < milli < MILLI_PER_GPU:
            raise InvalidRequest(f"annotation {ANNOTATION_GPU_MILLI}: expected 1..999, got {milli}")
    if not gpus and not memory_units and not mig and not milli:
        return None
    if len(mig) > 1 or any(v != 1 for v in mig.values()):
        raise InvalidRequest(
            "a pod can ask for one MIG instance of one profile (nvidia.com/mig-<profile>: 1)"
        )
    models_text = annotations.get(ANNOTATION_GPU_MODEL) or selector.get(ANNOTATION_GPU_MODEL)
    models = frozenset(m.strip() for m in str(models_text).split("|") if m.strip()) if models_text else None
    return Request(
        gpus=gpus,
        gpu_milli=milli,
        gpu_memory_bytes=_ceil(memory_units * memory_unit_bytes),
        mig_profile=next(iter(mig)) if mig else None,
        gpu_models=models or None,
        cpu_milli=_ceil(totals.get("cpu", Decimal(0)) * 1000),
        memory_bytes=_ceil(totals.get("memory", Decimal(0))),
    )


@dataclass(frozen=True)
class NodeView:
    """A node as the extender sees it: its placement state, or why it has none."""

    name: str
    state: NodeState | None
    reason: str = ""
    annotation: NodeGpuState | None = None
    fingerprint: str = ""  # changes whenever the annotation text changes
    pods: frozenset[str] = frozenset()  # namespace/name of the pods the annotation lists


def _allocatable(node: Mapping[str, Any], key: str, scale: int) -> int:
    status = node.get("status") or {}
    alloc = status.get("allocatable") if isinstance(status, Mapping) else None
    if not isinstance(alloc, Mapping) or key not in alloc:
        return 0
    try:
        return _ceil(parse_quantity(alloc[key], where=f"status.allocatable.{key}") * scale)
    except InvalidRequest:
        return 0


class NodeCache:
    """Decoded node states by name, reused while a node's annotation text is unchanged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: dict[str, tuple[str, NodeView]] = {}
        self._supply: Counter[str] = Counter()  # GPUs per model over the cached views
        self._capacity: dict[str, NodeCapacity] = {}  # what each cached node offers empty (node pressure)
        self.capacity_version = 0  # moves whenever _capacity changes

    def view(self, node: object) -> NodeView:
        """Decode (or reuse) one v1.Node; never raises for a bad node, the reason says what is wrong."""
        if not isinstance(node, Mapping):
            return NodeView(name="", state=None, reason="not a Node object")
        meta = node.get("metadata") or {}
        name = meta.get("name") if isinstance(meta, Mapping) else None
        if not isinstance(name, str) or not name:
            return NodeView(name="", state=None, reason="Node without metadata.name")
        annotations = meta.get("annotations") or {}
        text = annotations.get(ANNOTATION_KEY) if isinstance(annotations, Mapping) else None
        with self._lock:
            cached = self._views.get(name)
        if cached is not None and cached[0] == text and text is not None:
            return cached[1]
        view = self._decode(name, node, text)
        with self._lock:
            old = self._views.get(name)
            if old is not None and old[1].state is not None:
                self._supply.subtract(g.model for g in old[1].state.gpus)
            if view.state is not None:
                self._supply.update(g.model for g in view.state.gpus)
            self._set_capacity(name, view.state)
            self._views[name] = (text or "", view)
        return view

    def _set_capacity(self, name: str, state: NodeState | None) -> None:
        """Record what the node offers empty (one GPU model per node; others get no node pressure)."""
        models = {g.model for g in state.gpus} if state is not None else set()
        capacity = (
            NodeCapacity(name, models.pop(), len(state.gpus), state.cpu_milli_free)
            if state is not None and len(models) == 1
            else None
        )
        if self._capacity.get(name) != capacity:
            if capacity is None:
                del self._capacity[name]
            else:
                self._capacity[name] = capacity
            self.capacity_version += 1

    def node_capacities(self) -> tuple[int, tuple[NodeCapacity, ...]]:
        """(capacity_version, what each cached node with one GPU model offers when empty)."""
        with self._lock:
            return self.capacity_version, tuple(self._capacity.values())

    def gpu_supply(self) -> dict[str, int]:
        """GPUs per model on the cached nodes."""
        with self._lock:
            return {m: n for m, n in self._supply.items() if n > 0}

    def _decode(self, name: str, node: Mapping[str, Any], text: object) -> NodeView:
        if text is None:
            return NodeView(
                name, None, f"no {ANNOTATION_KEY} annotation (is the gpunode agent running there?)"
            )
        if not isinstance(text, str):
            return NodeView(name, None, f"{ANNOTATION_KEY} annotation is not a string")
        try:
            annotation = decode(text, node=name)
            labels = (node.get("metadata") or {}).get("labels") or {}
            state = annotation.to_node_state(
                cpu_milli_free=_allocatable(node, "cpu", 1000),
                memory_free_bytes=_allocatable(node, "memory", 1),
                labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {},
            )
        except NodeStateError as exc:
            return NodeView(name, None, f"unusable {ANNOTATION_KEY} annotation: {exc.message}")
        fingerprint = f"{annotation.generation}:{hash(text)}"
        return NodeView(name, state, annotation=annotation, fingerprint=fingerprint, pods=annotation.pods())

    def update(self, nodes: Iterable[object]) -> int:
        """Feed Node objects (a refresher's list); returns how many were taken."""
        return sum(1 for n in nodes if self.view(n).name)

    def get(self, name: str) -> NodeView:
        return self.get_many([name])[0]

    def get_many(self, names: Iterable[str]) -> list[NodeView]:
        """The cached views of these nodes, in order; an unknown name gets a view that says so."""
        with self._lock:
            found = [self._views.get(n) for n in names]
        names = list(names) if not isinstance(names, list) else names
        return [
            c[1] if c is not None else NodeView(n, None, _UNKNOWN_NODE)
            for n, c in zip(names, found, strict=True)
        ]

    def views(self) -> list[NodeView]:
        """Every node view in the cache."""
        with self._lock:
            return [view for _, view in self._views.values()]

    def forget(self, names: Iterable[str]) -> None:
        with self._lock:
            for n in names:
                old = self._views.pop(n, None)
                if old is not None and old[1].state is not None:
                    self._supply.subtract(g.model for g in old[1].state.gpus)
                self._set_capacity(n, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._views)


@dataclass(frozen=True)
class Reservation:
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


class WorkloadTracker:
    """The target workload: a fixed one (from a trace), or learned from the pods seen.

    Learning keeps the request shapes of the last `window` pods and, every
    REFRESH_EVERY pods, takes the most frequent shapes covering `popularity` of
    them, weighted in per-mille of the window. The version (part of every cached
    score's key) only moves when that result changes, so a steady workload does
    not invalidate the extender's caches.
    """

    REFRESH_EVERY = 500

    def __init__(
        self,
        *,
        window: int = 10_000,
        popularity: float = 0.95,
        seed: TargetWorkload | None = None,
        learn: bool | None = None,
        memory_reference_bytes: int = 80 * GIB,
    ) -> None:
        self._lock = threading.Lock()
        self._recent: deque[tuple[int, int, int, frozenset[str] | None]] = deque(maxlen=window)
        self._popularity = popularity
        self._cached: TargetWorkload | None = seed
        self._demand: tuple[TargetPod, ...] | None = None
        self._learn = seed is None if learn is None else learn
        self._unseen = 0
        self.memory_reference_bytes = memory_reference_bytes
        self.version = 0

    def shape(self, request: Request) -> tuple[int, int, int, frozenset[str] | None] | None:
        """(CPU, milli-GPU per GPU, GPUs, models); a request by memory counts as its share of the reference GPU."""
        kind = request.kind
        if kind == "whole":
            return (request.cpu_milli, MILLI_PER_GPU, request.gpus, request.gpu_models)
        if kind == "fraction":
            by_memory = -(-request.gpu_memory_bytes * MILLI_PER_GPU // max(self.memory_reference_bytes, 1))
            share = min(MILLI_PER_GPU - 1, max(request.gpu_milli, by_memory, 1))
            return (request.cpu_milli, share, 1, request.gpu_models)
        if kind == "cpu":
            return (request.cpu_milli, 0, 0, None)
        return None

    def observe(self, request: Request) -> None:
        shape = self.shape(request)
        if shape is None or not self._learn:
            return
        with self._lock:
            self._recent.append(shape)
            self._unseen += 1

    def _learned(self) -> TargetWorkload | None:
        counts = Counter(self._recent)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][:3]))
        chosen, covered, total = [], 0, len(self._recent)
        for (cpu, milli, gpus, models), n in ranked:
            if covered >= self._popularity * total:
                break
            weight = max(1, round(1000 * n / total))
            chosen.append(
                TargetPod(cpu_milli=cpu, gpu_milli=milli, gpus=gpus, gpu_models=models, weight=weight)
            )
            covered += n
        return TargetWorkload(tuple(chosen)) if chosen else None

    def _learned_demand(self) -> tuple[TargetPod, ...]:
        """Every shape of the window with its count (node pressure spreads this demand)."""
        return shapes_with_counts(Counter(self._recent))

    def workload(self) -> TargetWorkload | None:
        """The workload to score against; None when nothing was seen and none was given."""
        with self._lock:
            if self._learn and self._unseen and (self._cached is None or self._unseen >= self.REFRESH_EVERY):
                learned = self._learned()
                demand = self._learned_demand() or None
                self._unseen = 0
                if learned is not None and (learned, demand) != (self._cached, self._demand):
                    self._cached, self._demand = learned, demand
                    self.version += 1
            return self._cached

    def demand(self) -> tuple[TargetPod, ...] | None:
        """All the shapes seen with their counts; None (use the typical pods) when not learning."""
        with self._lock:
            return self._demand
