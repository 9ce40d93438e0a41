"""Dynamic MIG partitioning: the instance is created when the claim is prepared, destroyed when it is
unprepared, and a stopped agent's successor neither leaks nor doubles it.

On the simulated a100-mig node with a real Preparer over a state directory. GPU 4 is two 3g.40gb
instances; the operator destroys the one on memory slices 4-7 first, so placements there are free.
A crash is an exception no handler of the Preparer catches (as SIGKILL would leave things), raised at
one point: after the intent is recorded, right after the instance is created, before the CDI spec is
written. Then a new Preparer over the same directories (MigNode.restart) finishes the prepare.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gpunode.contract import dra as names
from gpunode.errors import ClaimRefused
from gpunode.node.devices.base import Gpu
from gpunode.node.dra import cdi
from gpunode.node.dra.checkpoint import PREPARING
from gpunode.node.dra.prepare import created_migs
from gpunode.node.dra.slices import build_pool, mig_device_name
from tests.node.test_dra_mig import DRIVER, MigNode

GIB = 2**30


class Crash(BaseException):
    """The agent stops here (no handler of the Preparer catches it)."""


def freed(tmp_path: Path, **kw: Any) -> tuple[MigNode, Gpu, str]:
    """The node with GPU 4's second half freed by the operator; the GPU and its remaining instance."""
    node = MigNode(tmp_path, with_device_nodes=False, **kw)
    gpu = node.gpus[4]
    [half] = [m for m in gpu.mig_devices if m.start == 4]
    node.backend.destroy_mig(half.uuid)
    [kept] = [m.uuid for m in node.backend.gpus()[4].mig_devices]
    return node, gpu, kept


def created_by_gpunode(node: MigNode, gpu: Gpu, kept: str) -> list[str]:
    return [u for u in node.instances(gpu) if u != kept]


def test_a_free_placement_gets_an_instance_at_prepare_and_loses_it_at_unprepare(tmp_path: Path) -> None:
    node, gpu, kept = freed(tmp_path)
    ref = node.claim("one", gpu, "1g.10gb", 5)
    prepared = node.prepare(ref)
    [new] = created_by_gpunode(node, gpu, kept)
    assert node.instances(gpu)[new] == ("1g.10gb", 5)
    assert prepared.plan.devices[0].mig_uuid == new and prepared.plan.devices[0].mig_created
    spec = json.loads(cdi.spec_path(node.config.dra.cdi_dir, DRIVER, ref.uid).read_text())
    assert spec["devices"][0]["containerEdits"] == {"env": [f"NVIDIA_VISIBLE_DEVICES={new}"]}
    assert created_migs(node.config.state_dir) == {new}
    assert node.changes == 1  # the agent is told: it rediscovers and republishes
    assert node.prepare(ref).cdi_ids == prepared.cdi_ids  # prepared twice: nothing created again
    assert len(created_by_gpunode(node, gpu, kept)) == 1
    node.unprepare(ref)
    assert list(node.instances(gpu)) == [kept] and node.on_disk() == [] and node.changes == 2
    assert created_migs(node.config.state_dir) == set()


def test_the_created_instance_gets_its_capability_device_nodes(tmp_path: Path) -> None:
    node, gpu, kept = freed(tmp_path)
    node.with_device_nodes = True
    node.preparer = node._preparer()
    ref = node.claim("caps", gpu, "3g.40gb", 4)
    node.prepare(ref)
    [new] = created_by_gpunode(node, gpu, kept)
    mig = node.gpus[4].mig_by_uuid(new)
    assert mig is not None and mig.gi_id == 2  # the second half, as the driver numbers it in the simulator
    spec = json.loads(cdi.spec_path(node.config.dra.cdi_dir, DRIVER, ref.uid).read_text())
    assert [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]] == [
        f"/dev/nvidia{gpu.minor}",
        f"/dev/nvidia-caps/nvidia-cap{100 * gpu.minor + 2}",
        f"/dev/nvidia-caps/nvidia-cap{1000 + 100 * gpu.minor + 2}",
    ]
    node.unprepare(ref)
    assert list(node.instances(gpu)) == [kept]


def test_a_placement_on_a_foreign_instance_is_refused_naming_it(tmp_path: Path) -> None:
    node, gpu, kept = freed(tmp_path)
    ref = node.claim("over", gpu, "1g.10gb", 2)  # memory slice 2: the operator's 3g.40gb at 0
    with pytest.raises(ClaimRefused) as refused:
        node.prepare(ref)
    message = str(refused.value)
    assert "\n" not in message and kept in message and "which gpunode did not create" in message
    assert list(node.instances(gpu)) == [kept] and node.on_disk() == [] and node.changes == 0


