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


def cluster_view(nodes: Iterable[Mapping[str, Any]], queued_pods: frozenset[str]) -> ClusterView:
    """Placement's view of the Nodes (v1 JSON), with the GPUs of queued pods (namespace/name) given back."""
    out: list[NodeState] = []
    problems: dict[str, str] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        name = str(meta.get("name") or "")
        text = (meta.get("annotations") or {}).get(NODE_STATE_ANNOTATION)
        if not name:
            continue
        if text is None:
            problems[name] = f"node {name} has no {NODE_STATE_ANNOTATION} annotation (no gpunode agent)"
            continue
        try:
            state = decode(text, node=name)
            state = replace(state, gpus=tuple(_give_back(g, queued_pods) for g in state.gpus))
            out.append(
                node_state(
                    replace(state, cpu_milli_free=None, memory_free_bytes=None),
                    cpu_milli_free=UNLIMITED_CPU_MILLI,
                    memory_free_bytes=UNLIMITED_MEMORY,
                    labels=meta.get("labels") or {},
                )
            )
        except GpunodeError as exc:
            problems[name] = str(exc)
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
