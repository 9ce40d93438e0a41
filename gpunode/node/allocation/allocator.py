"""What Allocate hands the container runtime for a set of device IDs.

Validates one container's request against the current Snapshot (unknown,
vanished, unhealthy or duplicate IDs; failRequestsGreaterThanOne; memory units
spanning GPUs) and builds the response parts the NVIDIA device plugin would
(NVIDIA_VISIBLE_DEVICES, volume-mount list, CDI annotations or CDI devices,
device nodes), plus gpunode's memory cap: a region per container written
through gpunode.node.memcap, with the preload library, the region and optionally an
/etc/ld.so.preload mounted into the container. The regions of one capped GPU are
kept within what it can hold (RegionBound): a region whose units a newer region
took belongs to a container that has ended, and such regions are removed, oldest
first, once the GPU has more regions than capped devices, whether or not the
kubelet can be asked. This module does not speak gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpunode.config.agent import Config
from gpunode.errors import AllocationError, MemcapError
from gpunode.node import memcap
from gpunode.node.devices.base import Gpu
from gpunode.node.inventory import AdvertisedDevice, Inventory, region_key
from gpunode.node.memcap import MountSpec
from gpunode.node.memcap.checkpoint import CapRecord, Checkpoint
from gpunode.node.memcap.compute import DEFAULT_MODE, ComputeMode, set_compute_share, share_from_memory
from gpunode.node.state import Snapshot

log = logging.getLogger(__name__)

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNT_DIR = "/var/run/nvidia-container-devices"
CDI_KIND = "nvidia.com/gpu"  # the NVIDIA container toolkit's CDI device kind; not a resource name
MIG_MINORS_FILE = Path("/proc/driver/nvidia-caps/mig-minors")


@dataclass(frozen=True)
class DeviceNode:
    """A device node to expose in a container: container path, host path and permissions."""

    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ContainerAllocation:
    """What one container gets: env vars, mounts, device nodes, annotations, CDI devices and region key."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[MountSpec, ...] = ()
    devices: tuple[DeviceNode, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()
    region_key: str | None = None  # set when the container got a memory cap


def validate_request(
    snapshot: Snapshot, resource: str, device_ids: Sequence[str], cfg: Config
) -> list[AdvertisedDevice]:
    """The devices of one container request, or AllocationError naming what is wrong."""
    if not device_ids:
        raise AllocationError(f"{resource}: the request names no device")
    seen: set[str] = set()
    devices: list[AdvertisedDevice] = []
    for dev_id in device_ids:
        if dev_id in seen:
            raise AllocationError(f"{resource}: device {dev_id} is requested twice")
        seen.add(dev_id)
        status = snapshot.status(dev_id)
        if status is None or status.device.resource != resource:
            raise AllocationError(f"{resource}: unknown device ID {dev_id!r}")
        if not status.healthy:
            raise AllocationError(
                f"{resource}: device {dev_id} is unhealthy ({status.reason})",
                hint="the kubelet will pick another device; see `gpunode devices` for the node's state",
            )
        devices.append(status.device)
    shared = any(d.kind == "replica" for d in devices)
    if cfg.time_slicing.fail_requests_greater_than_one and len(devices) > 1 and shared:
        raise AllocationError(
            f"{resource}: request for {len(devices)} shared devices refused "
            f"(sharing.{'mps' if cfg.time_slicing.mps else 'timeSlicing'}.failRequestsGreaterThanOne is set)",
            hint="ask for 1 replica, or turn failRequestsGreaterThanOne off",
        )
    capped = [d for d in devices if d.memory_cap_bytes is not None]
    if capped and len({d.gpu_uuid for d in capped}) > 1:
        gpus = sorted({d.gpu_uuid for d in capped})
        raise AllocationError(
            f"{resource}: memory-capped devices of one container must be on one GPU, got {', '.join(gpus)}",
            hint="the kubelet follows GetPreferredAllocation; ask for no more units than one GPU has",
        )
    return devices


def compute_mode(cfg: Config, device: AdvertisedDevice) -> ComputeMode:
    """How a capped device's compute share is enforced: hard for an MPS replica, else the default."""
    return ComputeMode.HARD if cfg.time_slicing.mps and device.kind == "replica" else DEFAULT_MODE


def mps_region(cfg: Config, resource: str) -> bool:
    """Whether the regions of `resource` are MPS replicas (their share is fixed at 1/replicas, hard)."""
    return cfg.time_slicing.mps and resource != cfg.fractional.resource_name


def _mig_minors(path: Path) -> dict[str, int]:
    """Parse /proc/driver/nvidia-caps/mig-minors ("gpu0/gi1/ci0/access 13")."""
    minors: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                minors[parts[0]] = int(parts[1])
    except OSError:
        pass
    return minors


class RegionBound:
    """Which regions of a capped GPU (or MIG device) to remove so it keeps no more than it can hold.

    The kubelet gives a device to one container at a time, so when a new region takes a unit (or
    capped replica) an older region held, that older region's container has ended: it is superseded.
    Regions nothing superseded hold disjoint units, so there are never more of them than the GPU has
    units; removing superseded regions, oldest first, whenever the GPU has more regions than units
    keeps every GPU within that bound at a cost per Allocate independent of the number of regions.
    (The newest superseded regions stay while there is room: an init container's region, whose units
    its pod's app container reuses, is needed until the init container has run.) Thread-safe.
    """

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._lock = threading.Lock()
        self._newest: dict[str, str] = {}  # device ID -> key of the newest region holding it
        self._superseded: dict[str, dict[str, None]] = {}  # capped UUID -> superseded keys, oldest first
        self._capacity: tuple[Inventory | None, dict[str, int]] = (None, {})
        self.evicted = 0  # regions removed to keep a GPU within its bound, since start
        for rec in sorted(checkpoint.records().values(), key=lambda r: r.created):
            self._note(rec)

    def _note(self, rec: CapRecord) -> None:
        superseded = self._superseded.setdefault(rec.gpu_uuid, {})
        superseded.pop(rec.key, None)  # the key given out again: a fresh region, not superseded
        for dev_id in rec.device_ids:
            prev = self._newest.get(dev_id)
            if prev is not None and prev != rec.key:
                superseded[prev] = None
            self._newest[dev_id] = rec.key

    def capacity(self, inventory: Inventory, uuid: str) -> int:
        """How many capped devices (memory units, capped replicas) of `uuid` the inventory advertises."""
        with self._lock:
            inv, counts = self._capacity
            if inv is not inventory:
                counts = {}
                for d in inventory.devices:
                    if d.memory_cap_bytes is not None:
                        counts[d.target_uuid] = counts.get(d.target_uuid, 0) + 1
                self._capacity = (inventory, counts)
            return counts.get(uuid, 0)

    def added(self, rec: CapRecord, capacity: int) -> list[str]:
        """Note a new region; the keys of the superseded regions to remove now, oldest first."""
        with self._lock:
            self._note(rec)
            return self._over(rec.gpu_uuid, capacity, keep=rec.key)

    def over(self, uuid: str, capacity: int) -> list[str]:
        """The keys of the superseded regions of `uuid` beyond `capacity`, oldest first (at start: the
        regions an agent without this bound left)."""
        with self._lock:
            return self._over(uuid, capacity, keep=None)

    def _over(self, uuid: str, capacity: int, keep: str | None) -> list[str]:
        superseded = self._superseded.setdefault(uuid, {})
        out: list[str] = []
        excess = self.checkpoint.count_on(uuid) - max(capacity, 1)
        while excess > 0 and superseded:
            key = next(iter(superseded))
            del superseded[key]
            if key != keep and self.checkpoint.get(key) is not None:
                out.append(key)
                excess -= 1
        if len(superseded) > 2 * max(capacity, 1):  # forget those the collector removed already
            for key in [k for k in superseded if self.checkpoint.get(k) is None]:
                del superseded[key]
        return out


class Allocator:
    """Builds ContainerAllocations; creates memory-cap regions under state_dir/memcap."""

    def __init__(
        self, *, config: Config, checkpoint: Checkpoint | None = None, mig_minors_file: Path = MIG_MINORS_FILE
    ) -> None:
        self.config = config
        self.regions_root = config.state_dir / "memcap"
        self.checkpoint = checkpoint
        self.preload_lib: Path | None = (
            None  # the host copy of the interposer (regions.stage_preload_library)
        )
        self._mig_minors_file = mig_minors_file
        self._root_secured = False  # memcap.secure_root runs before the first region is written
        self.bound = RegionBound(checkpoint) if checkpoint is not None else None

    def allocate(self, snapshot: Snapshot, resource: str, device_ids: Sequence[str]) -> ContainerAllocation:
        """Validate the requested devices of resource and build the container's allocation."""
        cfg = self.config
        devices = validate_request(snapshot, resource, device_ids, cfg)
        ids = self._visible_ids(snapshot, devices)
        envs: dict[str, str] = {}
        mounts: list[MountSpec] = []
        annotations: dict[str, str] = {}
        cdi: list[str] = []
        strategies = cfg.plugin.device_list_strategy
        if "envvar" in strategies:
            envs[VISIBLE_DEVICES_ENV] = ",".join(ids)
        if "volume-mounts" in strategies:
            envs[VISIBLE_DEVICES_ENV] = VOLUME_MOUNT_DIR
            mounts += [MountSpec(f"{VOLUME_MOUNT_DIR}/{i}", "/dev/null", True) for i in ids]
        if "cdi-annotations" in strategies or "cdi-cri" in strategies:
            names = [f"{CDI_KIND}={i}" for i in ids]
            if "cdi-annotations" in strategies:
                name = f"{cfg.plugin.cdi_annotation_prefix}gpunode-device-plugin_{region_key(device_ids)}"
                annotations[name] = ",".join(names)
            if "cdi-cri" in strategies:
                cdi += names
        nodes = self._device_nodes(snapshot, devices) if cfg.plugin.pass_device_specs else ()
        cap_key: str | None = None
        if any(d.memory_cap_bytes is not None for d in devices):
            cap_key, cap_envs, cap_mounts = self._memory_cap(snapshot, devices, device_ids, ids)
            envs.update(cap_envs)
            mounts += cap_mounts
        return ContainerAllocation(envs, tuple(mounts), tuple(nodes), annotations, tuple(cdi), cap_key)

    def _visible_ids(self, snapshot: Snapshot, devices: Sequence[AdvertisedDevice]) -> list[str]:
        out: list[str] = []
        for d in devices:
            if self.config.plugin.device_id_strategy == "index":
                gpu = snapshot.inventory.gpu(d.gpu_uuid)
                mig = gpu.mig_by_uuid(d.mig_uuid) if gpu and d.mig_uuid else None
                ident = (f"{gpu.index}:{mig.index}" if mig else str(gpu.index)) if gpu else d.target_uuid
            else:
                ident = d.target_uuid
            if ident not in out:
                out.append(ident)
        return out

    def _device_nodes(self, snapshot: Snapshot, devices: Sequence[AdvertisedDevice]) -> list[DeviceNode]:
        root = self.config.device_root.rstrip("/")
        nodes = [
            DeviceNode(p, f"{root}{p}")
            for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
        ]
        minors = _mig_minors(self._mig_minors_file) if any(d.mig_uuid for d in devices) else {}
        seen: set[str] = {n.container_path for n in nodes}

        def add(path: str) -> None:
            if path not in seen:
                seen.add(path)
                nodes.append(DeviceNode(path, f"{root}{path}"))

        for d in devices:
            gpu: Gpu | None = snapshot.inventory.gpu(d.gpu_uuid)
            if gpu is None:
                continue
            add(f"/dev/nvidia{gpu.minor}")
            mig = gpu.mig_by_uuid(d.mig_uuid) if d.mig_uuid else None
            if mig is not None:
                for cap in (
                    f"gpu{gpu.minor}/gi{mig.gi_id}/access",
                    f"gpu{gpu.minor}/gi{mig.gi_id}/ci{mig.ci_id}/access",
                ):
                    if cap in minors:
                        add(f"/dev/nvidia-caps/nvidia-cap{minors[cap]}")
                    else:
                        log.warning("no MIG capability minor for %s in %s", cap, self._mig_minors_file)
        return nodes

    def _memory_cap(
        self,
        snapshot: Snapshot,
        devices: Sequence[AdvertisedDevice],
        device_ids: Sequence[str],
        visible: Sequence[str],
    ) -> tuple[str, dict[str, str], list[MountSpec]]:
        gpu_uuid = devices[0].gpu_uuid
        gpu = snapshot.inventory.gpu(gpu_uuid)
        total = gpu.memory_total_bytes if gpu else 0
        if devices[0].mig_uuid and gpu is not None:
            mig = gpu.mig_by_uuid(devices[0].mig_uuid)
            total = mig.memory_total_bytes if mig else total
        limit = sum(d.memory_cap_bytes or 0 for d in devices)
        key = region_key(device_ids)
        try:
            if not self._root_secured:
                memcap.secure_root(self.regions_root)
                self._root_secured = True
            # Always a fresh region: whatever a previous holder of these units left in its usage file
            # (a zeroed magic, garbage, a truncated file, a huge counter) must not reach the new container.
            region = memcap.replace_region(
                self.regions_root,
                key,
                devices=(memcap.DeviceCap(devices[0].target_uuid, limit, total or limit),),
                fail_open=self.config.fractional.fail_open,
            )
            # The compute share, until the pod says otherwise: proportional to its memory share. An MPS
            # replica keeps it, hard: 1/replicas of the GPU, as MPS's active-thread percentage would give.
            set_compute_share(
                region, share_from_memory(limit, total or limit), compute_mode(self.config, devices[0])
            )
            spec = memcap.container_spec(
                region,
                preload_lib=self.preload_lib,
                visible_device=",".join(visible),
                ld_so_preload=self.config.fractional.ld_so_preload,
            )
        except MemcapError as exc:
            raise AllocationError(f"cannot set up the memory cap: {exc}", hint=exc.hint) from None
        if self.checkpoint is not None:
            record = CapRecord(
                key=key,
                resource=devices[0].resource,
                device_ids=tuple(device_ids),
                gpu_uuid=devices[0].target_uuid,
                limit_bytes=region.devices[0].limit_bytes,
                device_total_bytes=total or limit,
                fail_open=self.config.fractional.fail_open,
                created=time.time(),
            )
            try:
                self.checkpoint.replace(record)
            except OSError as exc:
                raise AllocationError(
                    f"cannot checkpoint the memory cap of {key}: {exc.strerror or exc}",
                    hint=f"the state directory {self.config.state_dir} must be writable",
                ) from None
            self._keep_bound(snapshot, record)
        return key, dict(spec.envs), list(spec.mounts)

    def _keep_bound(self, snapshot: Snapshot, record: CapRecord) -> None:
        """Remove the superseded regions of the record's GPU beyond what the GPU can hold."""
        if self.bound is None:
            return
        capacity = self.bound.capacity(snapshot.inventory, record.gpu_uuid)
        self._evict(self.bound.added(record, capacity), record.gpu_uuid, capacity)

    def trim(self, inventory: Inventory) -> int:
        """Bring every capped GPU within its bound (at start); the number of regions removed."""
        if self.checkpoint is None or self.bound is None:
            return 0
        before = self.bound.evicted
        for uuid in {r.gpu_uuid for r in self.checkpoint.records().values()}:
            capacity = self.bound.capacity(inventory, uuid)
            if capacity:  # a GPU no longer capped keeps its regions until the collector removes them
                self._evict(self.bound.over(uuid, capacity), uuid, capacity)
        removed = self.bound.evicted - before
        if removed:
            log.info(
                "memory caps: removed %d region(s) of ended containers beyond their GPUs' units", removed
            )
        return removed

    def _evict(self, keys: Sequence[str], uuid: str, capacity: int) -> None:
        assert self.checkpoint is not None and self.bound is not None
        for old in keys:
            try:
                memcap.remove_region(self.regions_root, old)
            except MemcapError as exc:
                log.warning("memory caps: cannot remove the superseded region %s: %s", old, exc)
                continue
            self.checkpoint.remove([old])
            self.bound.evicted += 1
            log.debug(
                "memory caps: removed region %s of %s: newer regions took its units and the GPU "
                "holds at most %d",
                old,
                uuid,
                capacity,
            )
