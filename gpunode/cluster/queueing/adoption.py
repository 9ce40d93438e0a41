"""Rebuilding and cancelling: the Scheduler's calls for a live controller (mixed into engine.Scheduler).

adopt() puts a job admitted before a restart back among the running jobs, on
its own plan; withdraw() takes a pending job whose pods were deleted off the
queue; mark_idle() records that a running job's GPUs are idle; inherit_usage() keeps the
fair-share usage memory across a rebuild; usage_memory() and seed_usage() read it out and put
saved figures back (across processes: a restart, a failover). Split from engine.py to keep modules small.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from gpunode.cluster.queueing.fairshare import UsageLedger
from gpunode.cluster.queueing.lossbudget import LossBudget
from gpunode.cluster.queueing.model import Amounts, Decisions, Job, Plan, RunningJob, add, sub
from gpunode.cluster.queueing.pending import Nomination, Pending

if TYPE_CHECKING:
    from gpunode.cluster.queueing.capacity import ClusterCapacity
    from gpunode.cluster.queueing.quotas import QuotaBook
    from gpunode.cluster.queueing.waitlist import WaitList


class Adoption:
    """adopt(), withdraw() and mark_idle() of a Scheduler."""

    _outside: Mapping[str, Amounts] = {}  # replaced, never changed in place (charge_outside)
    _outside_capacity: Mapping[str, int] | None = None

    @property
    def outside_capacity(self) -> Mapping[str, int] | None:
        """The capacity last given to charge_outside (None: none given to this scheduler yet)."""
        return self._outside_capacity

    if TYPE_CHECKING:
        cap: ClusterCapacity
        running: dict[str, RunningJob]
        partial_gangs: set[str]
        _pending: dict[str, Pending]
        _pending_demand: dict[str, Amounts]
        _nominated: dict[str, Nomination]
        _notices: list[tuple[float, str]]
        _preempt_failed: dict[str, tuple[int, int, float, float]]
        _reserved: str | None
        _version: int
        _seq: Iterator[int]
        _ledger: UsageLedger | None
        loss_budget: LossBudget | None
        _charged_to: float | None
        _now: float
        _capacity: Amounts
        _shares_at: float
        book: QuotaBook

        def _order_charge(self, leaf: str, amounts: Mapping[str, int], sign: int) -> None: ...
        def _advance(self, now: float) -> None: ...
        def _start(
            self,
            p: Pending,
            plan: Plan,
            amounts: Amounts,
            now: float,
            d: Decisions,
            units: list[tuple[str, Job, Plan]] | None = None,
        ) -> None: ...
        def _list_of(self, job: Job) -> WaitList: ...
        def _planned_runtime(self, job: Job) -> float: ...
        def _drop_reservation(self) -> None: ...
        def _exclusions(self) -> None: ...

    def adopt(
        self,
        job: Job,
        plan: Plan,
        start: float,
        now: float,
        *,
        notice_deadline: float | None = None,
        preemptor: str | None = None,
    ) -> RunningJob:
        """Put an already admitted job (rebuilt after a restart) among the running jobs, on its own plan.

        Its plan is held on the cluster (InvalidState, nothing held, when it no longer
        fits) and its queue charged; no Decisions entry is made. With a notice, the job
        is stopped at that deadline as any victim; with a preemptor too, the victim's
        nodes are nominated to it (the room stays promised to that job once it is
        submitted; victims adopted for the same preemptor add up).
        """
        if job.queue not in self._pending_demand:
            raise ValueError(f"job {job.name}: no leaf queue is named {job.queue}")
        if job.name in self._pending or job.name in self.running:
            raise ValueError(f"job {job.name} is already pending or running")
        self._advance(now)
        self.cap.commit(job.name, job, plan)
        amounts = self.cap.held(job.name)
        runtime = self._planned_runtime(job)  # what backfill planned it with before the restart
        p = Pending(job=job, demand=amounts, seq=next(self._seq), since=start, shape=-1, runtime=runtime)
        self._pending[job.name] = p  # _start takes it off the pending jobs again
        self._pending_demand[job.queue] = add(self._pending_demand[job.queue], amounts)
        self._start(p, plan, amounts, start, Decisions(), units=[(job.name, job, plan)])
        r = self.running[job.name]
        if notice_deadline is not None:
            r.notice_deadline = notice_deadline
            r.preemptor = preemptor
            heapq.heappush(self._notices, (notice_deadline, job.name))
            if preemptor is not None:
                nom = self._nominated.get(preemptor)
                victims = (nom.victims if nom else ()) + (job.name,)
                nodes = (nom.nodes if nom else frozenset()) | plan.nodes
                deadline = max(notice_deadline, nom.deadline) if nom else notice_deadline
                self._nominated[preemptor] = Nomination(victims=victims, nodes=nodes, deadline=deadline)
                self._exclusions()
        return r

    @property
    def outside(self) -> Mapping[str, Amounts]:
        """What charge_outside last charged, per leaf."""
        return self._outside

    def charge_outside(
        self, usage: Mapping[str, Amounts], now: float, capacity: Mapping[str, int] | None = None
    ) -> None:
        """What leaves hold on GPUs this scheduler does not place (GPUs served through DRA, which
        kube-scheduler's allocator hands out), counted as their running jobs' are: in their quotas (up the
        tree), their fair share and their usage memory. Replaces the amounts given before (leaves not
        named hold none); `capacity`, when given, is those GPUs' own (added to the cluster's for fair
        shares, replacing the one given before). Unknown leaves are ignored."""
        self._advance(now)
        old, new = self._outside, {q: dict(a) for q, a in usage.items() if q in self._pending_demand}
        for leaf in set(old) | set(new):
            delta = {k: v for k, v in sub(new.get(leaf, {}), old.get(leaf, {})).items() if v}
            if delta:
                self.book.charge(leaf, delta)
                self._order_charge(leaf, delta, 1)
        self._outside = new
        if capacity is not None and dict(capacity) != dict(self._outside_capacity or {}):
            self._capacity = add(sub(self._capacity, self._outside_capacity or {}), capacity)
            self._outside_capacity = dict(capacity)
            self._shares_at = -float("inf")  # the shares are figured again at the next cycle

    def mark_idle(self, name: str, since: float | None) -> None:
        """A running job's GPUs have been idle since `since` (None: busy again); ignored if not running.

        Only victim order reads it, and only with preemption.idleFirst (preempt.py).
        """
        r = self.running.get(name)
        if r is not None:
            r.idle_since = since

    def withdraw(self, name: str, now: float) -> tuple[str, ...]:
        """A pending job leaves the queue (its pods were deleted); a job that is not pending is ignored.

        Pods it held (no-gang presets) are released; a reservation or nomination it
        held is dropped, and the notices of the victims that were stopping for it are
        lifted: they keep running. Returns those victims' names (the driver tells them).
        """
        self._advance(now)
        p = self._pending.pop(name, None)
        if p is None:
            return ()
        lst = self._list_of(p.job)
        del lst[lst.index_of(p)]
        self._pending_demand[p.job.queue] = sub(self._pending_demand[p.job.queue], p.demand)
        for key, _, _ in p.held:
            self.cap.release(key)
            self._version += 1
        p.held.clear()
        self.partial_gangs.discard(name)
        self._preempt_failed.pop(name, None)
        if self._reserved == name:
            self._drop_reservation()
        lifted: list[str] = []
        nom = self._nominated.pop(name, None)
        if nom is not None:
            for victim in nom.victims:
                r = self.running.get(victim)
                if r is not None and r.preemptor == name:
                    r.notice_deadline = r.preemptor = None
                    lifted.append(victim)
            self._exclusions()
        return tuple(lifted)

    def inherit_usage(self, previous: Adoption, now: float) -> bool:
        """Take over `previous`'s fair-share usage memory, charged up to `now`; False when it cannot.

        A controller rebuilds its Scheduler when the configuration or the cluster changes; the
        usage of the last window must survive that, or queues that used much would be treated
        as new. It carries over only when both keep usage and the half-life and window are the
        same (another setting changes what the figures mean: then usage starts afresh).
        """
        old, new = previous._ledger, self._ledger
        if old is None or new is None:
            return False
        if (old.half_life_s, old.window_s) != (new.half_life_s, new.window_s):
            return False
        previous._advance(max(now, previous._now))
        self._ledger = old
        self._charged_to = max(now, self._now)
        budget = self.loss_budget
        if budget is not None and previous.loss_budget is not None:  # the losses spent go on counting
            budget.seed(*previous.loss_budget.state(previous._now), previous._now)
        return True

    def usage_memory(self, now: float | None = None) -> tuple[dict[str, dict[str, float]], float] | None:
        """The decayed usage per leaf and the time it is figured at; None without usage memory.

        With `now`, the allocations are charged up to it first (as a cycle at `now` would);
        without, the figures are those of the last call that moved the scheduler's time.
        """
        if self._ledger is None or self._now == -float("inf"):
            return None
        if now is not None:
            self._advance(max(now, self._now))
        return self._ledger.usage(self._now), self._now

    def seed_usage(self, usage: dict[str, dict[str, float]], at: float) -> int:
        """Add usage saved by another process (decayed figures at `at`, no later than now) to the memory.

        Entries of queues that are not leaves here are dropped; returns how many leaves were seeded
        (0 without usage memory). The figures must be finite and non-negative (ValueError).
        """
        if self._ledger is None:
            return 0
        seeded = 0
        for queue, amounts in usage.items():
            if queue in self._pending_demand and any(amounts.values()):
                self._ledger.seed(queue, amounts, at)
                seeded += 1
        return seeded
