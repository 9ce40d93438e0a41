"""From physical GPUs and the configuration to the resources and device IDs the node advertises.

Pure functions over frozen data: no I/O, no NVML, no gRPC. `build_inventory`
decides one sharing mode per GPU (whole, time-sliced, fractional or MIG),
names every advertised device the way the NVIDIA device plugin does (GPU UUID,
MIG UUID, `<id>::<n>` replicas) plus gpunode's memory units
(`<id>::mem<n>`), and says why each device is advertised. It also makes the
configuration checks that need the GPUs in hand: a MIG strategy the GPUs cannot
satisfy, a device selector naming a GPU that does not exist or matching none,
two sharing modes for one GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpunode.config import Config, DeviceSelector, SharedResource
from gpunode.devices.base import Gpu, MigDevice
from gpunode.errors import ConfigError

GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

# Sharing modes of a physical GPU.
WHOLE, TIME_SLICED, FRACTIONAL, MIG = "whole", "time-sliced", "fractional", "mig"


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
    devices: tuple[AdvertisedDevice, ...] = ()
    gpus: tuple[Gpu, ...] = ()  # the physical GPUs the devices come from
    modes: tuple[tuple[str, str], ...] = ()  # (GPU UUID, sharing mode) in GPU order
    warnings: tuple[str, ...] = ()
    _by_id: dict[str, AdvertisedDevice] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_id.update({d.id: d for d in self.devices})

    def by_id(self, device_id: str) -> AdvertisedDevice | None:
        return self._by_id.get(device_id)

    def resources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.resource for d in self.devices))

    def by_resource(self, resource: str) -> tuple[AdvertisedDevice, ...]:
        return tuple(d for d in self.devices if d.resource == resource)

    def gpu(self, gpu_uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == gpu_uuid), None)

    def mode_of(self, gpu_uuid: str) -> str | None:
        return dict(self.modes).get(gpu_uuid)


def region_key(device_ids: Iterable[str]) -> str:
    """The memory-cap region key of one container's allocation (order-independent)."""
    joined = ",".join(sorted(set(device_ids)))
    return hashlib.sha256(joined.encode()).hexdigest()[:20]


def mig_resource_name(profile: str) -> str:
    return f"{MIG_RESOURCE_PREFIX}{profile}"


def _check_selector(selector: DeviceSelector, gpus: Sequence[Gpu]) -> None:
    if selector.all:
        return
    indexes = {g.index for g in gpus}
    uuids = {g.uuid for g in gpus} | {m.uuid for g in gpus for m in g.mig_devices}
    for i in selector.indexes:
        if i not in indexes:
            raise ConfigError(
                f"{selector.where}: there is no GPU with index {i} on this node "
                f"(indexes: {', '.join(map(str, sorted(indexes))) or 'none'})",
                hint="list the node's GPUs with `gpunode devices`",
            )
    for u in selector.uuids:
        if u not in uuids:
            raise ConfigError(
                f"{selector.where}: there is no GPU {u} on this node",
                hint="list the node's GPUs with `gpunode devices`",
            )


