"""Keeps the memory-cap regions in step with the kubelet: restore on start, reclaim, garbage-collect.

On start-up, every region the checkpoint names is re-created if its files are
gone (same key, same cap), so a container keeps its cap across an agent
restart or a wiped state directory. While running, a loop asks the kubelet's
pod-resources API which containers hold capped devices; a region whose
container is gone (and that is older than a grace period, since the kubelet
lists a container only after Allocate returns) is removed, and dead processes'
usage is reclaimed in the live ones. When the kubelet cannot be asked, nothing
is removed: the keeper says so once in the log, in `problem` (the metric
gpunode_memcap_cleanup_blocked) and in state_dir/status/region-cleanup.json for
`gpunode doctor`, and the regions of a GPU stay bounded by its units all the
same (allocation.allocator.RegionBound). This module never decides caps;
allocation.py does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from gpunode.errors import GpunodeError, RegionDamaged
from gpunode.node.files import write_atomically
from gpunode.node.inventory import region_key
from gpunode.node.kubelet.podresources import ContainerDevices
from gpunode.node.memcap.checkpoint import Checkpoint

log = logging.getLogger(__name__)


def staged_library_dir(state_dir: Path) -> Path:
    """state_dir/lib/layout-<N>: where the interposer for region layout N is staged."""
    from gpunode.node.memcap.region import _native

    return Path(state_dir) / "lib" / f"layout-{_native().lib.GPUNODE_MEMCAP_LAYOUT_VERSION}"


def stage_preload_library(state_dir: Path) -> Path:
    """Copy the interposer into state_dir/lib/layout-<N> (atomically, only when it changed); that path.

    The kubelet mounts the library into workload containers from a host path; the
    package's own copy may live inside the agent's container image, which the host
    cannot see, while the state directory is a host directory mounted at the same path.
    One directory per region layout: the kubelet keeps each pod's Allocate answer and
    mounts the same host path again when a container restarts, so a library an older
    agent staged (state_dir/lib/<name>, or another layout's directory) stays where its
    pods' answers point, and a container restarted in such a pod gets the library
    that reads its region rather than one that refuses it.
    """
    from gpunode.node import memcap

    source = memcap.preload_library_path()
    target = staged_library_dir(state_dir) / source.name
    data = source.read_bytes()
    if target.is_file() and target.read_bytes() == data:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, data, mode=0o755)  # containers that mapped the old file keep it
    log.info("memory caps: interposer staged at %s", target)
    return target


def restore_regions(checkpoint: Checkpoint, root: Path) -> list[str]:
    """Make the regions root-only (see memcap.secure_root) and re-create the checkpointed regions whose
    directories are missing; the keys restored."""
    from gpunode.node import memcap
    from gpunode.node.memcap.compute import set_compute_share, share_from_memory

    try:
        memcap.secure_root(root)
    except GpunodeError as exc:
        log.error("memory caps: %s (hint: %s)", exc, exc.hint)
    restored = []
    for rec in checkpoint.records().values():
        if (root / rec.key).is_dir():
            continue
        try:
            memcap.create_region(
                root,
                rec.key,
                gpu_uuid=rec.gpu_uuid,
                limit_bytes=rec.limit_bytes,
                device_total_bytes=rec.device_total_bytes,
                fail_open=rec.fail_open,
            )
            set_compute_share(root / rec.key, share_from_memory(rec.limit_bytes, rec.device_total_bytes))
            restored.append(rec.key)
        except GpunodeError as exc:
            log.error("checkpoint: cannot restore region %s: %s", rec.key, exc)
    if restored:
        log.info("checkpoint: restored %d memory-cap region(s)", len(restored))
    return restored


def live_keys(containers: Iterable[ContainerDevices]) -> set[str]:
    """Region keys of every container's devices, per resource (as Allocate computed them)."""
    return {region_key(c.device_ids) for c in containers if c.device_ids}


class RegionKeeper:
    """Garbage-collects the memory-cap regions under root of containers the kubelet no longer lists.

    A region stays while a container holds its devices or for grace_s seconds after its cap was
    created; regions kept get the usage of dead processes reclaimed. `removed` and `reclaimed_bytes`
    accumulate what was done.
    """

    def __init__(
        self,
        *,
        root: Path,
        checkpoint: Checkpoint,
        list_containers: Callable[[], Awaitable[tuple[ContainerDevices, ...]]],
        interval_s: float = 60.0,
        grace_s: float = 600.0,
        clock: Callable[[], float] = time.time,
        state_dir: Path | None = None,
    ) -> None:
        self.root = root
        self.checkpoint = checkpoint
        self.list_containers = list_containers
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.clock = clock
        self.state_dir = state_dir  # where the status for `gpunode doctor` goes (none when None)
        self.removed: list[str] = []
        self.reclaimed_bytes = 0
        self.problem: str | None = None  # why clean-up cannot run, while it cannot
        self.hint = ""  # its fix
        self.blocked_since: float | None = None  # unix time it stopped running

    async def collect_once(self) -> tuple[str, ...]:
        """One pass; returns the keys removed. Raises GpunodeError when the kubelet cannot be asked."""
        from gpunode.node import memcap

        started = time.time()  # file times, not self.clock: regions replaced after this are kept
        containers = await self.list_containers()
        keep = live_keys(containers)
        now = self.clock()
        records = self.checkpoint.records()
        keep |= {k for k, r in records.items() if now - r.created < self.grace_s}
        regions = await asyncio.to_thread(memcap.list_regions, self.root)
        for region in regions:
            if region.key in keep:
                try:
                    self.reclaimed_bytes += await asyncio.to_thread(memcap.reclaim_dead, region)
                except RegionDamaged:
                    pass  # recorded and logged once by memcap (region_problems); skipped until usable
                except GpunodeError as exc:
                    log.warning("memory caps: reclaiming in %s failed: %s", region.key, exc)
        removed = await asyncio.to_thread(
            lambda: memcap.gc_regions(self.root, keep, changed_since=started - 1.0)
        )
        if removed:
            log.info("memory caps: removed %d region(s) of containers that are gone", len(removed))
            self.checkpoint.remove(removed)
            self.removed.extend(removed)
        return removed

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Collect every interval_s seconds until cancelled; sets `ready` after the first pass.

        While the kubelet cannot be asked, nothing is removed and one warning is logged.
        """
        from gpunode.node.status import CLEANUP, write_status

        told = False  # an earlier agent's status file may say what no longer holds
        while True:
            try:
                await self.collect_once()
                changed = self._blocked(None)
            except GpunodeError as exc:
                changed = self._blocked(exc)
            if self.state_dir is not None and (changed or not told):
                await asyncio.to_thread(write_status, self.state_dir, CLEANUP, self.status())
                told = True
            if ready is not None and not ready.is_set():
                ready.set()
            await asyncio.sleep(self.interval_s)

    def status(self) -> dict[str, object] | None:
        """What `gpunode doctor` is told: why clean-up cannot run, or None while it runs."""
        if self.problem is None:
            return None
        return {"problem": self.problem, "hint": self.hint, "since": self.blocked_since}

    def _blocked(self, exc: GpunodeError | None) -> bool:
        """Record whether clean-up runs, logging a change once; True when it changed."""
        problem = None if exc is None else str(exc)
        if problem == self.problem:
            return False
        if exc is not None and self.problem is None:
            log.warning(
                "memory caps: no garbage collection while the kubelet cannot be asked: %s; each GPU still "
                "keeps no more regions than it has units",
                exc,
            )
            self.blocked_since = time.time()
        elif exc is None:
            log.info("memory caps: garbage collection runs again")
            self.blocked_since = None
        self.problem = problem
        self.hint = exc.hint if exc is not None else ""
        return True
