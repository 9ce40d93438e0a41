"""Placement: pure functions that decide fit, score and the GPUs chosen, for every caller.

The device plugin (preferred allocations), the extender (filter and prioritize)
and the simulator all decide through this package, so the node's choice and the
cluster's choice agree. Nothing here does I/O, talks to Kubernetes, or keeps
state between calls; randomness only comes from an `rng` the caller passes.

Entry points:
- fit:       fits(), unfit_reason(), candidate_gpus(), apply_request()
- score:     score_node(node, request, policy=..., workload=...)
- choose:    place(nodes, request, policy=..., workload=..., rng=...)
- the node:  preferred_whole_gpus(), preferred_fraction_gpu(), preferred_replicas()
- measure:   fragmentation(), TargetWorkload
- many nodes at once: placement.batch.ClusterArrays (numpy; same decisions)
- a published node: placement.published.node_state() (the annotation's records as a NodeState)
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from gpunode.errors import InvalidRequest
from gpunode.placement.fit import (
    allocatable_share,
    apply_request,
    candidate_gpus,
    fits,
    model_matches,
    unfit_reason,
)
from gpunode.placement.frag import NodeCapacity, TargetPod, TargetWorkload, fragmentation, fragmentation_milli
from gpunode.placement.model import (
    MILLI_PER_GPU,
    SHARING_MODES,
    GpuState,
    NodeState,
    Placement,
    Request,
    Sharing,
)
from gpunode.placement.ours import fill_fragmentation, gpunode_choice, gpunode_gpu_score, node_fragmentations
from gpunode.placement.policies import (
    NodeChoice,
    Scorer,
    bestfit_choice,
    dotprod_choice,
    fgd_choice,
    fgd_gpu_score,
    packing_choice,
    random_choice,
    spread_choice,
)
from gpunode.placement.topology import preferred_replicas, preferred_whole_gpus

POLICIES: dict[str, Scorer] = {
    "gpunode": gpunode_choice,
    "fgd": fgd_choice,
    "bestfit": bestfit_choice,
    "packing": packing_choice,
    "spread": spread_choice,
    "dotprod": dotprod_choice,
    "random": random_choice,
}
DEFAULT_POLICY = "gpunode"
NEEDS_WORKLOAD = frozenset({"fgd", "gpunode"})

__all__ = [
    "DEFAULT_POLICY",
    "MILLI_PER_GPU",
    "NEEDS_WORKLOAD",
    "POLICIES",
    "SHARING_MODES",
    "GpuState",
    "NodeCapacity",
    "NodeChoice",
    "NodeState",
    "Placement",
    "Request",
    "Sharing",
    "TargetPod",
    "TargetWorkload",
    "apply_request",
    "candidate_gpus",
    "check_policy",
    "fill_fragmentation",
    "fits",
    "fragmentation",
    "fragmentation_milli",
    "model_matches",
    "place",
    "preferred_fraction_gpu",
    "preferred_replicas",
    "preferred_whole_gpus",
    "score_node",
    "unfit_reason",
]


def check_policy(policy: str) -> Scorer:
    """The scorer of a policy name; InvalidRequest for an unknown name."""
    try:
        return POLICIES[policy]
    except KeyError:
        raise InvalidRequest(
            f"unknown placement policy {policy!r}", hint=f"use one of: {', '.join(POLICIES)}"
        ) from None


def score_node(
    node: NodeState,
    request: Request,
    *,
    policy: str = DEFAULT_POLICY,
    workload: TargetWorkload | None = None,
    rng: random.Random | None = None,
) -> NodeChoice | None:
    """The policy's score and GPU choice for one node; None when the request does not fit it."""
    return check_policy(policy)(node, request, workload, rng)


def place(
    nodes: Sequence[NodeState],
    request: Request,
    *,
    policy: str = DEFAULT_POLICY,
    workload: TargetWorkload | None = None,
    rng: random.Random | None = None,
) -> Placement | None:
    """The best node for the request and the GPUs on it; None when no node fits.

    Among nodes with the best score the choice is uniformly random when an `rng` is
    given (as kube-scheduler does), else the first such node in `nodes` order. The
    random policy scores every node the same, so with an rng it picks uniformly.
    """
    scorer = check_policy(policy)
    best: list[tuple[NodeState, NodeChoice]] = []
    for node in nodes:
        choice = scorer(node, request, workload, rng)
        if choice is None:
            continue
        if not best or choice.score > best[0][1].score:
            best = [(node, choice)]
        elif choice.score == best[0][1].score:
            best.append((node, choice))
    if not best:
        return None
    node, choice = rng.choice(best) if rng is not None else best[0]
    return Placement(node=node.name, gpu_uuids=choice.gpu_uuids, score=choice.score)


def preferred_fraction_gpu(
    node: NodeState,
    request: Request,
    *,
    candidates: Sequence[str],
    policy: str = DEFAULT_POLICY,
    workload: TargetWorkload | None = None,
) -> str | None:
    """Which GPU (UUID) among `candidates` a fractional request should land on; None if none fits.

    The policy's own GPU choice, restricted to `candidates`: the least fragmenting
    GPU for fgd and gpunode (given a workload; without one, the tightest), the
    emptiest for spread, the lowest index for random, else the tightest fitting
    GPU. Ties go to the lowest index.
    """
    if request.kind != "fraction":
        raise InvalidRequest(f"preferred_fraction_gpu takes a fractional request, got a {request.kind} one")
    check_policy(policy)
    allowed = set(candidates)
    gpus = [g for g in candidate_gpus(node, request) if g.uuid in allowed]
    if not gpus or unfit_reason(node, request) is not None:
        return None
    if policy == "fgd" and workload is not None:
        before = fragmentation(node, workload)
        best = max(gpus, key=lambda g: (fgd_gpu_score(node, request, workload, g, before), -g.index))
    elif policy == "gpunode" and workload is not None:
        pair = node_fragmentations(node, workload)
        best = max(gpus, key=lambda g: (gpunode_gpu_score(node, request, workload, g, pair), -g.index))
    elif policy == "spread":
        best = max(gpus, key=lambda g: (allocatable_share(g), -g.index))
    elif policy == "random":
        best = gpus[0]
    else:
        best = min(gpus, key=lambda g: (allocatable_share(g), g.index))
    return best.uuid
