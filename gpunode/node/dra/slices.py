"""The node's GPUs as a DRA resource pool: ResourceSlice objects, and the publisher that keeps them current.

build_pool turns the GPUs DRA serves into the pool's devices (resource.k8s.io/v1), in GPU index
order, which is the order kube-scheduler's allocator tries them in:

- A GPU without MIG gives two devices that take the same shared counter (the GPU's memory) whole:
  `<uuid>`, the whole GPU for one claim (DeviceClass gpu.gpunode.io, which `nvidia.com/gpu` maps
  to), and `<uuid>-shared`, allowMultipleAllocations, whose `memory` capacity claims take shares of
  (requestPolicy: the node's memory unit, gpunode.fractional.unit, as the minimum, the step and
  the default), so several claims share the GPU and the scheduler keeps the sum within capacity.
  The counter makes the two exclusive: once a claim holds the GPU whole, no share is offered, and
  once a share is taken the whole GPU is not (the allocator takes a multi-allocation device's
  counters once, when its first share is allocated).
- A GPU in MIG mode gives its 7 compute slices and 8 memory slices as shared counters, and one
  device per placement of a MIG profile of its model (`<uuid>-mig-<profile>-<start>`) that takes
  the slices the placement covers; a placement that overlaps one allocated is not offered, so the
  scheduler only picks profiles that fit what is left. Which placements are published is
  mig_placements': those of the GPU's instances, and with dynamic partitioning every placement
  that overlaps no instance gpunode did not create (gpunode.node.dra.prepare creates it).

Device names are derived from the GPU's UUID, so a restarted agent publishes the same names and
existing allocations stay valid. Unhealthy GPUs and MIG instances carry the taints of
gpunode.node.dra.taints on each of their devices.

Counter sets and devices go in separate slices (the API allows one or the other), at most 8 sets
and 64 devices per slice (the limits for devices that use counters or taints); every slice names
the node, the pool (the node's name) and its generation, and is owned by the Node, so deleting
the Node deletes them. SlicePublisher keeps them equal to build_pool's result, with a new pool
generation for every change (devices, health, configuration), through gpunode's KubeClient.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightkube.resources.resource_v1 import ResourceSlice

from gpunode.config.dra import MIG_DYNAMIC
from gpunode.contract import dra as names
from gpunode.contract.draclaims import gpu_device_name, shared_device_name  # the names both sides read
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.errors import GpunodeError, KubeConflict, KubeNotFound
from gpunode.infra.kube import KubeClient
from gpunode.node.devices.base import Gpu
from gpunode.node.devices.simnode.mig import (
    MIG_TABLES,
    TOTAL_COMPUTE_SLICES,
    TOTAL_MEMORY_SLICES,
    MigProfileSpec,
    table_of_model,
)
from gpunode.node.dra.taints import DeviceTaint

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 64  # with taints or counters (ResourceSliceMaxDevicesWithAdvancedFeatures)
MAX_COUNTER_SETS_PER_SLICE = 8  # ResourceSliceMaxCounterSets
CONTENT_ANNOTATION = "gpunode.io/slice-content"  # sha256 of what the agent wrote, generation aside
DEBOUNCE_S = 0.05

# CUDA compute capability by architecture, with the models that differ from their architecture's.
_CAPABILITY = {
    "kepler": "3.7",
    "maxwell": "5.2",
    "pascal": "6.1",
    "volta": "7.0",
    "turing": "7.5",
    "ampere": "8.6",
    "ada": "8.9",
    "hopper": "9.0",
    "blackwell": "10.0",
}
_CAPABILITY_BY_MODEL = (("A100", "8.0"), ("A30", "8.0"), ("P100", "6.0"), ("GB200", "10.0"), ("B200", "10.0"))


# -- names -------------------------------------------------------------------------------------------


def time_sliced_device_name(uuid: str) -> str:
    """The device claims take replicas of when the GPU is time-sliced."""
    return f"{gpu_device_name(uuid)}-timesliced"


def mig_device_name(uuid: str, profile: str, start: int) -> str:
    """One MIG placement: the profile without its dots and plus signs, and its first memory slice."""
    token = re.sub(r"[^a-z0-9]", "", profile.lower())
    return f"{gpu_device_name(uuid)}-mig-{token}-{start}"


def slice_name(node: str, driver: str, index: int) -> str:
    """The name of the pool's index-th ResourceSlice (a DNS subdomain, at most 253 characters)."""
    base = f"{node}-{driver}"
    if len(base) > 240:
        base = f"{node[:200]}-{hashlib.sha256(base.encode()).hexdigest()[:12]}"
    return f"{base}-{index}"


