"""The collector's view of the memory-cap regions: how much each capped device of each container uses.

Read through gpunode.node.memcap when its native part is built; without it there
is simply no per-container memory. A region that cannot be read is counted and
logged (once per region and reason), never guessed at; the regions skipped now
are a gauge by key and reason.
"""

from __future__ import annotations

import importlib
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from gpunode.errors import MemcapError, RegionDamaged
from gpunode.node.metrics.snapshot import ContainerCompute

log = logging.getLogger("gpunode.node.metrics.collector")  # reported as the collector's own problems


@dataclass(frozen=True)
class RegionReading:
    """What the collector takes from one device of one memory-cap region."""

    key: str
    device_uuid: str  # a GPU or a MIG device
    used_bytes: int
    limit_bytes: int
    share_milli: int = 0  # the compute share the agent wrote (0: none)
    busy_ns: int = 0  # GPU time the container's work took, as its interposer reported it
    throttled_ns: int = 0  # time its launches were held back


def read_regions(root: Path | None, errors: Counter, bad: Gauge | None = None) -> list[RegionReading]:
    """One reading per capped device of every usable memory-cap region under root.

    `errors` counts the regions that could not be read in this collection; `bad` (if given) is set to
    the regions the agent skips now, by key and reason. A container can truncate or rewrite its usage
    file at any moment: such a region is skipped (memcap logs it once), never guessed at.
    """
    if root is None or not root.is_dir():
        _set_bad(bad, ())
        return []
    try:
        memcap = importlib.import_module("gpunode.node.memcap")
    except ImportError as err:  # the native part is not built: no per-container memory
        log.warning(
            "metrics: per-container memory unavailable, gpunode.node.memcap cannot be loaded: %s", err
        )
        return []
    out: list[RegionReading] = []
    try:
        regions = memcap.list_regions(root)
    except MemcapError as err:
        errors.inc()
        log.warning("metrics: cannot list memory-cap regions: %s", err)
        return []
    for region in regions:
        try:
            usage = memcap.read_usage(region.path)
        except RegionDamaged:
            continue  # recorded by memcap (region_problems) and counted below
        except MemcapError as err:
            errors.inc()
            log.warning("metrics: cannot read memory-cap region %s: %s", region.key, err)
            continue
        c = usage.compute
        compute = (c.share_milli, c.busy_ns, c.throttled_ns) if c is not None else (0, 0, 0)
        if usage.devices:  # one reading per capped device of the container
            out.extend(
                RegionReading(usage.key, d.uuid, d.used_bytes, d.limit_bytes, *compute) for d in usage.devices
            )
        else:
            out.append(
                RegionReading(usage.key, usage.gpu_uuid, usage.used_bytes, usage.limit_bytes, *compute)
            )
    problems = memcap.region_problems(root)
    read = {r.key for r in out}
    skipped = [p for p in problems if p.key not in read]
    if skipped:
        errors.inc(len(skipped))
    _set_bad(bad, problems)
    return out


def _set_bad(bad: Gauge | None, problems: Iterable[Any]) -> None:
    if bad is None:
        return
    bad.clear()
    for problem in problems:
        bad.labels(region=problem.key, reason=problem.reason).set(1)


ACHIEVED_WINDOW_S = 10.0


class ComputeHistory:
    """Each region's reported GPU time over the last ACHIEVED_WINDOW_S, for the achieved share.

    The achieved share is the growth of the region's busy time between the newest reading and the
    newest one at least ACHIEVED_WINDOW_S older (the oldest kept, until the window has filled), over
    the wall time between them. A busy counter that went backwards (a restarted or tampering
    container) starts the history again.
    """

    def __init__(self, window_s: float = ACHIEVED_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: dict[str, deque[tuple[float, int]]] = {}

    def update(self, now: float, readings: Iterable[RegionReading]) -> dict[str, ContainerCompute]:
        """Take this collection's readings; the compute view of every region read."""
        out: dict[str, ContainerCompute] = {}
        for r in readings:
            if r.key in out:
                continue  # one reading per device of a multi-device region; the counters are the region's
            seen = self._seen.setdefault(r.key, deque())
            if seen and (r.busy_ns < seen[-1][1] or now <= seen[-1][0]):
                seen.clear()
            seen.append((now, r.busy_ns))
            while len(seen) > 2 and now - seen[1][0] >= self.window_s:
                seen.popleft()
            achieved = None
            if len(seen) >= 2 and now > seen[0][0]:
                achieved = (r.busy_ns - seen[0][1]) / ((now - seen[0][0]) * 1e9)
            out[r.key] = ContainerCompute(r.share_milli, achieved, r.busy_ns / 1e9, r.throttled_ns / 1e9)
        for key in [k for k in self._seen if k not in out]:
            del self._seen[key]
        return out
