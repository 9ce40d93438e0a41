"""How devices are selected and shared: device selectors, the NVIDIA plugin flags, time-slicing and
fractional (memory-capped) sharing, with the parsers of their configuration sections."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpunode.config.reader import parse_resource_name
from gpunode.contract.names import (
    GIB,
    GPU_MEMORY_RESOURCE,
    GPU_RESOURCE,
    MIB,
    TIB,
    mig_profile_of,
    mig_resource_name,
)
from gpunode.contract.reader import SectionReader, format_bytes, parse_bytes
from gpunode.errors import ConfigError

DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES = ("uuid", "index")
# flags.plugin.sharedDevicesAllocationPolicy (NVIDIA v0.20) -> gpunode.replicaPlacement
ALLOCATION_POLICIES = {"distributed": "spread", "packed": "pack"}

# Bounds on what a configuration may ask for (README, configuration table). Every advertised device
# is one entry in a kubelet ListAndWatch message and one ID in the kubelet's checkpoint, so counts are
# bounded where they are read, and the per-GPU and per-node totals again by node.inventory.
MIN_REPLICAS, MAX_REPLICAS = 2, 48  # GKE's limit on clients sharing a GPU is 48, too
MAX_SHARED_RESOURCES = 32  # sharing.timeSlicing.resources: nvidia.com/gpu plus every MIG profile fits
MAX_SELECTOR_ITEMS = 128  # a device list: 16 GPUs with 7 MIG devices each
MAX_DEVICE_INDEX = 255  # GPU and MIG indexes
MAX_UUID_CHARS = 128
MIN_UNIT_BYTES, MAX_UNIT_BYTES = MIB, TIB  # gpunode.fractional.unit (and replicaMemoryCap)
GC_INTERVAL_S = (0.1, 3600.0)  # gpunode.fractional.gcInterval: 100ms..1h
GC_GRACE_S = (0.0, 86400.0)  # gpunode.fractional.gcGrace: 0..1d


@dataclass(frozen=True)
class DeviceSelector:
    """Which devices a setting applies to: all of them, or the listed GPU indexes, MIG indexes
    ("<gpu>:<mig>") and GPU or MIG UUIDs. Selecting a GPU selects its MIG devices too."""

    all: bool = True
    indexes: tuple[int, ...] = ()
    uuids: tuple[str, ...] = ()
    where: str = ""  # the config key it came from, for messages
    mig_indexes: tuple[tuple[int, int], ...] = ()  # (GPU index, MIG device index)

    def matches(self, index: int, uuid: str) -> bool:
        """Whether a whole GPU is selected."""
        return self.all or index in self.indexes or uuid in self.uuids

    def matches_mig(self, gpu_index: int, gpu_uuid: str, mig_index: int, mig_uuid: str) -> bool:
        """Whether one MIG device is selected: by itself, or through its parent GPU."""
        return (
            self.matches(gpu_index, gpu_uuid)
            or (gpu_index, mig_index) in self.mig_indexes
            or mig_uuid in self.uuids
        )

    def describe(self) -> str:
        """The selection in words, for messages."""
        if self.all:
            return "all GPUs"
        parts = [f"index {i}" for i in self.indexes] + [f"MIG index {g}:{m}" for g, m in self.mig_indexes]
        return ", ".join(parts + list(self.uuids))


def parse_device_selector(value: object, where: str) -> DeviceSelector:
    """`all`, or a list of GPU indexes, MIG indexes ("0:1") and GPU/MIG UUIDs (the NVIDIA `devices` field)."""
    if value == "all":
        return DeviceSelector(all=True, where=where)
    if isinstance(value, int) and not isinstance(value, bool):
        raise ConfigError(
            f"{where}: a bare number ({value}) is a device count in the NVIDIA schema, which gpunode "
            "does not support",
            hint=f"list the GPU indexes instead, e.g. devices: [{value}] for the GPU with index {value}",
        )
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"{where}: expected `all` or a non-empty list of GPU indexes or UUIDs, got {value!r:.80}"
        )
    if len(value) > MAX_SELECTOR_ITEMS:
        raise ConfigError(
            f"{where}: a device list has 1..{MAX_SELECTOR_ITEMS} entries, got {len(value)}",
            hint="list each GPU or MIG device once, or use `all`",
        )
    indexes: list[int] = []
    mig_indexes: list[tuple[int, int]] = []
    uuids: list[str] = []
    for item in value:
        if isinstance(item, str) and len(item) > MAX_UUID_CHARS:
            raise ConfigError(
                f"{where}: {item[:40]!r}... is {len(item)} characters; a GPU or MIG UUID has at most "
                f"{MAX_UUID_CHARS}",
                hint="copy the UUIDs from `gpunode devices` or nvidia-smi -L",
            )
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            indexes.append(_index(item, where))
        elif isinstance(item, str) and item.isdigit():
            indexes.append(_index(int(item), where))
        elif isinstance(item, str) and re.fullmatch(r"\d+:\d+", item):
            gpu, mig = item.split(":")
            mig_indexes.append((_index(int(gpu), where), _index(int(mig), where)))
        elif isinstance(item, str) and _is_uuid(item):
            uuids.append(item)
        else:
            raise ConfigError(
                f"{where}: {item!r:.80} is not a GPU index (0), a MIG index (0:1) or a GPU/MIG UUID "
                "(GPU-..., MIG-...)"
            )
    return DeviceSelector(
        all=False,
        indexes=tuple(dict.fromkeys(indexes)),
        uuids=tuple(dict.fromkeys(uuids)),
        where=where,
        mig_indexes=tuple(dict.fromkeys(mig_indexes)),
    )


_UUID = r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"


def _is_uuid(item: str) -> bool:
    """A GPU UUID (GPU-<uuid>) or a MIG UUID (MIG-<uuid>, or the older MIG-GPU-<uuid>/<gi>/<ci>), as
    NVML prints them and as NVIDIA's parser checks them."""
    return bool(re.fullmatch(rf"(GPU|MIG)-{_UUID}|MIG-GPU-{_UUID}/\d+/\d+", item))


