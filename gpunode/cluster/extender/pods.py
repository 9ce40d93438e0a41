"""A pod's GPU request, read from a v1.Pod (JSON).

request_from_pod() turns a pod into a placement Request, from its containers'
resources (nvidia.com/gpu, gpunode.io/gpu-memory in units of a configured size,
nvidia.com/mig-<profile>, cpu, memory) and the annotations gpunode.io/gpu-milli
(compute share) and gpunode.io/gpu-model (accepted models, `|`-separated; the
node selector key of the same name works too). No I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from gpunode.contract.names import (
    GIB,
    GPU_MEMORY_RESOURCE,
    GPU_MILLI_ANNOTATION,
    GPU_MODEL_ANNOTATION,
    GPU_RESOURCE,
    mig_profile_of,
)
from gpunode.errors import InvalidRequest
from gpunode.placement import MILLI_PER_GPU, Request

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+))?([a-zA-Z]*)$")
_SUFFIXES = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}


def parse_quantity(value: object, *, where: str) -> Decimal:
    """A Kubernetes resource quantity ("500m", "2", "1.5Gi", "1e3") as a Decimal."""
    if isinstance(value, bool):
        raise InvalidRequest(f"{where}: expected a quantity, got {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}: expected a quantity, got {value!r}")
    m = _QUANTITY.match(value.strip())
    if not m or m.group(3) not in _SUFFIXES or (m.group(2) and m.group(3)):
        raise InvalidRequest(f"{where}: {value!r} is not a resource quantity (e.g. 500m, 2, 16Gi)")
    try:
        number = Decimal(m.group(1)) * (Decimal(10) ** int(m.group(2) or 0)) * _SUFFIXES[m.group(3)]
    except InvalidOperation:
        raise InvalidRequest(f"{where}: {value!r} is not a resource quantity") from None
    if number < 0:
        raise InvalidRequest(f"{where}: a resource quantity cannot be negative, got {value!r}")
    return number


def _ceil(d: Decimal) -> int:
    return int(d.to_integral_value(rounding="ROUND_CEILING"))


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
            total[k] = total.get(k, Decimal(0)) + v
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
    gpus = _ceil(totals.get(GPU_RESOURCE, Decimal(0)))
    memory_units = totals.get(GPU_MEMORY_RESOURCE, Decimal(0))
    mig = {p: v for k, v in totals.items() if (p := mig_profile_of(k)) and v > 0}
    milli_text = annotations.get(GPU_MILLI_ANNOTATION)
    milli = 0
    if milli_text is not None:
        try:
            milli = int(str(milli_text))
        except ValueError:
            raise InvalidRequest(
                f"annotation {GPU_MILLI_ANNOTATION}: expected 1..999, got {milli_text!r}"
            ) from None
        if not 0 < milli < MILLI_PER_GPU:
            raise InvalidRequest(f"annotation {GPU_MILLI_ANNOTATION}: expected 1..999, got {milli}")
    if not gpus and not memory_units and not mig and not milli:
        return None
    if len(mig) > 1 or any(v != 1 for v in mig.values()):
        raise InvalidRequest(
            "a pod can ask for one MIG instance of one profile (nvidia.com/mig-<profile>: 1)"
        )
    models_text = annotations.get(GPU_MODEL_ANNOTATION) or selector.get(GPU_MODEL_ANNOTATION)
    models = frozenset(m.strip() for m in str(models_text).split("|") if m.strip()) if models_text else None
    return Request(
        gpus=gpus,
        gpu_milli=milli,
        gpu_memory_bytes=_ceil(memory_units * memory_unit_bytes),
        mig_profile=next(iter(mig)) if mig else None,
        gpu_models=models or None,
        cpu_milli=_ceil(totals.get("cpu", Decimal(0)) * 1000),
        memory_bytes=_ceil(totals.get("memory", Decimal(0))),
    )
