"""How the simulated GPUs look from outside: UUIDs, Gpu snapshots, NVLink peers, hot-plug slots.

These are pure functions of a SimProfile and the SimGpu objects present;
SimBackend (backend.py) calls them under its lock and keeps all the state.
UUIDs are deterministic: uuid5 of the profile name, its seed and the GPU's slot.
"""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Collection
from dataclasses import dataclass

from gpunode.errors import SimFaultError
from gpunode.node.devices.base import Gpu, MigDevice
from gpunode.node.devices.simnode.gpu import SimGpu
from gpunode.node.devices.simnode.mig import GI_ID_BASE, MIG_TABLES, TOTAL_COMPUTE_SLICES
from gpunode.node.devices.simnode.profile import MigPlacement, SimModel, SimProfile

_NAMESPACE = uuidlib.uuid5(uuidlib.NAMESPACE_DNS, "sim.gpunode.io")


@dataclass(frozen=True)
class SimGpuState:
    """What the simulator knows about one GPU beyond its Gpu snapshot (for `gpunode sim list`)."""

    gpu: Gpu
    lost: bool
    ecc_sbe_volatile: int
    ecc_dbe_volatile: int
    row_remap_pending: bool | None
    row_remap_failure: bool | None
    retired_pages_pending: bool | None
    probe_delay_s: float
    processes: int


def gpu_state(gpu: Gpu, gs: SimGpu) -> SimGpuState:
    """The fault state of one GPU; None for what its model does not have."""
    m = gs.model
    return SimGpuState(
        gpu=gpu,
        lost=gs.lost,
        ecc_sbe_volatile=gs.ecc_sbe,
        ecc_dbe_volatile=gs.ecc_dbe,
        row_remap_pending=gs.remap_pending if m.supports("row_remapping") else None,
        row_remap_failure=gs.remap_failure if m.supports("row_remapping") else None,
        retired_pages_pending=gs.retired_pages_pending if m.supports("page_retirement") else None,
        probe_delay_s=gs.probe_delay_s,
        processes=len(gs.processes),
    )


def gpu_uuid(profile: SimProfile, what: str) -> str:
    """The UUID of the GPU `what` names ("gpu/<index>" for a profile slot, "added/<n>" for a hot-plugged one)."""
    return f"GPU-{uuidlib.uuid5(_NAMESPACE, f'{profile.name}/{profile.seed}/{what}')}"


def make_gpu(
    index: int,
    uuid: str,
    model: SimModel,
    bus: str,
    numa: int | None,
    minor: int,
    mig: tuple[MigPlacement, ...] | None,
) -> Gpu:
    """The Gpu snapshot of a simulated GPU, with its MIG devices (their UUIDs derive from the GPU's)."""
    devices = tuple(
        MigDevice(
            uuid=f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{uuid}/mig/{p.gi_id}/{p.ci_id}')}",
            parent_uuid=uuid,
            index=i,
            profile=p.profile,
            gi_id=p.gi_id,
            ci_id=p.ci_id,
            slices=p.compute_slices,
            memory_total_bytes=p.memory_bytes,
            start=p.start,
        )
        for i, p in enumerate(mig or ())
    )
    return Gpu(
        index=index,
        uuid=uuid,
        model=model.name,
        memory_total_bytes=model.memory_total_bytes,
        pci_bus_id=bus,
        numa_node=numa,
        minor=minor,
        mig_enabled=mig is not None,
        mig_devices=devices,
        architecture=model.architecture,
    )


