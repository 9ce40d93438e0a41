"""A whole-GPU pod is offered only GPUs that their node gives whole (the annotation's servesWhole).

A node that shares a GPU in memory units advertises it only as gpunode.io/gpu-memory, so its agent
publishes servesWhole false for it. Assigning such a GPU to a pod asking for nvidia.com/gpu would send
the node an assignment it cannot carry out: the extender must leave these GPUs out, through its batch
path and its per-node path alike, say why in FailedNodes, and read an annotation from an agent that
predates the field as the safe "not offered whole".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.contract.names import GIB, Sharing
from gpunode.contract.nodestate import GpuRecord, NodeGpuState, encode
from tests.cluster.test_extender import node_list, v1_node, v1_pod


def annotation(node: str, gpus: Sequence[tuple[Sharing, bool]], *, drop_field: bool = False) -> str:
    """A node's annotation: fully free A100s with these (sharing, serves_whole); drop_field removes
    servesWhole from every GPU, as an agent from before the field published it."""
    state = NodeGpuState(
        node=node,
        updated=1732252800.0,
        generation=1,
        gpus=tuple(
            GpuRecord(
                uuid=f"GPU-{node}-{i}",
                index=i,
                model="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=80 * GIB,
                sharing=sharing,
                serves_whole=whole,
                numa_node=0,
            )
            for i, (sharing, whole) in enumerate(gpus)
        ),
    )
    if not drop_field:
        return encode(state)
    doc = json.loads(encode(state))
    for g in doc["gpus"]:
        del g["servesWhole"]
    return json.dumps(doc)


class RecordingBinder:
    """Binds by remembering the GPUs the extender chose."""

    def __init__(self, pods: Mapping[str, dict[str, Any]]) -> None:
        self.pods = pods
        self.bound: dict[str, tuple[str, tuple[str, ...]]] = {}

    def read_pod(self, *, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod as the test made it."""
        return self.pods.get(name)

    def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
        """Remember the binding."""
        self.bound[name] = (node, gpu_uuids)


FRAC, WHOLE = Sharing.FRACTIONAL, Sharing.WHOLE
NODES = node_list(
    v1_node("shared", annotation("shared", [(FRAC, False)] * 4)),  # all shared by memory: the batch path
    v1_node("old-agent", annotation("old-agent", [(FRAC, True)] * 4, drop_field=True)),  # no servesWhole
    v1_node("mixed", annotation("mixed", [(FRAC, False), (FRAC, False), (WHOLE, True)])),  # per-node path
    v1_node("offered", annotation("offered", [(FRAC, True)] * 2)),  # shared and also offered whole
)
SHARED_ONLY = "shared by memory only (not offered whole)"


def test_filter_leaves_out_gpus_not_offered_whole_and_says_why() -> None:
    extender = Extender(config=ExtenderConfig(policy="gpunode"))
    one = extender.filter({"Pod": v1_pod("one"), "Nodes": NODES, "NodeNames": None})
    assert [n["metadata"]["name"] for n in one["Nodes"]["items"]] == ["mixed", "offered"]
    assert one["FailedNodes"] == {
        "shared": f"insufficient whole GPUs: 0 free, 1 requested; 4 more free but {SHARED_ONLY}",
        "old-agent": f"insufficient whole GPUs: 0 free, 1 requested; 4 more free but {SHARED_ONLY}",
    }
    two = extender.filter(
        {
            "Pod": v1_pod("two", uid="uid-two", limits={"nvidia.com/gpu": "2"}),
            "Nodes": NODES,
            "NodeNames": None,
        }
    )
    assert [n["metadata"]["name"] for n in two["Nodes"]["items"]] == ["offered"]
    assert (
        two["FailedNodes"]["mixed"]
        == f"insufficient whole GPUs: 1 free, 2 requested; 2 more free but {SHARED_ONLY}"
    )
    # A fraction still takes the GPUs shared by memory, everywhere (a fresh extender: the two-GPU pod,
    # passing one node only, holds a provisional reservation of both GPUs of "offered").
    frac = Extender(config=ExtenderConfig(policy="gpunode")).filter(
        {
            "Pod": v1_pod("frac", uid="uid-frac", limits={"gpunode.io/gpu-memory": "10"}),
            "Nodes": NODES,
            "NodeNames": None,
        }
    )
    assert [n["metadata"]["name"] for n in frac["Nodes"]["items"]] == [
        "shared",
        "old-agent",
        "mixed",
        "offered",
    ]


def test_bind_on_a_mixed_node_assigns_its_whole_gpu() -> None:
    pod = v1_pod("one", uid="uid-one")
    binder = RecordingBinder({"one": pod})
    extender = Extender(config=ExtenderConfig(policy="gpunode"), binder=binder)
    mixed = node_list(NODES["items"][2])
    answer = extender.filter({"Pod": pod, "Nodes": mixed, "NodeNames": None})
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["mixed"]
    result = extender.bind({"PodName": "one", "PodNamespace": "team-a", "PodUID": "uid-one", "Node": "mixed"})
    assert result.get("Error", "") == ""
    assert binder.bound["one"] == ("mixed", ("GPU-mixed-2",))
    # The whole GPU is now reserved; a second whole pod finds nothing it may take on the node.
    second = v1_pod("second", uid="uid-second")
    again = extender.filter({"Pod": second, "Nodes": mixed, "NodeNames": None})
    assert (
        again["FailedNodes"]["mixed"]
        == f"insufficient whole GPUs: 0 free, 1 requested; 2 more free but {SHARED_ONLY}"
    )
