"""The order of the pool's devices, so that kube-scheduler's first fit takes the device gpunode would.

kube-scheduler's DRA allocator walks a node's devices in the order the slice lists them and takes the first
that fits. order_pool() lists them in gpunode's order of preference, from what the node's claims already
hold (gpunode.contract.draclaims), so first fit is the placement policy's choice:

- shares (`<gpu>-shared`): the GPU with the least free memory first, GPUs held whole last, ties by GPU index.
  First fit over this order is the tightest GPU that fits, the placement policy's default choice for a
  fraction (gpunode.placement.policies.default_gpus): shares pack onto GPUs already shared and whole GPUs
  stay free for whole claims.
- whole GPUs (`<gpu>`): GPUs nothing holds first, in index order, which is what the policy takes for one
  whole GPU (gpunode.placement.topology.preferred_whole_gpus: the lowest index among the free ones).
  Claims for several GPUs that must share an NVLink domain or a NUMA node say so with a `matchAttribute`
  constraint (nvlinkDomain, numaNode); the allocator then searches the sets itself.
- MIG placements: those of the GPU with the fewest free placements of the same profile first (the policy's
  choice for a MIG request), placements that overlap one held last; within a GPU the table's order.
- time-sliced replicas (`<gpu>-timesliced`): build_pool's order.

Only the order changes: device names, attributes and capacities are those build_pool made, so allocations
stay valid across republishing. A new order is a new pool generation (SlicePublisher writes it when the
content changes), so ClaimUsage pokes the publisher whenever the node's usage changes; with no usage known
(the watch not yet listed, or refused) the order is build_pool's, GPU index order.

ClaimUsage keeps that usage: one list+watch of ResourceClaims through gpunode's KubeClient (the agent's
credentials need list and watch on resourceclaims), keeping the allocation results of this driver on this
node's pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import msgspec
from lightkube.resources.resource_v1 import ResourceClaim

from gpunode.contract import dra as names
from gpunode.contract.draclaims import DeviceUsage, DeviceUse, claim_uses, usage_of
from gpunode.errors import GpunodeError
from gpunode.infra.kube import DELETED, SYNC, KubeClient
from gpunode.node.dra.slices import Pool

log = logging.getLogger(__name__)

RETRY_S = 30.0  # after the watch fails for good (a 403: no list/watch right on resourceclaims)
SYNC_WAIT_S = 5.0  # the longest the first publication waits for the claims' first list


def _attr(device: Mapping[str, Any], key: str) -> Any:
    value = (device.get("attributes") or {}).get(key) or {}
    return value.get("int", value.get("string"))


def _gpu(device: Mapping[str, Any]) -> str:
    """The GPU a device belongs to: the counter set it consumes (named after the GPU)."""
    consumes = device.get("consumesCounters") or [{}]
    return str(consumes[0].get("counterSet", device["name"]))


def _capacity(device: Mapping[str, Any]) -> int:
    value = ((device.get("capacity") or {}).get(names.CAPACITY_MEMORY) or {}).get("value", "0")
    return int(value) if str(value).isdigit() else 0


def _counters(device: Mapping[str, Any]) -> dict[str, int]:
    consumes = device.get("consumesCounters") or [{}]
    return {k: int(v["value"]) for k, v in (consumes[0].get("counters") or {}).items()}


def order_devices(
    devices: Sequence[Mapping[str, Any]], usage: Mapping[str, DeviceUsage]
) -> tuple[dict[str, Any], ...]:
    """The devices in gpunode's order of preference, given what is allocated of them (device -> usage)."""
    held = {_gpu(d) for d in devices if d["name"] in usage and usage[d["name"]].claims > 0}
    whole_held = {
        _gpu(d) for d in devices if _attr(d, names.ATTR_SHARING) == names.SHARING_WHOLE and d["name"] in usage
    }
    position = {d["name"]: i for i, d in enumerate(devices)}
    index = {d["name"]: _attr(d, names.ATTR_INDEX) or 0 for d in devices}

    # MIG: counters still free per GPU, then the free placements of each profile per GPU.
    mig = [d for d in devices if _attr(d, names.ATTR_SHARING) == names.SHARING_MIG]
    taken: dict[str, dict[str, int]] = {}
    for d in mig:
        if d["name"] in usage:
            for k, v in _counters(d).items():
                taken.setdefault(_gpu(d), {})[k] = taken.get(_gpu(d), {}).get(k, 0) + v

    def fits(d: Mapping[str, Any]) -> bool:
        used = taken.get(_gpu(d), {})
        for k, v in _counters(d).items():
            total = 7 if k == names.COUNTER_COMPUTE_SLICES else 1
            if used.get(k, 0) + v > total:
                return False
        return True

    free_mig: dict[tuple[str, Any], int] = {}
    for d in mig:
        if fits(d):
            slot = (_gpu(d), _attr(d, names.ATTR_MIG_PROFILE))
            free_mig[slot] = free_mig.get(slot, 0) + 1

    def key(d: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
        name, gpu, sharing = d["name"], _gpu(d), _attr(d, names.ATTR_SHARING)
        if sharing == names.SHARING_SHARED:
            usable = gpu not in whole_held
            used = usage[name].memory_bytes if name in usage else 0
            free = max(0, _capacity(d) - used)
            return (1, 0 if usable else 1, free, index[name], position[name])
        if sharing not in (names.SHARING_WHOLE, names.SHARING_SHARED, names.SHARING_MIG):
            return (3, 0, 0, 0, position[name])  # time-sliced replicas: build_pool's order, as they were
        if sharing == names.SHARING_MIG:
            if not fits(d):
                return (2, 1, 0, index[name], position[name])
            return (2, 0, free_mig[(gpu, _attr(d, names.ATTR_MIG_PROFILE))], index[name], position[name])
        return (0, 1 if gpu in held else 0, 0, index[name], position[name])

    # Each kind of device is reordered within the places that kind has in build_pool's list (the allocator
    # only compares devices of the class a claim asks), so with nothing allocated the order is build_pool's.
    out: list[dict[str, Any]] = [dict(d) for d in devices]
    for kind in {_attr(d, names.ATTR_SHARING) for d in devices}:
        places = [i for i, d in enumerate(devices) if _attr(d, names.ATTR_SHARING) == kind]
        ranked = sorted((devices[i] for i in places), key=key)
        for i, d in zip(places, ranked, strict=True):
            out[i] = dict(d)
    return tuple(out)


def order_pool(pool: Pool, usage: Mapping[str, DeviceUsage]) -> Pool:
    """The pool with its devices in gpunode's order (order_devices); counter sets and names unchanged."""
    return replace(pool, devices=order_devices(pool.devices, usage))


class ClaimUsage:
    """What the ResourceClaims allocated of this node's pool, kept current by a list+watch; calls
    `on_change` (the publisher's poke) when it changes. order(pool) is order_pool with that usage."""

    def __init__(
        self,
        *,
        client_factory: Callable[[], KubeClient],
        node_name: str,
        driver: str,
        retry_s: float = RETRY_S,
    ) -> None:
        self._client_factory = client_factory
        self.node_name = node_name
        self.driver = driver
        self.retry_s = retry_s
        self.on_change: Callable[[], None] | None = None
        self._uses: dict[str, list[DeviceUse]] = {}  # namespace/name -> this pool's devices it holds
        self._usage: dict[str, DeviceUsage] = {}
        self.synced = False
        self.problems = 0  # malformed allocation results skipped

    def usage(self) -> dict[str, DeviceUsage]:
        """device -> usage on this node's pool, as last seen."""
        return self._usage

    async def wait_synced(self, timeout_s: float = SYNC_WAIT_S) -> bool:
        """Until the claims are listed (True) or timeout_s has passed (False): the publisher's first write
        waits for it, so a restarted agent republishes the order the claims call for, not index order first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.synced and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return self.synced

    def order(self, pool: Pool) -> Pool:
        """The pool in gpunode's order for the usage known now (build_pool's order before the first list)."""
        return order_pool(pool, self._usage) if self.synced else pool

    def _mine(self, claim: Mapping[str, Any]) -> list[DeviceUse]:
        said: list[str] = []
        uses = [u for u in claim_uses(claim, self.driver, said) if u.pool == self.node_name]
        if said:
            self.problems += len(said)
            log.warning("DRA order: %s", said[0])
        return uses

    def replace_all(self, claims: Sequence[Mapping[str, Any]]) -> bool:
        """A fresh list; True when this pool's usage changed."""
        uses: dict[str, list[DeviceUse]] = {}
        for claim in claims:
            mine = self._mine(claim)
            if mine:
                uses[mine[0].claim] = mine
        self._uses = uses
        self.synced = True
        return self._recount()

    def claim_changed(self, claim: Mapping[str, Any], *, deleted: bool = False) -> bool:
        """One claim added, changed or deleted; True when this pool's usage changed."""
        meta = claim.get("metadata") or {}
        ref = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
        mine = [] if deleted else self._mine(claim)
        if not mine and ref not in self._uses:
            return False
        if mine:
            self._uses[ref] = mine
        else:
            self._uses.pop(ref, None)
        return self._recount()

    def _recount(self) -> bool:
        usage = usage_of(u for uses in self._uses.values() for u in uses)
        fresh = usage.get(self.node_name, {})
        before = {d: (u.claims, u.memory_bytes) for d, u in self._usage.items()}
        after = {d: (u.claims, u.memory_bytes) for d, u in fresh.items()}
        self._usage = fresh
        return before != after

    def _tell(self, changed: bool) -> None:
        if changed and self.on_change is not None:
            self.on_change()

    async def run(self) -> None:
        """List and watch the claims until cancelled; a refused watch is said once and tried again later."""
        said = False
        while True:
            client = self._client_factory()
            try:
                async with contextlib.aclosing(client.watch(ResourceClaim)) as events:
                    async for event in events:
                        if event.type == SYNC:
                            self._tell(self.replace_all([_json(o) for o in event.items]))
                        elif event.object is not None:
                            self._tell(self.claim_changed(_json(event.object), deleted=event.type == DELETED))
                        said = False
            except GpunodeError as exc:
                if not said:
                    log.warning(
                        "DRA order: cannot watch ResourceClaims (%s); the slice keeps GPU index order until "
                        "it can (the agent needs list and watch on resourceclaims); trying again every %g s",
                        exc,
                        self.retry_s,
                    )
                    said = True
            finally:
                await client.close()
            await asyncio.sleep(self.retry_s)


def _json(obj: Any) -> dict[str, Any]:
    out = msgspec.to_builtins(obj)
    return out if isinstance(out, dict) else {}
