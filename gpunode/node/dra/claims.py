"""From a ResourceClaim (resource.k8s.io/v1, as JSON) to what this node must prepare for it.

Pure functions over decoded JSON: no I/O. `plan_claim` checks the claim is the one the kubelet
named (its UID), takes the allocation results for this driver and, for each, the device (looked up
in the node's own ResourceSlices by pool and name, gpunode.node.dra.devices), the memory it consumes
(`consumedCapacity`) and its `shareID`, and validates the opaque configuration given to this driver.
Anything wrong is a ClaimRefused naming the claim and what is wrong; tenants write claims, so every
field is read strictly and bounded, and nothing from the claim but its UID names anything on disk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.contract import dra as names
from gpunode.contract import quantity
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.contract.reader import excerpt, format_bytes
from gpunode.errors import ClaimRefused, QuantityError

# A Kubernetes UID as the API server makes them (RFC 4122 text form). The CDI spec's file name,
# the region key and the checkpoint record are derived from it, so it is checked before any use.
_UID = names.CLAIM_UID
MAX_RESULTS = 32  # allocation results of one claim for this driver (the API allows 32 requests)
MAX_OPAQUE_BYTES = 10 * 1024  # the API server's own bound on opaque parameters
OPAQUE_API_VERSION = "gpunode.io/v1alpha1"
OPAQUE_KIND = "GpuConfig"
MEMORY_CAPACITY = names.CAPACITY_MEMORY  # the capacity a shared device's claims consume
COMPUTE_CAPACITY = names.CAPACITY_COMPUTE  # and their compute share, in milli-GPU

MAX_QUANTITY_BYTES = 2**63 - 1


@dataclass(frozen=True)
class ClaimRef:
    """The claim as the kubelet names it."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class DeviceInfo:
    """One of this node's published devices, as its ResourceSlice says."""

    pool: str
    name: str
    gpu_uuid: str
    kind: str  # "gpu" | "mig"
    sharing: str  # "whole" | "shared" | "mig"
    profile: str | None = None  # a MIG placement: its profile ("3g.40gb")
    start: int | None = None  # a MIG placement: its first memory slice


@dataclass(frozen=True)
class PlannedDevice:
    """One allocation result of the claim for this driver, with what its container gets."""

    request: str
    pool: str
    device: str
    share_id: str | None
    gpu_uuid: str
    memory_bytes: int | None  # the cap (consumed capacity); None: the whole GPU, uncapped
    mig_uuid: str | None = None  # a MIG placement: the MIG device it is prepared as (set by prepare)
    compute_milli: int | None = None  # a share's consumedCapacity.compute; None: not asked (0)
    mig_profile: str | None = None  # a MIG placement: its profile
    mig_start: int | None = None  # and its first memory slice
    mig_created: bool = False  # gpunode creates the instance for the claim (mig_uuid None until it has)


