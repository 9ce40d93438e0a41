"""A GPU with live holders keeps how it is sold until they are gone: the gate of reloads and restarts.

A reload (SIGHUP), a rediscovery or a restart with a new configuration (the
chart rolls the agents when it changes) gives the inventory the configuration
wants; what the node advertised last is kept in state_dir/advertised.json, so a
restarted agent knows how each GPU was sold before.
For every GPU whose advertised devices would change (sharing mode, memory
units, time-slicing replicas, MIG layout or strategy), SharingGate asks who holds
the GPU's current devices: the kubelet's pod-resources List (containers, with
the Allocates answered in the last moments that it may not list yet) and the
Allocates in flight; when the kubelet cannot be asked, the devices this agent
handed out and the memory caps of the checkpoint. A held GPU keeps its current
devices (the change is pending) while the others switch at once; the gate looks
again every interval_s and switches each GPU as soon as its holders are gone
(drained). Each GPU held back is said in one log line, in the gauge
gpunode_sharing_change_pending{gpu,UUID,current,wanted} and in
state_dir/status/sharing.json, which `gpunode devices` and `gpunode doctor` show.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpunode.contract.names import Sharing
from gpunode.node.allocation.holds import DeviceHolds
from gpunode.node.files import write_atomically
from gpunode.node.inventory import AdvertisedDevice, Inventory
from gpunode.node.memcap.checkpoint import Checkpoint
from gpunode.node.state import DeviceState
from gpunode.node.status import SHARING, write_status

log = logging.getLogger("gpunode.node.agent")  # said as the agent's reload

DRAIN_CHECK_S = 5.0  # how often a pending change looks again at the GPU's holders
MAX_HOLDERS_SHOWN = 8
SERVED_FILE = "advertised.json"
SERVED_VERSION = 1
MAX_SERVED_BYTES = 32 << 20  # 16,384 devices of a few hundred bytes each, with room to spare


@dataclass(frozen=True)
class PendingChange:
    """A GPU that keeps its current devices until its holders are gone."""

    uuid: str
    index: int
    current: str  # how it is sold now, e.g. "fractional (79 x gpunode.io/gpu-memory)"
    wanted: str  # how the configuration wants it sold
    current_mode: str
    wanted_mode: str
    holders: tuple[str, ...]
    since: float  # unix seconds


def devices_by_gpu(inventory: Inventory) -> dict[str, tuple[AdvertisedDevice, ...]]:
    """Each GPU's advertised devices, in inventory order."""
    out: dict[str, list[AdvertisedDevice]] = {}
    for d in inventory.devices:
        out.setdefault(d.gpu_uuid, []).append(d)
    return {g: tuple(ds) for g, ds in out.items()}


def _sale(devices: Sequence[AdvertisedDevice]) -> tuple[tuple[str, str, str, int | None, str | None], ...]:
    """What selling a GPU means to a container: the devices' IDs, resources, kinds, caps and MIG devices."""
    return tuple((d.id, d.resource, d.kind, d.memory_cap_bytes, d.mig_uuid) for d in devices)


def sold_as(inventory: Inventory, uuid: str) -> str:
    """How one GPU is sold, in words: its mode and its devices per resource."""
    mode = inventory.mode_of(uuid) or Sharing.WHOLE
    counts: dict[str, int] = {}
    for d in inventory.devices:
        if d.gpu_uuid == uuid:
            counts[d.resource] = counts.get(d.resource, 0) + 1
    what = ", ".join(f"{n} x {r}" for r, n in counts.items()) or "nothing advertised"
    return f"{mode} ({what})"


def changed_gpus(current: Inventory, wanted: Inventory) -> list[str]:
    """The GPUs of both inventories whose sharing mode or advertised devices differ."""
    cur, new = devices_by_gpu(current), devices_by_gpu(wanted)
    present = {g.uuid for g in current.gpus}
    return [
        g.uuid
        for g in wanted.gpus
        if g.uuid in present
        and (
            current.mode_of(g.uuid) != wanted.mode_of(g.uuid)
            or _sale(cur.get(g.uuid, ())) != _sale(new.get(g.uuid, ()))
        )
    ]


