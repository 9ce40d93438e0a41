"""What NVML says about one GPU's place in the machine: bus ID, NUMA node, minor number,
memory, MIG devices and NVLink peers (see backend.py for the order discovery reads them in)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpunode.contract.deviceids import normalize_pci_bus_id
from gpunode.contract.names import MIB
from gpunode.errors import BackendError, GpuLostError
from gpunode.node.devices.base import Gpu, MigDevice
from gpunode.node.devices.nvml.query import ERR_INVALID_ARGUMENT, NvmlQuery

NVML_NVLINK_DEVICE_TYPE_GPU = 0
NVML_NVLINK_DEVICE_TYPE_SWITCH = 2


def _sysfs_bdf(bus_id: str) -> str:
    """The sysfs form of a bus ID: 4-digit domain, lower case ("0000:18:00.0")."""
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def memory_total(q: NvmlQuery, handle: Any, uuid: str) -> int:
    """The GPU's total memory in bytes (nvmlDeviceGetMemoryInfo, the v2 struct where the driver has it)."""
    version = q.const("nvmlMemory_v2", None)
    info = None
    if version is not None:
        info = q.call("nvmlDeviceGetMemoryInfo", handle, uuid=uuid, version=version)
    if info is None:
        info = q.require("nvmlDeviceGetMemoryInfo", handle, uuid=uuid)
    return int(info.total)


def numa_node(q: NvmlQuery, sysfs: Path, handle: Any, uuid: str, bus: str) -> int | None:
    """The GPU's NUMA node from NVML, else from sysfs; None when it has none."""
    node = q.call("nvmlDeviceGetNumaNodeId", handle, uuid=uuid)
    if node is None:
        try:
            node = int((sysfs / "bus/pci/devices" / _sysfs_bdf(bus) / "numa_node").read_text())
        except (OSError, ValueError):
            return None
    return int(node) if int(node) >= 0 else None


def minor_number(q: NvmlQuery, procfs: Path, handle: Any, uuid: str, bus: str) -> int:
    """The GPU's /dev/nvidia<minor> number from NVML, else from /proc/driver/nvidia."""
    minor = q.call("nvmlDeviceGetMinorNumber", handle, uuid=uuid)
    if minor is not None:
        return int(minor)
    info = procfs / "driver/nvidia/gpus" / _sysfs_bdf(bus) / "information"
    try:
        m = re.search(r"^Device Minor:\s*(\d+)", info.read_text(), re.MULTILINE)
    except OSError:
        m = None
    if m is None:
        raise BackendError(f"cannot tell the device minor number of GPU {uuid} (NVML and {info} give none)")
    return int(m.group(1))


def discover_mig(q: NvmlQuery, handle: Any, uuid: str) -> tuple[tuple[Any, MigDevice], ...]:
    """The MIG devices of a MIG-enabled GPU with their NVML handles, by MIG device index."""
    found = []
    for i in range(int(q.call("nvmlDeviceGetMaxMigDeviceCount", handle, uuid=uuid) or 0)):
        mh = q.call(
            "nvmlDeviceGetMigDeviceHandleByIndex", handle, i, uuid=uuid, absent=(ERR_INVALID_ARGUMENT,)
        )
        if mh is None:
            continue  # no MIG device in this slot
        name = str(q.call("nvmlDeviceGetName", mh, uuid=uuid) or "")
        attrs = q.call("nvmlDeviceGetAttributes", mh, uuid=uuid)
        profile = name.rsplit(" MIG ", 1)[1].strip() if " MIG " in name else ""
        if not profile and attrs is not None:
            profile = f"{attrs.gpuInstanceSliceCount}g.{round(attrs.memorySizeMB / 1024)}gb"
        slices_match = re.search(r"(\d+)g\.", profile)
        if attrs is not None:
            slices = int(attrs.gpuInstanceSliceCount)
        elif slices_match:
            slices = int(slices_match.group(1))
        else:
            raise BackendError(f"cannot tell the size of MIG device {i} on GPU {uuid} (name {name!r})")
        mem = q.call("nvmlDeviceGetMemoryInfo", mh, uuid=uuid)
        if mem is None and attrs is None:
            raise BackendError(f"cannot tell the memory of MIG device {i} on GPU {uuid}")
        gi_id = int(q.require("nvmlDeviceGetGpuInstanceId", mh, uuid=uuid))
        device = MigDevice(
            uuid=str(q.require("nvmlDeviceGetUUID", mh, uuid=uuid)),
            parent_uuid=uuid,
            index=i,
            profile=profile or f"{slices}g",
            gi_id=gi_id,
            ci_id=int(q.require("nvmlDeviceGetComputeInstanceId", mh, uuid=uuid)),
            slices=slices,
            memory_total_bytes=int(mem.total) if mem is not None else int(attrs.memorySizeMB) * MIB,
            start=placement_start(q, handle, gi_id, uuid),
        )
        found.append((mh, device))
    return tuple(found)


def placement_start(q: NvmlQuery, handle: Any, gi_id: int, uuid: str) -> int | None:
    """The first memory slice of GPU instance gi_id (nvmlGpuInstanceGetInfo's placement); None where
    NVML does not say (the caller must not guess it from the instance ID: the driver numbers them)."""
    gi = q.call("nvmlDeviceGetGpuInstanceById", handle, gi_id, uuid=uuid, absent=(ERR_INVALID_ARGUMENT,))
    info = q.call("nvmlGpuInstanceGetInfo", gi, uuid=uuid) if gi is not None else None
    placement = getattr(info, "placement", None)
    start = getattr(placement, "start", None)
    return int(start) if isinstance(start, int) else None


def nvlink_peers(q: NvmlQuery, found: Sequence[tuple[Gpu, Any]]) -> dict[str, set[str]]:
    """UUIDs of the GPUs each GPU reaches over an active NVLink (directly or through NVSwitch)."""
    by_bus = {g.pci_bus_id: g.uuid for g, _ in found}
    peers: dict[str, set[str]] = {g.uuid: set() for g, _ in found}
    on_switch: set[str] = set()
    links = int(q.const("NVML_NVLINK_MAX_LINKS", 18))
    odd = (ERR_INVALID_ARGUMENT,)
    for gpu, handle in found:
        if handle is None:
            continue
        for link in range(links):
            try:
                if not q.call("nvmlDeviceGetNvLinkState", handle, link, uuid=gpu.uuid, absent=odd):
                    continue
                kind = q.call("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link, uuid=gpu.uuid, absent=odd)
                if kind == NVML_NVLINK_DEVICE_TYPE_SWITCH:
                    on_switch.add(gpu.uuid)
                    continue
                pci = q.call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link, uuid=gpu.uuid, absent=odd)
            except GpuLostError:
                break
            if pci is None or kind not in (None, NVML_NVLINK_DEVICE_TYPE_GPU):
                continue  # an IBM NPU or an unknown device at the far end
            try:
                remote = by_bus.get(normalize_pci_bus_id(str(pci.busId)))
            except ValueError:
                remote = None  # a far end NVML cannot name by bus ID is none of our GPUs
            if remote is not None and remote != gpu.uuid:
                peers[gpu.uuid].add(remote)
                peers[remote].add(gpu.uuid)
            elif remote is None and kind is None:
                on_switch.add(gpu.uuid)  # an older driver: a non-GPU remote end is the switch
    for uuid in on_switch:
        peers[uuid] |= on_switch - {uuid}
    return peers
