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

The `gpunode.metrics`, `gpunode.health`, `gpunode.remediation` and `gpunode.dra`
sections are parsed by their parsers in this package (config.metrics,
config.health, config.dra), and
`flags.plugin`, `sharing` and `gpunode.fractional` by config.sharing, so one
load validates the whole file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpunode.config.dra import DraConfig, check_exclusive, dra_time_slicing, parse_dra_config
from gpunode.config.files import read_regular
from gpunode.config.health import (
    HealthConfig,
    RemediationConfig,
    parse_health_config,
    parse_remediation_config,
)
from gpunode.config.idle import IdleConfig, parse_idle_config
from gpunode.config.metrics import MetricsConfig, parse_metrics_config
from gpunode.config.reader import load_yaml
from gpunode.config.sharing import (
    DEVICE_ID_STRATEGIES,
    DEVICE_LIST_STRATEGIES,
    ComputeShareCheck,
    Fractional,
    PluginFlags,
    SharedResource,
    TimeSlicing,
    parse_compute_share_check,
    parse_fractional,
    parse_plugin_flags,
    parse_replica_cap,
    parse_sharing,
)
from gpunode.contract.names import shared_resource_default
from gpunode.contract.reader import SectionReader
from gpunode.errors import ConfigError

DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_STATE_DIR = Path("/var/lib/gpunode")
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")

MIG_STRATEGIES = ("none", "single", "mixed")
BACKENDS = ("auto", "nvml", "sim")

# Bounds (README, configuration table); sharing bounds are in config.sharing.
MAX_CONFIG_BYTES = 1024 * 1024  # a configuration file is a few KiB
REDISCOVER_INTERVAL_S = (1.0, 3600.0)  # gpunode.rediscoverInterval: 1s..1h
PUBLISH_INTERVAL_S = (1.0, 3600.0)  # gpunode.nodeState.interval: 1s..1h
MAX_PATH_CHARS = 4096  # kubeletDir, stateDir, podResourcesSocket, simProfile (PATH_MAX)
MAX_SOCKET_PATH_CHARS = 107  # simControlSocket: a Unix socket path (sun_path)
MAX_NODE_NAME_CHARS = 253  # nodeName: a Kubernetes object name


@dataclass(frozen=True)
class Config:
    """The agent's validated configuration (built by load() or parse_config(); frozen).

    Field comments give units and choices: durations are seconds (`_s`), `source` names the file the
    settings came from and `origins` the flag or variable that set each setting not from the file.
    """

    source: str = "<defaults>"  # the file it came from
    # NVIDIA device-plugin settings
    mig_strategy: str = "none"
    fail_on_init_error: bool = True
    nvidia_driver_root: str = "/"
    nvidia_dev_root: str | None = None  # where /dev/nvidia* are on the host; None: nvidia_driver_root
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
    idle: IdleConfig = field(default_factory=IdleConfig)  # flag pods whose GPUs stay idle (node.idle)
    dra: DraConfig = field(default_factory=DraConfig)  # the DRA kubelet plugin (node.dra); off by default
    compute_share: ComputeShareCheck = field(default_factory=ComputeShareCheck)  # gpunode.computeShare
    # Setting -> the environment variable or flag that set it (settings from the file are absent).
    origins: Mapping[str, str] = field(default_factory=dict)

    @property
    def device_root(self) -> str:
        """The host root the device nodes (/dev/nvidia*) are under: flags.nvidiaDevRoot, else the driver root."""
        return self.nvidia_dev_root or self.nvidia_driver_root

    @property
    def kubelet_socket(self) -> Path:
        """The kubelet's device-plugin registration socket, kubelet_dir/kubelet.sock."""
        return self.kubelet_dir / "kubelet.sock"

    def origin(self, setting: str, key: str) -> str:
        """Where a setting came from, for messages: its flag or variable, else the file and `key`."""
        return self.origins.get(setting) or f"{self.source}: {key}"


# --- the file ----------------------------------------------------------------------------------


