"""A pod's GPU request, read from a v1.Pod (JSON).

request_from_pod() turns a pod into a placement Request, from its containers'
resources (nvidia.com/gpu, gpunode.io/gpu-memory in units of a configured size,
nvidia.com/mig-<profile>, cpu, memory) and the annotations gpunode.io/gpu-milli
(compute share) and gpunode.io/gpu-model (accepted models, `|`-separated; the
node selector key of the same name works too). No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from gpunode.contract import quantity
from gpunode.contract.names import (
    GIB,
    GPU_MEMORY_RESOURCE,
    GPU_MILLI_ANNOTATION,
    GPU_MODEL_ANNOTATION,
    GPU_RESOURCE,
    mig_profile_of,
)
from gpunode.contract.share import parse_compute_share
from gpunode.errors import InvalidComputeShare, InvalidRequest, QuantityError
from gpunode.placement import MILLI_PER_GPU, Request

# Sane ceilings of a pod's totals, far above any node, so that nothing downstream (the learned
# workload, the numpy tables) ever sees a number it cannot hold.
MAX_GPUS = 1024
MAX_CPU_MILLI = 2**40  # about 10^9 cores
MAX_BYTES = 2**50  # 1 PiB of memory or GPU memory
MAX_MODELS = 32  # GPU models one pod may accept
_EXACT = quantity.EXACT


def parse_quantity(value: object, *, where: str) -> Decimal:
    """A Kubernetes resource quantity as an exact Decimal (gpunode.contract.quantity); InvalidRequest
    naming `where` for anything its strict, bounded grammar refuses."""
    try:
        return quantity.parse_quantity(value, where=where)
    except QuantityError as exc:
        raise InvalidRequest(str(exc)) from None


_ceil = quantity.ceil


def _bounded(totals: Mapping[str, Decimal], name: str, scale: int, limit: int, unit: str) -> int:
    """The pod's total of one resource times `scale`, rounded up; InvalidRequest beyond `limit`."""
    value = _ceil(_EXACT.multiply(totals.get(name, Decimal(0)), Decimal(scale)))
    if value > limit:
        raise InvalidRequest(f"{name}: the pod asks for {value} {unit}, more than any node has ({limit})")
    return value


def _container_resources(container: object, where: str) -> dict[str, Decimal]:
    """limits where given, else requests (extended resources must have limits == requests)."""
    if not isinstance(container, Mapping):
        raise InvalidRequest(f"{where}: expected an object")
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise InvalidRequest(f"{where}.resources: expected an object")
    out: dict[str, Decimal] = {}
    for section in ("requests", "limits"):
        values = resources.get(section) or {}
        if not isinstance(values, Mapping):
            raise InvalidRequest(f"{where}.resources.{section}: expected an object")
        for name, qty in values.items():
            out[str(name)] = parse_quantity(qty, where=f"{where}.resources.{section}.{name}")
    return out


def _pod_totals(spec: Mapping[str, Any]) -> dict[str, Decimal]:
    """Effective pod resources: the larger of the containers' sum and any single init container."""
    total: dict[str, Decimal] = {}
    containers = spec.get("containers") or []
    if not isinstance(containers, list):
        raise InvalidRequest("spec.containers: expected a list")
    for i, c in enumerate(containers):
        for k, v in _container_resources(c, f"spec.containers[{i}]").items():
            total[k] = _EXACT.add(total.get(k, Decimal(0)), v)
    inits = spec.get("initContainers") or []
    if not isinstance(inits, list):
        raise InvalidRequest("spec.initContainers: expected a list")
    for i, c in enumerate(inits):
        for k, v in _container_resources(c, f"spec.initContainers[{i}]").items():
            total[k] = max(total.get(k, Decimal(0)), v)
    return total


def pod_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    """(uid, "namespace/name") of a v1.Pod."""
    meta = pod.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise InvalidRequest("Pod.metadata: expected an object")
    name, namespace = meta.get("name"), meta.get("namespace") or "default"
    if not isinstance(name, str) or not name:
        raise InvalidRequest("Pod.metadata.name: required")
    uid = meta.get("uid")
    key = f"{namespace}/{name}"
    return (uid if isinstance(uid, str) and uid else key), key


def request_from_pod(pod: Mapping[str, Any], *, memory_unit_bytes: int = GIB) -> Request | None:
    """The pod's GPU request, or None when it asks for none of our GPU resources."""
    if not isinstance(pod, Mapping):
        raise InvalidRequest("Pod: expected an object")
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    if not isinstance(spec, Mapping) or not isinstance(meta, Mapping):
        raise InvalidRequest("Pod.spec and Pod.metadata must be objects")
    totals = _pod_totals(spec)
    annotations = meta.get("annotations") or {}
    selector = spec.get("nodeSelector") or {}
    if not isinstance(annotations, Mapping) or not isinstance(selector, Mapping):
        raise InvalidRequest("Pod.metadata.annotations and Pod.spec.nodeSelector must be objects")
    gpus = _bounded(totals, GPU_RESOURCE, 1, MAX_GPUS, "GPUs")
    memory_units = totals.get(GPU_MEMORY_RESOURCE, Decimal(0))
    gpu_memory = _bounded(totals, GPU_MEMORY_RESOURCE, memory_unit_bytes, MAX_BYTES, "bytes")
    mig = {p: v for k, v in totals.items() if (p := mig_profile_of(k)) and v > 0}
    milli_text = annotations.get(GPU_MILLI_ANNOTATION)
    milli = 0
    if milli_text is not None:
        try:  # the node agent reads the same annotation with the same parser
            milli = parse_compute_share(milli_text, what=f"annotation {GPU_MILLI_ANNOTATION}")
        except InvalidComputeShare as exc:
            raise InvalidRequest(f"{exc}; expected 1..999") from None
        if milli >= MILLI_PER_GPU:
            raise InvalidRequest(
                f"annotation {GPU_MILLI_ANNOTATION}: expected 1..999, got {milli} (ask {GPU_RESOURCE}: 1 for a whole GPU)"
            )
    if not gpus and not memory_units and not mig and not milli:
        return None
    if len(mig) > 1 or any(v != 1 for v in mig.values()):
        raise InvalidRequest(
            "a pod can ask for one MIG instance of one profile (nvidia.com/mig-<profile>: 1)"
        )
    models_text = annotations.get(GPU_MODEL_ANNOTATION) or selector.get(GPU_MODEL_ANNOTATION)
    models = frozenset(m.strip() for m in str(models_text).split("|") if m.strip()) if models_text else None
    if models is not None and (len(models) > MAX_MODELS or any(len(m) > 128 for m in models)):
        raise InvalidRequest(
            f"annotation {GPU_MODEL_ANNOTATION}: at most {MAX_MODELS} models of at most 128 characters"
        )
    return Request(
        gpus=gpus,
        gpu_milli=milli,
        gpu_memory_bytes=gpu_memory,
        mig_profile=next(iter(mig)) if mig else None,
        gpu_models=models or None,
        cpu_milli=_bounded(totals, "cpu", 1000, MAX_CPU_MILLI, "milli-CPUs"),
        memory_bytes=_bounded(totals, "memory", 1, MAX_BYTES, "bytes"),
    )
