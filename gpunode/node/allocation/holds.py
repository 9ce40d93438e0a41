"""Who holds which device: the check that refuses an Allocate for devices another container holds.

The kubelet gives a device to one container at a time, and the agent is the last
line when it does not: an Allocate is refused (one AllocationError naming the
device and its holder) when one of its device IDs
- is claimed by another Allocate still in flight (the kubelet never sends two at once);
- is held by another running container, as the kubelet's pod-resources List says
  (a container listed with exactly the same devices is the same container allocated
  again, after a kubelet restart, and is let through).
The kubelet records an allocation only once the answer reached it, so a device
this agent gave to another set less than RECORD_GRACE_S ago that the List does
not show yet is not taken as free at once: the List is asked again every
LIST_POLL_S until it shows the holder (refused) or the grace has passed (the
earlier holder never started, e.g. its pod was rejected: let through). The
kubelet allocates one container at a time and records each before the next, so
it waits only after such a rejection; an init container's devices reused by its
pod's app container (one set within the other) are not waited for.
The kubelet is asked only when a device was given before to another set (a unit
reused after its holder ended), so most Allocates cost no call. While it cannot
be asked (no pod-resources socket, no answer), the check falls back to the calls
in flight, says so once per outage, and asks again after LIST_RETRY_S; units
reused after their holder ended keep getting a fresh region.
`given` also tells the reload which GPUs this agent handed out (gpunode.node.drain).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from gpunode.errors import AllocationError, GpunodeError
from gpunode.node.inventory import region_key
from gpunode.node.kubelet.podresources import ContainerDevices

log = logging.getLogger(__name__)

RECORD_GRACE_S = 0.5  # how long after an Allocate answered the kubelet may not list it yet
LIST_POLL_S = 0.05  # how often the kubelet is asked again meanwhile
LIST_RETRY_S = 5.0  # after a failed List, how long Allocates do without one
LIST_TIMEOUT_S = 2.0

ListContainers = Callable[[], Awaitable[tuple[ContainerDevices, ...]]]


@dataclass(frozen=True)
class Given:
    """One Allocate's devices as this agent answered them: region key, the set, monotonic time."""

    key: str
    ids: frozenset[str]
    at: float


class DeviceHolds:
    """The device IDs of Allocates in flight and of those answered, checked against the kubelet.

    Lives on the event loop (no lock): claim() checks and claims in one step, with no await between.
    """

    def __init__(
        self,
        list_containers: ListContainers | None,
        *,
        record_grace_s: float = RECORD_GRACE_S,
        retry_s: float = LIST_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.list_containers = list_containers
        self.record_grace_s = record_grace_s
        self.retry_s = retry_s
        self.clock = clock
        self.in_flight: dict[str, str] = {}  # device ID -> region key of the Allocate holding it
        self.given: dict[str, Given] = {}  # device ID -> the last Allocate this agent answered with it
        self.refused = 0  # Allocates refused for devices another container holds, since start
        self.unchecked = 0  # Allocates let through without the kubelet's List (it could not be asked)
        self.waited = 0  # times an Allocate waited for the kubelet to record an earlier answer
        self.problem: str | None = None  # why the kubelet cannot be asked, while it cannot
        self._failed_at: float | None = None

    def seed(self, holdings: Iterable[tuple[str, Sequence[str]]]) -> None:
        """Devices handed out before this process started (the checkpoint's caps): (key, device IDs)."""
        for key, ids in holdings:
            given = Given(key, frozenset(ids), float("-inf"))
            for dev_id in ids:
                self.given[dev_id] = given

    async def seed_from_kubelet(self) -> None:
        """Take every device the kubelet says a container holds as handed out (at start: this process
        did not see those Allocates), so reusing one of them makes the check ask the kubelet."""
        containers = await self.live()
        if containers is not None:
            self.seed((region_key(c.device_ids), c.device_ids) for c in containers if c.device_ids)

    def claim(self, resource: str, device_ids: Sequence[str]) -> str:
        """Claim the devices of one container's Allocate; AllocationError if another Allocate in flight
        holds one. Returns the region key of the set; release() must follow."""
        key = region_key(device_ids)
        for dev_id in device_ids:
            if dev_id in self.in_flight:
                self.refused += 1
                raise AllocationError(
                    f"{resource}: device {dev_id[:80]} is being allocated to another container right now",
                    hint="the kubelet sends one Allocate at a time; a second client is talking to the plugin",
                )
        for dev_id in device_ids:
            self.in_flight[dev_id] = key
        return key

    def release(self, device_ids: Sequence[str], key: str, *, given: bool) -> None:
        """End a claim; with given, the devices now belong to the set `key` (the Allocate answered)."""
        record = Given(key, frozenset(device_ids), self.clock()) if given else None
        for dev_id in device_ids:
            if self.in_flight.get(dev_id) == key:
                del self.in_flight[dev_id]
            if record is not None:
                self.given[dev_id] = record

    async def live(self) -> tuple[ContainerDevices, ...] | None:
        """The kubelet's containers and their devices, or None when it cannot be asked (said once)."""
        if self.list_containers is None:
            return None
        now = self.clock()
        if self._failed_at is not None and now - self._failed_at < self.retry_s:
            return None
        try:
            containers = await self.list_containers()
        except GpunodeError as exc:
            self._failed_at = now
            if self.problem is None:
                log.warning(
                    "Allocate: the kubelet's pod-resources List cannot be asked (%s); devices are checked "
                    "against the Allocates in flight only",
                    exc,
                )
            self.problem = str(exc)
            return None
        if self.problem is not None:
            log.info("Allocate: the kubelet's pod-resources List answers again")
        self.problem = None
        self._failed_at = None
        return containers

    async def check(self, resource: str, device_ids: Sequence[str], key: str) -> None:
        """AllocationError when another container holds one of the devices (see the module docstring)."""
        others = {d: self.given[d] for d in device_ids if d in self.given and self.given[d].key != key}
        if not others:
            return
        wanted = frozenset(device_ids)
        while True:
            containers = await self.live()
            if containers is None:
                self.unchecked += 1  # the kubelet's word is all there is
                return
            now = self.clock()
            listed: dict[str, ContainerDevices] = {}
            for c in containers:
                for dev_id in c.device_ids:
                    listed[dev_id] = c
            for dev_id in device_ids:
                holder = listed.get(dev_id)
                if holder is not None and region_key(holder.device_ids) != key:
                    self.refused += 1
                    raise AllocationError(
                        f"{resource}: device {dev_id[:80]} is still held by the running container "
                        f"{holder.namespace}/{holder.pod}/{holder.container}",
                        hint="the kubelet gave out a device a running container holds; restart the kubelet "
                        "if this repeats (`kubectl get pods -A -o wide` shows the holder)",
                    )
            # Not listed: the holder has ended, unless it was answered so recently that the kubelet may not
            # have recorded it yet (an init container's devices reused by its own pod are not waited for).
            recent = [
                g
                for g in others.values()
                if now - g.at < self.record_grace_s and not (wanted <= g.ids or g.ids <= wanted)
            ]
            if not recent:
                for dev_id, g in others.items():
                    if self.given.get(dev_id) is g:
                        del self.given[dev_id]
                return
            self.waited += 1
            wait = min(LIST_POLL_S, max(0.0, min(g.at for g in recent) + self.record_grace_s - now))
            await asyncio.sleep(wait)

    def given_on(self, device_ids: Iterable[str]) -> list[str]:
        """The IDs among device_ids that this agent handed out and has not seen released."""
        return [d for d in device_ids if d in self.given]
