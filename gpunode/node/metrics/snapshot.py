"""One collection of the node's telemetry, frozen, with the labels dcgm-exporter puts on it.

`build_snapshot` is a pure function from what the collector read (GPUs and
their samples, the inventory, health, the kubelet's assignment, memory-cap
region usage) to a NodeSnapshot the renderer can print without further
lookups. Labels follow dcgm-exporter's order and spelling: gpu, UUID,
pci_bus_id, device, modelName, GPU_I_PROFILE and GPU_I_ID for a MIG instance,
Hostname (or hostname), DCGM_FI_DRIVER_VERSION, then container, namespace and
pod when a pod holds the device, never with empty values. A device a pod holds
through a DRA claim also carries dcgm-exporter's DRA labels (dra_claim_name,
dra_claim_namespace, dra_device_name, dra_driver_name, dra_pool_name), sorted
in among the pod labels as dcgm-exporter sorts them.

This module reads nothing and renders nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpunode.contract import dra as dra_names
from gpunode.node.devices.base import Gpu, GpuSample, MigDevice
from gpunode.node.dra.claims import ClaimPlan
from gpunode.node.inventory import Inventory, region_key
from gpunode.node.kubelet.podresources import AttributionSnapshot, ContainerDevices, PodRef
from gpunode.node.metrics.fields import FIELDS, format_value

EntityKey = tuple[str, str | None]  # (GPU UUID, MIG UUID or None)


def escape_label_value(value: str) -> str:
    """Escape a label value for the Prometheus text format."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_labels(pairs: Iterable[tuple[str, str]]) -> str:
    """`a="1",b="2"` from (name, value) pairs, in the given order."""
    return ",".join(f'{k}="{escape_label_value(v)}"' for k, v in pairs)


@dataclass(frozen=True)
class Entity:
    """A GPU or a MIG instance as dcgm-exporter labels it, with its values for this collection.

    base_labels identify the device and never change while it exists; labels
    add the holder (container, namespace, pod) when a pod holds it. values maps
    a DCGM field name to its rendered value; a field the backend could not read
    is not in it.
    """

    key: EntityKey
    gpu_index: int
    base_pairs: tuple[tuple[str, str], ...]
    base_labels: str
    labels: str
    owner: PodRef | None
    values: Mapping[str, str]
    claim: ClaimDeviceUse | None = None  # when a DRA claim holds the GPU or instance whole


@dataclass(frozen=True)
class ClaimDeviceUse:
    """One device of a DRA claim this node prepared, and the containers the kubelet lists using it."""

    claim_uid: str
    claim_name: str
    claim_namespace: str
    driver: str
    pool: str
    device: str
    gpu_uuid: str
    mig_uuid: str | None  # the MIG device a placement was prepared as
    capped: bool  # a share of the GPU, charged through the claim's memory-cap region
    holders: tuple[PodRef, ...]  # sorted; a claim may be shared by several containers and pods

    def labels(self) -> list[tuple[str, str]]:
        """dcgm-exporter's DRA labels with the pod labels, sorted by name as dcgm-exporter prints them.

        `pod` and `container` are given when they are one (a claim used by several pods or containers
        is charged once, to the claim, not once per user)."""
        pairs = [
            ("dra_claim_name", self.claim_name),
            ("dra_claim_namespace", self.claim_namespace),
            ("dra_device_name", self.device),
            ("dra_driver_name", self.driver),
            ("dra_pool_name", self.pool),
            ("namespace", self.claim_namespace),  # a pod uses claims of its own namespace only
        ]
        pods = {(h.namespace, h.pod) for h in self.holders}
        if len(pods) == 1:
            pairs.append(("pod", self.holders[0].pod))
            if len(self.holders) == 1:
                pairs.append(("container", self.holders[0].container))
        return sorted(pairs)


