"""What kube-scheduler allocated of gpunode's DRA devices: ResourceClaims' `status.allocation`, read once.

kube-scheduler writes a claim's allocation (resource.k8s.io/v1) as results, one per device:

    status:
      allocation:
        devices:
          results:
          - {request: gpu, driver: gpu.gpunode.io, pool: <node>, device: <uuid>-shared,
             shareID: ..., consumedCapacity: {memory: 4Gi}}

The agent (ordering its slice's devices by what is in use, gpunode.node.dra.order) and the cluster side (the
extender's and the queue controller's view of each GPU, gpunode.cluster.extender.claims) read them through
claim_uses() and pool_usage(), so both count the same. The pool is the node's name; the device names are
made here (gpu_device_name and the suffixes, which the agent's slices use): `<gpu>` held whole,
`<gpu>-shared` shared by memory, `<gpu>-mig-...` a MIG placement.

Claims come from tenants, and the status from whoever may write it: every field is checked and bounded
before it is used. A result that is not ours (another driver) is skipped; one of ours that is malformed
(not a mapping, a name that is not a DNS label or subdomain, a memory that is not a quantity, negative or
beyond MAX_MEMORY_BYTES) is skipped and named in the problems, and so are results beyond
MAX_RESULTS (the API's own limit) and a claim that is not a mapping. Nothing a claim says can raise, and
usage is a sum of bounded numbers (callers clamp it to the GPU's capacity). Pure functions; no I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpunode.contract.quantity import ceil, parse_quantity
from gpunode.errors import QuantityError

MAX_RESULTS = 32  # resource.k8s.io/v1 AllocationResultsMaxSize
MAX_MEMORY_BYTES = 2**50  # 1 PiB: no GPU has more
MEMORY = "memory"  # the capacity the shared device is taken by (gpunode.contract.dra.CAPACITY_MEMORY)
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a device name
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a pool (node) or driver name


_GPU_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")  # room for the suffixes within 63


def gpu_device_name(uuid: str) -> str:
    """The whole GPU's device name: its UUID in lower case (a DNS label), or a digest of it otherwise.
    Every other device of the GPU is named `<this>-<suffix>` (`-shared`, `-mig-<profile>-<start>`)."""
    lower = uuid.lower()
    if _GPU_NAME.fullmatch(lower):
        return lower
    return "gpu-" + hashlib.sha256(uuid.encode()).hexdigest()[:32]


def shared_device_name(uuid: str) -> str:
    """The device several claims take memory shares of."""
    return f"{gpu_device_name(uuid)}-shared"


def gpu_of_device(device: str, uuids: Iterable[str]) -> str | None:
    """Which of these GPUs (UUIDs) a device of gpunode's pool belongs to; None for none of them."""
    for uuid in uuids:
        base = gpu_device_name(uuid)
        if device == base or device.startswith(base + "-"):
            return uuid
    return None


@dataclass(frozen=True)
class DeviceUse:
    """One allocated device of one claim: where it is and what it consumes."""

    claim: str  # namespace/name
    uid: str
    pool: str  # the node
    device: str
    memory_bytes: int | None  # consumedCapacity.memory; None when the result names none (a whole device)


@dataclass
class DeviceUsage:
    """All allocations of one device: how many claims hold it and the memory they consumed, with who."""

    claims: int = 0
    memory_bytes: int = 0
    holders: list[str] = field(default_factory=list)  # namespace/name of the claims


def _text(value: object, pattern: re.Pattern[str]) -> str | None:
    return value if isinstance(value, str) and len(value) <= 253 and pattern.fullmatch(value) else None


def claim_uses(claim: object, driver: str, problems: list[str] | None = None) -> list[DeviceUse]:
    """The devices of `driver` that this claim (v1 JSON) holds; malformed results are skipped (and named
    in `problems` when given)."""
    said = problems if problems is not None else []
    if not isinstance(claim, Mapping):
        said.append("a ResourceClaim that is not an object")
        return []
    meta = claim.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    ns, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
    ref = f"{ns if isinstance(ns, str) else '?'}/{name if isinstance(name, str) else '?'}"[:320]
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if not isinstance(results, list):
        return []  # not allocated
    if len(results) > MAX_RESULTS:
        said.append(f"claim {ref}: {len(results)} allocation results, more than the API's {MAX_RESULTS}")
        results = results[:MAX_RESULTS]
    out: list[DeviceUse] = []
    for i, result in enumerate(results):
        if not isinstance(result, Mapping) or result.get("driver") != driver:
            continue
        pool, device = _text(result.get("pool"), _SUBDOMAIN), _text(result.get("device"), _LABEL)
        if pool is None or device is None:
            said.append(f"claim {ref}: result {i} names no valid pool and device")
            continue
        memory: int | None = None
        consumed = result.get("consumedCapacity")
        if consumed is not None:
            if not isinstance(consumed, Mapping):
                said.append(f"claim {ref}: result {i}: consumedCapacity is not a mapping")
                continue
            if MEMORY in consumed:
                try:
                    memory = ceil(parse_quantity(consumed[MEMORY], where=f"claim {ref} result {i} memory"))
                except QuantityError as exc:
                    said.append(str(exc))
                    continue
                if not 0 <= memory <= MAX_MEMORY_BYTES:
                    said.append(f"claim {ref}: result {i}: memory {memory} is beyond {MAX_MEMORY_BYTES}")
                    continue
        out.append(DeviceUse(ref, uid if isinstance(uid, str) else "", pool, device, memory))
    return out


def pool_usage(
    claims: Iterable[object], driver: str, problems: list[str] | None = None
) -> dict[str, dict[str, DeviceUsage]]:
    """pool (node) -> device -> its usage, over these claims (v1 JSON)."""
    return usage_of(use for claim in claims for use in claim_uses(claim, driver, problems))


def usage_of(uses: Iterable[DeviceUse]) -> dict[str, dict[str, DeviceUsage]]:
    """pool -> device -> usage, from DeviceUse records already read (a watcher's per-claim cache)."""
    out: dict[str, dict[str, DeviceUsage]] = {}
    for use in uses:
        usage = out.setdefault(use.pool, {}).setdefault(use.device, DeviceUsage())
        usage.claims += 1
        usage.memory_bytes += use.memory_bytes or 0
        usage.holders.append(use.claim)
    return out


def as_json(usage: Mapping[str, DeviceUsage]) -> dict[str, Any]:
    """One pool's usage as plain JSON (for logs and benchmarks)."""
    return {d: {"claims": u.claims, "memoryBytes": u.memory_bytes} for d, u in sorted(usage.items())}
