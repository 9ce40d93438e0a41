"""From physical GPUs and the configuration to the resources and device IDs the node advertises.

Pure functions over frozen data: no I/O, no NVML, no gRPC. `build_inventory`
decides one sharing mode per GPU (whole, time-sliced, fractional or MIG, or
`dra` for a GPU the DRA kubelet plugin serves instead: it is advertised nothing),
names every advertised device the way the NVIDIA device plugin does (GPU UUID,
MIG UUID, `<id>::<n>` replicas) plus gpunode's memory units
(`<id>::mem<n>`; both formats are gpunode.contract.deviceids), and says why
each device is advertised. It also makes the
configuration checks that need the GPUs in hand: a MIG strategy the GPUs cannot
satisfy, a device selector naming a GPU that does not exist or matching none,
two sharing modes for one GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gpunode.config.agent import Config, shared_resource_name
from gpunode.config.dra import dra_time_slicing
from gpunode.config.sharing import DeviceSelector, SharedResource
from gpunode.contract.deviceids import memory_unit_id, replica_id
from gpunode.contract.names import GIB, GPU_RESOURCE, MIB, Sharing, mig_resource_name
from gpunode.contract.reader import format_bytes
from gpunode.errors import ConfigError
from gpunode.node.devices.base import Gpu, MigDevice

# What one node may advertise. A device is about 70 bytes of a kubelet ListAndWatch message (ID,
# health, NUMA node), so 16384 devices stay far below gRPC's default 4 MiB message limit (a test
# checks it), and the kubelet's checkpoint stays small. Counts are checked before devices are built.
MAX_UNITS_PER_GPU = 1024  # gpunode.fractional memory units of one GPU
MAX_DEVICES_PER_NODE = 16384  # every advertised device ID of the node, all resources together


@dataclass(frozen=True)
class AdvertisedDevice:
    """One device ID in one advertised resource."""

    id: str  # kubelet device ID: GPU UUID, MIG UUID, "<id>::<n>" replica, "<id>::mem<n>" memory unit
    resource: str  # "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/gpu.shared", ...
    gpu_uuid: str  # parent physical GPU
    mig_uuid: str | None  # set for MIG devices and their replicas
    kind: str  # "gpu" | "mig" | "replica" | "memory"
    numa_node: int | None
    memory_cap_bytes: int | None  # memory unit size, or the cap of a capped replica; None = uncapped
    reason: str

    @property
    def target_uuid(self) -> str:
        """The UUID the container runtime is given (NVIDIA_VISIBLE_DEVICES)."""
        return self.mig_uuid or self.gpu_uuid


@dataclass(frozen=True)
class Inventory:
    """The advertised devices, their physical GPUs, each GPU's sharing mode and discovery warnings."""

    devices: tuple[AdvertisedDevice, ...] = ()
    gpus: tuple[Gpu, ...] = ()  # the physical GPUs the devices come from
    modes: tuple[tuple[str, Sharing], ...] = ()  # (GPU UUID, sharing mode) in GPU order
    warnings: tuple[str, ...] = ()
    _by_id: dict[str, AdvertisedDevice] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_id.update({d.id: d for d in self.devices})

    def by_id(self, device_id: str) -> AdvertisedDevice | None:
        """The device with this ID, or None."""
        return self._by_id.get(device_id)

    def resources(self) -> tuple[str, ...]:
        """The resource names of the devices, in first-seen order without duplicates."""
        return tuple(dict.fromkeys(d.resource for d in self.devices))

    def by_resource(self, resource: str) -> tuple[AdvertisedDevice, ...]:
        """The devices advertised under resource."""
        return tuple(d for d in self.devices if d.resource == resource)

    def gpu(self, gpu_uuid: str) -> Gpu | None:
        """The GPU with this UUID, or None."""
        return next((g for g in self.gpus if g.uuid == gpu_uuid), None)

    def mode_of(self, gpu_uuid: str) -> Sharing | None:
        """The sharing mode of the GPU with this UUID, or None."""
        return dict(self.modes).get(gpu_uuid)