def claim_device_uses(
    attribution: AttributionSnapshot | None, driver: str | None, plans: Mapping[str, ClaimPlan]
) -> tuple[ClaimDeviceUse, ...]:
    """The devices of the DRA claims this node prepared (plans, by claim UID) that the kubelet lists
    for a container, joined by the CDI device IDs the kubelet was given (`<driver>/claim=<uid>-<n>`:
    result n of the claim's plan). Devices of other drivers, and IDs that are not of a prepared claim,
    are left out."""
    if attribution is None or driver is None or not plans:
        return ()
    found: dict[tuple[str, int], tuple[str, str, set[PodRef]]] = {}
    for c in attribution.claims:
        for d in c.devices:
            if d.driver != driver:
                continue
            for cdi_id in d.cdi_ids:
                parsed = dra_names.claim_of_cdi_id(driver, cdi_id)
                plan = plans.get(parsed[0]) if parsed is not None else None
                if parsed is None or plan is None or parsed[1] >= len(plan.devices):
                    continue
                planned = plan.devices[parsed[1]]
                if (planned.pool, planned.device) != (d.pool, d.device):
                    continue  # not what this node prepared under that ID
                entry = found.setdefault(parsed, (c.claim_name, c.claim_namespace, set()))
                entry[2].add(PodRef(c.namespace, c.pod, c.container))
    out = []
    for (uid, n), (name, namespace, holders) in sorted(found.items()):
        planned = plans[uid].devices[n]
        out.append(
            ClaimDeviceUse(
                claim_uid=uid,
                claim_name=name,
                claim_namespace=namespace,
                driver=driver,
                pool=planned.pool,
                device=planned.device,
                gpu_uuid=planned.gpu_uuid,
                mig_uuid=planned.mig_uuid,
                capped=planned.memory_bytes is not None,
                holders=tuple(sorted(holders, key=lambda h: (h.namespace, h.pod, h.container))),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class ContainerCompute:
    """One container's compute share and use, from its region (what its interposer reported)."""

    share_milli: int  # 0: no share written
    achieved_share: float | None  # GPU time over wall time in the last 10 s; None until two readings
    busy_s: float
    throttled_s: float


@dataclass(frozen=True)
class ContainerMemory:
    """GPU memory one container uses on one device, and its cap there, from the interposer's region."""

    region: str
    gpu_uuid: str  # the physical GPU (the parent, for a MIG device)
    gpu_index: int | None  # None when the GPU is no longer listed
    mig: MigDevice | None  # set when the capped device is a MIG device
    used_bytes: int
    limit_bytes: int
    owner: ContainerDevices | None  # None when the kubelet lists no container for the region
    compute: ContainerCompute | None = None
    claim: ClaimDeviceUse | None = None  # the region of a DRA claim: the claim's device on this GPU


@dataclass(frozen=True)
class DeviceState:
    """One advertised device ID: its health and its holder."""

    device_id: str
    resource: str
    gpu_uuid: str
    gpu_index: int | None
    healthy: bool
    owner: PodRef | None


@dataclass(frozen=True)
class GpuSampleTime:
    """When one GPU (by NVML index and UUID) was last sampled successfully."""

    gpu_index: int
    uuid: str
    timestamp_s: float  # time.time() of the GPU's last successful sample


@dataclass(frozen=True)
class NodeSnapshot:
    """Everything a scrape shows about the devices, as of collected_at_s (seconds since the epoch)."""

    seq: int
    collected_at_s: float
    entities: tuple[Entity, ...] = ()
    sample_times: tuple[GpuSampleTime, ...] = ()
    containers: tuple[ContainerMemory, ...] = ()
    devices: tuple[DeviceState, ...] = ()

    def entity(self, key: EntityKey) -> Entity | None:
        """The GPU or MIG device with this (GPU UUID, MIG UUID or None) key, or None when absent."""
        return next((e for e in self.entities if e.key == key), None)


@dataclass(frozen=True)
class LabelStyle:
    """Label spellings and constant values shared by every series of one node."""

    hostname: str
    hostname_label: str = "Hostname"
    driver_version: str | None = None


def _base_labels(gpu: Gpu, mig: MigDevice | None, style: LabelStyle) -> list[tuple[str, str]]:
    pairs = [
        ("gpu", str(gpu.index)),
        ("UUID", gpu.uuid),
        ("pci_bus_id", gpu.pci_bus_id),
        ("device", f"nvidia{gpu.index}"),
        ("modelName", gpu.model),
    ]
    if mig is not None:
        pairs += [("GPU_I_PROFILE", mig.profile), ("GPU_I_ID", str(mig.gi_id))]
    pairs.append((style.hostname_label, style.hostname))
    if style.driver_version:
        pairs.append(("DCGM_FI_DRIVER_VERSION", style.driver_version))
    return pairs


def owner_labels(owner: PodRef) -> list[tuple[str, str]]:
    """Pod labels in dcgm-exporter's (sorted) order."""
    return [("container", owner.container), ("namespace", owner.namespace), ("pod", owner.pod)]


def find_owners(
    gpus: Sequence[Gpu], inventory: Inventory | None, attribution: AttributionSnapshot | None
) -> dict[EntityKey, PodRef]:
    """Which pod holds each whole GPU or MIG instance (shared GPUs have no single holder)."""
    if attribution is None:
        return {}
    owners: dict[EntityKey, PodRef] = {}
    if inventory is not None:
        for d in inventory.devices:
            owner = attribution.owner_of(d.id)
            if owner is None:
                continue
            if d.kind == "gpu":
                owners[(d.gpu_uuid, None)] = owner
            elif d.kind == "mig" and d.mig_uuid is not None:
                owners[(d.gpu_uuid, d.mig_uuid)] = owner
    # Device IDs that are plain UUIDs identify their GPU or instance without the inventory.
    for g in gpus:
        owner = attribution.owner_of(g.uuid)
        if owner is not None:
            owners.setdefault((g.uuid, None), owner)
        for m in g.mig_devices:
            owner = attribution.owner_of(m.uuid)
            if owner is not None:
                owners.setdefault((g.uuid, m.uuid), owner)
    return owners


def _gpu_values(sample: GpuSample | None, prev: GpuSample | None) -> dict[str, str]:
    if sample is None:
        return {}
    out: dict[str, str] = {}
    for f in FIELDS:
        if f.gpu_value is None:
            continue
        v = f.gpu_value(sample, prev)
        if v is not None:
            out[f.name] = format_value(v, integer=f.integer)
    return out


def _mig_values(sample: GpuSample | None, mig_uuid: str) -> dict[str, str]:
    ms = next((m for m in sample.mig if m.uuid == mig_uuid), None) if sample is not None else None
    if ms is None:
        return {}
    out: dict[str, str] = {}
    for f in FIELDS:
        if f.mig_value is None:
            continue
        v = f.mig_value(ms)
        if v is not None:
            out[f.name] = format_value(v, integer=f.integer)
    return out


def build_snapshot(
    *,
    seq: int,
    collected_at_s: float,
    gpus: Sequence[Gpu],
    samples: Mapping[str, GpuSample],
    previous_samples: Mapping[str, GpuSample],
    last_sample_times: Mapping[str, float],
    style: LabelStyle,
    inventory: Inventory | None = None,
    unhealthy: Mapping[str, str] | None = None,
    attribution: AttributionSnapshot | None = None,
    regions: Sequence[tuple[str, str, int, int]] = (),
    compute: Mapping[str, ContainerCompute] | None = None,
    claims: Sequence[ClaimDeviceUse] = (),
) -> NodeSnapshot:
    """Assemble one snapshot.

    samples holds this collection's sample per GPU UUID (a GPU that could not
    be read is missing, and so are its values); previous_samples the one
    before, for rates. regions holds (region key, device UUID, used bytes,
    limit bytes) per device of each memory-cap region; the device is a GPU or
    a MIG device. compute holds each region's compute share and use, by region key. claims holds the
    devices of prepared DRA claims in use (claim_device_uses): a whole GPU or a MIG placement labels its
    entity with the claim (when it is the one claim holding it: time-sliced claims share a GPU uncapped);
    a share labels the claim's region.
    """
    owners = find_owners(gpus, inventory, attribution)
    held: dict[EntityKey, ClaimDeviceUse] = {}
    holders: dict[EntityKey, int] = {}
    for use in claims:
        if not use.capped:
            held.setdefault((use.gpu_uuid, use.mig_uuid), use)
            holders[(use.gpu_uuid, use.mig_uuid)] = holders.get((use.gpu_uuid, use.mig_uuid), 0) + 1
    # A GPU several uncapped claims share (time-sliced) has no one holder: its series name none of them.
    held = {k: v for k, v in held.items() if holders[k] == 1}
    entities: list[Entity] = []
    for g in gpus:
        sample = samples.get(g.uuid)
        for mig in (None, *g.mig_devices):
            key: EntityKey = (g.uuid, mig.uuid if mig else None)
            base = _base_labels(g, mig, style)
            owner = owners.get(key)
            claim = held.get(key) if owner is None else None
            full = base + (owner_labels(owner) if owner else claim.labels() if claim else [])
            values = (
                _gpu_values(sample, previous_samples.get(g.uuid))
                if mig is None
                else _mig_values(sample, mig.uuid)
            )
            entities.append(
                Entity(
                    key=key,
                    gpu_index=g.index,
                    base_pairs=tuple(base),
                    base_labels=render_labels(base),
                    labels=render_labels(full),
                    owner=owner,
                    values=values,
                    claim=claim,
                )
            )
    index_of = {g.uuid: g.index for g in gpus}
    sample_times = tuple(
        GpuSampleTime(g.index, g.uuid, last_sample_times[g.uuid]) for g in gpus if g.uuid in last_sample_times
    )
    return NodeSnapshot(
        seq=seq,
        collected_at_s=collected_at_s,
        entities=tuple(entities),
        sample_times=sample_times,
        containers=_container_memory(regions, attribution, inventory, gpus, compute or {}, claims),
        devices=_device_states(inventory, unhealthy or {}, attribution, index_of),
    )


def _container_memory(
    regions: Sequence[tuple[str, str, int, int]],
    attribution: AttributionSnapshot | None,
    inventory: Inventory | None,
    gpus: Sequence[Gpu],
    compute: Mapping[str, ContainerCompute],
    claims: Sequence[ClaimDeviceUse] = (),
) -> tuple[ContainerMemory, ...]:
    by_region: dict[tuple[str, str], ClaimDeviceUse] = {}
    for use in claims:
        if use.capped:
            key = dra_names.claim_region_key(use.claim_uid)
            by_region.setdefault((key, use.mig_uuid or use.gpu_uuid), use)
    where: dict[str, tuple[Gpu, MigDevice | None]] = {g.uuid: (g, None) for g in gpus}
    where.update({m.uuid: (g, m) for g in gpus for m in g.mig_devices})
    holders: dict[str, ContainerDevices] = {}
    if attribution is not None:
        ours = set(inventory.resources()) if inventory is not None else None
        for c in attribution.containers:
            if ours is None or c.resource_name in ours:
                holders.setdefault(region_key(c.device_ids), c)
    out: list[ContainerMemory] = []
    for key, device_uuid, used, limit in regions:
        gpu, mig = where.get(device_uuid, (None, None))
        out.append(
            ContainerMemory(
                region=key,
                gpu_uuid=gpu.uuid if gpu is not None else device_uuid,
                gpu_index=gpu.index if gpu is not None else None,
                mig=mig,
                used_bytes=used,
                limit_bytes=limit,
                owner=holders.get(key),
                compute=compute.get(key),
                claim=by_region.get((key, device_uuid)),
            )
        )
    return tuple(out)


def _device_states(
    inventory: Inventory | None,
    unhealthy: Mapping[str, str],
    attribution: AttributionSnapshot | None,
    index_of: Mapping[str, int],
) -> tuple[DeviceState, ...]:
    if inventory is None:
        return ()
    return tuple(
        DeviceState(
            device_id=d.id,
            resource=d.resource,
            gpu_uuid=d.gpu_uuid,
            gpu_index=index_of.get(d.gpu_uuid),
            healthy=d.id not in unhealthy,
            owner=attribution.owner_of(d.id) if attribution is not None else None,
        )
        for d in inventory.devices
    )
