"""The configuration file (NVIDIA device-plugin v1 plus the gpunode section), its errors, and precedence.

Files under tests/data/configs are written the way users write them (the NVIDIA README's and helm
chart's shapes); the invalid cases are written to a temporary file so that every message can be
checked for the file's name, the key, and a hint.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from gpunode.config.agent import (
    DEFAULT_KUBELET_DIR,
    Config,
    environment_variables,
    load,
    parse_config,
    read_config_file,
)
from gpunode.errors import ConfigError

DATA = Path(__file__).resolve().parents[1] / "data" / "configs"
EXAMPLES = Path(__file__).resolve().parents[2] / "gpunode" / "examples"
GIB = 2**30
GPU_A = "GPU-7c3b2f10-53a1-4a8e-9d5c-2b1e0f6a9d41"
MIG_A = "MIG-1f0e9d8c-7b6a-4958-8372-615049382716"


def setting(cfg: Config, path: str) -> Any:
    """A setting by dotted attribute path, e.g. "plugin.device_list_strategy"."""
    return functools.reduce(getattr, path.split("."), cfg)


def shared(cfg: Config) -> list[tuple[str, int, str | None, str]]:
    """The time-slicing resources in a comparable form: (name, replicas, rename, devices)."""
    return [(r.name, r.replicas, r.rename, r.devices.describe()) for r in cfg.time_slicing.resources]


# --- valid files --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filename", "expected"),
    [
        pytest.param(
            "nvidia-readme-flags.yaml",
            {
                "mig_strategy": "none",
                "fail_on_init_error": True,
                "nvidia_driver_root": "/",
                "plugin.pass_device_specs": False,
                "plugin.device_list_strategy": ("envvar",),
                "plugin.device_id_strategy": "uuid",
                "time_slicing.resources": (),
                "fractional.devices": None,
            },
            id="nvidia-readme-flags",
        ),
        pytest.param(
            "nvidia-time-slicing.yaml",
            {
                "time_slicing.rename_by_default": False,
                "time_slicing.fail_requests_greater_than_one": False,
                shared: [("nvidia.com/gpu", 10, None, "all GPUs")],
            },
            id="nvidia-readme-time-slicing",
        ),
        pytest.param(
            "nvidia-time-slicing-renamed.yaml",
            {
                "plugin.pass_device_specs": True,
                "plugin.device_list_strategy": ("envvar", "cdi-annotations"),
                "plugin.device_id_strategy": "index",
                "plugin.container_driver_root": "/driver-root",
                "plugin.cdi_annotation_prefix": "cdi.k8s.io/",
                "time_slicing.rename_by_default": True,
                "time_slicing.fail_requests_greater_than_one": True,
                shared: [("nvidia.com/gpu", 4, None, "all GPUs")],
            },
            id="helm-configmap-with-gfd-section",
        ),
        pytest.param(
            "nvidia-mig-mixed-time-slicing.yaml",
            {
                "mig_strategy": "mixed",
                "fail_on_init_error": False,
                shared: [
                    ("nvidia.com/gpu", 2, None, "all GPUs"),
                    ("nvidia.com/mig-1g.10gb", 7, None, "all GPUs"),
                    ("nvidia.com/mig-2g.20gb", 3, "nvidia.com/mig-2g.20gb.shared", "all GPUs"),
                ],
            },
            id="mig-mixed-with-bare-resource-names",
        ),
        pytest.param(
            "nvidia-config.json",
            {
                "mig_strategy": "single",
                "plugin.device_list_strategy": ("volume-mounts",),
                shared: [("nvidia.com/gpu", 3, None, "all GPUs")],
            },
            id="json-file",
        ),
        pytest.param(
            "gpunode-per-device.yaml",
            {
                "backend": "sim",
                "sim_profile": "t4",
                "kubelet_dir": Path("/run/gpunode-test/device-plugins"),
                "state_dir": Path("/run/gpunode-test/state"),
                "pod_resources_socket": Path("/run/gpunode-test/pod-resources.sock"),
                "kubelet_socket": Path("/run/gpunode-test/device-plugins/kubelet.sock"),
                "node_name": "gpu-node-3",
                "log_level": "debug",
                "replica_placement": "pack",
                "replica_memory_cap": "equal",
                "rediscover_interval_s": 45.0,
                "fractional.resource_name": "gpunode.io/gpu-memory",
                "fractional.unit_bytes": 2 * GIB,
                "fractional.fail_open": False,
                "fractional.ld_so_preload": True,
                "fractional.devices.indexes": (2,),
                shared: [("nvidia.com/gpu", 4, None, "index 0, index 1")],
            },
            id="gpunode-section-every-key",
        ),
        pytest.param(
            "nvidia-v020-flags.yaml",
            {
                "mig_strategy": "mixed",
                "nvidia_driver_root": "/run/nvidia/driver",
                "device_root": "/",
                "replica_placement": "pack",
                shared: [("nvidia.com/mig-1g.10gb.me", 2, None, "all GPUs")],
            },
            id="nvidia-v0.20-flags",
        ),
    ],
)
def test_valid_file(filename: str, expected: dict[Any, Any]) -> None:
    path = DATA / filename
    cfg = read_config_file(path)
    assert cfg.source == str(path)
    for key, value in expected.items():
        got = key(cfg) if callable(key) else setting(cfg, key)
        assert got == value, key


def test_version_alone_and_missing_version_mean_v1_defaults(tmp_path: Path) -> None:
    only_version = tmp_path / "defaults.yaml"
    only_version.write_text("# the defaults, on purpose\nversion: v1\n")
    cfg = read_config_file(only_version)
    assert cfg == Config(source=str(only_version))
    assert cfg.kubelet_dir == DEFAULT_KUBELET_DIR
    assert cfg.backend == "auto" and cfg.mig_strategy == "none" and cfg.fail_on_init_error is True
    no_version = tmp_path / "no-version.yaml"
    no_version.write_text("flags: {}\n")
    assert read_config_file(no_version) == Config(source=str(no_version))


def test_an_empty_file_is_refused_not_read_as_the_defaults(tmp_path: Path) -> None:
    """A file of nothing but comments is more likely truncated or mounted wrongly than meant as defaults."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError) as info:
        read_config_file(empty)
    assert (
        str(info.value) == f"{empty}: the configuration file is empty (no settings, not even `version: v1`)"
    )
    assert "version: v1" in info.value.hint


