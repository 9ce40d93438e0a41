"""The inventory: physical GPUs plus the configuration give the resources and device IDs a node advertises.

The first half builds GPUs by hand (gpunode.node.devices.base.Gpu / MigDevice) so each rule is seen on
the smallest node that shows it; the second half runs the same rules over the bundled simulated
nodes, whose layouts are counted here from their profile files.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.config.agent import Config, load, parse_config, read_config_file
from gpunode.contract.names import Sharing
from gpunode.errors import ConfigError
from gpunode.node.devices.base import Gpu, MigDevice
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import AdvertisedDevice, Inventory, build_inventory, region_key

GIB = 2**30
MIB = 2**20
WHOLE, FRACTIONAL, TIME_SLICED, MIG = Sharing.WHOLE, Sharing.FRACTIONAL, Sharing.TIME_SLICED, Sharing.MIG
EXAMPLES = Path(__file__).resolve().parents[2] / "gpunode" / "examples"
MIG_MEMORY = {"1g.10gb": 9856 * MIB, "2g.20gb": 19968 * MIB, "3g.40gb": 40192 * MIB, "7g.80gb": 80 * GIB}


def gpu(index: int, *, mig: Sequence[str] | None = None, memory: int = 80 * GIB, numa: int | None = 0) -> Gpu:
    """A hand-built GPU; `mig` lists its MIG devices' profiles (None: MIG disabled, []: enabled, empty)."""
    uuid = f"GPU-{index:08x}-0000-4000-8000-00000000a100"
    migs = tuple(
        MigDevice(
            uuid=f"MIG-{index:04x}{m:04x}-0000-4000-8000-00000000a100",
            parent_uuid=uuid,
            index=m,
            profile=profile,
            gi_id=m + 1,
            ci_id=0,
            slices=int(profile[0]),
            memory_total_bytes=MIG_MEMORY[profile],
        )
        for m, profile in enumerate(mig or ())
    )
    return Gpu(
        index=index,
        uuid=uuid,
        model="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=memory,
        pci_bus_id=f"00000000:{0x07 + 8 * index:02X}:00.0",
        numa_node=numa,
        minor=index,
        mig_enabled=mig is not None,
        mig_devices=migs,
    )


def config(text: str = "") -> Config:
    return parse_config(yaml.safe_load(text) or {}, "node.yaml")


def ids(inv: Inventory, resource: str) -> list[str]:
    return [d.id for d in inv.by_resource(resource)]


def counts(inv: Inventory) -> dict[str, int]:
    return dict(Counter(d.resource for d in inv.devices))


def assert_well_formed(inv: Inventory) -> None:
    """What holds for every inventory: unique IDs, a reason for each device, IDs that name their GPU."""
    assert len({d.id for d in inv.devices}) == len(inv.devices)
    by_uuid = {g.uuid: g for g in inv.gpus}
    for d in inv.devices:
        assert d.reason.strip(), d
        assert d.gpu_uuid in by_uuid
        parent = by_uuid[d.gpu_uuid]
        assert d.id.startswith(d.mig_uuid or d.gpu_uuid)
        assert d.numa_node == parent.numa_node
        if d.mig_uuid is not None:
            assert parent.mig_by_uuid(d.mig_uuid) is not None
        assert inv.by_id(d.id) is d
    assert [u for u, _ in inv.modes] == [g.uuid for g in inv.gpus]


G0, G1, G2 = gpu(0), gpu(1), gpu(2, numa=1)
M0 = gpu(0, mig=["3g.40gb", "2g.20gb", "1g.10gb"])
M1 = gpu(1, mig=["1g.10gb"] * 7)
S0, S1 = gpu(0, mig=["1g.10gb"] * 2), gpu(1, mig=["1g.10gb"] * 3)


