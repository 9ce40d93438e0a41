"""What one simulated run measured: per job records and a timeline in, the issue's metrics out.

Definitions (docs/queueing.md, "Time simulator", says the same):
- queueing delay: first start - arrival. A job that never started by the end of the
  run is counted with end - arrival (a lower bound) and reported in `not_started`.
- job completion time (JCT): end - arrival, over jobs that started (a job still
  running when the run stops ends at start + its remaining runtime: nothing can
  change that once no job waits).
- bounded slowdown: max(1, JCT / max(runtime, bound)), bound = rules.metrics.slowdownBound (10 s).
- time-averaged GPU allocation: allocated GPUs integrated over [0, H) / (cluster GPUs x H).
- fairness: for each window of rules.metrics.window (one day) inside [0, H), each queue's
  received GPU-time / entitled GPU-time, and Jain's index (sum x)^2 / (n sum x^2) over the
  queues entitled to something. Entitled at each moment: the fair share of
  queueing.fairshare.fair_shares for the queues' demand then (held + waiting GPUs),
  without usage memory (k = 0): guarantees first, the rest by weight, none above its
  demand or borrowing limit.
- preemption loss: GPU-seconds since a victim's last checkpoint (or start) when killed,
  against the GPU-seconds delivered over the whole run.
- energy: busy and idle-on-powered GPU-seconds over [0, H), priced by queueing.energy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.energy import GpuSeconds, energy_kwh
from gpunode.cluster.queueing.fairshare import fair_shares
from gpunode.cluster.queueing.model import GPU

ALL = "all"


@dataclass
class JobRecord:
    """One job's life in the run."""

    name: str
    queue: str
    arrival: float
    gpus: float
    duration: float
    multi_gpu: bool
    gang: bool
    first_start: float | None = None
    end: float | None = None
    preemptions: int = 0
    lost_gpu_s: float = 0.0
    partial_gang: bool = False  # some but not all of its pods held GPUs at some moment
    timed_out: bool = False  # reported by the scheduler as waiting past its gang timeout