# -- attributes --------------------------------------------------------------------------------------


def semantic_version(text: str | None) -> str | None:
    """A driver or capability version as a semantic version ("535.183.01" -> "535.183.1"), or None."""
    if not text:
        return None
    parts = text.strip().split(".")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        return None
    numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(numbers)


def compute_capability(gpu: Gpu) -> str | None:
    """The CUDA compute capability of the GPU's model, where its architecture tells it."""
    for token, capability in _CAPABILITY_BY_MODEL:
        if token in gpu.model:
            return capability
    return _CAPABILITY.get((gpu.architecture or "").lower())


def mig_table(gpu: Gpu) -> str | None:
    """The MIG profile table of the GPU's model (gpunode.node.devices.simnode.mig), or None."""
    return table_of_model(gpu.model, gpu.memory_total_bytes)


def nvlink_domains(gpus: Sequence[Gpu]) -> dict[str, int]:
    """GPU UUID -> the lowest index among the GPUs NVLink joins it to (directly or not); only linked GPUs."""
    by_uuid = {g.uuid: g for g in gpus}
    out: dict[str, int] = {}
    for gpu in gpus:
        if gpu.uuid in out or not gpu.nvlink_peers:
            continue
        group, todo = {gpu.uuid}, [gpu.uuid]
        while todo:
            for peer in by_uuid[todo.pop()].nvlink_peers:
                if peer in by_uuid and peer not in group:
                    group.add(peer)
                    todo.append(peer)
        lowest = min(by_uuid[u].index for u in group)
        out.update(dict.fromkeys(group, lowest))
    return out


def _pci_bus_id(bus: str) -> str:
    """NVML's 8-digit PCI domain as sysfs writes it (0000:18:00.0)."""
    domain, _, rest = bus.lower().partition(":")
    return f"{domain[-4:]}:{rest}" if rest else bus.lower()


def _attributes(gpu: Gpu, driver_version: str | None, domain: int | None, **extra: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        names.ATTR_UUID: {"string": gpu.uuid},
        names.ATTR_PRODUCT: {"string": gpu.model[:64]},
        names.ATTR_INDEX: {"int": gpu.index},
        names.ATTR_PCI_BUS_ID: {"string": _pci_bus_id(gpu.pci_bus_id)},
    }
    if gpu.architecture:
        attrs[names.ATTR_ARCHITECTURE] = {"string": gpu.architecture.lower()}
    capability = semantic_version(compute_capability(gpu))
    if capability:
        attrs[names.ATTR_COMPUTE_CAPABILITY] = {"version": capability}
    version = semantic_version(driver_version)
    if version:
        attrs[names.ATTR_DRIVER_VERSION] = {"version": version}
    if gpu.numa_node is not None:
        attrs[names.ATTR_NUMA_NODE] = {"int": gpu.numa_node}
    if domain is not None:
        attrs[names.ATTR_NVLINK_DOMAIN] = {"int": domain}
    for key, value in extra.items():
        attrs[key] = {"int": value} if isinstance(value, int) else {"string": value}
    return attrs