# --- whole GPUs and MIG -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "text", "expected", "modes"),
    [
        pytest.param(
            [G0, G1, G2],
            "",
            {"nvidia.com/gpu": [G0.uuid, G1.uuid, G2.uuid]},
            [WHOLE] * 3,
            id="whole-gpus-by-uuid",
        ),
        pytest.param(
            [G0, G1],
            "flags: {plugin: {deviceIDStrategy: index}}",
            {"nvidia.com/gpu": [G0.uuid, G1.uuid]},
            [WHOLE] * 2,
            id="index-strategy-keeps-uuid-ids",
        ),
        pytest.param(
            [S0, S1],
            "flags: {migStrategy: single}",
            {"nvidia.com/gpu": [m.uuid for m in S0.mig_devices + S1.mig_devices]},
            [MIG] * 2,
            id="mig-single",
        ),
        pytest.param(
            [M0, M1, G2],
            "flags: {migStrategy: mixed}",
            {
                "nvidia.com/mig-3g.40gb": [M0.mig_devices[0].uuid],
                "nvidia.com/mig-2g.20gb": [M0.mig_devices[1].uuid],
                "nvidia.com/mig-1g.10gb": [M0.mig_devices[2].uuid] + [m.uuid for m in M1.mig_devices],
                "nvidia.com/gpu": [G2.uuid],
            },
            [MIG, MIG, WHOLE],
            id="mig-mixed-with-a-whole-gpu",
        ),
        pytest.param(
            [M0, M1],
            "flags: {migStrategy: none}",
            {"nvidia.com/gpu": [M0.uuid, M1.uuid]},
            [WHOLE] * 2,
            id="mig-none-advertises-mig-gpus-whole",
        ),
        pytest.param(
            [G0, G1],
            "flags: {migStrategy: single}",
            {"nvidia.com/gpu": [G0.uuid, G1.uuid]},
            [WHOLE] * 2,
            id="mig-single-without-mig-gpus",
        ),
        pytest.param(
            [gpu(0, mig=[]), G1],
            "flags: {migStrategy: mixed}",
            {"nvidia.com/gpu": [G1.uuid]},
            [MIG, WHOLE],
            id="mig-enabled-but-empty",
        ),
    ],
)
def test_whole_and_mig(gpus: list[Gpu], text: str, expected: dict[str, list[str]], modes: list[str]) -> None:
    inv = build_inventory(gpus, config(text))
    assert {r: ids(inv, r) for r in inv.resources()} == expected
    assert [m for _, m in inv.modes] == modes
    for d in inv.devices:
        assert d.memory_cap_bytes is None
        assert d.kind == ("mig" if d.mig_uuid else "gpu")
        assert d.target_uuid == (d.mig_uuid or d.gpu_uuid)
    assert_well_formed(inv)


@pytest.mark.parametrize(
    ("gpus", "text", "warning"),
    [
        pytest.param(
            [M0, G1],
            "flags: {migStrategy: none}",
            "GPU(s) 0 have MIG enabled and are advertised whole",
            id="none",
        ),
        pytest.param(
            [G0],
            "flags: {migStrategy: single}",
            "no GPU has MIG enabled, GPUs are advertised whole",
            id="single",
        ),
        pytest.param(
            [gpu(0, mig=[])], "flags: {migStrategy: mixed}", "has MIG enabled but no MIG devices", id="empty"
        ),
    ],
)
def test_mig_warnings(gpus: list[Gpu], text: str, warning: str) -> None:
    inv = build_inventory(gpus, config(text))
    assert any(warning in w for w in inv.warnings), inv.warnings


def test_whole_gpu_reason_says_which_gpu_and_why() -> None:
    inv = build_inventory([G0, M1], config("flags: {migStrategy: none}"))
    assert [d.reason for d in inv.devices] == ["whole GPU 0", "whole GPU 1 (MIG enabled, migStrategy none)"]


