"""Which GPUs and replicas to hand out on one node: interconnect first, then NUMA locality.

Used by the device plugin's GetPreferredAllocation and by placement's choice of
GPUs for multi-GPU requests, so the node and the cluster pick the same set.
Everything here is deterministic: equal inputs give equal answers, and ties go
to the lowest GPU indices. Pure functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations
from math import comb

from gpunode.errors import Unsatisfiable
from gpunode.placement.model import GpuState, NodeState

# Above this many subsets to compare, grow the set greedily instead of enumerating.
_MAX_SUBSETS = 20_000


def _set_key(gpus: Sequence[GpuState]) -> tuple[int, int, int, int, tuple[int, ...]]:
    """Sort key, smaller is better: all-pairs NVLink, NVLink pair count, one NUMA node, NUMA node count, indices."""
    pairs = len(gpus) * (len(gpus) - 1) // 2
    linked = sum(1 for a, b in combinations(gpus, 2) if b.uuid in a.nvlink_peers or a.uuid in b.nvlink_peers)
    numa = {g.numa_node for g in gpus}
    return (
        0 if linked == pairs else 1,
        -linked,
        0 if len(numa) == 1 else 1,
        len(numa),
        tuple(sorted(g.index for g in gpus)),
    )


def _greedy(pool: list[GpuState], fixed: list[GpuState], count: int) -> list[GpuState]:
    chosen = list(fixed)
    rest = [g for g in pool if g not in chosen]
    while len(chosen) < count:
        best = min(rest, key=lambda g: _set_key([*chosen, g]))
        chosen.append(best)
        rest.remove(best)
    return chosen


def preferred_whole_gpus(
    node: NodeState, *, count: int, available: Sequence[str], must_include: Sequence[str] = ()
) -> tuple[str, ...]:
    """`count` GPU UUIDs out of `available` (including all of `must_include`) with the best interconnect.

    Preference: every pair NVLink-connected, then more NVLink pairs, then all on one
    NUMA node, then fewer NUMA nodes, then the lowest indices. UUIDs unknown to the
    node are ignored. Raises Unsatisfiable (a ValueError) when it cannot be done.
    """
    if count < 0:
        raise Unsatisfiable(f"count cannot be negative, got {count}")
    known = {g.uuid: g for g in node.gpus}
    pool = [known[u] for u in dict.fromkeys(available) if u in known]
    missing = [u for u in must_include if u not in known or u not in available]
    if missing:
        raise Unsatisfiable(f"must_include names GPU(s) not available on node {node.name}: {missing}")
    fixed = [known[u] for u in dict.fromkeys(must_include)]
    if len(fixed) > count:
        raise Unsatisfiable(f"must_include names {len(fixed)} GPUs but only {count} are wanted")
    if len(pool) < count:
        raise Unsatisfiable(f"node {node.name}: {count} GPU(s) wanted, {len(pool)} available")
    free = [g for g in pool if g not in fixed]
    need = count - len(fixed)
    if comb(len(free), need) > _MAX_SUBSETS:
        chosen = _greedy(pool, fixed, count)
    else:
        chosen = min(([*fixed, *extra] for extra in combinations(free, need)), key=_set_key)
    return tuple(g.uuid for g in sorted(chosen, key=lambda g: g.index))


def preferred_replicas(
    free_by_gpu: Mapping[str, Sequence[str]],
    *,
    count: int,
    must_include: Sequence[str] = (),
    mode: str = "spread",
) -> tuple[str, ...]:
    """Pick `count` time-sliced replica IDs, including all of `must_include`.

    free_by_gpu maps a GPU UUID to its free replica IDs. spread takes each next
    replica from the GPU with the most free replicas (fewest sharers); pack from the
    GPU with the fewest free replicas left (the most used one), so whole GPUs stay
    free for others. Ties go to the GPU UUID that sorts first; replicas are taken in
    the order given. Raises Unsatisfiable (a ValueError) when it cannot be done.
    """
    if mode not in ("spread", "pack"):
        raise Unsatisfiable(f"mode must be spread or pack, got {mode!r}")
    if count < 0:
        raise Unsatisfiable(f"count cannot be negative, got {count}")
    left = {gpu: [r for r in ids if r not in must_include] for gpu, ids in free_by_gpu.items()}
    known = {r for ids in free_by_gpu.values() for r in ids}
    missing = [r for r in must_include if r not in known]
    if missing:
        raise Unsatisfiable(f"must_include names replicas that are not free: {missing}")
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) > count:
        raise Unsatisfiable(f"must_include names {len(chosen)} replicas but only {count} are wanted")
    if len(chosen) + sum(len(v) for v in left.values()) < count:
        raise Unsatisfiable(f"{count} replica(s) wanted, {len(known)} free")
    while len(chosen) < count:
        candidates = [gpu for gpu in sorted(left) if left[gpu]]
        # max() and min() return the first best item, and candidates are in UUID order.
        if mode == "spread":
            gpu = max(candidates, key=lambda g: len(left[g]))
        else:
            gpu = min(candidates, key=lambda g: len(left[g]))
        chosen.append(left[gpu].pop(0))
    return tuple(chosen)
