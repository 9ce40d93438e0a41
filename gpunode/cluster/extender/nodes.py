"""The extender's cache of node GPU states.

NodeCache holds decoded node GPU states keyed by node name and annotation text,
fed with Node objects (from each request, or from a refresher when
kube-scheduler sends only names). We do not run an informer: kube-scheduler
already sends the nodes, and a refresher function that lists nodes is enough for
the names-only mode; no watch connection, no extra memory per node beyond the
decoded state.

A node whose agent stopped publishing is not trusted forever: with `max_age_s`
(--node-state-max-age), a node whose annotation was published (its `updated`
field) longer ago than that, or whose annotation text this cache has seen
unchanged for longer than that (by the extender's own clock: an annotation
frozen with a future `updated` goes stale too), is answered without a state,
its reason naming the age and the bound, so filter sends it to FailedNodes and
bind refuses it. The agent republishes every nodeState.interval (60 s by
default) even when nothing changed, with a new `updated`. With `max_skew_s`
(--node-state-max-skew), an annotation whose `updated` lies further in the
future than that (a node whose clock runs ahead, or a forged value) fails its
node the same way.

One node's state never fails a request about others: an annotation that does
not decode or that placement cannot use (any error, not only the expected
ones) gives its node a view without a state and the reason.

The cache is bounded: a node not seen (in a request or a refresh) for
`ttl_s` (--node-cache-ttl) is forgotten, and beyond `max_nodes`
(--node-cache-max-nodes) the node seen least recently is; its annotation is
decoded again when it comes back. Thread safe; no I/O.

OnDemandRefresh covers the names-only mode's blind spots: a node created after the
last periodic refresh, and a node the cache first saw before its agent published
(a new node whose agent starts a few seconds after the kubelet: without this it
would fail as "no annotation" until the next periodic refresh). When a request
names nodes the cache does not know, or nodes without an annotation that the
cache first saw less than `young_s` ago, it lists the nodes at once (the I/O is
the lister's), at most once per `min_interval_s`; requests arriving meanwhile
wait for that list and use it. A node that never runs an agent (a CPU node)
costs at most one list a second for its first `young_s`, then nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpunode.cluster.extender.claims import ClaimView
from gpunode.cluster.extender.pods import _ceil, parse_quantity
from gpunode.contract.nodestate import (
    ANNOTATION_KEY,
    MAX_NODE_CPU_MILLI,
    MAX_NODE_MEMORY_BYTES,
    NodeGpuState,
    decode,
)
from gpunode.errors import GpunodeError, InvalidRequest, NodeStateError
from gpunode.placement import NodeCapacity, NodeState
from gpunode.placement.published import node_state

log = logging.getLogger(__name__)
_UNKNOWN_NODE = "node unknown to the extender's cache (no refresh has seen it yet)"
_NO_ANNOTATION = f"no {ANNOTATION_KEY} annotation (is the gpunode agent running there?)"
DEFAULT_MAX_NODES = 8_000  # ~150 MiB of 8-GPU nodes; Kubernetes supports clusters of 5,000
DEFAULT_TTL_S = 3600.0  # a node not seen for this long is forgotten
YOUNG_NODE_S = 120.0  # a node without an annotation this new is listed again on demand (its agent starting)
DEFAULT_MAX_SKEW_S = 65.0  # the agent's default republish interval (60 s) and a few seconds


@dataclass(frozen=True)
class NodeView:
    """A node as the extender sees it: its placement state, or why it has none."""

    name: str
    state: NodeState | None
    reason: str = ""
    annotation: NodeGpuState | None = None
    fingerprint: str = ""  # changes whenever the annotation text changes
    pods: frozenset[str] = frozenset()  # namespace/name of the pods the annotation lists


def _allocatable(node: Mapping[str, Any], key: str, scale: int, most: int) -> int:
    """The node's allocatable `key` in units of 1/scale (0 when absent or unreadable); NodeStateError
    beyond `most`, which no real node has."""
    status = node.get("status") or {}
    alloc = status.get("allocatable") if isinstance(status, Mapping) else None
    if not isinstance(alloc, Mapping) or key not in alloc:
        return 0
    try:
        value = _ceil(parse_quantity(alloc[key], where=f"status.allocatable.{key}") * scale)
    except (InvalidRequest, ArithmeticError, ValueError):
        return 0
    if not 0 <= value <= most:
        raise NodeStateError(f"status.allocatable.{key}: {value} is beyond the {most} a node may have")
    return value


@dataclass
class _Entry:
    """A cached node: its annotation text, its view, when the text last changed and when the node was
    last seen (the cache's clock)."""

    text: str
    view: NodeView
    changed: float
    seen: float
    first: float = 0.0  # when the cache first saw this node (kept while it stays cached)


class NodeCache:
    """Decoded node states by name, reused while a node's annotation text is unchanged (see the module
    docstring for staleness, skew and the bounds)."""

    def __init__(
        self,
        *,
        max_age_s: float | None = None,
        max_skew_s: float | None = DEFAULT_MAX_SKEW_S,
        ttl_s: float | None = DEFAULT_TTL_S,
        max_nodes: int = DEFAULT_MAX_NODES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`max_age_s`: annotations published longer ago than this (by `clock`, unix seconds), or seen
        unchanged for longer, are stale; `max_skew_s`: how far in the future `updated` may lie (None: any);
        `ttl_s`: nodes not seen for this long are forgotten (None: never); `max_nodes`: at most this many
        nodes are kept (the least recently seen go first)."""
        if max_nodes < 1:
            raise ValueError("max_nodes must be at least 1")
        self.max_age_s = max_age_s
        self.max_skew_s = max_skew_s
        self.ttl_s = ttl_s
        self.max_nodes = max_nodes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently seen first
        self._supply: Counter[str] = Counter()  # GPUs per model over the cached views
        self._capacity: dict[str, NodeCapacity] = {}  # what each cached node offers empty (node pressure)
        self.capacity_version = 0  # moves whenever _capacity changes
        self.forgotten = 0  # nodes dropped by the TTL or the node bound, in all
        self.dra: ClaimView | None = None  # what DRA claims hold of `dra` GPUs, when they are watched

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
        now = self._clock()
        with self._lock:
            cached = self._entries.get(name)
            if cached is not None and cached.text == text and text is not None:
                cached.seen = now
                self._entries.move_to_end(name)
                return self._judged(cached, now)
        view = self._decode(name, node, text)
        with self._lock:
            old = self._entries.pop(name, None)
            if old is not None and old.view.state is not None:
                self._supply.subtract(g.model for g in old.view.state.gpus)
            if view.state is not None:
                self._supply.update(g.model for g in view.state.gpus)
            self._set_capacity(name, view.state)
            first = old.first if old is not None else now
            entry = _Entry(text if isinstance(text, str) else "", view, now, now, first)
            self._entries[name] = entry
            self._evict(now)
        return self._judged(entry, now)

    def _evict(self, now: float) -> None:
        """Forget the nodes not seen for ttl_s, and the least recently seen beyond max_nodes (lock held)."""
        entries = self._entries
        while entries:
            name, oldest = next(iter(entries.items()))
            if len(entries) <= self.max_nodes and (self.ttl_s is None or now - oldest.seen <= self.ttl_s):
                return
            self._drop(name)
            self.forgotten += 1

    def _drop(self, name: str) -> None:
        old = self._entries.pop(name, None)
        if old is not None and old.view.state is not None:
            self._supply.subtract(g.model for g in old.view.state.gpus)
        self._set_capacity(name, None)

    def _judged(self, entry: _Entry, now: float) -> NodeView:
        """The view as it may be used now: without a state when its annotation is too old or too new."""
        view = entry.view
        if view.annotation is None or view.state is None:
            return view
        ahead = view.annotation.updated - now
        if self.max_skew_s is not None and ahead > self.max_skew_s:
            reason = (
                f"{ANNOTATION_KEY} annotation published {ahead:.0f} s in the future (updated "
                f"{view.annotation.updated:.0f}), more than the {self.max_skew_s:g} s allowed "
                f"(--node-state-max-skew): is the clock of {view.name} right (NTP)?"
            )
            return replace(view, state=None, reason=reason)
        if self.max_age_s is None:
            return self._with_dra(view)
        age = now - view.annotation.updated
        if age > self.max_age_s:
            reason = (
                f"{ANNOTATION_KEY} annotation published {age:.0f} s ago, more than the {self.max_age_s:g} s "
                f"allowed (--node-state-max-age): is the gpunode agent on {view.name} running and publishing?"
            )
            return replace(view, state=None, reason=reason)
        unchanged = now - entry.changed
        if unchanged > self.max_age_s:
            reason = (
                f"{ANNOTATION_KEY} annotation unchanged for {unchanged:.0f} s as the extender saw it, more "
                f"than the {self.max_age_s:g} s allowed (--node-state-max-age): is the gpunode agent on "
                f"{view.name} running and publishing?"
            )
            return replace(view, state=None, reason=reason)
        return self._with_dra(view)

    def _with_dra(self, view: NodeView) -> NodeView:
        """The view with what DRA claims hold of its `dra` GPUs (ClaimView), when the extender watches them."""
        if self.dra is None or view.state is None:
            return view
        return replace(view, state=self.dra.apply(view.state))

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
            return NodeView(name, None, _NO_ANNOTATION)
        if not isinstance(text, str):
            return NodeView(name, None, f"{ANNOTATION_KEY} annotation is not a string")
        try:
            annotation = decode(text, node=name)
            labels = (node.get("metadata") or {}).get("labels") or {}
            state = node_state(
                annotation,
                cpu_milli_free=_allocatable(node, "cpu", 1000, MAX_NODE_CPU_MILLI),
                memory_free_bytes=_allocatable(node, "memory", 1, MAX_NODE_MEMORY_BYTES),
                labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {},
            )
        except NodeStateError as exc:
            return NodeView(name, None, f"unusable {ANNOTATION_KEY} annotation: {exc}")
        except Exception as exc:  # a defect of ours must fail this node only, never the request
            log.warning("node %s: its %s annotation could not be read: %r", name, ANNOTATION_KEY, exc)
            return NodeView(name, None, f"unusable {ANNOTATION_KEY} annotation: {type(exc).__name__}: {exc}")
        fingerprint = f"{annotation.generation}:{hash(text)}"
        return NodeView(name, state, annotation=annotation, fingerprint=fingerprint, pods=annotation.pods())

    def update(self, nodes: Iterable[object]) -> int:
        """Feed Node objects (a refresher's list); returns how many were taken."""
        return sum(1 for n in nodes if self.view(n).name)

    def get(self, name: str) -> NodeView:
        """The cached view of one node (see get_many)."""
        return self.get_many([name])[0]

    def get_many(self, names: Iterable[str]) -> list[NodeView]:
        """The cached views of these nodes, in order; an unknown name gets a view that says so."""
        names = list(names) if not isinstance(names, list) else names
        now = self._clock()
        with self._lock:
            found: list[_Entry | None] = []
            for n in names:
                entry = self._entries.get(n)
                if entry is not None:
                    entry.seen = now
                    self._entries.move_to_end(n)
                found.append(entry)
            self._evict(now)
        return [
            self._judged(c, now) if c is not None else NodeView(n, None, _UNKNOWN_NODE)
            for n, c in zip(names, found, strict=True)
        ]

    def awaiting_agent(self, names: Iterable[str], young_s: float) -> bool:
        """Whether one of these nodes has no annotation yet and was first seen less than `young_s` ago."""
        now = self._clock()
        with self._lock:
            for n in names:
                entry = self._entries.get(n)
                if entry is not None and entry.view.reason == _NO_ANNOTATION and now - entry.first < young_s:
                    return True
        return False

    def views(self) -> list[NodeView]:
        """Every node view in the cache (stale ones with their state: the node table's rows)."""
        with self._lock:
            return [entry.view for entry in self._entries.values()]

    def forget(self, names: Iterable[str]) -> None:
        """Drop these nodes from the cache (and from the GPU supply and node capacities)."""
        with self._lock:
            for n in names:
                self._drop(n)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Export the cache's size and the nodes it forgot on `registry` (once per registry)."""
        with contextlib.suppress(ValueError):  # already there (a cache shared by two extenders)
            registry.register(_CacheCollector(self))


class _CacheCollector(Collector):
    """gpunode_extender_nodes_cached and gpunode_extender_nodes_forgotten_total, read at scrape time."""

    def __init__(self, cache: NodeCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "gpunode_extender_nodes_cached",
            "Nodes whose GPU state the extender holds (bounded by --node-cache-max-nodes)",
            value=len(self._cache),
        )
        yield CounterMetricFamily(
            "gpunode_extender_nodes_forgotten",
            "Nodes the extender forgot, not seen for --node-cache-ttl or beyond --node-cache-max-nodes",
            value=self._cache.forgotten,
        )


class OnDemandRefresh:
    """Views of named nodes, listing the nodes first when some are unknown (see the module docstring)."""

    def __init__(
        self,
        cache: NodeCache,
        lister: Callable[[], Iterable[object]],
        *,
        min_interval_s: float = 1.0,
        young_s: float = YOUNG_NODE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`lister` returns every Node (it may raise GpunodeError); called from worker threads."""
        self.cache = cache
        self.lister = lister
        self.min_interval_s = min_interval_s
        self.young_s = young_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self.refreshes = 0

    def get_many(self, names: Iterable[str]) -> list[NodeView]:
        """NodeCache.get_many, after one list of the nodes when some names are unknown (rate-limited)."""
        names = list(names)
        views = self.cache.get_many(names)
        if not any(v.state is None and v.reason == _UNKNOWN_NODE for v in views) and not (
            any(v.reason == _NO_ANNOTATION for v in views) and self.cache.awaiting_agent(names, self.young_s)
        ):
            return views
        with self._lock:  # one list at a time; the requests waiting for it read its result
            now = self._clock()
            if self._last is not None and now - self._last < self.min_interval_s:
                return self.cache.get_many(names)
            self._list(now, "unknown nodes or new nodes without an annotation yet")
        return self.cache.get_many(names)

    def get_many_fresh(self, names: Iterable[str]) -> list[NodeView]:
        """The views of these nodes from a list started after this call (one list serves the calls waiting
        for it): for a decision the cache's age may have made wrong (a queued pod admitted onto GPUs
        freed since the last refresh)."""
        names = list(names)
        asked = self._clock()
        with self._lock:
            if self._last is None or self._last < asked:
                self._list(self._clock(), "a queue admission")
        return self.cache.get_many(names)

    def _list(self, now: float, why: str) -> None:
        self._last = now
        try:
            self.cache.update(self.lister())
            self.refreshes += 1
        except GpunodeError as exc:
            log.warning("node refresh for %s failed: %s (hint: %s)", why, exc, exc.hint)
