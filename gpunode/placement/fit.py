"""Fit: whether a request can run on a node, on which GPUs, and what the node looks like after.

The rules, one place for all callers:
- a whole-GPU request takes healthy GPUs with nothing handed out: `whole` ones,
  and `fractional` ones whose node also offers them whole (GpuState.serves_whole;
  the agent's published record says it per GPU);
- a fraction takes one healthy GPU in `fractional` mode with enough free compute
  share and, when asked by memory, enough free memory;
- a MIG request takes one free instance of its profile on a healthy `mig` GPU;
- `time-sliced` GPUs serve replicas that kube-scheduler counts itself, so no
  request here lands on them;
- gpu_models, when given, must name the GPU's model (case-insensitive, either
  the whole model name or one of its words: "A100" matches "NVIDIA A100-SXM4-80GB");
- CPU and memory must fit the node's free CPU and memory.
Pure functions; no policy, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from gpunode.errors import InvalidState
from gpunode.placement.model import MILLI_PER_GPU, GpuState, NodeState, Request


@lru_cache(maxsize=1024)
def _model_words(model: str) -> frozenset[str]:
    return frozenset(w for w in re.split(r"[^0-9a-z]+", model.lower()) if w) | {model.lower()}


def model_matches(model: str, wanted: frozenset[str] | None) -> bool:
    """Whether a GPU model satisfies a model constraint (None accepts any model)."""
    if wanted is None:
        return True
    words = _model_words(model)
    return any(w.lower() in words for w in wanted)


def takes_whole(gpu: GpuState) -> bool:
    """Whole-GPU requests may land on the GPU, by its health and sharing mode (what is free aside).

    `whole` GPUs, and `fractional` ones that their node also offers whole (serves_whole).
    """
    if not gpu.healthy:
        return False
    return gpu.sharing == "whole" or (gpu.sharing == "fractional" and gpu.serves_whole)


def serves_whole(gpu: GpuState, models: frozenset[str] | None = None) -> bool:
    """The GPU can be handed out whole right now."""
    return takes_whole(gpu) and gpu.fully_free and model_matches(gpu.model, models)


def _shared_only(node: NodeState, request: Request) -> int:
    """Fully free fractional GPUs of the node that whole requests may not take (not offered whole)."""
    return sum(
        1
        for g in node.gpus
        if g.healthy
        and g.sharing == "fractional"
        and not g.serves_whole
        and g.fully_free
        and model_matches(g.model, request.gpu_models)
    )


def fits_fraction(gpu: GpuState, request: Request) -> bool:
    """The fractional request fits on this GPU right now."""
    if not (gpu.healthy and gpu.sharing == "fractional" and model_matches(gpu.model, request.gpu_models)):
        return False
    if gpu.milli_free < request.gpu_milli:
        return False
    if request.gpu_memory_bytes:
        return gpu.memory_total_bytes > 0 and gpu.memory_free_bytes >= request.gpu_memory_bytes
    return True


def fits_mig(gpu: GpuState, request: Request) -> bool:
    """The MIG request fits this GPU right now: a free instance of its profile on a healthy `mig` GPU."""
    if request.mig_profile is None:
        return False
    return (
        gpu.healthy
        and gpu.sharing == "mig"
        and gpu.mig_free.get(request.mig_profile, 0) > 0
        and model_matches(gpu.model, request.gpu_models)
    )


def candidate_gpus(node: NodeState, request: Request) -> tuple[GpuState, ...]:
    """The GPUs of the node that could take (one unit of) the request, in index order."""
    kind = request.kind
    if kind == "whole":
        return tuple(g for g in node.gpus if serves_whole(g, request.gpu_models))
    if kind == "fraction":
        return tuple(g for g in node.gpus if fits_fraction(g, request))
    if kind == "mig":
        return tuple(g for g in node.gpus if fits_mig(g, request))
    return ()


def unfit_reason(node: NodeState, request: Request) -> str | None:
    """None when the request fits the node, else a short reason for FailedNodes."""
    if node.cpu_milli_free < request.cpu_milli:
        return f"insufficient CPU: {node.cpu_milli_free}m free, {request.cpu_milli}m requested"
    if node.memory_free_bytes < request.memory_bytes:
        return f"insufficient memory: {node.memory_free_bytes} bytes free, {request.memory_bytes} requested"
    kind = request.kind
    if kind == "cpu":
        return None
    if request.gpu_models is not None and not any(
        model_matches(g.model, request.gpu_models) for g in node.gpus
    ):
        return f"no GPU of model {'|'.join(sorted(request.gpu_models))}"
    found = candidate_gpus(node, request)
    if kind == "whole" and len(found) < request.gpus:
        shared = _shared_only(node, request)
        why = f"; {shared} more free but shared by memory only (not offered whole)" if shared else ""
        return f"insufficient whole GPUs: {len(found)} free, {request.gpus} requested{why}"
    if kind == "fraction" and not found:
        want = []
        if request.gpu_milli:
            want.append(f"{request.gpu_milli} milli-GPU")
        if request.gpu_memory_bytes:
            want.append(f"{request.gpu_memory_bytes} bytes of GPU memory")
        return f"no GPU with {' and '.join(want)} free"
    if kind == "mig" and not found:
        return f"no free MIG instance of profile {request.mig_profile}"
    return None


def fits(node: NodeState, request: Request) -> bool:
    """Whether the request fits the node (unfit_reason gives why not)."""
    return unfit_reason(node, request) is None


def apply_request(node: NodeState, request: Request, gpu_uuids: Sequence[str]) -> NodeState:
    """The node after placing `request` on the named GPUs; raises InvalidState if it does not fit them."""
    kind = request.kind
    wanted = {"cpu": 0, "whole": request.gpus, "fraction": 1, "mig": 1}[kind]
    if len(gpu_uuids) != wanted or len(set(gpu_uuids)) != wanted:
        raise InvalidState(f"a {kind} request takes {wanted} distinct GPU(s), got {list(gpu_uuids)}")
    if node.cpu_milli_free < request.cpu_milli or node.memory_free_bytes < request.memory_bytes:
        raise InvalidState(f"node {node.name}: the request's CPU or memory does not fit")
    chosen = set(gpu_uuids)
    new_gpus = []
    for gpu in node.gpus:
        if gpu.uuid not in chosen:
            new_gpus.append(gpu)
            continue
        chosen.discard(gpu.uuid)
        if kind == "whole":
            if not serves_whole(gpu, request.gpu_models):
                raise InvalidState(f"GPU {gpu.uuid} cannot be handed out whole")
            new_gpus.append(replace(gpu, milli_free=0, memory_free_bytes=0))
        elif kind == "fraction":
            if not fits_fraction(gpu, request):
                raise InvalidState(f"GPU {gpu.uuid} has not enough free share for the request")
            new_gpus.append(
                replace(
                    gpu,
                    milli_free=gpu.milli_free - request.gpu_milli,
                    memory_free_bytes=gpu.memory_free_bytes - request.gpu_memory_bytes,
                )
            )
        else:
            if not fits_mig(gpu, request):
                raise InvalidState(f"GPU {gpu.uuid} has no free {request.mig_profile} instance")
            assert request.mig_profile is not None
            mig = dict(gpu.mig_free)
            mig[request.mig_profile] -= 1
            new_gpus.append(replace(gpu, mig_free=mig))
    if chosen:
        raise InvalidState(f"node {node.name} has no GPU(s) {sorted(chosen)}")
    return replace(
        node,
        gpus=tuple(new_gpus),
        cpu_milli_free=node.cpu_milli_free - request.cpu_milli,
        memory_free_bytes=node.memory_free_bytes - request.memory_bytes,
    )


def allocatable_share(gpu: GpuState) -> int:
    """The milli-GPU of this GPU that our requests could still take (0 for MIG, time-sliced, sick GPUs)."""
    if not gpu.healthy:
        return 0
    if gpu.sharing == "fractional":
        return gpu.free_share_milli
    if gpu.sharing == "whole":
        return MILLI_PER_GPU if gpu.fully_free else 0
    return 0
