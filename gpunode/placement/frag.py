"""GPU fragmentation of a node against a target workload, the measure FGD descends.

Definitions (after the FGD paper, "Beware of Fragmentation", USENIX ATC'23):
the target workload is a set of typical pod shapes with their frequencies. For
one shape, the node's free GPU share is a fragment when the shape cannot run on
the node at all (not enough CPU, no GPU of its model, not enough GPUs with room,
or it needs no GPU); when it can run, the fragment is the free share of the GPUs
it cannot use (those with less free share than it asks, or of another model or
mode). The node's fragmentation is the frequency-weighted sum over the shapes.

Weights are kept as integer counts, so fragmentation is an exact integer in
milli-GPU x weight units: every caller (node, extender, simulator) computes the
same number, and FGD's score from a fragmentation change is read off a table of
thresholds instead of a floating-point sigmoid, so that equal inputs always give
equal scores. Pure functions; no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gpunode.errors import InvalidRequest
from gpunode.placement.fit import allocatable_share, model_matches, takes_whole
from gpunode.placement.model import MILLI_PER_GPU, GpuState, NodeState

FGD_MAX_SCORE = 100
# sigmoid(x) rounds to exactly 1.0 in float64 once exp(-x) < 2**-53, i.e. x > 36.74.
_SIGMOID_SATURATION = 53 * math.log(2)


@dataclass(frozen=True)
class TargetPod:
    """One typical pod shape: CPU, milli-GPU per GPU (1000 = whole), GPU count, models; weight = its count."""

    cpu_milli: int
    gpu_milli: int
    gpus: int
    gpu_models: frozenset[str] | None
    weight: int

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise InvalidRequest(f"a target pod needs a positive weight, got {self.weight}")
        if self.gpus < 0 or not 0 <= self.gpu_milli <= MILLI_PER_GPU or self.cpu_milli < 0:
            raise InvalidRequest(f"bad target pod shape {self}")
        if self.gpus > 1 and self.gpu_milli != MILLI_PER_GPU:
            raise InvalidRequest("a multi-GPU target pod must ask for whole GPUs")
        if (self.gpus == 0) != (self.gpu_milli == 0):
            raise InvalidRequest("a target pod asks for GPUs and milli-GPU together, or for neither")

    @property
    def whole(self) -> bool:
        """Whether the shape asks for whole GPUs (1000 milli-GPU each)."""
        return self.gpu_milli == MILLI_PER_GPU


Shape = tuple[int, int, int, frozenset[str] | None]  # (CPU milli, milli-GPU per GPU, GPUs, models)


def shapes_with_counts(counts: Mapping[Shape, int]) -> tuple[TargetPod, ...]:
    """Every shape with its count as a TargetPod, most frequent first (ties in a fixed order)."""
    return tuple(
        TargetPod(cpu_milli=cpu, gpu_milli=milli, gpus=gpus, gpu_models=models, weight=n)
        for (cpu, milli, gpus, models), n in sorted(counts.items(), key=lambda kv: (-kv[1], repr(kv[0])))
    )


def _thresholds(total_weight: int) -> tuple[float, ...]:
    """Fragmentation changes (scaled) at which FGD's integer score steps from k-1 to k, k = 1..100."""
    scale = MILLI_PER_GPU * total_weight
    steps = [math.log(k / (FGD_MAX_SCORE - k)) * scale for k in range(1, FGD_MAX_SCORE)]
    return (*steps, _SIGMOID_SATURATION * scale)


@dataclass(frozen=True)
class NodeCapacity:
    """What a node offers when empty, as node pressure sees it: GPU model and count, CPU (milli-cores)."""

    name: str
    model: str
    gpus: int
    cpu_milli: int

    @property
    def node_class(self) -> tuple[str, int, int]:
        """The node's kind, (model, GPU count, CPU milli-cores): node pressure is shared per kind."""
        return (self.model, self.gpus, self.cpu_milli)

    def takes(self, pod: TargetPod) -> bool:
        """Whether a pod of this shape fits the node when the node is empty."""
        return (
            0 < pod.gpus <= self.gpus
            and pod.cpu_milli <= self.cpu_milli
            and bool(self.model)
            and model_matches(self.model, pod.gpu_models)
        )