def _index(value: int, where: str) -> int:
    if value > MAX_DEVICE_INDEX:
        raise ConfigError(
            f"{where}: a GPU or MIG index is 0..{MAX_DEVICE_INDEX}, got {value}",
            hint="list the node's GPUs and their indexes with `gpunode devices`",
        )
    return value


@dataclass(frozen=True)
class PluginFlags:
    """NVIDIA `flags.plugin`: how Allocate hands devices to the container runtime."""

    pass_device_specs: bool = False
    device_list_strategy: tuple[str, ...] = ("envvar",)
    device_id_strategy: str = "uuid"
    container_driver_root: str = "/driver-root"
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    # sharedDevicesAllocationPolicy as gpunode's replicaPlacement (spread | pack); None when not given
    replica_placement: str | None = None


@dataclass(frozen=True)
class SharedResource:
    """One `sharing.timeSlicing.resources[]` entry."""

    name: str  # the resource being shared: nvidia.com/gpu or nvidia.com/mig-<profile>
    replicas: int
    rename: str | None
    devices: DeviceSelector


@dataclass(frozen=True)
class TimeSlicing:
    """NVIDIA `sharing.timeSlicing` or `sharing.mps`: GPUs (and, time-sliced, MIG devices) advertised several
    times each. With mps, each replica is a memory cap of 1/replicas of the GPU and a hard compute share of
    1/replicas, enforced by gpunode's interposer (no MPS control daemon runs)."""

    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    resources: tuple[SharedResource, ...] = ()
    mps: bool = False  # the resources came from sharing.mps


@dataclass(frozen=True)
class Fractional:
    """gpunode.fractional: GPUs shared by memory, each container capped by the interposer."""

    devices: DeviceSelector | None = None  # None: no GPU is fractional
    resource_name: str = GPU_MEMORY_RESOURCE
    unit_bytes: int = GIB
    fail_open: bool = False  # what the interposer does when its region is unusable
    ld_so_preload: bool = False  # also mount /etc/ld.so.preload so clearing LD_PRELOAD does not escape
    gc_interval_s: float = 60.0  # how often regions of vanished containers are looked for
    gc_grace_s: float = 600.0  # a region younger than this is kept even if the kubelet does not list it yet


