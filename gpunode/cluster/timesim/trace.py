"""The openb pod list with its times, and the replay the time simulator offers the scheduler.

Times (docs/queueing.md, "Time simulator"):
- A row arrives at `creation_time` and runs for `deletion_time - scheduled_time`
  (at least 1 s). The trace is a snapshot: the earliest `deletion_time` is where its
  observation starts; the rows created before it are those still alive then (long
  services), and they arrive at the start of the replay.
- Rows without `scheduled_time` (the default list has 897, all Pending, deleted a
  median 94 s after creation) never ran, so their runtime is unknown. Rule
  `unscheduled: sample` (the default) gives each a runtime drawn, by seed, from the
  runtimes of the scheduled rows asking for the same GPU count: they are demand the
  real cluster did not serve, and a scheduler under test may well serve it.
  `lifetime` runs them for deletion - creation (the time they waited); `drop`
  leaves them out.

Load (`--load L`): the replay offers arrivals over [0, H), H = the rules' horizon.
The trace's arrival pattern (its own creation times, relative to the observation
start) is compressed to a lap of length l, and laps follow one another (lap k's
copy of a pod is named `<name>~k`, with its own seeded draws) until H. l is the
one value for which the offered GPU-time *inside the replay* equals L x cluster
GPUs x H, where a job counts gpus x min(duration, H - arrival): the GPU-time it
would use in [0, H) if it started on arrival. Counting only what falls inside the
window matters because runtimes are heavy-tailed (median ~616 s, mean ~29,000 s,
longest 12.5 million s): counting whole runtimes would make a replay of hours look
loaded while its GPUs sat idle. One lap of the default list offers at most 0.98 x
the cluster (its pods' total request), so loads near 1 take several laps. The
offered GPU-time falls as l grows, so l is found by bisection.

GPU memory: with `asks` (the simulation carries GPU memory, cli.memory_asks) every
fractional pod asks memory as well as compute (its `gpu_memory_mib`, else its
compute share of the smallest GPU model it may land on: tracesim.gpumemory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpunode.cluster.queueing.model import Job
from gpunode.cluster.timesim.rules import SimRules
from gpunode.cluster.tracesim.gpumemory import MemoryAsks
from gpunode.cluster.tracesim.trace import (
    POD_COLUMNS,
    TracePod,
    pod_from_row,
    read_rows,
    request_of,
)
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.errors import TraceError
from gpunode.placement import Request

TIME_COLUMNS = ("creation_time", "deletion_time", "scheduled_time")
MIN_DURATION_S = 1.0
_LAP_STREAM = 11  # numpy SeedSequence key: each lap's draws come from [seed, _LAP_STREAM, lap]
_BISECTIONS = 80


@dataclass(frozen=True)
class TimedPod:
    """One pod list row with its QoS class and its times (seconds; scheduled None: never scheduled)."""

    pod: TracePod
    qos: str
    creation: float
    scheduled: float | None
    deletion: float


def _time(path: Path, line: int, row: dict[str, str], key: str) -> float | None:
    raw = (row.get(key) or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"{path}:{line}: column {key}: expected a time in seconds, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{path}:{line}: column {key}: expected a non-negative time, got {raw!r}")
    return value


def load_timed_pods(path: Path) -> tuple[TimedPod, ...]:
    """Read a pod list with times; a missing or inconsistent time is a TraceError naming the line."""
    out = []
    for line, row in read_rows(path, (*POD_COLUMNS, *TIME_COLUMNS)):
        pod = pod_from_row(path, line, row)
        creation = _time(path, line, row, "creation_time")
        deletion = _time(path, line, row, "deletion_time")
        scheduled = _time(path, line, row, "scheduled_time")
        if creation is None or deletion is None:
            raise TraceError(f"{path}:{line}: a pod needs creation_time and deletion_time")
        if deletion < creation or (scheduled is not None and not creation <= scheduled <= deletion):
            raise TraceError(
                f"{path}:{line}: times out of order: creation {creation:g}, scheduled "
                f"{'-' if scheduled is None else f'{scheduled:g}'}, deletion {deletion:g}"
            )
        out.append(TimedPod(pod, (row.get("qos") or "").strip(), creation, scheduled, deletion))
    if not out:
        raise TraceError(f"{path}: no pods")
    return tuple(out)


@dataclass(frozen=True)
class Replay:
    """The jobs of one seed (by arrival), the lap length found for the load, and what the load came to."""

    jobs: tuple[Job, ...]
    horizon_s: float
    lap_s: float
    laps: int
    offered_load: float  # offered GPU-time inside [0, H) / (cluster GPUs x H)
    rows: int  # trace rows kept per lap
    dropped: int  # trace rows left out by the rules


class _Laps:
    """The kept rows and, lap by lap, their seeded durations and draws (independent of the lap length)."""

    def __init__(self, pods: Sequence[TimedPod], rules: SimRules, seed: int) -> None:
        self.rules = rules
        self.seed = seed
        start = min(p.deletion for p in pods)  # the observation start of the snapshot
        keep = [
            p
            for p in pods
            if (rules.replay.cpu_pods or p.pod.num_gpu > 0)
            and not (p.scheduled is None and rules.replay.unscheduled == "drop")
        ]
        if not keep:
            raise TraceError("the rules keep no pod of the trace", hint="set replay.cpuPods or unscheduled")
        self.pods = keep
        self.dropped = len(pods) - len(keep)
        offsets = np.array([max(p.creation, start) - start for p in keep])
        span = float(offsets.max())
        self.unit = offsets / span if span > 0 else np.zeros(len(keep))  # place within a lap, 0..1
        self.gpus = np.array([p.pod.total_gpu_milli / MILLI_PER_GPU for p in keep])
        self.base = np.array(
            [
                max((p.deletion - (p.scheduled if p.scheduled is not None else p.creation)), MIN_DURATION_S)
                for p in keep
            ]
        )
        self.unscheduled = np.array([p.scheduled is None for p in keep])
        ran = [(p.pod.num_gpu, self.base[i]) for i, p in enumerate(keep) if p.scheduled is not None]
        if not ran and rules.replay.unscheduled == "sample" and self.unscheduled.any():
            raise TraceError(
                "no scheduled row to draw runtimes from", hint="set replay.unscheduled: lifetime"
            )
        self.pool = {n: np.array([d for m, d in ran if m == n]) for n in {m for m, _ in ran}}
        self.pool_all = np.array([d for _, d in ran])
        self._laps: list[dict[str, np.ndarray]] = []

    def lap(self, k: int) -> dict[str, np.ndarray]:
        """Lap k's durations and draws (cached)."""
        while len(self._laps) <= k:
            self._laps.append(self._draw(len(self._laps)))
        return self._laps[k]

    def _draw(self, k: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, _LAP_STREAM, k])
        n = len(self.pods)
        sample = rng.random(n)
        gang = rng.random(n)
        members = rng.integers(0, 1 << 30, n)
        noise = rng.standard_normal(n)
        durations = self.base.copy()
        if self.rules.replay.unscheduled == "sample":
            for i in np.flatnonzero(self.unscheduled):
                pool = self.pool.get(self.pods[i].pod.num_gpu, self.pool_all)
                pool = pool if len(pool) else self.pool_all
                durations[i] = pool[int(sample[i] * len(pool))]
        return {"duration": durations, "gang": gang, "members": members, "noise": noise}

    def offered(self, lap_s: float, horizon: float) -> float:
        """GPU-seconds offered inside [0, horizon) with laps of length lap_s."""
        total = 0.0
        k = 0
        while k * lap_s < horizon:
            arrival = (k + self.unit) * lap_s
            inside = arrival < horizon
            d = self.lap(k)["duration"]
            total += float((self.gpus * np.minimum(d, horizon - arrival))[inside].sum())
            k += 1
        return total