# --- valid values, one key at a time ------------------------------------------------------------


def ts(**resource: Any) -> dict[str, Any]:
    """A document with one time-slicing resource of nvidia.com/gpu (fields overridable)."""
    return {
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, **resource}]}}
    }


def own(**section: Any) -> dict[str, Any]:
    return {"gpunode": section}


@pytest.mark.parametrize(
    ("doc", "path", "expected"),
    [
        pytest.param({"flags": {"migStrategy": "single"}}, "mig_strategy", "single", id="mig-single"),
        pytest.param({"flags": {"migStrategy": "mixed"}}, "mig_strategy", "mixed", id="mig-mixed"),
        pytest.param({"flags": {"failOnInitError": False}}, "fail_on_init_error", False, id="fail-on-init"),
        pytest.param(
            {"flags": {"plugin": {"deviceListStrategy": "cdi-cri"}}},
            "plugin.device_list_strategy",
            ("cdi-cri",),
            id="device-list-strategy-string",
        ),
        pytest.param(
            {"flags": {"plugin": {"deviceListStrategy": ["envvar", "volume-mounts", "envvar"]}}},
            "plugin.device_list_strategy",
            ("envvar", "volume-mounts"),
            id="device-list-strategy-list-deduplicated",
        ),
        pytest.param(
            {"flags": {"plugin": {"deviceIDStrategy": "index"}}},
            "plugin.device_id_strategy",
            "index",
            id="device-id-strategy-index",
        ),
        pytest.param(ts(devices="all"), "time_slicing.resources.0.devices.all", True, id="devices-all"),
        pytest.param(ts(devices=[0, "3"]), "time_slicing.resources.0.devices.indexes", (0, 3), id="indexes"),
        pytest.param(
            ts(devices="0, 2"), "time_slicing.resources.0.devices.indexes", (0, 2), id="index-string"
        ),
        pytest.param(ts(devices=[1, 1]), "time_slicing.resources.0.devices.indexes", (1,), id="index-twice"),
        pytest.param(ts(devices=[GPU_A]), "time_slicing.resources.0.devices.uuids", (GPU_A,), id="gpu-uuid"),
        pytest.param(ts(devices=[MIG_A]), "time_slicing.resources.0.devices.uuids", (MIG_A,), id="mig-uuid"),
        pytest.param(
            ts(devices=["1:0", "2:3"]),
            "time_slicing.resources.0.devices.mig_indexes",
            ((1, 0), (2, 3)),
            id="mig-indexes",
        ),
        pytest.param(
            ts(rename="gpu-shared"),
            "time_slicing.resources.0.rename",
            "nvidia.com/gpu-shared",
            id="bare-rename",
        ),
        pytest.param(
            ts(rename="example.com/tpu-ish"),
            "time_slicing.resources.0.rename",
            "example.com/tpu-ish",
            id="domain-rename",
        ),
        pytest.param(ts(name="gpu"), "time_slicing.resources.0.name", "nvidia.com/gpu", id="bare-name"),
        pytest.param(own(replicaMemoryCap="none"), "replica_memory_cap", None, id="cap-none"),
        pytest.param(own(replicaMemoryCap="equal"), "replica_memory_cap", "equal", id="cap-equal"),
        pytest.param(own(replicaMemoryCap="10Gi"), "replica_memory_cap", 10 * GIB, id="cap-gibibytes"),
        pytest.param(own(replicaMemoryCap="512MiB"), "replica_memory_cap", 512 * 2**20, id="cap-mebibytes"),
        pytest.param(own(replicaMemoryCap="16GB"), "replica_memory_cap", 16 * 10**9, id="cap-gigabytes"),
        pytest.param(own(replicaMemoryCap=GIB), "replica_memory_cap", GIB, id="cap-bytes"),
        pytest.param(
            own(fractional={"unit": "512Mi"}), "fractional.unit_bytes", 512 * 2**20, id="unit-mebibytes"
        ),
        pytest.param(own(fractional={"devices": "all"}), "fractional.devices.all", True, id="fractional-all"),
        pytest.param(
            own(fractional={"resourceName": "gpu-memory"}),
            "fractional.resource_name",
            "nvidia.com/gpu-memory",
            id="fractional-bare-name",
        ),
        pytest.param(own(backend="nvml"), "backend", "nvml", id="backend-nvml"),
        pytest.param(
            own(simProfile="/etc/gpunode/lab.yaml"), "sim_profile", "/etc/gpunode/lab.yaml", id="profile-path"
        ),
        pytest.param(own(rediscoverInterval=5), "rediscover_interval_s", 5.0, id="rediscover-number"),
        pytest.param(own(rediscoverInterval="2m"), "rediscover_interval_s", 120.0, id="rediscover-minutes"),
        pytest.param(
            own(simControlSocket="/run/sim.sock"),
            "sim_control_socket",
            Path("/run/sim.sock"),
            id="sim-socket",
        ),
    ],
)
def test_valid_value(doc: dict[str, Any], path: str, expected: Any) -> None:
    cfg = parse_config(doc, "cfg.yaml")
    value: Any = cfg
    for part in path.split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part)
    assert value == expected


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param({"flags": {"gfd": {"oneshot": True, "sleepInterval": "60s"}}}, id="gfd-section"),
        pytest.param({"flags": {"useNodeFeatureAPI": True}}, id="use-node-feature-api"),
        pytest.param({"flags": {"deviceDiscoveryStrategy": "nvml"}}, id="device-discovery-strategy"),
        pytest.param(
            {"flags": {"gdsEnabled": False, "mofedEnabled": False, "gdrcopyEnabled": False}}, id="gds-off"
        ),
        pytest.param({"flags": {"plugin": {"nvidiaCTKPath": "/usr/bin/nvidia-ctk"}}}, id="nvidia-ctk-path"),
        pytest.param({"imex": {"channelIDs": [], "required": False}}, id="imex-without-channels"),
        pytest.param({"version": None, "flags": None, "sharing": None, "gpunode": None}, id="null-sections"),
    ],
)
def test_nvidia_keys_accepted_without_effect(doc: dict[str, Any]) -> None:
    cfg = parse_config(doc, "cfg.yaml")
    defaults = parse_config({}, "cfg.yaml")
    assert cfg == defaults