@dataclass(frozen=True)
class ClaimPlan:
    """Everything NodePrepareResources does for one claim."""

    claim: ClaimRef
    devices: tuple[PlannedDevice, ...]
    fail_open: bool = False  # the opaque GpuConfig's failOpen

    def as_json(self) -> dict[str, Any]:
        """The plan as the checkpoint keeps it."""
        return {
            "namespace": self.claim.namespace,
            "uid": self.claim.uid,
            "name": self.claim.name,
            "failOpen": self.fail_open,
            "devices": [
                {
                    "request": d.request,
                    "pool": d.pool,
                    "device": d.device,
                    "shareID": d.share_id,
                    "gpu": d.gpu_uuid,
                    "memory": d.memory_bytes,
                    "mig": d.mig_uuid,
                    "compute": d.compute_milli,
                    "migProfile": d.mig_profile,
                    "migStart": d.mig_start,
                    "migCreated": d.mig_created,
                }
                for d in self.devices
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClaimPlan:
        """The plan back from the checkpoint (written by as_json; KeyError/TypeError if it was not)."""
        return cls(
            claim=ClaimRef(str(data["namespace"]), check_uid(str(data["uid"])), str(data["name"])),
            devices=tuple(
                PlannedDevice(
                    request=str(d["request"]),
                    pool=str(d["pool"]),
                    device=str(d["device"]),
                    share_id=None if d["shareID"] is None else str(d["shareID"]),
                    gpu_uuid=str(d["gpu"]),
                    memory_bytes=None if d["memory"] is None else int(d["memory"]),
                    mig_uuid=None if d.get("mig") is None else str(d["mig"]),
                    compute_milli=None if d.get("compute") is None else int(d["compute"]),
                    mig_profile=None if d.get("migProfile") is None else str(d["migProfile"]),
                    mig_start=None if d.get("migStart") is None else int(d["migStart"]),
                    mig_created=d.get("migCreated") is True,
                )
                for d in data["devices"]
            ),
            fail_open=bool(data["failOpen"]),
        )


def check_uid(uid: str) -> str:
    """The claim UID, if it is one the API server could have made; ClaimRefused otherwise.

    The UID names the CDI spec file, the region and the checkpoint record: a UID such as
    "../../etc/x" or one with a NUL byte must never reach a path."""
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise ClaimRefused(
            f"claim UID {excerpt(uid)} is not a Kubernetes UID",
            hint="the kubelet sends the ResourceClaim's metadata.uid; this request did not come from it",
        )
    return uid


def parse_memory(value: object, where: str) -> int:
    """A memory quantity ("4Gi", "4294967296", "4.5G", "1e9") as whole bytes (rounded up), read with
    Kubernetes' grammar (gpunode.contract.quantity)."""
    if not isinstance(value, str):
        raise ClaimRefused(f"{where}: expected a quantity such as 4Gi, got {excerpt(value)}")
    try:
        size = quantity.ceil(quantity.parse_quantity(value, where=where))
    except QuantityError as exc:
        raise ClaimRefused(str(exc)) from None
    if size <= 0 or size > MAX_QUANTITY_BYTES:
        raise ClaimRefused(f"{where}: a memory quantity is 1 byte or more, got {excerpt(value)}")
    return size


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ClaimRefused(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _list(value: object, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ClaimRefused(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _applies(config: Mapping[str, Any], request: str) -> bool:
    """Whether an allocation config entry applies to a request ("req" also covers its subrequests "req/sub")."""
    requests = config.get("requests") or []
    return not requests or request in requests or request.split("/", 1)[0] in requests


def parse_opaque(parameters: object, where: str) -> bool:
    """The opaque configuration for this driver: a GpuConfig; returns its failOpen.

    The only fields are apiVersion, kind and failOpen (what the interposer does when the region is
    unusable: false, the default, refuses GPU memory). Anything else is refused with its key."""
    if len(json.dumps(parameters, default=str)) > MAX_OPAQUE_BYTES:
        raise ClaimRefused(f"{where}: the configuration is larger than {MAX_OPAQUE_BYTES // 1024} KiB")
    if not isinstance(parameters, Mapping):
        raise ClaimRefused(
            f"{where}: expected a {OPAQUE_KIND} object, got {type(parameters).__name__}",
            hint=f"write {{apiVersion: {OPAQUE_API_VERSION}, kind: {OPAQUE_KIND}}}",
        )
    api, kind = parameters.get("apiVersion"), parameters.get("kind")
    if api != OPAQUE_API_VERSION or kind != OPAQUE_KIND:
        raise ClaimRefused(
            f"{where}: expected apiVersion {OPAQUE_API_VERSION} and kind {OPAQUE_KIND}, "
            f"got {excerpt(api, 40)} and {excerpt(kind, 40)}",
            hint=f"write {{apiVersion: {OPAQUE_API_VERSION}, kind: {OPAQUE_KIND}}}",
        )
    unknown = sorted(str(k) for k in parameters if k not in ("apiVersion", "kind", "failOpen"))
    if unknown:
        raise ClaimRefused(f"{where}.{unknown[0][:40]}: unknown field (a {OPAQUE_KIND} has failOpen only)")
    fail_open = parameters.get("failOpen", False)
    if not isinstance(fail_open, bool):
        raise ClaimRefused(f"{where}.failOpen: expected true or false, got {excerpt(fail_open, 40)}")
    return fail_open


def plan_claim(
    ref: ClaimRef,
    claim: Mapping[str, Any],
    *,
    driver: str,
    device: Any,
    gpu_memory: Any,
    mig_device: Any = None,
) -> ClaimPlan:
    """What to prepare for the claim the kubelet named `ref`, read from the API server's `claim`.

    device(pool, name) -> DeviceInfo | None: this node's published device of that name;
    gpu_memory(uuid) -> int | None: the memory of a GPU this node serves through DRA (None: not one);
    mig_device(gpu uuid, profile, start) -> str | None: the UUID of the MIG device at that placement,
    None when prepare creates it, or ValueError saying why neither (None: MIG placements are refused).
    Raises ClaimRefused with the reason for the claim."""
    meta = _mapping(claim.get("metadata"), "metadata")
    if meta.get("uid") != ref.uid:
        raise ClaimRefused(
            f"claim {ref}: the API server's {ref.namespace}/{ref.name} has UID {excerpt(meta.get('uid'), 40)}; "
            "it was deleted and created again",
            hint="the pod that asked for the old claim has to be recreated",
        )
    status = _mapping(claim.get("status"), "status")
    allocation = _mapping(status.get("allocation"), "status.allocation")
    devices = _mapping(allocation.get("devices"), "status.allocation.devices")
    if not allocation:
        raise ClaimRefused(f"claim {ref}: it is not allocated", hint="the scheduler allocates a claim first")
    results = [
        (i, r)
        for i, r in enumerate(_list(devices.get("results"), "status.allocation.devices.results"))
        if isinstance(r, Mapping) and r.get("driver") == driver
    ]
    if not results:
        raise ClaimRefused(f"claim {ref}: its allocation has no device of the driver {driver}")
    if len(results) > MAX_RESULTS:
        raise ClaimRefused(f"claim {ref}: {len(results)} devices of {driver}; at most {MAX_RESULTS}")
    configs = [
        (j, c)
        for j, c in enumerate(_list(devices.get("config"), "status.allocation.devices.config"))
        if isinstance(c, Mapping) and _mapping(c.get("opaque"), f"config[{j}].opaque").get("driver") == driver
    ]
    planned: list[PlannedDevice] = []
    fail_open = False
    seen: set[tuple[str, str, str | None]] = set()
    for i, result in results:
        where = f"claim {ref}: status.allocation.devices.results[{i}]"
        request, pool, name = (result.get(k) for k in ("request", "pool", "device"))
        if not all(isinstance(v, str) and 0 < len(v) <= 253 for v in (request, pool, name)):
            raise ClaimRefused(f"{where}: request, pool and device must be names of 1..253 characters")
        assert isinstance(request, str) and isinstance(pool, str) and isinstance(name, str)
        share = result.get("shareID")
        if share is not None and (not isinstance(share, str) or not 0 < len(share) <= 64):
            raise ClaimRefused(f"{where}.shareID: expected a UID, got {excerpt(share, 40)}")
        if (pool, name, share) in seen:
            raise ClaimRefused(f"{where}: device {pool}/{name} is allocated twice to the claim")
        seen.add((pool, name, share))
        if result.get("adminAccess"):
            raise ClaimRefused(
                f"{where}: admin access to {pool}/{name} is not supported by gpunode",
                hint="request the device without adminAccess",
            )
        info = device(pool, name)
        if info is None:
            raise ClaimRefused(
                f"{where}: device {pool}/{name} is not one of this node's {driver} devices",
                hint="the claim was allocated for another node, or the node's ResourceSlice changed since",
            )
        if info.kind not in (names.TYPE_GPU, names.TYPE_MIG):
            raise ClaimRefused(
                f"{where}: device {pool}/{name} is of type {excerpt(info.kind, 20)}, not a GPU"
            )
        total = gpu_memory(info.gpu_uuid)
        if total is None:
            raise ClaimRefused(
                f"{where}: GPU {info.gpu_uuid} is not served through DRA on this node",
                hint="gpunode.dra.devices lists the GPUs DRA serves; the device plugin serves the others",
            )
        if info.kind == names.TYPE_MIG:
            mig = _mig_placement(info, mig_device, where)
            planned.append(
                PlannedDevice(
                    request,
                    pool,
                    name,
                    share,
                    info.gpu_uuid,
                    None,
                    mig,
                    mig_profile=info.profile,
                    mig_start=info.start,
                    mig_created=mig is None,
                )
            )
            fail_open = _config(configs, request, ref, fail_open)
            continue
        shared = info.sharing == names.SHARING_SHARED
        memory = _consumed(result, driver, where) if shared else None
        if shared and memory is None:
            raise ClaimRefused(
                f"{where}: the shared device {pool}/{name} has no consumedCapacity.{MEMORY_CAPACITY}",
                hint="a shared GPU is requested with capacity.requests.memory",
            )
        if memory is not None and memory > total:
            raise ClaimRefused(
                f"{where}: {format_bytes(memory)} of GPU memory asked of {pool}/{name}, which has "
                f"{format_bytes(total)}",
                hint="ask for at most the GPU's memory, or for the whole GPU",
            )
        compute = _consumed_compute(result, driver, where) if shared else None
        fail_open = _config(configs, request, ref, fail_open)
        planned.append(PlannedDevice(request, pool, name, share, info.gpu_uuid, memory, None, compute))
    return ClaimPlan(ref, tuple(planned), fail_open)


def _config(configs: list[tuple[int, Any]], request: str, ref: ClaimRef, fail_open: bool) -> bool:
    """The failOpen of the opaque configurations that apply to the request (the last one wins)."""
    for j, config in configs:
        if _applies(config, request):
            opaque = _mapping(config.get("opaque"), "opaque")
            fail_open = parse_opaque(
                opaque.get("parameters"),
                f"claim {ref}: status.allocation.devices.config[{j}].opaque.parameters",
            )
    return fail_open


def _mig_placement(info: DeviceInfo, mig_device: Any, where: str) -> str | None:
    """The MIG device a placement is prepared as, None when prepare is to create it; ClaimRefused
    naming why it can be neither."""
    what = f"{where}: MIG placement {info.pool}/{info.name}"
    if info.profile is None or info.start is None:
        raise ClaimRefused(
            f"{what} has no profile or memorySliceStart attribute in this node's ResourceSlice"
        )
    if mig_device is None:
        raise ClaimRefused(f"{what}: this node does not prepare MIG placements")
    try:
        found = mig_device(info.gpu_uuid, info.profile, info.start)
    except ValueError as exc:
        raise ClaimRefused(
            f"{what} ({info.profile} at memory slice {info.start}): {exc}",
            hint="free the GPU's memory slices (nvidia-smi mig -dci/-dgi of the instance named) or delete "
            "the pod so the scheduler picks a placement that fits",
        ) from None
    return None if found is None else str(found)


MAX_POD_CLAIMS = 128  # resource claims of one pod looked at (the API allows far fewer in practice)


def containers_with_other_caps(
    pod: Mapping[str, Any], claim_name: str, fractional_resource: str
) -> list[tuple[str, list[str], bool]]:
    """The pod's containers that use the ResourceClaim `claim_name` together with another claim or with
    the device plugin's memory units: (container, the other claims' names, whether it also asks
    `fractional_resource`). Read from the pod as the API server returned it; anything malformed is
    skipped (the check is a safety net, not the pod's validation)."""
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
    assert isinstance(spec, Mapping) and isinstance(status, Mapping)
    generated = {
        s.get("name"): s.get("resourceClaimName")
        for s in (status.get("resourceClaimStatuses") or [])[:MAX_POD_CLAIMS]
        if isinstance(s, Mapping)
    }
    actual: dict[str, str] = {}
    for c in (spec.get("resourceClaims") or [])[:MAX_POD_CLAIMS]:
        if isinstance(c, Mapping) and isinstance(c.get("name"), str):
            name = c.get("resourceClaimName") or generated.get(c["name"])
            if isinstance(name, str):
                actual[c["name"]] = name
    ours = {k for k, v in actual.items() if v == claim_name}
    out = []
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if not isinstance(container, Mapping):
            continue
        resources = container.get("resources") if isinstance(container.get("resources"), Mapping) else {}
        assert isinstance(resources, Mapping)
        refs = [r.get("name") for r in resources.get("claims") or [] if isinstance(r, Mapping)]
        if not ours.intersection(refs):
            continue
        others = sorted({actual[r] for r in refs if isinstance(r, str) and r in actual and r not in ours})
        asks = [resources.get("limits"), resources.get("requests")]
        units = any(isinstance(a, Mapping) and fractional_resource in a for a in asks)
        if others or units:
            out.append((str(container.get("name")), others, units))
    return out


def _consumed_compute(result: Mapping[str, Any], driver: str, where: str) -> int | None:
    """The compute share a shared device's result consumed, in milli-GPU; None when it asked none (0)."""
    consumed = _mapping(result.get("consumedCapacity"), f"{where}.consumedCapacity")
    for key in (COMPUTE_CAPACITY, f"{driver}/{COMPUTE_CAPACITY}"):
        if key in consumed:
            value = consumed[key]
            at = f"{where}.consumedCapacity.{key}"
            if not isinstance(value, str):
                raise ClaimRefused(f"{at}: expected a quantity such as 250, got {excerpt(value)}")
            try:
                milli = quantity.ceil(quantity.parse_quantity(value, where=at))
            except QuantityError as exc:
                raise ClaimRefused(str(exc)) from None
            if not 0 <= milli <= MILLI_PER_GPU:
                raise ClaimRefused(
                    f"{at}: a compute share is 0 to {MILLI_PER_GPU} milli-GPU, got {excerpt(value)}",
                    hint=f"ask capacity.requests.compute in thousandths of the GPU ({MILLI_PER_GPU} is all of it)",
                )
            return milli or None
    return None


def _consumed(result: Mapping[str, Any], driver: str, where: str) -> int | None:
    consumed = _mapping(result.get("consumedCapacity"), f"{where}.consumedCapacity")
    for key in (MEMORY_CAPACITY, f"{driver}/{MEMORY_CAPACITY}"):
        if key in consumed:
            return parse_memory(consumed[key], f"{where}.consumedCapacity.{key}")
    return None
