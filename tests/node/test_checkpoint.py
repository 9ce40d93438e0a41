"""The memory-cap checkpoint: one small file per cap, the old single file upgraded once, nothing lost.

And the bound on the regions of one GPU (gpunode.node.allocation.allocator.RegionBound):
regions whose units newer regions took are removed once the GPU holds more regions than
it has units, whether or not the kubelet can be asked.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from gpunode.config.agent import parse_config
from gpunode.node import memcap
from gpunode.node.allocation.allocator import Allocator
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import build_inventory, region_key
from gpunode.node.memcap.checkpoint import DIR_NAME, FILE_NAME, CapRecord, Checkpoint
from gpunode.node.state import DeviceState

MEM = "gpunode.io/gpu-memory"


def record(
    key: str, ids: tuple[str, ...] = ("g::mem0",), gpu: str = "GPU-a", created: float = 1.0
) -> CapRecord:
    return CapRecord(
        key=key,
        resource=MEM,
        device_ids=ids,
        gpu_uuid=gpu,
        limit_bytes=2**30,
        device_total_bytes=2**34,
        fail_open=False,
        created=created,
    )


def test_each_cap_is_its_own_file_and_survives_a_restart(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path)
    cp.load()
    for i in range(50):
        cp.replace(record(f"{i:020x}", gpu=f"GPU-{i % 2}"))
    assert cp.writes == 50, "one file written per cap, never the whole set"
    files = sorted((tmp_path / DIR_NAME).iterdir())
    assert len(files) == 50 and all(f.stat().st_size < 400 for f in files)
    cp.remove([f"{i:020x}" for i in range(10)])
    again = Checkpoint(tmp_path)
    assert sorted(again.load()) == [f"{i:020x}" for i in range(10, 50)]
    assert again.count_on("GPU-0") == 20 and again.keys_on("GPU-1")[0] == f"{11:020x}"


def test_an_old_checkpoint_is_upgraded_once(tmp_path: Path) -> None:
    old = [record(f"{i:020x}", created=float(i)) for i in range(3)]
    doc = {"version": 1, "caps": [asdict(r) for r in old]}
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    cp = Checkpoint(tmp_path)
    assert cp.load() == {r.key: r for r in old}
    assert not (tmp_path / FILE_NAME).exists()
    assert len(list((tmp_path / DIR_NAME).iterdir())) == 3
    assert Checkpoint(tmp_path).load() == {r.key: r for r in old}, "read from the files afterwards"


def test_a_broken_record_is_kept_aside_and_the_others_load(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path)
    cp.load()
    cp.replace(record("a" * 20))
    cp.replace(record("b" * 20))
    (tmp_path / DIR_NAME / f"{'b' * 20}.json").write_text('{"key": "bbb')  # torn by a disk fault
    again = Checkpoint(tmp_path)
    assert list(again.load()) == ["a" * 20]
    assert again.problem is not None and "could not be read" in again.problem
    aside = list((tmp_path / DIR_NAME).glob("*.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"key": "bbb'


def test_a_write_cut_short_by_a_crash_loses_nothing_held(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path)
    cp.load()
    cp.replace(record("a" * 20))
    # A crash in the middle of writing the next record leaves only its temporary file.
    staged = tmp_path / DIR_NAME / f".{'b' * 20}.json.{os.getpid()}.tmp"
    staged.write_text('{"key": "b')
    again = Checkpoint(tmp_path)
    assert list(again.load()) == ["a" * 20]
    assert again.problem is None and not staged.exists()


def sim_config(tmp_path: Path) -> tuple[Allocator, DeviceState, list[str]]:
    cfg = parse_config(
        {"gpunode": {"fractional": {"devices": "all", "unit": "1Gi"}, "stateDir": str(tmp_path / "state")}},
        "test.yaml",
    )
    backend = SimBackend.from_profile("t4")
    inventory = build_inventory(backend.gpus(), cfg)
    cp = Checkpoint(cfg.state_dir)
    cp.load()
    allocator = Allocator(config=cfg, checkpoint=cp)
    allocator.preload_lib = memcap.preload_library_path()
    gpu = backend.gpus()[0].uuid
    units = sorted(
        (d.id for d in inventory.devices if d.gpu_uuid == gpu), key=lambda i: int(i.rsplit("mem", 1)[1])
    )
    return allocator, DeviceState(inventory), units


def test_regions_of_a_gpu_stay_within_its_units(tmp_path: Path) -> None:
    """500 Allocates for distinct containers on one 15-unit GPU, nothing collected (no kubelet):
    the GPU keeps at most 15 regions, and every region the kubelet could still be using stays."""
    allocator, state, units = sim_config(tmp_path)
    snap = state.snapshot()
    assert len(units) == 15
    last: dict[str, str] = {}  # unit -> key of the newest region holding it
    sets: dict[str, list[str]] = {}
    for i in range(500):
        size = 1 + i % 4
        ids = units[(i * 3) % (15 - size) :][:size]
        allocator.allocate(snap, MEM, ids)
        sets[region_key(ids)] = ids
        for u in ids:
            last[u] = region_key(ids)
    # The containers that may still run: those no newer allocation took a unit of.
    unsuperseded = {k for k, ids in sets.items() if all(last[u] == k for u in ids)}
    root = tmp_path / "state" / "memcap"
    regions = {p.name for p in root.iterdir() if not p.name.startswith(".")}
    assert len(regions) <= 15, f"{len(regions)} regions on a GPU with 15 units"
    assert unsuperseded <= regions, "a region no newer one superseded is never removed"
    assert allocator.checkpoint is not None and set(allocator.checkpoint.records()) == regions
    assert allocator.bound is not None and allocator.bound.evicted >= len(sets) - 15


def test_the_bound_is_kept_after_a_restart(tmp_path: Path) -> None:
    allocator, state, units = sim_config(tmp_path)
    snap = state.snapshot()
    for i in range(15):
        allocator.allocate(snap, MEM, [units[i]])
    again, state, _ = sim_config(tmp_path)  # a restarted agent: the bound knows the checkpointed regions
    for i in range(15):
        again.allocate(state.snapshot(), MEM, [units[i], units[(i + 1) % 15]])
    assert again.checkpoint is not None and again.checkpoint.count_on(snap.inventory.gpus[0].uuid) <= 15


@pytest.mark.parametrize("unit", ["4Gi"])
def test_capacity_counts_the_capped_devices_of_a_gpu(tmp_path: Path, unit: str) -> None:
    cfg = parse_config({"gpunode": {"fractional": {"devices": [0], "unit": unit}}}, "test.yaml")
    backend = SimBackend.from_profile("t4")
    inventory = build_inventory(backend.gpus(), cfg)
    allocator = Allocator(config=cfg, checkpoint=Checkpoint(tmp_path))
    assert allocator.bound is not None
    assert allocator.bound.capacity(inventory, backend.gpus()[0].uuid) == 3
    assert allocator.bound.capacity(inventory, backend.gpus()[1].uuid) == 0


def test_regions_an_unbounded_agent_left_are_trimmed_at_start(tmp_path: Path) -> None:
    """An old agent left 300 regions on a 15-unit GPU (kept in an old checkpoint.json): the next start keeps
    only those no newer region superseded."""
    allocator, state, units = sim_config(tmp_path)
    gpu = state.snapshot().inventory.gpus[0].uuid
    assert allocator.bound is not None and allocator.checkpoint is not None
    allocator.bound = None  # the old agent: no bound
    for i in range(300):
        allocator.allocate(state.snapshot(), MEM, units[i % 13 :][: 1 + (i // 13) % 3])
    assert allocator.checkpoint.count_on(gpu) > 15
    again, state, _ = sim_config(tmp_path)
    assert again.trim(state.snapshot().inventory) > 0
    assert again.checkpoint is not None and again.checkpoint.count_on(gpu) <= 15
    root = tmp_path / "state" / "memcap"
    assert {p.name for p in root.iterdir() if not p.name.startswith(".")} == set(again.checkpoint.records())
