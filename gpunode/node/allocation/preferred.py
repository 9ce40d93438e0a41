"""The agent's device state as the scheduler side sees it.

placement_node() turns a Snapshot into the placement.NodeState the shared
placement functions take, so GetPreferredAllocation on the node decides with
the same code and the same picture of the GPUs as the extender and the
simulator. Pure functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpunode.node.inventory import FRACTIONAL, MIG, TIME_SLICED
from gpunode.node.state import Snapshot
from gpunode.placement import GpuState, NodeState

MILLI = 1000


def placement_node(
    snapshot: Snapshot,
    *,
    name: str = "this-node",
    free_memory_units: Mapping[str, Sequence[str]] | None = None,
    assigned_milli: Mapping[str, int] | None = None,
) -> NodeState:
    """A NodeState over the snapshot's GPUs.

    free_memory_units: for fractional GPUs, GPU UUID -> the memory-unit IDs still free (from the
    kubelet's available list); the free memory and, proportionally, the free compute share follow.
    assigned_milli: compute share already assigned per GPU, when known.
    """
    inv = snapshot.inventory
    gpus: list[GpuState] = []
    for g in inv.gpus:
        mode = inv.mode_of(g.uuid) or "whole"
        total = g.memory_total_bytes
        free = total
        milli = MILLI - (assigned_milli or {}).get(g.uuid, 0)
        if mode == FRACTIONAL and free_memory_units is not None:
            units = [d for d in inv.devices if d.gpu_uuid == g.uuid and d.kind == "memory"]
            unit = units[0].memory_cap_bytes or 0 if units else 0
            free = min(total, len(free_memory_units.get(g.uuid, ())) * unit)
            milli = min(milli, free * MILLI // total) if total else milli
        mig_free: dict[str, int] = {}
        if mode == MIG:
            for m in g.mig_devices:
                mig_free[m.profile] = mig_free.get(m.profile, 0) + 1
        sharing = {FRACTIONAL: "fractional", TIME_SLICED: "time-sliced", MIG: "mig"}.get(mode, "whole")
        gpus.append(
            GpuState(
                uuid=g.uuid,
                index=g.index,
                model=g.model,
                milli_free=max(0, milli),
                memory_total_bytes=total,
                memory_free_bytes=max(0, free),
                numa_node=g.numa_node,
                nvlink_peers=frozenset(p for p in g.nvlink_peers if p != g.uuid),
                healthy=g.uuid not in snapshot.unhealthy,
                mig_free=mig_free,
                sharing=sharing,  # type: ignore[arg-type]
            )
        )
    return NodeState(name=name, gpus=tuple(gpus), cpu_milli_free=0, memory_free_bytes=0)