# -- the pool ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    """The pool's counter sets and devices (resource.k8s.io/v1 JSON), in the order they are published."""

    counter_sets: tuple[dict[str, Any], ...] = ()
    devices: tuple[dict[str, Any], ...] = ()
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def device(self, name: str) -> dict[str, Any] | None:
        """The device of this name, or None."""
        return next((d for d in self.devices if d["name"] == name), None)

    def slice_specs(self) -> list[dict[str, Any]]:
        """The slices' contents: counter-set slices first, then devices, each within the API's limits."""
        specs: list[dict[str, Any]] = []
        sets, devices = list(self.counter_sets), list(self.devices)
        for i in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE):
            specs.append({"sharedCounters": sets[i : i + MAX_COUNTER_SETS_PER_SLICE]})
        for i in range(0, len(devices), MAX_DEVICES_PER_SLICE):
            specs.append({"devices": devices[i : i + MAX_DEVICES_PER_SLICE]})
        return specs or [{"devices": []}]  # an empty pool is one empty slice: the node has nothing


def build_pool(
    gpus: Iterable[Gpu],
    *,
    unit_bytes: int,
    driver_version: str | None = None,
    taints: Mapping[str, DeviceTaint] | None = None,
    time_sliced: Mapping[str, int] | None = None,
    mig_partitioning: str = MIG_DYNAMIC,
    mig_owned: Collection[str] = (),
) -> Pool:
    """The devices of these GPUs (the ones DRA serves), tainted where `taints` (GPU/MIG UUID -> taint) says.

    unit_bytes is the minimum, step and default of a share of a GPU's memory. time_sliced (GPU UUID ->
    replicas) names the GPUs a time-slicing resource lists: each offers `replicas` uncapped claims
    (`<uuid>-timesliced`) instead of memory shares. mig_partitioning (gpunode.dra.mig.partitioning) and
    mig_owned (the MIG UUIDs gpunode created for claims) decide the MIG placements (mig_placements).
    """
    gpus = sorted(gpus, key=lambda g: g.index)
    taints = taints or {}
    domains = nvlink_domains(gpus)
    sets: list[dict[str, Any]] = []
    devices: list[dict[str, Any]] = []
    warnings: list[str] = []
    for gpu in gpus:
        domain = domains.get(gpu.uuid)
        if gpu.mig_enabled:
            table = mig_table(gpu)
            if table is None:
                warnings.append(
                    f"GPU {gpu.index} ({gpu.model}) is in MIG mode, but its MIG profiles are not known to "
                    "gpunode: it is not published"
                )
                continue
            sets.append(_mig_counters(gpu))
            placements = mig_placements(gpu, table, dynamic=mig_partitioning == MIG_DYNAMIC, owned=mig_owned)
            devices.extend(_mig_devices(gpu, table, driver_version, domain, taints, placements))
            continue
        sets.append(
            {
                "name": gpu_device_name(gpu.uuid),
                "counters": {names.COUNTER_MEMORY: {"value": str(gpu.memory_total_bytes)}},
            }
        )
        replicas = (time_sliced or {}).get(gpu.uuid)
        devices.extend(
            _gpu_devices(gpu, unit_bytes, driver_version, domain, taints.get(gpu.uuid), warnings, replicas)
        )
    return Pool(tuple(sets), tuple(devices), tuple(warnings))


def _consumes(gpu: Gpu, counters: Mapping[str, int]) -> list[dict[str, Any]]:
    return [
        {
            "counterSet": gpu_device_name(gpu.uuid),
            "counters": {k: {"value": str(v)} for k, v in counters.items()},
        }
    ]