def parse_config(data: object, source: str) -> Config:
    """Validate a whole configuration document (already parsed from YAML/JSON)."""
    top = SectionReader(data, f"{source}: ")
    version = top.raw("version", "v1")
    if version != "v1":
        raise ConfigError(
            f"{source}: version: only v1 is supported, got {version!r:.40}",
            hint="write `version: v1` (the NVIDIA device-plugin configuration version gpunode reads)",
        )
    cfg = Config(source=source)
    cfg = _parse_flags(top.section("flags"), cfg)
    cfg = replace(cfg, time_slicing=parse_sharing(top.section("sharing")))
    _check_imex(top.section("imex"))
    if top.raw("resources", None) is not None:
        raise ConfigError(
            f"{source}: resources: custom resource patterns are not supported (NVIDIA's plugin ignores "
            "them too); gpunode names GPUs nvidia.com/gpu and MIG devices nvidia.com/mig-<profile>",
            hint="remove the section; use sharing.timeSlicing.resources[].rename to name shared resources",
        )
    explicit_placement = "replicaPlacement" in (top.raw("gpunode", None) or {})
    cfg = _parse_gpunode(top.section("gpunode"), cfg)
    policy = cfg.plugin.replica_placement
    if policy is not None and not explicit_placement:
        cfg = replace(cfg, replica_placement=policy)
    elif policy is not None and policy != cfg.replica_placement:
        raise ConfigError(
            f"{source}: flags.plugin.sharedDevicesAllocationPolicy and gpunode.replicaPlacement disagree "
            f"({cfg.plugin.replica_placement} vs {cfg.replica_placement})",
            hint="keep one of them (packed is pack, distributed is spread)",
        )
    _check_mps(cfg)
    top.finish()
    return cfg


def _check_mps(cfg: Config) -> None:
    """sharing.mps: what NVIDIA's plugin refuses with it (migStrategy mixed), and a replica memory cap other
    than MPS's own (an equal part of the GPU per replica)."""
    if not cfg.time_slicing.mps:
        return
    if cfg.mig_strategy == "mixed":
        raise ConfigError(
            f"{cfg.source}: flags.migStrategy: using migStrategy mixed is not supported with MPS (as NVIDIA's plugin)",
            hint="set migStrategy none (or single, on GPUs without MIG), or share MIG devices with timeSlicing",
        )
    if cfg.replica_memory_cap not in (None, "equal"):
        raise ConfigError(
            f"{cfg.source}: gpunode.replicaMemoryCap: MPS replicas are each capped at 1/replicas of the GPU's "
            "memory (MPS's pinned memory limit); another cap contradicts sharing.mps",
            hint="remove gpunode.replicaMemoryCap (or set it to equal), or use sharing.timeSlicing",
        )


