"""The time simulator's rules: how trace pods become queued jobs, as data (gpunode/examples/sim-rules.yaml).

A rules file says how long the replay offers arrivals, what to do with rows the
trace never scheduled, which queue and priority a pod's job gets, which
multi-GPU jobs become multi-pod gangs, what runtime estimate backfill sees, how
a preempted job checkpoints, and how the metrics are windowed. Every key is
optional (the defaults are the example file's); an unknown key or a bad value
is one SimRulesError naming the key.

What a seed varies (everything else is fixed by the trace and the rules): the
runtimes drawn for never-scheduled rows (`unscheduled: sample`), which
multi-GPU jobs become gangs and how many pods each has, the estimate noise
(`estimates.mode: noisy`), and the placement's tie-breaking. The queue a job
goes to is a stable hash of the pod's trace name (the same in every seed and
lap), so a seed never moves work between teams.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from gpunode.config.reader import load_yaml
from gpunode.contract.reader import SectionReader
from gpunode.errors import ConfigError, SimRulesError

MAX_FILE_BYTES = 1 << 16
UNSCHEDULED = ("sample", "lifetime", "drop")
QUEUE_BY = ("hash", "qos")
PRIORITY_BY = ("queue", "qos")
ESTIMATES = ("exact", "default", "noisy")
DEFAULT_TEAMS = {"team-a": 1.0, "team-b": 1.0, "team-c": 1.0, "team-d": 1.0}
DEFAULT_QOS_QUEUES = {"LS": "team-a", "BE": "team-b", "Burstable": "team-c", "Guaranteed": "team-d"}
DEFAULT_QOS_PRIORITY = {"LS": 1, "Guaranteed": 1, "Burstable": 0, "BE": 0}


@dataclass(frozen=True)
class ReplayRules:
    """The replay window and the rows kept: see docs/queueing.md, "Time simulator"."""

    horizon_s: float = 1800.0  # arrivals are offered over [0, horizon)
    max_jobs: int = 200_000  # the most jobs load compression may lay out (laps x rows)
    drain_limit_s: float = 7 * 86400.0  # after the horizon, give up on jobs not started this long after it
    tick_s: float = 1.0  # the scheduler runs at most once per tick (0: after every batch of same-time events)
    unscheduled: str = "sample"  # rows without scheduled_time: sample | lifetime | drop
    cpu_pods: bool = False  # keep pods that ask for no GPU


@dataclass(frozen=True)
class QueueRules:
    """Which leaf queue a job goes to: by a stable hash of the pod name into teams, or by QoS class."""

    by: str = "hash"
    teams: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TEAMS))  # hash: share of jobs
    qos: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_QOS_QUEUES))  # qos: class -> queue
    default: str = "team-d"  # qos: a class not listed

    def queue_of(self, name: str, qos: str) -> str:
        """The leaf queue of a pod."""
        if self.by == "qos":
            return self.qos.get(qos, self.default)
        return hashed_team(name, self.teams)

    def names(self) -> tuple[str, ...]:
        """Every queue these rules can send a job to."""
        if self.by == "qos":
            return tuple(dict.fromkeys((*self.qos.values(), self.default)))
        return tuple(self.teams)


@dataclass(frozen=True)
class PriorityRules:
    """A job's priority: its queue's default, or a value per QoS class."""

    by: str = "queue"
    qos: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_QOS_PRIORITY))


@dataclass(frozen=True)
class GangRules:
    """A `share` of the multi-GPU jobs run as gangs: split into one of `members` pods (those dividing it)."""

    share: float = 0.5
    members: tuple[int, ...] = (2, 4)


@dataclass(frozen=True)
class EstimateRules:
    """What backfill is told: the true duration (exact: the ceiling), nothing (default), or a noisy one.

    bias scales the estimate of exact and noisy (systematically optimistic users: below 1; 1 leaves
    it as it is).
    """

    mode: str = "exact"
    sigma: float = 0.5  # noisy: duration x exp(N(0, sigma))
    bias: float = 1.0  # exact and noisy: the estimate x bias


@dataclass(frozen=True)
class CheckpointRules:
    """A victim told to stop saves a checkpoint `cost_s` after the notice, if that is before its deadline."""

    on_notice: bool = True
    cost_s: float = 60.0


@dataclass(frozen=True)
class MetricRules:
    """Fairness windows and the bounded-slowdown floor."""

    window_s: float = 86400.0
    slowdown_bound_s: float = 10.0


@dataclass(frozen=True)
class SimRules:
    """Every rule of one simulation (see the module docstring)."""

    replay: ReplayRules = field(default_factory=ReplayRules)
    queues: QueueRules = field(default_factory=QueueRules)
    priority: PriorityRules = field(default_factory=PriorityRules)
    gangs: GangRules = field(default_factory=GangRules)
    estimates: EstimateRules = field(default_factory=EstimateRules)
    checkpoint: CheckpointRules = field(default_factory=CheckpointRules)
    metrics: MetricRules = field(default_factory=MetricRules)


def hashed_team(name: str, teams: dict[str, float]) -> str:
    """The team of a name: a stable hash (BLAKE2b) mapped to [0, 1) and cut by the teams' shares in order."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    point = int.from_bytes(digest, "big") / 2**64 * sum(teams.values())
    acc = 0.0
    last = ""
    for team, share in teams.items():
        acc += share
        last = team
        if point < acc:
            return team
    return last