def parse_plugin_flags(r: SectionReader) -> PluginFlags:
    """Validate `flags.plugin`."""
    strategies_raw = r.raw("deviceListStrategy", "envvar")
    strategies = [strategies_raw] if isinstance(strategies_raw, str) else strategies_raw
    if not isinstance(strategies, list) or not strategies or len(strategies) > MAX_SELECTOR_ITEMS:
        raise ConfigError(
            f"{r.key_path('deviceListStrategy')}: expected a strategy or a list of them "
            f"(1..{MAX_SELECTOR_ITEMS} entries)",
            hint=f"the strategies are {', '.join(DEVICE_LIST_STRATEGIES)}",
        )
    for s in strategies:
        if s not in DEVICE_LIST_STRATEGIES:
            raise ConfigError(
                f"{r.key_path('deviceListStrategy')}: expected one of {', '.join(DEVICE_LIST_STRATEGIES)}, "
                f"got {s!r:.40}"
            )
    flags = PluginFlags(
        pass_device_specs=r.get("passDeviceSpecs", bool, False),
        device_list_strategy=tuple(dict.fromkeys(strategies)),
        device_id_strategy=r.choice("deviceIDStrategy", DEVICE_ID_STRATEGIES, "uuid"),
        container_driver_root=r.get("containerDriverRoot", str, "/driver-root"),
        cdi_annotation_prefix=r.get("cdiAnnotationPrefix", str, "cdi.k8s.io/"),
        replica_placement=_allocation_policy(r),
    )
    r.raw("nvidiaCTKPath", None)  # accepted for compatibility; gpunode writes no CDI spec files
    r.finish()
    return flags


def _allocation_policy(r: SectionReader) -> str | None:
    """`sharedDevicesAllocationPolicy`: NVIDIA's `distributed` and `packed` are gpunode's replica placements
    `spread` (fewest sharers first) and `pack` (the busiest GPU first)."""
    policy = r.get("sharedDevicesAllocationPolicy", str, None)
    if policy is None:
        return None
    if policy not in ALLOCATION_POLICIES:
        raise r.fail(
            "sharedDevicesAllocationPolicy",
            f"expected distributed or packed, got {policy!r:.40}",
            hint="distributed spreads replicas over the GPUs, packed fills one GPU first",
        )
    return ALLOCATION_POLICIES[policy]


def parse_time_slicing(r: SectionReader, *, mps: bool = False) -> TimeSlicing:
    """Validate `sharing.timeSlicing` (or, with mps, `sharing.mps`, which has the same fields): at least 2
    replicas per resource, each resource once; MPS shares whole GPUs only, as NVIDIA's plugin."""
    section = "mps" if mps else "timeSlicing"
    rename_by_default = r.get("renameByDefault", bool, False)
    fail_gt_one = r.get("failRequestsGreaterThanOne", bool, False)
    items = r.raw("resources", [])
    if not isinstance(items, list):
        raise ConfigError(f"{r.key_path('resources')}: expected a list")
    if len(items) > MAX_SHARED_RESOURCES:
        raise ConfigError(
            f"{r.key_path('resources')}: at most {MAX_SHARED_RESOURCES} resources can be time-sliced, "
            f"got {len(items)}",
            hint="list nvidia.com/gpu and each MIG profile once",
        )
    resources: list[SharedResource] = []
    for i, item in enumerate(items):
        ir = SectionReader(item, f"{r.key_path('resources')}[{i}]")
        raw_name = ir.get("name", str)
        if "+" in raw_name and mig_profile_of(raw_name) is not None:
            raise ir.fail(
                "name",
                f"{raw_name[:80]} is not a valid resource name; MIG profiles with a suffix are advertised "
                f"with '.' for '+': {mig_resource_name(mig_profile_of(raw_name) or '')}",
                hint="write the MIG resource as `gpunode devices` lists it",
            )
        name = parse_resource_name(raw_name, ir.key_path("name"))
        if mps and name != GPU_RESOURCE:
            raise ConfigError(
                f"{ir.key_path('name')}: sharing using MPS is not supported for MIG devices or other resources "
                f"than {GPU_RESOURCE} (as NVIDIA's plugin), got {name}",
                hint=f"share {GPU_RESOURCE} with mps, or MIG devices with sharing.timeSlicing",
            )
        if name != GPU_RESOURCE and mig_profile_of(name) is None:
            raise ConfigError(
                f"{ir.key_path('name')}: {name} is not a resource gpunode advertises, so there is nothing "
                "to time-slice under it",
                hint="name nvidia.com/gpu or a MIG profile (nvidia.com/mig-1g.10gb); give the shared "
                "resource another name with `rename`",
            )
        replicas = ir.get("replicas", int)
        if replicas < MIN_REPLICAS:
            raise ConfigError(
                f"{ir.key_path('replicas')}: must be at least {MIN_REPLICAS} to share a GPU "
                f"(allowed {MIN_REPLICAS}..{MAX_REPLICAS}), got {replicas}",
                hint=f"leave the resource out of {section} to advertise each GPU once",
            )
        if replicas > MAX_REPLICAS:
            raise ConfigError(
                f"{ir.key_path('replicas')}: at most {MAX_REPLICAS} replicas per GPU "
                f"(allowed {MIN_REPLICAS}..{MAX_REPLICAS}), got {replicas!s:.40}",
                hint="each replica is one device ID the kubelet tracks; more sharers than 48 per GPU "
                "only slice its time thinner",
            )
        rename = ir.get("rename", str, None)
        if rename is not None:
            rename = parse_resource_name(rename, ir.key_path("rename"))
        if (
            isinstance(item, dict) and "devices" in item and item["devices"] is None
        ):  # `devices:` left empty, e.g. by a Helm template
            raise ConfigError(
                f"{ir.key_path('devices')}: the key is present but empty; it would otherwise select every GPU",
                hint="write `devices: all`, list GPU indexes or UUIDs, or remove the key",
            )
        devices = ir.parse("devices", parse_device_selector, DeviceSelector(where=ir.key_path("devices")))
        ir.finish()
        if any(res.name == name for res in resources):
            raise ConfigError(f"{ir.key_path('name')}: {name} is listed twice under {section}.resources")
        resources.append(SharedResource(name=name, replicas=replicas, rename=rename, devices=devices))
    r.finish()
    if not items:  # as NVIDIA's parser: a timeSlicing (or mps) section shares something
        raise ConfigError(
            f"{r.key_path('resources')}: no resources listed, so nothing would be shared",
            hint="list the resources to share (e.g. - {name: nvidia.com/gpu, replicas: 4}), or remove "
            f"the {section} section",
        )
    return TimeSlicing(rename_by_default, fail_gt_one, tuple(resources), mps)


