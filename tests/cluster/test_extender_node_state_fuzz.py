"""One node's gpunode.io/gpu-state never fails a request about others: bounds, isolation, fuzzing.

The attack: a node annotation with numbers beyond any hardware (memoryTotalBytes of 2^63 or 2^64) made
placement overflow, filter and prioritize answer 500, and the bad node, kept in the cache, failed every
later request. These tests send such annotations, and a few thousand seeded mutations of real ones,
through the extender's request path (server._answer: what the HTTP server answers) next to good nodes.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunode.cluster.extender.core import Extender
from gpunode.cluster.extender.server import ExtenderServer, _answer
from gpunode.contract.names import Sharing
from gpunode.contract.nodestate import (
    MAX_GPU_MEMORY_BYTES,
    MAX_GPUS_PER_NODE,
    MAX_MIG_PER_GPU,
    GpuRecord,
    MigInstance,
    NodeGpuState,
    decode,
    encode,
    load_schema,
)
from gpunode.errors import NodeStateError
from tests.cluster.test_extender import gpu_state, v1_node, v1_pod

GIB = 2**30
POISON: list[Any] = [2**63, 2**64 - 1, 2**64, 2**63 - 1, 10**30, -1, -(2**63), 1e308, -1e308, 1e18,
          float("inf"), float("nan"), 0.5, True, None, "", "x" * 400, [], {}, [[]], 2**53 + 1]  # fmt: skip
PODS = [
    v1_pod("whole", limits={"nvidia.com/gpu": "1"}, uid="uid-whole"),
    v1_pod("memory", limits={"gpunode.io/gpu-memory": "10"}, uid="uid-memory"),
]


def mixed_state(node: str) -> str:
    """An annotation with every kind of GPU: whole, fractional (half used), MIG and time-sliced."""
    mig = tuple(MigInstance("1g.10gb", f"MIG-{node}-{i}", assigned=i == 0) for i in range(7))
    return encode(
        NodeGpuState(
            node=node,
            updated=1732252800.0,
            generation=3,
            cpu_milli_free=64000,
            memory_free_bytes=512 * GIB,
            gpus=(
                GpuRecord(f"GPU-{node}-0", 0, "NVIDIA H100", 80 * GIB, sharing=Sharing.WHOLE, numa_node=0),
                GpuRecord(
                    f"GPU-{node}-1", 1, "NVIDIA H100", 80 * GIB, milli_assigned=500,
                    memory_assigned_bytes=40 * GIB, sharing=Sharing.FRACTIONAL, serves_whole=False,
                    pods=("team-a/p0",), nvlink_peers=(f"GPU-{node}-0",), numa_node=1,
                ),
                GpuRecord(f"GPU-{node}-2", 2, "NVIDIA H100", 80 * GIB, sharing=Sharing.MIG, mig=mig),
                GpuRecord(f"GPU-{node}-3", 3, "NVIDIA H100", 80 * GIB, sharing=Sharing.TIME_SLICED),
            ),
        )
    )  # fmt: skip


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside a decoded JSON document."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths(v, (*prefix, i))
    return out


def mutated(doc: dict[str, Any], rng: random.Random) -> str:
    """The document with one to three random mutations, as annotation text."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(paths(doc))
        parent: Any = doc
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        action = rng.random()
        if action < 0.6:
            parent[last] = rng.choice(POISON)
        elif action < 0.7 and isinstance(parent, dict):
            del parent[last]
        elif action < 0.8 and isinstance(parent[last], list) and parent[last]:
            parent[last] = parent[last] * rng.choice([2, 9, 70])  # duplicates, too many GPUs or MIGs
        elif action < 0.9 and isinstance(parent[last], int | float) and not isinstance(parent[last], bool):
            parent[last] = parent[last] * rng.choice([2**20, 2**40, -1]) + rng.choice([0, 1])
        else:
            parent[last] = rng.choice([2**62, 2**40 + 1, 999, 1001, 10**6, 64, 65])
    return json.dumps(doc)


def ask(extender: Extender, verb: str, pod: dict[str, Any], nodes: list[dict[str, Any]]) -> Any:
    status, body = _answer(
        verb, getattr(extender, verb), orjson.dumps({"Pod": pod, "Nodes": {"items": nodes}})
    )
    assert status == 200, body
    return orjson.loads(body)


def good_nodes() -> list[dict[str, Any]]:
    return [v1_node("good-1", gpu_state("good-1", [1000] * 8)), v1_node("good-2", mixed_state("good-2"))]


