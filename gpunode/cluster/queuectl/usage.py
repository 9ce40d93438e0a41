"""The fair-share usage memory as the controller saves it, and the checks it passes before it is used again.

The Scheduler's UsageLedger (queueing/fairshare.py) lives in the controller's memory; the leader
saves it (usagestore.py) so that the next leader, after a restart or a failover, goes on from it
instead of from zero. What is saved is one figure per leaf queue and resource: the decayed
resource-seconds of UsageLedger.usage() at the time `at` (gpu in milli-GPU-seconds, gpu_memory in
byte-seconds, gpu/<model> in milli-GPU-seconds), with the half-life and window they were figured
with. Its size grows with the queues and resources, never with the jobs.

Anyone allowed to write ConfigMaps in the controller's namespace can edit it, so decode() refuses
what this controller cannot have written (QueueUsageRefused, one line): more than MAX_BYTES, not
the JSON below, numbers that are not finite or are negative, a time more than CLOCK_SKEW_S ahead of
this clock (one up to that far ahead is taken as now, so decay cannot be run backwards to inflate
the figures), more than MAX_QUEUES entries. seed() refuses a figure no cluster of the current
capacity could have reached: above PLAUSIBLE x capacity x half-life / ln 2 (the decayed integral of
holding the whole capacity for ever; the slack covers a cluster that shrank since). Entries of
queues that are no longer leaves, and of resources the cluster no longer has, are dropped. Usage
saved with another half-life or window is discarded (usage starts afresh), as an in-process rebuild
does (Adoption.inherit_usage): those settings change what the figures mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.lossbudget import HALF_LIFE_S
from gpunode.cluster.queueing.model import GPU
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.errors import QueueUsageRefused

VERSION = 1
DATA_KEY = "usage.json"
MAX_BYTES = 256 * 1024  # a few thousand queue-resource figures; a ConfigMap may hold 1 MiB
MAX_QUEUES = 4096
MAX_NAME = 253
CLOCK_SKEW_S = 60.0
PLAUSIBLE = 10.0


class SavedLosses(msgspec.Struct, forbid_unknown_fields=True):
    """The loss budget's sums (queueing/lossbudget.py), decayed to the same `at` as the usage."""

    lost: float = msgspec.field(name="lostGpuSeconds")
    delivered: float = msgspec.field(name="deliveredGpuSeconds")


class SavedUsage(msgspec.Struct, forbid_unknown_fields=True):
    """The saved state (the JSON of the ConfigMap's usage.json)."""

    version: int
    at: float  # seconds since the epoch the figures are decayed to
    half_life_s: float = msgspec.field(name="halfLifeSeconds")
    window_s: float = msgspec.field(name="windowSeconds")
    usage: dict[str, dict[str, float]]  # leaf queue -> resource -> decayed resource-seconds
    saved_by: str = msgspec.field(name="savedBy", default="")
    losses: SavedLosses | None = None  # with preemption.shareReclaim.lossBudget


@dataclass(frozen=True)
class Outcome:
    """What became of a load: loaded, absent, discarded, refused or error (the metric label), and why."""

    outcome: str
    message: str
    hint: str = ""


def encode(state: SavedUsage) -> bytes:
    """The JSON text saved."""
    return msgspec.json.encode(state)


def snapshot(sched: Scheduler, now: float, identity: str) -> SavedUsage | None:
    """The Scheduler's usage charged up to `now`, ready to save; None when it keeps no usage memory."""
    got = sched.usage_memory(now)
    if got is None:
        return None
    usage, at = got
    kept = {q: {r: v for r, v in amounts.items() if v > 0} for q, amounts in usage.items()}
    fair = sched.config.fair_share
    losses = None
    if sched.loss_budget is not None:
        losses = SavedLosses(*sched.loss_budget.state(at))
    return SavedUsage(
        version=VERSION,
        at=at,
        half_life_s=fair.half_life_s,
        window_s=fair.window_s,
        usage={q: a for q, a in sorted(kept.items()) if a},
        saved_by=identity,
        losses=losses,
    )