@dataclass(frozen=True)
class TargetWorkload:
    """The typical pods fragmentation is measured against.

    model_pressure (optional) maps a GPU model to the share of that model's GPUs
    that pods restricted to a few models would take at full load; node_pressure
    (optional) maps a node name to the load its kind of node (model, GPU count,
    CPU) would carry at full load if every pod shape spread over the kinds of
    node it fits (see with_supply). The gpunode policy keeps pressed models and
    nodes for the pods that need them.
    """

    pods: tuple[TargetPod, ...]
    model_pressure: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    node_pressure: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    total_weight: int = field(init=False)
    fgd_thresholds: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.pods:
            raise InvalidRequest("a target workload needs at least one pod shape")
        total = sum(p.weight for p in self.pods)
        object.__setattr__(self, "total_weight", total)
        object.__setattr__(self, "fgd_thresholds", _thresholds(total))
        object.__setattr__(self, "model_pressure", MappingProxyType(dict(self.model_pressure)))
        object.__setattr__(self, "node_pressure", MappingProxyType(dict(self.node_pressure)))

    def __hash__(self) -> int:
        return hash((self.pods, tuple(sorted(self.model_pressure.items())), len(self.node_pressure)))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TargetWorkload)
            and self.pods == other.pods
            and dict(self.model_pressure) == dict(other.model_pressure)
            and dict(self.node_pressure) == dict(other.node_pressure)
        )

    def pressure(self, node: str, model: str) -> float:
        """The pressure on one GPU of `model` on node `node`: its model's plus its node's."""
        return self.model_pressure.get(model, 0.0) + self.node_pressure.get(node, 0.0)

    def with_supply(
        self,
        gpus_by_model: Mapping[str, int],
        *,
        nodes: Sequence[NodeCapacity] = (),
        demand: Sequence[TargetPod] | None = None,
    ) -> TargetWorkload:
        """The workload with model_pressure (and, given nodes, node_pressure) for a cluster.

        Model pressure: each typical shape restricted to some models spreads its GPU
        demand (weight x GPUs x milli, as a share of all the shapes' GPU demand,
        times the cluster's GPUs) over the models it accepts, in proportion to
        their supply; a model's pressure is the demand it receives over its
        supply. Unrestricted shapes put no pressure on any model.

        Node pressure: nodes are grouped into kinds (model, GPU count, CPU). Every
        GPU shape of `demand` (all the workload's shapes with their counts, CPU-only
        ones included; the typical pods when not given) spreads its GPU demand over
        the kinds of node that could run it when empty, in proportion to their
        GPUs; a kind's pressure is the demand it receives over its GPUs, and each
        node gets its kind's. Kinds that only some shapes fit (8-GPU nodes, the few
        nodes with CPU enough for the largest pods) end up with more pressure than
        the rest. When the workload's CPU at full GPU load would fill the nodes'
        CPU, there is no node pressure (CPU-only pods would take the pressed
        nodes' cores regardless).
        """
        with_models = self._with_model_pressure(gpus_by_model)
        if not nodes:
            return with_models
        return TargetWorkload(
            self.pods,
            model_pressure=with_models.model_pressure,
            node_pressure=node_pressure(nodes, self.pods if demand is None else demand),
        )

    def _with_model_pressure(self, gpus_by_model: Mapping[str, int]) -> TargetWorkload:
        supply = {m: n * MILLI_PER_GPU for m, n in gpus_by_model.items() if n > 0 and m}
        capacity = sum(supply.values())
        demand_total = sum(p.weight * p.gpu_milli * p.gpus for p in self.pods)
        demand = dict.fromkeys(supply, 0.0)
        if capacity and demand_total:
            for pod in self.pods:
                if not pod.gpus or pod.gpu_models is None:
                    continue
                accepted = [m for m in supply if model_matches(m, pod.gpu_models)]
                share = sum(supply[m] for m in accepted)
                for m in accepted:
                    demand[m] += (
                        pod.weight * pod.gpu_milli * pod.gpus / demand_total * capacity * supply[m] / share
                    )
        pressure = {m: demand[m] / supply[m] for m in supply if demand[m] > 0}
        return TargetWorkload(self.pods, model_pressure=pressure)

    def fgd_score(self, frag_decrease_scaled: int) -> int:
        """FGD's node score: floor(100 * sigmoid(decrease / 1000 milli-GPU)), decrease in scaled units."""
        return bisect_right(self.fgd_thresholds, frag_decrease_scaled)


