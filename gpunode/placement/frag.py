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
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpunode.placement.fit import allocatable_share, model_matches
from gpunode.placement.model import MILLI_PER_GPU, GpuState, InvalidRequest, NodeState

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
        return self.gpu_milli == MILLI_PER_GPU


def _thresholds(total_weight: int) -> tuple[float, ...]:
    """Fragmentation changes (scaled) at which FGD's integer score steps from k-1 to k, k = 1..100."""
    scale = MILLI_PER_GPU * total_weight
    steps = [math.log(k / (FGD_MAX_SCORE - k)) * scale for k in range(1, FGD_MAX_SCORE)]
    return (*steps, _SIGMOID_SATURATION * scale)


@dataclass(frozen=True)
class TargetWorkload:
    """The typical pods fragmentation is measured against.

    model_pressure (optional) maps a GPU model to the share of that model's GPUs
    that pods restricted to a few models would take at full load (see
    with_supply); the gpunode policy keeps such models for those pods.
    """

    pods: tuple[TargetPod, ...]
    model_pressure: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    total_weight: int = field(init=False)
    fgd_thresholds: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.pods:
            raise InvalidRequest("a target workload needs at least one pod shape")
        total = sum(p.weight for p in self.pods)
        object.__setattr__(self, "total_weight", total)
        object.__setattr__(self, "fgd_thresholds", _thresholds(total))
        object.__setattr__(self, "model_pressure", MappingProxyType(dict(self.model_pressure)))

    def __hash__(self) -> int:
        return hash((self.pods, tuple(sorted(self.model_pressure.items()))))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TargetWorkload)
            and self.pods == other.pods
            and dict(self.model_pressure) == dict(other.model_pressure)
        )

    def with_supply(self, gpus_by_model: Mapping[str, int]) -> TargetWorkload:
        """The workload with model_pressure computed for a cluster with these GPU counts per model.

        Each shape restricted to some models spreads its GPU demand (weight x GPUs x
        milli, as a share of all the shapes' GPU demand, times the cluster's GPUs)
        over the models it accepts, in proportion to their supply; a model's
        pressure is the demand it receives over its supply. Unrestricted shapes
        put no pressure on any model.
        """
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


def serves_target(gpu: GpuState, pod: TargetPod) -> bool:
    if not gpu.healthy or not model_matches(gpu.model, pod.gpu_models):
        return False
    return gpu.sharing in ("whole", "fractional") if pod.whole else gpu.sharing == "fractional"


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