def created_mig(gpu: Gpu, table: str, profile: str, start: int, serial: int) -> MigDevice:
    """The MIG device an instance created at run time is (SimBackend.create_mig): its GPU instance ID
    numbered as the profile layouts number them, a UUID new for every creation (as NVML's), the lowest
    free MIG device index. SimFaultError naming why the placement is not possible on the GPU."""
    spec = MIG_TABLES[table].get(profile)
    if spec is None:
        raise SimFaultError(
            f"GPU {gpu.uuid}: {profile!r} is not a MIG profile of this GPU (profiles: {', '.join(MIG_TABLES[table])})"
        )
    if start not in spec.starts:
        raise SimFaultError(
            f"GPU {gpu.uuid}: {profile} cannot start at memory slice {start} "
            f"(its placements start at {', '.join(map(str, spec.starts))})"
        )
    cells = set(range(start, start + spec.memory_slices))
    compute = spec.compute_slices
    for mig in gpu.mig_devices:
        other = MIG_TABLES[table].get(mig.profile)
        if other is None or mig.start is None:
            continue
        compute += other.compute_slices
        if cells & set(range(mig.start, mig.start + other.memory_slices)):
            raise SimFaultError(
                f"GPU {gpu.uuid}: {profile} at memory slice {start} overlaps MIG device {mig.uuid} "
                f"({mig.profile} at {mig.start})"
            )
    if compute > TOTAL_COMPUTE_SLICES:
        raise SimFaultError(
            f"GPU {gpu.uuid}: {profile} needs {spec.compute_slices} more compute slices than are free"
        )
    gi_id = GI_ID_BASE[spec.memory_slices] + start // spec.memory_slices
    taken = {m.index for m in gpu.mig_devices}
    return MigDevice(
        uuid=f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{gpu.uuid}/mig/{gi_id}/0/created/{serial}')}",
        parent_uuid=gpu.uuid,
        index=next(i for i in range(len(taken) + 1) if i not in taken),
        profile=profile,
        gi_id=gi_id,
        ci_id=0,
        slices=spec.compute_slices,
        memory_total_bytes=spec.memory_bytes,
        start=start,
    )


def nvlink_peers(profile: SimProfile, gs: SimGpu, present: Collection[SimGpu]) -> tuple[str, ...]:
    """The UUIDs of the GPUs gs reaches over NVLink, by index (none while it or they are lost)."""
    if gs.lost or profile.nvlink == "none":
        return ()
    others = [o for o in present if o is not gs and not o.lost]
    if profile.nvlink == "nvswitch":
        peers = [o for o in others if o.model.supports("nvlink")] if gs.model.supports("nvlink") else []
    else:
        # Index pairs name profile slots; a GPU hot-added into a slot takes over its links.
        pairs = set(profile.nvlink_pairs)
        me = gs.gpu.index
        peers = [o for o in others if (min(me, o.gpu.index), max(me, o.gpu.index)) in pairs]
    return tuple(o.gpu.uuid for o in sorted(peers, key=lambda o: o.gpu.index))


def hotplug_slot(
    profile: SimProfile, index: int, sim_model: SimModel | None, present: Collection[SimGpu]
) -> tuple[SimModel, str, int | None, int, tuple[MigPlacement, ...] | None]:
    """Where a GPU hot-added at index sits: its model, PCI bus ID, NUMA node, minor and MIG layout.

    A free profile slot keeps its bus ID and MIG layout (the layout only for the slot's own
    model); any other index gets a bus in a second PCI domain and no NUMA affinity.
    """
    slot = profile.gpus[index] if index < len(profile.gpus) else None
    taken_bus = {s.gpu.pci_bus_id for s in present}
    taken_minor = {s.gpu.minor for s in present}
    if slot is not None and slot.pci_bus_id not in taken_bus and slot.minor not in taken_minor:
        slot_model = profile.model(slot.model)
        sim_model = sim_model or slot_model
        mig = slot.mig if sim_model is slot_model else None
        bus, numa, minor = slot.pci_bus_id, slot.numa_node, slot.minor
    else:
        sim_model = sim_model or profile.model(profile.gpus[0].model)
        # A slot the profile does not have: a bus in a second PCI domain, no NUMA affinity known.
        free_bus = [b for b in (f"00000001:{n:02X}:00.0" for n in range(256)) if b not in taken_bus]
        if not free_bus:
            raise SimFaultError("no free simulated PCI bus is left for another GPU")
        bus = free_bus[0]
        numa, mig = None, None
        minor = next(m for m in range(index, index + 1 + len(taken_minor)) if m not in taken_minor)
    return sim_model, bus, numa, minor, mig
