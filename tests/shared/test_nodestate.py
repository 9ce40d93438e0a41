"""The node GPU-state annotation: encode/decode, its JSON Schema, and clear errors for bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from gpunode.contract.nodestate import (
    ANNOTATION_KEY,
    GpuRecord,
    MigInstance,
    NodeGpuState,
    decode,
    encode,
    load_schema,
)
from gpunode.errors import GpunodeError, NodeStateError
from gpunode.placement import GpuState, NodeState, Request, candidate_gpus, unfit_reason
from gpunode.placement.published import node_state, published_state

GIB = 2**30


def sample_state() -> NodeGpuState:
    return NodeGpuState(
        node="gpu-node-7",
        updated=1732252800.25,
        generation=42,
        cpu_milli_free=60_000,
        memory_free_bytes=256 * GIB,
        gpus=(
            GpuRecord(
                uuid="GPU-aaaa",
                index=0,
                model="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=80 * GIB,
                milli_capacity=1000,
                milli_assigned=250,
                memory_assigned_bytes=20 * GIB,
                healthy=True,
                sharing="fractional",
                nvlink_peers=("GPU-bbbb",),
                numa_node=0,
                pods=("team-a/train-0",),
            ),
            GpuRecord(
                uuid="GPU-bbbb",
                index=1,
                model="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=80 * GIB,
                healthy=False,
                sharing="whole",
                nvlink_peers=("GPU-aaaa",),
                numa_node=0,
            ),
            GpuRecord(
                uuid="GPU-cccc",
                index=2,
                model="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=80 * GIB,
                sharing="mig",
                numa_node=None,
                mig=(
                    MigInstance("1g.10gb", "MIG-1", False),
                    MigInstance("1g.10gb", "MIG-2", True),
                    MigInstance("3g.40gb", "MIG-3", False),
                ),
            ),
        ),
    )


def test_round_trip_keeps_every_field() -> None:
    state = sample_state()
    assert decode(encode(state), node="gpu-node-7") == state


def test_encoded_output_validates_against_the_schema() -> None:
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(json.loads(encode(sample_state())), schema)
    # A placement NodeState encodes too, and validates.
    node = NodeState(
        name="n1",
        gpus=(
            GpuState(
                uuid="GPU-1",
                index=0,
                model="T4",
                milli_free=400,
                memory_total_bytes=16 * GIB,
                memory_free_bytes=6 * GIB,
                numa_node=1,
                mig_free={},
            ),
        ),
        cpu_milli_free=1000,
        memory_free_bytes=GIB,
    )
    text = encode(published_state(node, generation=3, updated=10.0))
    jsonschema.validate(json.loads(text), schema)
    back = node_state(decode(text), cpu_milli_free=0, memory_free_bytes=0)
    assert back == node


def test_placement_view_turns_assigned_into_free() -> None:
    view = node_state(decode(encode(sample_state())), cpu_milli_free=1, memory_free_bytes=1)
    a, b, c = view.gpus
    assert (a.milli_free, a.memory_free_bytes) == (750, 60 * GIB)
    assert not b.healthy and b.sharing == "whole"
    assert c.mig_free == {"1g.10gb": 1, "3g.40gb": 1}
    assert a.nvlink_peers == frozenset({"GPU-bbbb"})
    assert view.cpu_milli_free == 60_000  # the annotation's own figure wins over the caller's default


def doc() -> dict[str, Any]:
    return json.loads(encode(sample_state()))


def mutate(path: str, value: object) -> str:
    d = doc()
    target: Any = d
    keys = path.split(".")
    for k in keys[:-1]:
        target = target[int(k)] if isinstance(target, list) else target[k]
    last = keys[-1]
    if value is _DELETE:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return json.dumps(d)


_DELETE = object()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("{not json", "broken JSON", id="broken-json"),
        pytest.param("[]", "expected an object", id="not-an-object"),
        pytest.param(mutate("version", "v2"), "version 'v2' is not supported", id="newer-version"),
        pytest.param(mutate("version", _DELETE), "version: required", id="no-version"),
        pytest.param(mutate("node", _DELETE), "node: required", id="no-node"),
        pytest.param(mutate("gpus", _DELETE), "gpus: required", id="no-gpus"),
        pytest.param(
            mutate("generation", -1),
            "generation: expected 0..9007199254740992, got -1",
            id="negative-generation",
        ),
        pytest.param(
            mutate("updated", "yesterday"), "updated: expected a 0..4.10244e+09 number", id="bad-updated"
        ),
        pytest.param(mutate("gpus.0.uuid", _DELETE), "gpus[0].uuid: required", id="no-uuid"),
        pytest.param(mutate("gpus.0.milliAssigned", 1200), "exceeds milliCapacity", id="over-assigned"),
        pytest.param(mutate("gpus.0.milliCapacity", 2000), "milliCapacity: expected 0..1000", id="capacity"),
        pytest.param(
            mutate("gpus.0.memoryAssignedBytes", 100 * GIB), "exceeds memoryTotalBytes", id="over-mem"
        ),
        pytest.param(mutate("gpus.0.health", "Sick"), "expected one of Healthy, Unhealthy", id="health"),
        pytest.param(mutate("gpus.0.sharing", "shared"), "expected one of whole", id="sharing"),
        pytest.param(mutate("gpus.0.index", True), "expected an integer", id="bool-index"),
        pytest.param(mutate("gpus.1.uuid", "GPU-aaaa"), "duplicate GPU UUIDs", id="duplicate-uuid"),
        pytest.param(
            mutate("gpus.0.nvlinkPeers", ["GPU-zzzz"]), "NVLink peer that is not", id="unknown-peer"
        ),
        pytest.param(
            mutate("gpus.2.mig.0.assigned", "no"), "assigned: expected true or false", id="mig-flag"
        ),
        pytest.param(mutate("gpus.0.pods", [""]), "non-empty strings", id="empty-pod"),
        pytest.param(mutate("gpus.0.servesWhole", "no"), "expected true or false", id="serves-whole-type"),
        pytest.param(
            mutate("gpus.1.servesWhole", False), "cannot be false for a whole GPU", id="whole-not-whole"
        ),
        pytest.param(mutate("gpus.2.servesWhole", True), "cannot be true for a mig GPU", id="mig-whole"),
    ],
)
def test_bad_annotations_raise_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(NodeStateError) as err:
        decode(text)
    assert message in str(err.value)
    assert isinstance(err.value, GpunodeError) and err.value.hint


def test_node_name_must_match_and_unknown_fields_are_ignored() -> None:
    with pytest.raises(NodeStateError, match="says 'gpu-node-7'"):
        decode(encode(sample_state()), node="other")
    d = doc()
    d["futureField"] = {"x": 1}
    d["gpus"][0]["futureGpuField"] = 3
    state = decode(json.dumps(d))
    assert state.extra == {"futureField": {"x": 1}} and state.gpus[0] == sample_state().gpus[0]


def test_oversized_and_non_utf8_text_is_refused() -> None:
    with pytest.raises(NodeStateError, match="bytes is more than"):
        decode("x" * (300 * 1024))
    with pytest.raises(NodeStateError, match="not UTF-8"):
        decode(b"\xff\xfe")


def test_schema_refuses_what_decode_refuses() -> None:
    schema = load_schema()
    for path, value in (
        ("version", "v2"),
        ("gpus.0.health", "Sick"),
        ("gpus.0.milliCapacity", 2000),
        ("gpus.0.servesWhole", "no"),
        ("gpus.1.servesWhole", False),
        ("gpus.2.servesWhole", True),
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(mutate(path, value)), schema)


def test_serves_whole_is_published_and_defaults_to_the_safe_reading() -> None:
    """servesWhole round-trips; an annotation without it (an agent from before the field) means a
    fractional GPU takes no whole-GPU request while a whole GPU still does, and the placement view
    carries it: a whole request does not fit a free GPU shared by memory only, and says why."""
    state = sample_state()
    shared = replace(state.gpus[0], milli_assigned=0, memory_assigned_bytes=0, pods=(), serves_whole=False)
    free_whole = replace(state.gpus[1], healthy=True)
    state = replace(state, gpus=(shared, free_whole, state.gpus[2]))
    d = json.loads(encode(state))
    assert [g["servesWhole"] for g in d["gpus"]] == [False, True, False]
    jsonschema.validate(d, load_schema())
    assert decode(encode(state)) == state
    for g in d["gpus"]:
        del g["servesWhole"]
    old = decode(json.dumps(d))
    assert [g.serves_whole for g in old.gpus] == [False, True, False]
    jsonschema.validate(d, load_schema())
    view = node_state(old, cpu_milli_free=1, memory_free_bytes=1)
    assert not view.gpus[0].serves_whole and view.gpus[0].fully_free
    assert candidate_gpus(view, Request(gpus=1)) == (view.gpus[1],)
    reason = unfit_reason(view, Request(gpus=2))
    assert reason == (
        "insufficient whole GPUs: 1 free, 2 requested; 1 more free but shared by memory only (not offered whole)"
    )
    # Stated true, a fractional GPU that is fully free takes a whole request.
    d["gpus"][0]["servesWhole"] = True
    view = node_state(decode(json.dumps(d)), cpu_milli_free=1, memory_free_bytes=1)
    assert unfit_reason(view, Request(gpus=2)) is None


def test_annotation_key() -> None:
    assert ANNOTATION_KEY == "gpunode.io/gpu-state"
