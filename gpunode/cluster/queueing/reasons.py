"""Why a job waits, in sentences a person reads (and the live controller posts as Kubernetes events).

Every reason starts with where the job stands ("queued in team-a, position 12:")
and says what it waits for: its queue's quota, room for its GPUs (with the
reservation it holds, if any), members of a gang that do not fit, victims
being stopped for it, or that it can never fit this cluster.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from gpunode.cluster.queueing.model import GPU, Decisions, Waiting
from gpunode.cluster.queueing.quotas import describe

if TYPE_CHECKING:
    from gpunode.cluster.queueing.backfill import Reservation
    from gpunode.cluster.queueing.capacity import ClusterCapacity
    from gpunode.cluster.queueing.config import QueueConfig
    from gpunode.cluster.queueing.model import Job
    from gpunode.cluster.queueing.pending import Nomination, Pending
    from gpunode.cluster.queueing.quotas import QuotaBook
    from gpunode.cluster.queueing.waitlist import WaitList
    from gpunode.placement.model import Request


class ReasonsHost(Protocol):
    """What Reasons reads of its scheduler (engine.Scheduler), and the one list it empties."""

    config: QueueConfig
    cap: ClusterCapacity
    book: QuotaBook
    report_waiting: bool
    _timeouts: list[tuple[float, int, str]]
    _pending: dict[str, Pending]
    _touched: list[Pending]

    @property
    def reservation(self) -> tuple[str, Reservation] | None:
        """The head of line's backfill reservation: (job name, reservation), or None."""

    def _list_of(self, job: Job) -> WaitList:
        """The wait list the job is in."""

    def pod_fits_now(self, q: Request, exclude: frozenset[str]) -> bool:
        """Whether some node outside `exclude` has room for this one pod now."""


def _gpus(milli: int) -> str:
    return describe(GPU, milli)


def _alike(job: Job) -> bool:
    """Whether every member of the job asks for the same."""
    first = job.pods[0]
    return all(q == first for q in job.pods)


def _t(t: float) -> str:
    return f"t={t:.0f}s"


class Reasons:
    """Builds the waiting reasons for one scheduler."""

    def __init__(self, sched: ReasonsHost) -> None:
        self.sched = sched

    def waiting(self, p: Pending, position: int, *, timed_out: bool = False) -> Waiting:
        """The Waiting record of p: "queued in Q, position N: why"."""
        queue = p.job.queue
        why = p.why or "not considered yet"
        if timed_out:
            timeout = self.sched.config.gang_timeout_s if p.job.gang_timeout is None else p.job.gang_timeout
            why = f"waited longer than the gang timeout ({timeout:.0f}s): {why}"
        return Waiting(
            job=p.job.name,
            queue=queue,
            position=position,
            reason=f"queued in {queue}, position {position}: {why}",
        )

    def report(self, now: float, d: Decisions) -> None:
        """Add to d the gangs past their timeout (once each) and the pending jobs whose reason changed
        (unless the scheduler's report_waiting is off)."""
        sched = self.sched
        timeouts = sched._timeouts
        while timeouts and timeouts[0][0] <= now:
            _, seq, name = heapq.heappop(timeouts)
            p = sched._pending.get(name)
            if p is not None and p.seq == seq:
                d.timed_out.append(self.waiting(p, self.position(p), timed_out=True))
        touched, sched._touched = sched._touched, []
        if not sched.report_waiting:  # nobody reads them (the time simulator)
            return
        for p in touched:
            if p.why != p.reported_why and p.job.name in sched._pending:
                p.reported_why = p.why
                d.waiting.append(self.waiting(p, self.position(p)))

    def position(self, p: Pending) -> int:
        """p's 1-based position in its queue."""
        lst = self.sched._list_of(p.job)
        return lst.index_of(p) + 1

    def over_quota(self, p: Pending, queue: str, resource: str) -> str:
        """The job would take `queue` past its limit in `resource`."""
        held = self.sched.book.allocated[queue].get(resource, 0)
        limit = self.sched.config.limit(queue) or {}
        return (
            f"{queue} is over its quota: it holds {describe(resource, held)} of at most "
            f"{describe(resource, limit.get(resource, 0))}"
        )

    def never_fits(self, p: Pending) -> str:
        """The job does not fit even the empty cluster."""
        job = p.job
        what = f"gang of {len(job.pods)}" if job.gang else "job"
        return f"{what} asking for {_gpus(job.gpu_milli)} can never fit this cluster, even when it is empty"

    def no_room(self, p: Pending, exclude: frozenset[str], placed: int | None = None) -> str:
        """No placement now: for a gang, how many members would fit; else the GPUs it waits for.

        `placed`: how many members the plan that just failed placed (ClusterCapacity.plan_counted),
        when one was tried with this exclusion; for a gang of like members that is the count to give.
        """
        job = p.job
        sched = self.sched
        behind = ""
        res = sched.reservation
        if res is not None and res[0] != job.name and exclude & res[1].nodes:
            behind = f"; it may not delay {res[0]}, reserved from {_t(res[1].start)}"
        if job.gang and not sched.report_waiting:  # nobody reads how many members fit (the time simulator)
            return f"gang of {len(job.pods)}: not every member fits now{behind}"
        if job.gang:
            fit = self._members_fitting(p, exclude, placed)
            fits = {0: "no member fits now", 1: "only 1 member fits"}.get(fit, f"only {fit} members fit")
            return f"gang of {len(job.pods)}: {fits}{behind}"
        return f"waiting for {_gpus(job.gpu_milli)}: no node has room now{behind}"

    def _members_fitting(self, p: Pending, exclude: frozenset[str], placed: int | None) -> int:
        """The largest k such that the first k members place together: for like members the count one
        plan places (members are placed one after another, each seeing those before it, so the first k
        place together exactly when that plan placed k), `placed` when that plan was just made; else a
        binary search on plans."""
        job = p.job
        cap = self.sched.cap
        lo, hi = 0, len(job.pods) - 1
        if _alike(job):
            if placed is not None:
                return placed
            if not self.sched.pod_fits_now(job.pods[0], exclude):
                return 0  # the common case on a full cluster, told without a plan
            with cap.draws_kept():  # the explanation must not change later decisions
                return min(hi, cap.plan_counted(job, exclude_nodes=exclude)[1])
        with cap.draws_kept():
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if cap.plan(replace(job, pods=job.pods[:mid]), exclude_nodes=exclude) is not None:
                    lo = mid
                else:
                    hi = mid - 1
        return lo

    def pods_placed(self, p: Pending) -> str:
        """Pods placed one by one (no gangs): how many hold GPUs so far."""
        job = p.job
        if len(job.pods) == 1:
            return f"waiting for {_gpus(job.gpu_milli)}: no node has room now"
        return f"{len(p.held)} of {len(job.pods)} pods placed; the others wait for room"

    def reserved(self, p: Pending, res: Reservation) -> str:
        """The head of line: when its reservation starts."""
        return (
            f"waiting for {_gpus(p.job.gpu_milli)}; reserved from {_t(res.start)} on {len(res.nodes)} nodes"
        )

    def nominated(self, nom: Nomination) -> str:
        """Victims are being stopped for the job."""
        n = len(nom.victims)
        return (
            f"preempting {n} job{'' if n == 1 else 's'} for it; starts when they stop, by {_t(nom.deadline)}"
        )
