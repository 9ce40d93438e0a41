"""The collector's view of the memory-cap regions: how much each capped device of each container uses.

Read through gpunode.node.memcap when its native part is built; without it there
is simply no per-container memory. A region that cannot be read is counted and
logged (once per region and reason), never guessed at; the regions skipped now
are a gauge by key and reason.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from gpunode.errors import MemcapError, RegionDamaged

log = logging.getLogger("gpunode.node.metrics.collector")  # reported as the collector's own problems


@dataclass(frozen=True)
class RegionReading:
    """What the collector takes from one device of one memory-cap region."""

    key: str
    device_uuid: str  # a GPU or a MIG device
    used_bytes: int
    limit_bytes: int


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
        if usage.devices:  # one reading per capped device of the container
            out.extend(RegionReading(usage.key, d.uuid, d.used_bytes, d.limit_bytes) for d in usage.devices)
        else:
            out.append(RegionReading(usage.key, usage.gpu_uuid, usage.used_bytes, usage.limit_bytes))
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