def region_key(device_ids: Iterable[str]) -> str:
    """The memory-cap region key of one container's allocation (order-independent)."""
    joined = ",".join(sorted(set(device_ids)))
    return hashlib.sha256(joined.encode()).hexdigest()[:20]


def _check_selector(selector: DeviceSelector, gpus: Sequence[Gpu]) -> None:
    if selector.all:
        return
    hint = "list the node's GPUs with `gpunode devices`"
    indexes = {g.index for g in gpus}
    mig_indexes = {(g.index, m.index) for g in gpus for m in g.mig_devices}
    uuids = {g.uuid for g in gpus} | {m.uuid for g in gpus for m in g.mig_devices}
    for i in selector.indexes:
        if i not in indexes:
            raise ConfigError(
                f"{selector.where}: there is no GPU with index {i} on this node "
                f"(indexes: {', '.join(map(str, sorted(indexes))) or 'none'})",
                hint=hint,
            )
    for gi, mi in selector.mig_indexes:
        if (gi, mi) not in mig_indexes:
            raise ConfigError(f"{selector.where}: there is no MIG device {gi}:{mi} on this node", hint=hint)
    for u in selector.uuids:
        if u not in uuids:
            raise ConfigError(f"{selector.where}: there is no GPU or MIG device {u} on this node", hint=hint)


def _check_mig_strategy(cfg: Config, gpus: Sequence[Gpu]) -> list[str]:
    warnings: list[str] = []
    enabled = [g for g in gpus if g.mig_enabled]
    for g in enabled:
        if not g.mig_devices and cfg.mig_strategy != "none":
            warnings.append(
                f"GPU {g.index} ({g.uuid}) has MIG enabled but no MIG devices: nothing to advertise"
            )
    where = cfg.origin("mig_strategy", "flags.migStrategy")
    if cfg.mig_strategy == "single" and enabled:
        disabled = [g for g in gpus if not g.mig_enabled]
        if disabled:
            raise ConfigError(
                f"{where}: single needs MIG enabled on every GPU, but GPU(s) "
                f"{', '.join(str(g.index) for g in disabled)} have MIG disabled",
                hint="use migStrategy: mixed for a node with MIG and non-MIG GPUs",
            )
        profiles = sorted({m.profile for g in enabled for m in g.mig_devices})
        if len(profiles) > 1:
            raise ConfigError(
                f"{where}: single needs one MIG profile on the whole node, found {', '.join(profiles)}",
                hint="use migStrategy: mixed to advertise each profile as nvidia.com/mig-<profile>",
            )
    if cfg.mig_strategy == "single" and not enabled:
        warnings.append("migStrategy single: no GPU has MIG enabled, GPUs are advertised whole")
    if cfg.mig_strategy == "none" and enabled:
        warnings.append(
            f"migStrategy none: GPU(s) {', '.join(str(g.index) for g in enabled)} have MIG enabled "
            "and are advertised whole, as the NVIDIA plugin does"
        )
    return warnings


def _base_id(gpu: Gpu, mig: MigDevice | None = None) -> str:
    """The kubelet device ID: always the UUID, as the NVIDIA plugin advertises it. deviceIDStrategy
    only changes what the container runtime is handed at Allocate (allocation.py), never these IDs."""
    return mig.uuid if mig else gpu.uuid


def _replica_cap(cfg: Config, total_bytes: int, replicas: int) -> int | None:
    if cfg.time_slicing.mps:  # MPS's pinned memory limit: an equal part of the GPU per replica
        return total_bytes // replicas
    cap = cfg.replica_memory_cap
    if cap is None:
        return None
    if cap == "equal":
        return total_bytes // replicas
    assert isinstance(cap, int)
    return min(cap, total_bytes)


