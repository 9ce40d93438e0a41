"""Reading a memory-cap region's usage, and reclaiming what exited processes held.

Both go through the guarded C wrappers: a usage file that its container
truncated, removed or rewrote raises RegionDamaged (and is recorded in
problems.PROBLEMS, logged once), and what was read from it is thrown away.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from gpunode.errors import RegionDamaged
from gpunode.node.memcap.compute import ComputeReport, compute_of_report
from gpunode.node.memcap.problems import PROBLEMS
from gpunode.node.memcap.region import Region, _native, _opened, _region_of, _status_error

log = logging.getLogger("gpunode.node.memcap")


@dataclass(frozen=True)
class ProcessUsage:
    """One process's usage. pid is as the process saw itself (its container's pid namespace).

    alive is False only when the process is known to be gone (its slot lock is free);
    an unknown state counts as alive, so nothing is reclaimed on a guess.
    """

    pid: int
    used_bytes: int
    alive: bool
    per_device_bytes: tuple[int, ...] = ()
    start_ticks: int = 0


@dataclass(frozen=True)
class DeviceUsage:
    """One device's cap and the bytes counted against it."""

    uuid: str
    limit_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class RegionUsage:
    """Usage of a region. limit_bytes and used_bytes are summed over its devices (see devices).

    used_bytes is what the cap is checked against; reclaimable_bytes is the part held by
    processes known to be gone, which reclaim_dead (or the next allocating process) returns.
    """

    key: str
    gpu_uuid: str
    limit_bytes: int
    used_bytes: int
    per_process: tuple[ProcessUsage, ...]
    devices: tuple[DeviceUsage, ...] = ()
    registrations: int = 0
    reclaimable_bytes: int = 0
    compute: ComputeReport | None = None  # the compute block, as the container left it


def _region_path(region_or_dir: Region | str | os.PathLike[str]) -> Path:
    return region_or_dir.path if isinstance(region_or_dir, Region) else Path(region_or_dir)


def read_usage(region_or_dir: Region | str | os.PathLike[str]) -> RegionUsage:
    """A snapshot of a region's usage, per device and per process; RegionDamaged if it cannot be read."""
    m = _native()
    path = _region_path(region_or_dir)
    report = m.ffi.new("struct gpunode_memcap_report *")
    try:
        with _opened(path, writable=False) as handle:
            region = _region_of(handle, path)
            status = m.lib.gpunode_memcap_guarded_report(handle, report)
            if status != m.lib.GPUNODE_MEMCAP_OK:
                errno_value = m.lib.gpunode_memcap_region_errno(handle)
                raise _status_error(status, path, errno_value, usage_part=True)
    except RegionDamaged as exc:
        PROBLEMS.bad(path, exc)
        raise
    PROBLEMS.good(path)
    count = len(region.devices)
    devices = tuple(
        DeviceUsage(cap.uuid, cap.limit_bytes, int(report.used_bytes[d]))
        for d, cap in enumerate(region.devices)
    )
    processes = []
    for i in range(report.process_count):
        p = report.processes[i]
        per_device = tuple(int(p.used_bytes[d]) for d in range(count))
        processes.append(
            ProcessUsage(int(p.pid), sum(per_device), p.alive != 0, per_device, int(p.start_ticks))
        )
    return RegionUsage(
        key=region.key,
        gpu_uuid=region.gpu_uuid,
        limit_bytes=sum(d.limit_bytes for d in devices),
        used_bytes=sum(d.used_bytes for d in devices),
        per_process=tuple(processes),
        devices=devices,
        registrations=int(report.registrations),
        reclaimable_bytes=sum(p.used_bytes for p in processes if not p.alive),
        compute=compute_of_report(report),
    )


def reclaim_dead(region_or_dir: Region | str | os.PathLike[str]) -> int:
    """Return the usage of processes that are gone (even SIGKILLed) to the region; bytes reclaimed.

    With no live process left, usage that no process accounts for is returned too. RegionDamaged if the
    usage file is unusable (a fault part-way counts as nothing reclaimed).
    """
    m = _native()
    path = _region_path(region_or_dir)
    reclaimed_bytes = m.ffi.new("uint64_t *")
    reclaimed_slots = m.ffi.new("uint32_t *")
    try:
        with _opened(path, writable=True) as handle:
            status = m.lib.gpunode_memcap_guarded_reclaim_dead(handle, reclaimed_bytes, reclaimed_slots)
            if status != m.lib.GPUNODE_MEMCAP_OK:
                errno_value = m.lib.gpunode_memcap_region_errno(handle)
                raise _status_error(status, path, errno_value, usage_part=True)
    except RegionDamaged as exc:
        PROBLEMS.bad(path, exc)
        raise
    PROBLEMS.good(path)
    if reclaimed_bytes[0]:
        log.info(
            "region %s: reclaimed %d bytes from %d exited process(es)",
            path,
            reclaimed_bytes[0],
            reclaimed_slots[0],
        )
    return int(reclaimed_bytes[0])