def node_pressure(nodes: Sequence[NodeCapacity], demand: Sequence[TargetPod]) -> dict[str, float]:
    """Per node name, its kind's load at full demand (see TargetWorkload.with_supply)."""
    supply: dict[tuple[str, int, int], int] = {}
    for node in nodes:
        if node.gpus > 0 and node.model:
            supply[node.node_class] = supply.get(node.node_class, 0) + node.gpus * MILLI_PER_GPU
    capacity = sum(supply.values())
    shapes = [p for p in demand if p.gpus]
    demand_total = sum(p.weight * p.gpu_milli * p.gpus for p in shapes)
    if not capacity or not demand_total:
        return {}
    # At full GPU load, would the pods' CPU (CPU-only pods included) fill the nodes' CPU? Then CPU-only
    # pods, which node pressure does not steer, take the pressed nodes' cores anyway and protecting
    # those nodes for GPU pods only strands their GPUs: no node pressure.
    cpu_demand = sum(p.weight * p.cpu_milli for p in demand) * capacity / demand_total
    if cpu_demand >= sum(n.cpu_milli for n in nodes if n.node_class in supply):
        return {}
    load = dict.fromkeys(supply, 0.0)
    probes = {c: NodeCapacity("", c[0], c[1], c[2]) for c in supply}
    for pod in shapes:
        fitting = [c for c, probe in probes.items() if probe.takes(pod)]
        room = sum(supply[c] for c in fitting)
        for c in fitting:
            load[c] += pod.weight * pod.gpu_milli * pod.gpus / demand_total * capacity * supply[c] / room
    return {n.name: load[n.node_class] / supply[n.node_class] for n in nodes if n.node_class in supply}


def serves_target(gpu: GpuState, pod: TargetPod) -> bool:
    """Whether the GPU could serve the shape by health, model and sharing mode (free share aside).

    Whole-GPU shapes use the GPUs whole requests may take (fit.takes_whole: `whole` ones and
    `fractional` ones also offered whole); fractional shapes only `fractional` ones.
    """
    if not gpu.healthy or not model_matches(gpu.model, pod.gpu_models):
        return False
    return takes_whole(gpu) if pod.whole else gpu.sharing == "fractional"


def fragmentation(node: NodeState, workload: TargetWorkload) -> int:
    """The node's GPU fragmentation in scaled units (milli-GPU x weight); divide by total_weight for milli-GPU."""
    shares = [allocatable_share(g) for g in node.gpus]
    total = sum(shares)
    if total == 0:
        return 0
    frag = 0
    for pod in workload.pods:
        contribution = total
        if pod.gpus and node.cpu_milli_free >= pod.cpu_milli:
            usable = [
                s
                for g, s in zip(node.gpus, shares, strict=True)
                if s >= pod.gpu_milli and serves_target(g, pod)
            ]
            if len(usable) >= pod.gpus:
                contribution = total - sum(usable)
        frag += pod.weight * contribution
    return frag


def fragmentation_milli(node: NodeState, workload: TargetWorkload) -> float:
    """The node's expected fragmented GPU share in milli-GPU."""
    return fragmentation(node, workload) / workload.total_weight