# --- invalid files ------------------------------------------------------------------------------


def expected_errors(path: Path) -> list[str]:
    """The `# error: ...` lines at the top of an invalid example: fragments its message must contain."""
    return [
        line.removeprefix("# error: ")
        for line in path.read_text().splitlines()
        if line.startswith("# error: ")
    ]


INVALID = sorted((DATA / "invalid").glob("*.yaml"))


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_file(path: Path) -> None:
    """Each file under data/configs/invalid is refused with a message naming the file and the key."""
    fragments = expected_errors(path)
    assert fragments, f"{path.name} says which error it expects in `# error:` lines"
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    for fragment in fragments:
        assert fragment in message
    assert "\n" not in message and info.value.hint


def test_broken_yaml_points_at_the_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text('version: v1\nflags:\n  migStrategy: "mixed\n')
    with pytest.raises(ConfigError, match=r"not valid YAML at line 4, column 1: .*end of stream"):
        read_config_file(path)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        pytest.param(
            lambda d: d / "missing.yaml", "configuration file not found (named by --config)", id="missing"
        ),
        pytest.param(
            lambda d: d,
            "cannot read the configuration file: not a regular file (a directory)",
            id="directory",
        ),
        pytest.param(
            lambda d: (d / "binary.yaml", (d / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\xff"))[0],
            "not a text file (byte 0 is not UTF-8)",
            id="binary",
        ),
    ],
)
def test_unreadable_file(tmp_path: Path, make: Any, fragment: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    assert str(info.value).startswith(str(path)) and fragment in str(info.value)


def test_nothing_is_half_applied_when_a_later_key_is_bad(tmp_path: Path) -> None:
    """A bad value anywhere refuses the whole file: load() never returns a partly read config."""
    path = tmp_path / "cfg.yaml"
    path.write_text("flags:\n  migStrategy: mixed\ngpunode:\n  kubeletDir: /tmp/k\n  logLevel: loud\n")
    with pytest.raises(ConfigError, match=r"gpunode\.logLevel: expected one of"):
        load(config_path=path, environ={})


# --- precedence ---------------------------------------------------------------------------------

FILE = """\
version: v1
flags:
  migStrategy: mixed
  failOnInitError: true
  nvidiaDriverRoot: /run/nvidia/driver
  plugin:
    deviceListStrategy: volume-mounts
    cdiAnnotationPrefix: example.com/
gpunode:
  backend: sim
  simProfile: a100-mig
  kubeletDir: /from/file
  nodeName: file-node
"""


@pytest.mark.parametrize(
    ("use_file", "environ", "overrides", "expected", "origins"),
    [
        pytest.param(
            False,
            {},
            {},
            {
                "backend": "auto",
                "mig_strategy": "none",
                "kubelet_dir": DEFAULT_KUBELET_DIR,
                "source": "<defaults>",
            },
            {},
            id="defaults",
        ),
        pytest.param(
            True,
            {},
            {},
            {
                "backend": "sim",
                "mig_strategy": "mixed",
                "kubelet_dir": Path("/from/file"),
                "node_name": "file-node",
            },
            {},
            id="file-over-defaults",
        ),
        pytest.param(
            True,
            {"MIG_STRATEGY": "single", "GPUNODE_KUBELET_DIR": "/from/env", "NODE_NAME": "env-node"},
            {},
            {
                "mig_strategy": "single",
                "kubelet_dir": Path("/from/env"),
                "node_name": "env-node",
                "backend": "sim",
            },
            {
                "mig_strategy": "environment variable MIG_STRATEGY",
                "kubelet_dir": "environment variable GPUNODE_KUBELET_DIR",
                "node_name": "environment variable NODE_NAME",
            },
            id="environment-over-file",
        ),
        pytest.param(
            True,
            {"GPUNODE_MIG_STRATEGY": "none", "MIG_STRATEGY": "single"},
            {},
            {"mig_strategy": "none"},
            {"mig_strategy": "environment variable GPUNODE_MIG_STRATEGY"},
            id="gpunode-variable-over-nvidia-variable",
        ),
        pytest.param(
            True,
            {"GPUNODE_BACKEND": "nvml", "GPUNODE_KUBELET_DIR": "/from/env", "MIG_STRATEGY": "single"},
            {"backend": "sim", "kubelet_dir": Path("/from/cli"), "mig_strategy": None},
            {"backend": "sim", "kubelet_dir": Path("/from/cli"), "mig_strategy": "single"},
            {
                "backend": "command line --backend",
                "kubelet_dir": "command line --kubelet-dir",
                "mig_strategy": "environment variable MIG_STRATEGY",
            },
            id="command-line-over-environment-none-ignored",
        ),
        pytest.param(
            True,
            {"FAIL_ON_INIT_ERROR": "false"},
            {},
            {"fail_on_init_error": False},
            {"fail_on_init_error": "environment variable FAIL_ON_INIT_ERROR"},
            id="fail-on-init-error-variable",
        ),
        pytest.param(
            True,
            {"GPUNODE_FAIL_ON_INIT_ERROR": "yes", "FAIL_ON_INIT_ERROR": "0"},
            {},
            {"fail_on_init_error": True},
            {"fail_on_init_error": "environment variable GPUNODE_FAIL_ON_INIT_ERROR"},
            id="gpunode-fail-on-init-over-nvidia",
        ),
        pytest.param(
            True,
            {"GPUNODE_BACKEND": "", "MIG_STRATEGY": ""},
            {},
            {"backend": "sim", "mig_strategy": "mixed"},
            {},
            id="empty-variables-are-unset",
        ),
        pytest.param(
            True,
            {
                "DEVICE_LIST_STRATEGY": "envvar,cdi-cri",
                "PASS_DEVICE_SPECS": "true",
                "DEVICE_ID_STRATEGY": "index",
            },
            {},
            {
                "plugin.device_list_strategy": ("envvar", "cdi-cri"),
                "plugin.pass_device_specs": True,
                "plugin.device_id_strategy": "index",
                "plugin.cdi_annotation_prefix": "example.com/",
            },
            {
                "plugin.device_list_strategy": "environment variable DEVICE_LIST_STRATEGY",
                "plugin.pass_device_specs": "environment variable PASS_DEVICE_SPECS",
                "plugin.device_id_strategy": "environment variable DEVICE_ID_STRATEGY",
            },
            id="nvidia-plugin-variables-keep-other-file-flags",
        ),
        pytest.param(
            True,
            {"NVIDIA_DRIVER_ROOT": "/"},
            {},
            {"nvidia_driver_root": "/"},
            {"nvidia_driver_root": "environment variable NVIDIA_DRIVER_ROOT"},
            id="nvidia-driver-root-variable",
        ),
        pytest.param(
            False,
            {"HOME": "/root", "PATH": "/usr/bin", "GPUNODE_UNRELATED": "x"},
            {},
            {"backend": "auto"},
            {},
            id="unrelated-variables-ignored",
        ),
    ],
)
def test_precedence(
    tmp_path: Path,
    use_file: bool,
    environ: dict[str, str],
    overrides: dict[str, Any],
    expected: dict[str, Any],
    origins: dict[str, str],
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(FILE)
    cfg = load(config_path=path if use_file else None, overrides=overrides, environ=environ)
    for key, value in expected.items():
        assert setting(cfg, key) == value, key
    assert cfg.origins == origins


@pytest.mark.parametrize(
    ("environ", "config_arg", "expected_source"),
    [
        pytest.param({"CONFIG_FILE": "b.yaml"}, None, "b.yaml", id="nvidia-config-file-variable"),
        pytest.param(
            {"GPUNODE_CONFIG": "a.yaml", "CONFIG_FILE": "b.yaml"}, None, "a.yaml", id="gpunode-config-first"
        ),
        pytest.param({"GPUNODE_CONFIG": "a.yaml"}, "c.yaml", "c.yaml", id="config-flag-over-variables"),
        pytest.param({"CONFIG_FILE": ""}, None, "<defaults>", id="empty-config-variable"),
    ],
)
def test_which_file_is_read(
    tmp_path: Path, environ: dict[str, str], config_arg: str | None, expected_source: str
) -> None:
    for name, strategy in (("a.yaml", "single"), ("b.yaml", "mixed"), ("c.yaml", "none")):
        (tmp_path / name).write_text(f"flags: {{migStrategy: {strategy}}}\n")
    env = {k: str(tmp_path / v) if v else v for k, v in environ.items()}
    cfg = load(config_path=tmp_path / config_arg if config_arg else None, environ=env)
    expected = expected_source if expected_source == "<defaults>" else str(tmp_path / expected_source)
    assert cfg.source == expected


@pytest.mark.parametrize(
    ("environ", "fragments"),
    [
        pytest.param(
            {"GPUNODE_BACKEND": "gpu"},
            ["environment variable GPUNODE_BACKEND: expected one of auto, nvml, sim, got 'gpu'"],
            id="backend",
        ),
        pytest.param(
            {"MIG_STRATEGY": "Mixed"},
            ["environment variable MIG_STRATEGY: expected one of none, single, mixed, got 'Mixed'"],
            id="mig-strategy-case",
        ),
        pytest.param(
            {"GPUNODE_MIG_STRATEGY": "all"},
            ["environment variable GPUNODE_MIG_STRATEGY"],
            id="gpunode-mig-strategy",
        ),
        pytest.param(
            {"FAIL_ON_INIT_ERROR": "maybe"},
            ["environment variable FAIL_ON_INIT_ERROR: expected true or false, got 'maybe'"],
            id="fail-on-init",
        ),
        pytest.param(
            {"GPUNODE_LOG_LEVEL": "verbose"},
            ["environment variable GPUNODE_LOG_LEVEL: expected one of debug, info, warning, error"],
            id="log-level",
        ),
        pytest.param(
            {"GPUNODE_REPLICA_PLACEMENT": "random"},
            ["environment variable GPUNODE_REPLICA_PLACEMENT"],
            id="placement",
        ),
        pytest.param(
            {"DEVICE_LIST_STRATEGY": "envvar,cdi"},
            ["environment variable DEVICE_LIST_STRATEGY: expected one of", "got 'cdi'"],
            id="device-list-strategy",
        ),
        pytest.param(
            {"DEVICE_ID_STRATEGY": "serial"},
            ["environment variable DEVICE_ID_STRATEGY"],
            id="device-id-strategy",
        ),
        pytest.param(
            {"PASS_DEVICE_SPECS": "2"},
            ["environment variable PASS_DEVICE_SPECS: expected true or false"],
            id="pass-device-specs",
        ),
        pytest.param(
            {"CONFIG_FILE": "/nonexistent/gpunode.yaml"},
            [
                "/nonexistent/gpunode.yaml: configuration file not found (named by environment variable CONFIG_FILE)"
            ],
            id="config-file-missing",
        ),
        pytest.param(
            {"GPUNODE_CONFIG": "/nonexistent/g.yaml"},
            ["named by environment variable GPUNODE_CONFIG"],
            id="gpunode-config-missing",
        ),
    ],
)
def test_bad_environment_names_the_variable(environ: dict[str, str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load(environ=environ)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert info.value.hint


def test_unknown_command_line_setting_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'gpus' given on the command line"):
        load(overrides={"gpus": 4}, environ={})


# One valid value per documented variable: setting it must change where that setting came from.
SAMPLE_VALUES = {
    "backend": "sim",
    "sim_profile": "t4",
    "sim_control_socket": "/run/sim.sock",
    "kubelet_dir": "/k",
    "state_dir": "/s",
    "pod_resources_socket": "/p.sock",
    "node_name": "n1",
    "log_level": "debug",
    "mig_strategy": "mixed",
    "fail_on_init_error": "false",
    "replica_placement": "pack",
    "nvidia_driver_root": "/run/nvidia/driver",
    "nvidia_dev_root": "/run/nvidia/driver",
    "plugin.pass_device_specs": "true",
    "plugin.device_list_strategy": "cdi-cri",
    "plugin.device_id_strategy": "index",
}


@pytest.mark.parametrize(
    ("name", "var"),
    [
        pytest.param(name, var, id=var)
        for name, names in environment_variables().items()
        if name != "config"
        for var in names
    ],
)
def test_every_documented_variable_is_read(name: str, var: str) -> None:
    cfg = load(environ={var: SAMPLE_VALUES[name]})
    assert cfg.origins == {name: f"environment variable {var}"}
    assert setting(cfg, name) != setting(load(environ={}), name)


# --- the bundled examples ----------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("config-*.yaml")), ids=lambda p: p.name)
def test_bundled_example_is_valid(path: Path) -> None:
    cfg = read_config_file(path)
    assert cfg.source == str(path)
    text = path.read_text()
    assert text.startswith("#"), "an example starts with a comment saying what it is for"


def test_the_four_documented_examples_exist() -> None:
    names = {p.name for p in EXAMPLES.glob("config-*.yaml")}
    assert {
        "config-whole.yaml",
        "config-timeslicing.yaml",
        "config-mig-mixed.yaml",
        "config-fractional.yaml",
    } <= names


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("gpunode:\n  logLevel: " + "x" * 5000 + "END\n", id="long-choice"),
        pytest.param("gpunode:\n  backend: [" + ", ".join(["sim"] * 2000) + ", END]\n", id="long-list"),
        pytest.param("K" * 3000 + "END: 1\n" + "K" * 3000 + "END: 2\n", id="long-duplicate-key"),
        pytest.param("version: " + "v" * 5000 + "END\n", id="long-version"),
        pytest.param(
            "sharing:\n  timeSlicing:\n    resources:\n    - name: " + "n" * 5000 + "END\n", id="long-name"
        ),
    ],
)
def test_messages_quote_only_an_excerpt_of_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "END" not in message and len(message) < len(str(path)) + 250, (
        message
    )