def merge(current: Inventory, wanted: Inventory, keep: Iterable[str]) -> Inventory:
    """The wanted inventory, except that the GPUs in `keep` stay sold as in the current one."""
    keep = set(keep)
    cur, new = devices_by_gpu(current), devices_by_gpu(wanted)
    devices: list[AdvertisedDevice] = []
    modes: list[tuple[str, Sharing]] = []
    for gpu in wanted.gpus:
        source = current if gpu.uuid in keep else wanted
        devices += (cur if gpu.uuid in keep else new).get(gpu.uuid, ())
        modes.append((gpu.uuid, source.mode_of(gpu.uuid) or Sharing.WHOLE))
    return Inventory(devices=tuple(devices), gpus=wanted.gpus, modes=tuple(modes), warnings=wanted.warnings)


def save_served(state_dir: Path, inventory: Inventory) -> None:
    """Keep what the node advertises now, per GPU, for the next start (a failure is logged)."""
    by_gpu = devices_by_gpu(inventory)
    doc = {
        "version": SERVED_VERSION,
        "gpus": [
            {
                "uuid": g.uuid,
                "mode": str(inventory.mode_of(g.uuid) or Sharing.WHOLE),
                "devices": [asdict(d) for d in by_gpu.get(g.uuid, ())],
            }
            for g in inventory.gpus
        ],
    }
    path = Path(state_dir) / SERVED_FILE
    try:
        write_atomically(path, json.dumps(doc, separators=(",", ":")))
    except OSError as exc:
        log.warning("cannot write %s: %s", path, exc.strerror or exc)


def load_served(state_dir: Path, wanted: Inventory) -> Inventory | None:
    """What the node advertised before this start, over the GPUs present now (a GPU it did not know is
    sold as wanted); None when there is no such record, or it cannot be used (logged)."""
    path = Path(state_dir) / SERVED_FILE
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SERVED_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s: %s; the configuration applies to every GPU", path, exc.strerror or exc)
        return None
    try:
        if len(data) > MAX_SERVED_BYTES:
            raise ValueError(f"more than {MAX_SERVED_BYTES} bytes")
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("version") != SERVED_VERSION:
            raise ValueError("unknown version")
        before: dict[str, tuple[Sharing, tuple[AdvertisedDevice, ...]]] = {}
        for g in doc["gpus"]:
            saved = tuple(AdvertisedDevice(**d) for d in g["devices"])
            if any(d.gpu_uuid != g["uuid"] for d in saved):
                raise ValueError(f"a device of {g['uuid']} names another GPU")
            before[str(g["uuid"])] = (Sharing(g["mode"]), saved)
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("%s cannot be used (%s); the configuration applies to every GPU", path, exc)
        return None
    new = devices_by_gpu(wanted)
    devices: list[AdvertisedDevice] = []
    modes: list[tuple[str, Sharing]] = []
    for gpu in wanted.gpus:
        mode, devs = before.get(gpu.uuid, (wanted.mode_of(gpu.uuid) or Sharing.WHOLE, new.get(gpu.uuid, ())))
        devices += devs
        modes.append((gpu.uuid, mode))
    return Inventory(devices=tuple(devices), gpus=wanted.gpus, modes=tuple(modes), warnings=wanted.warnings)


