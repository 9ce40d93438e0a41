"""Placement's view of a published node state, and back.

The agent publishes per GPU what is assigned (gpunode.contract.nodestate);
placement decides on what is free (GpuState, NodeState). These functions turn
one into the other with a single rule, used by the extender for every node it
reads and by the agent for its own GetPreferredAllocation, so both sides
decide on the same picture: free = capacity - assigned (never below zero), a
MIG profile counts its unassigned instances (a profile whose instances are
all held stays listed, with 0), and whether a GPU serves whole-GPU requests
is what the record says (servesWhole). Pure functions; no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from gpunode.contract.names import MILLI_PER_GPU, mig_resource_profile
from gpunode.contract.nodestate import GpuRecord, MigInstance, NodeGpuState
from gpunode.errors import NodeStateError, PlacementError
from gpunode.placement.model import GpuState, NodeState


def gpu_state(record: GpuRecord) -> GpuState:
    """What is free on one published GPU."""
    mig_free: dict[str, int] = {}  # by profile as a pod's resource spells it (1g.10gb.me for 1g.10gb+me)
    for m in record.mig:
        profile = mig_resource_profile(m.profile)
        mig_free[profile] = mig_free.get(profile, 0) + (0 if m.assigned else 1)
    return GpuState(
        uuid=record.uuid,
        index=record.index,
        model=record.model,
        milli_free=max(0, record.milli_capacity - record.milli_assigned),
        memory_total_bytes=record.memory_total_bytes,
        memory_free_bytes=max(0, record.memory_total_bytes - record.memory_assigned_bytes),
        numa_node=record.numa_node,
        nvlink_peers=frozenset(record.nvlink_peers),
        healthy=record.healthy,
        mig_free=mig_free,
        sharing=record.sharing,
        serves_whole=record.serves_whole,
    )


def node_state(
    state: NodeGpuState,
    *,
    cpu_milli_free: int,
    memory_free_bytes: int,
    labels: Mapping[str, str] | None = None,
) -> NodeState:
    """Placement's view of a published node; the CPU and memory given count when it carries none.

    A state that placement cannot use (it contradicts itself) is a NodeStateError naming the node.
    """
    try:
        return NodeState(
            name=state.node,
            gpus=tuple(gpu_state(g) for g in state.gpus),
            cpu_milli_free=state.cpu_milli_free if state.cpu_milli_free is not None else cpu_milli_free,
            memory_free_bytes=(
                state.memory_free_bytes if state.memory_free_bytes is not None else memory_free_bytes
            ),
            labels=labels or {},
        )
    except PlacementError as exc:
        raise NodeStateError(f"node {state.node}: {exc}") from exc


def gpu_record(gpu: GpuState, *, pods: Sequence[str] = ()) -> GpuRecord:
    """A GpuRecord from a GpuState: free turned back into assigned; MIG instances named per free one."""
    mig = tuple(
        MigInstance(profile=profile, uuid=f"{gpu.uuid}/{profile}/{i}", assigned=False)
        for profile, n in sorted(gpu.mig_free.items())
        for i in range(n)
    )
    return GpuRecord(
        uuid=gpu.uuid,
        index=gpu.index,
        model=gpu.model,
        memory_total_bytes=gpu.memory_total_bytes,
        milli_capacity=MILLI_PER_GPU,
        milli_assigned=MILLI_PER_GPU - gpu.milli_free,
        memory_assigned_bytes=gpu.memory_total_bytes - gpu.memory_free_bytes,
        healthy=gpu.healthy,
        sharing=gpu.sharing,
        serves_whole=gpu.serves_whole,
        mig=mig,
        nvlink_peers=tuple(sorted(gpu.nvlink_peers)),
        numa_node=gpu.numa_node,
        pods=tuple(pods),
    )


def published_state(node: NodeState, *, generation: int = 0, updated: float | None = None) -> NodeGpuState:
    """The NodeGpuState that publishes a placement NodeState (for simulations, tests and benchmarks)."""
    return NodeGpuState(
        node=node.name,
        updated=time.time() if updated is None else updated,
        generation=generation,
        gpus=tuple(gpu_record(g) for g in node.gpus),
        cpu_milli_free=node.cpu_milli_free,
        memory_free_bytes=node.memory_free_bytes,
    )
