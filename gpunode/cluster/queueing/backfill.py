"""EASY backfill: a reservation for the blocked head-of-line job, and the rule for jobs behind it.

reserve() finds the earliest time the head fits if the running jobs end when they
are expected to (RunningJob.expected_end: start + the job's runtime estimate, or
the configured default; a job already past its estimate is expected to end now):
on a what-if copy of the cluster it releases the running jobs in order of expected
end, and finds the fewest groups of equal end times to release before the head
plans: galloping (1, 2, 4, ... groups) then bisection, so a reservation costs a few
dozen placement trials at most however many jobs run. The head's plan at that time
reserves its nodes. (Bisection takes the head's fit as monotone in time, which it is
for any exact placement; a greedy gang placement may rarely find a later time than
the earliest one. The reservation is valid either way.)

backfill_plan() lets a later job start now only if it cannot delay that reservation
under the estimates: either it is expected to end by the reservation's start, or it
places on nodes outside the reservation. Either way the reserved nodes hold, at the
reservation's start, exactly what the reservation was computed with, so its plan
still fits then (tests/cluster/queueing/test_backfill.py checks this as a property).
A job that runs past its estimate can still delay the head: that is EASY backfill's
known trade-off, and why estimates matter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.model import GPU, Job, Plan, RunningJob


@dataclass(frozen=True)
class Reservation:
    """The head-of-line job (`job`) may start at `start` with `plan`, which uses `nodes`."""

    start: float
    plan: Plan
    nodes: frozenset[str]
    job: str = ""


def estimate(job: Job, default_runtime: float) -> float:
    """The runtime backfill plans a job with: its estimate, else the default."""
    return default_runtime if job.runtime_estimate is None else job.runtime_estimate


def reserve(
    head: Job,
    running: Sequence[RunningJob],
    cap: ClusterCapacity,
    now: float,
    default_runtime: float,
    exclude: frozenset[str] = frozenset(),
) -> Reservation | None:
    """The earliest start (and plan) of `head` as the running jobs end; None if it never fits.

    `running` are the committed jobs of `cap` (others are ignored: they are taken to
    run on for ever). The result is `now` with a plan when the head fits already.
    The plan stays off `exclude` (nodes other reservations hold). cap is left as it was.
    """
    plan = cap.plan(head, exclude_nodes=exclude)
    if plan is not None:
        return Reservation(job=head.name, start=now, plan=plan, nodes=plan.nodes)
    if not cap.fits_empty(head):
        return None
    groups = [
        (end, [name for _, name in group])
        for end, group in groupby(
            sorted(
                (max(now, r.expected_end(default_runtime)), r.job.name) for r in running if r.job.name in cap
            ),
            key=lambda item: item[0],
        )
    ]
    found = _Search(cap.fork(), head, groups, exclude).earliest()
    if found is None:
        return None
    k, plan = found
    return Reservation(job=head.name, start=groups[k - 1][0], plan=plan, nodes=plan.nodes)


class _Search:
    """The fewest end-time groups to release before the head plans: galloping, then bisection.

    Going forward releases groups (release_many, each node rebuilt once per step);
    going back commits them again with their own plans. A step whose released GPUs
    cannot cover the head's in all is decided without a placement trial.
    """

    def __init__(
        self, cap: ClusterCapacity, head: Job, groups: list[tuple[float, list[str]]], exclude: frozenset[str]
    ) -> None:
        self.cap, self.head, self.groups, self.exclude = cap, head, groups, exclude
        self.pos = 0
        self.free = [cap.free()[GPU]]  # free GPU after releasing the first k groups, extended as needed
        self.kept: dict[str, tuple[Job, Plan]] = {}

    def _free_after(self, k: int) -> int:
        while len(self.free) <= k:
            names = self.groups[len(self.free) - 1][1]
            self.free.append(self.free[-1] + sum(self.cap.held(name).get(GPU, 0) for name in names))
        return self.free[k]

    def _probe(self, k: int) -> Plan | None:
        if self._free_after(k) < self.head.gpu_milli:
            return None
        cap = self.cap
        if k > self.pos:
            names = [n for _, group in self.groups[self.pos : k] for n in group]
            for name in names:
                self.kept.setdefault(name, (cap.job_of(name), cap.plan_of(name)))
            cap.release_many(names)
        for _, group in self.groups[k : self.pos]:
            for name in group:
                cap.commit(name, *self.kept[name])
        self.pos = k
        return cap.plan(self.head, exclude_nodes=self.exclude)

    def earliest(self) -> tuple[int, Plan] | None:
        n = len(self.groups)
        low, k = 0, 1  # releasing `low` groups is known not to be enough
        best: tuple[int, Plan] | None = None
        while k <= n:
            plan = self._probe(k)
            if plan is not None:
                best = (k, plan)
                break
            low, k = k, min(2 * k, n) if k < n else n + 1
        if best is None:
            return None
        high = best[0]
        while high - low > 1:
            mid = (low + high) // 2
            plan = self._probe(mid)
            if plan is not None:
                best, high = (mid, plan), mid
            else:
                low = mid
        return best


def backfill_plan(
    job: Job,
    reservation: Reservation,
    cap: ClusterCapacity,
    now: float,
    default_runtime: float,
) -> Plan | None:
    """A plan to start `job` now without delaying the reservation (under the estimates), or None.

    A job expected to end by the reservation's start may go anywhere; any other job
    only on nodes the reservation does not use.
    """
    if now + estimate(job, default_runtime) <= reservation.start:
        return cap.plan(job)
    return cap.plan(job, exclude_nodes=reservation.nodes)
