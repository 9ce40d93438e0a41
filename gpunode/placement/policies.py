"""Scoring policies: for one node and one request, the score and the GPUs the policy would take.

One function per policy, each `(node, request, workload) -> NodeChoice | None`
(None when the request does not fit). Higher scores are better. The baselines
reproduce the published policies of the FGD paper's simulator, scores included
(integers 0..100, truncated as there), so that the cluster-level reproduction
can be checked against the paper:

- fgd:     100*sigmoid(fragmentation decrease / 1 GPU); the GPU with the best score
- bestfit: 100*(1 - mean of leftover CPU/128 cores and leftover GPU/8 GPUs); tightest GPU
- packing: shared GPUs first, then free GPUs on used nodes, then free nodes; tightest GPU
- dotprod: 100*(1 - <free, request>/2) on (CPU/128 cores, GPU/8 GPUs); tightest GPU
- spread:  the mirror of bestfit (most leftover first); the emptiest GPU
- random:  every fitting node scores the same; a random fitting GPU
- gpunode: ours (see gpunode_choice)

Multi-GPU requests take their GPUs through topology.preferred_whole_gpus and MIG
requests the GPU with the fewest free instances of the profile, under every
policy. Pure functions; randomness only through the `rng` passed in.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from gpunode.errors import InvalidRequest
from gpunode.placement.fit import allocatable_share, apply_request, candidate_gpus, unfit_reason
from gpunode.placement.frag import TargetWorkload, fragmentation
from gpunode.placement.model import MILLI_PER_GPU, GpuState, NodeState, Request
from gpunode.placement.topology import preferred_whole_gpus

MAX_SPEC_CPU_MILLI = 128_000  # the normalisers of bestfit and dotprod in the FGD simulator
MAX_SPEC_GPU_MILLI = 8_000
MAX_SCORE = 100


@dataclass(frozen=True)
class NodeChoice:
    """A policy's view of one node for one request: its score and the GPUs it would take."""

    score: float
    gpu_uuids: tuple[str, ...]


Scorer = Callable[[NodeState, Request, "TargetWorkload | None", "random.Random | None"], "NodeChoice | None"]


def _tightest(gpus: tuple[GpuState, ...]) -> GpuState:
    """The fitting GPU with the least free share; the lowest index on ties."""
    return min(gpus, key=lambda g: (allocatable_share(g), g.index))


def _emptiest(gpus: tuple[GpuState, ...]) -> GpuState:
    return min(gpus, key=lambda g: (-allocatable_share(g), g.index))


def _fewest_mig(gpus: tuple[GpuState, ...], profile: str) -> GpuState:
    return min(gpus, key=lambda g: (g.mig_free.get(profile, 0), g.index))


def _request_milli(request: Request, gpu: GpuState | None) -> int:
    """The total milli-GPU the request takes (its share on `gpu` for a fraction)."""
    kind = request.kind
    if kind == "whole":
        return request.gpus * MILLI_PER_GPU
    if kind == "fraction":
        assert gpu is not None
        return request.share_on(gpu)
    return 0


def default_gpus(node: NodeState, request: Request, candidates: tuple[GpuState, ...]) -> tuple[str, ...]:
    """The GPUs a policy takes by default from the fitting `candidates` (UUIDs; empty for a CPU-only request).

    Whole GPUs by topology.preferred_whole_gpus, a fraction on the tightest GPU, a MIG instance on the GPU
    with the fewest free instances of its profile.
    """
    kind = request.kind
    if kind == "whole":
        return preferred_whole_gpus(node, count=request.gpus, available=[g.uuid for g in candidates])
    if kind == "fraction":
        return (_tightest(candidates).uuid,)
    if kind == "mig":
        assert request.mig_profile is not None
        return (_fewest_mig(candidates, request.mig_profile).uuid,)
    return ()


def _fitting(node: NodeState, request: Request) -> tuple[GpuState, ...] | None:
    if unfit_reason(node, request) is not None:
        return None
    return candidate_gpus(node, request)


def _free_gpu_milli(node: NodeState) -> int:
    return sum(allocatable_share(g) for g in node.gpus)