@pytest.mark.parametrize(
    ("gpus", "fragments"),
    [
        pytest.param(
            [S0, G1],
            ["single needs MIG enabled on every GPU", "GPU(s) 1 have MIG disabled"],
            id="non-mig-gpu",
        ),
        pytest.param(
            [M0, M1], ["single needs one MIG profile", "1g.10gb, 2g.20gb, 3g.40gb"], id="mixed-profiles"
        ),
    ],
)
def test_mig_single_that_the_gpus_cannot_satisfy(gpus: list[Gpu], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        build_inventory(gpus, config("flags: {migStrategy: single}"))
    assert str(info.value).startswith("node.yaml: flags.migStrategy: single needs")
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "migStrategy: mixed" in info.value.hint


@pytest.mark.parametrize(
    ("environ", "overrides", "origin"),
    [
        pytest.param(
            {"MIG_STRATEGY": "single"}, {}, "environment variable MIG_STRATEGY", id="nvidia-variable"
        ),
        pytest.param({}, {"mig_strategy": "single"}, "command line --mig-strategy", id="flag"),
    ],
)
def test_mig_strategy_error_names_where_it_was_set(
    environ: dict[str, str], overrides: dict[str, Any], origin: str
) -> None:
    cfg = load(environ=environ, overrides=overrides)
    with pytest.raises(ConfigError, match=f"^{origin}: single needs MIG enabled on every GPU"):
        build_inventory([S0, G1], cfg)


# --- time-slicing -------------------------------------------------------------------------------


def ts(resources: str, head: str = "") -> str:
    """A time-slicing document: `resources` is the flow-style list body, `head` other timeSlicing keys."""
    return f"sharing: {{timeSlicing: {{{head} resources: [{resources}]}}}}"


def replicas(g: Gpu | MigDevice, n: int) -> list[str]:
    return [f"{g.uuid}::{i}" for i in range(n)]


@pytest.mark.parametrize(
    ("gpus", "text", "expected", "modes"),
    [
        pytest.param(
            [G0, G1],
            ts("{name: nvidia.com/gpu, replicas: 4}"),
            {"nvidia.com/gpu": replicas(G0, 4) + replicas(G1, 4)},
            [TIME_SLICED] * 2,
            id="all-gpus",
        ),
        pytest.param(
            [G0, G1],
            ts("{name: nvidia.com/gpu, replicas: 2}", head="renameByDefault: true,"),
            {"nvidia.com/gpu.shared": replicas(G0, 2) + replicas(G1, 2)},
            [TIME_SLICED] * 2,
            id="rename-by-default",
        ),
        pytest.param(
            [G0],
            ts(
                "{name: nvidia.com/gpu, replicas: 3, rename: example.com/slice}",
                head="renameByDefault: true,",
            ),
            {"example.com/slice": replicas(G0, 3)},
            [TIME_SLICED],
            id="rename-wins-over-rename-by-default",
        ),
        pytest.param(
            [G0, G1, G2],
            ts("{name: nvidia.com/gpu, replicas: 4, devices: [1]}", head="renameByDefault: true,"),
            {"nvidia.com/gpu": [G0.uuid, G2.uuid], "nvidia.com/gpu.shared": replicas(G1, 4)},
            [WHOLE, TIME_SLICED, WHOLE],
            id="selector-by-index",
        ),
        pytest.param(
            [G0, G1, G2],
            ts(
                f"{{name: nvidia.com/gpu, replicas: 2, devices: [{G2.uuid}, 0]}}",
                head="renameByDefault: true,",
            ),
            {"nvidia.com/gpu.shared": replicas(G0, 2) + replicas(G2, 2), "nvidia.com/gpu": [G1.uuid]},
            [TIME_SLICED, WHOLE, TIME_SLICED],
            id="selector-by-uuid-and-index",
        ),
        pytest.param(
            [M0, M1],
            "flags: {migStrategy: mixed}\n" + ts("{name: nvidia.com/mig-1g.10gb, replicas: 2}"),
            {
                "nvidia.com/mig-3g.40gb": [M0.mig_devices[0].uuid],
                "nvidia.com/mig-2g.20gb": [M0.mig_devices[1].uuid],
                "nvidia.com/mig-1g.10gb": [
                    i for m in (M0.mig_devices[2], *M1.mig_devices) for i in replicas(m, 2)
                ],
            },
            [MIG, MIG],
            id="mig-profile-time-sliced",
        ),
        pytest.param(
            [M0, M1],
            "flags: {migStrategy: mixed}\n"
            + ts(
                "{name: nvidia.com/mig-1g.10gb, replicas: 2, devices: ['1:3']}", head="renameByDefault: true,"
            ),
            {
                "nvidia.com/mig-3g.40gb": [M0.mig_devices[0].uuid],
                "nvidia.com/mig-2g.20gb": [M0.mig_devices[1].uuid],
                "nvidia.com/mig-1g.10gb": [M0.mig_devices[2].uuid]
                + [m.uuid for i, m in enumerate(M1.mig_devices) if i != 3],
                "nvidia.com/mig-1g.10gb.shared": replicas(M1.mig_devices[3], 2),
            },
            [MIG, MIG],
            id="mig-selector-by-mig-index",
        ),
        pytest.param(
            [M0, M1],
            "flags: {migStrategy: mixed}\n"
            + ts(
                f"{{name: mig-1g.10gb, replicas: 3, rename: mig-small, devices: [{M0.mig_devices[2].uuid}]}}"
            ),
            {
                "nvidia.com/mig-3g.40gb": [M0.mig_devices[0].uuid],
                "nvidia.com/mig-2g.20gb": [M0.mig_devices[1].uuid],
                "nvidia.com/mig-small": replicas(M0.mig_devices[2], 3),
                "nvidia.com/mig-1g.10gb": [m.uuid for m in M1.mig_devices],
            },
            [MIG, MIG],
            id="mig-selector-by-mig-uuid",
        ),
        pytest.param(
            [S0, S1],
            "flags: {migStrategy: single}\n" + ts("{name: nvidia.com/gpu, replicas: 2, devices: [1]}"),
            {
                "nvidia.com/gpu": [m.uuid for m in S0.mig_devices]
                + [i for m in S1.mig_devices for i in replicas(m, 2)]
            },
            [MIG, MIG],
            id="mig-single-replicas-through-parent-index",
        ),
    ],
)
def test_time_slicing(gpus: list[Gpu], text: str, expected: dict[str, list[str]], modes: list[str]) -> None:
    inv = build_inventory(gpus, config(text))
    assert {r: ids(inv, r) for r in inv.resources()} == expected
    assert [m for _, m in inv.modes] == modes
    for d in inv.devices:
        if "::" in d.id:
            assert d.kind == "replica"
            assert "time-sliced into" in d.reason
            assert d.id.rsplit("::", 1)[0] == d.target_uuid
    assert_well_formed(inv)


def test_whole_and_time_sliced_under_one_name_warns() -> None:
    inv = build_inventory([G0, G1], config(ts("{name: nvidia.com/gpu, replicas: 2, devices: [0]}")))
    assert ids(inv, "nvidia.com/gpu") == [*replicas(G0, 2), G1.uuid]
    assert any("renameByDefault" in w for w in inv.warnings), inv.warnings


@pytest.mark.parametrize(
    ("gpus", "own", "caps"),
    [
        pytest.param([G0], "replicaMemoryCap: none", [None] * 4, id="none"),
        pytest.param([G0], "", [None] * 4, id="default-is-uncapped"),
        pytest.param([G0], "replicaMemoryCap: equal", [20 * GIB] * 4, id="equal"),
        pytest.param(
            [gpu(0, memory=15360 * MIB)], "replicaMemoryCap: equal", [3840 * MIB] * 4, id="equal-t4"
        ),
        pytest.param([G0], "replicaMemoryCap: 10Gi", [10 * GIB] * 4, id="size"),
        pytest.param([G0], "replicaMemoryCap: 100Gi", [80 * GIB] * 4, id="size-clamped-to-the-gpu"),
    ],
)
def test_replica_memory_caps(gpus: list[Gpu], own: str, caps: list[int | None]) -> None:
    text = ts("{name: nvidia.com/gpu, replicas: 4}") + (f"\ngpunode: {{{own}}}" if own else "")
    inv = build_inventory(gpus, config(text))
    assert [d.memory_cap_bytes for d in inv.devices] == caps
    if caps[0] is not None:
        assert f"each capped at {caps[0] / GIB:.1f} GiB" in inv.devices[0].reason


def test_equal_cap_of_a_mig_replica_uses_the_mig_device_memory() -> None:
    text = "flags: {migStrategy: mixed}\n" + ts("{name: nvidia.com/mig-1g.10gb, replicas: 2}")
    inv = build_inventory([M1], config(text + "\ngpunode: {replicaMemoryCap: equal}"))
    assert {d.memory_cap_bytes for d in inv.devices} == {MIG_MEMORY["1g.10gb"] // 2}


# --- fractional ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "fractional", "expected_units", "unit_bytes"),
    [
        pytest.param([G0], "{devices: all}", {G0.uuid: 80}, GIB, id="a100-in-1gi-units"),
        pytest.param(
            [gpu(0, memory=15360 * MIB)],
            "{devices: all, unit: 4Gi}",
            {gpu(0).uuid: 3},
            4 * GIB,
            id="remainder-dropped",
        ),
        pytest.param(
            [G0, G1, G2], "{devices: [1], unit: 10Gi}", {G1.uuid: 8}, 10 * GIB, id="one-gpu-of-three"
        ),
        pytest.param(
            [G0, G1], f"{{devices: [{G0.uuid}], unit: 512Mi}}", {G0.uuid: 160}, 512 * MIB, id="by-uuid"
        ),
    ],
)
def test_fractional_units(
    gpus: list[Gpu], fractional: str, expected_units: dict[str, int], unit_bytes: int
) -> None:
    inv = build_inventory(gpus, config(f"gpunode: {{fractional: {fractional}}}"))
    memory = inv.by_resource("gpunode.io/gpu-memory")
    assert dict(Counter(d.gpu_uuid for d in memory)) == expected_units
    for uuid, n in expected_units.items():
        assert [d.id for d in memory if d.gpu_uuid == uuid] == [f"{uuid}::mem{i}" for i in range(n)]
        assert inv.mode_of(uuid) == FRACTIONAL
    assert {d.memory_cap_bytes for d in memory} == {unit_bytes}
    assert {d.kind for d in memory} == {"memory"}
    whole = [g.uuid for g in gpus if g.uuid not in expected_units]
    assert ids(inv, "nvidia.com/gpu") == whole
    assert_well_formed(inv)


def test_fractional_resource_name_is_configurable() -> None:
    inv = build_inventory(
        [G0], config("gpunode: {fractional: {devices: all, unit: 40Gi, resourceName: example.com/vram}}")
    )
    assert ids(inv, "example.com/vram") == [f"{G0.uuid}::mem0", f"{G0.uuid}::mem1"]


# --- configuration that does not fit these GPUs --------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "text", "fragments"),
    [
        pytest.param(
            [G0, G1],
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2, devices: [0]}]}}\n"
            "gpunode: {fractional: {devices: [0, 1]}}",
            ["GPU 0", "selected by gpunode.fractional.devices and uses time-slicing", "one sharing mode"],
            id="fractional-and-time-sliced",
        ),
        pytest.param(
            [G0, G1],
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n"
            "gpunode: {fractional: {devices: [1]}}",
            ["GPU 1", "uses time-slicing"],
            id="fractional-and-time-slice-all",
        ),
        pytest.param(
            [M0, G1],
            "flags: {migStrategy: mixed}\ngpunode: {fractional: {devices: [0]}}",
            ["GPU 0", "uses MIG"],
            id="fractional-on-mig",
        ),
        pytest.param(
            [M0, G1],
            "flags: {migStrategy: none}\ngpunode: {fractional: {devices: [0]}}",
            ["GPU 0", "uses MIG"],
            id="fractional-on-mig-enabled-strategy-none",
        ),
        pytest.param(
            [G0, G1],
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2, devices: [0, 5]}]}}",
            [
                "node.yaml: sharing.timeSlicing.resources[0].devices: there is no GPU with index 5",
                "indexes: 0, 1",
            ],
            id="selector-missing-index",
        ),
        pytest.param(
            [G0],
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2, devices: [GPU-0bad0bad-0000-4000-8000-000000000000]}]}}",
            [
                "sharing.timeSlicing.resources[0].devices: there is no GPU or MIG device GPU-0bad0bad-0000-4000-8000-000000000000"
            ],
            id="selector-missing-uuid",
        ),
        pytest.param(
            [M0],
            "flags: {migStrategy: mixed}\n"
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/mig-1g.10gb, replicas: 2, devices: ['0:7']}]}}",
            ["sharing.timeSlicing.resources[0].devices: there is no MIG device 0:7"],
            id="selector-missing-mig-index",
        ),
        pytest.param(
            [G0],
            "gpunode: {fractional: {devices: [3]}}",
            ["node.yaml: gpunode.fractional.devices: there is no GPU with index 3"],
            id="fractional-selector-missing-index",
        ),
        pytest.param(
            [M0, G1],
            "flags: {migStrategy: mixed}\n"
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2, devices: [0]}]}}",
            [
                "sharing.timeSlicing.resources[0].devices: the selector (index 0) matches no GPU that can use it"
            ],
            id="whole-gpu-selector-on-a-mig-gpu",
        ),
        pytest.param(
            [M0, G1],
            "flags: {migStrategy: mixed}\n"
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/mig-1g.10gb, replicas: 2, devices: [1]}]}}",
            ["the selector (index 1) matches no GPU that can use it"],
            id="mig-selector-on-a-gpu-without-that-profile",
        ),
        pytest.param(
            [gpu(0, memory=15360 * MIB)],
            "gpunode: {fractional: {devices: all, unit: 16Gi}}",
            ["gpunode.fractional.unit: 17179869184 bytes is more than the 16106127360 bytes of GPU 0"],
            id="unit-larger-than-the-gpu",
        ),
    ],
)
def test_configuration_that_does_not_fit(gpus: list[Gpu], text: str, fragments: list[str]) -> None:
    cfg = config(text)
    with pytest.raises(ConfigError) as info:
        build_inventory(gpus, cfg)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert str(info.value).startswith("node.yaml: ")
    # On rediscovery the same problems are warnings, and the node keeps advertising what it can.
    inv = build_inventory(gpus, cfg, strict=False)
    assert any(fragments[-1] in w for w in inv.warnings), inv.warnings
    assert_well_formed(inv)


