"""A GPU is served by DRA or by the device plugin, never both: the inventory advertises nothing for
DRA's GPUs, shows them as `dra` (the published node state reads the modes), and refuses a
device-plugin selector that names one of them."""

from __future__ import annotations

from typing import Any

import pytest

from gpunode.config.agent import parse_config
from gpunode.contract.names import Sharing
from gpunode.errors import ConfigError
from gpunode.node.inventory import build_inventory
from tests.node.dra_world import GPUS


def inventory(dra: dict[str, Any], **doc: Any) -> Any:
    cfg = parse_config(
        {"version": "v1", **doc, "gpunode": {**doc.pop("gpunode", {}), "dra": dra}}, "cfg.yaml"
    )
    return build_inventory(GPUS, cfg)


def test_without_dra_every_gpu_is_the_device_plugins() -> None:
    inv = inventory({"enabled": False, "devices": [0]})
    assert {d.gpu_uuid for d in inv.devices} == {g.uuid for g in GPUS}
    assert Sharing.DRA not in dict(inv.modes).values()


def test_dra_gpus_are_advertised_nothing_and_published_as_dra() -> None:
    inv = inventory({"enabled": True, "devices": [0, 2]}, gpunode={"fractional": {"devices": [1]}})
    assert {d.gpu_uuid for d in inv.devices} == {GPUS[1].uuid}
    assert all(d.kind == "memory" for d in inv.devices)
    assert dict(inv.modes) == {GPUS[0].uuid: "dra", GPUS[1].uuid: "fractional", GPUS[2].uuid: "dra"}
    assert inv.gpus == GPUS  # still watched by the health engine


def test_all_gpus_to_dra_leaves_the_device_plugin_nothing() -> None:
    inv = inventory({"enabled": True})
    assert inv.devices == () and inv.resources() == ()
    assert set(dict(inv.modes).values()) == {Sharing.DRA}


def test_a_device_plugin_selector_naming_a_dra_gpu_by_uuid_is_refused() -> None:
    doc = {
        "sharing": {
            "mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": [GPUS[0].uuid]}]}
        }
    }
    with pytest.raises(ConfigError) as err:
        inventory({"enabled": True, "devices": [0]}, **doc)
    assert "is served through DRA" in str(err.value) and "\n" not in str(err.value)


def test_a_dra_gpu_a_time_slicing_list_names_is_dras_and_the_others_are_time_sliced_by_the_plugin() -> None:
    doc = {
        "sharing": {
            "timeSlicing": {
                "resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": [GPUS[0].uuid, 1]}]
            }
        }
    }
    inv = inventory({"enabled": True, "devices": [0]}, **doc)
    assert dict(inv.modes)[GPUS[0].uuid] == Sharing.DRA  # DRA publishes it time-sliced (its slice)
    assert {d.gpu_uuid for d in inv.devices} == {GPUS[1].uuid, GPUS[2].uuid}
    assert len([d for d in inv.devices if d.gpu_uuid == GPUS[1].uuid]) == 2  # the plugin's two replicas


def test_the_published_node_state_shows_dra_gpus_and_the_extender_places_nothing_there() -> None:
    from gpunode import placement
    from gpunode.contract import nodestate
    from gpunode.node.allocation.accounting import gpu_records
    from gpunode.node.state import DeviceState

    inv = inventory({"enabled": True, "devices": [0]})
    records = gpu_records(DeviceState(inv).snapshot(), {})
    by_uuid = {r.uuid: r for r in records}
    assert by_uuid[GPUS[0].uuid].sharing == "dra" and not by_uuid[GPUS[0].uuid].serves_whole
    assert by_uuid[GPUS[1].uuid].sharing == "whole"
    text = nodestate.encode(nodestate.NodeGpuState(node="node-a", updated=1.0, generation=1, gpus=records))
    decoded = nodestate.decode(text, node="node-a")
    assert [g.sharing for g in decoded.gpus] == ["dra", "whole", "whole"]
    # a whole-GPU placement on the node never takes the DRA GPU
    gpu = placement.GpuState("GPU-1", 0, "T4", 1000, 0, 0, None, sharing=Sharing.DRA)
    assert not placement.fit.takes_whole(gpu) and not placement.fit.serves_whole(gpu)
