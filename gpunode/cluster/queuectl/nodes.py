"""The cluster as the queue controller plans on it: the Nodes' published GPU state.

Each Node's gpunode.io/gpu-state annotation (the agent's, decoded by
gpunode.contract.nodestate and turned into placement's view by
gpunode.placement.published.node_state) gives its GPUs. What the controller's own
admitted jobs hold is given back (a GPU whose holders are all queued pods counts as
free: the controller commits those jobs itself, with their plans); what other pods
hold stays taken. CPU and memory are left to kube-scheduler: admission plans GPUs.
A node without the annotation, or with one that does not decode, offers nothing
(reported once per change in `problems`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpunode.contract.names import NODE_STATE_ANNOTATION
from gpunode.contract.nodestate import GpuRecord, MigInstance, decode
from gpunode.errors import GpunodeError
from gpunode.placement.model import NodeState
from gpunode.placement.published import node_state

UNLIMITED_CPU_MILLI = 2**40
UNLIMITED_MEMORY = 2**50


@dataclass(frozen=True)
class ClusterView:
    """The nodes to plan on, a signature that changes when capacity does, and the nodes left out (why)."""

    nodes: tuple[NodeState, ...]
    signature: tuple[object, ...]
    problems: Mapping[str, str]


def _give_back(record: GpuRecord, ours: frozenset[str]) -> GpuRecord:
    if not record.pods or not all(p in ours for p in record.pods):
        return record
    return replace(
        record,
        milli_assigned=0,
        memory_assigned_bytes=0,
        mig=tuple(MigInstance(m.profile, m.uuid, False) for m in record.mig),
        pods=(),
    )


def cluster_view(
    nodes: Iterable[Mapping[str, Any]],
    queued_pods: frozenset[str],
    cache: dict[str, tuple[object, NodeState]] | None = None,
) -> ClusterView:
    """Placement's view of the Nodes (v1 JSON), with the GPUs of queued pods (namespace/name) given back.

    `cache` (the caller's, kept between calls) holds each node's view with what it was made from (the
    annotation's text, the labels, which of its GPUs' holders are queued pods), so that a reconcile decodes
    only the Nodes that changed; it is left holding the nodes of this call only."""
    out: list[NodeState] = []
    problems: dict[str, str] = {}
    seen: dict[str, tuple[object, NodeState]] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        name = str(meta.get("name") or "")
        text = (meta.get("annotations") or {}).get(NODE_STATE_ANNOTATION)
        if not name:
            continue
        if text is None:
            problems[name] = f"node {name} has no {NODE_STATE_ANNOTATION} annotation (no gpunode agent)"
            continue
        labels = meta.get("labels") or {}
        hit = cache.get(name) if cache is not None else None
        if hit is not None and isinstance(hit[0], tuple) and hit[0][0] == text and hit[0][1] == labels:
            ours = frozenset(p for p in hit[0][2] if p in queued_pods)
            if ours == hit[0][3]:
                seen[name] = hit
                out.append(hit[1])
                continue
        try:
            state = decode(text, node=name)
            holders = frozenset(p for g in state.gpus for p in g.pods)
            ours = frozenset(p for p in holders if p in queued_pods)
            state = replace(state, gpus=tuple(_give_back(g, queued_pods) for g in state.gpus))
            view = node_state(
                replace(state, cpu_milli_free=None, memory_free_bytes=None),
                cpu_milli_free=UNLIMITED_CPU_MILLI,
                memory_free_bytes=UNLIMITED_MEMORY,
                labels=labels,
            )
        except GpunodeError as exc:
            problems[name] = str(exc)
            continue
        seen[name] = ((text, dict(labels), holders, ours), view)
        out.append(view)
    if cache is not None:
        cache.clear()
        cache.update(seen)
    out.sort(key=lambda n: n.name)
    signature = tuple(
        (
            n.name,
            tuple(
                (g.uuid, g.healthy, g.milli_free, g.memory_free_bytes, tuple(sorted(g.mig_free.items())))
                for g in n.gpus
            ),
        )
        for n in out
    )
    return ClusterView(nodes=tuple(out), signature=signature, problems=problems)
