"""Sampling the scenario's cluster for over-commitment: nothing over capacity, ever.

Every SAMPLE_S the Sampler reads each node's published GPU state and the GPU assignments of the bound
pods; a GPU whose published assignment exceeds what it holds, or whose pods' assignments do, is a
violation.
"""

from __future__ import annotations

import contextlib
from typing import Any

from gpunode.contract.names import ASSIGNMENT_ANNOTATION, GPU_MEMORY_RESOURCE, NODE_STATE_ANNOTATION
from gpunode.contract.nodestate import decode
from tests.e2e.api import Api
from tests.e2e.procs import Poller

GIB = 2**30
SAMPLE_S = 0.1


def _pod_memory(pod: dict[str, Any]) -> int:
    limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
    return int(limits.get(GPU_MEMORY_RESOURCE, 0)) * GIB


class Sampler(Poller):
    """Every SAMPLE_S: each GPU's published assignment within capacity, and the assignments of the bound
    pods (the extender's decisions) never more than a GPU holds."""

    def __init__(self, api: Api, nodes: list[str], namespace: str) -> None:
        """Sample these nodes and the pods of `namespace` through `api`."""
        super().__init__("sampler")
        self.api = api
        self.namespace = namespace
        self.nodes = set(nodes)
        self.samples = 0
        self.violations: list[str] = []
        self.capacity: dict[
            tuple[str, str], int
        ] = {}  # (node, GPU UUID) -> bytes: sim UUIDs repeat across nodes

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with contextlib.suppress(OSError):
                self.sample()

    def sample(self) -> None:
        """One sample of every node and pod."""
        for node in self.api.get("/api/v1/nodes")["items"]:
            name = node["metadata"]["name"]
            text = node["metadata"].get("annotations", {}).get(NODE_STATE_ANNOTATION)
            if name not in self.nodes or not text:
                continue
            for gpu in decode(text, node=name).gpus:
                self.capacity[(name, gpu.uuid)] = gpu.memory_total_bytes
                if (
                    gpu.memory_assigned_bytes > gpu.memory_total_bytes
                    or gpu.milli_assigned > gpu.milli_capacity
                ):
                    self.violations.append(
                        f"{name} {gpu.uuid}: published {gpu.memory_assigned_bytes} of {gpu.memory_total_bytes} "
                        f"bytes, {gpu.milli_assigned} of {gpu.milli_capacity} milli"
                    )
        held: dict[tuple[str, str], list[tuple[str, int]]] = {}
        for pod in self.api.get(f"/api/v1/namespaces/{self.namespace}/pods")["items"]:
            assigned = pod["metadata"].get("annotations", {}).get(ASSIGNMENT_ANNOTATION)
            if not assigned or not pod["spec"].get("nodeName"):
                continue
            gpus = assigned.split(",")
            memory = _pod_memory(pod)
            limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
            if any(r.startswith("nvidia.com/mig-") for r in limits):
                continue  # a MIG instance: the published state above counts what each instance holds
            for uuid in gpus:
                # A fraction holds its memory; a whole GPU or a MIG instance all of it.
                held.setdefault((pod["spec"]["nodeName"], uuid), []).append(
                    (pod["metadata"]["name"], memory or -1)
                )
        for uuid, holders in held.items():
            total = self.capacity.get(uuid)
            whole = [h for h in holders if h[1] < 0]
            used = sum(m for _, m in holders if m > 0)
            if (whole and len(holders) > 1) or (total is not None and used > total):
                self.violations.append(f"{uuid}: assigned to {holders} (capacity {total} bytes)")
        self.samples += 1
