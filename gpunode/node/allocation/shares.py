"""The compute share each capped container runs at: the pod's gpunode.io/gpu-milli, else its memory share.

Allocate writes a region's share before the kubelet says which pod it is for (the
device-plugin calls do not name the pod), so it writes the default: proportional to
the container's memory cap (gpunode.node.memcap.compute.share_from_memory). This
module then carries out what the pods ask: once per tick it takes the kubelet's
pod-resources List (which container holds which device IDs, hence which region:
region_key of the container's device IDs) and the pods' gpu-milli annotations (from
the assignment book's watch of the pods bound to this node), and writes each
region's share where the region holds another. The interposer reads the share on
every refill, so a changed annotation applies within a tick.

The shares of one GPU never add up to more than the GPU. A pod's ask that would take
a GPU over MILLI_PER_GPU (the extender refuses such a placement; an annotation edited
after placement, or a cluster without the extender, can still ask it) is refused with
one warning line, and the container keeps the share it has. Decreases are written
before increases, and increases go first allocated, first served. A region whose
share the container rewrote (its usage file is the container's to write) gets the
planned share back at the next tick. The shares written for pods that asked are
published in the node state (gpunode.node.allocation.accounting), so the extender
and the queue see compute and memory as two dimensions of a GPU.

Must not: speak gRPC or HTTP itself (callers pass the List and the annotations).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpunode.contract.names import GPU_MILLI_ANNOTATION, MILLI_PER_GPU
from gpunode.contract.share import parse_compute_share
from gpunode.errors import GpunodeError, InvalidComputeShare
from gpunode.node.inventory import region_key
from gpunode.node.kubelet.podresources import ContainerDevices
from gpunode.node.memcap.checkpoint import CapRecord, Checkpoint
from gpunode.node.memcap.compute import (
    DEFAULT_MODE,
    ComputeMode,
    read_compute,
    set_compute_share,
    share_from_memory,
)

log = logging.getLogger(__name__)

TICK_S = 1.0  # how often the shares are carried out (a changed annotation applies within this)
FRESH_S = 30.0  # a region the kubelet does not list yet counts on its GPU for this long after its Allocate


@dataclass(frozen=True)
class Planned:
    """The share one region is to hold, and for which pod ("" when the kubelet lists no container for it)."""

    key: str
    pod: str
    gpu_uuid: str
    share_milli: int
    explicit: bool  # the pod asked for it (else: the memory-proportional default)


@dataclass(frozen=True)
class Refusal:
    """A pod's ask that would take its GPU over one GPU of compute."""

    pod: str
    gpu_uuid: str
    asked_milli: int
    kept_milli: int
    free_milli: int

    def line(self) -> str:
        """One line naming the problem and the remedy."""
        return (
            f"compute share: pod {self.pod} asks {GPU_MILLI_ANNOTATION}={self.asked_milli} on GPU {self.gpu_uuid}, "
            f"but its neighbours hold all but {self.free_milli} of {MILLI_PER_GPU}; it keeps {self.kept_milli} "
            "(ask for less, or let the extender place it where the share is free)"
        )


def pods_of_regions(records: Iterable[CapRecord], containers: Iterable[ContainerDevices]) -> dict[str, str]:
    """Region key -> "namespace/pod" for each checkpointed region the kubelet lists a container for."""
    keys = {r.key for r in records}
    out: dict[str, str] = {}
    for c in containers:
        if c.device_ids:
            key = region_key(c.device_ids)
            if key in keys:
                out[key] = f"{c.namespace}/{c.pod}"
    return out


