"""The node GPU-state annotation: the versioned JSON the agent publishes and the extender reads.

Key `gpunode.io/gpu-state` on the Node object. Version v1 (JSON, camelCase):

    {
      "version": "v1",
      "node": "gpu-node-7",              # must equal the Node's name
      "updated": 1732252800.25,          # unix seconds when the agent published this value
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
        "sharing": "fractional",         # whole | fractional | time-sliced | mig | dra
        "servesWhole": false,            # optional: whether a whole-GPU request (nvidia.com/gpu) may take it
        "mig": [{"profile": "1g.10gb", "uuid": "MIG-...", "assigned": false}],
        "nvlinkPeers": ["GPU-..."],
        "numaNode": 0,                   # null when unknown
        "pods": ["team-a/train-0"]       # optional: namespace/name of the pods holding it
      }]
    }

`servesWhole` says whether the node gives this GPU to a whole-GPU request
when it is fully free, i.e. whether the agent also advertises it as
nvidia.com/gpu. A `whole` GPU always does and a `mig`, `time-sliced` or `dra`
one never does (the other value is refused); for a `fractional` GPU it is the
agent's word. The field was added to v1 as an optional one (old readers ignore
it, so no new version): an annotation without it means `sharing == "whole"`,
the safe reading of an agent from before it, which advertised fractional GPUs
only as memory units. Read as true, such an agent's free fractional GPUs would
be assigned to whole-GPU pods that the node then places elsewhere.

A `dra` GPU is served through the DRA kubelet plugin (gpunode.dra.devices)
and advertised nothing by the device plugin: the scheduler extender places no
device-plugin pod on it, and its claims are allocated by kube-scheduler from the
node's ResourceSlices. An extender from before `dra` refuses such an annotation
(an unknown value), so it leaves that node to kube-scheduler alone.

`updated` is the publication time: the agent sets it on every publish, on a
change and on its periodic refresh (nodeState.interval, 60 s by default) even
when nothing changed, so readers can tell a node whose agent stopped publishing
(the extender's --node-state-max-age). It is written with the agent's clock; a
reader refuses one further in the future than the clocks may differ (the
extender's --node-state-max-skew).

decode() checks every field (types, ranges within the MAX_* bounds below, which
are what real hardware has with room to spare, that assigned never exceeds
capacity, that UUIDs are unique and peers exist) and raises NodeStateError (a
GpunodeError) with the field path for anything wrong; it refuses versions it
does not know, newer ones included, rather than guess. Readers that see an
unknown field ignore it, so v1 can grow optional fields. The JSON Schema of v1
ships as gpunode/examples/node-gpu-state-v1.schema.json.

This module converts between JSON and these records; it does no I/O.
Placement's view of a node (free rather than assigned) is built from them by
gpunode.placement.published, so the contract depends on nothing above it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpunode.contract.names import MILLI_PER_GPU, NODE_STATE_ANNOTATION, SHARING_MODES, TIB, Sharing
from gpunode.contract.reader import SectionReader, excerpt
from gpunode.errors import NodeStateError

ANNOTATION_KEY = NODE_STATE_ANNOTATION
VERSION = "v1"
SUPPORTED_VERSIONS = (VERSION,)
HEALTH_VALUES = ("Healthy", "Unhealthy")
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "examples" / "node-gpu-state-v1.schema.json"
MAX_TEXT_BYTES = 256 * 1024  # an annotation value larger than this is refused before parsing

# Bounds of every number and list of v1, from what real hardware has with room to spare. A value beyond
# one is refused (NodeStateError): placement works in 64-bit integers, and no count or size here can
# overflow them, even summed over a node's GPUs and multiplied by MILLI_PER_GPU.
MAX_GPUS_PER_NODE = 64  # DGX/HGX systems have 8 or 16 GPUs
MAX_GPU_MEMORY_BYTES = TIB  # the largest GPUs (B300) have 288 GB
MAX_MIG_PER_GPU = 7  # A100, H100, H200, B200: at most 7 GPU instances
MAX_PODS_PER_GPU = 1024  # pods sharing one GPU (time-slicing allows 48; 1Gi memory units ~300)
MAX_NODE_CPU_MILLI = 16384 * 1000  # 16,384 cores; the largest servers have under 2,000 threads
MAX_NODE_MEMORY_BYTES = 64 * TIB  # the largest servers have 32-48 TiB
MAX_NUMA_NODE = 1023  # Linux's MAX_NUMNODES is at most 1024
MAX_GENERATION = 2**53  # a JSON-safe integer; the agent adds one per change
MAX_UPDATED = 4102444800.0  # 2100-01-01T00:00:00Z, unix seconds
MAX_NAME_CHARS = 320  # a UUID, model, MIG profile or pod namespace/name (253 + 1 + 63)


@dataclass(frozen=True)
class MigInstance:
    """One MIG instance of a GPU: its profile, its UUID, and whether a container holds it."""

    profile: str
    uuid: str
    assigned: bool


@dataclass(frozen=True)
class GpuRecord:
    """One GPU as published: capacity and what is assigned, rather than what is free.

    serves_whole defaults to True, as placement's GpuState does (in-process callers that model a
    GPU serving both); the agent states it for every GPU, and decode() reads an absent servesWhole
    as the safe False for a fractional GPU (see the module docstring).
    """

    uuid: str
    index: int
    model: str
    memory_total_bytes: int
    milli_capacity: int = MILLI_PER_GPU
    milli_assigned: int = 0
    memory_assigned_bytes: int = 0
    healthy: bool = True
    sharing: Sharing = Sharing.FRACTIONAL
    mig: tuple[MigInstance, ...] = ()
    nvlink_peers: tuple[str, ...] = ()
    numa_node: int | None = None
    pods: tuple[str, ...] = ()
    serves_whole: bool = True  # for fractional GPUs; whole ones always True, MIG/time-sliced False

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharing", Sharing(self.sharing))
        object.__setattr__(self, "serves_whole", whole_by_mode(self.sharing, self.serves_whole))


def whole_by_mode(sharing: Sharing, stated: bool) -> bool:
    """Whether a GPU in `sharing` mode serves whole-GPU requests, given what is stated for a fractional one."""
    if sharing == Sharing.WHOLE:
        return True
    return stated if sharing == Sharing.FRACTIONAL else False


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
        "sharing": g.sharing.value,
        "servesWhole": g.serves_whole,
        "mig": [{"profile": m.profile, "uuid": m.uuid, "assigned": m.assigned} for m in g.mig],
        "nvlinkPeers": list(g.nvlink_peers),
        "numaNode": g.numa_node,
    }
    if g.pods:
        out["pods"] = list(g.pods)
    return out


def encode(state: NodeGpuState) -> str:
    """The annotation value (compact JSON) of a NodeGpuState."""
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


def _reader(data: object, where: str) -> SectionReader:
    """A strict reader of one JSON object of the annotation; every refusal is a NodeStateError."""
    return SectionReader(data, where, error=NodeStateError, json_object=True)


def _decode_mig(r: SectionReader) -> MigInstance:
    assigned = r.flag("assigned")
    profile, uuid = _name(r, "profile"), _name(r, "uuid")
    return MigInstance(profile=profile, uuid=uuid, assigned=assigned)


def _name(r: SectionReader, key: str, *, empty: bool = False) -> str:
    """A string (non-empty unless `empty`) of at most MAX_NAME_CHARS characters."""
    value = r.get(key, str)
    if not value and not empty:
        raise r.fail(key, "cannot be empty")
    if len(value) > MAX_NAME_CHARS:
        raise r.fail(key, f"{len(value)} characters is more than the {MAX_NAME_CHARS} accepted")
    return value


def _names(r: SectionReader, key: str, most: int) -> tuple[str, ...]:
    """A list of at most `most` non-empty strings of at most MAX_NAME_CHARS characters each."""
    values = r.text_list(key, ())
    if len(values) > most:
        raise r.fail(key, f"{len(values)} entries is more than the {most} accepted")
    if any(len(v) > MAX_NAME_CHARS for v in values):
        raise r.fail(key, f"an entry is longer than the {MAX_NAME_CHARS} characters accepted")
    return values


def _decode_gpu(r: SectionReader) -> GpuRecord:
    uuid = _name(r, "uuid")
    memory_total = r.integer("memoryTotalBytes", minimum=0, maximum=MAX_GPU_MEMORY_BYTES)
    capacity = r.integer("milliCapacity", minimum=0, maximum=MILLI_PER_GPU)
    assigned = r.integer("milliAssigned", minimum=0)  # at most milliCapacity, below
    memory_assigned = r.integer("memoryAssignedBytes", minimum=0, maximum=MAX_GPU_MEMORY_BYTES)
    if assigned > capacity:
        raise r.fail("milliAssigned", f"{assigned} exceeds milliCapacity {capacity}")
    if memory_assigned > memory_total:
        raise r.fail("memoryAssignedBytes", f"{memory_assigned} exceeds memoryTotalBytes {memory_total}")
    mig_items = r.items("mig")
    if len(mig_items) > MAX_MIG_PER_GPU:
        raise r.fail("mig", f"{len(mig_items)} MIG instances is more than the {MAX_MIG_PER_GPU} a GPU has")
    mig = tuple(_decode_mig(r.item(item, r.key_path(f"mig[{i}]"))) for i, item in enumerate(mig_items))
    sharing = Sharing(r.choice("sharing", SHARING_MODES))
    serves_whole = r.flag("servesWhole", sharing == Sharing.WHOLE)
    if serves_whole != whole_by_mode(sharing, serves_whole):
        raise r.fail(
            "servesWhole",
            f"cannot be {str(serves_whole).lower()} for a {sharing.value} GPU",
            hint="a whole GPU always serves whole-GPU requests and a MIG or time-sliced one never does",
        )
    return GpuRecord(
        uuid=uuid,
        index=r.integer("index", minimum=0, maximum=MAX_GPUS_PER_NODE - 1),
        model=_name(r, "model", empty=True),
        memory_total_bytes=memory_total,
        milli_capacity=capacity,
        milli_assigned=assigned,
        memory_assigned_bytes=memory_assigned,
        healthy=r.choice("health", HEALTH_VALUES) == "Healthy",
        sharing=sharing,
        serves_whole=serves_whole,
        mig=mig,
        nvlink_peers=_names(r, "nvlinkPeers", MAX_GPUS_PER_NODE - 1),
        numa_node=r.integer("numaNode", None, minimum=0, maximum=MAX_NUMA_NODE),
        pods=_names(r, "pods", MAX_PODS_PER_GPU),
    )


def _json_text(text: str | bytes) -> object:
    """The parsed JSON of an annotation value, refusing non-UTF-8, oversized and broken text."""
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
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise NodeStateError(f"{ANNOTATION_KEY}: broken JSON: {exc}") from exc


def _check_gpus(gpus: tuple[GpuRecord, ...]) -> None:
    """What holds across the GPUs of one node: unique UUIDs and indexes, peers on the node."""
    where = f"{ANNOTATION_KEY}.gpus"
    uuids = [g.uuid for g in gpus]
    if len(set(uuids)) != len(uuids):
        raise NodeStateError(f"{where}: duplicate GPU UUIDs")
    indexes = [g.index for g in gpus]
    if len(set(indexes)) != len(indexes):
        raise NodeStateError(f"{where}: duplicate GPU indexes")
    known = set(uuids)
    for g in gpus:
        if g.uuid in g.nvlink_peers or any(p not in known for p in g.nvlink_peers):
            raise NodeStateError(f"{where}: GPU {g.uuid} lists an NVLink peer that is not on the node")


def decode(text: str | bytes, *, node: str | None = None) -> NodeGpuState:
    """Parse and check an annotation value; `node`, when given, must match the annotation's node."""
    r = _reader(_json_text(text), ANNOTATION_KEY)
    version = r.get("version", str)
    if version not in SUPPORTED_VERSIONS:
        raise NodeStateError(
            f"{ANNOTATION_KEY}: version {version!r} is not supported (this extender reads "
            f"{', '.join(SUPPORTED_VERSIONS)})",
            hint="run an extender at least as new as the agents, or pin the agents to publish v1",
        )
    name = _name(r, "node")
    if node is not None and name != node:
        raise r.fail("node", f"says {excerpt(name)} but it is on node {excerpt(node)}")
    gpu_items = r.items("gpus")
    if len(gpu_items) > MAX_GPUS_PER_NODE:
        raise r.fail("gpus", f"{len(gpu_items)} GPUs is more than the {MAX_GPUS_PER_NODE} a node may have")
    gpus = tuple(_decode_gpu(r.item(item, r.key_path(f"gpus[{i}]"))) for i, item in enumerate(gpu_items))
    _check_gpus(gpus)
    return NodeGpuState(
        node=name,
        updated=r.number("updated", minimum=0, maximum=MAX_UPDATED),
        generation=r.integer("generation", minimum=0, maximum=MAX_GENERATION),
        gpus=gpus,
        cpu_milli_free=r.integer("cpuMilliFree", None, minimum=0, maximum=MAX_NODE_CPU_MILLI),
        memory_free_bytes=r.integer("memoryFreeBytes", None, minimum=0, maximum=MAX_NODE_MEMORY_BYTES),
        version=version,
        extra=r.unread(),
    )


def load_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the v1 annotation."""
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return schema
