"""AssignmentBook on its own: which pods it keeps, what it refuses to take from an annotation, and what
an assignment that names a GPU not on this node comes to."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from gpunode.config.agent import parse_config
from gpunode.contract.names import ALLOCATED_ANNOTATION, ASSIGNMENT_ANNOTATION
from gpunode.errors import KubeError
from gpunode.infra.kube import MODIFIED, SYNC, WatchEvent
from gpunode.node.assignments import AssignmentBook, parse_assignment
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import build_inventory
from gpunode.node.state import Snapshot

MEM = "gpunode.io/gpu-memory"


def snapshot() -> Snapshot:
    cfg = parse_config({"gpunode": {"fractional": {"devices": [0, 1, 2, 3], "unit": "1Gi"}}}, "node.yaml")
    return Snapshot(version=1, inventory=build_inventory(SimBackend.from_profile("t4").gpus(), cfg))


def pod(name: str, units: int, annotations: dict[str, str], *, phase: str = "Pending") -> Pod:
    doc = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "annotations": annotations},
        "spec": {"nodeName": "n", "containers": [{"name": "c", "resources": {"limits": {MEM: str(units)}}}]},
        "status": {"phase": phase},
    }
    return msgspec.json.decode(json.dumps(doc).encode(), type=Pod)


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
