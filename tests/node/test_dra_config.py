"""The `gpunode.dra` configuration section: defaults, paths, and each refusal as one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.config.agent import parse_config
from gpunode.config.dra import DEFAULT_CDI_DIR, DEFAULT_DRIVER_NAME
from gpunode.errors import ConfigError

GPU_A = "GPU-7c3b2f10-53a1-4a8e-9d5c-2b1e0f6a9d41"


def cfg_with(dra: object, **gpunode: object) -> object:
    return parse_config({"version": "v1", "gpunode": {"dra": dra, **gpunode}}, "cfg.yaml")


def test_defaults_leave_dra_off() -> None:
    cfg = parse_config({"version": "v1"}, "cfg.yaml")
    assert not cfg.dra.enabled
    assert cfg.dra.driver_name == DEFAULT_DRIVER_NAME
    assert cfg.dra.cdi_dir == DEFAULT_CDI_DIR
    assert not cfg.dra.serves(0, GPU_A)  # off: the device plugin serves every GPU


def test_enabled_serves_all_gpus_and_derives_kubelet_paths() -> None:
    cfg = cfg_with({"enabled": True}, kubeletDir="/k/device-plugins")
    dra = cfg.dra
    assert dra.serves(0, GPU_A) and dra.serves(7, "GPU-other")
    assert dra.registration_socket(cfg.kubelet_dir) == Path("/k/plugins_registry/gpu.gpunode.io-reg.sock")
    assert dra.service_socket(cfg.kubelet_dir) == Path("/k/plugins/gpu.gpunode.io/dra.sock")


def test_listed_gpus_only_and_explicit_root() -> None:
    dra = cfg_with(
        {"enabled": True, "devices": [1, GPU_A], "driverName": "gpu.example.com", "kubeletRoot": "/kr"}
    ).dra
    assert dra.serves(1, "GPU-x") and dra.serves(5, GPU_A)
    assert not dra.serves(0, "GPU-x")
    assert dra.registration_socket(Path("/ignored/device-plugins")) == Path(
        "/kr/plugins_registry/gpu.example.com-reg.sock"
    )


def test_device_plugin_keeps_gpus_dra_does_not_list() -> None:
    cfg = cfg_with({"enabled": True, "devices": [0]}, fractional={"devices": [1, 2]})
    assert cfg.fractional.devices is not None and cfg.fractional.devices.indexes == (1, 2)
    # `all` in a device-plugin setting means the device plugin's GPUs: no clash with DRA's list
    cfg_with({"enabled": True, "devices": [0]}, fractional={"devices": "all"})


@pytest.mark.parametrize(
    ("dra", "extra", "key", "words"),
    [
        ({"driverName": "GPU.Example.com"}, {}, "gpunode.dra.driverName", "DNS subdomain"),
        ({"driverName": "nodots"}, {}, "gpunode.dra.driverName", "DNS subdomain"),
        ({"driverName": "1gpu.example.com"}, {}, "gpunode.dra.driverName", "starting with a letter"),
        ({"driverName": "../../etc"}, {}, "gpunode.dra.driverName", "DNS subdomain"),
        ({"driverName": "a/b.example.com"}, {}, "gpunode.dra.driverName", "DNS subdomain"),
        ({"driverName": "x" * 60 + ".example.com"}, {}, "gpunode.dra.driverName", "63"),
        ({"enabled": "yes"}, {}, "gpunode.dra.enabled", "true or false"),
        ({"devices": None}, {}, "gpunode.dra.devices", "present but empty"),
        ({"devices": ["0:1"]}, {}, "gpunode.dra.devices", "MIG"),
        ({"devices": 2}, {}, "gpunode.dra.devices", "device count"),
        ({"cdiDir": "relative/cdi"}, {}, "gpunode.dra.cdiDir", "absolute path"),
        ({"kubeletRoot": "/a\0b"}, {}, "gpunode.dra.kubeletRoot", "absolute path"),
        ({"driver": "gpu.gpunode.io"}, {}, "gpunode.dra", "driver"),
        (
            {"enabled": True, "devices": [0, 1]},
            {"fractional": {"devices": [1]}},
            "gpunode.fractional.devices",
            "one of the two",
        ),
        ({"enabled": True}, {"fractional": {"devices": "all"}}, "gpunode.fractional.devices", "all GPUs"),
    ],
)
def test_refused_with_one_line(dra: dict, extra: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfg_with(dra, **extra)
    message = str(err.value)
    assert "\n" not in message and message.startswith("cfg.yaml: ")
    assert key in message and words in message


def test_a_time_sliced_list_naming_a_dra_gpu_makes_dra_publish_it_time_sliced() -> None:
    from gpunode.config.dra import time_sliced_replicas

    doc: dict = {
        "version": "v1",
        "sharing": {
            "timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 3, "devices": [0, GPU_A]}]}
        },
        "gpunode": {"dra": {"enabled": True, "devices": [0, 1]}},
    }
    cfg = parse_config(doc, "cfg.yaml")
    assert time_sliced_replicas(cfg.dra, cfg.time_slicing, 0, "GPU-x") == 3
    assert time_sliced_replicas(cfg.dra, cfg.time_slicing, 1, "GPU-y") is None  # DRA's, not listed
    assert time_sliced_replicas(cfg.dra, cfg.time_slicing, 5, GPU_A) is None  # listed, not DRA's
    doc["gpunode"] = {"dra": {"enabled": False, "devices": [0]}}  # off: the device plugin time-slices it
    cfg = parse_config(doc, "cfg.yaml")
    assert time_sliced_replicas(cfg.dra, cfg.time_slicing, 0, "GPU-x") is None


def test_an_mps_list_or_fractional_selector_naming_a_dra_gpu_is_still_refused() -> None:
    mps = {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": [0]}]}}
    doc = {"version": "v1", "sharing": mps, "gpunode": {"dra": {"enabled": True, "devices": [0]}}}
    with pytest.raises(ConfigError, match=r"devices: index 0 would be served by the device plugin"):
        parse_config(doc, "cfg.yaml")
    doc = {
        "version": "v1",
        "gpunode": {"dra": {"enabled": True, "devices": [0]}, "fractional": {"devices": [0]}},
    }
    with pytest.raises(ConfigError, match=r"index 0 would be served by the device plugin"):
        parse_config(doc, "cfg.yaml")
    doc["gpunode"] = {"dra": {"enabled": False, "devices": [0]}}  # off: no clash
    parse_config(doc, "cfg.yaml")
