"""The queueing data model: resource amounts, jobs, running jobs and the scheduler's decisions.

Amounts are plain dicts from a resource name to an integer: `gpu` in milli-GPU
(1000 = one whole GPU), `gpu_memory` in bytes, and `gpu/<model>` in milli-GPU of
that GPU model (only where a queue has a per-model quota). A job is one or more
pods admitted together (a gang when it has several); each pod is a placement
Request, so admission places members with the same code the extender runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from gpunode.contract.names import MILLI_PER_GPU
from gpunode.placement.model import Request

GPU = "gpu"  # milli-GPU
GPU_MEMORY = "gpu_memory"  # bytes
MODEL_PREFIX = "gpu/"  # + model: milli-GPU of one model
BASE_RESOURCES = (GPU, GPU_MEMORY)

Amounts = dict[str, int]


def model_key(model: str) -> str:
    """The resource name of one GPU model's milli-GPUs."""
    return MODEL_PREFIX + model


def add(a: Mapping[str, int], b: Mapping[str, int]) -> Amounts:
    """a + b, resource by resource."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def sub(a: Mapping[str, int], b: Mapping[str, int]) -> Amounts:
    """a - b, resource by resource (may go negative)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) - v
    return out


def total(amounts: Iterable[Mapping[str, int]]) -> Amounts:
    """The sum of several amounts."""
    out: Amounts = {}
    for a in amounts:
        for k, v in a.items():
            out[k] = out.get(k, 0) + v
    return out


def within(a: Mapping[str, int], limit: Mapping[str, int]) -> bool:
    """Every resource of a is at most limit's (a resource missing from limit is unlimited)."""
    return all(v <= limit[k] for k, v in a.items() if k in limit)


@dataclass(frozen=True)
class Job:
    """A unit of admission: its pods start together or not at all.

    priority: higher runs first and may preempt lower. runtime_estimate: what
    backfill plans with (None: the configured default). duration: the true
    runtime, known only to the simulator. gpu_memory_bytes: the job's GPU memory
    demand for quotas and fairness (None: derived from its pods' requests; pods
    asking by compute share count the memory of that share of a nominal GPU).
    """

    name: str
    queue: str
    pods: tuple[Request, ...]
    arrival: float
    priority: int = 0
    runtime_estimate: float | None = None
    duration: float | None = None
    gang_timeout: float | None = None
    preemptible: bool = True
    gpu_memory_bytes: int | None = None

    @property
    def gang(self) -> bool:
        """A job of several pods: all-or-nothing."""
        return len(self.pods) > 1

    @cached_property
    def gpu_milli(self) -> int:
        """The GPU the job asks for in all, in milli-GPU (a MIG pod counts as its parent's share: 0 here)."""
        return sum(p.gpus * MILLI_PER_GPU + p.gpu_milli for p in self.pods)

    @property
    def multi_gpu(self) -> bool:
        """More than one GPU in all (a gang, or one pod with several whole GPUs)."""
        return self.gpu_milli > MILLI_PER_GPU


@dataclass(frozen=True)
class PodPlacement:
    """Where one pod of a job goes: the node and the GPUs (UUIDs)."""

    node: str
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """A placement for every pod of a job, in the order of job.pods."""

    pods: tuple[PodPlacement, ...]

    @property
    def nodes(self) -> frozenset[str]:
        """The nodes the plan uses."""
        return frozenset(p.node for p in self.pods)


@dataclass
class RunningJob:
    """An admitted job: when it started, where, what it holds, and its preemption state."""

    job: Job
    start: float
    plan: Plan
    usage: Amounts  # what it holds, charged to its queue
    borrowed: bool = False  # admitted above its queue's guarantee
    last_checkpoint: float | None = None
    notice_deadline: float | None = None  # set once it is told to stop
    preemptor: str | None = None  # the job it makes room for
    idle_since: float | None = None  # its GPUs have been idle since (set by the driver: Scheduler.mark_idle)
    estimate: float | None = None  # the runtime backfill planned it with (None: the job's own estimate)

    def expected_end(self, default_runtime: float) -> float:
        """When backfill expects it to end: start + the planned runtime (or its estimate, or the default)."""
        estimate = self.estimate if self.estimate is not None else self.job.runtime_estimate
        return self.start + (default_runtime if estimate is None else estimate)

    @property
    def since(self) -> float:
        """What a stop would lose the work since: its last checkpoint, or its start."""
        return self.start if self.last_checkpoint is None else max(self.start, self.last_checkpoint)

    def lost_work(self, now: float) -> float:
        """GPU-seconds lost if it is stopped now: since the last checkpoint, or since the start."""
        return max(0.0, now - self.since) * self.job.gpu_milli / MILLI_PER_GPU


@dataclass(frozen=True)
class Admission:
    """Start this job now, with this placement."""

    job: Job
    plan: Plan
    borrowed: bool


@dataclass(frozen=True)
class Notice:
    """Tell `victim` to stop by `deadline` (it may checkpoint until then), to make room for `preemptor`."""

    victim: str
    preemptor: str
    deadline: float
    reason: str  # "reclaim" | "priority" | "idle"


@dataclass(frozen=True)
class Waiting:
    """Why a pending job is not admitted, for events and reports (e.g. "team-a is over its quota")."""

    job: str
    queue: str
    position: int  # 1-based position in its queue
    reason: str


@dataclass
class Decisions:
    """What one scheduling cycle decided."""

    admit: list[Admission] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    kill: list[str] = field(default_factory=list)  # victims whose notice ran out: stop them now
    timed_out: list[Waiting] = field(default_factory=list)  # gangs waiting past their timeout (reported once)
    waiting: list[Waiting] = field(default_factory=list)