def test_a_placement_overlapping_another_claims_instance_is_refused_naming_the_claim(tmp_path: Path) -> None:
    node, gpu, kept = freed(tmp_path)
    first = node.claim("first", gpu, "2g.20gb", 4)
    node.prepare(first)
    [new] = created_by_gpunode(node, gpu, kept)
    for name, profile, start in (("second", "1g.10gb", 5), ("same", "2g.20gb", 4)):
        with pytest.raises(ClaimRefused) as refused:
            node.prepare(node.claim(name, gpu, profile, start))
        assert new in str(refused.value) and first.uid in str(refused.value)
    assert created_by_gpunode(node, gpu, kept) == [new]


def test_a_placement_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    """A forged or stale slice: 3g.40gb at memory slice 7 is no placement of the profile."""
    node, gpu, kept = freed(tmp_path)
    with pytest.raises(ClaimRefused, match=r"3g\.40gb at memory slice 7 is not a MIG placement"):
        node.prepare(node.claim("bad", gpu, "3g.40gb", 7))
    assert list(node.instances(gpu)) == [kept] and node.on_disk() == []


def test_static_partitioning_never_creates(tmp_path: Path) -> None:
    node, gpu, kept = freed(tmp_path, partitioning="static")
    with pytest.raises(ClaimRefused, match="partitioning is static"):
        node.prepare(node.claim("one", gpu, "1g.10gb", 5))
    assert list(node.instances(gpu)) == [kept]


# -- crash points -------------------------------------------------------------------------------------


def crash_in_create(node: MigNode, *, after: bool) -> None:
    real = node.backend.create_mig

    def create(gpu_uuid: str, profile: str, start: int) -> str:
        if after:
            real(gpu_uuid, profile, start)
        raise Crash

    node.backend.create_mig = create  # type: ignore[method-assign]


def test_a_stop_between_intent_and_create_creates_once_on_the_retry(tmp_path: Path) -> None:
    node, gpu, kept = freed(tmp_path)
    ref = node.claim("one", gpu, "1g.10gb", 5)
    real = node.backend.create_mig
    crash_in_create(node, after=False)
    with pytest.raises(Crash):
        node.prepare(ref)
    record = node.preparer.checkpoint.load(ref.uid)
    assert record is not None and record.state == PREPARING  # the intent was recorded first
    assert record.plan.devices[0].mig_created and record.plan.devices[0].mig_uuid is None
    node.backend.create_mig = real  # type: ignore[method-assign]
    node.restart()
    node.prepare(ref)
    assert len(created_by_gpunode(node, gpu, kept)) == 1
    node.unprepare(ref)
    assert list(node.instances(gpu)) == [kept] and node.on_disk() == []


def test_a_stop_right_after_create_adopts_the_instance(tmp_path: Path) -> None:
    """Created, its UUID not recorded yet: the retry finds it at the recorded placement and adopts it."""
    node, gpu, kept = freed(tmp_path)
    ref = node.claim("one", gpu, "3g.40gb", 4)
    real = node.backend.create_mig
    crash_in_create(node, after=True)
    with pytest.raises(Crash):
        node.prepare(ref)
    [made] = created_by_gpunode(node, gpu, kept)
    node.backend.create_mig = real  # type: ignore[method-assign]
    node.restart()
    prepared = node.prepare(ref)
    assert created_by_gpunode(node, gpu, kept) == [made]  # adopted, not a second one
    assert prepared.plan.devices[0].mig_uuid == made and prepared.plan.devices[0].mig_created
    node.unprepare(ref)
    assert list(node.instances(gpu)) == [kept] and node.on_disk() == []


def test_a_stop_before_the_cdi_spec_adopts_the_recorded_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, gpu, kept = freed(tmp_path)
    ref = node.claim("one", gpu, "1g.20gb", 6)

    def crash(*_: Any, **__: Any) -> None:
        raise Crash

    monkeypatch.setattr(cdi, "write_spec", crash)
    with pytest.raises(Crash):
        node.prepare(ref)
    monkeypatch.undo()
    [made] = created_by_gpunode(node, gpu, kept)
    record = node.preparer.checkpoint.load(ref.uid)
    assert record is not None and record.plan.devices[0].mig_uuid == made
    node.restart()  # the start keeps the record and the instance, for the kubelet's retry
    assert created_by_gpunode(node, gpu, kept) == [made]
    assert node.prepare(ref).plan.devices[0].mig_uuid == made
    assert created_by_gpunode(node, gpu, kept) == [made]
    node.unprepare(ref)
    assert list(node.instances(gpu)) == [kept]