def load_rules(path: str | Path | None) -> SimRules:
    """Read a rules file (None: the defaults); every problem is one SimRulesError."""
    if path is None:
        return SimRules()
    where = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SimRulesError(
            f"{where}: cannot read the simulator rules: {exc.strerror or exc}",
            hint="check the path given to --rules",
        ) from None
    if len(raw) > MAX_FILE_BYTES:
        raise SimRulesError(f"{where}: the rules file is larger than {MAX_FILE_BYTES} bytes")
    try:
        data = load_yaml(raw.decode("utf-8", errors="replace"), where=where)
    except ConfigError as exc:
        raise SimRulesError(str(exc), hint=exc.hint) from None
    return parse_rules(data, where)


def parse_rules(data: object, where: str) -> SimRules:
    """Validate decoded YAML into SimRules."""
    top = SectionReader(data, f"{where}: ", error=SimRulesError)
    rules = SimRules(
        replay=_replay(top.section("replay")),
        queues=_queues(top.section("queues")),
        priority=_priority(top.section("priority")),
        gangs=_gangs(top.section("gangs")),
        estimates=_estimates(top.section("estimates")),
        checkpoint=_checkpoint(top.section("checkpoint")),
        metrics=_metrics(top.section("metrics")),
    )
    top.finish()
    return rules


def _replay(r: SectionReader) -> ReplayRules:
    d = ReplayRules()
    out = ReplayRules(
        horizon_s=r.duration("horizon", d.horizon_s, minimum=60.0),
        max_jobs=r.integer("maxJobs", d.max_jobs, minimum=1, maximum=10_000_000),
        drain_limit_s=r.duration("drainLimit", d.drain_limit_s, minimum=0.0),
        tick_s=r.duration("tick", d.tick_s, minimum=0.0, maximum=3600.0),
        unscheduled=r.choice("unscheduled", UNSCHEDULED, d.unscheduled),
        cpu_pods=r.flag("cpuPods", d.cpu_pods),
    )
    r.finish()
    return out


def _queues(r: SectionReader) -> QueueRules:
    d = QueueRules()
    by = r.choice("by", QUEUE_BY, d.by)
    teams: dict[str, float] = dict(d.teams)
    if r.has("teams"):
        t = r.section("teams")
        raw = t.unread()
        if not raw:
            raise r.fail("teams", "expected at least one team with its share, e.g. {team-a: 1}")
        teams = {str(k): t.number(str(k), minimum=0.0) for k in raw}
        if sum(teams.values()) <= 0:
            raise r.fail("teams", "the shares add up to 0: give at least one team a positive share")
    qos: dict[str, str] = dict(d.qos)
    if r.has("qos"):
        q = r.section("qos")
        qos = {str(k): q.get(str(k), str) for k in q.unread()}
    out = QueueRules(by=by, teams=teams, qos=qos, default=r.get("default", str, d.default))
    r.finish()
    return out


def _priority(r: SectionReader) -> PriorityRules:
    by = r.choice("by", PRIORITY_BY, "queue")
    values: dict[str, int] = dict(DEFAULT_QOS_PRIORITY)
    if r.has("qos"):
        q = r.section("qos")
        values = {str(k): q.integer(str(k), minimum=-(10**9), maximum=10**9) for k in q.unread()}
    r.finish()
    return PriorityRules(by=by, qos=values)


def _gangs(r: SectionReader) -> GangRules:
    d = GangRules()
    share = r.number("share", d.share, minimum=0.0, maximum=1.0)
    members = r.int_list("members", d.members)
    if not members or any(m < 2 or m > 64 for m in members):
        raise r.fail("members", f"expected pod counts within 2..64, got {list(members)}")
    r.finish()
    return GangRules(share=share, members=tuple(members))


def _estimates(r: SectionReader) -> EstimateRules:
    d = EstimateRules()
    out = EstimateRules(
        mode=r.choice("mode", ESTIMATES, d.mode),
        sigma=r.number("sigma", d.sigma, minimum=0.0, maximum=5.0),
        bias=r.number("bias", d.bias, minimum=0.01, maximum=100.0),
    )
    r.finish()
    return out


def _checkpoint(r: SectionReader) -> CheckpointRules:
    d = CheckpointRules()
    out = CheckpointRules(on_notice=r.flag("onNotice", d.on_notice), cost_s=r.duration("cost", d.cost_s))
    r.finish()
    return out


def _metrics(r: SectionReader) -> MetricRules:
    d = MetricRules()
    out = MetricRules(
        window_s=r.duration("window", d.window_s, minimum=60.0),
        slowdown_bound_s=r.duration("slowdownBound", d.slowdown_bound_s, minimum=0.001),
    )
    r.finish()
    return out