def _slicing_for(cfg: Config, resource: str, gpu: Gpu, mig: MigDevice | None = None) -> SharedResource | None:
    for res in cfg.time_slicing.resources:
        if res.name != resource:
            continue
        if mig is None and res.devices.matches(gpu.index, gpu.uuid):
            return res
        if mig is not None and res.devices.matches_mig(gpu.index, gpu.uuid, mig.index, mig.uuid):
            return res
    return None


def _emit(
    out: list[AdvertisedDevice],
    cfg: Config,
    *,
    resource: str,
    gpu: Gpu,
    mig: MigDevice | None,
    reason: str,
) -> None:
    """Append the device(s) for one schedulable unit (a GPU or a MIG device), replicated if configured."""
    base = _base_id(gpu, mig)
    sharing = _slicing_for(cfg, resource, gpu, mig)
    if sharing is None:
        out.append(
            AdvertisedDevice(
                id=base,
                resource=resource,
                gpu_uuid=gpu.uuid,
                mig_uuid=mig.uuid if mig else None,
                kind="mig" if mig else "gpu",
                numa_node=gpu.numa_node,
                memory_cap_bytes=None,
                reason=reason,
            )
        )
        return
    total = mig.memory_total_bytes if mig else gpu.memory_total_bytes
    cap = _replica_cap(cfg, total, sharing.replicas)
    name = shared_resource_name(cfg, sharing)
    how = "MPS-shared (hard compute share of 1/replicas)" if cfg.time_slicing.mps else "time-sliced"
    why = f"{reason}; {how} into {sharing.replicas} replicas ({sharing.devices.where or 'all'})"
    if cap is not None:
        why += f", each capped at {cap / GIB:.1f} GiB"
    out.extend(
        AdvertisedDevice(
            id=replica_id(base, n),
            resource=name,
            gpu_uuid=gpu.uuid,
            mig_uuid=mig.uuid if mig else None,
            kind="replica",
            numa_node=gpu.numa_node,
            memory_cap_bytes=cap,
            reason=why,
        )
        for n in range(sharing.replicas)
    )


class _Problems:
    """Configuration problems found with the GPUs in hand: fatal at start-up, warnings on rediscovery."""

    def __init__(self, strict: bool, warnings: list[str]) -> None:
        self.strict = strict
        self.warnings = warnings

    def __call__(self, message: str, hint: str | None = None) -> None:
        """Raise the problem as a ConfigError (strict), or keep it as a warning."""
        if self.strict:
            raise ConfigError(message, hint=hint)
        self.warnings.append(message)


def build_inventory(gpus: Sequence[Gpu], cfg: Config, *, strict: bool = True) -> Inventory:
    """Everything the node advertises, or a ConfigError if the configuration does not fit these GPUs.

    strict=False is for rediscovery while running: a device selector that names a GPU which has
    since vanished gives a warning instead of an error, so a hot-unplug never stops the agent.
    """
    warnings = _check_mig_strategy(cfg, gpus)
    problem = _Problems(strict, warnings)
    selectors = _selectors(cfg)
    for sel in selectors:
        try:
            _check_selector(sel, gpus)
        except ConfigError as exc:
            problem(str(exc), exc.hint)

    devices: list[AdvertisedDevice] = []
    modes: list[tuple[str, Sharing]] = []
    matched: dict[str, int] = {}

    def count(selector: DeviceSelector) -> None:
        matched[selector.where] = matched.get(selector.where, 0) + 1

    for gpu in gpus:
        if len(devices) > MAX_DEVICES_PER_NODE:
            _too_many_devices(cfg, len(devices), gpu)
        if cfg.dra.serves(gpu.index, gpu.uuid):  # a GPU is served by DRA or by the device plugin, never both
            # (a time-slicing list may name it: DRA publishes it time-sliced, gpunode.config.dra)
            by_dra = [r.devices for r in dra_time_slicing(cfg.time_slicing)]
            for sel in by_dra:
                if gpu.index in sel.indexes or gpu.uuid in sel.uuids:
                    count(sel)
            _check_not_named([s for s in selectors if s not in by_dra], gpu, problem)
            modes.append((gpu.uuid, Sharing.DRA))
            continue
        mode = _sharing_mode(cfg, gpu, count, problem)
        modes.append((gpu.uuid, mode))
        if mode == Sharing.MIG:
            _advertise_mig_devices(devices, cfg, gpu, count)
        elif mode == Sharing.FRACTIONAL:
            devices.extend(_memory_units(cfg, gpu, problem))
        else:
            note = " (MIG enabled, migStrategy none)" if gpu.mig_enabled else ""
            _emit(
                devices, cfg, resource=GPU_RESOURCE, gpu=gpu, mig=None, reason=f"whole GPU {gpu.index}{note}"
            )

    if len(devices) > MAX_DEVICES_PER_NODE:
        _too_many_devices(cfg, len(devices), None)
    for sel in selectors:
        if not sel.all and not matched.get(sel.where):
            problem(f"{sel.where}: the selector ({sel.describe()}) matches no GPU that can use it")
    if _shares_gpu_resource(cfg, modes):
        warnings.append(
            "whole and time-sliced GPUs share the resource nvidia.com/gpu; set "
            "sharing.timeSlicing.renameByDefault or rename to tell them apart"
        )
    return Inventory(devices=tuple(devices), gpus=tuple(gpus), modes=tuple(modes), warnings=tuple(warnings))