def _gpu_devices(
    gpu: Gpu,
    unit_bytes: int,
    driver_version: str | None,
    domain: int | None,
    taint: DeviceTaint | None,
    warnings: list[str],
    replicas: int | None = None,
) -> list[dict[str, Any]]:
    total = gpu.memory_total_bytes
    consumes = _consumes(gpu, {names.COUNTER_MEMORY: total})
    whole: dict[str, Any] = {
        "name": gpu_device_name(gpu.uuid),
        "attributes": _attributes(
            gpu,
            driver_version,
            domain,
            **{names.ATTR_TYPE: names.TYPE_GPU, names.ATTR_SHARING: names.SHARING_WHOLE},
        ),
        "capacity": {names.CAPACITY_MEMORY: {"value": str(total)}},
        "consumesCounters": consumes,
    }
    out = [whole]
    units = total // unit_bytes
    if replicas is not None:
        # Time-sliced: `replicas` claims share the GPU, each one replica, uncapped (as the device plugin's
        # replicas are); they and the whole GPU take the memory counter, so they exclude each other.
        one = "1"
        out.append(
            {
                "name": time_sliced_device_name(gpu.uuid),
                "allowMultipleAllocations": True,
                "attributes": _attributes(
                    gpu,
                    driver_version,
                    domain,
                    **{names.ATTR_TYPE: names.TYPE_GPU, names.ATTR_SHARING: names.SHARING_TIME_SLICED},
                ),
                "capacity": {  # no memory: a capacity without a request policy is consumed whole
                    names.CAPACITY_REPLICAS: {
                        "value": str(replicas),
                        "requestPolicy": {"default": one, "validRange": {"min": one, "max": one}},
                    },
                },
                "consumesCounters": consumes,
            }
        )
    elif units >= 2:
        step = str(unit_bytes)
        out.append(
            {
                "name": shared_device_name(gpu.uuid),
                "allowMultipleAllocations": True,
                "attributes": _attributes(
                    gpu,
                    driver_version,
                    domain,
                    **{names.ATTR_TYPE: names.TYPE_GPU, names.ATTR_SHARING: names.SHARING_SHARED},
                ),
                "capacity": {
                    names.CAPACITY_MEMORY: {
                        "value": str(units * unit_bytes),
                        "requestPolicy": {"default": step, "validRange": {"min": step, "step": step}},
                    },
                    # A claim that asks no compute reserves none; it runs with a share proportional
                    # to its memory (gpunode.node.dra.prepare). One that asks reserves it.
                    names.CAPACITY_COMPUTE: {
                        "value": str(MILLI_PER_GPU),
                        "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1"}},
                    },
                },
                "consumesCounters": consumes,
            }
        )
    else:
        warnings.append(
            f"GPU {gpu.index}: its {total} bytes hold fewer than two memory units of {unit_bytes} bytes: "
            "it is offered whole only"
        )
    if taint is not None:
        for device in out:
            device["taints"] = [taint.as_json()]
    return out


def _mig_counters(gpu: Gpu) -> dict[str, Any]:
    counters = {names.COUNTER_COMPUTE_SLICES: {"value": str(TOTAL_COMPUTE_SLICES)}}
    for i in range(TOTAL_MEMORY_SLICES):
        counters[names.MIG_MEMORY_SLICE_COUNTER.format(i)] = {"value": "1"}
    return {"name": gpu_device_name(gpu.uuid), "counters": counters}


def mig_instance_slices(gpu: Gpu, table: str) -> dict[str, range]:
    """MIG UUID -> the memory slices of each instance the GPU has now: its placement as the backend
    reads it, else (a backend that cannot say) from its GPU instance ID as simnode.mig numbers them."""
    first_gi = {8: 0, 4: 1, 2: 3, 1: 7}
    out: dict[str, range] = {}
    for mig in gpu.mig_devices:
        spec = MIG_TABLES[table].get(mig.profile)
        if spec is None or spec.memory_slices not in first_gi:
            continue
        start = mig.start
        if start is None:
            start = (mig.gi_id - first_gi[spec.memory_slices]) * spec.memory_slices
        out[mig.uuid] = range(start, start + spec.memory_slices)
    return out


def mig_placements(
    gpu: Gpu, table: str, *, dynamic: bool, owned: Collection[str] = ()
) -> list[tuple[MigProfileSpec, int]]:
    """The placements (profile, first memory slice) of a GPU in MIG mode that can be prepared, in the
    profile table's order: those of the instances the GPU has, and, when `dynamic`, every other one
    that overlaps no instance gpunode did not create (`owned`: the MIG UUIDs it created for claims;
    their slices are the scheduler's to count, through the counters their claims consume)."""
    instances = mig_instance_slices(gpu, table)
    have = {(m.profile, instances[m.uuid].start) for m in gpu.mig_devices if m.uuid in instances}
    foreign = [set(cells) for uuid, cells in instances.items() if uuid not in owned]
    out = []
    for spec in MIG_TABLES[table].values():
        for start in spec.starts:
            cells = set(range(start, start + spec.memory_slices))
            if (spec.name, start) in have or (dynamic and not any(cells & f for f in foreign)):
                out.append((spec, start))
    return out


