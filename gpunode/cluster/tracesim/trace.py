"""Trace input for the simulator: the openb node and pod lists, and the workload built from them.

The openb trace format (Alibaba GPU cluster trace 2023, used by the FGD paper)
is two CSV files: a node list (`sn, cpu_milli, memory_mib, gpu, model`) and a pod
list (`name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec, gpu_memory_mib, ...]`;
`gpu_memory_mib`, gpunode's own optional column, is the GPU memory a fractional pod
asks beside its compute share: see gpumemory.py). This module reads them strictly
(a missing column or a bad value is a TraceError that names the file and the
line), builds the arrival sequence of the evaluation
protocol (shuffle by seed, then tune the total GPU request to a ratio of the
cluster's GPU capacity by sampling with replacement or by random removal), and
derives the target workload (the most frequent pod shapes) that fragmentation is
measured against.

It only reads files and does arithmetic; it never schedules anything.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpunode.cluster.tracesim.gpumemory import MemoryAsks, model_memory_bytes
from gpunode.contract.names import MIB
from gpunode.errors import TraceError
from gpunode.placement import (
    MILLI_PER_GPU,
    GpuState,
    NodeCapacity,
    NodeState,
    Request,
    TargetPod,
    TargetWorkload,
)
from gpunode.placement.frag import shapes_with_counts

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
GPU_MEMORY_COLUMN = "gpu_memory_mib"  # optional: GPU memory a fractional pod asks (empty or 0: none given)
DEFAULT_NODE_FILE = "openb_node_list_gpu_node.csv"
TYPICAL_POPULARITY = 0.95  # the target workload covers this share of the trace's pods


@dataclass(frozen=True)
class TraceNode:
    """One node of the trace: CPU in milli-cores, memory in bytes, GPU count and model."""

    name: str
    cpu_milli: int
    memory_bytes: int
    gpus: int
    model: str  # "" for a node without GPUs


@dataclass(frozen=True)
class TracePod:
    """One pod shape of the trace. gpu_milli is per GPU (1000 = a whole GPU).

    gpu_memory_bytes: the GPU memory the pod asks when the trace gives it (fractional
    pods only; 0: none given, the simulators derive it from the compute share).
    """

    name: str
    cpu_milli: int
    memory_bytes: int
    num_gpu: int
    gpu_milli: int
    gpu_models: frozenset[str] | None  # None: any GPU model
    gpu_memory_bytes: int = 0

    @property
    def total_gpu_milli(self) -> int:
        """GPU the pod asks for in all, in milli-GPU (num_gpu * gpu_milli)."""
        return self.num_gpu * self.gpu_milli

    @property
    def shape(self) -> tuple[int, int, int, frozenset[str] | None]:
        """What placement sees of the pod (memory aside): CPU, milli-GPU per GPU, GPU count, models."""
        return (self.cpu_milli, self.gpu_milli, self.num_gpu, self.gpu_models)


def find_csv(trace_dir: Path, filename: str) -> Path:
    """The path of one trace CSV, in trace_dir/csv/ or directly in trace_dir."""
    for candidate in (trace_dir / "csv" / filename, trace_dir / filename):
        if candidate.is_file():
            return candidate
    raise TraceError(f"{filename} not found in {trace_dir} or {trace_dir / 'csv'}")


def pod_list_path(trace_dir: Path, pods: str) -> Path:
    """`default` -> trace_dir/csv/openb_pod_list_default.csv; a path to a CSV is taken as it is."""
    as_path = Path(pods)
    if as_path.suffix == ".csv" and as_path.is_file():
        return as_path
    return find_csv(trace_dir, f"openb_pod_list_{pods}.csv")


def read_rows(path: Path, required: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """The rows of a CSV with (line number, row); a missing column or an unreadable file is a TraceError."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; found {', '.join(header)}")
            return [(i + 2, row) for i, row in enumerate(reader)]
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    except (csv.Error, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not a CSV file: {exc}") from exc


def int_field(path: Path, line: int, row: dict[str, str], key: str) -> int:
    """A non-negative integer column (empty: 0); anything else is a TraceError naming the line."""
    raw = (row.get(key) or "").strip()
    try:
        value = int(float(raw)) if raw else 0
    except ValueError:
        raise TraceError(f"{path}:{line}: column {key}: expected a number, got {raw!r}") from None
    if value < 0:
        raise TraceError(f"{path}:{line}: column {key}: cannot be negative, got {value}")
    return value


def load_nodes(path: Path) -> tuple[TraceNode, ...]:
    """Read a node list CSV. GPU nodes need a model; a node with 0 GPUs may leave it empty."""
    nodes = []
    for line, row in read_rows(path, NODE_COLUMNS):
        gpus = int_field(path, line, row, "gpu")
        model = (row.get("model") or "").strip()
        if model.lower() == "nan":
            model = ""
        if gpus > 8:
            raise TraceError(f"{path}:{line}: at most 8 GPUs per node are supported, got {gpus}")
        if gpus and not model:
            raise TraceError(f"{path}:{line}: a node with {gpus} GPU(s) needs a model")
        nodes.append(
            TraceNode(
                name=(row.get("sn") or "").strip() or f"node-{line}",
                cpu_milli=int_field(path, line, row, "cpu_milli"),
                memory_bytes=int_field(path, line, row, "memory_mib") * MIB,
                gpus=gpus,
                model=model,
            )
        )
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    return tuple(nodes)


def pod_from_row(path: Path, line: int, row: dict[str, str]) -> TracePod:
    """One pod list row as a TracePod (gpu_milli above 1000 clipped to 1000; num_gpu 0 makes a CPU pod)."""
    num_gpu = int_field(path, line, row, "num_gpu")
    gpu_milli = min(int_field(path, line, row, "gpu_milli"), MILLI_PER_GPU)
    if num_gpu > 8:
        raise TraceError(f"{path}:{line}: num_gpu above 8 cannot fit any node, got {num_gpu}")
    if num_gpu == 0 or gpu_milli == 0:
        num_gpu, gpu_milli = 0, 0
    if num_gpu > 1 and gpu_milli < MILLI_PER_GPU:
        raise TraceError(f"{path}:{line}: a multi-GPU pod must ask for whole GPUs, got {gpu_milli} milli")
    gpu_memory = int_field(path, line, row, GPU_MEMORY_COLUMN) * MIB
    if gpu_memory and num_gpu == 0:
        raise TraceError(
            f"{path}:{line}: column {GPU_MEMORY_COLUMN}: a pod asking no GPU cannot ask GPU memory; leave it empty"
        )
    if gpu_memory and gpu_milli >= MILLI_PER_GPU:
        raise TraceError(
            f"{path}:{line}: column {GPU_MEMORY_COLUMN}: a whole-GPU pod holds all of its GPUs' memory; "
            "leave it empty (gpu_spec picks the model)"
        )
    spec = (row.get("gpu_spec") or "").strip()
    models = frozenset(m for m in spec.split("|") if m and m.lower() != "nan")
    return TracePod(
        name=(row.get("name") or "").strip() or f"pod-{line}",
        cpu_milli=int_field(path, line, row, "cpu_milli"),
        memory_bytes=int_field(path, line, row, "memory_mib") * MIB,
        num_gpu=num_gpu,
        gpu_milli=gpu_milli,
        gpu_models=models if (models and num_gpu) else None,
        gpu_memory_bytes=gpu_memory,
    )


def load_pods(path: Path) -> tuple[TracePod, ...]:
    """Read a pod list CSV (each row as pod_from_row reads it)."""
    pods = tuple(pod_from_row(path, line, row) for line, row in read_rows(path, POD_COLUMNS))
    if not pods:
        raise TraceError(f"{path}: no pods")
    return pods


def target_workload(pods: Sequence[TracePod], popularity: float = TYPICAL_POPULARITY) -> TargetWorkload:
    """The most frequent pod shapes that together cover `popularity` of the pods, with their counts.

    This is the FGD paper's target workload: shapes ranked by count (ties broken by
    larger CPU, then larger GPU share, then more GPUs, then model list), taken one by
    one until they cover the share. Counts stay integers so fragmentation can be
    computed exactly.
    """
    if not pods:
        raise TraceError("the pod list is empty: no target workload can be derived")
    counts = Counter(p.shape for p in pods)

    def rank(item: tuple[tuple[int, int, int, frozenset[str] | None], int]) -> tuple[object, ...]:
        (cpu, milli, num, models), n = item
        return (-n, -cpu, -milli, -num, tuple(sorted(models)) if models else ())

    ranked = sorted(counts.items(), key=rank)
    needed = popularity * len(pods)
    chosen: list[TargetPod] = []
    covered = 0
    for (cpu, milli, num, models), n in ranked:
        if covered >= needed:
            break
        chosen.append(TargetPod(cpu_milli=cpu, gpu_milli=milli, gpus=num, gpu_models=models, weight=n))
        covered += n
    return TargetWorkload(tuple(chosen))


def demand_shapes(pods: Sequence[TracePod]) -> tuple[TargetPod, ...]:
    """Every pod shape of the list with its count: the demand node pressure spreads over the cluster."""
    return shapes_with_counts(Counter(p.shape for p in pods))


def node_capacity(node: TraceNode) -> NodeCapacity:
    """What an empty trace node offers, for node pressure."""
    return NodeCapacity(name=node.name, model=node.model, gpus=node.gpus, cpu_milli=node.cpu_milli)


@dataclass(frozen=True)
class Arrivals:
    """The arrival sequence of one seed and the capacity it is measured against."""

    pods: tuple[TracePod, ...]
    cluster_gpu_milli: int


def build_arrivals(
    pods: Sequence[TracePod], *, nodes: Sequence[TraceNode], seed: int, ratio: float = 1.3
) -> Arrivals:
    """Shuffle the pods by seed, then tune their total GPU request to ratio x cluster GPU capacity.

    Below the target, pods are drawn with replacement from the trace (in name order,
    uniformly) and appended until the next draw would pass the target. Above it,
    random pods are removed until the total is at or below it. The same seed gives
    the same sequence.
    """
    if ratio <= 0 or not math.isfinite(ratio):
        raise TraceError(f"the arrival ratio must be a positive number, got {ratio}")
    rng = np.random.default_rng(seed)
    by_name = sorted(pods, key=lambda p: p.name)
    order = rng.permutation(len(by_name))
    arrivals = [by_name[i] for i in order]
    capacity = sum(n.gpus for n in nodes) * MILLI_PER_GPU
    if capacity <= 0:
        raise TraceError("the node list has no GPUs: there is no GPU capacity to fill")
    target = ratio * capacity
    total = sum(p.total_gpu_milli for p in arrivals)
    if total > target:
        while total > target and arrivals:
            victim = arrivals.pop(int(rng.integers(len(arrivals))))
            total -= victim.total_gpu_milli
    elif total < target:
        if not any(p.total_gpu_milli for p in by_name):
            raise TraceError("the pod list asks for no GPUs: it can never reach the GPU arrival target")
        while True:
            pod = by_name[int(rng.integers(len(by_name)))]
            if total + pod.gpu_milli > target:
                break
            total += pod.total_gpu_milli
            arrivals.append(pod)
    return Arrivals(pods=tuple(arrivals), cluster_gpu_milli=capacity)


def node_state(node: TraceNode, *, gpu_memory: bool = True) -> NodeState:
    """An empty trace node as placement sees it: every GPU fractional and free.

    Each GPU carries its model's memory (gpumemory.model_memory_bytes); with
    gpu_memory=False none (memory_total_bytes 0: compute only).
    """
    memory = model_memory_bytes(node.model) if gpu_memory and node.gpus else 0
    gpus = tuple(
        GpuState(
            uuid=f"{node.name}/gpu{j}",
            index=j,
            model=node.model,
            milli_free=MILLI_PER_GPU,
            memory_total_bytes=memory,
            memory_free_bytes=memory,
            numa_node=None,
        )
        for j in range(node.gpus)
    )
    return NodeState(
        name=node.name, gpus=gpus, cpu_milli_free=node.cpu_milli, memory_free_bytes=node.memory_bytes
    )


def request_of(pod: TracePod, asks: MemoryAsks | None = None) -> Request:
    """The placement request of a trace pod: whole GPUs, a fraction, or CPU only.

    A fraction asks its compute share and GPU memory: the pod's own figure, else, with
    `asks` (a cluster whose GPUs carry memory), asks.ask's; without `asks`, only what
    the pod gives.
    """
    if pod.num_gpu == 0:
        return Request(cpu_milli=pod.cpu_milli, memory_bytes=pod.memory_bytes)
    if pod.gpu_milli >= MILLI_PER_GPU:
        return Request(
            gpus=pod.num_gpu,
            gpu_models=pod.gpu_models,
            cpu_milli=pod.cpu_milli,
            memory_bytes=pod.memory_bytes,
        )
    gpu_memory = pod.gpu_memory_bytes
    if asks is not None:
        gpu_memory = asks.ask(pod.gpu_milli, pod.gpu_models, pod.gpu_memory_bytes)
    return Request(
        gpu_milli=pod.gpu_milli,
        gpu_memory_bytes=gpu_memory,
        gpu_models=pod.gpu_models,
        cpu_milli=pod.cpu_milli,
        memory_bytes=pod.memory_bytes,
    )
