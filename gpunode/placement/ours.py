"""The gpunode policy: FGD's gradient first, then a CPU-aware, fill-based fragmentation to break its ties.

FGD scores a node by how much placing the pod lowers its fragmentation, where a
node's free GPU share is a fragment for a typical pod shape when one more pod
of that shape could not use it. Its score is an integer, floor(100 x sigmoid),
so many nodes tie, and FGD's published numbers rest on the scheduler breaking
those ties by a fixed node order (a first-fit by accident; with the random tie
breaking of a stock kube-scheduler, FGD's unallocated GPU share on the openb
default trace goes from 4.8% to about 10%).

We keep FGD's integer score as the first key and decide its ties by our own
measure instead of by node order:

- Fill fragmentation: for each typical shape, the free share that pods of that
  shape could NOT use if the node were filled with them alone, the number of
  copies being limited by whole free GPUs (or by the share on each GPU, for a
  fraction) AND by free CPU; weighted by how often the shape occurs. FGD's
  one-pod test passes an 8-GPU node with 40 free cores for a 1-GPU, 11-core
  shape; filling shows that 5 of its GPUs would be stranded. On the openb trace
  GPU pods ask ~11 cores per GPU and most nodes have 12, so this is where
  placements lose GPUs.
- The second key is the exact decrease of fill fragmentation (milli-GPU), minus,
  for a fraction, FRACTION_FIT_WEIGHT x the share it leaves free on its GPU
  (pack fractions where they fill a GPU best), minus SCARCITY_WEIGHT x the
  pressure on the GPUs taken x the share taken. Pressure has two parts: the
  model's (a model that pods restricted to it would fill on their own,
  workload.model_pressure) and the node's (the load its kind of node, by model,
  GPU count and CPU, would carry if every shape spread over the kinds of node
  it fits, workload.node_pressure: the few nodes with CPU enough for the
  largest 8-GPU pods carry the most). Pressed models and nodes are kept for the
  pods that need them; pods that can run anywhere go elsewhere first.

The GPU for a fraction is the one with the best (first key, second key); the
lowest index on ties. The node score is the pair folded into one float,
FGD x TIE_SCALE + second key (|second key| stays far below TIE_SCALE).

Pure functions; the numpy form is placement.batch (policy "gpunode").
"""

from __future__ import annotations

import random
from collections import Counter

from gpunode.errors import InvalidRequest
from gpunode.placement.fit import allocatable_share, apply_request, candidate_gpus, unfit_reason
from gpunode.placement.frag import TargetPod, TargetWorkload, fragmentation, serves_target
from gpunode.placement.model import MILLI_PER_GPU, GpuState, NodeState, Request
from gpunode.placement.policies import NodeChoice, default_gpus, mig_score

FRACTION_FIT_WEIGHT = 2.0  # milli-GPU of fill fragmentation worth one milli-GPU left free on the chosen GPU
SCARCITY_WEIGHT = 10.0  # milli-GPU of fill fragmentation worth one milli-GPU taken at model pressure 1
TIE_SCALE = 1e9  # one FGD score step outweighs any second-key difference (those stay within +-1e8)


def _copies_used(node: NodeState, shares: list[int], pod: TargetPod) -> int:
    """The milli-GPU that pods of this shape alone could take on the node."""
    if pod.gpus == 0:
        return 0
    usable = [s for g, s in zip(node.gpus, shares, strict=True) if serves_target(g, pod)]
    if pod.whole:
        copies = sum(1 for s in usable if s >= MILLI_PER_GPU) // pod.gpus
        per_copy = MILLI_PER_GPU * pod.gpus
    else:
        copies = sum(s // pod.gpu_milli for s in usable)
        per_copy = pod.gpu_milli
    if pod.cpu_milli > 0:
        copies = min(copies, node.cpu_milli_free // pod.cpu_milli)
    return copies * per_copy


def fill_fragmentation(node: NodeState, workload: TargetWorkload) -> int:
    """Fill-based fragmentation in scaled units (milli-GPU x weight); see the module docstring."""
    shares = [allocatable_share(g) for g in node.gpus]
    total = sum(shares)
    if total == 0:
        return 0
    return sum(pod.weight * (total - min(total, _copies_used(node, shares, pod))) for pod in workload.pods)


def _fold(
    before: tuple[int, int], after: NodeState, workload: TargetWorkload, *, left: int, scarcity: float
) -> float:
    first = workload.fgd_score(before[0] - fragmentation(after, workload))
    second = (before[1] - fill_fragmentation(after, workload)) / workload.total_weight
    return first * TIE_SCALE + ((second - FRACTION_FIT_WEIGHT * left) - SCARCITY_WEIGHT * scarcity)


def _pressure(workload: TargetWorkload, node: str, gpus: list[GpuState], share: int) -> float:
    """Pressure (model + node) x share taken, summed over the GPUs taken (grouped by model, for exact sums)."""
    per_model = Counter(g.model for g in gpus)
    return sum(workload.pressure(node, m) * n for m, n in per_model.items()) * share


def gpunode_gpu_score(
    node: NodeState, request: Request, workload: TargetWorkload, gpu: GpuState, before: tuple[int, int]
) -> float:
    """Our score for a fraction placed on `gpu`; `before` is the node's (FGD, fill) fragmentation now."""
    after = apply_request(node, request, (gpu.uuid,))
    share = request.share_on(gpu)
    return _fold(
        before,
        after,
        workload,
        left=allocatable_share(gpu) - share,
        scarcity=_pressure(workload, node.name, [gpu], share),
    )


def node_fragmentations(node: NodeState, workload: TargetWorkload) -> tuple[int, int]:
    """(FGD fragmentation, fill fragmentation) of the node, both scaled."""
    return fragmentation(node, workload), fill_fragmentation(node, workload)


def gpunode_choice(
    node: NodeState,
    request: Request,
    workload: TargetWorkload | None = None,
    rng: random.Random | None = None,
) -> NodeChoice | None:
    """Our policy's score and GPUs for one node (None when the request does not fit)."""
    if workload is None:
        raise InvalidRequest(
            "the gpunode policy needs a target workload", hint="pass workload=TargetWorkload(...)"
        )
    if unfit_reason(node, request) is not None:
        return None
    candidates = candidate_gpus(node, request)
    kind = request.kind
    if kind == "mig":
        return mig_score(node, request, candidates, pack=True)
    before = node_fragmentations(node, workload)
    if kind == "fraction":
        best: NodeChoice | None = None
        for gpu in candidates:
            score = gpunode_gpu_score(node, request, workload, gpu, before)
            if best is None or score > best.score:
                best = NodeChoice(score, (gpu.uuid,))
        return best
    gpus = default_gpus(node, request, candidates)
    scarcity = _pressure(workload, node.name, [node.gpu(u) for u in gpus], MILLI_PER_GPU)
    return NodeChoice(
        _fold(before, apply_request(node, request, gpus), workload, left=0, scarcity=scarcity), gpus
    )