def parse_replica_cap(value: object, where: str) -> str | int | None:
    """`equal` (the GPU's memory divided by its replicas), `none`, or a size per replica."""
    if value in ("none", None):
        return None
    if value == "equal":
        return "equal"
    try:
        cap = parse_bytes(value, where=where)
    except ConfigError:
        raise ConfigError(
            f"{where}: expected equal, none or a size such as 10Gi, got {value!r:.80}",
            hint=f"a replica memory cap is {format_bytes(MIN_UNIT_BYTES)}..{format_bytes(MAX_UNIT_BYTES)}",
        ) from None
    if cap == 0:
        raise ConfigError(
            f"{where}: a replica memory cap must be more than 0 bytes (or `none`)",
            hint=f"use equal, none or a size in {format_bytes(MIN_UNIT_BYTES)}..{format_bytes(MAX_UNIT_BYTES)}",
        )
    if not MIN_UNIT_BYTES <= cap <= MAX_UNIT_BYTES:
        raise ConfigError(
            f"{where}: a replica memory cap is {format_bytes(MIN_UNIT_BYTES)}..{format_bytes(MAX_UNIT_BYTES)}, "
            f"got {format_bytes(cap)}",
            hint="use equal, none or a size such as 10Gi",
        )
    return cap


def parse_fractional(r: SectionReader) -> Fractional:
    """Validate `gpunode.fractional`: whole GPUs only, a resource name of its own, a unit of at least 1Mi."""
    devices = r.parse("devices", parse_device_selector, None)
    if devices is not None and (devices.mig_indexes or any(u.startswith("MIG-") for u in devices.uuids)):
        raise ConfigError(
            f"{r.key_path('devices')}: fractional sharing applies to whole GPUs, not to MIG devices",
            hint="list GPU indexes or GPU UUIDs (GPU-...)",
        )
    name = parse_resource_name(r.get("resourceName", str, GPU_MEMORY_RESOURCE), r.key_path("resourceName"))
    if name == GPU_RESOURCE or mig_profile_of(name) is not None:
        raise ConfigError(
            f"{r.key_path('resourceName')}: {name} is already advertised for whole GPUs or MIG devices",
            hint="give fractional GPUs a resource of their own, e.g. gpunode.io/gpu-memory",
        )
    _refuse_decimal_unit(r)
    unit = r.size("unit", GIB)
    if unit < MIN_UNIT_BYTES:
        raise ConfigError(
            f"{r.key_path('unit')}: the unit must be at least 1Mi, got {unit} bytes",
            hint=f"use a unit in {format_bytes(MIN_UNIT_BYTES)}..{format_bytes(MAX_UNIT_BYTES)}, such as 1Gi",
        )
    if unit > MAX_UNIT_BYTES:
        raise ConfigError(
            f"{r.key_path('unit')}: the unit must be at most {format_bytes(MAX_UNIT_BYTES)}, "
            f"got {format_bytes(unit)}",
            hint="use a unit smaller than one GPU's memory, such as 1Gi",
        )
    frac = Fractional(
        devices=devices,
        resource_name=name,
        unit_bytes=unit,
        fail_open=r.get("failOpen", bool, False),
        ld_so_preload=r.get("ldSoPreload", bool, False),
        gc_interval_s=r.duration("gcInterval", 60.0, minimum=GC_INTERVAL_S[0], maximum=GC_INTERVAL_S[1]),
        gc_grace_s=r.duration("gcGrace", 600.0, minimum=GC_GRACE_S[0], maximum=GC_GRACE_S[1]),
    )
    r.finish()
    return frac