def _check_not_named(selectors: Sequence[DeviceSelector], gpu: Gpu, problem: _Problems) -> None:
    """A device-plugin selector that lists a GPU DRA serves (by index or UUID) is a problem."""
    for sel in selectors:
        if not sel.all and (gpu.index in sel.indexes or gpu.uuid in sel.uuids):
            problem(
                f"{sel.where}: GPU {gpu.index} ({gpu.uuid}) is served through DRA (gpunode.dra.devices); "
                "a GPU is served by DRA or by the device plugin, not both",
                hint="remove the GPU from one of the two selections",
            )


def _too_many_devices(cfg: Config, count: int, at: Gpu | None) -> None:
    """Refuse a configuration that would advertise more than MAX_DEVICES_PER_NODE devices."""
    where = f" before GPU {at.index}" if at is not None else ""
    raise ConfigError(
        f"{cfg.source}: the configuration would advertise {count} devices{where}; a node advertises at "
        f"most {MAX_DEVICES_PER_NODE}",
        hint="lower sharing.timeSlicing replicas or raise gpunode.fractional.unit",
    )


def _selectors(cfg: Config) -> list[DeviceSelector]:
    """The device selectors of the configuration: each time-sliced resource's, then gpunode.fractional's."""
    frac = cfg.fractional
    selectors = [r.devices for r in cfg.time_slicing.resources]
    if frac.devices is not None:
        selectors.append(frac.devices)
    return selectors


def _sharing_mode(
    cfg: Config, gpu: Gpu, count: Callable[[DeviceSelector], None], problem: _Problems
) -> Sharing:
    """The one sharing mode of a GPU, counting the selectors that match it; two modes are a problem."""
    frac = cfg.fractional
    use_mig = gpu.mig_enabled and cfg.mig_strategy != "none"
    fractional = frac.devices is not None and frac.devices.matches(gpu.index, gpu.uuid)
    sliced = None if use_mig else _slicing_for(cfg, GPU_RESOURCE, gpu)
    if frac.devices is not None and fractional:
        count(frac.devices)
    if sliced is not None:
        count(sliced.devices)
    if fractional and (gpu.mig_enabled or sliced is not None):
        problem(
            f"{cfg.source}: GPU {gpu.index} ({gpu.uuid}) is selected by gpunode.fractional.devices "
            f"and uses {'MIG' if gpu.mig_enabled else 'time-slicing'}: a GPU has one sharing mode at a time",
            hint="narrow one of the device selectors",
        )
        fractional = False
    if use_mig:
        return Sharing.MIG
    if fractional:
        return Sharing.FRACTIONAL
    return Sharing.TIME_SLICED if sliced is not None else Sharing.WHOLE