def _mig_devices(
    gpu: Gpu,
    table: str,
    driver_version: str | None,
    domain: int | None,
    taints: Mapping[str, DeviceTaint],
    placements: list[tuple[MigProfileSpec, int]],
) -> list[dict[str, Any]]:
    instances = mig_instance_slices(gpu, table)
    out: list[dict[str, Any]] = []
    for spec, start in placements:
        cells = range(start, start + spec.memory_slices)
        counters = {names.COUNTER_COMPUTE_SLICES: spec.compute_slices}
        counters.update({names.MIG_MEMORY_SLICE_COUNTER.format(c): 1 for c in cells})
        device: dict[str, Any] = {
            "name": mig_device_name(gpu.uuid, spec.name, start),
            "attributes": _attributes(
                gpu,
                driver_version,
                domain,
                **{
                    names.ATTR_TYPE: names.TYPE_MIG,
                    names.ATTR_SHARING: names.SHARING_MIG,
                    names.ATTR_MIG_PROFILE: spec.name,
                    names.ATTR_MIG_START: start,
                },
            ),
            "capacity": {names.CAPACITY_MEMORY: {"value": str(spec.memory_bytes)}},
            "consumesCounters": _consumes(gpu, counters),
        }
        # The GPU's taint, or that of an instance whose memory slices the placement overlaps.
        found = [taints[gpu.uuid]] if gpu.uuid in taints else []
        found += [
            taints[uuid] for uuid, slices in instances.items() if uuid in taints and set(slices) & set(cells)
        ]
        if found:
            unique = list(dict.fromkeys(found))
            unique.sort(key=lambda t: t.effect != names.NO_EXECUTE)
            device["taints"] = [t.as_json() for t in unique[:16]]
        out.append(device)
    return out


# -- the slices ------------------------------------------------------------------------------------------


def content_digest(spec: Mapping[str, Any]) -> str:
    """A digest of one slice's content (not its generation), to tell whether the server already has it."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def build_slices(
    pool: Pool,
    *,
    node: str,
    driver: str,
    generation: int,
    owner: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The ResourceSlice objects of the pool at this generation (owned by the Node `owner` when given)."""
    specs = pool.slice_specs()
    out = []
    for i, content in enumerate(specs):
        meta: dict[str, Any] = {
            "name": slice_name(node, driver, i),
            "annotations": {CONTENT_ANNOTATION: content_digest(content)},
        }
        if owner is not None:
            meta["ownerReferences"] = [dict(owner)]
        spec = {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": len(specs)},
            **content,
        }
        out.append({"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": meta, "spec": spec})
    return out


# -- publishing ----------------------------------------------------------------------------------------


@dataclass
class _Existing:
    """What the API server holds of this node's pool: name -> (resourceVersion, content digest)."""

    slices: dict[str, tuple[str, str]] = field(default_factory=dict)
    generation: int = 0


