"""NVIDIA's device-plugin configuration v1, key by key: each key carries its meaning or is refused with
its reason in one line (README, "NVIDIA's configuration keys").

The cases are the ones NVIDIA's own parser tests (api/config/v1/*_test.go: flags, imex, replicated
devices and resources) and its README use, written down here as gpunode reads them: where NVIDIA's
parser fails, gpunode fails too; where NVIDIA accepts a key, gpunode honours it or says why it cannot.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpunode.config.agent import parse_config
from gpunode.contract.names import mig_profile_of, mig_resource_name
from gpunode.errors import ConfigError

GPU_UUID = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"
MIG_UUID = "MIG-3eb87630-93d5-b2b6-b8ff-9b359caf4ee2"
MIG_OLD_UUID = "MIG-GPU-662077db-fa3f-0d8f-9502-21ab0ef058a2/10/0"


def ts(**resource: Any) -> dict[str, Any]:
    """A configuration time-slicing one resource (nvidia.com/gpu, 2 replicas unless given)."""
    return {
        "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, **resource}]}}
    }


def refused(doc: dict[str, Any], *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(doc, "cfg.yaml")
    message = str(info.value)
    assert message.startswith("cfg.yaml: ") and "\n" not in message and info.value.hint, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --- flags --------------------------------------------------------------------------------------


def test_nvidia_dev_root_is_where_device_nodes_are_and_defaults_to_the_driver_root() -> None:
    assert parse_config({"flags": {"nvidiaDevRoot": "/run/nvidia/driver"}}, "c").device_root == (
        "/run/nvidia/driver"
    )
    both = parse_config({"flags": {"nvidiaDriverRoot": "/run/nvidia/driver", "nvidiaDevRoot": "/"}}, "c")
    assert both.device_root == "/" and both.nvidia_driver_root == "/run/nvidia/driver"
    assert parse_config({"flags": {"nvidiaDriverRoot": "/run/nvidia/driver"}}, "c").device_root == (
        "/run/nvidia/driver"
    )
    assert parse_config({}, "c").device_root == "/"


@pytest.mark.parametrize(
    ("policy", "placement"), [("packed", "pack"), ("distributed", "spread")], ids=["packed", "distributed"]
)
def test_shared_devices_allocation_policy_is_the_replica_placement(policy: str, placement: str) -> None:
    doc = {"flags": {"plugin": {"sharedDevicesAllocationPolicy": policy}}}
    assert parse_config(doc, "c").replica_placement == placement
    agreeing = {**doc, "gpunode": {"replicaPlacement": placement}}
    assert parse_config(agreeing, "c").replica_placement == placement


def test_allocation_policy_that_contradicts_replica_placement_is_refused() -> None:
    doc = {
        "flags": {"plugin": {"sharedDevicesAllocationPolicy": "packed"}},
        "gpunode": {"replicaPlacement": "spread"},
    }
    refused(doc, "sharedDevicesAllocationPolicy and gpunode.replicaPlacement disagree")


def test_unknown_allocation_policy_is_refused() -> None:
    doc = {"flags": {"plugin": {"sharedDevicesAllocationPolicy": "binpack"}}}
    refused(doc, "flags.plugin.sharedDevicesAllocationPolicy: expected distributed or packed")


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param({"flags": {}}, id="empty-flags"),
        pytest.param({"flags": {"gfd": {}}}, id="empty-gfd"),
        pytest.param({"flags": {"gfd": {"sleepInterval": 0}}}, id="gfd-interval-0"),
        pytest.param({"flags": {"gfd": {"sleepInterval": "5s"}}}, id="gfd-interval-5s"),
        pytest.param({"flags": {"gfd": {"sleepInterval": "infinite"}}}, id="gfd-interval-infinite"),
        pytest.param({"flags": {"mpsRoot": "/run/nvidia/mps"}}, id="mps-root-without-mps"),
        pytest.param({"flags": {"plugin": {"nvidiaCTKPath": "/usr/bin/nvidia-ctk"}}}, id="ctk-path"),
        pytest.param({"imex": {}}, id="imex-empty"),
        pytest.param({"imex": {"channelIDs": None}}, id="imex-null-channels"),
        pytest.param({"imex": {"channelIDs": []}}, id="imex-no-channels"),
    ],
)
def test_keys_nvidia_accepts_that_change_nothing_here(doc: dict[str, Any]) -> None:
    assert parse_config(doc, "c") == parse_config({}, "c")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("envvar", ("envvar",)), (["envvar", "cdi-annotations"], ("envvar", "cdi-annotations"))],
    ids=["one", "list"],
)
def test_device_list_strategy_one_or_a_list(value: Any, expected: tuple[str, ...]) -> None:
    doc = {"flags": {"plugin": {"deviceListStrategy": value}}}
    assert parse_config(doc, "c").plugin.device_list_strategy == expected


# --- imex, mps, resources -------------------------------------------------------------------------


def test_imex_channel_zero_is_refused_with_its_reason() -> None:
    refused(
        {"imex": {"channelIDs": [0]}}, "imex.channelIDs: IMEX channels are not supported", "does not inject"
    )


def test_imex_channels_nvidia_refuses_are_refused_as_invalid() -> None:
    refused({"imex": {"channelIDs": [2]}}, "imex.channelIDs: expected [] or [0]")


def test_resource_patterns_are_refused_with_their_reason() -> None:
    doc = {"resources": {"mig": [{"pattern": "1g.24gb+me.all", "name": "mig-1g.24gb.me.all"}]}}
    refused(doc, "resources: custom resource patterns are not supported", "NVIDIA's plugin ignores them too")


# --- sharing.timeSlicing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        pytest.param(
            {"sharing": {"timeSlicing": {}}}, "timeSlicing.resources: no resources listed", id="no-resources"
        ),
        pytest.param(
            {"sharing": {"timeSlicing": {"resources": []}}},
            "timeSlicing.resources: no resources listed",
            id="empty-resources",
        ),
        pytest.param(
            {"sharing": {"timeSlicing": None}}, "sharing.timeSlicing: the key is present but empty", id="null"
        ),
        pytest.param(
            ts(devices=None), "resources[0].devices: the key is present but empty", id="devices-left-empty"
        ),
        pytest.param(ts(devices="not-all"), "resources[0].devices", id="devices-not-all"),
        pytest.param(ts(devices=-2), "resources[0].devices", id="devices-negative"),
        pytest.param(ts(devices=2.0), "resources[0].devices", id="devices-float"),
        pytest.param(
            ts(devices=2), "resources[0].devices: a bare number (2) is a device count", id="devices-count"
        ),
        pytest.param(ts(devices=[-1]), "resources[0].devices", id="devices-minus-one"),
        pytest.param(ts(devices=["-1"]), "resources[0].devices", id="devices-minus-one-string"),
        pytest.param(ts(devices=["invalid-UUID"]), "'invalid-UUID' is not a GPU index", id="invalid-uuid"),
        pytest.param(ts(devices=["GPU-UUID"]), "'GPU-UUID' is not a GPU index", id="gpu-uuid-word"),
        pytest.param(ts(devices=["MIG-UUID"]), "'MIG-UUID' is not a GPU index", id="mig-uuid-word"),
        pytest.param(ts(devices=[f"MIG-{GPU_UUID}"]), "is not a GPU index", id="mig-gpu-uuid-without-ids"),
        pytest.param(ts(replicas=-1), "resources[0].replicas: must be at least 2", id="replicas-negative"),
        pytest.param(ts(replicas=0), "resources[0].replicas: must be at least 2", id="replicas-zero"),
        pytest.param(ts(name="$invalid$"), "is not a valid extended resource name", id="name-invalid"),
        pytest.param(ts(rename="$invalid$"), "is not a valid extended resource name", id="rename-invalid"),
        pytest.param(
            ts(name="valid"), "nvidia.com/valid is not a resource gpunode advertises", id="other-name"
        ),
    ],
)
def test_time_slicing_cases_nvidia_refuses_are_refused(doc: dict[str, Any], fragment: str) -> None:
    refused(doc, fragment)


@pytest.mark.parametrize(
    ("devices", "described"),
    [
        ("all", "all GPUs"),
        ([0], "index 0"),
        (["0"], "index 0"),
        (["0:0"], "MIG index 0:0"),
        ([GPU_UUID], GPU_UUID),
        ([MIG_UUID], MIG_UUID),
        ([MIG_OLD_UUID], MIG_OLD_UUID),
        ([0, "0:0", GPU_UUID], f"index 0, MIG index 0:0, {GPU_UUID}"),
    ],
    ids=["all", "index", "index-string", "mig-index", "gpu-uuid", "mig-uuid", "mig-old-uuid", "mixed"],
)
def test_device_lists_nvidia_accepts(devices: Any, described: str) -> None:
    (res,) = parse_config(ts(devices=devices), "c").time_slicing.resources
    assert res.devices.describe() == described


def test_bare_names_get_nvidia_prefix_as_in_nvidia_parser() -> None:
    (res,) = parse_config(ts(name="gpu", rename="gpu-shared"), "c").time_slicing.resources
    assert (res.name, res.rename) == ("nvidia.com/gpu", "nvidia.com/gpu-shared")


# --- MIG profile names ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "resource"),
    [
        ("1g.10gb", "nvidia.com/mig-1g.10gb"),
        ("1g.10gb+me", "nvidia.com/mig-1g.10gb.me"),
        ("1g.24gb+gfx", "nvidia.com/mig-1g.24gb.gfx"),
        ("1g.24gb+me.all", "nvidia.com/mig-1g.24gb.me.all"),
    ],
)
def test_mig_profile_suffixes_become_valid_resource_names(profile: str, resource: str) -> None:
    assert mig_resource_name(profile) == resource
    assert "+" not in resource
    assert mig_profile_of(resource) == profile.replace("+", ".")


def test_a_suffixed_mig_resource_can_be_time_sliced_and_not_renamed_onto_another() -> None:
    (res,) = parse_config(ts(name="nvidia.com/mig-1g.10gb.me", replicas=3), "c").time_slicing.resources
    assert res.name == "nvidia.com/mig-1g.10gb.me"
    refused(
        ts(rename="nvidia.com/mig-1g.10gb.me"), "is a name NVIDIA GPUs and MIG devices are advertised under"
    )


def _mig_gpu(profiles: list[str]) -> Any:
    from gpunode.node.devices.base import Gpu, MigDevice

    uuid = "GPU-00000000-0000-4000-8000-00000000a100"
    migs = tuple(
        MigDevice(
            uuid=f"MIG-0000{m:04x}-0000-4000-8000-00000000a100",
            parent_uuid=uuid,
            index=m,
            profile=profile,
            gi_id=m + 1,
            ci_id=0,
            slices=1,
            memory_total_bytes=10 * 2**30,
        )
        for m, profile in enumerate(profiles)
    )
    return Gpu(
        index=0,
        uuid=uuid,
        model="NVIDIA H100 80GB HBM3",
        memory_total_bytes=80 * 2**30,
        pci_bus_id="00000000:07:00.0",
        numa_node=0,
        minor=0,
        mig_enabled=True,
        mig_devices=migs,
    )


def test_a_media_extension_mig_device_is_advertised_and_time_sliced_under_a_valid_name() -> None:
    from gpunode.node.inventory import build_inventory

    gpu = _mig_gpu(["1g.10gb+me", "1g.10gb"])
    inv = build_inventory([gpu], parse_config({"flags": {"migStrategy": "mixed"}}, "c"))
    assert sorted({d.resource for d in inv.devices}) == [
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-1g.10gb.me",
    ]
    doc = {"flags": {"migStrategy": "mixed"}, **ts(name="nvidia.com/mig-1g.10gb.me", replicas=3)}
    sliced = build_inventory([gpu], parse_config(doc, "c"))
    assert len(sliced.by_resource("nvidia.com/mig-1g.10gb.me")) == 3
    assert len(sliced.by_resource("nvidia.com/mig-1g.10gb")) == 1


def test_the_extender_finds_a_suffixed_profile_under_the_name_pods_ask_for() -> None:
    from gpunode.contract.names import Sharing
    from gpunode.contract.nodestate import GpuRecord, MigInstance
    from gpunode.placement.published import gpu_state

    record = GpuRecord(
        uuid="GPU-00000000-0000-4000-8000-00000000a100",
        index=0,
        model="NVIDIA H100 80GB HBM3",
        memory_total_bytes=80 * 2**30,
        sharing=Sharing.MIG,
        mig=(
            MigInstance(profile="1g.10gb+me", uuid=MIG_UUID, assigned=False),
            MigInstance(profile="1g.10gb", uuid="MIG-0000aaaa-0000-4000-8000-00000000a100", assigned=False),
        ),
    )
    free = gpu_state(record).mig_free
    assert free == {"1g.10gb.me": 1, "1g.10gb": 1}
    assert mig_profile_of(mig_resource_name("1g.10gb+me")) in free


@pytest.mark.parametrize(
    ("flags", "root"),
    [
        ({}, ""),
        ({"nvidiaDriverRoot": "/run/nvidia/driver"}, "/run/nvidia/driver"),
        ({"nvidiaDriverRoot": "/run/nvidia/driver", "nvidiaDevRoot": "/"}, ""),
        ({"nvidiaDevRoot": "/host"}, "/host"),
    ],
    ids=["defaults", "driver-root", "dev-root-beside-driver-root", "dev-root"],
)
def test_device_specs_take_their_host_paths_from_the_dev_root(flags: dict[str, Any], root: str) -> None:
    from gpunode.node.allocation.allocator import Allocator
    from gpunode.node.devices.simnode.backend import SimBackend
    from gpunode.node.inventory import build_inventory
    from gpunode.node.state import DeviceState

    cfg = parse_config({"flags": {**flags, "plugin": {"passDeviceSpecs": True}}}, "c")
    inventory = build_inventory(SimBackend.from_profile("t4").gpus(), cfg)
    device = inventory.by_resource("nvidia.com/gpu")[0]
    got = Allocator(config=cfg).allocate(DeviceState(inventory).snapshot(), "nvidia.com/gpu", [device.id])
    paths = {n.container_path: n.host_path for n in got.devices}
    assert paths["/dev/nvidiactl"] == f"{root}/dev/nvidiactl"
    assert all(host == f"{root}{container}" for container, host in paths.items()), paths