def _advertise_mig_devices(
    devices: list[AdvertisedDevice], cfg: Config, gpu: Gpu, count: Callable[[DeviceSelector], None]
) -> None:
    """Append the MIG devices of a GPU in MIG mode, under the resource names the MIG strategy gives."""
    for mig in gpu.mig_devices:
        resource = GPU_RESOURCE if cfg.mig_strategy == "single" else mig_resource_name(mig.profile)
        sliced_mig = _slicing_for(cfg, resource, gpu, mig)
        if sliced_mig is not None and cfg.time_slicing.mps:
            raise ConfigError(  # as NVIDIA's plugin, at start and on rediscovery alike
                f"{cfg.source}: sharing.mps: sharing using MPS is not supported for MIG devices (GPU {gpu.index} "
                f"has MIG enabled and migStrategy single advertises its MIG devices as {resource})",
                hint="disable MIG on the GPU, set migStrategy none, or narrow sharing.mps.resources[].devices",
            )
        if sliced_mig is not None:
            count(sliced_mig.devices)
        _emit(
            devices,
            cfg,
            resource=resource,
            gpu=gpu,
            mig=mig,
            reason=f"MIG {mig.profile} (GI {mig.gi_id}, CI {mig.ci_id}) on GPU {gpu.index}, "
            f"migStrategy {cfg.mig_strategy}",
        )


def _memory_units(cfg: Config, gpu: Gpu, problem: _Problems) -> list[AdvertisedDevice]:
    """The memory units of a fractional GPU, each capped at one unit by the interposer."""
    frac = cfg.fractional
    units = gpu.memory_total_bytes // frac.unit_bytes
    if units > MAX_UNITS_PER_GPU:
        # Refused even while rediscovering (never built): the smallest unit that fits is named.
        smallest = -(-gpu.memory_total_bytes // MAX_UNITS_PER_GPU // MIB) * MIB
        raise ConfigError(
            f"{cfg.source}: gpunode.fractional.unit: {format_bytes(frac.unit_bytes)} gives {units} units on "
            f"GPU {gpu.index} ({gpu.memory_total_bytes // MIB} MiB); at most {MAX_UNITS_PER_GPU} units per "
            f"GPU are allowed",
            hint=f"use a unit of at least {format_bytes(smallest)} for this GPU (1Gi suits most)",
        )
    if units == 0:
        problem(
            f"{cfg.source}: gpunode.fractional.unit: {frac.unit_bytes} bytes is more than the "
            f"{gpu.memory_total_bytes} bytes of GPU {gpu.index} ({gpu.uuid}): it would advertise nothing",
            hint="choose a unit smaller than the GPU's memory, such as 1Gi",
        )
    return [
        AdvertisedDevice(
            id=memory_unit_id(_base_id(gpu), n),
            resource=frac.resource_name,
            gpu_uuid=gpu.uuid,
            mig_uuid=None,
            kind="memory",
            numa_node=gpu.numa_node,
            memory_cap_bytes=frac.unit_bytes,
            reason=f"fractional GPU {gpu.index}: {units} units of {frac.unit_bytes / GIB:g} GiB, "
            "memory capped by the interposer",
        )
        for n in range(units)
    ]


def _shares_gpu_resource(cfg: Config, modes: Sequence[tuple[str, Sharing]]) -> bool:
    """Whether whole and time-sliced GPUs would both be advertised as nvidia.com/gpu."""
    shared_unrenamed = any(
        r.name == GPU_RESOURCE and shared_resource_name(cfg, r) == GPU_RESOURCE
        for r in cfg.time_slicing.resources
    )
    mode_set = {m for _, m in modes}
    return shared_unrenamed and {Sharing.WHOLE, Sharing.TIME_SLICED} <= mode_set
