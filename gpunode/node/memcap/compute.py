"""The compute share in a region: what the agent writes (share, mode) and reads back.

The usage file (layout version 2) carries one compute block per container: the share
in thousandths of the GPU and the mode, written here with a generation the preload
library reads on every refill of its budget; and the GPU time the container's work
took, the time its launches were held back and its launch count, written by the
library. All of it lives in memory the container can write, so what is read back is
a claim to be cross-checked against the driver's own per-process figures, never a
fact (see cross_check).

Must not: import the metrics or the kubelet side; trust a compute report alone.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from gpunode.contract.names import MILLI_PER_GPU
from gpunode.contract.share import parse_compute_share
from gpunode.errors import RegionDamaged
from gpunode.node.memcap.problems import PROBLEMS
from gpunode.node.memcap.region import Region, _native, _opened, _status_error


class ComputeMode(IntEnum):
    """How the share is enforced (GPUNODE_COMPUTE_MODE_* in gpunode_memcap.h)."""

    OFF = 0  # measured only
    HARD = 1  # never above the share
    WORK_CONSERVING = 2  # above the share while the GPU has idle time; the default


DEFAULT_MODE = ComputeMode.WORK_CONSERVING
TAMPERED_MODE = 0xFFFFFFFF  # the report's mode when the control word is not one the agent wrote


def share_from_memory(memory_bytes: int, total_bytes: int) -> int:
    """The default share of a pod that asks for none: proportional to its memory share (at least 1)."""
    if total_bytes <= 0 or memory_bytes <= 0:
        return MILLI_PER_GPU
    return max(1, min(MILLI_PER_GPU, math.floor(memory_bytes * MILLI_PER_GPU / total_bytes)))


def set_compute_share(
    region: Region | str | os.PathLike[str], share_milli: int, mode: ComputeMode = DEFAULT_MODE
) -> None:
    """Write the share and mode into the region (the generation is bumped); applies within a refill tick."""
    share = parse_compute_share(share_milli, what="compute share")
    m = _native()
    path = region.path if isinstance(region, Region) else Path(region)
    try:
        with _opened(path, writable=True) as handle:
            status = m.lib.gpunode_memcap_guarded_compute_set(handle, share, int(mode))
            if status != m.lib.GPUNODE_MEMCAP_OK:
                raise _status_error(status, path, m.lib.gpunode_memcap_region_errno(handle), usage_part=True)
    except RegionDamaged as exc:
        PROBLEMS.bad(path, exc)
        raise


@dataclass(frozen=True)
class ProcessCompute:
    """One process's GPU time as its interposer reported it."""

    pid: int
    busy_ns: int
    throttled_ns: int
    launches: int
    alive: bool


@dataclass(frozen=True)
class ComputeReport:
    """A region's compute block as read (a container may have written any of it)."""

    share_milli: int
    mode: int  # a ComputeMode, or TAMPERED_MODE
    generation: int
    budget_ns: int
    busy_ns: int
    throttled_ns: int
    launches: int
    per_process: tuple[ProcessCompute, ...]

    @property
    def tampered(self) -> bool:
        """The control word is not one the agent wrote (the container rewrote it)."""
        return self.mode == TAMPERED_MODE


def compute_of_report(report: Any) -> ComputeReport:
    """The compute part of a struct gpunode_memcap_report (read through the guarded wrapper)."""
    c = report.compute
    processes = tuple(
        ProcessCompute(int(p.pid), int(p.busy_ns), int(p.throttled_ns), int(p.launches), p.alive != 0)
        for p in (report.processes[i] for i in range(report.process_count))
    )
    return ComputeReport(
        share_milli=int(c.share_milli),
        mode=int(c.mode),
        generation=int(c.generation),
        budget_ns=int(c.budget_ns),
        busy_ns=int(c.busy_ns),
        throttled_ns=int(c.throttled_ns),
        launches=int(c.launches),
        per_process=processes,
    )


def read_compute(region: Region | str | os.PathLike[str]) -> ComputeReport:
    """The region's compute block and per-process figures; RegionDamaged if the usage file is unusable."""
    m = _native()
    path = region.path if isinstance(region, Region) else Path(region)
    report = m.ffi.new("struct gpunode_memcap_report *")
    try:
        with _opened(path, writable=False) as handle:
            status = m.lib.gpunode_memcap_guarded_report(handle, report)
            if status != m.lib.GPUNODE_MEMCAP_OK:
                raise _status_error(status, path, m.lib.gpunode_memcap_region_errno(handle), usage_part=True)
    except RegionDamaged as exc:
        PROBLEMS.bad(path, exc)
        raise
    return compute_of_report(report)


@dataclass(frozen=True)
class ShareCheck:
    """One window of one container's compute use, as the driver saw it and as its region claims.

    driver_share is the container's processes' GPU time by the driver's per-process figures (NVML on a
    real GPU) over the window's wall time; reported_share is the same from the region's busy counter.
    """

    driver_share: float
    reported_share: float
    over_share: bool  # hard mode, and the driver says above the share by more than the tolerance
    under_reported: (
        bool  # the driver saw more GPU time than the region claims (a bypass or a tampered counter)
    )


@dataclass
class ShareWatch:
    """The agent's cross-check of one container's compute share against the driver's figures.

    Feed it one window at a time (observe); it flags the container once it has been above its hard share,
    by the driver's figures, for flag_after_s in a row, or has reported less GPU time than the driver saw
    for as long. The tolerance covers measurement noise (the driver samples, the interposer's windows are
    not the agent's).
    """

    share_milli: int
    mode: ComputeMode
    flag_after_s: float = 30.0
    tolerance: float = 0.05
    over_s: float = 0.0
    under_s: float = 0.0

    def observe(self, window_s: float, driver_busy_ns: int, reported_busy_ns: int) -> ShareCheck:
        """Account one window of window_s seconds: the container's GPU time by the driver and by its region."""
        wall_ns = window_s * 1e9
        driver = driver_busy_ns / wall_ns if wall_ns > 0 else 0.0
        reported = reported_busy_ns / wall_ns if wall_ns > 0 else 0.0
        over = self.mode == ComputeMode.HARD and driver > self.share_milli / MILLI_PER_GPU + self.tolerance
        under = driver > reported + self.tolerance
        self.over_s = self.over_s + window_s if over else 0.0
        self.under_s = self.under_s + window_s if under else 0.0
        return ShareCheck(driver, reported, over, under)

    @property
    def flagged(self) -> bool:
        """Above its hard share, or under-reporting, for flag_after_s in a row."""
        return self.over_s >= self.flag_after_s or self.under_s >= self.flag_after_s

    def reason(self) -> str:
        """One line for the Warning event, naming the problem and the remedy."""
        if self.over_s >= self.flag_after_s:
            return (
                f"above its hard compute share of {self.share_milli}/{MILLI_PER_GPU} for {self.over_s:.0f}s by the "
                "driver's figures; its launches bypass or defeat the interposer (evict it, or give it a larger share)"
            )
        if self.under_s >= self.flag_after_s:
            return (
                f"the driver saw more GPU time than its region reports for {self.under_s:.0f}s; it runs work outside "
                "the interposer or rewrites its counters (evict it)"
            )
        return ""
