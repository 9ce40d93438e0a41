"""The node GPU-state annotation: the versioned JSON the agent publishes and the extender reads.

Key `gpunode.io/gpu-state` on the Node object. Version v1 (JSON, camelCase):

    {
      "version": "v1",
      "node": "gpu-node-7",              # must equal the Node's name
      "updated": 1732252800.25,          # unix seconds of the last change or refresh
      "generation": 42,                  # increases by one on every change the agent publishes
      "cpuMilliFree": 60000,             # optional: CPU the node can still give pods (milli-cores)
      "memoryFreeBytes": 274877906944,   # optional: memory the node can still give pods
      "gpus": [{
        "uuid": "GPU-...", "index": 0, "model": "NVIDIA A100-SXM4-80GB",
        "memoryTotalBytes": 85899345920,
        "milliCapacity": 1000,           # compute share this GPU offers (1000 = all of it)
        "milliAssigned": 250,            # compute share handed out
        "memoryAssignedBytes": 21474836480,
        "health": "Healthy",             # or "Unhealthy"
        "sharing": "fractional",         # whole | fractional | time-sliced | mig
        "mig": [{"profile": "1g.10gb", "uuid": "MIG-...", "assigned": false}],
        "nvlinkPeers": ["GPU-..."],
        "numaNode": 0,                   # null when unknown
        "pods": ["team-a/train-0"]       # optional: namespace/name of the pods holding it
      }]
    }

decode() checks every field (types, ranges, that assigned never exceeds
capacity, that UUIDs are unique and peers exist) and raises NodeStateError (a
GpunodeError) with the field path for anything wrong; it refuses versions it
does not know, newer ones included, rather than guess. Readers that see an
unknown field ignore it, so v1 can grow optional fields. The JSON Schema of v1
ships as gpunode/examples/node-gpu-state-v1.schema.json.

This module converts between JSON and placement's NodeState; it does no I/O.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpunode.errors import GpunodeError
from gpunode.placement import MILLI_PER_GPU, SHARING_MODES, GpuState, NodeState, PlacementError

ANNOTATION_KEY = "gpunode.io/gpu-state"
VERSION = "v1"
SUPPORTED_VERSIONS = (VERSION,)
HEALTH_VALUES = ("Healthy", "Unhealthy")
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "examples" / "node-gpu-state-v1.schema.json"
MAX_TEXT_BYTES = 256 * 1024  # an annotation value larger than this is refused before parsing


class NodeStateError(GpunodeError):
    """A node GPU-state annotation that cannot be used: broken JSON, a bad field, an unknown version."""

    default_hint = (
        "the gpunode agent on that node publishes this annotation; check that it runs and that its "
        "version matches the extender's (gpunode.io/gpu-state must be version v1)"
    )


@dataclass(frozen=True)
class MigInstance:
    profile: str
    uuid: str
    assigned: bool


@dataclass(frozen=True)
class GpuRecord:
    """One GPU as published: capacity and what is assigned, rather than what is free."""

    uuid: str
    index: int
    model: str
    memory_total_bytes: int
    milli_capacity: int = MILLI_PER_GPU
    milli_assigned: int = 0
    memory_assigned_bytes: int = 0
    healthy: bool = True
    sharing: str = "fractional"
    mig: tuple[MigInstance, ...] = ()
    nvlink_peers: tuple[str, ...] = ()
    numa_node: int | None = None
    pods: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeGpuState:
    """The decoded annotation."""

    node: str
    updated: float
    generation: int
    gpus: tuple[GpuRecord, ...]
    cpu_milli_free: int | None = None
    memory_free_bytes: int | None = None
    version: str = VERSION
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def pods(self) -> frozenset[str]:
        """namespace/name of every pod the annotation says holds a GPU or a share of one."""
        return frozenset(p for g in self.gpus for p in g.pods)

    def to_node_state(
        self, *, cpu_milli_free: int, memory_free_bytes: int, labels: Mapping[str, str] | None = None
    ) -> NodeState:
        """Placement's view; the CPU/memory given are used when the annotation does not carry them."""
        gpus = []
        for g in self.gpus:
            mig_free: dict[str, int] = {}
            for m in g.mig:
                mig_free.setdefault(m.profile, 0)
                if not m.assigned:
                    mig_free[m.profile] += 1
            gpus.append(
                GpuState(
                    uuid=g.uuid,
                    index=g.index,
                    model=g.model,
                    milli_free=max(0, g.milli_capacity - g.milli_assigned),
                    memory_total_bytes=g.memory_total_bytes,
                    memory_free_bytes=max(0, g.memory_total_bytes - g.memory_assigned_bytes),
                    numa_node=g.numa_node,
                    nvlink_peers=frozenset(g.nvlink_peers),
                    healthy=g.healthy,
                    mig_free=mig_free,
                    sharing=g.sharing,  # type: ignore[arg-type]
                )
            )
        try:
            return NodeState(
                name=self.node,
                gpus=tuple(gpus),
                cpu_milli_free=self.cpu_milli_free if self.cpu_milli_free is not None else cpu_milli_free,
                memory_free_bytes=self.memory_free_bytes
                if self.memory_free_bytes is not None
                else memory_free_bytes,
                labels=labels or {},
            )
        except PlacementError as exc:
            raise NodeStateError(f"node {self.node}: {exc.message}") from exc