def test_rediscovery_after_a_selected_gpu_vanished_keeps_the_others() -> None:
    cfg = config(ts("{name: nvidia.com/gpu, replicas: 2, devices: [2]}", head="renameByDefault: true,"))
    before = build_inventory([G0, G1, G2], cfg)
    assert ids(before, "nvidia.com/gpu.shared") == replicas(G2, 2)
    after = build_inventory([G0, G1], cfg, strict=False)
    assert ids(after, "nvidia.com/gpu") == [G0.uuid, G1.uuid]
    assert after.warnings == (
        "node.yaml: sharing.timeSlicing.resources[0].devices: there is no GPU with index 2 on this node "
        "(indexes: 0, 1)",
        "node.yaml: sharing.timeSlicing.resources[0].devices: the selector (index 2) matches no GPU that can use it",
    )


# --- lookups and the region key -----------------------------------------------------------------


def test_lookups() -> None:
    inv = build_inventory([M0, G1], config("flags: {migStrategy: mixed}"))
    assert inv.resources() == (
        "nvidia.com/mig-3g.40gb",
        "nvidia.com/mig-2g.20gb",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/gpu",
    )
    assert inv.gpu(G1.uuid) == G1 and inv.gpu("GPU-missing") is None
    assert (
        inv.mode_of(M0.uuid) == MIG and inv.mode_of(G1.uuid) == WHOLE and inv.mode_of("GPU-missing") is None
    )
    assert inv.by_id("GPU-missing") is None
    mig = inv.by_id(M0.mig_devices[1].uuid)
    assert isinstance(mig, AdvertisedDevice)
    assert (mig.resource, mig.kind, mig.gpu_uuid, mig.target_uuid) == (
        "nvidia.com/mig-2g.20gb",
        "mig",
        M0.uuid,
        M0.mig_devices[1].uuid,
    )
    assert mig.reason == "MIG 2g.20gb (GI 2, CI 0) on GPU 0, migStrategy mixed"


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        pytest.param(["x::0", "y::1"], ["y::1", "x::0"], True, id="order"),
        pytest.param(["x::0", "x::0", "y::1"], ["y::1", "x::0"], True, id="duplicates"),
        pytest.param(["x::0"], ["x::1"], False, id="different-ids"),
        pytest.param(["x::0", "y::1"], ["x::0"], False, id="subset"),
    ],
)
def test_region_key(a: list[str], b: list[str], same: bool) -> None:
    ka, kb = region_key(a), region_key(b)
    assert len(ka) == 20 and all(c in "0123456789abcdef" for c in ka)
    assert (ka == kb) is same


