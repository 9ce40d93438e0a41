"""The node's device state as the device plugins serve it: what is advertised and what is healthy.

DeviceState is the one place where discovery (the inventory, GPUs that
vanished) and health (faults from gpunode.health, lost GPUs) meet. Every change
bumps a version and wakes the ListAndWatch streams, from any thread. Health is
kept per source ("topology", "health", ...) as a level: each source replaces its
whole set of unhealthy UUIDs, and a device is unhealthy while any source names
its physical GPU or its MIG device. This module does no I/O.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpunode.node.inventory import AdvertisedDevice, Inventory

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


@dataclass(frozen=True)
class DeviceStatus:
    """One advertised device with its health as ListAndWatch reports it, and the reason when unhealthy."""

    device: AdvertisedDevice
    healthy: bool
    reason: str = ""  # why unhealthy


@dataclass(frozen=True)
class Snapshot:
    """The device state at one version: inventory, vanished devices, unhealthy UUIDs of all sources."""

    version: int
    inventory: Inventory
    vanished: tuple[AdvertisedDevice, ...] = ()  # advertised before, their GPU is gone now
    unhealthy: Mapping[str, str] = field(default_factory=dict)  # GPU or MIG UUID -> reason (all sources)

    def resources(self) -> tuple[str, ...]:
        """Resource names to serve: the inventory's, then those that only vanished devices have, in order."""
        names = list(self.inventory.resources())
        names += [d.resource for d in self.vanished if d.resource not in names]
        return tuple(dict.fromkeys(names))

    def health_of(self, device: AdvertisedDevice) -> tuple[bool, str]:
        """(healthy, reason) of one device: unhealthy when its GPU or its MIG device is named unhealthy."""
        for uuid in (device.gpu_uuid, device.mig_uuid):
            if uuid is not None and uuid in self.unhealthy:
                return False, self.unhealthy[uuid]
        return True, ""

    def statuses(self, resource: str) -> tuple[DeviceStatus, ...]:
        """The status of every device of `resource`; vanished devices are listed last, unhealthy."""
        out = [DeviceStatus(d, *self.health_of(d)) for d in self.inventory.by_resource(resource)]
        out += [
            DeviceStatus(d, False, "GPU vanished from the node")
            for d in self.vanished
            if d.resource == resource
        ]
        return tuple(out)

    def status(self, device_id: str) -> DeviceStatus | None:
        """The status of one device ID (vanished devices are unhealthy), or None when it is not known."""
        device = self.inventory.by_id(device_id)
        if device is not None:
            return DeviceStatus(device, *self.health_of(device))
        for d in self.vanished:
            if d.id == device_id:
                return DeviceStatus(d, False, "GPU vanished from the node")
        return None


class DeviceState:
    """Thread-safe, versioned holder of the current Snapshot with async change notification."""

    def __init__(self, inventory: Inventory) -> None:
        self._lock = threading.Lock()
        self._inventory = inventory
        self._vanished: dict[str, AdvertisedDevice] = {}
        self._health: dict[str, dict[str, str]] = {}
        self._version = 0
        self._snapshot = self._build()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def _build(self) -> Snapshot:
        unhealthy: dict[str, str] = {}
        for source in sorted(self._health):
            for uuid, reason in self._health[source].items():
                unhealthy.setdefault(uuid, reason)
        return Snapshot(self._version, self._inventory, tuple(self._vanished.values()), unhealthy)

    def snapshot(self) -> Snapshot:
        """The current Snapshot (immutable; a change makes a new one)."""
        with self._lock:
            return self._snapshot

    def _changed(self) -> None:
        self._version += 1
        self._snapshot = self._build()
        waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def set_inventory(self, inventory: Inventory) -> None:
        """Replace the inventory; devices whose GPU disappeared stay listed as unhealthy."""
        with self._lock:
            present = {g.uuid for g in inventory.gpus} | {u for u, _ in inventory.modes}
            new_ids = {d.id for d in inventory.devices}
            for d in self._inventory.devices:
                if d.gpu_uuid not in present and d.id not in new_ids:
                    self._vanished[d.id] = d
            for dev_id in list(self._vanished):
                if dev_id in new_ids or self._vanished[dev_id].gpu_uuid in present:
                    del self._vanished[dev_id]
            if inventory == self._inventory and not self._vanished:
                return
            self._inventory = inventory
            self._changed()

    def forget_vanished(self) -> None:
        """Stop listing the devices whose GPU vanished (they are no longer advertised at all)."""
        with self._lock:
            if self._vanished:
                self._vanished.clear()
                self._changed()

    def set_unhealthy(self, source: str, unhealthy: Mapping[str, str]) -> None:
        """Set the complete set of GPU/MIG UUIDs the named source considers unhealthy, with reasons."""
        with self._lock:
            new = dict(unhealthy)
            if self._health.get(source, {}) == new:
                return
            if new:
                self._health[source] = new
            else:
                self._health.pop(source, None)
            self._changed()

    async def wait_for_change(self, after_version: int) -> Snapshot:
        """Return the first snapshot whose version is greater than after_version."""
        while True:
            event = asyncio.Event()
            with self._lock:
                if self._snapshot.version > after_version:
                    return self._snapshot
                self._waiters.append((asyncio.get_running_loop(), event))
            await event.wait()
