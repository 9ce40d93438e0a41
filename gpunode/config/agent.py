"""gpunode's configuration: the only reader of os.environ and of configuration files.

One file holds both the NVIDIA k8s-device-plugin configuration (version v1:
`flags`, `sharing.timeSlicing`) with the same meaning, and gpunode's own
settings in the `gpunode` section. Values are taken, most important first, from
the command line, the environment (`GPUNODE_*`, and the NVIDIA plugin's own
variables such as MIG_STRATEGY), then the file, then defaults.

Everything is validated here, in one place, before anything starts: an unknown
key, a wrong type, replicas < 2 or an unsupported section is a ConfigError that
names the file and the key. Checks that need the node's GPUs (a MIG strategy the
GPUs cannot satisfy, a device selector that matches nothing) are made by
inventory.build_inventory, also before anything is advertised.

The `gpunode.metrics`, `gpunode.health` and `gpunode.remediation` sections are
parsed by their parsers in this package (config.metrics, config.health), so one
load validates the whole file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpunode.config.health import (
    HealthConfig,
    RemediationConfig,
    parse_health_config,
    parse_remediation_config,
)
from gpunode.config.metrics import MetricsConfig, parse_metrics_config
from gpunode.config.reader import SectionReader, load_yaml, parse_bytes, parse_resource_name
from gpunode.errors import ConfigError

DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_STATE_DIR = Path("/var/lib/gpunode")
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
GIB = 2**30

MIG_STRATEGIES = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES = ("uuid", "index")
BACKENDS = ("auto", "nvml", "sim")


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
            f"{where}: expected `all` or a non-empty list of GPU indexes or UUIDs, got {value!r}"
        )
    indexes: list[int] = []
    mig_indexes: list[tuple[int, int]] = []
    uuids: list[str] = []
    for item in value:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            indexes.append(item)
        elif isinstance(item, str) and item.isdigit():
            indexes.append(int(item))
        elif isinstance(item, str) and re.fullmatch(r"\d+:\d+", item):
            gpu, mig = item.split(":")
            mig_indexes.append((int(gpu), int(mig)))
        elif isinstance(item, str) and re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z][-0-9A-Za-z/]*", item):
            uuids.append(item)
        else:
            raise ConfigError(
                f"{where}: {item!r} is not a GPU index (0), a MIG index (0:1) or a GPU/MIG UUID (GPU-..., MIG-...)"
            )
    return DeviceSelector(
        all=False,
        indexes=tuple(dict.fromkeys(indexes)),
        uuids=tuple(dict.fromkeys(uuids)),
        where=where,
        mig_indexes=tuple(dict.fromkeys(mig_indexes)),
    )


@dataclass(frozen=True)
class PluginFlags:
    """NVIDIA `flags.plugin`: how Allocate hands devices to the container runtime."""

    pass_device_specs: bool = False
    device_list_strategy: tuple[str, ...] = ("envvar",)
    device_id_strategy: str = "uuid"
    container_driver_root: str = "/driver-root"
    cdi_annotation_prefix: str = "cdi.k8s.io/"


@dataclass(frozen=True)
class SharedResource:
    """One `sharing.timeSlicing.resources[]` entry."""

    name: str  # the resource being shared: nvidia.com/gpu or nvidia.com/mig-<profile>
    replicas: int
    rename: str | None
    devices: DeviceSelector


@dataclass(frozen=True)
class TimeSlicing:
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    resources: tuple[SharedResource, ...] = ()


@dataclass(frozen=True)
class Fractional:
    """gpunode.fractional: GPUs shared by memory, each container capped by the interposer."""

    devices: DeviceSelector | None = None  # None: no GPU is fractional
    resource_name: str = "gpunode.io/gpu-memory"
    unit_bytes: int = GIB
    fail_open: bool = False  # what the interposer does when its region is unusable
    ld_so_preload: bool = False  # also mount /etc/ld.so.preload so clearing LD_PRELOAD does not escape
    gc_interval_s: float = 60.0  # how often regions of vanished containers are looked for
    gc_grace_s: float = 600.0  # a region younger than this is kept even if the kubelet does not list it yet


@dataclass(frozen=True)
class Config:
    source: str = "<defaults>"  # the file it came from
    # NVIDIA device-plugin settings
    mig_strategy: str = "none"
    fail_on_init_error: bool = True
    nvidia_driver_root: str = "/"
    plugin: PluginFlags = field(default_factory=PluginFlags)
    time_slicing: TimeSlicing = field(default_factory=TimeSlicing)
    # gpunode settings
    backend: str = "auto"
    sim_profile: str = "dgx-h100"
    sim_control_socket: Path | None = None
    kubelet_dir: Path = DEFAULT_KUBELET_DIR
    state_dir: Path = DEFAULT_STATE_DIR
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET
    node_name: str = ""
    log_level: str = "info"
    replica_placement: str = "spread"  # spread | pack
    replica_memory_cap: str | int | None = None  # None, "equal", or bytes
    fractional: Fractional = field(default_factory=Fractional)
    rediscover_interval_s: float = 30.0
    publish_node_state: bool = True  # annotate the Node with its GPU state for the scheduler extender
    publish_interval_s: float = 60.0
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    remediation: RemediationConfig = field(default_factory=RemediationConfig)
    # Setting -> the environment variable or flag that set it (settings from the file are absent).
    origins: Mapping[str, str] = field(default_factory=dict)

    @property
    def kubelet_socket(self) -> Path:
        return self.kubelet_dir / "kubelet.sock"

    def origin(self, setting: str, key: str) -> str:
        """Where a setting came from, for messages: its flag or variable, else the file and `key`."""
        return self.origins.get(setting) or f"{self.source}: {key}"


# --- the file ----------------------------------------------------------------------------------


def _parse_plugin_flags(r: SectionReader) -> PluginFlags:
    strategies_raw = r.raw("deviceListStrategy", "envvar")
    strategies = [strategies_raw] if isinstance(strategies_raw, str) else strategies_raw
    if not isinstance(strategies, list) or not strategies:
        raise ConfigError(f"{r.key_path('deviceListStrategy')}: expected a strategy or a list of them")
    for s in strategies:
        if s not in DEVICE_LIST_STRATEGIES:
            raise ConfigError(
                f"{r.key_path('deviceListStrategy')}: expected one of {', '.join(DEVICE_LIST_STRATEGIES)}, "
                f"got {s!r}"
            )
    flags = PluginFlags(
        pass_device_specs=r.get("passDeviceSpecs", bool, False),
        device_list_strategy=tuple(dict.fromkeys(strategies)),
        device_id_strategy=r.choice("deviceIDStrategy", DEVICE_ID_STRATEGIES, "uuid"),
        container_driver_root=r.get("containerDriverRoot", str, "/driver-root"),
        cdi_annotation_prefix=r.get("cdiAnnotationPrefix", str, "cdi.k8s.io/"),
    )
    r.raw("nvidiaCTKPath", None)  # accepted for compatibility; gpunode writes no CDI spec files
    r.finish()
    return flags


def _parse_time_slicing(r: SectionReader) -> TimeSlicing:
    rename_by_default = r.get("renameByDefault", bool, False)
    fail_gt_one = r.get("failRequestsGreaterThanOne", bool, False)
    items = r.raw("resources", [])
    if not isinstance(items, list):
        raise ConfigError(f"{r.key_path('resources')}: expected a list")
    resources: list[SharedResource] = []
    for i, item in enumerate(items):
        ir = SectionReader(item, f"{r.key_path('resources')}[{i}]")
        name = parse_resource_name(ir.get("name", str), ir.key_path("name"))
        if name != "nvidia.com/gpu" and not name.startswith("nvidia.com/mig-"):
            raise ConfigError(
                f"{ir.key_path('name')}: only nvidia.com/gpu and nvidia.com/mig-<profile> can be "
                f"time-sliced, got {name!r}"
            )
        replicas = ir.get("replicas", int)
        if replicas < 2:
            raise ConfigError(f"{ir.key_path('replicas')}: must be at least 2 to share a GPU, got {replicas}")
        rename = ir.get("rename", str, None)
        if rename is not None:
            rename = parse_resource_name(rename, ir.key_path("rename"))
        devices = ir.parse("devices", parse_device_selector, DeviceSelector(where=ir.key_path("devices")))
        ir.finish()
        if any(res.name == name for res in resources):
            raise ConfigError(f"{ir.key_path('name')}: {name} is listed twice under timeSlicing.resources")
        resources.append(SharedResource(name=name, replicas=replicas, rename=rename, devices=devices))
    r.finish()
    return TimeSlicing(rename_by_default, fail_gt_one, tuple(resources))


def _parse_replica_cap(value: object, where: str) -> str | int | None:
    """`equal` (the GPU's memory divided by its replicas), `none`, or a size per replica."""
    if value in ("none", None):
        return None
    if value == "equal":
        return "equal"
    try:
        cap = parse_bytes(value, where=where)
    except ConfigError:
        raise ConfigError(f"{where}: expected equal, none or a size such as 10Gi, got {value!r}") from None
    if cap == 0:
        raise ConfigError(f"{where}: a replica memory cap must be more than 0 bytes (or `none`)")
    return cap


def _parse_fractional(r: SectionReader) -> Fractional:
    devices = r.parse("devices", parse_device_selector, None)
    if devices is not None and (devices.mig_indexes or any(u.startswith("MIG-") for u in devices.uuids)):
        raise ConfigError(
            f"{r.key_path('devices')}: fractional sharing applies to whole GPUs, not to MIG devices",
            hint="list GPU indexes or GPU UUIDs (GPU-...)",
        )
    name = parse_resource_name(
        r.get("resourceName", str, "gpunode.io/gpu-memory"), r.key_path("resourceName")
    )
    if name == "nvidia.com/gpu" or name.startswith("nvidia.com/mig-"):
        raise ConfigError(
            f"{r.key_path('resourceName')}: {name} is already advertised for whole GPUs or MIG devices",
            hint="give fractional GPUs a resource of their own, e.g. gpunode.io/gpu-memory",
        )
    unit = r.size("unit", GIB)
    if unit < 2**20:
        raise ConfigError(f"{r.key_path('unit')}: the unit must be at least 1Mi, got {unit} bytes")
    frac = Fractional(
        devices=devices,
        resource_name=name,
        unit_bytes=unit,
        fail_open=r.get("failOpen", bool, False),
        ld_so_preload=r.get("ldSoPreload", bool, False),
        gc_interval_s=r.duration("gcInterval", 60.0),
        gc_grace_s=r.duration("gcGrace", 600.0),
    )
    r.finish()
    return frac


def parse_config(data: object, source: str) -> Config:
    """Validate a whole configuration document (already parsed from YAML/JSON)."""
    top = SectionReader(data, f"{source}: ")
    version = top.raw("version", "v1")
    if version != "v1":
        raise ConfigError(f"{source}: version: only v1 is supported, got {version!r}")
    cfg = Config(source=source)

    flags = top.section("flags")
    cfg = replace(
        cfg,
        mig_strategy=flags.choice("migStrategy", MIG_STRATEGIES, "none"),
        fail_on_init_error=flags.get("failOnInitError", bool, True),
        nvidia_driver_root=flags.get("nvidiaDriverRoot", str, "/"),
        plugin=_parse_plugin_flags(flags.section("plugin")),
    )
    for ignored in ("gfd", "useNodeFeatureAPI", "deviceDiscoveryStrategy"):
        flags.raw(ignored, None)  # NVIDIA settings that concern other components; accepted, no effect
    for unsupported in ("gdsEnabled", "mofedEnabled", "gdrcopyEnabled"):
        if flags.get(unsupported, bool, False):
            raise ConfigError(
                f"{flags.key_path(unsupported)}: gpunode does not inject GPUDirect Storage, MOFED or "
                "GDRCopy support into containers",
                hint=f"remove {unsupported} or set it to false",
            )
    if flags.raw("mpsRoot", None) is not None:
        raise ConfigError(f"{flags.key_path('mpsRoot')}: MPS is not supported; use gpunode.fractional")
    flags.finish()

    sharing = top.section("sharing")
    if sharing.raw("mps", None) is not None:
        raise ConfigError(
            f"{sharing.key_path('mps')}: MPS sharing is not supported by gpunode",
            hint="use gpunode.fractional for memory-capped sharing, or sharing.timeSlicing",
        )
    cfg = replace(cfg, time_slicing=_parse_time_slicing(sharing.section("timeSlicing")))
    sharing.finish()

    imex = top.section("imex")
    if imex.raw("channelIDs", []):
        raise ConfigError(
            f"{imex.key_path('channelIDs')}: IMEX channels are not supported by gpunode",
            hint="remove imex.channelIDs (or leave the list empty)",
        )
    imex.get("required", bool, False)
    imex.finish()

    if top.raw("resources", None) is not None:
        raise ConfigError(
            f"{source}: resources: custom resource patterns are not supported",
            hint="use sharing.timeSlicing.resources[].rename to name shared resources",
        )

    own = top.section("gpunode")
    node_state = own.section("nodeState")
    cfg = replace(
        cfg,
        backend=own.choice("backend", BACKENDS, "auto"),
        sim_profile=own.get("simProfile", str, "dgx-h100"),
        sim_control_socket=_opt_path(own.get("simControlSocket", str, None)),
        kubelet_dir=Path(own.get("kubeletDir", str, str(DEFAULT_KUBELET_DIR))),
        state_dir=Path(own.get("stateDir", str, str(DEFAULT_STATE_DIR))),
        pod_resources_socket=Path(own.get("podResourcesSocket", str, str(DEFAULT_POD_RESOURCES_SOCKET))),
        node_name=own.get("nodeName", str, ""),
        log_level=own.choice("logLevel", ("debug", "info", "warning", "error"), "info"),
        replica_placement=own.choice("replicaPlacement", ("spread", "pack"), "spread"),
        replica_memory_cap=own.parse("replicaMemoryCap", _parse_replica_cap, None),
        fractional=_parse_fractional(own.section("fractional")),
        rediscover_interval_s=own.duration("rediscoverInterval", 30.0),
        publish_node_state=node_state.get("enabled", bool, True),
        publish_interval_s=node_state.duration("interval", 60.0),
    )
    node_state.finish()
    _check_resource_names(cfg)
    cfg = replace(
        cfg,
        metrics=parse_metrics_config(own.raw("metrics", {}), own.key_path("metrics")),
        health=parse_health_config(own.raw("health", {}), own.key_path("health")),
        remediation=parse_remediation_config(own.raw("remediation", {}), own.key_path("remediation")),
    )
    own.finish()
    top.finish()
    return cfg


def shared_resource_name(cfg: Config, res: SharedResource) -> str:
    """The name a time-sliced resource is advertised under: its rename, `<name>.shared`, or its name."""
    if res.rename:
        return res.rename
    if cfg.time_slicing.rename_by_default:
        return f"{res.name}.shared"
    return res.name


def _check_resource_names(cfg: Config) -> None:
    """Two settings must never advertise under one name: one resource is one device-plugin socket."""
    seen: dict[str, str] = {}
    for i, res in enumerate(cfg.time_slicing.resources):
        name = shared_resource_name(cfg, res)
        where = f"{cfg.source}: sharing.timeSlicing.resources[{i}]"
        if name == cfg.fractional.resource_name:
            raise ConfigError(f"{where}: {name} is also gpunode.fractional.resourceName")
        if res.name != name and re.fullmatch(r"nvidia\.com/(gpu|mig-(\d+c\.)?\d+g\.\d+gb(\+\w+)?)", name):
            raise ConfigError(
                f"{where}.rename: {name} is a name NVIDIA GPUs and MIG devices are advertised under",
                hint="rename shared resources to a name of their own, such as nvidia.com/gpu.shared",
            )
        if name in seen:
            raise ConfigError(f"{where}: {res.name} would be advertised as {name}, as {seen[name]} is")
        seen[name] = res.name


def _opt_path(value: str | None) -> Path | None:
    return Path(value) if value else None


def read_config_file(path: Path, *, named_by: str = "--config") -> Config:
    """Read and validate a configuration file (YAML or JSON). `named_by` says who named the file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: configuration file not found (named by {named_by})",
            hint=f"point {named_by} at an existing file",
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file (byte {exc.start} is not UTF-8)") from None
    data = load_yaml(text, where=str(path))
    return parse_config(data if data is not None else {}, str(path))


# --- environment and command line ---------------------------------------------------------------


def _env_bool(value: str, where: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


# setting -> (environment variables, most specific first; converter)
_ENV: dict[str, tuple[tuple[str, ...], Callable[[str, str], Any]]] = {
    "backend": (("GPUNODE_BACKEND",), lambda v, w: _choice(v, BACKENDS, w)),
    "sim_profile": (("GPUNODE_SIM_PROFILE",), lambda v, w: v),
    "sim_control_socket": (("GPUNODE_SIM_CONTROL_SOCKET",), lambda v, w: Path(v)),
    "kubelet_dir": (("GPUNODE_KUBELET_DIR",), lambda v, w: Path(v)),
    "state_dir": (("GPUNODE_STATE_DIR",), lambda v, w: Path(v)),
    "pod_resources_socket": (("GPUNODE_POD_RESOURCES_SOCKET",), lambda v, w: Path(v)),
    "node_name": (("GPUNODE_NODE_NAME", "NODE_NAME"), lambda v, w: v),
    "log_level": (("GPUNODE_LOG_LEVEL",), lambda v, w: _choice(v, ("debug", "info", "warning", "error"), w)),
    "mig_strategy": (("GPUNODE_MIG_STRATEGY", "MIG_STRATEGY"), lambda v, w: _choice(v, MIG_STRATEGIES, w)),
    "fail_on_init_error": (("GPUNODE_FAIL_ON_INIT_ERROR", "FAIL_ON_INIT_ERROR"), _env_bool),
    "replica_placement": (("GPUNODE_REPLICA_PLACEMENT",), lambda v, w: _choice(v, ("spread", "pack"), w)),
    "nvidia_driver_root": (("GPUNODE_NVIDIA_DRIVER_ROOT", "NVIDIA_DRIVER_ROOT"), lambda v, w: v),
    "plugin.pass_device_specs": (("GPUNODE_PASS_DEVICE_SPECS", "PASS_DEVICE_SPECS"), _env_bool),
    "plugin.device_list_strategy": (
        ("GPUNODE_DEVICE_LIST_STRATEGY", "DEVICE_LIST_STRATEGY"),
        lambda v, w: tuple(
            dict.fromkeys(_choice(x.strip(), DEVICE_LIST_STRATEGIES, w) for x in v.split(","))
        ),
    ),
    "plugin.device_id_strategy": (
        ("GPUNODE_DEVICE_ID_STRATEGY", "DEVICE_ID_STRATEGY"),
        lambda v, w: _choice(v, DEVICE_ID_STRATEGIES, w),
    ),
}
CONFIG_ENV = ("GPUNODE_CONFIG", "CONFIG_FILE")


def _choice(value: str, choices: tuple[str, ...], where: str) -> str:
    if value not in choices:
        raise ConfigError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def environment_variables() -> dict[str, tuple[str, ...]]:
    """The variables the agent reads, by setting (for documentation and `gpunode doctor`)."""
    return {name: names for name, (names, _) in _ENV.items()} | {"config": CONFIG_ENV}


def load(
    *,
    config_path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the configuration: command-line overrides > environment > file > defaults.

    `overrides` holds the command-line values by setting name (None values are ignored); a
    `plugin.` prefix names a field of Config.plugin. Config.origins records which variable or
    flag set each value that did not come from the file, so later messages can name it.
    """
    env = os.environ if environ is None else environ
    named_by = "--config"
    if config_path is None:
        for var in CONFIG_ENV:
            if env.get(var):
                config_path, named_by = Path(env[var]), f"environment variable {var}"
                break
    if config_path is not None:
        cfg = read_config_file(config_path, named_by=named_by)
    else:
        cfg = parse_config({}, "<defaults>")
    changes: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for setting, (names, convert) in _ENV.items():
        for var in names:
            if var in env and env[var] != "":
                changes[setting] = convert(env[var], f"environment variable {var}")
                origins[setting] = f"environment variable {var}"
                break
    for setting, value in (overrides or {}).items():
        if value is None:
            continue
        if setting not in _ENV:
            raise ConfigError(f"unknown setting {setting!r} given on the command line")
        changes[setting] = value
        origins[setting] = f"command line --{setting.removeprefix('plugin.').replace('_', '-')}"
    plugin = {k.removeprefix("plugin."): v for k, v in changes.items() if k.startswith("plugin.")}
    top = {k: v for k, v in changes.items() if not k.startswith("plugin.")}
    return replace(cfg, **top, plugin=replace(cfg.plugin, **plugin), origins={**cfg.origins, **origins})
