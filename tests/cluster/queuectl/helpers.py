"""Pods, Nodes and queue configurations for the queue controller's tests."""

from __future__ import annotations

from typing import Any

from gpunode.cluster.queueing.config import QueueConfig, parse_queue_config
from gpunode.contract.names import (
    GANG_LABEL,
    GANG_SIZE_LABEL,
    GIB,
    GPU_RESOURCE,
    NODE_STATE_ANNOTATION,
    QUEUE_LABEL,
    Sharing,
)
from gpunode.contract.nodestate import GpuRecord, NodeGpuState, encode

CONFIG_YAML = """
queues:
  - name: team-a
    guarantee: {gpu: 4}
    borrowLimit: {gpu: 4}
  - name: team-b
    guarantee: {gpu: 4}
    borrowLimit: {gpu: 0}
preemption: {notice: 2s, minRuntime: 0s}
"""


def config(text: str = CONFIG_YAML) -> QueueConfig:
    """A parsed queue configuration."""
    import yaml

    return parse_queue_config(yaml.safe_load(text), "test")


def node_annotation(name: str, gpus: int = 8, *, held: dict[int, str] | None = None) -> str:
    """A published gpu-state of `gpus` whole 80 GiB H100s; `held` maps a GPU index to the pod holding it."""
    records = []
    for i in range(gpus):
        pod = (held or {}).get(i)
        records.append(
            GpuRecord(
                uuid=f"GPU-{name}-{i}",
                index=i,
                model="H100",
                memory_total_bytes=80 * GIB,
                milli_assigned=1000 if pod else 0,
                memory_assigned_bytes=80 * GIB if pod else 0,
                sharing=Sharing.WHOLE,
                pods=(pod,) if pod else (),
            )
        )
    return encode(NodeGpuState(node=name, updated=0.0, generation=1, gpus=tuple(records)))


def node(name: str, gpus: int = 8, **kw: Any) -> dict[str, Any]:
    """A v1 Node carrying its published GPU state."""
    return {
        "metadata": {"name": name, "annotations": {NODE_STATE_ANNOTATION: node_annotation(name, gpus, **kw)}}
    }


def pod(
    name: str,
    *,
    queue: str | None = "team-a",
    gpus: int = 1,
    namespace: str = "ml",
    gang: str | None = None,
    size: int = 0,
    priority: int | None = None,
    created: str = "2026-01-01T00:00:00Z",
) -> dict[str, Any]:
    """A pending v1 Pod asking for whole GPUs, in a queue (and a gang)."""
    labels = {}
    if queue:
        labels[QUEUE_LABEL] = queue
    if gang:
        labels[GANG_LABEL] = gang
        labels[GANG_SIZE_LABEL] = str(size)
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "x", "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}]
    }
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "creationTimestamp": created},
        "spec": spec,
        "status": {"phase": "Pending"},
    }