def solve_lap(laps: _Laps, *, load: float, cluster_gpus: float, horizon: float, max_jobs: int) -> float:
    """The lap length at which the offered GPU-time inside [0, horizon) is load x cluster_gpus x horizon."""
    target = load * cluster_gpus * horizon
    rows = len(laps.pods)
    shortest = horizon * rows / max_jobs  # at most max_jobs arrivals
    if laps.offered(shortest, horizon) < target:
        raise TraceError(
            f"load {load:g} cannot be offered with at most {max_jobs} jobs over {horizon:g} s",
            hint="lower --load, or raise replay.maxJobs in the rules file",
        )
    lo, hi = math.log(shortest), math.log(horizon * 1e6)
    for _ in range(_BISECTIONS):  # offered() falls as the lap grows: keep lo at or above the target
        mid = (lo + hi) / 2
        if laps.offered(math.exp(mid), horizon) >= target:
            lo = mid
        else:
            hi = mid
    return math.exp(lo)


def build_replay(
    pods: Sequence[TimedPod],
    *,
    cluster_gpus: float,
    load: float,
    rules: SimRules,
    seed: int,
    priorities: dict[str, int] | None = None,
    asks: MemoryAsks | None = None,
) -> Replay:
    """The jobs of one seed: rows laid out in laps over the horizon so that the offered load is `load`."""
    if not (load > 0 and math.isfinite(load)):
        raise TraceError(f"--load must be a positive number, got {load}", hint="e.g. --load 0.9")
    if cluster_gpus <= 0:
        raise TraceError("the node list has no GPUs: no load can be offered")
    laps = _Laps(pods, rules, seed)
    horizon = rules.replay.horizon_s
    lap_s = solve_lap(
        laps, load=load, cluster_gpus=cluster_gpus, horizon=horizon, max_jobs=rules.replay.max_jobs
    )
    jobs: list[Job] = []
    k = 0
    while k * lap_s < horizon:
        jobs.extend(_lap_jobs(laps, k, lap_s, horizon, priorities or {}, asks))
        k += 1
    jobs.sort(key=lambda j: (j.arrival, j.name))
    return Replay(
        jobs=tuple(jobs),
        horizon_s=horizon,
        lap_s=lap_s,
        laps=k,
        offered_load=laps.offered(lap_s, horizon) / (cluster_gpus * horizon),
        rows=len(laps.pods),
        dropped=laps.dropped,
    )