# ----- encode --------------------------------------------------------------------------------------


def _gpu_to_json(g: GpuRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "uuid": g.uuid,
        "index": g.index,
        "model": g.model,
        "memoryTotalBytes": g.memory_total_bytes,
        "milliCapacity": g.milli_capacity,
        "milliAssigned": g.milli_assigned,
        "memoryAssignedBytes": g.memory_assigned_bytes,
        "health": "Healthy" if g.healthy else "Unhealthy",
        "sharing": g.sharing,
        "mig": [{"profile": m.profile, "uuid": m.uuid, "assigned": m.assigned} for m in g.mig],
        "nvlinkPeers": list(g.nvlink_peers),
        "numaNode": g.numa_node,
    }
    if g.pods:
        out["pods"] = list(g.pods)
    return out


def record_from_gpu_state(gpu: GpuState, *, pods: Sequence[str] = ()) -> GpuRecord:
    """A GpuRecord from placement's GpuState (free turned back into assigned; MIG as counts of free)."""
    mig = tuple(
        MigInstance(profile=profile, uuid=f"{gpu.uuid}/{profile}/{i}", assigned=False)
        for profile, n in sorted(gpu.mig_free.items())
        for i in range(n)
    )
    return GpuRecord(
        uuid=gpu.uuid,
        index=gpu.index,
        model=gpu.model,
        memory_total_bytes=gpu.memory_total_bytes,
        milli_capacity=MILLI_PER_GPU,
        milli_assigned=MILLI_PER_GPU - gpu.milli_free,
        memory_assigned_bytes=gpu.memory_total_bytes - gpu.memory_free_bytes,
        healthy=gpu.healthy,
        sharing=gpu.sharing,
        mig=mig,
        nvlink_peers=tuple(sorted(gpu.nvlink_peers)),
        numa_node=gpu.numa_node,
        pods=tuple(pods),
    )


def encode(state: NodeGpuState | NodeState, *, generation: int = 0, updated: float | None = None) -> str:
    """The annotation value (compact JSON) for a NodeGpuState, or for a placement NodeState."""
    if isinstance(state, NodeState):
        state = NodeGpuState(
            node=state.name,
            updated=time.time() if updated is None else updated,
            generation=generation,
            gpus=tuple(record_from_gpu_state(g) for g in state.gpus),
            cpu_milli_free=state.cpu_milli_free,
            memory_free_bytes=state.memory_free_bytes,
        )
    doc: dict[str, Any] = {
        "version": VERSION,
        "node": state.node,
        "updated": state.updated,
        "generation": state.generation,
    }
    if state.cpu_milli_free is not None:
        doc["cpuMilliFree"] = state.cpu_milli_free
    if state.memory_free_bytes is not None:
        doc["memoryFreeBytes"] = state.memory_free_bytes
    doc["gpus"] = [_gpu_to_json(g) for g in state.gpus]
    return json.dumps(doc, separators=(",", ":"), sort_keys=False)


# ----- decode --------------------------------------------------------------------------------------