@dataclass
class Timeline:
    """Piecewise-constant GPUs held and demanded per queue (columns in `queues` order) from each time on."""

    queues: tuple[str, ...]
    times: list[float] = field(default_factory=list)
    held: list[tuple[float, ...]] = field(default_factory=list)
    demand: list[tuple[float, ...]] = field(default_factory=list)

    def record(self, t: float, held: Sequence[float], demand: Sequence[float]) -> None:
        """The state from t on (a second record at the same time replaces the first)."""
        h, d = tuple(held), tuple(demand)
        if self.times and self.times[-1] == t:
            self.held[-1], self.demand[-1] = h, d
            return
        if self.held and self.held[-1] == h and self.demand[-1] == d:
            return
        self.times.append(t)
        self.held.append(h)
        self.demand.append(d)

    def arrays(self, until: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(start times, durations, held, demand) of the steps clipped to [first time, until)."""
        t = np.asarray(self.times, dtype=float)
        held = np.asarray(self.held, dtype=float).reshape(len(t), len(self.queues))
        demand = np.asarray(self.demand, dtype=float).reshape(len(t), len(self.queues))
        ends = np.append(t[1:], max(until, t[-1] if len(t) else until))
        dt = np.clip(np.minimum(ends, until) - t, 0.0, None)
        return t, dt, held, demand


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not len(values):
        return {"count": 0, "mean": float("nan"), "median": float("nan"), "p95": float("nan")}
    a = np.asarray(values, dtype=float)
    return {
        "count": len(a),
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p95": float(np.percentile(a, 95)),
    }


def job_metrics(records: Sequence[JobRecord], *, end: float, slowdown_bound: float) -> dict[str, float]:
    """Delay, JCT, slowdown, preemption and gang figures over a set of jobs (see the module docstring)."""
    delays = [(r.first_start if r.first_start is not None else end) - r.arrival for r in records]
    multi = [d for d, r in zip(delays, records, strict=True) if r.multi_gpu]
    gang = [d for d, r in zip(delays, records, strict=True) if r.gang]
    done = [r for r in records if r.end is not None]
    jct = np.array([r.end - r.arrival for r in done if r.end is not None])
    runtime = np.array([r.duration for r in done])
    out: dict[str, float] = {"jobs": len(records), "not_started": sum(r.first_start is None for r in records)}
    for label, values in (("delay", delays), ("delay_multi_gpu", multi), ("delay_gang", gang)):
        s = _stats(values)
        out.update({f"{label}_{k}": v for k, v in s.items() if k != "count" or label != "delay"})
    out["jct_mean"] = float(jct.mean()) if len(jct) else float("nan")
    out["slowdown_mean"] = (
        float(np.maximum(1.0, jct / np.maximum(runtime, slowdown_bound)).mean()) if len(jct) else float("nan")
    )
    out["preemptions"] = sum(r.preemptions for r in records)
    out["lost_gpu_hours"] = sum(r.lost_gpu_s for r in records) / 3600.0
    out["gang_wait_max"] = max(gang) if gang else 0.0
    out["gang_timeouts"] = sum(r.timed_out for r in records)
    out["partial_gang_held_gpus"] = float(any(r.partial_gang for r in records))
    return out


def allocation(timeline: Timeline, *, horizon: float, cluster_gpus: float) -> dict[str, float]:
    """Time-averaged allocated share of the cluster's GPUs over [0, H), in total and per queue."""
    _, dt, held, _ = timeline.arrays(horizon)
    span = float(dt.sum()) or 1.0
    per_queue = (held * dt[:, None]).sum(axis=0) / (cluster_gpus * span)
    out = {ALL: float(per_queue.sum())}
    out.update({q: float(v) for q, v in zip(timeline.queues, per_queue, strict=True)})
    return out


def delivered_gpu_hours(timeline: Timeline, *, until: float) -> float:
    """GPU-hours held over [first record, until)."""
    _, dt, held, _ = timeline.arrays(until)
    return float((held.sum(axis=1) * dt).sum()) / 3600.0


def fairness(
    timeline: Timeline, config: QueueConfig, *, horizon: float, cluster_gpus: float, window: float
) -> dict[str, float]:
    """Jain's index of received / entitled GPU-time across queues, per window of [0, H): mean and min."""
    t, dt, held, demand = timeline.arrays(horizon)
    capacity = {GPU: round(cluster_gpus * 1000)}
    cache: dict[tuple[float, ...], tuple[float, ...]] = {}
    entitled = np.zeros_like(held)
    for i, row in enumerate(demand):
        key = tuple(row)
        if key not in cache:
            want = {q: {GPU: round(v * 1000)} for q, v in zip(timeline.queues, row, strict=True)}
            shares = fair_shares(config, capacity, want, {}, k=0.0)
            cache[key] = tuple(shares[q].get(GPU, 0) / 1000.0 for q in timeline.queues)
        entitled[i] = cache[key]
    indices = []
    start = 0.0
    while start < horizon:
        stop = min(start + window, horizon)
        w = np.clip(np.minimum(t + dt, stop) - np.maximum(t, start), 0.0, None)
        got = (held * w[:, None]).sum(axis=0)
        owed = (entitled * w[:, None]).sum(axis=0)
        mask = owed > 1e-9
        if mask.any():
            x = got[mask] / owed[mask]
            indices.append(float(x.sum() ** 2 / (len(x) * (x**2).sum())) if (x**2).sum() > 0 else 0.0)
        start = stop
    if not indices:
        return {"jain_mean": float("nan"), "jain_min": float("nan"), "windows": 0}
    return {"jain_mean": float(np.mean(indices)), "jain_min": float(min(indices)), "windows": len(indices)}


def energy(seconds: Mapping[str, GpuSeconds]) -> dict[str, float]:
    """Busy and idle-on-powered GPU-hours and their kWh (queueing.energy's model and power table)."""
    busy_kwh, idle_kwh = energy_kwh(seconds)
    return {
        "busy_gpu_hours": sum(s.busy for s in seconds.values()) / 3600.0,
        "idle_gpu_hours": sum(s.idle for s in seconds.values()) / 3600.0,
        "busy_kwh": busy_kwh,
        "idle_kwh": idle_kwh,
        "kwh": busy_kwh + idle_kwh,
    }


def summarize_run(
    records: Sequence[JobRecord],
    timeline: Timeline,
    config: QueueConfig,
    *,
    horizon: float,
    end: float,
    cluster_gpus: float,
    window: float,
    slowdown_bound: float,
    energy_seconds: Mapping[str, GpuSeconds],
) -> dict[str, dict[str, float]]:
    """Every metric of one run: {"all": {...}, "<queue>": {...}} (fairness and energy under "all")."""
    alloc = allocation(timeline, horizon=horizon, cluster_gpus=cluster_gpus)
    out: dict[str, dict[str, float]] = {}
    for queue in (ALL, *timeline.queues):
        mine = records if queue == ALL else [r for r in records if r.queue == queue]
        m = job_metrics(mine, end=end, slowdown_bound=slowdown_bound)
        m["allocation"] = alloc.get(queue, 0.0)
        out[queue] = m
    whole = out[ALL]
    whole.update(fairness(timeline, config, horizon=horizon, cluster_gpus=cluster_gpus, window=window))
    whole.update(energy(energy_seconds))
    delivered = delivered_gpu_hours(timeline, until=end)
    whole["delivered_gpu_hours"] = delivered
    whole["lost_share"] = whole["lost_gpu_hours"] / delivered if delivered > 0 else 0.0
    return out
