"""The records the scheduling cycle keeps of a pending job and of a nomination.

The bottom of the scheduling cycle's modules: it imports only the model, and the
steps (admit, adoption, ordering, preempt, reasons, rooms, waitlist) and the
engine on top of them import it. The one-way shape of the cycle:

    model, pending                      records
    quotas, fairshare, capacity, ...    the books the steps read and write
    waitlist, backfill, preempt, reasons  steps that see the scheduler through a protocol
    admit, adoption, ordering, rooms    the Scheduler's mixins
    engine                              the Scheduler: the cycle calling the steps
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpunode.cluster.queueing.model import Amounts, Job, Plan


@dataclass
class Pending:
    """A job waiting for admission, with what the engine remembers about it."""

    job: Job
    demand: Amounts
    seq: int
    since: float
    shape: int
    runtime: float = 0.0  # what backfill expects it to run: its estimate, or the configured default
    held: list[tuple[str, Job, Plan]] = field(default_factory=list)  # pods placed so far (no-gang mode)
    why: str = ""
    reported_why: str = ""
    shift: float = 0.0  # seconds its place in its queue moves back for its size (config.OrderSettings)

    key: tuple[int, float, int] = field(init=False, repr=False)
    # order within a queue: higher priority first, then earlier (shifted) arrival, then submission order

    def __post_init__(self) -> None:
        self.key = (-self.job.priority, self.job.arrival + self.shift, self.seq)


@dataclass
class Nomination:
    """Room being freed for a preemptor: its victims and the nodes it will use."""

    victims: tuple[str, ...]
    nodes: frozenset[str]
    deadline: float