class SlicePublisher:
    """Keeps this node's ResourceSlices equal to `pool()`: on every change (`changed` returns when the
    device state moves past a version, `poke()` from any thread), and every interval_s against the
    API server's own copy (slices deleted behind its back are written again). Failures are logged and
    retried with backoff; the rest of the agent never waits for the API server."""

    def __init__(
        self,
        *,
        client_factory: Callable[[], KubeClient],
        node_name: str,
        driver: str,
        pool: Callable[[], Pool],
        changed: Callable[[int], Awaitable[int]] | None = None,
        interval_s: float = 60.0,
        debounce_s: float = DEBOUNCE_S,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 30.0,
        order: Any = None,
    ) -> None:
        self._client_factory = client_factory
        self._client: KubeClient | None = None
        self.node_name = node_name
        self.driver = driver
        self._pool = pool
        # gpunode.node.dra.order.ClaimUsage (or None: GPU index order): lists the devices so that the
        # allocator's first fit is gpunode's choice; its watch runs beside the publisher and pokes it.
        self.order = order
        self._changed = changed
        self.interval_s = interval_s
        self.debounce_s = debounce_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.generation = 0
        self.published: list[dict[str, Any]] = []  # the slices as last written
        self.writes = 0  # slices created, replaced or deleted
        self.failures = 0
        self._existing: _Existing | None = None  # None: read the server before the next write
        self._owner: dict[str, str] | None = None
        self._time_added: dict[tuple[str, str, str, str], str] = {}  # (device, key, value, effect) -> time
        self._poked: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._said: tuple[str, ...] = ()

    def poke(self) -> None:
        """Publish soon (thread-safe): the configuration changed."""
        loop, event = self._loop, self._poked
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

    def client(self) -> KubeClient:
        """The API client (made on first use)."""
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    async def close(self) -> None:
        """Close the API client; the slices stay (a restarted agent takes them over)."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _read_existing(self) -> _Existing:
        selector = f"spec.nodeName={self.node_name},spec.driver={self.driver}"
        items, _ = await self.client().list_json(ResourceSlice, field_selector=selector)
        existing = _Existing()
        for item in items:
            meta, spec = item.get("metadata") or {}, item.get("spec") or {}
            if (spec.get("pool") or {}).get("name") != self.node_name:
                continue  # not this agent's pool: left alone
            digest = (meta.get("annotations") or {}).get(CONTENT_ANNOTATION, "")
            existing.slices[str(meta.get("name"))] = (str(meta.get("resourceVersion", "")), digest)
            existing.generation = max(existing.generation, int(spec["pool"].get("generation") or 0))
            self._remember_times(item)
        if self._owner is None:
            node = await self.client().get_node(self.node_name)
            uid = node.metadata.uid if node.metadata else None
            if uid:
                self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": uid}
        return existing

    def _remember_times(self, item: Mapping[str, Any]) -> None:
        for device in (item.get("spec") or {}).get("devices") or ():
            for taint in device.get("taints") or ():
                if taint.get("timeAdded"):
                    key = (device["name"], taint["key"], taint.get("value", ""), taint["effect"])
                    self._time_added.setdefault(key, taint["timeAdded"])

    def _with_times(self, body: dict[str, Any]) -> dict[str, Any]:
        """Keep the time a taint was first added (tolerationSeconds count from it) across rewrites."""
        for device in body["spec"].get("devices") or ():
            for taint in device.get("taints") or ():
                key = (device["name"], taint["key"], taint.get("value", ""), taint["effect"])
                if key in self._time_added:
                    taint["timeAdded"] = self._time_added[key]
        return body

    async def publish_once(self, *, resync: bool = False) -> bool:
        """Make the server's slices equal to the pool now; True when something was written. `resync`
        reads the server's copy first (always done on the first call and after a failure)."""
        pool = self._pool() if self.order is None else self.order.order(self._pool())
        if pool.warnings != self._said:
            for warning in pool.warnings:
                log.warning("DRA slices: %s", warning)
            self._said = pool.warnings
        if self._existing is None or resync:
            self._existing = None
            existing = await self._read_existing()
            self.generation = max(self.generation, existing.generation)
            self._existing = existing
        existing = self._existing
        want = {
            slice_name(self.node_name, self.driver, i): content_digest(spec)
            for i, spec in enumerate(pool.slice_specs())
        }
        have = {name: digest for name, (_, digest) in existing.slices.items()}
        if want == have:
            return False
        self.generation += 1
        bodies = build_slices(
            pool, node=self.node_name, driver=self.driver, generation=self.generation, owner=self._owner
        )
        self._existing = None  # until every write succeeded
        client = self.client()
        written: dict[str, tuple[str, str]] = {}

        async def write(body: dict[str, Any]) -> None:
            body = self._with_times(body)
            name = body["metadata"]["name"]
            if name in existing.slices:
                body["metadata"]["resourceVersion"] = existing.slices[name][0]
                stored = await client.replace_json(ResourceSlice, body)
            else:
                stored = await client.create_json(ResourceSlice, body)
            self.writes += 1
            self._remember_times(stored)
            written[name] = (str(stored["metadata"]["resourceVersion"]), want[name])

        try:
            # All slices at once: the scheduler uses the pool only when every slice has the new generation.
            await asyncio.gather(*(write(body) for body in bodies))
            for name, (version, _) in existing.slices.items():
                if name not in written:
                    with contextlib.suppress(KubeNotFound):
                        await client.delete_json(ResourceSlice, name, resource_version=version)
                    self.writes += 1
        except KubeConflict:
            self.generation += 1  # someone else wrote: re-read, and publish above what they wrote
            raise
        self._existing = _Existing(written, self.generation)
        self.published = bodies
        return True

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Publish now, then on every change and every interval_s, until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._poked = asyncio.Event()
        loop = self._loop
        version = -1
        delay = self.retry_initial_s
        next_resync = 0.0
        watcher = asyncio.ensure_future(self._watch_deletions())
        if self.order is not None:
            self.order.on_change = self.poke
        follower = asyncio.ensure_future(self.order.run()) if self.order is not None else watcher
        try:
            if self.order is not None:  # the first write in the order the claims call for (a few s at most)
                await self.order.wait_synced()
            while True:
                resync = loop.time() >= next_resync
                self._poked.clear()
                started = time.monotonic()
                try:
                    if await self.publish_once(resync=resync):
                        log.info(
                            "DRA slices: pool %s generation %d published (%d slice(s), %.0f ms)",
                            self.node_name,
                            self.generation,
                            len(self.published),
                            (time.monotonic() - started) * 1000,
                        )
                    if resync:
                        next_resync = loop.time() + self.interval_s
                    delay = self.retry_initial_s
                    wait_s = max(0.0, next_resync - loop.time())
                except GpunodeError as exc:
                    self.failures += 1
                    self._existing = None
                    log.warning("DRA slices: publishing failed (retry in %.0f s): %s", delay, exc)
                    wait_s, delay = delay, min(delay * 2, self.retry_max_s)
                if ready is not None and not ready.is_set():
                    ready.set()
                version = await self._wait(version, wait_s)
        finally:
            for task in {watcher, follower}:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.close()

    async def _watch_deletions(self) -> None:
        """Publish again at once when one of the pool's slices is deleted by someone else (the kubelet
        wipes a node's slices when it starts, and a driver's when its registration is gone a while)."""
        selector = f"spec.nodeName={self.node_name},spec.driver={self.driver}"
        try:
            async with contextlib.aclosing(
                self.client().watch(ResourceSlice, field_selector=selector)
            ) as events:
                async for event in events:
                    meta = getattr(event.object, "metadata", None)
                    name = getattr(meta, "name", None)
                    existing = self._existing
                    if event.type == "DELETED" and existing is not None and name in existing.slices:
                        log.warning("DRA slices: %s was deleted by someone else; publishing it again", name)
                        self._existing = None
                        self.poke()
        except GpunodeError as exc:
            log.warning(
                "DRA slices: cannot watch the slices (%s); they are checked every %g s", exc, self.interval_s
            )

    async def _wait(self, version: int, wait_s: float) -> int:
        """Until a change (device state past `version`, or a poke) or wait_s; the version to wait past next."""
        assert self._poked is not None
        waits: dict[asyncio.Future[Any], str] = {asyncio.ensure_future(self._poked.wait()): "poke"}
        if self._changed is not None:
            waits[asyncio.ensure_future(self._changed(version))] = "state"
        try:
            done, _ = await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        for fut in done:
            if waits[fut] == "state" and not fut.cancelled() and fut.exception() is None:
                version = int(fut.result())
        if done:
            await asyncio.sleep(self.debounce_s)  # let a burst of changes settle into one generation
        return version