# --- the bundled simulated nodes ----------------------------------------------------------------


def sim_gpus(profile: str) -> tuple[Gpu, ...]:
    backend = SimBackend.from_profile(profile)
    try:
        return backend.gpus()
    finally:
        backend.close()


# a100-mig, from its profile: GPUs 0-1 in 7x 1g.10gb; 2: 3g+2g+1g+1g; 3: 3g+2g+1g; 4: 2x 3g;
# 5: 4g+2g+1g; 6: 3x 2g + 1g; 7: MIG disabled.
A100_MIXED = {
    "nvidia.com/mig-1g.10gb": 19,
    "nvidia.com/mig-2g.20gb": 6,
    "nvidia.com/mig-3g.40gb": 4,
    "nvidia.com/mig-4g.40gb": 1,
    "nvidia.com/gpu": 1,
}


@pytest.mark.parametrize(
    ("profile", "text", "expected"),
    [
        pytest.param("dgx-h100", "", {"nvidia.com/gpu": 8}, id="dgx-h100-whole"),
        pytest.param("t4", "", {"nvidia.com/gpu": 4}, id="t4-whole"),
        pytest.param("a100-mig", "flags: {migStrategy: none}", {"nvidia.com/gpu": 8}, id="a100-mig-none"),
        pytest.param("a100-mig", "flags: {migStrategy: mixed}", A100_MIXED, id="a100-mig-mixed"),
        pytest.param(
            "h100-mig", "flags: {migStrategy: single}", {"nvidia.com/gpu": 56}, id="h100-mig-single"
        ),
        pytest.param(
            "h100-mig", "flags: {migStrategy: mixed}", {"nvidia.com/mig-1g.10gb": 56}, id="h100-mig-mixed"
        ),
        pytest.param(
            "dgx-h100",
            ts("{name: nvidia.com/gpu, replicas: 10}", head="renameByDefault: true,"),
            {"nvidia.com/gpu.shared": 80},
            id="dgx-h100-ten-replicas",
        ),
        pytest.param(
            "t4",
            ts("{name: nvidia.com/gpu, replicas: 4, devices: [0, 1]}", head="renameByDefault: true,")
            + "\ngpunode: {fractional: {devices: [3], unit: 1Gi}}",
            {"nvidia.com/gpu.shared": 8, "nvidia.com/gpu": 1, "gpunode.io/gpu-memory": 15},
            id="t4-three-modes",
        ),
        pytest.param(
            "a100-mig",
            "flags: {migStrategy: mixed}\n"
            + ts(
                "{name: nvidia.com/mig-1g.10gb, replicas: 2, devices: [0, 1]}", head="renameByDefault: true,"
            ),
            {**A100_MIXED, "nvidia.com/mig-1g.10gb": 5, "nvidia.com/mig-1g.10gb.shared": 28},
            id="a100-mig-mixed-time-sliced-on-two-gpus",
        ),
    ],
)
def test_bundled_profile(profile: str, text: str, expected: dict[str, int]) -> None:
    gpus = sim_gpus(profile)
    inv = build_inventory(gpus, config(text))
    assert counts(inv) == expected
    assert_well_formed(inv)