def plan_shares(
    records: Sequence[CapRecord],
    owners: Mapping[str, str],
    asks: Mapping[str, int],
    current: Mapping[str, int],
    *,
    now: float,
    fresh_s: float = FRESH_S,
    fixed: Collection[str] = (),
) -> tuple[list[Planned], list[Refusal]]:
    """The share of every region that counts on its GPU, and the asks refused.

    owners: region key -> pod (pods_of_regions); asks: pod -> its valid gpu-milli; current: region key ->
    the share it holds now (absent: the default). A region counts when the kubelet lists its container,
    or within fresh_s of its Allocate; the others belong to containers that have ended. A pod with
    several capped containers on one GPU has its share split among them. The regions in `fixed` (MPS
    replicas) keep their memory-proportional share whatever their pod asks.
    """
    counted = [r for r in records if r.key in owners or now - r.created < fresh_s]
    per_pod_gpu: dict[tuple[str, str], int] = {}
    for r in counted:
        pod = owners.get(r.key, "")
        if pod in asks and r.key not in fixed:
            per_pod_gpu[(pod, r.gpu_uuid)] = per_pod_gpu.get((pod, r.gpu_uuid), 0) + 1
    wanted: dict[str, Planned] = {}
    defaults: dict[str, int] = {}
    for r in counted:
        pod = owners.get(r.key, "")
        default = defaults[r.key] = share_from_memory(r.limit_bytes, r.device_total_bytes)
        if pod in asks and r.key not in fixed:
            share = max(1, asks[pod] // per_pod_gpu[(pod, r.gpu_uuid)])
            wanted[r.key] = Planned(r.key, pod, r.gpu_uuid, share, True)
        else:
            wanted[r.key] = Planned(r.key, pod, r.gpu_uuid, default, False)
    planned: list[Planned] = []
    refused: list[Refusal] = []
    by_gpu: dict[str, list[CapRecord]] = {}
    for r in sorted(counted, key=lambda r: (r.created, r.key)):
        by_gpu.setdefault(r.gpu_uuid, []).append(r)
    for gpu, recs in by_gpu.items():
        held = {r.key: current.get(r.key, defaults[r.key]) for r in recs}
        total = sum(held.values())
        ups: list[Planned] = []
        for r in recs:
            want = wanted[r.key]
            if want.share_milli <= held[r.key]:
                total -= held[r.key] - want.share_milli
                held[r.key] = want.share_milli
                planned.append(want)
            else:
                ups.append(want)
        for want in ups:  # first allocated, first served
            rise = want.share_milli - held[want.key]
            if total + rise <= MILLI_PER_GPU:
                total += rise
                held[want.key] = want.share_milli
                planned.append(want)
            else:
                kept = held[want.key]
                refused.append(Refusal(want.pod, gpu, want.share_milli, kept, MILLI_PER_GPU - total + kept))
                planned.append(Planned(want.key, want.pod, gpu, kept, want.explicit))
    return planned, refused


class ComputeShares:
    """Carries out the pods' compute shares in their containers' regions, once per tick (see the module)."""

    def __init__(
        self,
        *,
        checkpoint: Checkpoint,
        regions_root: Path,
        list_containers: Callable[[], Awaitable[Sequence[ContainerDevices]]],
        asks: Callable[[], Mapping[str, str]],
        mode_of: Callable[[CapRecord], ComputeMode] = lambda _: DEFAULT_MODE,
        fixed: Callable[[CapRecord], bool] = lambda _: False,
        tick_s: float = TICK_S,
        fresh_s: float = FRESH_S,
    ) -> None:
        self.checkpoint = checkpoint
        self.regions_root = Path(regions_root)
        self._list = list_containers
        self._asks = asks
        self._mode_of = mode_of
        self._fixed = fixed
        self.tick_s = tick_s
        self.fresh_s = fresh_s
        self.planned: dict[str, Planned] = {}  # region key -> what it holds after the last tick
        self.owners: dict[str, str] = {}  # region key -> pod, as of the last tick
        self.written = 0  # shares written since start (a change, or a region the container rewrote)
        self._said: set[str] = set()  # warnings given (one per pod and problem)
        self._poked = asyncio.Event()
        self.on_change: Callable[[], None] | None = None  # called when explicit() changed (the publisher)

    def poke(self) -> None:
        """Carry the shares out now (an annotation changed) rather than at the next tick."""
        self._poked.set()

    def explicit(self) -> dict[tuple[str, str], int]:
        """(pod, GPU UUID) -> the compute share held for pods that asked for one (for the node state)."""
        out: dict[tuple[str, str], int] = {}
        for p in self.planned.values():
            if p.explicit and p.pod:
                out[(p.pod, p.gpu_uuid)] = out.get((p.pod, p.gpu_uuid), 0) + p.share_milli
        return out

    def _valid_asks(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pod, text in self._asks().items():
            try:
                out[pod] = parse_compute_share(text)
            except InvalidComputeShare as exc:
                self._say(f"bad:{pod}:{text}", f"compute share: pod {pod}: {exc}; it keeps its memory share")
        return out

    def _say(self, what: str, line: str) -> None:
        if what not in self._said:
            self._said.add(what)
            if len(self._said) > 4096:
                self._said.clear()
            log.warning("%s", line)

    async def tick(self) -> list[Planned]:
        """One pass: plan every region's share and write those that differ; the plan."""
        try:
            containers = await self._list()
        except GpunodeError as exc:
            self._say(
                f"list:{exc}", f"compute share: cannot list the kubelet's containers, shares unchanged: {exc}"
            )
            return list(self.planned.values())
        records = list(self.checkpoint.records().values())
        owners = pods_of_regions(records, containers)
        asks = self._valid_asks()
        before = self.explicit()
        planned = await asyncio.to_thread(self._carry_out, records, owners, asks)
        if self.on_change is not None and self.explicit() != before:
            self.on_change()  # on the loop: the publisher's event is not thread-safe
        return planned

    def _carry_out(
        self, records: list[CapRecord], owners: dict[str, str], asks: dict[str, int]
    ) -> list[Planned]:
        held: dict[str, tuple[int, int]] = {}  # key -> (share, mode) as the region holds it now
        for r in records:
            if r.key not in owners and time.time() - r.created >= self.fresh_s:
                continue
            try:
                report = read_compute(self.regions_root / r.key)
            except GpunodeError:
                continue  # a damaged region: the collector reports it; nothing to write into
            if not report.tampered and report.share_milli:
                held[r.key] = (report.share_milli, report.mode)
        # What the agent last wrote is what a region holds; a share the container wrote itself is not.
        current = {k: p.share_milli for k, p in self.planned.items()}  # even where the container rewrote it
        current.update({k: v[0] for k, v in held.items() if k not in self.planned})
        fixed = {r.key for r in records if self._fixed(r)}
        planned, refused = plan_shares(
            records, owners, asks, current, now=time.time(), fresh_s=self.fresh_s, fixed=fixed
        )
        for refusal in refused:
            self._say(f"over:{refusal.pod}:{refusal.asked_milli}", refusal.line())
        by_key = {r.key: r for r in records}
        for p in planned:
            share, mode = held.get(p.key, (0, -1))
            want_mode = self._mode_of(by_key[p.key])  # the agent's, whatever the container wrote
            if share == p.share_milli and mode == want_mode:
                continue
            try:
                set_compute_share(self.regions_root / p.key, p.share_milli, want_mode)
            except GpunodeError as exc:
                self._say(f"write:{p.key}", f"compute share: cannot write the share of region {p.key}: {exc}")
                continue
            self.written += 1
            if share and share != p.share_milli:
                log.info(
                    "compute share: region %s of pod %s: %d -> %d thousandths of GPU %s",
                    p.key,
                    p.pod or "?",
                    share,
                    p.share_milli,
                    p.gpu_uuid,
                )
        self.planned = {p.key: p for p in planned}
        self.owners = owners
        return planned

    async def run(self) -> None:
        """Tick until cancelled; a poke starts the next tick at once."""
        while True:
            await self.tick()
            self._poked.clear()
            try:
                async with asyncio.timeout(self.tick_s):
                    await self._poked.wait()
            except TimeoutError:
                pass
