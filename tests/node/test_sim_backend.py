"""The simulated backend: bundled profiles, profile validation, telemetry and fault injection."""

from __future__ import annotations

import re
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.errors import DeviceNotFound, GpuLostError, GpunodeError, ProfileError, SimFaultError
from gpunode.node.devices.base import Backend, EventKind, Gpu
from gpunode.node.devices.simnode.backend import SimBackend, bundled_profiles, load_profile
from gpunode.node.devices.simnode.mig import MIG_TABLES, place_mig_layout

MIB = 2**20
GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
MIG_UUID = re.compile(r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class ManualClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(profile: str, **kwargs: object) -> tuple[SimBackend, ManualClock]:
    clock = ManualClock()
    return SimBackend.from_profile(profile, clock=clock, **kwargs), clock  # type: ignore[arg-type]


# -- bundled profiles ----------------------------------------------------------------------------


def test_the_bundled_profiles_are_the_documented_ones() -> None:
    assert set(bundled_profiles()) >= {"dgx-h100", "a100-mig", "t4", "h100-mig"}


@pytest.mark.parametrize(
    ("profile", "count", "model", "memory_mib", "arch", "numa", "mesh"),
    [
        ("dgx-h100", 8, "NVIDIA H100 80GB HBM3", 81559, "hopper", [0, 0, 0, 0, 1, 1, 1, 1], True),
        ("h100-mig", 8, "NVIDIA H100 80GB HBM3", 81559, "hopper", [0, 0, 0, 0, 1, 1, 1, 1], True),
        ("a100-mig", 8, "NVIDIA A100-SXM4-80GB", 81920, "ampere", [0, 0, 0, 0, 1, 1, 1, 1], True),
        ("t4", 4, "Tesla T4", 15360, "turing", [0, 0, 1, 1], False),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bundled_profile_describes_its_node(
    profile: str, count: int, model: str, memory_mib: int, arch: str, numa: list[int], mesh: bool
) -> None:
    backend, _ = make(profile)
    assert isinstance(backend, Backend)
    assert backend.name == f"sim:{profile}"
    gpus = backend.gpus()
    assert [g.index for g in gpus] == list(range(count))
    assert {g.model for g in gpus} == {model}
    assert {g.memory_total_bytes for g in gpus} == {memory_mib * MIB}
    assert {g.architecture for g in gpus} == {arch}
    assert [g.numa_node for g in gpus] == numa
    assert all(GPU_UUID.fullmatch(g.uuid) for g in gpus)
    assert len({g.uuid for g in gpus}) == count
    assert len({g.pci_bus_id for g in gpus}) == count
    assert all(re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]", g.pci_bus_id) for g in gpus)
    assert [g.minor for g in gpus] == list(range(count))
    for g in gpus:
        expected = {o.uuid for o in gpus if o is not g} if mesh else set()
        assert set(g.nvlink_peers) == expected
    assert backend.driver_version()


def test_dgx_h100_has_the_dgx_bus_ids_and_no_mig() -> None:
    gpus = make("dgx-h100")[0].gpus()
    assert [g.pci_bus_id[9:11] for g in gpus] == ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
    assert not any(g.mig_enabled for g in gpus)


def test_a100_mig_has_a_mixed_layout_that_fits_every_gpu() -> None:
    gpus = make("a100-mig")[0].gpus()
    layouts = [sorted(m.profile for m in g.mig_devices) if g.mig_enabled else None for g in gpus]
    assert None in layouts, "at least one GPU has MIG disabled"
    assert ["1g.10gb"] * 7 in layouts
    assert ["3g.40gb", "3g.40gb"] in layouts
    assert any(layout and {"3g.40gb", "2g.20gb", "1g.10gb"} <= set(layout) for layout in layouts)
    table = MIG_TABLES["a100-80gb"]
    for g in gpus:
        assert sum(m.slices for m in g.mig_devices) <= 7
        assert sum(table[m.profile].memory_slices for m in g.mig_devices) <= 8
        for m in g.mig_devices:
            assert MIG_UUID.fullmatch(m.uuid)
            assert m.parent_uuid == g.uuid
            assert m.slices == table[m.profile].compute_slices
            assert m.memory_total_bytes == table[m.profile].memory_bytes
        assert len({m.gi_id for m in g.mig_devices}) == len(g.mig_devices)
        assert [m.index for m in g.mig_devices] == list(range(len(g.mig_devices)))


def test_h100_mig_has_56_one_slice_instances() -> None:
    gpus = make("h100-mig")[0].gpus()
    migs = [m for g in gpus for m in g.mig_devices]
    assert len(migs) == 56
    assert {m.profile for m in migs} == {"1g.10gb"}
    assert len({m.uuid for m in migs}) == 56


def test_uuids_are_deterministic_and_follow_the_seed(tmp_path: Path) -> None:
    first = [g.uuid for g in make("dgx-h100")[0].gpus()]
    again = [g.uuid for g in make("dgx-h100")[0].gpus()]
    assert first == again
    source = _bundled_text("dgx-h100")
    seeded = tmp_path / "dgx-h100.yaml"
    seeded.write_text(source + "\nseed: rack-7\n")
    other = [g.uuid for g in SimBackend.from_profile(seeded).gpus()]
    assert not set(other) & set(first)
    assert len(set(other)) == 8


def _bundled_text(name: str) -> str:
    import importlib.resources

    return (
        importlib.resources.files("gpunode.node.devices.simnode") / "profiles" / f"{name}.yaml"
    ).read_text()


# -- profile validation --------------------------------------------------------------------------

GOOD_MODEL = """
models:
  g:
    name: Test GPU
    memory_total: 16Gi
    power_idle_w: 10
    power_limit_w: 100
    sm_clock_idle_mhz: 300
    sm_clock_max_mhz: 1500
    mem_clock_mhz: 5000
    mig_table: a100-80gb
    supports: [ecc, nvlink]
"""
GOOD_HEAD = 'version: 1\ndriver_version: "1.0"\n' + GOOD_MODEL


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(GOOD_HEAD + "gpus: []\n", "gpus: expected a non-empty list", id="no-gpus"),
        pytest.param(
            "version: 1\n" + GOOD_MODEL + 'gpus: [{pci_bus_id: "0000:01:00.0"}]\n',
            "driver_version: required key is missing",
            id="missing-driver-version",
        ),
        pytest.param(
            GOOD_HEAD.replace("version: 1", "version: 2") + 'gpus: [{pci_bus_id: "0000:01:00.0"}]\n',
            "unsupported profile version 2",
            id="future-version",
        ),
        pytest.param(
            GOOD_HEAD + 'gpus: [{pci_bus_id: "0000:01:00.0"}]\nnvlinks: none\n',
            "unknown key nvlinks (did you mean nvlink?)",
            id="typo-top-level-key",
        ),
        pytest.param(
            GOOD_HEAD + 'gpus: [{pci_bus_id: "01:00"}]\n',
            "gpus[0].pci_bus_id: expected a PCI bus ID",
            id="bad-bus-id",
        ),
        pytest.param(
            GOOD_HEAD + 'gpus: [{pci_bus_id: "0000:01:00.0"}, {pci_bus_id: "00000000:01:00.0"}]\n',
            "duplicate pci_bus_id 00000000:01:00.0",
            id="duplicate-bus-id",
        ),
        pytest.param(
            GOOD_HEAD + 'gpus: [{pci_bus_id: "0000:01:00.0", numa_node: -1}]\n',
            "gpus[0].numa_node: must be 0 or more",
            id="negative-numa",
        ),
        pytest.param(
            GOOD_HEAD + 'gpus: [{pci_bus_id: "0000:01:00.0", model: h100}]\n',
            "gpus[0].model: unknown model 'h100'",
            id="unknown-model",
        ),
        pytest.param(
            GOOD_HEAD + 'gpus: [{pci_bus_id: "0000:01:00.0", mig: [1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb,'
            " 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb]}]\n",
            "needs 8 compute slices, the GPU has 7",
            id="mig-too-many-compute-slices",
        ),
        pytest.param(
            GOOD_HEAD + 'gpus: [{pci_bus_id: "0000:01:00.0", mig: [3g.40gb, 3g.40gb, 1g.10gb]}]\n',
            "needs 9 memory slices, the GPU has 8",
            id="mig-too-many-memory-slices",
        ),
        pytest.param(
            GOOD_HEAD + 'gpus: [{pci_bus_id: "0000:01:00.0", mig: [5g.50gb]}]\n',
            "gpus[0].mig: '5g.50gb' is not a MIG profile of this GPU",
            id="unknown-mig-profile",
        ),
        pytest.param(
            GOOD_HEAD.replace("    mig_table: a100-80gb\n", "")
            + 'gpus: [{pci_bus_id: "0000:01:00.0", mig: [1g.10gb]}]\n',
            "does not support MIG",
            id="mig-on-a-gpu-without-mig",
        ),
        pytest.param(
            GOOD_HEAD.replace("[ecc, nvlink]", "[ecc, warp_drive]")
            + 'gpus: [{pci_bus_id: "0000:01:00.0"}]\n',
            "models.g.supports: unknown feature(s) warp_drive",
            id="unknown-feature",
        ),
        pytest.param(
            GOOD_HEAD.replace("[ecc, nvlink]", "[ecc]")
            + 'gpus: [{pci_bus_id: "0000:01:00.0"}]\nnvlink: nvswitch\n',
            "GPU 0 (Test GPU) has no NVLink",
            id="nvlink-on-a-pcie-only-model",
        ),
        pytest.param(
            GOOD_HEAD + 'gpus: [{pci_bus_id: "0000:01:00.0"}]\nnvlink: [[0, 3]]\n',
            "pair [0, 3] must name two different GPUs among 0..0",
            id="nvlink-pair-out-of-range",
        ),
        pytest.param(
            GOOD_HEAD.replace("power_limit_w: 100", "power_limit_w: 5")
            + 'gpus: [{pci_bus_id: "0000:01:00.0"}]\n',
            "models.g.power_limit_w: must be greater than power_idle_w",
            id="power-limit-below-idle",
        ),
        pytest.param(
            GOOD_HEAD.replace("memory_total: 16Gi", "memory_total: lots")
            + 'gpus: [{pci_bus_id: "0000:01:00.0"}]\n',
            "models.g.memory_total: expected a size",
            id="memory-not-a-size",
        ),
        pytest.param(
            'version: 1\ndriver_version: "1.0"\nmodels: {}\ngpus: [{pci_bus_id: "0000:01:00.0"}]\n',
            "models: expected a mapping of one or more GPU models",
            id="no-models",
        ),
        pytest.param("- just\n- a list\n", "expected a mapping", id="not-a-mapping"),
        pytest.param("version: 1\ngpus: [\n", "not valid YAML at line", id="yaml-syntax-error"),
    ],
)
def test_a_malformed_profile_names_the_file_and_the_key(tmp_path: Path, body: str, expected: str) -> None:
    path = tmp_path / "custom.yaml"
    path.write_text(textwrap.dedent(body))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(path) in str(err.value)
    assert expected in str(err.value)
    assert err.value.hint


def test_a_valid_user_profile_loads_from_a_path(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text(
        GOOD_HEAD + 'gpus:\n  - {pci_bus_id: "0000:01:00.0", mig: [4g.40gb, 3g.40gb]}\n'
        '  - {pci_bus_id: "0000:02:00.0", numa_node: null}\nnvlink: [[0, 1]]\n'
    )
    backend = SimBackend.from_profile(str(path))
    assert backend.name == "sim:lab"
    a, b = backend.gpus()
    assert [(m.profile, m.slices) for m in a.mig_devices] == [("4g.40gb", 4), ("3g.40gb", 3)]
    assert a.nvlink_peers == (b.uuid,) and b.nvlink_peers == (a.uuid,)
    assert b.numa_node is None and not b.mig_enabled


@pytest.mark.parametrize(
    "ref", ["no-such-node", "/nonexistent/dir/profile.yaml"], ids=["unknown-bundled-name", "missing-file"]
)
def test_an_unknown_profile_says_what_exists(ref: str) -> None:
    with pytest.raises(ProfileError) as err:
        load_profile(ref)
    assert ref in str(err.value)
    if "/" not in ref:
        assert "dgx-h100" in str(err.value)


@pytest.mark.parametrize(
    ("layout", "starts"),
    [
        (["3g.40gb", "3g.40gb"], [0, 4]),
        (["4g.40gb", "3g.40gb"], [0, 4]),
        (["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], [4, 0, 2, 3]),
        (["2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"], [0, 2, 4, 6]),
        (["1g.20gb"] * 4, [0, 2, 4, 6]),
        (["7g.80gb"], [0]),
    ],
    ids=lambda v: "+".join(v) if isinstance(v, list) and isinstance(v[0], str) else None,
)
def test_mig_layouts_sit_on_allowed_non_overlapping_placements(layout: list[str], starts: list[int]) -> None:
    placed = place_mig_layout("a100-80gb", layout, where="t")
    assert [p.start for p in placed] == starts
    cells = [c for p in placed for c in range(p.start, p.start + p.memory_slices)]
    assert len(cells) == len(set(cells))


# -- telemetry -----------------------------------------------------------------------------------


def test_an_idle_gpu_reads_idle_values() -> None:
    backend, _ = make("dgx-h100")
    gpu = backend.gpus()[0]
    s = backend.sample(gpu.uuid)
    assert s.gpu_util == 0.0 and s.gr_engine_active == 0.0
    assert s.power_w == 70.0
    assert s.sm_clock_hz == 345e6 and s.mem_clock_hz == 2619e6
    assert s.memory_used_bytes == 0
    assert s.memory_reserved_bytes == 512 * MIB
    assert s.memory_free_bytes == gpu.memory_total_bytes - 512 * MIB


def test_memory_used_is_the_sum_of_the_processes_and_load_raises_the_readings() -> None:
    backend, clock = make("dgx-h100")
    gpu = backend.gpus()[2]
    idle = backend.sample(gpu.uuid)
    backend.add_process(gpu.uuid, 4242, 3 * 2**30)
    backend.add_process(gpu.uuid, 4343, 2**30)
    clock.t += 7.5
    busy = backend.sample(gpu.uuid)
    assert busy.memory_used_bytes == 4 * 2**30
    assert idle.memory_free_bytes is not None
    assert busy.memory_free_bytes == idle.memory_free_bytes - 4 * 2**30
    assert busy.gpu_util is not None and 0.25 <= busy.gpu_util <= 0.95
    assert busy.power_w is not None and idle.power_w is not None and busy.power_w > idle.power_w
    assert busy.sm_clock_hz == 1980e6
    assert busy.gpu_temp_c is not None and idle.gpu_temp_c is not None and busy.gpu_temp_c > idle.gpu_temp_c
    assert [p.pid for p in backend.processes(gpu.uuid)] == [4242, 4343]
    backend.remove_process(4242)
    assert backend.sample(gpu.uuid).memory_used_bytes == 2**30


def test_energy_is_the_exact_integral_of_power_and_never_decreases() -> None:
    backend, clock = make("dgx-h100")
    uuid = backend.gpus()[0].uuid
    e0 = backend.sample(uuid).total_energy_j
    assert e0 is not None
    clock.t += 10
    e1 = backend.sample(uuid).total_energy_j
    assert e1 is not None
    assert e1 == pytest.approx(e0 + 70.0 * 10)  # idle power for 10 s
    backend.set_activity(uuid, 1.0)
    clock.t += 10
    s = backend.sample(uuid)
    assert s.power_w == pytest.approx(0.85 * 700)
    assert s.total_energy_j == pytest.approx(e1 + 0.85 * 700 * 10)
    backend.set_activity(uuid, None)
    backend.add_process(uuid, 7, 2**30)
    last = s.total_energy_j
    assert last is not None
    for _ in range(50):
        clock.t += 1.3
        e = backend.sample(uuid).total_energy_j
        assert e is not None and e > last
        last = e


def test_nvlink_counter_grows_only_on_linked_gpus_under_load() -> None:
    backend, clock = make("dgx-h100")
    uuid = backend.gpus()[0].uuid
    assert backend.sample(uuid).nvlink_bandwidth_total_bytes == 0
    backend.set_activity(uuid, 0.5)
    clock.t += 2
    assert backend.sample(uuid).nvlink_bandwidth_total_bytes == int(0.5 * 200e9 * 2)


@pytest.mark.parametrize(
    ("profile", "index", "present", "absent"),
    [
        (
            "dgx-h100",
            0,
            [
                "remapped_rows_correctable",
                "row_remap_pending",
                "gr_engine_active",
                "tensor_active",
                "dram_active",
                "pcie_tx_bytes_per_s",
                "memory_temp_c",
                "nvlink_bandwidth_total_bytes",
                "gpu_util",
                "dec_util",
                "ecc_dbe_volatile",
            ],
            ["enc_util", "vgpu_license_status"],
        ),
        (
            "t4",
            0,
            ["gpu_util", "enc_util", "dec_util", "ecc_sbe_volatile", "power_w", "total_energy_j"],
            [
                "remapped_rows_correctable",
                "row_remap_pending",
                "row_remap_failure",
                "gr_engine_active",
                "tensor_active",
                "dram_active",
                "pcie_rx_bytes_per_s",
                "memory_temp_c",
                "nvlink_bandwidth_total_bytes",
            ],
        ),
        ("a100-mig", 0, ["gr_engine_active", "remapped_rows_uncorrectable"], ["gpu_util", "mem_copy_util"]),
        ("a100-mig", 7, ["gpu_util", "mem_copy_util", "gr_engine_active"], []),
    ],
    ids=["h100", "t4", "a100-mig-enabled", "a100-mig-disabled"],
)
def test_fields_the_modelled_gpu_lacks_are_none(
    profile: str, index: int, present: list[str], absent: list[str]
) -> None:
    backend, _ = make(profile)
    s = backend.sample(backend.gpus()[index].uuid)
    assert [f for f in present if getattr(s, f) is None] == []
    assert [f for f in absent if getattr(s, f) is not None] == []


def test_mig_samples_account_memory_per_instance() -> None:
    backend, _ = make("a100-mig")
    gpu = backend.gpus()[2]
    big, small = gpu.mig_devices[0], gpu.mig_devices[3]
    backend.add_process(gpu.uuid, 10, 5 * 2**30, mig_uuid=big.uuid)
    backend.add_process(gpu.uuid, 11, 2**30, mig_uuid=small.uuid)
    s = backend.sample(gpu.uuid)
    per_mig = {m.uuid: m for m in s.mig}
    assert set(per_mig) == {m.uuid for m in gpu.mig_devices}
    assert per_mig[big.uuid].memory_used_bytes == 5 * 2**30
    assert per_mig[small.uuid].memory_used_bytes == 2**30
    assert per_mig[gpu.mig_devices[1].uuid].memory_used_bytes == 0
    assert per_mig[big.uuid].memory_total_bytes == big.memory_total_bytes
    assert (per_mig[big.uuid].gr_engine_active or 0) > 0
    assert per_mig[gpu.mig_devices[1].uuid].gr_engine_active == 0
    assert s.memory_used_bytes == 6 * 2**30
    assert {p.mig_uuid for p in backend.processes(gpu.uuid)} == {big.uuid, small.uuid}


@pytest.mark.parametrize(
    ("profile", "index", "call", "error", "message"),
    [
        ("a100-mig", 0, lambda b, g: b.add_process(g.uuid, 1, 1), SimFaultError, "is in MIG mode"),
        (
            "dgx-h100",
            0,
            lambda b, g: b.add_process(g.uuid, 1, 1, mig_uuid="MIG-x"),
            SimFaultError,
            "not in MIG",
        ),
        ("a100-mig", 0, lambda b, g: b.add_process(g.uuid, 1, 1, mig_uuid="MIG-x"), DeviceNotFound, "MIG-x"),
        ("t4", 0, lambda b, g: b.add_process(g.uuid, 1, 16 * 2**30), SimFaultError, "out of memory"),
        ("t4", 0, lambda b, g: b.remove_process(999), SimFaultError, "no simulated process with pid 999"),
        ("t4", 0, lambda b, g: b.sample("GPU-nope"), DeviceNotFound, "GPU-nope"),
        ("t4", 0, lambda b, g: b.probe("GPU-nope"), DeviceNotFound, "GPU-nope"),
        ("t4", 0, lambda b, g: b.inject_xid(g.uuid, 0), SimFaultError, "positive integer"),
        ("t4", 0, lambda b, g: b.inject_ecc(g.uuid, True, count=0), SimFaultError, "positive integer"),
        ("t4", 0, lambda b, g: b.inject_xid(g.uuid, 79, mig_uuid="MIG-x"), DeviceNotFound, "MIG-x"),
        ("t4", 0, lambda b, g: b.set_row_remap(g.uuid, pending=True), SimFaultError, "no row remapping"),
        (
            "dgx-h100",
            0,
            lambda b, g: b.set_retired_pages_pending(g.uuid, True),
            SimFaultError,
            "page retirement",
        ),
        ("t4", 0, lambda b, g: b.add_gpu(index=1), SimFaultError, "index 1 is taken"),
        ("t4", 0, lambda b, g: b.add_gpu(model="h100"), SimFaultError, "no GPU model 'h100'"),
        ("t4", 0, lambda b, g: b.set_activity(g.uuid, 1.5), SimFaultError, "ratio in 0..1"),
        ("t4", 0, lambda b, g: b.resolve_gpu(9), DeviceNotFound, "index 9"),
    ],
    ids=[
        "process-without-mig-on-mig-gpu",
        "process-with-mig-on-whole-gpu",
        "process-on-unknown-mig",
        "process-out-of-memory",
        "remove-unknown-process",
        "sample-unknown-gpu",
        "probe-unknown-gpu",
        "xid-zero",
        "ecc-count-zero",
        "xid-on-unknown-mig",
        "row-remap-on-t4",
        "retired-pages-on-h100",
        "add-into-taken-index",
        "add-unknown-model",
        "activity-out-of-range",
        "resolve-unknown-index",
    ],
)
def test_bad_requests_get_clear_errors(
    profile: str,
    index: int,
    call: Callable[[SimBackend, Gpu], object],
    error: type[GpunodeError],
    message: str,
) -> None:
    backend, _ = make(profile)
    gpu = backend.gpus()[index]
    with pytest.raises(error) as err:
        call(backend, gpu)
    assert message in str(err.value)
    assert err.value.hint


# -- faults --------------------------------------------------------------------------------------


def test_xid_events_carry_the_code_and_the_mig_device() -> None:
    backend, _ = make("a100-mig")
    gpu = backend.gpus()[4]
    assert backend.wait_event(0) is None
    backend.inject_xid(gpu.uuid, 79)
    backend.inject_xid(gpu.uuid, 43, mig_uuid=gpu.mig_devices[1].uuid)
    first, second = backend.wait_event(1), backend.wait_event(1)
    assert first is not None and second is not None
    assert (first.kind, first.gpu_uuid, first.xid, first.mig_uuid) == (EventKind.XID, gpu.uuid, 79, None)
    assert (second.xid, second.mig_uuid) == (43, gpu.mig_devices[1].uuid)
    assert backend.wait_event(0.01) is None


def test_ecc_errors_raise_the_volatile_counters_until_a_reset() -> None:
    backend, _ = make("dgx-h100")
    uuid = backend.gpus()[1].uuid
    backend.inject_ecc(uuid, double_bit=False, count=3)
    backend.inject_ecc(uuid, double_bit=True)
    kinds = [backend.wait_event(1) for _ in range(2)]
    assert [(e.kind, e.count) for e in kinds if e] == [(EventKind.ECC_SBE, 3), (EventKind.ECC_DBE, 1)]
    s, p = backend.sample(uuid), backend.probe(uuid)
    assert (s.ecc_sbe_volatile, s.ecc_dbe_volatile) == (3, 1)
    assert (p.ecc_sbe_volatile, p.ecc_dbe_volatile) == (3, 1)
    backend.reset_gpu(uuid)
    assert (backend.sample(uuid).ecc_sbe_volatile, backend.probe(uuid).ecc_dbe_volatile) == (0, 0)


def test_a_lost_gpu_stays_listed_but_cannot_be_read_until_reset() -> None:
    backend, _ = make("dgx-h100")
    gpus = backend.gpus()
    lost = gpus[3].uuid
    backend.add_process(lost, 55, 2**30)
    event = backend.lose_gpu(lost)
    assert event.kind is EventKind.GPU_LOST and backend.wait_event(1) == event
    assert lost in [g.uuid for g in backend.gpus()]
    with pytest.raises(GpuLostError) as err:
        backend.sample(lost)
    assert err.value.uuid == lost
    with pytest.raises(GpuLostError):
        backend.processes(lost)
    probe = backend.probe(lost)
    assert not probe.reachable and "lost" in probe.detail
    assert all(lost not in g.nvlink_peers for g in backend.gpus() if g.uuid != lost)
    backend.reset_gpu(lost)
    assert backend.probe(lost).reachable
    assert backend.processes(lost) == ()
    assert lost in backend.gpus()[0].nvlink_peers


def test_remove_and_add_change_the_gpu_list_and_emit_events() -> None:
    backend, _ = make("dgx-h100")
    before = backend.gpus()
    gone = before[5]
    backend.remove_gpu(gone.uuid)
    removed = backend.wait_event(1)
    assert removed is not None and (removed.kind, removed.gpu_uuid) == (EventKind.GPU_REMOVED, gone.uuid)
    assert gone.uuid not in [g.uuid for g in backend.gpus()]
    with pytest.raises(DeviceNotFound):
        backend.sample(gone.uuid)
    new = backend.add_gpu()
    added = backend.wait_event(1)
    assert added is not None and (added.kind, added.gpu_uuid) == (EventKind.GPU_ADDED, new.uuid)
    # The replacement sits in the freed slot: same index, bus ID and NUMA node, a new UUID.
    assert (new.index, new.pci_bus_id, new.numa_node) == (gone.index, gone.pci_bus_id, gone.numa_node)
    assert new.uuid != gone.uuid and GPU_UUID.fullmatch(new.uuid)
    assert [g.uuid for g in backend.gpus()][5] == new.uuid
    assert len(backend.gpus()[0].nvlink_peers) == 7
    extra = backend.add_gpu()
    assert extra.index == 8 and extra.pci_bus_id not in {g.pci_bus_id for g in before}


def test_a_replacement_gpu_in_a_mig_slot_keeps_the_slot_layout() -> None:
    backend, _ = make("a100-mig")
    gone = backend.gpus()[2]
    backend.remove_gpu(gone.uuid)
    new = backend.add_gpu(index=2)
    assert [m.profile for m in new.mig_devices] == [m.profile for m in gone.mig_devices]
    assert not {m.uuid for m in new.mig_devices} & {m.uuid for m in gone.mig_devices}


def test_row_remap_and_retired_pages_reach_sample_and_probe() -> None:
    h100, _ = make("dgx-h100")
    uuid = h100.gpus()[0].uuid
    h100.set_row_remap(uuid, pending=True, uncorrectable=2)
    s = h100.sample(uuid)
    assert (s.row_remap_pending, s.row_remap_failure, s.remapped_rows_uncorrectable) == (True, False, 2)
    assert h100.probe(uuid).row_remap_pending is True
    assert h100.probe(uuid).retired_pages_pending is None
    h100.set_row_remap(uuid, failure=True)
    h100.reset_gpu(uuid)
    p = h100.probe(uuid)
    assert (p.row_remap_pending, p.row_remap_failure) == (False, True)

    t4, _ = make("t4")
    uuid = t4.gpus()[0].uuid
    t4.set_retired_pages_pending(uuid, True)
    p = t4.probe(uuid)
    assert (p.retired_pages_pending, p.row_remap_pending) == (True, None)
    t4.reset_gpu(uuid)
    assert t4.probe(uuid).retired_pages_pending is False


def test_a_hanging_probe_answers_unreachable_at_the_timeout() -> None:
    backend, _ = make("t4", probe_timeout_s=0.05)
    uuid = backend.gpus()[0].uuid
    backend.set_probe_delay(uuid, 30)
    p = backend.probe(uuid)
    assert not p.reachable and "no answer within 0.05 s" in p.detail
    backend.set_probe_delay(uuid, 0.01)
    assert backend.probe(uuid).reachable


def test_close_ends_waiting_for_events() -> None:
    backend, _ = make("t4")
    backend.inject_xid(backend.gpus()[0].uuid, 13)
    backend.close()
    assert backend.wait_event(5) is None


def test_resolve_gpu_accepts_uuid_index_and_digits() -> None:
    backend, _ = make("t4")
    gpus = backend.gpus()
    assert backend.resolve_gpu(2) == gpus[2].uuid
    assert backend.resolve_gpu("3") == gpus[3].uuid
    assert backend.resolve_gpu(gpus[1].uuid) == gpus[1].uuid


def test_concurrent_faults_and_reads_lose_no_event() -> None:
    backend, _ = make("h100-mig")
    gpus = backend.gpus()
    errors: list[BaseException] = []

    def inject(g_index: int) -> None:
        try:
            uuid = gpus[g_index].uuid
            for i in range(50):
                backend.inject_xid(uuid, 31, mig_uuid=gpus[g_index].mig_devices[i % 7].uuid)
                backend.inject_ecc(uuid, double_bit=bool(i % 2))
                backend.sample(uuid)
                backend.probe(uuid)
                backend.gpus()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=inject, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    events = []
    while (e := backend.wait_event(0)) is not None:
        events.append(e)
    assert len(events) == 8 * 100
    for g in gpus:
        s = backend.sample(g.uuid)
        assert (s.ecc_sbe_volatile, s.ecc_dbe_volatile) == (25, 25)