def test_an_instance_whose_claim_is_gone_is_destroyed_by_the_reconciliation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped mid-prepare, and the claim deleted meanwhile: the check for claims gone from the API server
    destroys the instance created for it, and leaves the operator's alone."""
    node, gpu, kept = freed(tmp_path)
    ref = node.claim("gone", gpu, "1g.10gb", 4)
    prepared_ref = node.claim("stays", gpu, "1g.10gb", 6)
    node.prepare(prepared_ref)

    def crash(*_: Any, **__: Any) -> None:
        raise Crash

    monkeypatch.setattr(cdi, "write_spec", crash)
    with pytest.raises(Crash):
        node.prepare(ref)
    monkeypatch.undo()
    assert len(created_by_gpunode(node, gpu, kept)) == 2
    del node.claims[("team-a", "gone")]
    node.restart()
    assert asyncio.run(node.preparer.collect_orphans()) == [ref.uid]
    [left] = created_by_gpunode(node, gpu, kept)
    assert node.instances(gpu)[left] == ("1g.10gb", 6) and kept in node.instances(gpu)
    assert node.preparer.checkpoint.load(ref.uid) is None


def test_a_failed_create_leaves_nothing(tmp_path: Path) -> None:
    """The backend refuses (here: the operator took the slices after the scheduler chose them)."""
    node, gpu, kept = freed(tmp_path)
    ref = node.claim("late", gpu, "1g.10gb", 5)

    def refuse(gpu_uuid: str, profile: str, start: int) -> str:
        from gpunode.errors import SimFaultError

        raise SimFaultError(f"GPU {gpu_uuid}: {profile} at memory slice {start} overlaps MIG device MIG-x")

    node.backend.create_mig = refuse  # type: ignore[method-assign]
    with pytest.raises(ClaimRefused, match="overlaps MIG device MIG-x") as refused:
        node.prepare(ref)
    assert "\n" not in str(refused.value)
    assert node.on_disk() == [] and list(node.instances(gpu)) == [kept]


def test_an_instance_destroyed_under_a_prepared_claim_is_made_again(tmp_path: Path) -> None:
    node, gpu, kept = freed(tmp_path)
    ref = node.claim("one", gpu, "1g.10gb", 5)
    node.prepare(ref)
    [first] = created_by_gpunode(node, gpu, kept)
    node.backend.destroy_mig(first)  # someone destroyed it behind gpunode's back
    again = node.prepare(ref)
    [second] = created_by_gpunode(node, gpu, kept)
    assert second != first and again.plan.devices[0].mig_uuid == second
    node.unprepare(ref)
    assert list(node.instances(gpu)) == [kept]


# -- what is published ----------------------------------------------------------------------------------


def published(gpu: Gpu, **kw: Any) -> set[tuple[str, int]]:
    pool = build_pool([gpu], unit_bytes=GIB, **kw)
    out = set()
    for d in pool.devices:
        a = d["attributes"]
        out.add((a[names.ATTR_MIG_PROFILE]["string"], a[names.ATTR_MIG_START]["int"]))
    return out


def test_dynamic_publishes_around_foreign_instances_and_static_only_the_instances(tmp_path: Path) -> None:
    node, gpu, _ = freed(tmp_path)
    now = node.gpus[4]
    assert published(now, mig_partitioning="static") == {("3g.40gb", 0)}
    dynamic = published(now, mig_partitioning="dynamic")
    assert dynamic == {
        ("3g.40gb", 0),
        ("3g.40gb", 4),
        ("2g.20gb", 4),
        ("1g.20gb", 4),
        ("1g.20gb", 6),
        ("1g.10gb", 4),
        ("1g.10gb", 5),
        ("1g.10gb", 6),
    }
    # An instance gpunode created for a claim: the placements on its slices stay published (the claim's
    # counters keep the scheduler off them); the same instance made by the operator hides them.
    ref = node.claim("one", gpu, "1g.10gb", 5)
    node.prepare(ref)
    now = node.gpus[4]
    owned = created_migs(node.config.state_dir)
    assert published(now, mig_partitioning="dynamic", mig_owned=owned) == dynamic
    assert ("2g.20gb", 4) not in published(now, mig_partitioning="dynamic")
    names_now = {d["name"] for d in build_pool([now], unit_bytes=GIB, mig_owned=owned).devices}
    assert mig_device_name(gpu.uuid, "1g.10gb", 5) in names_now  # the names are the placements'