def _leftover_ratio(node: NodeState, request: Request, gpu: GpuState | None) -> float:
    cpu_left = float(node.cpu_milli_free - request.cpu_milli)
    gpu_left = float(_free_gpu_milli(node) - _request_milli(request, gpu))
    return cpu_left / MAX_SPEC_CPU_MILLI * 0.5 + gpu_left / MAX_SPEC_GPU_MILLI * 0.5


def _clamp_score(value: float) -> int:
    return min(MAX_SCORE, max(0, int(value)))


def mig_score(node: NodeState, request: Request, candidates: tuple[GpuState, ...], pack: bool) -> NodeChoice:
    """Score of a MIG request from the free instances of its profile (capped at 100) on the fitting GPUs.

    pack=True scores 100 - free (fullest node first), else free (emptiest first).
    """
    assert request.mig_profile is not None
    free = sum(g.mig_free.get(request.mig_profile, 0) for g in candidates)
    score = MAX_SCORE - min(free, MAX_SCORE) if pack else min(free, MAX_SCORE)
    return NodeChoice(float(score), default_gpus(node, request, candidates))


def bestfit_choice(
    node: NodeState,
    request: Request,
    workload: TargetWorkload | None = None,
    rng: random.Random | None = None,
) -> NodeChoice | None:
    """The bestfit policy: 100*(1 - leftover ratio) after placing, truncated to 0..100; None if no fit.

    The leftover ratio is the mean of leftover CPU / 128 cores and leftover GPU share / 8 GPUs. A fraction
    takes the tightest GPU; a MIG request packs (mig_score).
    """
    candidates = _fitting(node, request)
    if candidates is None:
        return None
    if request.kind == "mig":
        return mig_score(node, request, candidates, pack=True)
    gpus = default_gpus(node, request, candidates)
    gpu = node.gpu(gpus[0]) if request.kind == "fraction" else None
    return NodeChoice(float(_clamp_score((1.0 - _leftover_ratio(node, request, gpu)) * MAX_SCORE)), gpus)


def spread_choice(
    node: NodeState,
    request: Request,
    workload: TargetWorkload | None = None,
    rng: random.Random | None = None,
) -> NodeChoice | None:
    """The spread policy, bestfit's mirror: 100*leftover ratio, truncated to 0..100; None if it does not fit.

    A fraction takes the emptiest GPU; a MIG request spreads (mig_score with pack=False).
    """
    candidates = _fitting(node, request)
    if candidates is None:
        return None
    if request.kind == "mig":
        return mig_score(node, request, candidates, pack=False)
    if request.kind == "fraction":
        gpu: GpuState | None = _emptiest(candidates)
        assert gpu is not None
        gpus: tuple[str, ...] = (gpu.uuid,)
    else:
        gpu, gpus = None, default_gpus(node, request, candidates)
    return NodeChoice(float(_clamp_score(_leftover_ratio(node, request, gpu) * MAX_SCORE)), gpus)


def dotprod_choice(
    node: NodeState,
    request: Request,
    workload: TargetWorkload | None = None,
    rng: random.Random | None = None,
) -> NodeChoice | None:
    """The dotprod policy: 100*(1 - <free, request>/2), truncated to 0..100; None if it does not fit.

    Both vectors are (CPU / 128 cores, GPU share / 8 GPUs). A fraction takes the tightest GPU; a MIG
    request packs (mig_score).
    """
    candidates = _fitting(node, request)
    if candidates is None:
        return None
    if request.kind == "mig":
        return mig_score(node, request, candidates, pack=True)
    gpus = default_gpus(node, request, candidates)
    gpu = node.gpu(gpus[0]) if request.kind == "fraction" else None
    free = (node.cpu_milli_free / MAX_SPEC_CPU_MILLI, _free_gpu_milli(node) / MAX_SPEC_GPU_MILLI)
    want = (request.cpu_milli / MAX_SPEC_CPU_MILLI, _request_milli(request, gpu) / MAX_SPEC_GPU_MILLI)
    dot = free[0] * want[0] + free[1] * want[1]
    return NodeChoice(float(_clamp_score(MAX_SCORE * (1 - dot / 2))), gpus)


