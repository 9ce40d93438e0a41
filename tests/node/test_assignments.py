"""AssignmentBook on its own: which pods it keeps, what it refuses to take from an annotation, and what
an assignment that names a GPU not on this node comes to."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from lightkube.resources.core_v1 import Pod

from gpunode.config.agent import parse_config
from gpunode.contract.names import ALLOCATED_ANNOTATION, ASSIGNMENT_ANNOTATION, mig_resource_name
from gpunode.errors import KubeError
from gpunode.infra.kube import ADDED, MODIFIED, SYNC, WatchEvent
from gpunode.node.assignments import AssignmentBook, parse_assignment
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import AdvertisedDevice, build_inventory
from gpunode.node.state import Snapshot

MEM = "gpunode.io/gpu-memory"


def snapshot() -> Snapshot:
    cfg = parse_config({"gpunode": {"fractional": {"devices": [0, 1, 2, 3], "unit": "1Gi"}}}, "node.yaml")
    return Snapshot(version=1, inventory=build_inventory(SimBackend.from_profile("t4").gpus(), cfg))


def pod(
    name: str,
    units: int,
    annotations: dict[str, str],
    *,
    phase: str = "Pending",
    rv: str = "1",
    resource: str = MEM,
) -> Pod:
    doc = {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "annotations": annotations,
            "resourceVersion": rv,
            "creationTimestamp": "2030-01-01T00:00:00Z",
        },
        "spec": {
            "nodeName": "n",
            "containers": [{"name": "c", "resources": {"limits": {resource: str(units)}}}],
        },
        "status": {
            "phase": phase,
            # The same second for every pod: the API server's times tell no two bindings apart.
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2030-01-01T00:00:01Z"}
            ],
        },
    }
    return msgspec.json.decode(json.dumps(doc).encode(), type=Pod)


def device(snap: Snapshot, dev_id: str) -> AdvertisedDevice:
    found = snap.inventory.by_id(dev_id)
    assert found is not None, dev_id
    return found


def gpus_of(snap: Snapshot, ids: list[str] | None) -> set[str]:
    assert ids is not None
    return {device(snap, u).gpu_uuid for u in ids}


def no_client() -> Any:
    raise KubeError("no API server in this test")


def book_with(tmp_path: Path, *pods: Pod) -> AssignmentBook:
    book = AssignmentBook(
        node_name="n", state_dir=tmp_path, client_factory=no_client, served=lambda: (MEM, "nvidia.com/gpu")
    )
    book.apply(WatchEvent(SYNC, items=tuple(pods)))
    return book


@pytest.mark.parametrize(
    "text",
    [
        "",
        " , ,",
        ",".join(f"GPU-{n}" for n in range(65)),  # more GPUs than any node has
        "GPU-" + "a" * 200,  # longer than a UUID
        "GPU-1\x00,GPU-2",  # control characters
        "GPU-1 GPU-2",
    ],
)
def test_an_annotation_that_is_no_list_of_uuids_is_refused(text: str) -> None:
    assert parse_assignment(text) is None


def test_unusable_annotations_and_finished_pods_are_not_kept(tmp_path: Path) -> None:
    snap = snapshot()
    gpu = snap.inventory.gpus[3].uuid
    book = book_with(
        tmp_path,
        pod("garbage", 2, {ASSIGNMENT_ANNOTATION: "GPU-x\x07"}),
        pod("running", 2, {ASSIGNMENT_ANNOTATION: gpu}, phase="Running"),
        pod("marked", 2, {ASSIGNMENT_ANNOTATION: gpu, ALLOCATED_ANNOTATION: gpu}),
        pod("kept", 2, {ASSIGNMENT_ANNOTATION: gpu}),
    )
    assert set(book.pending) == {"uid-kept"}
    book.apply(WatchEvent(MODIFIED, object=pod("kept", 2, {ASSIGNMENT_ANNOTATION: gpu}, phase="Running")))
    assert book.pending == {}


def test_an_assignment_to_a_gpu_not_on_this_node_is_not_possible(tmp_path: Path) -> None:
    snap = snapshot()
    units = [d.id for d in snap.inventory.by_resource(MEM)]
    book = book_with(
        tmp_path, pod("p", 2, {ASSIGNMENT_ANNOTATION: "GPU-00000000-0000-0000-0000-000000000bad"})
    )

    async def admit() -> tuple[list[str] | None, str]:
        preferred = await book.prefer(snap, MEM, units, [], 2, replica_placement="spread")
        return preferred, await book.allocated(snap, MEM, units[:2])

    preferred, holder = asyncio.run(admit())
    assert preferred is None  # the node decides
    assert holder == "ns/p" and book.outcomes["not_possible"] == 1
    assert book.carried_out == {"uid-p": [snap.inventory.gpus[0].uuid]}


def test_a_request_of_another_size_does_not_match(tmp_path: Path) -> None:
    snap = snapshot()
    gpu = snap.inventory.gpus[2].uuid
    units = [d.id for d in snap.inventory.by_resource(MEM)]
    book = book_with(tmp_path, pod("p", 4, {ASSIGNMENT_ANNOTATION: gpu}))

    async def admit() -> tuple[list[str] | None, str]:
        return await book.prefer(snap, MEM, units, [], 3, replica_placement="spread"), await book.allocated(
            snap, MEM, units[:3]
        )

    assert asyncio.run(admit()) == (None, "")
    assert book.outcomes["no_assignment"] == 1 and "uid-p" in book.pending


def test_a_broken_record_file_is_kept_aside(tmp_path: Path) -> None:
    (tmp_path / "assignments.json").write_text("{not json")
    book = book_with(tmp_path)
    assert book.carried_out == {}
    assert (tmp_path / "assignments.json.corrupt").read_text() == "{not json"


@pytest.mark.parametrize("how", ["watch", "list"])
def test_equal_requests_are_matched_in_the_order_they_were_bound(tmp_path: Path, how: str) -> None:
    snap = snapshot()
    gpus = [g.uuid for g in snap.inventory.gpus]
    units = [d.id for d in snap.inventory.by_resource(MEM)]
    # "zeta" was bound first (the lower resourceVersion), "alpha" in the same second after it.
    zeta = pod("zeta", 2, {ASSIGNMENT_ANNOTATION: gpus[3]}, rv="1207")
    alpha = pod("alpha", 2, {ASSIGNMENT_ANNOTATION: gpus[1]}, rv="1213")
    if how == "watch":
        book = book_with(tmp_path)
        book.apply(WatchEvent(ADDED, object=zeta))
        book.apply(WatchEvent(ADDED, object=alpha))
    else:
        book = book_with(tmp_path, alpha, zeta)  # a list comes in name order

    async def admit() -> list[tuple[list[str], str]]:
        out = []
        for _ in range(2):
            taken = {u for g in book.carried_out.values() for u in g}
            free = [u for u in units if device(snap, u).gpu_uuid not in taken]
            preferred = await book.prefer(snap, MEM, free, [], 2, replica_placement="spread")
            assert preferred is not None
            out.append((preferred, await book.allocated(snap, MEM, preferred)))
        return out

    (first, first_pod), (second, second_pod) = asyncio.run(admit())
    assert first_pod == "ns/zeta" and gpus_of(snap, first) == {gpus[3]}
    assert second_pod == "ns/alpha" and gpus_of(snap, second) == {gpus[1]}
    assert book.outcomes == {"followed": 2, "no_assignment": 0, "not_possible": 0}


def test_a_pod_the_watch_delivers_after_the_kubelet_asked_is_still_followed(tmp_path: Path) -> None:
    snap = snapshot()
    gpu = snap.inventory.gpus[2].uuid
    units = [d.id for d in snap.inventory.by_resource(MEM)]
    # listed: nothing pending here yet, one pod the extender placed earlier (so it is in use here)
    book = book_with(tmp_path, pod("earlier", 1, {ASSIGNMENT_ANNOTATION: gpu, ALLOCATED_ANNOTATION: gpu}))

    async def admit() -> tuple[list[str] | None, str]:
        asking = asyncio.create_task(book.prefer(snap, MEM, units, [], 3, replica_placement="spread"))
        await asyncio.sleep(0.5)  # the kubelet's watch delivered the binding before ours did
        assert not asking.done()
        book.apply(WatchEvent(ADDED, object=pod("late", 3, {ASSIGNMENT_ANNOTATION: gpu}, rv="88")))
        preferred = await asking
        assert preferred is not None
        return preferred, await book.allocated(snap, MEM, preferred)

    preferred, holder = asyncio.run(admit())
    assert holder == "ns/late" and gpus_of(snap, preferred) == {gpu}
    assert book.outcomes["followed"] == 1 and book.carried_out == {"uid-late": [gpu]}


def test_without_the_extender_only_the_first_allocation_waits_for_the_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No pod on this node ever carried an assignment: the first allocation after start waits the
    # catch-up once (the first pod bound to a fresh node may be on its way), every later one decides
    # at once, however long the catch-up wait is set to (an hour then: waiting would hang the test).
    monkeypatch.setattr("gpunode.node.assignments.CATCH_UP_S", 0.2)
    snap = snapshot()
    units = [d.id for d in snap.inventory.by_resource(MEM)]
    book = book_with(tmp_path, pod("plain", 1, {}))

    async def admit() -> list[str] | None:
        async with asyncio.timeout(60):
            return await book.prefer(snap, MEM, units, [], 3, replica_placement="spread")

    assert asyncio.run(admit()) is None  # waited 0.2 s, then the node's own policy decides
    monkeypatch.setattr("gpunode.node.assignments.CATCH_UP_S", 3600.0)
    assert asyncio.run(admit()) is None  # no assignment: the node's own policy decides, at once


def test_the_first_pod_on_a_fresh_node_gets_its_assignment_when_the_kubelet_asks_first(
    tmp_path: Path,
) -> None:
    # The e2e scenario's whole-1 (1.36 series, run 11): the first pod bound to a node, allocated
    # before the agent's watch delivered its binding; no pod there had carried an assignment yet.
    snap = snapshot()
    units = [d.id for d in snap.inventory.by_resource(MEM)]
    gpu = snap.inventory.by_resource(MEM)[-1].gpu_uuid
    book = book_with(tmp_path)

    async def admit() -> tuple[list[str] | None, str]:
        asking = asyncio.create_task(book.prefer(snap, MEM, units, [], 3, replica_placement="spread"))
        await asyncio.sleep(0.2)
        assert not asking.done()
        book.apply(WatchEvent(ADDED, object=pod("first", 3, {ASSIGNMENT_ANNOTATION: gpu}, rv="7")))
        preferred = await asking
        assert preferred is not None
        return preferred, await book.allocated(snap, MEM, preferred)

    preferred, holder = asyncio.run(admit())
    assert holder == "ns/first" and gpus_of(snap, preferred) == {gpu}


def test_a_mig_device_on_the_assigned_gpu_is_the_assignment_followed(tmp_path: Path) -> None:
    cfg = parse_config(yaml.safe_load("flags: {migStrategy: mixed}"), "node.yaml")
    snap = Snapshot(version=1, inventory=build_inventory(SimBackend.from_profile("a100-mig").gpus(), cfg))
    resource = mig_resource_name("1g.10gb")
    migs = snap.inventory.by_resource(resource)
    parents = sorted({d.gpu_uuid for d in migs})
    assigned = parents[-1]  # the extender assigns the MIG device's parent GPU
    book = AssignmentBook(
        node_name="n", state_dir=tmp_path, client_factory=no_client, served=lambda: (resource,)
    )
    book.apply(WatchEvent(SYNC, items=(pod("m", 1, {ASSIGNMENT_ANNOTATION: assigned}, resource=resource),)))

    async def admit() -> tuple[list[str] | None, str]:
        preferred = await book.prefer(snap, resource, [d.id for d in migs], [], 1, replica_placement="spread")
        assert preferred is not None
        return preferred, await book.allocated(snap, resource, preferred)

    preferred, holder = asyncio.run(admit())
    assert len(parents) > 1 and holder == "ns/m"
    assert preferred is not None and len(preferred) == 1
    assert gpus_of(snap, preferred) == {assigned}  # not the lowest ID's GPU
    assert book.outcomes == {"followed": 1, "no_assignment": 0, "not_possible": 0}
    assert book.carried_out["uid-m"] == [device(snap, preferred[0]).target_uuid]