def _finite(value: float, what: str, where: str, *, positive: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise QueueUsageRefused(f"{where}: {what} is {value!r}, not a finite {kind} number")


def _name(text: str) -> str:
    """A name read from the ConfigMap, fit for one log line (quoted, escaped, shortened)."""
    return ascii(text[:60] + ("..." if len(text) > 60 else ""))


def decode(text: str, now: float, where: str) -> SavedUsage:
    """The saved state read from `text`, checked (see the module docstring); `at` no later than `now`."""
    size = len(text.encode())
    if size > MAX_BYTES:
        raise QueueUsageRefused(f"{where}: {size} bytes, more than the {MAX_BYTES} a saved usage may take")
    try:
        state = msgspec.json.decode(text, type=SavedUsage)
    except msgspec.ValidationError as exc:
        raise QueueUsageRefused(f"{where}: not a saved usage: {exc}") from None
    except msgspec.DecodeError as exc:
        raise QueueUsageRefused(f"{where}: not JSON: {exc}") from None
    if state.version != VERSION:
        raise QueueUsageRefused(f"{where}: version {state.version}, this controller reads version {VERSION}")
    _finite(state.at, "the time", where, positive=True)
    _finite(state.half_life_s, "the half-life", where, positive=True)
    _finite(state.window_s, "the window", where, positive=True)
    if state.at > now + CLOCK_SKEW_S:
        raise QueueUsageRefused(
            f"{where}: saved {state.at - now:.0f} s in the future (more than the {CLOCK_SKEW_S:g} s "
            "two clocks may differ by)"
        )
    if len(state.usage) > MAX_QUEUES:
        raise QueueUsageRefused(f"{where}: {len(state.usage)} queues, more than {MAX_QUEUES}")
    for queue, amounts in state.usage.items():
        if not queue or len(queue) > MAX_NAME or len(amounts) > MAX_QUEUES:
            raise QueueUsageRefused(f"{where}: an entry named {_name(queue)} cannot be a queue's")
        for resource, value in amounts.items():
            if not resource or len(resource) > MAX_NAME:
                raise QueueUsageRefused(f"{where}: queue {_name(queue)}: a resource named {_name(resource)}")
            _finite(value, f"queue {_name(queue)}, {_name(resource)}", where)
    if state.losses is not None:
        _finite(state.losses.lost, "the GPU-seconds lost to preemption", where)
        _finite(state.losses.delivered, "the GPU-seconds delivered", where)
    state.at = min(state.at, now)
    return state


def seed(sched: Scheduler, state: SavedUsage, config: QueueConfig, where: str) -> Outcome:
    """Put checked saved usage into the Scheduler's memory; never raises (the Outcome says what happened)."""
    fair = config.fair_share
    if (state.half_life_s, state.window_s) != (fair.half_life_s, fair.window_s):
        return Outcome(
            "discarded",
            f"{where}: saved with half-life {state.half_life_s:g} s and window {state.window_s:g} s, now "
            f"{fair.half_life_s:g} s and {fair.window_s:g} s: fair-share usage starts afresh",
        )
    capacity = sched.cap.capacity()
    leaves = set(config.leaves)
    usage: dict[str, dict[str, float]] = {}
    for queue, amounts in state.usage.items():
        if queue not in leaves:
            continue
        kept = usage[queue] = {}
        for resource, value in amounts.items():
            cap = capacity.get(resource, 0)
            if cap <= 0:
                continue
            bound = PLAUSIBLE * cap * fair.half_life_s / math.log(2)
            if value > bound:
                return Outcome(
                    "refused",
                    f"{where}: queue {queue} used {value:.4g} {resource}-seconds, more than the whole "
                    f"cluster can in a half-life of {fair.half_life_s:g} s ({bound:.4g}, with slack): "
                    "fair-share usage starts afresh",
                    QueueUsageRefused.default_hint,
                )
            kept[resource] = value
    budget = sched.loss_budget
    if state.losses is not None and budget is not None:
        bound = PLAUSIBLE * capacity.get(GPU, 0) / MILLI_PER_GPU * HALF_LIFE_S / math.log(2)
        largest = max(state.losses.lost, state.losses.delivered)
        if largest > bound:
            return Outcome(
                "refused",
                f"{where}: {largest:.4g} GPU-seconds delivered or lost, "
                f"more than the whole cluster can in a half-life of {HALF_LIFE_S:g} s ({bound:.4g}, with slack): "
                "fair-share usage starts afresh",
                QueueUsageRefused.default_hint,
            )
    dropped = sorted(set(state.usage) - leaves)
    try:
        seeded = sched.seed_usage(usage, state.at)
    except ValueError as exc:  # decode() lets nothing through that seed_usage refuses
        return Outcome("refused", f"{where}: {exc}", QueueUsageRefused.default_hint)
    if state.losses is not None and budget is not None:
        budget.seed(state.losses.lost, state.losses.delivered, state.at)
    more = ""
    if dropped:
        named = ", ".join(_name(q) for q in dropped[:3])
        more = f"; dropped {len(dropped)} queue(s) not in the configuration ({named}...)"
    return Outcome("loaded", f"fair-share usage of {seeded} queue(s) loaded from {where}{more}")