def _check_mig_strategy(cfg: Config, gpus: Sequence[Gpu]) -> list[str]:
    warnings: list[str] = []
    enabled = [g for g in gpus if g.mig_enabled]
    for g in enabled:
        if not g.mig_devices and cfg.mig_strategy != "none":
            warnings.append(
                f"GPU {g.index} ({g.uuid}) has MIG enabled but no MIG devices: nothing to advertise"
            )
    if cfg.mig_strategy == "single" and enabled:
        disabled = [g for g in gpus if not g.mig_enabled]
        if disabled:
            raise ConfigError(
                f"{cfg.source}: flags.migStrategy: single needs MIG enabled on every GPU, but GPU(s) "
                f"{', '.join(str(g.index) for g in disabled)} have MIG disabled",
                hint="use migStrategy: mixed for a node with MIG and non-MIG GPUs",
            )
        profiles = sorted({m.profile for g in enabled for m in g.mig_devices})
        if len(profiles) > 1:
            raise ConfigError(
                f"{cfg.source}: flags.migStrategy: single needs one MIG profile on the whole node, "
                f"found {', '.join(profiles)}",
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


def _base_id(cfg: Config, gpu: Gpu, mig: MigDevice | None = None) -> str:
    if cfg.plugin.device_id_strategy == "index":
        return f"{gpu.index}:{mig.index}" if mig else str(gpu.index)
    return mig.uuid if mig else gpu.uuid


def _shared_name(cfg: Config, res: SharedResource) -> str:
    if res.rename:
        return res.rename
    if cfg.time_slicing.rename_by_default:
        return f"{res.name}.shared"
    return res.name


def _replica_cap(cfg: Config, total_bytes: int, replicas: int) -> int | None:
    cap = cfg.replica_memory_cap
    if cap is None:
        return None
    if cap == "equal":
        return total_bytes // replicas
    assert isinstance(cap, int)
    return min(cap, total_bytes)


def _slicing_for(cfg: Config, resource: str, gpu: Gpu) -> SharedResource | None:
    for res in cfg.time_slicing.resources:
        if res.name == resource and res.devices.matches(gpu.index, gpu.uuid):
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
    base = _base_id(cfg, gpu, mig)
    sharing = _slicing_for(cfg, resource, gpu)
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
    name = _shared_name(cfg, sharing)
    why = f"{reason}; time-sliced into {sharing.replicas} replicas ({sharing.devices.where or 'all'})"
    if cap is not None:
        why += f", each capped at {cap / 2**30:.1f} GiB"
    out.extend(
        AdvertisedDevice(
            id=f"{base}::{n}",
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


def build_inventory(gpus: Sequence[Gpu], cfg: Config, *, strict: bool = True) -> Inventory:
    """Everything the node advertises, or a ConfigError if the configuration does not fit these GPUs.

    strict=False is for rediscovery while running: a device selector that names a GPU which has
    since vanished gives a warning instead of an error, so a hot-unplug never stops the agent.
    """
    warnings = _check_mig_strategy(cfg, gpus)
    frac = cfg.fractional
    selectors = [r.devices for r in cfg.time_slicing.resources]
    if frac.devices is not None:
        selectors.append(frac.devices)
    for sel in selectors:
        try:
            _check_selector(sel, gpus)
        except ConfigError as exc:
            if strict:
                raise
            warnings.append(exc.message)

    devices: list[AdvertisedDevice] = []
    modes: list[tuple[str, str]] = []
    matched: dict[str, int] = {}
    for gpu in gpus:
        use_mig = gpu.mig_enabled and cfg.mig_strategy != "none"
        fractional = frac.devices is not None and frac.devices.matches(gpu.index, gpu.uuid)
        sliced = _slicing_for(cfg, GPU_RESOURCE, gpu)
        if fractional:
            matched[frac.devices.where] = matched.get(frac.devices.where, 0) + 1  # type: ignore[union-attr]
        if sliced is not None:
            matched[sliced.devices.where] = matched.get(sliced.devices.where, 0) + 1
        if fractional and (use_mig or sliced is not None):
            other = "MIG" if use_mig else "time-slicing"
            raise ConfigError(
                f"{cfg.source}: GPU {gpu.index} ({gpu.uuid}) is selected by gpunode.fractional.devices "
                f"and uses {other}: a GPU has one sharing mode at a time",
                hint="narrow one of the device selectors",
            )
        if use_mig:
            modes.append((gpu.uuid, MIG))
            for mig in gpu.mig_devices:
                resource = GPU_RESOURCE if cfg.mig_strategy == "single" else mig_resource_name(mig.profile)
                sliced_mig = _slicing_for(cfg, resource, gpu)
                if sliced_mig is not None:
                    matched[sliced_mig.devices.where] = matched.get(sliced_mig.devices.where, 0) + 1
                _emit(
                    devices,
                    cfg,
                    resource=resource,
                    gpu=gpu,
                    mig=mig,
                    reason=f"MIG {mig.profile} (GI {mig.gi_id}, CI {mig.ci_id}) on GPU {gpu.index}, "
                    f"migStrategy {cfg.mig_strategy}",
                )
        elif fractional:
            modes.append((gpu.uuid, FRACTIONAL))
            units = gpu.memory_total_bytes // frac.unit_bytes
            base = _base_id(cfg, gpu)
            devices.extend(
                AdvertisedDevice(
                    id=f"{base}::mem{n}",
                    resource=frac.resource_name,
                    gpu_uuid=gpu.uuid,
                    mig_uuid=None,
                    kind="memory",
                    numa_node=gpu.numa_node,
                    memory_cap_bytes=frac.unit_bytes,
                    reason=f"fractional GPU {gpu.index}: {units} units of {frac.unit_bytes / 2**30:g} GiB, "
                    "memory capped by the interposer",
                )
                for n in range(units)
            )
        else:
            modes.append((gpu.uuid, TIME_SLICED if sliced is not None else WHOLE))
            note = " (MIG enabled, migStrategy none)" if gpu.mig_enabled else ""
            _emit(
                devices, cfg, resource=GPU_RESOURCE, gpu=gpu, mig=None, reason=f"whole GPU {gpu.index}{note}"
            )

    for sel in selectors:
        if not sel.all and not matched.get(sel.where):
            message = f"{sel.where}: the selector ({sel.describe()}) matches no GPU that can use it"
            if strict:
                raise ConfigError(message)
            warnings.append(message)
    shared_unrenamed = any(
        r.name == GPU_RESOURCE and _shared_name(cfg, r) == GPU_RESOURCE for r in cfg.time_slicing.resources
    )
    mode_set = {m for _, m in modes}
    if shared_unrenamed and {WHOLE, TIME_SLICED} <= mode_set:
        warnings.append(
            "whole and time-sliced GPUs share the resource nvidia.com/gpu; set "
            "sharing.timeSlicing.renameByDefault or rename to tell them apart"
        )
    return Inventory(devices=tuple(devices), gpus=tuple(gpus), modes=tuple(modes), warnings=tuple(warnings))
