"""A family of synthetic multi-tenant workloads for the time simulator, and its fixed tuning/evaluation split.

A workload (Workload) is: a mix of tenants, an arrival pattern, a cluster shape, an
offered load, a horizon and an estimate mode. generate(workload, seed) turns it into
the nodes, the queue configuration and the Replay that run_replay takes.

Job classes (CLASSES: GPUs per job, GPUs per pod, runtime's log-normal median and
sigma, longest runtime):
- inference: fractional services (0.25, 0.5 or 1 GPU) living days (median 2 d); half of
  them are alive when the replay starts (they arrive at 0).
- notebook: interactive sessions, 0.5 or 1 GPU, median 2 h; in working hours under the
  diurnal pattern.
- research: short 1, 2 or 4 GPU jobs, median 20 min, sigma 1.5 (heavy tail); the bursty
  pattern sends them as sweeps of BURST jobs at the same second, each sweep one shape.
- training: one 8-GPU pod, median 6 h.
- gang: 16 or 32 GPUs as 8-GPU pods (all-or-nothing), median 4 h.
- giant: 32 or 64 GPUs as 8-GPU pods, median 1.5 d, rare.

Tenants (TENANTS) are leaf queues, each with its own mix of classes (share of its
GPU-time); a tenant mix (MIXES) gives each tenant a share of the offered GPU-time.

Arrival patterns: "poisson" (uniform in time), "diurnal" (weekdays: three times the
rate from 09:00 to 18:00, the night at a half; weekends, days 5 and 6, at 0.3; notebooks
only in working hours), "bursty" (poisson, with research in sweeps).

Cluster shapes (CLUSTERS, 256 GPUs each): "all8" (32 nodes of 8 GPUs), "mixed" (20 of 8,
16 of 4, 32 of 1), "twomodel" (16 nodes of 8 A100, 16 of 8 H100; half the training, gang
and giant jobs and a fifth of the rest pinned to one model).

Load: each tenant draws jobs (i.i.d.: class, size, runtime, arrival) until its offered
GPU-time inside the replay, gpus x min(runtime, H - arrival) as in trace.py, reaches its
share of load x cluster GPUs x H; the draw that would pass it is kept with the
probability (room left / its GPU-time), so a giant job does not lift a small cluster's
load far above the target (the offered load is the target on average over seeds;
Replay.offered_load says what one seed offers).

Estimates: "exact" (the runtime), "noisy0.5" / "noisy1.0" (runtime x exp(N(0, sigma))),
"optimistic" (each tenant's users under-estimate by the tenant's factor OPTIMISM, with
noise of sigma 0.5), "missing" (none: the configured default is used).

Everything a seed draws comes from numpy's generator seeded with [seed, the workload's
stable number]: the same (workload, seed) gives the same replay on every machine.

The family (family()): FAMILY_SIZE workloads enumerated by index i, each factor cycling
at its own period; SPLIT_RULE decides the halves from the index alone, before any tuning.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from gpunode.cluster.queueing.config import QueueConfig, parse_queue_config
from gpunode.cluster.queueing.model import Job
from gpunode.cluster.timesim.rules import (
    CheckpointRules,
    EstimateRules,
    MetricRules,
    ReplayRules,
    SimRules,
)
from gpunode.cluster.timesim.trace import Replay
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.placement import GpuState, NodeState, Request, TargetWorkload
from gpunode.placement.frag import shapes_with_counts

DAY = 86400.0
WEEK = 7 * DAY
BURST = 100
MIN_RUNTIME_S = 30.0
CPU_PER_GPU_MILLI = 8000
MEMORY_PER_GPU = 64 << 30
FAMILY_SIZE = 24
SPLIT_RULE = "a workload's index i in family(): even i -> tuning half, odd i -> evaluation half"


@dataclass(frozen=True)
class JobClass:
    """One kind of job: its sizes (GPUs, weight), pod size for gangs, runtime distribution, arrival habits."""

    name: str
    sizes: tuple[tuple[float, float], ...]  # (GPUs per job, weight); below 1: a fraction of one GPU
    pod_gpus: int  # GPUs per pod when a job has more than this many (0: one pod)
    median_s: float
    sigma: float
    max_s: float
    working_hours: bool = False  # diurnal pattern: only 09:00-18:00 on weekdays
    at_start: float = 0.0  # share alive when the replay starts (arrive at 0)
    pinned: float = 0.2  # share pinned to one GPU model on a two-model cluster


CLASSES: dict[str, JobClass] = {
    c.name: c
    for c in (
        JobClass("inference", ((0.25, 0.4), (0.5, 0.4), (1, 0.2)), 0, 2 * DAY, 0.8, 14 * DAY, at_start=0.5),
        JobClass("notebook", ((0.5, 0.5), (1, 0.5)), 0, 7200.0, 0.6, 12 * 3600.0, working_hours=True),
        JobClass("research", ((1, 0.5), (2, 0.25), (4, 0.25)), 0, 1200.0, 1.5, 2 * DAY),
        JobClass("training", ((8, 1.0),), 0, 6 * 3600.0, 1.0, 4 * DAY, pinned=0.5),
        JobClass("gang", ((16, 0.7), (32, 0.3)), 8, 4 * 3600.0, 1.0, 3 * DAY, pinned=0.5),
        JobClass("giant", ((32, 0.5), (64, 0.5)), 8, 1.5 * DAY, 0.5, 5 * DAY, pinned=0.5),
    )
}

# tenant -> (class, share of the tenant's GPU-time)
TENANTS: dict[str, tuple[tuple[str, float], ...]] = {
    "serve": (("inference", 0.8), ("notebook", 0.2)),
    "lab": (("research", 0.6), ("notebook", 0.25), ("training", 0.15)),
    "train": (("training", 0.6), ("gang", 0.4)),
    "frontier": (("giant", 0.7), ("gang", 0.3)),
}
# "optimistic" estimates: each tenant's users give this fraction of the runtime (times noise)
OPTIMISM = {"serve": 0.5, "lab": 0.3, "train": 0.6, "frontier": 0.8}
# mix -> (tenant, share of the offered GPU-time)
MIXES: dict[str, tuple[tuple[str, float], ...]] = {
    "four": (("serve", 0.25), ("lab", 0.25), ("train", 0.3), ("frontier", 0.2)),
    "research": (("serve", 0.15), ("lab", 0.5), ("train", 0.35)),
    "big": (("lab", 0.2), ("train", 0.4), ("frontier", 0.4)),
}
# shape -> (GPUs per node, model, node count) groups
CLUSTERS: dict[str, tuple[tuple[int, str, int], ...]] = {
    "all8": ((8, "A100", 32),),
    "mixed": ((8, "A100", 20), (4, "A100", 16), (1, "A100", 32)),
    "twomodel": ((8, "A100", 16), (8, "H100", 16)),
}
ARRIVALS = ("poisson", "diurnal", "bursty")
ESTIMATES = ("exact", "noisy0.5", "noisy1.0", "optimistic", "missing")
LOADS = (0.6, 0.9, 1.1, 0.8, 1.0)


@dataclass(frozen=True)
class Workload:
    """One member of the family (see the module docstring for each field's values)."""

    mix: str
    arrival: str
    cluster: str
    load: float
    horizon_s: float
    estimates: str
    index: int = -1  # its place in family(); -1: not from the family

    def __post_init__(self) -> None:
        for value, known, what in (
            (self.mix, MIXES, "mix"),
            (self.arrival, ARRIVALS, "arrival"),
            (self.cluster, CLUSTERS, "cluster"),
            (self.estimates, ESTIMATES, "estimates"),
        ):
            if value not in known:
                raise ValueError(f"workload {what} {value!r} is not one of {', '.join(known)}")
        if not (0 < self.load <= 10 and math.isfinite(self.load)):
            raise ValueError(f"workload load must be within (0, 10], got {self.load}")
        if not self.horizon_s > 0:
            raise ValueError(f"workload horizon must be above 0 s, got {self.horizon_s}")

    @property
    def name(self) -> str:
        """A readable, unique name: w<index>-mix-arrival-cluster-l<load>-<estimates>-<day|week>."""
        span = (
            "week" if self.horizon_s >= WEEK else "day" if self.horizon_s >= DAY else f"{self.horizon_s:g}s"
        )
        prefix = f"w{self.index:02d}-" if self.index >= 0 else ""
        return f"{prefix}{self.mix}-{self.arrival}-{self.cluster}-l{self.load:g}-{self.estimates}-{span}"

    @property
    def half(self) -> str:
        """ "tuning" or "evaluation" by SPLIT_RULE (a workload outside the family: "")."""
        if self.index < 0:
            return ""
        return "tuning" if self.index % 2 == 0 else "evaluation"

    @property
    def key(self) -> int:
        """A stable number of the workload's parameters, mixed into every seed's draws."""
        text = f"{self.mix}|{self.arrival}|{self.cluster}|{self.load!r}|{self.horizon_s!r}|{self.estimates}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big")