def _refuse_decimal_unit(r: SectionReader) -> None:
    """A memory unit in decimal units (1G, 1GB = 10^9 bytes) is refused: GPU memory comes in binary units,
    and 1GB would quietly make an 80 GiB GPU 85 units of 0.93 GiB. A plain number of bytes is taken as is."""
    value = r.raw("unit", None)
    if not isinstance(value, str):
        return
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt])b?\s*", value, re.IGNORECASE)
    if m is None:
        return
    size = parse_bytes(value, where=r.key_path("unit"))
    raise r.fail(
        "unit",
        f"{value.strip()} is a decimal size ({size} bytes, so GPU memory would be counted in units of "
        f"{size / GIB:.3g} GiB); write the unit as a binary size",
        hint=f"write {m.group(1)}{m.group(2).upper()}i (Ki, Mi, Gi, Ti are powers of 1024), or a plain "
        "number of bytes if the decimal size is really meant",
    )


def parse_sharing(sharing: SectionReader) -> TimeSlicing:
    """Validate the `sharing` section: timeSlicing, or mps (carried by gpunode's own enforcement), not both."""
    given = {key: sharing.has(key) for key in ("timeSlicing", "mps")}
    for key, present in given.items():
        if sharing.raw(key, None) is None and present:  # (raw also marks the key known, for typos)
            raise ConfigError(
                f"{sharing.key_path(key)}: the key is present but empty, so nothing would be shared",
                hint=f"list its resources ({key}: {{resources: [{{name: nvidia.com/gpu, replicas: 4}}]}}) or "
                "remove the key",
            )
    if given["timeSlicing"] and given["mps"]:
        raise ConfigError(
            f"{sharing.key_path('mps')}: timeSlicing and mps are both given; a GPU is shared one way, and "
            "NVIDIA's plugin uses mps and silently ignores timeSlicing",
            hint="keep one of the two sections",
        )
    if given["mps"]:
        result = parse_time_slicing(sharing.section("mps"), mps=True)
    elif given["timeSlicing"]:
        result = parse_time_slicing(sharing.section("timeSlicing"))
    else:
        result = TimeSlicing()
    sharing.finish()
    return result


COMPUTE_FLAG_AFTER_S = (1.0, 86400.0)  # gpunode.computeShare.flagAfter: 1s..1d
COMPUTE_INTERVAL_S = (0.2, 60.0)  # gpunode.computeShare.interval: 200ms..1min
COMPUTE_TOLERANCE_POINTS = (1.0, 50.0)  # gpunode.computeShare.tolerance, percentage points


@dataclass(frozen=True)
class ComputeShareCheck:
    """gpunode.computeShare: the agent's cross-check of each pod's compute share against the driver's
    per-process figures (gpunode.node.allocation.sharecheck)."""

    interval_s: float = 2.0  # one window of the check
    flag_after_s: float = 30.0  # above its hard share (or under-reporting) this long in a row: flagged
    tolerance: float = 0.05  # a ratio of the GPU: measurement noise allowed above the share
    evict: bool = False  # a flagged pod above its hard share is also evicted (policy/v1)


def parse_compute_share_check(data: object, where: str) -> ComputeShareCheck:
    """Validate the `gpunode.computeShare` section (a mapping; missing or null means all defaults)."""
    r = SectionReader(data, where)
    lo, hi = COMPUTE_TOLERANCE_POINTS
    check = ComputeShareCheck(
        interval_s=r.duration("interval", 2.0, minimum=COMPUTE_INTERVAL_S[0], maximum=COMPUTE_INTERVAL_S[1]),
        flag_after_s=r.duration(
            "flagAfter", 30.0, minimum=COMPUTE_FLAG_AFTER_S[0], maximum=COMPUTE_FLAG_AFTER_S[1]
        ),
        tolerance=r.number("tolerance", 5.0, minimum=lo, maximum=hi) / 100.0,
        evict=r.flag("evict", False),
    )
    r.finish()
    return check