class _Reader:
    """Typed access to one JSON object, with the path of each field for error messages."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, dict):
            raise NodeStateError(f"{where}: expected an object, got {type(data).__name__}")
        self.data = data
        self.where = where

    def _get(self, key: str, required: bool) -> Any:
        if key not in self.data or self.data[key] is None:
            if required:
                raise NodeStateError(f"{self.where}.{key}: required field is missing")
            return None
        return self.data[key]

    def opt_int(
        self, key: str, *, required: bool = True, minimum: int = 0, maximum: int | None = None
    ) -> int | None:
        value = self._get(key, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise NodeStateError(f"{self.where}.{key}: expected an integer, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
            raise NodeStateError(f"{self.where}.{key}: expected {bound}, got {value}")
        return value

    def req_int(self, key: str, *, minimum: int = 0, maximum: int | None = None) -> int:
        value = self.opt_int(key, minimum=minimum, maximum=maximum)
        assert value is not None
        return value

    def text(self, key: str, *, required: bool = True, choices: Sequence[str] = ()) -> str:
        value = self._get(key, required)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise NodeStateError(f"{self.where}.{key}: expected a string, got {value!r}")
        if choices and value not in choices:
            raise NodeStateError(f"{self.where}.{key}: expected one of {', '.join(choices)}, got {value!r}")
        return value

    def seconds(self, key: str) -> float:
        value = self._get(key, True)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise NodeStateError(
                f"{self.where}.{key}: expected a non-negative number of seconds, got {value!r}"
            )
        return float(value)

    def items(self, key: str, *, required: bool = True) -> list[Any]:
        value = self._get(key, required)
        if value is None:
            return []
        if not isinstance(value, list):
            raise NodeStateError(f"{self.where}.{key}: expected a list, got {type(value).__name__}")
        return value

    def text_list(self, key: str) -> tuple[str, ...]:
        items = self.items(key, required=False)
        if not all(isinstance(i, str) and i for i in items):
            raise NodeStateError(f"{self.where}.{key}: expected a list of non-empty strings")
        return tuple(items)


def _decode_gpu(data: object, where: str) -> GpuRecord:
    r = _Reader(data, where)
    uuid = r.text("uuid")
    if not uuid:
        raise NodeStateError(f"{where}.uuid: cannot be empty")
    memory_total = r.req_int("memoryTotalBytes")
    capacity = r.req_int("milliCapacity", maximum=MILLI_PER_GPU)
    assigned = r.req_int("milliAssigned")
    memory_assigned = r.req_int("memoryAssignedBytes")
    if assigned > capacity:
        raise NodeStateError(f"{where}.milliAssigned: {assigned} exceeds milliCapacity {capacity}")
    if memory_assigned > memory_total:
        raise NodeStateError(
            f"{where}.memoryAssignedBytes: {memory_assigned} exceeds memoryTotalBytes {memory_total}"
        )
    mig = []
    for i, item in enumerate(r.items("mig")):
        m = _Reader(item, f"{where}.mig[{i}]")
        assigned_flag = m._get("assigned", True)
        if not isinstance(assigned_flag, bool):
            raise NodeStateError(f"{where}.mig[{i}].assigned: expected true or false, got {assigned_flag!r}")
        profile, mig_uuid = m.text("profile"), m.text("uuid")
        if not profile or not mig_uuid:
            raise NodeStateError(f"{where}.mig[{i}]: profile and uuid cannot be empty")
        mig.append(MigInstance(profile=profile, uuid=mig_uuid, assigned=assigned_flag))
    return GpuRecord(
        uuid=uuid,
        index=r.req_int("index"),
        model=r.text("model"),
        memory_total_bytes=memory_total,
        milli_capacity=capacity,
        milli_assigned=assigned,
        memory_assigned_bytes=memory_assigned,
        healthy=r.text("health", choices=HEALTH_VALUES) == "Healthy",
        sharing=r.text("sharing", choices=SHARING_MODES),
        mig=tuple(mig),
        nvlink_peers=r.text_list("nvlinkPeers"),
        numa_node=r.opt_int("numaNode", required=False),
        pods=r.text_list("pods"),
    )


def decode(text: str | bytes, *, node: str | None = None) -> NodeGpuState:
    """Parse and check an annotation value; `node`, when given, must match the annotation's node."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise NodeStateError(f"{ANNOTATION_KEY}: not UTF-8: {exc}") from exc
    if not isinstance(text, str):
        raise NodeStateError(f"{ANNOTATION_KEY}: expected a JSON string, got {type(text).__name__}")
    if len(text) > MAX_TEXT_BYTES:
        raise NodeStateError(
            f"{ANNOTATION_KEY}: {len(text)} bytes is more than the {MAX_TEXT_BYTES} accepted"
        )
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise NodeStateError(f"{ANNOTATION_KEY}: broken JSON: {exc}") from exc
    r = _Reader(data, ANNOTATION_KEY)
    version = r.text("version")
    if version not in SUPPORTED_VERSIONS:
        raise NodeStateError(
            f"{ANNOTATION_KEY}: version {version!r} is not supported (this extender reads "
            f"{', '.join(SUPPORTED_VERSIONS)})",
            hint="run an extender at least as new as the agents, or pin the agents to publish v1",
        )
    name = r.text("node")
    if not name:
        raise NodeStateError(f"{ANNOTATION_KEY}.node: cannot be empty")
    if node is not None and name != node:
        raise NodeStateError(f"{ANNOTATION_KEY}.node: says {name!r} but it is on node {node!r}")
    gpus = tuple(_decode_gpu(g, f"{ANNOTATION_KEY}.gpus[{i}]") for i, g in enumerate(r.items("gpus")))
    uuids = [g.uuid for g in gpus]
    if len(set(uuids)) != len(uuids):
        raise NodeStateError(f"{ANNOTATION_KEY}.gpus: duplicate GPU UUIDs")
    indexes = [g.index for g in gpus]
    if len(set(indexes)) != len(indexes):
        raise NodeStateError(f"{ANNOTATION_KEY}.gpus: duplicate GPU indexes")
    known = set(uuids)
    for g in gpus:
        if g.uuid in g.nvlink_peers or any(p not in known for p in g.nvlink_peers):
            raise NodeStateError(
                f"{ANNOTATION_KEY}.gpus: GPU {g.uuid} lists an NVLink peer that is not on the node"
            )
    known_keys = {"version", "node", "updated", "generation", "cpuMilliFree", "memoryFreeBytes", "gpus"}
    return NodeGpuState(
        node=name,
        updated=r.seconds("updated"),
        generation=r.req_int("generation"),
        gpus=gpus,
        cpu_milli_free=r.opt_int("cpuMilliFree", required=False),
        memory_free_bytes=r.opt_int("memoryFreeBytes", required=False),
        version=version,
        extra={k: v for k, v in data.items() if k not in known_keys},
    )


def load_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the v1 annotation."""
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return schema
