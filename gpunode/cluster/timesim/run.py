"""The time simulator's event loop: one replay through one policy preset, with the queueing engine.

Events (a heap ordered by time, then kind): a job finishes, a victim saves its
checkpoint, a job arrives, or a wake-up (a notice deadline or a gang timeout, so
the scheduler looks again then). Events are handled at their own times; the
engine runs one cycle at the end of each tick (`replay.tick`, 1 s: the next
multiple of it at or after the earliest pending event), again at once while it
stopped victims then. A tick of 0 cycles after every batch of same-time events;
1 s adds at most 1 s to a wait (jobs run a median of 616 s) and cuts the number
of cycles several-fold at high load. The engine's decisions become events: an
admitted job finishes after its remaining runtime,
a victim told to stop checkpoints `checkpoint.cost` later when that is before
its deadline, and at the deadline the engine stops it and requeues it. A
restarted job runs what was left at its last checkpoint (all of it without
one); the work since is lost.

The run stops once every job has arrived, none waits and the horizon is passed
(every job has a queueing delay; the running ones end at start + remaining
runtime, which no decision can change any more), or at horizon + drainLimit (jobs not started by
then are reported as `not_started`). A job no node could ever hold (it does not
fit the empty cluster) is not submitted; it is counted in `unplaceable`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.energy import EnergyMeter
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import GPU, Decisions, Job
from gpunode.cluster.queueing.presets import preset as preset_named
from gpunode.cluster.timesim.metrics import JobRecord, Timeline, summarize_run
from gpunode.cluster.timesim.rules import SimRules
from gpunode.cluster.timesim.trace import Replay
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.placement import NodeState, TargetWorkload

FINISH, CHECKPOINT, ARRIVAL, WAKE = 0, 1, 2, 3
MAX_CYCLES_PER_INSTANT = 4


@dataclass
class RunResult:
    """One (policy, seed) run: metrics per queue, a thinned timeline for plots, the delays for CDFs."""

    policy: str
    seed: int
    load: float
    metrics: dict[str, dict[str, float]]
    replay: dict[str, float]
    plot_times: tuple[float, ...]
    plot_held: tuple[tuple[float, ...], ...]  # GPUs per queue at each plot time
    queues: tuple[str, ...]
    delays: tuple[float, ...]
    wall_s: float


class _Run:
    """The mutable state of one run."""

    def __init__(
        self, replay: Replay, config: QueueConfig, cap: ClusterCapacity, policy: str, rules: SimRules
    ) -> None:
        self.replay, self.config, self.cap, self.rules = replay, config, cap, rules
        self.sched = Scheduler(config, cap, preset_named(policy))
        self.sched.report_waiting = False  # the replay reads timeouts, not the waiting reasons
        self.jobs: dict[str, Job] = {j.name: j for j in replay.jobs}
        self.records: dict[str, JobRecord] = {}
        self.remaining: dict[str, float] = {}
        self.attempt: dict[str, int] = {}
        self.run_start: dict[str, float] = {}
        self.saved: dict[str, float] = {}  # last checkpoint of the current attempt
        self.queues = config.leaves
        self.waiting_gpu: dict[str, float] = dict.fromkeys(self.queues, 0.0)
        self.timeline = Timeline(self.queues)
        self.meter = EnergyMeter()
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.seq = itertools.count()
        self.wakes: set[float] = set()
        self.arrivals_left = 0
        self.unplaceable = 0
        self.partial_seen = 0
        self.now = 0.0

    def push(self, t: float, kind: int, name: str = "", attempt: int = 0) -> None:
        if kind == WAKE:
            if t in self.wakes:
                return
            self.wakes.add(t)
        heapq.heappush(self.heap, (t, kind, next(self.seq), name, attempt))

    def load(self) -> None:
        gang_timeout = self.config.gang_timeout_s
        fits: dict[tuple[object, ...], bool] = {}
        for job in self.replay.jobs:
            gpus = job.gpu_milli / MILLI_PER_GPU
            self.records[job.name] = JobRecord(
                name=job.name,
                queue=job.queue,
                arrival=job.arrival,
                gpus=gpus,
                duration=float(job.duration or 0.0),
                multi_gpu=job.multi_gpu,
                gang=job.gang,
            )
            if job.pods not in fits:
                fits[job.pods] = self.cap.fits_empty(job)
            if not fits[job.pods]:
                self.unplaceable += 1
                del self.records[job.name]
                continue
            self.remaining[job.name] = float(job.duration or 0.0)
            self.attempt[job.name] = 0
            self.push(job.arrival, ARRIVAL, job.name)
            self.arrivals_left += 1
            if job.gang:
                self.push(job.arrival + (job.gang_timeout or gang_timeout), WAKE)

    def handle(self, kind: int, name: str, attempt: int, t: float) -> None:
        if kind == ARRIVAL:
            self.sched.submit(self.jobs[name], t)
            self.waiting_gpu[self.jobs[name].queue] += self.records[name].gpus
            self.arrivals_left -= 1
        elif self.attempt[name] != attempt or name not in self.sched.running:
            return  # a finish or checkpoint of an attempt that a preemption ended
        elif kind == FINISH:
            self.sched.finished(name, t)
            self.records[name].end = t
        elif kind == CHECKPOINT:
            self.sched.checkpoint(name, t)
            self.saved[name] = t

    def apply(self, d: Decisions, t: float) -> None:
        for name in d.kill:  # already released and requeued by the scheduler
            rec = self.records[name]
            start = self.run_start[name]
            saved = self.saved.pop(name, None)
            done = (saved - start) if saved is not None else 0.0
            self.remaining[name] = max(self.remaining[name] - done, 0.0)
            rec.preemptions += 1
            rec.lost_gpu_s += (t - (saved if saved is not None else start)) * rec.gpus
            self.attempt[name] += 1
            self.waiting_gpu[rec.queue] += rec.gpus
        for adm in d.admit:
            name = adm.job.name
            rec = self.records[name]
            if rec.first_start is None:
                rec.first_start = t
            self.run_start[name] = t
            self.saved.pop(name, None)
            self.attempt[name] += 1
            self.waiting_gpu[rec.queue] -= rec.gpus
            self.push(t + self.remaining[name], FINISH, name, self.attempt[name])
        for notice in d.notices:
            deadline = notice.deadline
            if self.rules.checkpoint.on_notice and t + self.rules.checkpoint.cost_s < deadline:
                victim = notice.victim
                self.push(t + self.rules.checkpoint.cost_s, CHECKPOINT, victim, self.attempt[victim])
            self.push(deadline, WAKE)
        for w in d.timed_out:
            if w.job in self.records:
                self.records[w.job].timed_out = True

    def observe(self, t: float) -> None:
        if len(self.sched.partial_gangs) != self.partial_seen:
            for name in self.sched.partial_gangs:
                if name in self.records:
                    self.records[name].partial_gang = True
            self.partial_seen = len(self.sched.partial_gangs)
        allocated = self.sched.allocated_by_queue()
        held = [allocated.get(q, {}).get(GPU, 0) / MILLI_PER_GPU for q in self.queues]
        demand = [h + max(self.waiting_gpu[q], 0.0) for h, q in zip(held, self.queues, strict=True)]
        self.timeline.record(t, held, demand)
        if t < self.replay.horizon_s:
            self.meter.observe(t, self.cap.gpu_activity())

    def step(self) -> bool:
        """Process the next instant; False when the run is over."""
        if not self.heap:
            return False
        first = self.heap[0][0]
        if first > self.replay.horizon_s + self.rules.replay.drain_limit_s:
            return False
        tick = self.rules.replay.tick_s
        t = max(math.ceil(first / tick) * tick, first) if tick > 0 else first
        self.now = t
        while self.heap and self.heap[0][0] <= t:
            at, kind, _, name, attempt = heapq.heappop(self.heap)
            if kind == WAKE:
                self.wakes.discard(at)
            else:
                self.handle(kind, name, attempt, at)
        for _ in range(MAX_CYCLES_PER_INSTANT):
            d = self.sched.cycle(t)
            self.apply(d, t)
            if not d.kill:
                break
        deadline = self.sched.next_deadline()
        if deadline is not None and deadline > t:
            self.push(deadline, WAKE)
        self.observe(t)
        before_horizon = bool(self.heap) and self.heap[0][0] < self.replay.horizon_s
        return (
            self.arrivals_left > 0 or self.sched.pending_count > 0 or deadline is not None or before_horizon
        )

    def finish(self) -> float:
        """Close the books: running jobs end at start + remaining; returns the end of the run."""
        end = self.now
        for name in self.sched.running:
            self.records[name].end = self.run_start[name] + self.remaining[name]
        if end < self.replay.horizon_s:
            self.meter.observe(self.replay.horizon_s, self.cap.gpu_activity())
        else:
            self.meter.observe(self.replay.horizon_s, {})
        return end


def run_replay(
    replay: Replay,
    *,
    config: QueueConfig,
    nodes: Sequence[NodeState],
    workload: TargetWorkload | None,
    policy: str,
    seed: int,
    load: float,
    rules: SimRules,
    tick: Callable[[], None] | None = None,
) -> RunResult:
    """Run one replay through one preset and measure it (see the module docstring)."""
    started = time.perf_counter()
    energy_weight = config.energy_weight if preset_named(policy).energy else 0.0
    cap = ClusterCapacity(
        nodes, workload=workload, policy=config.placement_policy, energy_weight=energy_weight, seed=seed
    )
    cluster_gpus = cap.capacity().get(GPU, 0) / MILLI_PER_GPU
    run = _Run(replay, config, cap, policy, rules)
    run.load()
    run.observe(0.0)
    steps = 0
    while run.step():
        steps += 1
        if tick is not None and steps % 1000 == 0:
            tick()
    end = run.finish()
    records = list(run.records.values())
    metrics = summarize_run(
        records,
        run.timeline,
        config,
        horizon=replay.horizon_s,
        end=max(end, replay.horizon_s),
        cluster_gpus=cluster_gpus,
        window=rules.metrics.window_s,
        slowdown_bound=rules.metrics.slowdown_bound_s,
        energy_seconds=run.meter.seconds,
    )
    metrics["all"]["unplaceable"] = run.unplaceable
    times, held = _thin(run.timeline, points=400, until=max(end, replay.horizon_s))
    return RunResult(
        policy=policy,
        seed=seed,
        load=load,
        metrics=metrics,
        replay={
            "jobs": len(replay.jobs),
            "laps": replay.laps,
            "lap_s": replay.lap_s,
            "horizon_s": replay.horizon_s,
            "offered_load": replay.offered_load,
            "end_s": end,
            "cluster_gpus": cluster_gpus,
        },
        plot_times=times,
        plot_held=held,
        queues=run.queues,
        delays=tuple((r.first_start if r.first_start is not None else end) - r.arrival for r in records),
        wall_s=time.perf_counter() - started,
    )


def _thin(
    timeline: Timeline, *, points: int, until: float
) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """The timeline sampled at `points` evenly spaced times over [0, until] (step function)."""
    import numpy as np

    t = np.asarray(timeline.times)
    if not len(t):
        return (), ()
    grid = np.linspace(0.0, until, points)
    idx = np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(t) - 1)
    held = [timeline.held[i] for i in idx]
    return tuple(float(x) for x in grid), tuple(held)