def family() -> tuple[Workload, ...]:
    """The FAMILY_SIZE workloads: each factor cycles with the index i at its own period (weeks: i % 12 in 5, 8)."""
    mixes, clusters = tuple(MIXES), tuple(CLUSTERS)
    out = []
    for i in range(FAMILY_SIZE):
        out.append(
            Workload(
                mix=mixes[i % 3],
                arrival=ARRIVALS[(i // 3) % 3],
                cluster=clusters[(i + i // 9) % 3],
                load=LOADS[i % 5],
                horizon_s=WEEK if i % 12 in (5, 8) else DAY,
                estimates=ESTIMATES[(i // 2) % 5],
                index=i,
            )
        )
    return tuple(out)


def halves() -> dict[str, tuple[Workload, ...]]:
    """{"tuning": [...], "evaluation": [...]} by SPLIT_RULE."""
    fam = family()
    return {h: tuple(w for w in fam if w.half == h) for h in ("tuning", "evaluation")}


# ----- what one (workload, seed) is made of ---------------------------------------------------------------


def nodes_of(shape: str) -> tuple[NodeState, ...]:
    """The empty nodes of a cluster shape."""
    out = []
    for gpus, model, count in CLUSTERS[shape]:
        for n in range(count):
            name = f"{model.lower()}-{gpus}g-{n:02d}"
            out.append(
                NodeState(
                    name=name,
                    gpus=tuple(
                        GpuState(
                            uuid=f"{name}/gpu{j}",
                            index=j,
                            model=model,
                            milli_free=MILLI_PER_GPU,
                            memory_total_bytes=0,
                            memory_free_bytes=0,
                            numa_node=None,
                        )
                        for j in range(gpus)
                    ),
                    cpu_milli_free=gpus * CPU_PER_GPU_MILLI + 4000,
                    memory_free_bytes=gpus * MEMORY_PER_GPU + (32 << 30),
                )
            )
    return tuple(out)


def cluster_gpus(shape: str) -> int:
    """The GPUs of a cluster shape."""
    return sum(g * c for g, _, c in CLUSTERS[shape])


def queue_config(workload: Workload) -> QueueConfig:
    """The queue tree: one leaf per tenant of the mix, weight 1, guaranteed half its share of the cluster.

    Every other setting is the queue configuration's default (what ships), except the energy
    weight, which is gpu-node's example's 0.1 (gpunode/examples/sim-queues.yaml).
    """
    gpus = cluster_gpus(workload.cluster)
    children = [
        {"name": t, "weight": 1, "guarantee": {"gpu": math.floor(0.5 * gpus * share)}}
        for t, share in MIXES[workload.mix]
    ]
    return parse_queue_config(
        {"queues": [{"name": "org", "children": children}], "energy": {"weight": 0.1}}, workload.name
    )


def sim_rules(workload: Workload) -> SimRules:
    """The simulator's rules for a workload: its horizon, one-day fairness windows, a 60 s checkpoint."""
    return SimRules(
        replay=ReplayRules(horizon_s=workload.horizon_s, drain_limit_s=2 * DAY, tick_s=1.0),
        estimates=EstimateRules(mode="exact"),
        checkpoint=CheckpointRules(on_notice=True, cost_s=60.0),
        metrics=MetricRules(window_s=DAY, slowdown_bound_s=10.0),
    )


def _density(arrival: str, horizon: float, working: bool) -> tuple[np.ndarray, np.ndarray]:
    """The arrival pattern as hourly bins: (bin starts, probabilities)."""
    starts = np.arange(0.0, horizon, 3600.0)
    hour = (starts // 3600.0) % 24
    day = (starts // DAY) % 7
    if arrival != "diurnal":
        rate = np.ones(len(starts))
    else:
        work = (hour >= 9) & (hour < 18) & (day < 5)
        rate = np.where(work, 3.0, 0.0 if working else np.where(day < 5, 0.5, 0.3))
    if rate.sum() == 0:
        rate = np.ones(len(starts))
    return starts, rate / rate.sum()


def _pods(klass: JobClass, gpus: float, model: str | None) -> tuple[Request, ...]:
    models = frozenset({model}) if model else None
    if gpus < 1:
        milli = round(gpus * MILLI_PER_GPU)
        return (
            Request(
                gpu_milli=milli,
                gpu_models=models,
                cpu_milli=milli * CPU_PER_GPU_MILLI // MILLI_PER_GPU,
                memory_bytes=MEMORY_PER_GPU * milli // MILLI_PER_GPU,
            ),
        )
    whole = int(gpus)
    per_pod = klass.pod_gpus if klass.pod_gpus and whole > klass.pod_gpus else whole
    member = Request(
        gpus=per_pod,
        gpu_models=models,
        cpu_milli=per_pod * CPU_PER_GPU_MILLI,
        memory_bytes=per_pod * MEMORY_PER_GPU,
    )
    return (member,) * (whole // per_pod)


def _estimate(workload: Workload, tenant: str, runtime: float, noise: float) -> float | None:
    mode = workload.estimates
    if mode == "exact":
        return runtime
    if mode == "missing":
        return None
    if mode == "optimistic":
        return max(runtime * OPTIMISM[tenant] * math.exp(0.5 * noise), 1.0)
    sigma = float(mode.removeprefix("noisy"))
    return max(runtime * math.exp(sigma * noise), 1.0)


def generate(workload: Workload, seed: int) -> Replay:
    """The jobs of one (workload, seed): see the module docstring for every rule."""
    rng = np.random.default_rng([seed, workload.key])
    horizon = workload.horizon_s
    gpus_total = cluster_gpus(workload.cluster)
    models = sorted({m for _, m, _ in CLUSTERS[workload.cluster]})
    biggest_node = max(g for g, _, _ in CLUSTERS[workload.cluster])
    jobs: list[Job] = []
    offered_total = 0.0
    for tenant, share in MIXES[workload.mix]:
        target = share * workload.load * gpus_total * horizon
        classes = TENANTS[tenant]
        # draw a class by its share of the tenant's GPU-time: weight by share / mean GPU-time of one job
        weights = np.array(
            [
                s / (_mean_gpu_time(CLASSES[c], horizon) * (BURST if _bursty(workload, c) else 1))
                for c, s in classes
            ]
        )
        weights /= weights.sum()
        offered = 0.0
        n = 0
        while offered < target:
            klass = CLASSES[classes[int(rng.choice(len(classes), p=weights))][0]]
            sizes = np.array([w for _, w in klass.sizes])
            gpus = klass.sizes[int(rng.choice(len(sizes), p=sizes / sizes.sum()))][0]
            if gpus >= 1 and klass.pod_gpus == 0 and gpus > biggest_node:
                gpus = float(biggest_node)
            bursty = _bursty(workload, klass.name)
            count = BURST if bursty else 1
            if rng.random() < klass.at_start:
                arrival = 0.0
            else:
                starts, p = _density(workload.arrival, horizon, klass.working_hours)
                arrival = float(starts[int(rng.choice(len(starts), p=p))] + rng.random() * 3600.0)
                arrival = min(arrival, horizon - 1.0)
            model = None
            if len(models) > 1 and rng.random() < klass.pinned:
                model = models[int(rng.integers(len(models)))]
            median = klass.median_s * math.exp(klass.sigma * float(rng.standard_normal()))
            size = count * gpus * min(max(median, MIN_RUNTIME_S), klass.max_s, horizon - arrival)
            if offered + size > target and rng.random() >= (target - offered) / size:
                break  # the last draw is kept with the probability of the room left: the load is met on average
            for _ in range(count):
                spread = 0.25 * float(rng.standard_normal()) if bursty else 0.0
                runtime = median * math.exp(spread) if bursty else median
                runtime = float(min(max(runtime, MIN_RUNTIME_S), klass.max_s))
                noise = float(rng.standard_normal())
                jobs.append(
                    Job(
                        name=f"{tenant}-{klass.name}-{n}",
                        queue=tenant,
                        pods=_pods(klass, gpus, model),
                        arrival=arrival,
                        runtime_estimate=_estimate(workload, tenant, runtime, noise),
                        duration=runtime,
                    )
                )
                offered += gpus * min(runtime, horizon - arrival)
                n += 1
        offered_total += offered
    jobs.sort(key=lambda j: (j.arrival, j.name))
    return Replay(
        jobs=tuple(jobs),
        horizon_s=horizon,
        lap_s=horizon,
        laps=1,
        offered_load=offered_total / (gpus_total * horizon),
        rows=len(jobs),
        dropped=0,
    )


def target_workload(replay: Replay, shape: str) -> TargetWorkload:
    """The placement's typical pods: every pod shape of the replay with its count, with the models' supply."""
    counts: dict[tuple[int, int, int, frozenset[str] | None], int] = {}
    for job in replay.jobs:
        for pod in job.pods:
            key = (pod.cpu_milli, pod.gpu_milli or MILLI_PER_GPU, max(pod.gpus, 1), pod.gpu_models)
            counts[key] = counts.get(key, 0) + 1
    supply: dict[str, int] = {}
    for gpus, model, count in CLUSTERS[shape]:
        supply[model] = supply.get(model, 0) + gpus * count
    return TargetWorkload(shapes_with_counts(counts)).with_supply(supply)


def _bursty(workload: Workload, klass: str) -> bool:
    return workload.arrival == "bursty" and klass == "research"


def _mean_gpu_time(klass: JobClass, horizon: float) -> float:
    """About the GPU-seconds one job of the class offers inside a replay (for choosing classes by GPU-time)."""
    sizes = sum(g * w for g, w in klass.sizes) / sum(w for _, w in klass.sizes)
    mean_runtime = min(klass.median_s * math.exp(klass.sigma**2 / 2), klass.max_s, horizon / 2)
    per_job = sizes * mean_runtime
    return per_job