def test_bundled_mixed_mig_profile_refuses_mig_single() -> None:
    with pytest.raises(ConfigError, match=r"flags\.migStrategy: single needs MIG enabled on every GPU"):
        build_inventory(sim_gpus("a100-mig"), config("flags: {migStrategy: single}"))


@pytest.mark.parametrize(
    ("example", "profile", "expected"),
    [
        pytest.param("config-whole.yaml", "dgx-h100", {"nvidia.com/gpu": 8}, id="whole-on-dgx-h100"),
        pytest.param(
            "config-timeslicing.yaml",
            "t4",
            {"nvidia.com/gpu.shared": 8, "nvidia.com/gpu": 2},
            id="timeslicing-on-t4",
        ),
        pytest.param(
            "config-mig-mixed.yaml",
            "a100-mig",
            {**A100_MIXED, "nvidia.com/mig-1g.10gb": 0, "nvidia.com/mig-1g.10gb.shared": 38},
            id="mig-mixed-on-a100-mig",
        ),
        pytest.param(
            "config-mig-mixed.yaml",
            "h100-mig",
            {"nvidia.com/mig-1g.10gb.shared": 112},
            id="mig-mixed-on-h100-mig",
        ),
        pytest.param("config-fractional.yaml", "t4", {"gpunode.io/gpu-memory": 60}, id="fractional-on-t4"),
        pytest.param(
            "config-fractional.yaml",
            "dgx-h100",
            {"gpunode.io/gpu-memory": 8 * 79},
            id="fractional-on-dgx-h100",
        ),
    ],
)
def test_bundled_example_on_its_profile(example: str, profile: str, expected: dict[str, int]) -> None:
    cfg = read_config_file(EXAMPLES / example)
    inv = build_inventory(sim_gpus(profile), cfg)
    assert counts(inv) == {k: v for k, v in expected.items() if v}
    assert not inv.warnings
    assert_well_formed(inv)