def _lap_jobs(
    laps: _Laps, k: int, lap_s: float, horizon: float, priorities: dict[str, int], asks: MemoryAsks | None
) -> list[Job]:
    rules = laps.rules
    draws = laps.lap(k)
    out = []
    for i, timed in enumerate(laps.pods):
        arrival = float((k + laps.unit[i]) * lap_s)
        if arrival >= horizon:
            continue
        pod = timed.pod
        duration = float(draws["duration"][i])
        queue = rules.queues.queue_of(pod.name, timed.qos)
        if rules.priority.by == "qos":
            priority = rules.priority.qos.get(timed.qos, priorities.get(queue, 0))
        else:
            priority = priorities.get(queue, 0)
        if rules.estimates.mode == "exact":
            estimate: float | None = duration * rules.estimates.bias
        elif rules.estimates.mode == "noisy":
            estimate = (
                duration * math.exp(rules.estimates.sigma * float(draws["noise"][i])) * rules.estimates.bias
            )
        else:
            estimate = None
        out.append(
            Job(
                name=pod.name if k == 0 else f"{pod.name}~{k}",
                queue=queue,
                pods=_pods(pod, rules, float(draws["gang"][i]), int(draws["members"][i]), asks),
                arrival=arrival,
                priority=priority,
                runtime_estimate=estimate,
                duration=duration,
            )
        )
    return out


def _pods(
    pod: TracePod, rules: SimRules, gang_draw: float, member_draw: int, asks: MemoryAsks | None = None
) -> tuple[Request, ...]:
    """The trace pod as one request, or split into a gang of equal members when the draw says so."""
    if pod.num_gpu < 2 or gang_draw >= rules.gangs.share:
        return (request_of(pod, asks),)
    choices = [m for m in rules.gangs.members if m <= pod.num_gpu and pod.num_gpu % m == 0]
    if not choices:
        return (request_of(pod, asks),)
    members = choices[member_draw % len(choices)]
    member = Request(
        gpus=pod.num_gpu // members,
        gpu_models=pod.gpu_models,
        cpu_milli=pod.cpu_milli // members,
        memory_bytes=pod.memory_bytes // members,
    )
    return (member,) * members