def assert_good_placed(extender: Extender, pod: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
    result = ask(extender, "filter", pod, nodes)
    passed = [n["metadata"]["name"] for n in result["Nodes"]["items"]]
    assert "good-1" in passed, result["FailedNodes"]
    scores = {s["Host"]: s["Score"] for s in ask(extender, "prioritize", pod, nodes)}
    assert scores["good-1"] > 0 or scores.get("good-2", 0) > 0, scores


@pytest.mark.parametrize("value", [2**63, 2**64 - 1, 2**64, 2**62])
@pytest.mark.parametrize("key", ["memoryTotalBytes", "memoryAssignedBytes"])
def test_an_annotation_beyond_real_hardware_fails_its_node_only(key: str, value: int) -> None:
    """The issue's attack: filter and prioritize answer 200, the bad node fails with the field and the
    bound, the good nodes pass, and a later request naming only good nodes is answered as before."""
    extender = Extender()
    doc = json.loads(gpu_state("bad", [1000] * 8))
    for g in doc["gpus"]:
        g[key] = value
        g["memoryTotalBytes"] = max(g["memoryTotalBytes"], value)
    nodes = [v1_node("bad", json.dumps(doc)), *good_nodes()]
    for pod in PODS:
        result = ask(extender, "filter", pod, nodes)
        assert "memoryTotalBytes: expected 0..1099511627776" in result["FailedNodes"]["bad"]
        assert_good_placed(extender, pod, nodes)
        assert {s["Host"]: s["Score"] for s in ask(extender, "prioritize", pod, nodes)}["bad"] == 0
        assert_good_placed(extender, pod, good_nodes())  # the cache holds no poison


def test_an_annotation_beyond_real_hardware_over_http() -> None:
    """The same through the real server: 200 with the reason, never 500."""
    import http.client

    extender = Extender()
    server = ExtenderServer(extender, port=0)
    server.start()
    try:
        doc = json.loads(gpu_state("bad", [1000] * 8))
        doc["gpus"][0]["memoryTotalBytes"] = 2**64
        body = orjson.dumps(
            {"Pod": PODS[1], "Nodes": {"items": [v1_node("bad", json.dumps(doc)), *good_nodes()]}}
        )
        for verb in ("filter", "prioritize", "filter"):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("POST", f"/{verb}", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200, response.read()
            response.read()
            conn.close()
    finally:
        server.stop()


def test_thousands_of_mutated_annotations_never_fail_a_request() -> None:
    """A seeded mutation loop over real annotations (whole, fractional, MIG, time-sliced GPUs): decode
    refuses with NodeStateError or accepts; filter and prioritize answer 200 every time, with the good
    nodes of the same request placed, through one extender whose cache sees every mutation."""
    rng = random.Random(29)
    bases = [json.loads(gpu_state("bad", [1000, 500, 0, 1000])), json.loads(mixed_state("bad"))]
    extender = Extender()
    refused = 0
    for case in range(3000):
        text = mutated(rng.choice(bases), rng)
        try:
            decode(text, node="bad")
        except NodeStateError:
            refused += 1
        nodes = [v1_node("bad", text), *good_nodes()]
        pod = PODS[case % 2]
        result = ask(extender, "filter", pod, nodes)
        assert "good-1" in [n["metadata"]["name"] for n in result["Nodes"]["items"]]
        scores = {s["Host"]: s["Score"] for s in ask(extender, "prioritize", pod, nodes)}
        assert set(scores) == {"bad", "good-1", "good-2"} and all(0 <= s <= 10 for s in scores.values())
    assert 1000 < refused < 3000  # the mutations reach both refused and accepted annotations
    assert_good_placed(extender, PODS[0], good_nodes())


def test_the_bounds_are_named_in_the_schema() -> None:
    gpu = load_schema()["$defs"]["gpu"]["properties"]
    assert gpu["memoryTotalBytes"]["maximum"] == MAX_GPU_MEMORY_BYTES
    assert gpu["mig"]["maxItems"] == MAX_MIG_PER_GPU
    assert load_schema()["properties"]["gpus"]["maxItems"] == MAX_GPUS_PER_NODE


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["updated", "generation", "cpuMilliFree", "memoryFreeBytes", "gpus", "node"]),
       gpu_field=st.sampled_from(["index", "memoryTotalBytes", "milliCapacity", "milliAssigned", "mig",
                                  "memoryAssignedBytes", "numaNode", "pods", "nvlinkPeers", "uuid"]),
       value=json_values, gpu_value=json_values)  # fmt: skip
def test_decode_refuses_or_accepts_any_value_with_a_node_state_error(
    field: str, gpu_field: str, value: Any, gpu_value: Any
) -> None:
    doc = json.loads(mixed_state("n"))
    doc["gpus"][1][gpu_field] = gpu_value
    for text in (json.dumps({**doc, field: value}), json.dumps(doc)):
        try:
            state = decode(text, node="n")
        except NodeStateError:
            continue
        assert all(0 <= g.memory_total_bytes <= MAX_GPU_MEMORY_BYTES for g in state.gpus)


def test_a_node_status_beyond_real_hardware_fails_its_node_only() -> None:
    """The Node's own allocatable CPU and memory (used when the annotation carries none) are bounded too."""
    extender = Extender()
    bad = v1_node("bad", gpu_state("bad", [1000] * 8))
    bad["status"]["allocatable"]["memory"] = "1e30"
    bad["status"]["allocatable"]["cpu"] = "9223372036854775807"
    result = ask(extender, "filter", PODS[1], [bad, *good_nodes()])
    assert "status.allocatable." in result["FailedNodes"]["bad"]
    assert_good_placed(extender, PODS[1], [bad, *good_nodes()])
