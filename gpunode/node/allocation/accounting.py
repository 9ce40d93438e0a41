"""Per-GPU accounting of one Snapshot: what is assigned on each GPU, given which devices are held.

The node publishes these records (gpunode.node.publish) and decides its own
GetPreferredAllocation on them (gpunode.node.allocation.preferred, through
gpunode.placement.published, as the extender does), so both see one picture.
Who holds what comes from the caller: the kubelet's pod-resources List for the
annotation, the devices the kubelet did not offer for a preferred allocation.

The rules, per sharing mode of the GPU:
- whole: a held GPU is all assigned (all compute, all memory);
- MIG: an instance is assigned when it or one of its replicas is held; the GPU's
  assigned memory is the held instances' memory, its compute share their
  compute slices out of MIG_COMPUTE_SLICES;
- fractional: assigned memory is the held memory units' sizes (at most the GPU's
  memory); the compute share follows memory, rounded down;
- time-sliced: the held share of the replicas is the compute share; memory is the
  held replicas' caps when they are capped, else the same share of the memory;
- on both, a pod that asked for a compute share (gpunode.io/gpu-milli) counts with
  the share the node gave it instead (with_explicit_shares), at most the whole GPU.
A GPU serves whole-GPU requests (servesWhole) when the node advertises it whole,
as one nvidia.com/gpu device: a fractional GPU, advertised only in memory units,
does not.
Pure functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpunode.contract.names import GPU_RESOURCE, MILLI_PER_GPU, Sharing
from gpunode.contract.nodestate import GpuRecord, MigInstance
from gpunode.node.devices.base import Gpu
from gpunode.node.inventory import AdvertisedDevice
from gpunode.node.state import Snapshot

MIG_COMPUTE_SLICES = 7  # A100/H100: a GPU has 7 compute slices


@dataclass(frozen=True)
class Assigned:
    """What is handed out of one GPU."""

    milli: int
    memory_bytes: int
    mig: tuple[MigInstance, ...] = ()


def assigned_on(
    gpu: Gpu, mode: Sharing, devices: Sequence[AdvertisedDevice], held: Sequence[AdvertisedDevice]
) -> Assigned:
    """The assigned share of one GPU in `mode`, from its advertised devices and those of them held."""
    total = gpu.memory_total_bytes
    if mode == Sharing.MIG:
        held_migs = {d.mig_uuid for d in held}
        taken = [m for m in gpu.mig_devices if m.uuid in held_migs]
        slices = sum(m.slices for m in taken)
        return Assigned(
            milli=min(MILLI_PER_GPU, slices * MILLI_PER_GPU // MIG_COMPUTE_SLICES),
            memory_bytes=min(total, sum(m.memory_total_bytes for m in taken)),
            mig=tuple(MigInstance(m.profile, m.uuid, m.uuid in held_migs) for m in gpu.mig_devices),
        )
    if mode == Sharing.FRACTIONAL:
        memory = min(total, sum(d.memory_cap_bytes or 0 for d in held))
        return Assigned(milli=memory * MILLI_PER_GPU // total if total else 0, memory_bytes=memory)
    if mode == Sharing.TIME_SLICED:
        share = len(held) / len(devices) if devices else 0.0
        caps = [d.memory_cap_bytes for d in held if d.memory_cap_bytes is not None]
        memory = min(total, sum(caps)) if caps else round(share * total)
        return Assigned(milli=round(share * MILLI_PER_GPU), memory_bytes=memory)
    return Assigned(milli=MILLI_PER_GPU, memory_bytes=total) if held else Assigned(milli=0, memory_bytes=0)


def with_explicit_shares(
    gpu: Gpu,
    mode: Sharing,
    devices: Sequence[AdvertisedDevice],
    held: Sequence[AdvertisedDevice],
    holders: Mapping[str, str],
    explicit: Mapping[tuple[str, str], int],
    assigned: Assigned,
) -> Assigned:
    """The assignment with the compute shares pods asked for (gpunode.io/gpu-milli) in place of their
    memory-proportional default, on a fractional or time-sliced GPU; at most the whole GPU."""
    if mode not in (Sharing.FRACTIONAL, Sharing.TIME_SLICED) or not explicit:
        return assigned
    total = gpu.memory_total_bytes
    by_pod: dict[str, list[AdvertisedDevice]] = {}
    for d in held:
        by_pod.setdefault(holders.get(d.id, ""), []).append(d)
    if not any((pod, gpu.uuid) in explicit for pod in by_pod if pod):
        return assigned
    milli = 0
    for pod, mine in by_pod.items():
        if pod and (pod, gpu.uuid) in explicit:
            milli += explicit[(pod, gpu.uuid)]
        elif mode == Sharing.FRACTIONAL:
            memory = sum(d.memory_cap_bytes or 0 for d in mine)
            milli += memory * MILLI_PER_GPU // total if total else 0
        else:
            milli += round(len(mine) / len(devices) * MILLI_PER_GPU) if devices else 0
    return Assigned(milli=min(MILLI_PER_GPU, milli), memory_bytes=assigned.memory_bytes, mig=assigned.mig)


def offered_whole(devices: Sequence[AdvertisedDevice]) -> bool:
    """Whether one GPU's advertised devices offer it whole: as one nvidia.com/gpu device of its own."""
    return any(d.kind == "gpu" and d.resource == GPU_RESOURCE for d in devices)


def gpu_records(
    snapshot: Snapshot, holders: Mapping[str, str], explicit: Mapping[tuple[str, str], int] | None = None
) -> tuple[GpuRecord, ...]:
    """One GpuRecord per GPU of the snapshot, in inventory order.

    holders: device ID -> "namespace/name" of the pod holding it; every device ID in it
    counts as held, and the non-empty names become the GPU's pods. explicit: ("namespace/name",
    GPU UUID) -> the compute share the node gave a pod that asked for one
    (gpunode.node.allocation.shares), counted instead of its memory-proportional default.
    """
    inv = snapshot.inventory
    records: list[GpuRecord] = []
    for gpu in inv.gpus:
        devices = [d for d in inv.devices if d.gpu_uuid == gpu.uuid]
        held = [d for d in devices if d.id in holders]
        mode = inv.mode_of(gpu.uuid) or Sharing.WHOLE
        assigned = assigned_on(gpu, mode, devices, held)
        if explicit:
            assigned = with_explicit_shares(gpu, mode, devices, held, holders, explicit, assigned)
        records.append(
            GpuRecord(
                uuid=gpu.uuid,
                index=gpu.index,
                model=gpu.model,
                memory_total_bytes=gpu.memory_total_bytes,
                milli_capacity=MILLI_PER_GPU,
                milli_assigned=assigned.milli,
                memory_assigned_bytes=assigned.memory_bytes,
                healthy=gpu.uuid not in snapshot.unhealthy,
                sharing=mode,
                serves_whole=offered_whole(devices),
                mig=assigned.mig,
                nvlink_peers=tuple(sorted(p for p in gpu.nvlink_peers if p != gpu.uuid)),
                numa_node=gpu.numa_node,
                pods=tuple(sorted({holders[d.id] for d in held} - {""})),
            )
        )
    return tuple(records)
