"""This node's published DRA devices, read back from its ResourceSlices.

The allocation result of a claim names a device by pool and name; what GPU that is, and whether it
is the whole GPU, a share of its memory or a MIG placement, is what the node's own ResourceSlices
say (their publisher is gpunode.node.dra.slices). Only slices of this driver on this node are read
(fieldSelector spec.nodeName and spec.driver), so a claim allocated on another node's device is
refused. The answer is cached and read again when a name is not found (misses at the same time
share one read), so a slice republished with new devices is seen without a read per claim.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gpunode.contract import dra as names
from gpunode.node.dra.claims import DeviceInfo

log = logging.getLogger(__name__)

SliceLister = Callable[[], Awaitable[list[dict[str, Any]]]]


def _attribute(attrs: Mapping[str, Any], driver: str, name: str) -> str | None:
    for key in (name, f"{driver}/{name}"):
        value = attrs.get(key)
        if isinstance(value, Mapping) and isinstance(value.get("string"), str):
            return str(value["string"])
    return None


def _int_attribute(attrs: Mapping[str, Any], driver: str, name: str) -> int | None:
    for key in (name, f"{driver}/{name}"):
        value = attrs.get(key)
        if isinstance(value, Mapping) and type(value.get("int")) is int:
            return int(value["int"])
    return None


def devices_of(slices: list[dict[str, Any]], driver: str, node: str) -> dict[tuple[str, str], DeviceInfo]:
    """(pool, device name) -> DeviceInfo for every GPU device of this driver and node in the slices."""
    out: dict[tuple[str, str], DeviceInfo] = {}
    for item in slices:
        spec = item.get("spec") if isinstance(item, Mapping) else None
        if not isinstance(spec, Mapping) or spec.get("driver") != driver or spec.get("nodeName") != node:
            continue
        pool = spec.get("pool")
        pool_name = pool.get("name") if isinstance(pool, Mapping) else None
        if not isinstance(pool_name, str):
            continue
        for dev in spec.get("devices") or ():
            if not isinstance(dev, Mapping) or not isinstance(dev.get("name"), str):
                continue
            attrs = dev.get("attributes") or {}
            uuid = _attribute(attrs, driver, names.ATTR_UUID) if isinstance(attrs, Mapping) else None
            if uuid is None:
                continue
            kind = _attribute(attrs, driver, names.ATTR_TYPE) or names.TYPE_GPU
            sharing = _attribute(attrs, driver, names.ATTR_SHARING) or (
                names.SHARING_MIG if kind == names.TYPE_MIG else names.SHARING_WHOLE
            )
            profile = start = None
            if kind == names.TYPE_MIG:
                profile = _attribute(attrs, driver, names.ATTR_MIG_PROFILE)
                start = _int_attribute(attrs, driver, names.ATTR_MIG_START)
            out[(pool_name, dev["name"])] = DeviceInfo(
                pool_name, dev["name"], uuid, kind, sharing, profile, start
            )
    return out


class DeviceDirectory:
    """Looks up this node's devices by pool and name; reads the slices again on a miss."""

    def __init__(self, lister: SliceLister, *, driver: str, node: str) -> None:
        self._lister = lister
        self.driver = driver
        self.node = node
        self._devices: dict[tuple[str, str], DeviceInfo] = {}
        self.reads = 0  # how often the slices were read
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        """Read the node's slices now (errors are the lister's: KubeError)."""
        slices = await self._lister()
        self._devices = devices_of(slices, self.driver, self.node)
        self.reads += 1

    async def lookup(self, pool: str, name: str) -> DeviceInfo | None:
        """The device, reading the slices again first if it is not known (misses at once share one read)."""
        found = self._devices.get((pool, name))
        if found is not None:
            return found
        reads = self.reads
        async with self._lock:
            if self.reads == reads:  # nobody read them while this miss waited
                await self.refresh()
        return self._devices.get((pool, name))

    def known(self, pool: str, name: str) -> DeviceInfo | None:
        """The device as last read, without reading."""
        return self._devices.get((pool, name))

    def all(self) -> list[DeviceInfo]:
        """Every device as last read."""
        return list(self._devices.values())


def kube_slice_lister(client: Any, *, driver: str, node: str) -> SliceLister:
    """A SliceLister over the project's KubeClient: this node's ResourceSlices of this driver."""
    from lightkube.resources.resource_v1 import ResourceSlice

    async def lister() -> list[dict[str, Any]]:
        items, _ = await client.list_json(
            ResourceSlice, field_selector=f"spec.nodeName={node},spec.driver={driver}"
        )
        return list(items)

    return lister