def packing_choice(
    node: NodeState,
    request: Request,
    workload: TargetWorkload | None = None,
    rng: random.Random | None = None,
) -> NodeChoice | None:
    """The packing policy; None if the request does not fit.

    Placing on shared GPUs scores 50..100 (the less free share they have, the higher), on free GPUs of a
    used node 33..49, on an empty node max(33 - n, n) for n free GPUs; a CPU-only request scores 0 and a
    MIG request packs (mig_score).
    """
    candidates = _fitting(node, request)
    if candidates is None:
        return None
    kind = request.kind
    if kind == "mig":
        return mig_score(node, request, candidates, pack=True)
    gpus = default_gpus(node, request, candidates)
    if kind == "cpu":
        return NodeChoice(0.0, gpus)
    shares = [allocatable_share(g) for g in node.gpus if g.sharing in ("whole", "fractional")]
    fully_free = sum(1 for s in shares if s == MILLI_PER_GPU)
    if fully_free == len(shares):
        return NodeChoice(float(max(MAX_SCORE // 3 - fully_free, fully_free)), gpus)
    used = [node.gpu(u) for u in gpus]
    free_used = sum(1 for g in used if allocatable_share(g) == MILLI_PER_GPU)
    if free_used:
        return NodeChoice(float(max(MAX_SCORE // 2 - free_used, MAX_SCORE // 3)), gpus)
    ratio = sum(allocatable_share(g) * 100 // MILLI_PER_GPU for g in used)
    return NodeChoice(float(max(MAX_SCORE - ratio // 10, MAX_SCORE // 2)), gpus)


def random_choice(
    node: NodeState,
    request: Request,
    workload: TargetWorkload | None = None,
    rng: random.Random | None = None,
) -> NodeChoice | None:
    """The random policy: every fitting node scores 0; None if the request does not fit.

    A fraction takes a GPU drawn from `rng` (the tightest GPU without one); other requests the defaults.
    """
    candidates = _fitting(node, request)
    if candidates is None:
        return None
    if request.kind == "fraction" and rng is not None:
        return NodeChoice(0.0, (rng.choice(candidates).uuid,))
    return NodeChoice(0.0, default_gpus(node, request, candidates))


def _need_workload(workload: TargetWorkload | None, policy: str) -> TargetWorkload:
    if workload is None:
        raise InvalidRequest(
            f"the {policy} policy needs a target workload", hint="pass workload=TargetWorkload(...)"
        )
    return workload


def fgd_choice(
    node: NodeState,
    request: Request,
    workload: TargetWorkload | None = None,
    rng: random.Random | None = None,
) -> NodeChoice | None:
    """The FGD policy: the score of the fragmentation decrease (workload.fgd_score); None if it does not fit.

    A fraction takes the GPU with the best score (the lowest index on ties); a MIG request packs
    (mig_score). Raises InvalidRequest when `workload` is None.
    """
    workload = _need_workload(workload, "fgd")
    candidates = _fitting(node, request)
    if candidates is None:
        return None
    kind = request.kind
    if kind == "mig":
        return mig_score(node, request, candidates, pack=True)
    before = fragmentation(node, workload)
    if kind == "fraction":
        best: NodeChoice | None = None
        for gpu in candidates:
            score = fgd_gpu_score(node, request, workload, gpu, before)
            if best is None or score > best.score:
                best = NodeChoice(score, (gpu.uuid,))
        return best
    gpus = default_gpus(node, request, candidates)
    after = fragmentation(apply_request(node, request, gpus), workload)
    return NodeChoice(float(workload.fgd_score(before - after)), gpus)


def fgd_gpu_score(
    node: NodeState, request: Request, workload: TargetWorkload, gpu: GpuState, before: int
) -> float:
    """FGD's score for a fraction placed on `gpu`; `before` is the node's fragmentation now."""
    after = fragmentation(apply_request(node, request, (gpu.uuid,)), workload)
    return float(workload.fgd_score(before - after))
