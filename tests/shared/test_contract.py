"""The contract between node and cluster: names, sharing modes, device-ID and bus-ID formats, the strict reader."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import yaml

from gpunode import placement
from gpunode.config.agent import parse_config
from gpunode.contract import names
from gpunode.contract.deviceids import (
    DeviceId,
    memory_unit_id,
    normalize_pci_bus_id,
    parse_device_id,
    replica_id,
)
from gpunode.contract.names import SHARING_MODES, Sharing
from gpunode.contract.nodestate import load_schema
from gpunode.contract.reader import SectionReader
from gpunode.errors import ConfigError, InvalidState, NodeStateError
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import build_inventory

UUID = "GPU-0f6a7e4c-3c1d-4b8e-9a51-5d2c8e7f1a00"
MIG = "MIG-4d1e9b2a-77c0-5f3e-8d6b-1c2a3b4c5d6e"

# -- device IDs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed", "kind"),
    [
        pytest.param(UUID, DeviceId(UUID), "gpu", id="whole-gpu"),
        pytest.param(MIG, DeviceId(MIG), "mig", id="mig-device"),
        pytest.param(f"{UUID}::0", DeviceId(UUID, replica=0), "replica", id="replica-0"),
        pytest.param(f"{MIG}::13", DeviceId(MIG, replica=13), "replica", id="mig-replica"),
        pytest.param(f"{UUID}::mem0", DeviceId(UUID, memory_unit=0), "memory", id="unit-0"),
        pytest.param(f"{UUID}::mem79", DeviceId(UUID, memory_unit=79), "memory", id="unit-79"),
    ],
)
def test_device_ids_parse_and_format_back(text: str, parsed: DeviceId, kind: str) -> None:
    assert parse_device_id(text) == parsed
    assert str(parsed) == text
    assert parsed.kind == kind


def test_the_formatters_write_what_the_parser_reads() -> None:
    for n in (0, 1, 9, 10, 127):
        assert parse_device_id(replica_id(UUID, n)) == DeviceId(UUID, replica=n)
        assert parse_device_id(memory_unit_id(UUID, n)) == DeviceId(UUID, memory_unit=n)
    assert replica_id(UUID, 3) == f"{UUID}::3"
    assert memory_unit_id(UUID, 3) == f"{UUID}::mem3"
    # Units sort by number, not as text: mem2 before mem10.
    ids = [memory_unit_id(UUID, n) for n in (10, 2, 1)]
    assert sorted(ids, key=lambda i: parse_device_id(i).memory_unit or 0) == [
        memory_unit_id(UUID, n) for n in (1, 2, 10)
    ]


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("::0", id="no-uuid"),
        pytest.param(f"{UUID}::", id="no-number"),
        pytest.param(f"{UUID}::mem", id="no-unit-number"),
        pytest.param(f"{UUID}::-1", id="negative"),
        pytest.param(f"{UUID}::+1", id="signed"),
        pytest.param(f"{UUID}::01", id="leading-zero"),
        pytest.param(f"{UUID}::mem007", id="unit-leading-zero"),
        pytest.param(f"{UUID}::x1", id="unknown-tag"),
        pytest.param(f"{UUID}::1::2", id="two-separators"),
        pytest.param(f"{UUID}::mem1::0", id="unit-of-a-replica"),
        pytest.param(f" {UUID}", id="space"),
    ],
)
def test_device_ids_that_no_formatter_writes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"^device ID .*: expected <uuid>, <uuid>::<n> or <uuid>::mem<n>"):
        parse_device_id(text)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(lambda: replica_id(UUID, -1), "integer >= 0", id="negative-replica"),
        pytest.param(lambda: memory_unit_id(UUID, True), "integer >= 0", id="bool-unit"),
        pytest.param(lambda: replica_id("", 0), "non-empty", id="empty-base"),
        pytest.param(lambda: replica_id(f"{UUID}::0", 1), "non-empty", id="base-with-separator"),
        pytest.param(lambda: DeviceId(UUID, replica=0, memory_unit=0), "not both", id="both"),
    ],
)
def test_formatting_refuses_what_it_could_not_read_back(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# -- PCI bus IDs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("0000:3b:00.0", "00000000:3B:00.0"),
        ("00000000:18:00.0", "00000000:18:00.0"),
        ("0001:af:1f.7", "00000001:AF:1F.7"),
        ("  00000000:18:00.0\n", "00000000:18:00.0"),
        ("10000:e1:00.0", "00010000:E1:00.0"),  # a 5-digit domain, as behind an Intel VMD bridge
    ],
)
def test_bus_ids_take_nvml_form(raw: str, normal: str) -> None:
    assert normalize_pci_bus_id(raw) == normal
    assert normalize_pci_bus_id(normal) == normal


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "18:00.0",
        "000:18:00.0",
        "000000000:18:00.0",
        "0000:18:00.8",
        "0000:1g:00.0",
        "0000:18:00",
        "GPU-1",
    ],
)
def test_what_is_not_a_bus_id_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match=r"is not a PCI bus ID such as 00000000:18:00\.0"):
        normalize_pci_bus_id(raw)


# -- names and sharing modes -------------------------------------------------------------------------


def test_resource_and_annotation_names() -> None:
    assert names.GPU_RESOURCE == "nvidia.com/gpu"
    assert names.GPU_MEMORY_RESOURCE == "gpunode.io/gpu-memory"
    assert names.NODE_STATE_ANNOTATION == "gpunode.io/gpu-state"
    assert names.ASSIGNMENT_ANNOTATION == "gpunode.io/gpu-assigned"
    assert names.mig_resource_name("1g.10gb") == "nvidia.com/mig-1g.10gb"
    assert names.mig_profile_of("nvidia.com/mig-1g.10gb") == "1g.10gb"
    assert names.mig_profile_of("nvidia.com/gpu") is None
    assert names.mig_profile_of("nvidia.com/mig-") is None
    assert names.shared_resource_default("nvidia.com/gpu") == "nvidia.com/gpu.shared"
    assert (names.MIB, names.GIB, names.MILLI_PER_GPU) == (2**20, 2**30, 1000)


def test_one_set_of_sharing_modes_for_node_placement_and_schema() -> None:
    assert SHARING_MODES == ("whole", "fractional", "time-sliced", "mig", "dra")
    assert placement.Sharing is Sharing and placement.SHARING_MODES == SHARING_MODES
    schema = load_schema()
    assert tuple(schema["$defs"]["gpu"]["properties"]["sharing"]["enum"]) == SHARING_MODES
    assert Sharing.TIME_SLICED == "time-sliced" and f"{Sharing.MIG}" == "mig"
    # A mode compares equal to its published name, so placement's string checks keep working.
    for mode in SHARING_MODES:
        gpu = placement.GpuState("GPU-1", 0, "T4", 1000, 0, 0, None, sharing=Sharing(mode))
        assert gpu.sharing is Sharing(mode) and gpu.sharing == mode
    named = placement.GpuState("GPU-1", 0, "T4", 1000, 0, 0, None, sharing="time-sliced")
    assert named.sharing is Sharing.TIME_SLICED  # a name given as text is read into the enum
    with pytest.raises(InvalidState, match="sharing must be one of whole, fractional"):
        placement.GpuState("GPU-1", 0, "T4", 1000, 0, 0, None, sharing="shared")


def test_the_inventory_decides_every_sharing_mode() -> None:
    """Whole, time-sliced and fractional GPUs on one node, MIG GPUs on another: all four modes."""
    text = """