class SharingGate:
    """Applies wanted inventories to the device state, holding back GPUs with live holders."""

    def __init__(
        self,
        *,
        state: DeviceState,
        holds: DeviceHolds,
        checkpoint: Checkpoint,
        state_dir: Path | None = None,
        interval_s: float = DRAIN_CHECK_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self.holds = holds
        self.checkpoint = checkpoint
        self.state_dir = state_dir
        self.interval_s = interval_s
        self.clock = clock
        self.wanted: Inventory | None = None  # what the configuration asks for, while part of it waits
        self.pending: dict[str, PendingChange] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._saved: Inventory | None = None  # what save_served wrote last
        self._told = False  # whether the status file says what `pending` holds (an earlier agent's may not)

    async def apply(self, wanted: Inventory) -> Inventory:
        """Advertise `wanted`, except on the GPUs that have holders now; the inventory advertised."""
        async with self._lock:
            current = self.state.snapshot().inventory
            changed = changed_gpus(current, wanted)
            held = await self.holders(current, changed) if changed else {}
            keep = [u for u in changed if held.get(u)]
            inventory = merge(current, wanted, keep) if keep else wanted
            told = self._record(current, wanted, {u: held[u] for u in keep})
            self.wanted = wanted if keep else None
            self.state.set_inventory(inventory)
            if keep:
                self._wake.set()
            if self.state_dir is not None:
                if not told or not self._told:
                    doc = {"gpus": [asdict(p) for p in self.pending.values()]} if self.pending else None
                    await asyncio.to_thread(write_status, self.state_dir, SHARING, doc)
                    self._told = True
                if inventory != self._saved:
                    await asyncio.to_thread(save_served, self.state_dir, inventory)
                    self._saved = inventory
            return inventory

    def _record(self, current: Inventory, wanted: Inventory, held: dict[str, list[str]]) -> bool:
        """Keep the GPUs held back in `pending`, logging each change; True when nothing changed."""
        now = self.clock()
        pending: dict[str, PendingChange] = {}
        for uuid, holders in held.items():
            gpu = wanted.gpu(uuid)
            before = self.pending.get(uuid)
            change = PendingChange(
                uuid=uuid,
                index=gpu.index if gpu is not None else -1,
                current=sold_as(current, uuid),
                wanted=sold_as(wanted, uuid),
                current_mode=str(current.mode_of(uuid) or Sharing.WHOLE),
                wanted_mode=str(wanted.mode_of(uuid) or Sharing.WHOLE),
                holders=tuple(sorted(holders)),
                since=before.since if before is not None and before.wanted == sold_as(wanted, uuid) else now,
            )
            pending[uuid] = change
            if before is None or before.wanted != change.wanted:
                shown = ", ".join(change.holders[:MAX_HOLDERS_SHOWN])
                more = len(change.holders) - MAX_HOLDERS_SHOWN
                log.warning(
                    "GPU %d (%s) stays %s while %s hold%s it; it becomes %s once they are gone",
                    change.index,
                    uuid,
                    change.current,
                    shown + (f" and {more} more" if more > 0 else ""),
                    "s" if len(change.holders) == 1 else "",
                    change.wanted,
                )
        for uuid in self.pending.keys() - pending.keys():
            gone = self.pending[uuid]
            log.info("GPU %d (%s): its holders are gone; now %s", gone.index, uuid, sold_as(wanted, uuid))
        same = pending == self.pending
        self.pending = pending
        return same

    async def holders(self, current: Inventory, uuids: Iterable[str]) -> dict[str, list[str]]:
        """Who holds each of these GPUs' current devices (nothing listed: not held)."""
        wanted = set(uuids)
        out: dict[str, set[str]] = {}

        def gpu_of(dev_id: str) -> str | None:
            d = current.by_id(dev_id)
            return d.gpu_uuid if d is not None and d.gpu_uuid in wanted else None

        for dev_id in self.holds.in_flight:
            if (g := gpu_of(dev_id)) is not None:
                out.setdefault(g, set()).add("an Allocate in flight")
        containers = await self.holds.live()
        now = self.holds.clock()
        if containers is not None:
            for c in containers:
                for dev_id in c.device_ids:
                    if (g := gpu_of(dev_id)) is not None:
                        out.setdefault(g, set()).add(f"{c.namespace}/{c.pod}/{c.container}")
            for dev_id, given in self.holds.given.items():  # answered, perhaps not listed yet
                if now - given.at < self.holds.record_grace_s and (g := gpu_of(dev_id)) is not None:
                    out.setdefault(g, set()).add("an Allocate just answered")
        else:
            for dev_id in self.holds.given:
                if (g := gpu_of(dev_id)) is not None:
                    out.setdefault(g, set()).add(
                        "containers this agent allocated (the kubelet cannot be asked)"
                    )
            for rec in self.checkpoint.records().values():
                if rec.device_ids and (g := gpu_of(rec.device_ids[0])) is not None:
                    out.setdefault(g, set()).add(f"memory-cap region {rec.key}")
        return {g: sorted(h) for g, h in out.items()}

    async def run(self) -> None:
        """Look again at the holders of pending GPUs every interval_s, until cancelled."""
        while True:
            if self.wanted is None:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.interval_s)
            if self.wanted is not None:
                await self.apply(self.wanted)

    def collector(self) -> Collector:
        """The gauge of pending changes, one series per GPU held back."""
        gate = self

        class _Pending(Collector):
            def collect(self) -> Iterator[GaugeMetricFamily]:
                g = GaugeMetricFamily(
                    "gpunode_sharing_change_pending",
                    "1 for a GPU whose new sharing mode (after a reload) waits until its holders are gone.",
                    labels=["gpu", "UUID", "current", "wanted"],
                )
                for p in list(gate.pending.values()):
                    g.add_metric([str(p.index), p.uuid, p.current_mode, p.wanted_mode], 1.0)
                yield g

        return _Pending()