def _parse_flags(flags: SectionReader, cfg: Config) -> Config:
    """The NVIDIA `flags` section: MIG strategy, driver roots and `flags.plugin`; GPUDirect is refused."""
    cfg = replace(
        cfg,
        mig_strategy=flags.choice("migStrategy", MIG_STRATEGIES, "none"),
        fail_on_init_error=flags.get("failOnInitError", bool, True),
        nvidia_driver_root=_text(flags, "nvidiaDriverRoot", "/", MAX_PATH_CHARS),
        nvidia_dev_root=_text(flags, "nvidiaDevRoot", None, MAX_PATH_CHARS) or None,
        plugin=parse_plugin_flags(flags.section("plugin")),
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
    flags.raw("mpsRoot", None)  # where NVIDIA's MPS daemons keep their files; gpunode runs none (sharing.mps)
    flags.finish()
    return cfg


def _check_imex(imex: SectionReader) -> None:
    """The NVIDIA `imex` section: accepted only without channels (gpunode does not inject IMEX channel
    device nodes); NVIDIA's own plugin accepts only [] and [0]."""
    channels = imex.raw("channelIDs", [])
    if channels != [] and channels != [0]:
        raise imex.fail(
            "channelIDs",
            f"expected [] or [0] (the values NVIDIA's plugin accepts), got {channels!r:.40}",
            hint="remove imex.channelIDs (or leave the list empty)",
        )
    if channels:
        raise ConfigError(
            f"{imex.key_path('channelIDs')}: IMEX channels are not supported by gpunode (it does not "
            "inject /dev/nvidia-caps-imex-channels into containers)",
            hint="remove imex.channelIDs (or leave the list empty); multi-node NVLink needs NVIDIA's plugin",
        )
    imex.get("required", bool, False)
    imex.finish()


def _parse_gpunode(own: SectionReader, cfg: Config) -> Config:
    """gpunode's own section: the agent's settings, then the metrics, health and remediation sections."""
    node_state = own.section("nodeState")
    cfg = replace(
        cfg,
        backend=own.choice("backend", BACKENDS, "auto"),
        sim_profile=_text(own, "simProfile", "dgx-h100", MAX_PATH_CHARS),
        sim_control_socket=_opt_path(_text(own, "simControlSocket", None, MAX_SOCKET_PATH_CHARS)),
        kubelet_dir=Path(_text(own, "kubeletDir", str(DEFAULT_KUBELET_DIR), MAX_PATH_CHARS)),
        state_dir=Path(_text(own, "stateDir", str(DEFAULT_STATE_DIR), MAX_PATH_CHARS)),
        pod_resources_socket=Path(
            _text(own, "podResourcesSocket", str(DEFAULT_POD_RESOURCES_SOCKET), MAX_PATH_CHARS)
        ),
        node_name=_text(own, "nodeName", "", MAX_NODE_NAME_CHARS),
        log_level=own.choice("logLevel", ("debug", "info", "warning", "error"), "info"),
        replica_placement=own.choice("replicaPlacement", ("spread", "pack"), "spread"),
        replica_memory_cap=own.parse("replicaMemoryCap", parse_replica_cap, None),
        fractional=parse_fractional(own.section("fractional")),
        rediscover_interval_s=own.duration(
            "rediscoverInterval", 30.0, minimum=REDISCOVER_INTERVAL_S[0], maximum=REDISCOVER_INTERVAL_S[1]
        ),
        publish_node_state=node_state.get("enabled", bool, True),
        publish_interval_s=node_state.duration(
            "interval", 60.0, minimum=PUBLISH_INTERVAL_S[0], maximum=PUBLISH_INTERVAL_S[1]
        ),
    )
    node_state.finish()
    _check_resource_names(cfg)
    cfg = replace(
        cfg,
        metrics=parse_metrics_config(own.raw("metrics", {}), own.key_path("metrics")),
        health=parse_health_config(own.raw("health", {}), own.key_path("health")),
        remediation=parse_remediation_config(own.raw("remediation", {}), own.key_path("remediation")),
        idle=parse_idle_config(own.raw("idle", {}), own.key_path("idle")),
        dra=parse_dra_config(own.raw("dra", {}), own.key_path("dra")),
        compute_share=parse_compute_share_check(own.raw("computeShare", {}), own.key_path("computeShare")),
    )
    time_sliced_by_dra = dra_time_slicing(cfg.time_slicing)  # may list DRA's GPUs: published time-sliced
    check_exclusive(
        cfg.dra,
        cfg.fractional.devices,
        [r.devices for r in cfg.time_slicing.resources if r not in time_sliced_by_dra],
    )
    own.finish()
    return cfg


def shared_resource_name(cfg: Config, res: SharedResource) -> str:
    """The name a time-sliced resource is advertised under: its rename, `<name>.shared`, or its name."""
    if res.rename:
        return res.rename
    if cfg.time_slicing.rename_by_default:
        return shared_resource_default(res.name)
    return res.name


def _check_resource_names(cfg: Config) -> None:
    """Two settings must never advertise under one name: one resource is one device-plugin socket."""
    seen: dict[str, str] = {}
    for i, res in enumerate(cfg.time_slicing.resources):
        name = shared_resource_name(cfg, res)
        where = f"{cfg.source}: sharing.timeSlicing.resources[{i}]"
        if name == cfg.fractional.resource_name:
            raise ConfigError(f"{where}: {name} is also gpunode.fractional.resourceName")
        if res.name != name and re.fullmatch(
            r"nvidia\.com/(gpu|mig-(\d+c\.)?\d+g\.\d+gb(\.(me|gfx|all))*)", name
        ):
            raise ConfigError(
                f"{where}.rename: {name} is a name NVIDIA GPUs and MIG devices are advertised under",
                hint="rename shared resources to a name of their own, such as nvidia.com/gpu.shared",
            )
        if name in seen:
            raise ConfigError(f"{where}: {res.name} would be advertised as {name}, as {seen[name]} is")
        seen[name] = res.name


def _opt_path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _text(r: SectionReader, key: str, default: str | None, max_chars: int) -> Any:
    """A string setting of at most max_chars characters, without NUL bytes."""
    value = r.get(key, str, default)
    if value is not None and (len(value) > max_chars or "\0" in value):
        raise r.fail(
            key,
            f"expected 0..{max_chars} characters without NUL bytes, got {len(value)} characters",
            hint="check the value for a runaway or binary string",
        )
    return value


def read_config_file(path: Path, *, named_by: str = "--config") -> Config:
    """Read and validate a configuration file (YAML or JSON). `named_by` says who named the file."""
    try:
        data_bytes = read_regular(path, MAX_CONFIG_BYTES)  # never blocks on a FIFO or a leased file
        if len(data_bytes) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{path}: the configuration file is larger than {MAX_CONFIG_BYTES // 1024} KiB",
                hint="a gpunode configuration is a few KiB; point --config at the right file",
            )
        text = data_bytes.decode()
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
    if data is None:  # nothing but blanks and comments: a truncated or wrongly mounted file, most likely
        raise ConfigError(
            f"{path}: the configuration file is empty (no settings, not even `version: v1`)",
            hint=f"write `version: v1` in it to run with the defaults, or point {named_by} at the right file",
        )
    return parse_config(data, str(path))


# --- environment and command line ---------------------------------------------------------------


def _env_bool(value: str, where: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(
        f"{where}: expected true or false, got {value[:40]!r}",
        hint=f"set {where.removeprefix('environment variable ')} to true or false (or 1/0), or unset it",
    )


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
    "nvidia_dev_root": (("GPUNODE_NVIDIA_DEV_ROOT", "NVIDIA_DEV_ROOT"), lambda v, w: v),
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
        raise ConfigError(
            f"{where}: expected one of {', '.join(choices)}, got {value[:40]!r}",
            hint=f"set {where.removeprefix('environment variable ')} to one of {', '.join(choices)}, "
            "or unset it",
        )
    return value


# Settings given as text by a variable or a flag, with their bounds (the file's are checked by _text).
_TEXT_BOUNDS = {
    "sim_profile": MAX_PATH_CHARS,
    "sim_control_socket": MAX_SOCKET_PATH_CHARS,
    "kubelet_dir": MAX_PATH_CHARS,
    "state_dir": MAX_PATH_CHARS,
    "pod_resources_socket": MAX_PATH_CHARS,
    "node_name": MAX_NODE_NAME_CHARS,
    "nvidia_driver_root": MAX_PATH_CHARS,
    "nvidia_dev_root": MAX_PATH_CHARS,
}


def _check_text(setting: str, value: object, origin: str) -> None:
    """A path or name from a variable or a flag: as bounded as the same key in the file."""
    limit = _TEXT_BOUNDS.get(setting)
    text = str(value)
    if limit is not None and (len(text) > limit or "\0" in text):
        raise ConfigError(
            f"{origin}: expected 0..{limit} characters without NUL bytes, got {len(text)} characters",
            hint=f"check the value given to {origin.removeprefix('environment variable ')}",
        )


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
            raise ConfigError(
                f"unknown setting {setting!r} given on the command line",
                hint=f"the settings a command line may give are: {', '.join(sorted(_ENV))}",
            )
        changes[setting] = value
        origins[setting] = f"command line --{setting.removeprefix('plugin.').replace('_', '-')}"
    for setting, value in changes.items():
        _check_text(setting, value, origins[setting])
    plugin = {k.removeprefix("plugin."): v for k, v in changes.items() if k.startswith("plugin.")}
    top = {k: v for k, v in changes.items() if not k.startswith("plugin.")}
    return replace(cfg, **top, plugin=replace(cfg.plugin, **plugin), origins={**cfg.origins, **origins})
