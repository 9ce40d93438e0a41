"""EASY backfill: a reservation for the blocked head-of-line job, and the rule for jobs behind it.

reserve() finds the earliest time the head fits if the running jobs end when they
are expected to (RunningJob.expected_end: start + the job's runtime estimate, or
the configured default; a job already past that is expected to end now, unless the
scheduler has planned it again: backfill.overdueRemaining, engine.py):
on a what-if copy of the cluster it releases the running jobs in order of expected
end, and finds the fewest groups of equal end times to release before the head
plans: galloping (1, 2, 4, ... groups) then bisection, so a reservation costs a few
dozen placement trials at most however many jobs run (earliest.py: each trial
builds only the nodes that free up enough for the head). The head's plan at that time
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

from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.earliest import FastSearch, Groups, Search
from gpunode.cluster.queueing.model import Job, Plan, RunningJob


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
    *,
    ends: Sequence[tuple[float, str]] | None = None,
    fast: bool = True,
) -> Reservation | None:
    """The earliest start (and plan) of `head` as the running jobs end; None if it never fits.

    `running` are the committed jobs of `cap` (others are ignored: they are taken to
    run on for ever). The result is `now` with a plan when the head fits already.
    The plan stays off `exclude` (nodes other reservations hold). cap is left as it was.
    `ends`, when given, replaces `running`: every running job's (expected end, name),
    sorted (the engine keeps it current, so a reservation does not sort the running
    jobs again; only the groups the search reaches are built). `fast` (the default) makes
    the same placement trials on node states built only where they can matter
    (earliest.py); False releases jobs on a fork as the plain search does.
    """
    plan = cap.plan(head, exclude_nodes=exclude)
    if plan is not None:
        return Reservation(job=head.name, start=now, plan=plan, nodes=plan.nodes)
    if not cap.fits_empty(head):
        return None
    if ends is None:
        ends = sorted((r.expected_end(default_runtime), r.job.name) for r in running)
    groups = Groups(ends, now, cap)
    search = FastSearch(cap, head, groups, exclude) if fast else Search(cap.fork(), head, groups, exclude)
    found = search.earliest()
    if found is None:
        return None
    k, plan = found
    return Reservation(job=head.name, start=groups.items[k - 1][0], plan=plan, nodes=plan.nodes)


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