flags: {migStrategy: mixed}
sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2, devices: [1]}]}}
gpunode: {fractional: {devices: [2]}}
"""
    gpus = SimBackend.from_profile("dgx-h100").gpus()[:4]
    inv = build_inventory(gpus, parse_config(yaml.safe_load(text), "node.yaml"))
    modes = [mode for _, mode in inv.modes]
    assert all(isinstance(m, Sharing) for m in modes)
    assert modes == [Sharing.WHOLE, Sharing.TIME_SLICED, Sharing.FRACTIONAL, Sharing.WHOLE]
    mig_gpus = [g for g in SimBackend.from_profile("a100-mig").gpus() if g.mig_enabled]
    mig_inv = build_inventory(mig_gpus, parse_config(yaml.safe_load("flags: {migStrategy: mixed}"), "n"))
    assert {mode for _, mode in mig_inv.modes} == {Sharing.MIG}
    # Every advertised ID reads back as the kind of device the inventory says it is, on its own target.
    for d in (*inv.devices, *mig_inv.devices):
        parsed = parse_device_id(d.id)
        assert (parsed.kind, parsed.base) == (d.kind, d.target_uuid), d


# -- the strict reader -------------------------------------------------------------------------------


def test_the_reader_raises_the_callers_error_class() -> None:
    r = SectionReader({"n": "x"}, "doc", error=NodeStateError, json_object=True)
    with pytest.raises(NodeStateError, match=r"doc\.n: expected an integer, got 'x'"):
        r.integer("n")
    with pytest.raises(NodeStateError, match=r"doc\.m: required key is missing"):
        r.size("m")
    with pytest.raises(ConfigError, match=r"cfg: expected a mapping, got list"):
        SectionReader([], "cfg")
    with pytest.raises(NodeStateError, match=r"doc: expected an object, got NoneType"):
        SectionReader(None, "doc", error=NodeStateError, json_object=True)
    assert SectionReader(None, "cfg: ").raw("x", 1) == 1  # an empty YAML section reads as empty


@pytest.mark.parametrize(
    ("method", "value", "kwargs", "message"),
    [
        pytest.param("integer", True, {}, "expected an integer, got True", id="bool-is-no-integer"),
        pytest.param("integer", 5, {"minimum": 0, "maximum": 3}, "expected 0..3, got 5", id="range"),
        pytest.param("integer", -1, {"minimum": 0}, "expected >= 0, got -1", id="minimum"),
        pytest.param("number", "soon", {"minimum": 0}, "expected a non-negative number", id="number"),
        pytest.param("number", float("nan"), {}, "expected a number, got nan", id="nan"),
        pytest.param("flag", "no", {}, "expected true or false, got 'no'", id="flag"),
        pytest.param("flag", 1, {}, "expected true or false, got 1", id="flag-int"),
        pytest.param("items", {"a": 1}, {}, "expected a list, got dict", id="items"),
        pytest.param("text_list", ["a", ""], {}, "expected a list of non-empty strings", id="text-list"),
    ],
)
def test_the_reader_names_the_key_and_what_it_expected(
    method: str, value: object, kwargs: dict[str, object], message: str
) -> None:
    r = SectionReader({"k": value}, "doc.section")
    with pytest.raises(ConfigError) as err:
        getattr(r, method)("k", **kwargs)
    assert str(err.value).startswith("doc.section.k: ")
    assert message in str(err.value)


def test_the_reader_reads_good_values_and_keeps_unknown_keys_when_asked() -> None:
    r = SectionReader({"i": 3, "f": 2, "b": False, "l": ["x"], "t": ["a", "b"], "extra": 1}, "doc")
    assert r.integer("i", minimum=0, maximum=3) == 3
    assert r.number("f", minimum=0) == 2.0
    assert r.flag("b") is False
    assert r.items("l") == ["x"]
    assert r.text_list("t") == ("a", "b")
    assert r.integer("missing", None) is None and r.text_list("none", ()) == ()
    assert r.unread() == {"extra": 1}
    assert r.where == "doc" and r.item({}, "doc.x").where == "doc.x"
    with pytest.raises(ConfigError, match="unknown key extra"):
        r.finish()
