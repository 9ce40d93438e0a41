"""The exposition a snapshot renders to: dcgm-exporter's names, types, help, units and labels, and ours."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from gpunode.config.agent import parse_config
from gpunode.node.devices.base import Gpu, GpuSample
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import Inventory, build_inventory, region_key
from gpunode.node.kubelet.podresources import AttributionSnapshot, ContainerDevices
from gpunode.node.metrics.fields import FIELDS
from gpunode.node.metrics.render import XidState, render_body
from gpunode.node.metrics.snapshot import LabelStyle, NodeSnapshot, build_snapshot

DATA = Path(__file__).resolve().parents[1] / "data"
HOST = "gpu-node-1"

# -- a strict reader of the text format, so tests see the exact names printed ---------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float
    label_order: tuple[str, ...]


@dataclass(frozen=True)
class Exposition:
    helps: dict[str, str]
    types: dict[str, str]
    samples: list[Sample]

    def named(self, name: str, **labels: str) -> list[Sample]:
        return [
            s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def one(self, name: str, **labels: str) -> Sample:
        found = self.named(name, **labels)
        assert len(found) == 1, f"expected one {name}{labels}, found {len(found)}"
        return found[0]


def parse_exposition(text: str) -> Exposition:
    """Parse Prometheus text format 0.0.4 strictly (an unparsable line fails the test)."""
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    samples: list[Sample] = []
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            helps[name] = doc
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            types[name] = typ
        elif line.startswith("#"):
            continue
        else:
            m = _SAMPLE.match(line)
            assert m, f"unparsable exposition line: {line!r}"
            body = m.group(2) or ""
            pairs = _LABEL.findall(body)
            assert ",".join(f'{k}="{v}"' for k, v in pairs) == body, f"bad labels in {line!r}"
            labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\") for k, v in pairs}
            assert len(labels) == len(pairs), f"duplicate label in {line!r}"
            samples.append(Sample(m.group(1), labels, float(m.group(3)), tuple(k for k, _ in pairs)))
    return Exposition(helps, types, samples)


# -- helpers ------------------------------------------------------------------------------------


def sample_node(profile: str) -> tuple[SimBackend, tuple[Gpu, ...], dict[str, GpuSample]]:
    backend = SimBackend.from_profile(profile)
    gpus = backend.gpus()
    return backend, gpus, {g.uuid: backend.sample(g.uuid) for g in gpus}


def snapshot_of(
    gpus: tuple[Gpu, ...],
    samples: dict[str, GpuSample],
    *,
    previous: dict[str, GpuSample] | None = None,
    inventory: Inventory | None = None,
    unhealthy: dict[str, str] | None = None,
    containers: list[ContainerDevices] | None = None,
    regions: list[tuple[str, str, int, int]] | None = None,
    hostname_label: str = "Hostname",
) -> NodeSnapshot:
    return build_snapshot(
        seq=1,
        collected_at_s=1000.0,
        gpus=gpus,
        samples=samples,
        previous_samples=previous or {},
        last_sample_times={u: s.timestamp for u, s in samples.items()},
        style=LabelStyle(HOST, hostname_label, "550.90.07"),
        inventory=inventory,
        unhealthy=unhealthy,
        attribution=AttributionSnapshot.from_containers(containers, fetched_at_s=999.0)
        if containers
        else None,
        regions=regions or [],
    )


def render(
    snapshot: NodeSnapshot, xid: XidState | None = None, hostname_label: str = "Hostname"
) -> Exposition:
    body = render_body(snapshot, xid or XidState(), hostname_label=hostname_label, hostname=HOST)
    return parse_exposition(body.decode())


def inventory_for(gpus: tuple[Gpu, ...], config: dict[str, object]) -> Inventory:
    return build_inventory(gpus, parse_config({"version": "v1", **config}, "test.yaml"))


# -- the dcgm-exporter contract -----------------------------------------------------------------


def test_field_table_matches_the_default_counter_set() -> None:
    spec = json.loads((DATA / "dcgm_default_counters.json").read_text())["fields"]
    assert [(f.name, f.prom_type, f.help, f.unit) for f in FIELDS] == [
        (s["name"], s["type"], s["help"], s["unit"]) for s in spec
    ]


def test_every_default_field_is_served_with_its_type_and_help_on_an_h100() -> None:
    backend, gpus, samples = sample_node("dgx-h100")
    later = {u: backend.sample(u) for u in samples}  # a second sample, for the NVLink rate
    out = render(snapshot_of(gpus, later, previous=samples))
    spec = json.loads((DATA / "dcgm_default_counters.json").read_text())["fields"]
    # A bare-metal H100 has no vGPU licence and no video encoder (NVENC): NVML gives no value, so no series.
    absent = {"DCGM_FI_DEV_VGPU_LICENSE_STATUS", "DCGM_FI_DEV_ENC_UTIL"}
    for s in spec:
        if s["name"] in absent:
            assert not out.named(s["name"]) and s["name"] not in out.types
            continue
        assert out.types.get(s["name"]) == s["type"], s["name"]
        assert out.helps.get(s["name"]) == s["help"], s["name"]
        assert len(out.named(s["name"])) == len(gpus), s["name"]


def test_counters_keep_dcgm_names_without_total() -> None:
    _, gpus, samples = sample_node("dgx-h100")
    out = render(snapshot_of(gpus, samples))
    for name in ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"):
        assert out.types[name] == "counter"
        assert out.named(name) and not out.named(name + "_total")


def test_labels_are_dcgm_exporters_in_its_order() -> None:
    _, gpus, samples = sample_node("dgx-h100")
    out = render(snapshot_of(gpus, samples))
    s = out.one("DCGM_FI_DEV_GPU_TEMP", gpu="3")
    g = gpus[3]
    assert s.label_order == (
        "gpu",
        "UUID",
        "pci_bus_id",
        "device",
        "modelName",
        "Hostname",
        "DCGM_FI_DRIVER_VERSION",
    )
    assert s.labels == {
        "gpu": "3",
        "UUID": g.uuid,
        "pci_bus_id": g.pci_bus_id,
        "device": "nvidia3",
        "modelName": "NVIDIA H100 80GB HBM3",
        "Hostname": HOST,
        "DCGM_FI_DRIVER_VERSION": "550.90.07",
    }


def test_newer_hostname_spelling() -> None:
    _, gpus, samples = sample_node("t4")
    out = render(snapshot_of(gpus, samples, hostname_label="hostname"), hostname_label="hostname")
    for s in out.samples:
        assert "Hostname" not in s.labels, s
    assert out.one("DCGM_FI_DEV_GPU_TEMP", gpu="0").labels["hostname"] == HOST


@dataclass(frozen=True)
class UnitCase:
    field: str
    attribute: str
    base_value: Any  # whatever type the GpuSample attribute has
    expected: str


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            UnitCase("DCGM_FI_DEV_SM_CLOCK", "sm_clock_hz", 1_980_000_000.0, "1980"), id="clock-hz-to-mhz"
        ),
        pytest.param(
            UnitCase("DCGM_FI_DEV_POWER_USAGE", "power_w", 312.5, "312.500000"), id="power-w-double"
        ),
        pytest.param(
            UnitCase("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "total_energy_j", 1234.5678, "1234568"),
            id="energy-j-to-mj",
        ),
        pytest.param(UnitCase("DCGM_FI_DEV_GPU_UTIL", "gpu_util", 0.37, "37"), id="util-ratio-to-percent"),
        pytest.param(
            UnitCase("DCGM_FI_DEV_FB_USED", "memory_used_bytes", 5 * 2**30 + 123, "5120"), id="bytes-to-mib"
        ),
        pytest.param(
            UnitCase("DCGM_FI_DEV_ROW_REMAP_FAILURE", "row_remap_failure", True, "1"), id="flag-to-int"
        ),
        pytest.param(
            UnitCase("DCGM_FI_PROF_DRAM_ACTIVE", "dram_active", 0.25, "0.250000"), id="ratio-stays-ratio"
        ),
        pytest.param(
            UnitCase("DCGM_FI_PROF_PCIE_TX_BYTES", "pcie_tx_bytes_per_s", 2.5e9, "2500000000"),
            id="pcie-bytes-per-s",
        ),
    ],
)
def test_values_are_converted_to_dcgm_units(case: UnitCase) -> None:
    _, gpus, samples = sample_node("dgx-h100")
    g = gpus[0]
    samples[g.uuid] = replace(samples[g.uuid], **{case.attribute: case.base_value})
    text = render_body(
        snapshot_of(gpus, samples), XidState(), hostname_label="Hostname", hostname=HOST
    ).decode()
    line = next(
        ln for ln in text.splitlines() if ln.startswith(case.field + "{") and f'UUID="{g.uuid}"' in ln
    )
    assert line.rsplit(" ", 1)[1] == case.expected


def test_nvlink_rate_needs_two_samples_and_is_mb_per_s() -> None:
    _, gpus, samples = sample_node("dgx-h100")
    g = gpus[0]
    first = replace(samples[g.uuid], timestamp=100.0, nvlink_bandwidth_total_bytes=10_000_000_000)
    second = replace(samples[g.uuid], timestamp=102.0, nvlink_bandwidth_total_bytes=10_500_000_000)
    out = render(snapshot_of(gpus, {g.uuid: first}))
    assert not out.named("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"), "one sample gives no rate"
    out = render(snapshot_of(gpus, {g.uuid: second}, previous={g.uuid: first}))
    assert out.one("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", UUID=g.uuid).value == pytest.approx(250.0)
    reset = replace(second, timestamp=104.0, nvlink_bandwidth_total_bytes=1_000)
    out = render(snapshot_of(gpus, {g.uuid: reset}, previous={g.uuid: second}))
    assert not out.named("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"), "a counter reset gives no rate"


def test_a_value_the_backend_cannot_read_is_absent() -> None:
    # A T4 has no GPM profiling, no NVLink, no row remapping: those series do not exist.
    _, gpus, samples = sample_node("t4")
    out = render(snapshot_of(gpus, samples))
    for name in (
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    ):
        assert not out.named(name), name
    assert len(out.named("DCGM_FI_DEV_GPU_TEMP")) == len(gpus)
    # One GPU whose power could not be read loses that series only.
    samples[gpus[1].uuid] = replace(samples[gpus[1].uuid], power_w=None)
    out = render(snapshot_of(gpus, samples))
    assert {s.labels["gpu"] for s in out.named("DCGM_FI_DEV_POWER_USAGE")} == {"0", "2", "3"}


def test_a_gpu_that_could_not_be_sampled_has_only_its_xid_series() -> None:
    _, gpus, samples = sample_node("t4")
    del samples[gpus[2].uuid]
    out = render(snapshot_of(gpus, samples))
    series = {
        s.name for s in out.samples if s.labels.get("UUID") == gpus[2].uuid and s.name.startswith("DCGM")
    }
    assert series == {"DCGM_FI_DEV_XID_ERRORS"}
    assert not out.named("gpunode_gpu_last_sample_timestamp_seconds", gpu="2")


def test_mig_instances_carry_profile_instance_id_and_their_parent() -> None:
    _, gpus, samples = sample_node("a100-mig")
    mig_gpu = next(g for g in gpus if g.mig_enabled)
    out = render(snapshot_of(gpus, samples))
    used = out.named("DCGM_FI_DEV_FB_USED", UUID=mig_gpu.uuid)
    instances = [s for s in used if "GPU_I_ID" in s.labels]
    assert len(instances) == len(mig_gpu.mig_devices)
    for s, mig in zip(instances, mig_gpu.mig_devices, strict=True):
        assert s.labels["gpu"] == str(mig_gpu.index) and s.labels["device"] == f"nvidia{mig_gpu.index}"
        assert s.labels["GPU_I_PROFILE"] == mig.profile and s.labels["GPU_I_ID"] == str(mig.gi_id)
        assert s.label_order[:7] == (
            "gpu", "UUID", "pci_bus_id", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID",
        )  # fmt: skip
    # Whole-GPU quantities stay on the parent's series only, so sums over instances do not double count.
    assert all("GPU_I_ID" not in s.labels for s in out.named("DCGM_FI_DEV_POWER_USAGE"))
    # NVML gives no utilisation for a MIG-enabled GPU: no series rather than a zero.
    assert not out.named("DCGM_FI_DEV_GPU_UTIL", UUID=mig_gpu.uuid)


def test_mig_instance_memory_is_the_instances_own() -> None:
    backend, gpus, _ = sample_node("a100-mig")
    mig_gpu = next(g for g in gpus if g.mig_enabled)
    target = mig_gpu.mig_devices[2]
    backend.add_process(mig_gpu.uuid, 4242, 3 * 2**30, mig_uuid=target.uuid)
    samples = {g.uuid: backend.sample(g.uuid) for g in gpus}
    out = render(snapshot_of(gpus, samples))
    inst = out.one("DCGM_FI_DEV_FB_USED", UUID=mig_gpu.uuid, GPU_I_ID=str(target.gi_id))
    assert inst.value == 3072
    free = out.one("DCGM_FI_DEV_FB_FREE", UUID=mig_gpu.uuid, GPU_I_ID=str(target.gi_id))
    assert free.value == (target.memory_total_bytes - 3 * 2**30) // 2**20
    other = mig_gpu.mig_devices[0]
    assert out.one("DCGM_FI_DEV_FB_USED", UUID=mig_gpu.uuid, GPU_I_ID=str(other.gi_id)).value == 0


def test_pod_labels_only_where_a_pod_holds_the_device() -> None:
    _, gpus, samples = sample_node("dgx-h100")
    inv = inventory_for(gpus, {})
    held = [ContainerDevices("ml", "trainer-0", "main", "nvidia.com/gpu", (gpus[1].uuid,))]
    out = render(snapshot_of(gpus, samples, inventory=inv, containers=held))
    s = out.one("DCGM_FI_DEV_GPU_TEMP", gpu="1")
    assert (s.labels["namespace"], s.labels["pod"], s.labels["container"]) == ("ml", "trainer-0", "main")
    assert s.label_order[-3:] == ("container", "namespace", "pod")
    for other in out.named("DCGM_FI_DEV_GPU_TEMP"):
        if other.labels["gpu"] != "1":
            assert not {"namespace", "pod", "container"} & other.labels.keys()
    for any_sample in out.samples:
        assert all(v != "" for v in any_sample.labels.values()), any_sample


def test_pod_labels_on_the_mig_instance_a_pod_holds() -> None:
    _, gpus, samples = sample_node("a100-mig")
    inv = inventory_for(gpus, {"flags": {"migStrategy": "mixed"}})
    mig_gpu = next(g for g in gpus if g.mig_enabled)
    mig = mig_gpu.mig_devices[4]
    held = [ContainerDevices("inference", "llm-7", "server", f"nvidia.com/mig-{mig.profile}", (mig.uuid,))]
    out = render(snapshot_of(gpus, samples, inventory=inv, containers=held))
    s = out.one("DCGM_FI_DEV_FB_USED", UUID=mig_gpu.uuid, GPU_I_ID=str(mig.gi_id))
    assert s.labels["pod"] == "llm-7"
    parent = out.one("DCGM_FI_DEV_POWER_USAGE", UUID=mig_gpu.uuid)
    assert "pod" not in parent.labels


def test_shared_gpu_gives_each_pod_its_own_memory_and_cap() -> None:
    _, gpus, samples = sample_node("dgx-h100")
    inv = inventory_for(gpus, {"gpunode": {"fractional": {"devices": [2]}}})
    gpu = gpus[2]
    a = ContainerDevices(
        "team-a", "notebook", "jupyter", "gpunode.io/gpu-memory", (f"{gpu.uuid}::mem0", f"{gpu.uuid}::mem1")
    )
    b = ContainerDevices(
        "team-b",
        "batch",
        "worker",
        "gpunode.io/gpu-memory",
        tuple(f"{gpu.uuid}::mem{n}" for n in range(2, 10)),
    )
    regions = [
        (region_key(a.device_ids), gpu.uuid, 1_500_000_000, 2 * 2**30),
        (region_key(b.device_ids), gpu.uuid, 6_000_000_000, 8 * 2**30),
        ("0123456789abcdef0123", gpu.uuid, 1_000, 2**30),  # a region whose pod the kubelet no longer lists
    ]
    out = render(snapshot_of(gpus, samples, inventory=inv, containers=[a, b], regions=regions))
    used_a = out.one("gpunode_container_memory_used_bytes", pod="notebook")
    used_b = out.one("gpunode_container_memory_used_bytes", pod="batch")
    assert (used_a.value, used_b.value) == (1_500_000_000, 6_000_000_000)
    assert out.one("gpunode_container_memory_limit_bytes", pod="notebook").value == 2 * 2**30
    assert out.one("gpunode_container_memory_limit_bytes", pod="batch").value == 8 * 2**30
    assert used_a.labels | {"pod": "x"} == {
        "UUID": gpu.uuid, "gpu": "2", "region": regions[0][0], "Hostname": HOST, "resource": "gpunode.io/gpu-memory",
        "namespace": "team-a", "pod": "x", "container": "jupyter",
    }  # fmt: skip
    orphan = out.one("gpunode_container_memory_used_bytes", region="0123456789abcdef0123")
    assert not {"namespace", "pod", "container"} & orphan.labels.keys()
    # The shared GPU's own DCGM series stay the GPU's, without a pod.
    assert "pod" not in out.one("DCGM_FI_DEV_FB_USED", gpu="2").labels
    assert out.types["gpunode_container_memory_used_bytes"] == "gauge"


def test_health_and_allocation_per_device_id() -> None:
    _, gpus, samples = sample_node("t4")
    inv = inventory_for(
        gpus, {"sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}
    )
    ids = [d.id for d in inv.devices]
    held = [ContainerDevices("ns", "p", "c", "nvidia.com/gpu", (ids[0],))]
    out = render(snapshot_of(gpus, samples, inventory=inv, unhealthy={ids[3]: "XID 79"}, containers=held))
    assert len(out.named("gpunode_device_healthy")) == len(ids) == 8
    assert out.one("gpunode_device_healthy", device_id=ids[3]).value == 0
    assert out.one("gpunode_device_healthy", device_id=ids[2]).value == 1
    mine = out.one("gpunode_device_allocated", device_id=ids[0])
    assert mine.value == 1 and (mine.labels["pod"], mine.labels["resource"]) == ("p", "nvidia.com/gpu")
    free = out.one("gpunode_device_allocated", device_id=ids[1])
    assert free.value == 0 and "pod" not in free.labels


def test_xid_last_code_and_counts_by_code() -> None:
    _, gpus, samples = sample_node("a100-mig")
    snap = snapshot_of(gpus, samples)
    mig_gpu = next(g for g in gpus if g.mig_enabled)
    mig = mig_gpu.mig_devices[1]
    plain = gpus[0] if not gpus[0].mig_enabled else gpus[-1]
    xid = XidState(
        last={(plain.uuid, None): 79, (mig_gpu.uuid, mig.uuid): 31, (mig_gpu.uuid, None): 31},
        counts={((plain.uuid, None), 48): 2, ((plain.uuid, None), 79): 1, ((mig_gpu.uuid, mig.uuid), 31): 1},
        unknown_device={13: 1},
    )
    out = render(snap, xid)
    assert out.one("DCGM_FI_DEV_XID_ERRORS", UUID=plain.uuid).value == 79
    assert out.one("DCGM_FI_DEV_XID_ERRORS", UUID=mig_gpu.uuid, GPU_I_ID=str(mig.gi_id)).value == 31
    assert (
        out.one("DCGM_FI_DEV_XID_ERRORS", UUID=mig_gpu.uuid, GPU_I_ID=str(mig_gpu.mig_devices[0].gi_id)).value
        == 0
    )
    assert out.types["gpunode_xid_errors_total"] == "counter"
    assert out.one("gpunode_xid_errors_total", UUID=plain.uuid, code="48").value == 2
    assert out.one("gpunode_xid_errors_total", UUID=plain.uuid, code="79").value == 1
    on_mig = out.one("gpunode_xid_errors_total", UUID=mig_gpu.uuid, code="31")
    assert on_mig.labels["GPU_I_ID"] == str(mig.gi_id)
    assert "modelName" not in on_mig.labels, "our own series keep snake_case label names"
    assert "UUID" not in out.one("gpunode_xid_errors_total", code="13").labels


def test_label_values_are_escaped() -> None:
    _, gpus, samples = sample_node("t4")
    odd = tuple(replace(g, model='Tesla "T4"\\rev\nB') for g in gpus)
    out = render(snapshot_of(odd, samples))
    assert out.one("DCGM_FI_DEV_GPU_TEMP", gpu="0").labels["modelName"] == 'Tesla "T4"\\rev\nB'


def test_container_memory_on_a_mig_device_names_the_instance() -> None:
    _, gpus, samples = sample_node("a100-mig")
    mig_gpu = next(g for g in gpus if g.mig_enabled)
    mig = mig_gpu.mig_devices[5]
    holder = ContainerDevices("ns", "p", "c", f"nvidia.com/mig-{mig.profile}", (mig.uuid,))
    regions = [(region_key(holder.device_ids), mig.uuid, 123 * 2**20, 4 * 2**30)]
    out = render(snapshot_of(gpus, samples, containers=[holder], regions=regions))
    s = out.one("gpunode_container_memory_used_bytes", pod="p")
    assert s.value == 123 * 2**20
    assert (s.labels["UUID"], s.labels["gpu"]) == (mig_gpu.uuid, str(mig_gpu.index)), (
        "the physical GPU, as DCGM"
    )
    assert (s.labels["GPU_I_PROFILE"], s.labels["GPU_I_ID"]) == (mig.profile, str(mig.gi_id))
