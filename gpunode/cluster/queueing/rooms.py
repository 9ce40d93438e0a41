"""Room for the head of line: preemption notices and nominations, backfill reservations.

Rooms is the part of the Scheduler (engine.py) that makes room for a job that
does not fit: it gives victims their notice and nominates the preemptor to the
nodes it will use (no other job may take them meanwhile), stops victims whose
notice ran out and admits their preemptor, and keeps the backfill reservations
current. Split from engine.py to keep modules small.

Reservations: the head of line (the first job of a queue that does not fit) holds
one, as in EASY backfill; up to `backfill.reservations` - 1 more go to multi-GPU
and multi-pod jobs that do not fit (one new one per cycle: the first such job,
in the queues' order, whose queue holds fewer than backfill.reservationsPerQueue
and that has waited backfill.reserveAfter). Each reservation is computed on nodes no
other reservation holds, so none can delay another; a job started now must keep
off the nodes of every reservation that starts before it is expected to end
(conservative backfill over all of them). Small jobs need no reservation: any
release lets them start; without one, an 8-GPU job waits for a whole free node
that small jobs, each of them admissible, keep taking.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from gpunode.cluster.queueing.backfill import Reservation, reserve
from gpunode.cluster.queueing.model import GPU, Decisions, Job, Notice, RunningJob
from gpunode.cluster.queueing.pending import Nomination, Pending
from gpunode.cluster.queueing.preempt import PreemptionHost, preemption_for
from gpunode.contract.names import MILLI_PER_GPU

if TYPE_CHECKING:
    from gpunode.cluster.queueing.capacity import ClusterCapacity
    from gpunode.cluster.queueing.lossbudget import LossBudget
    from gpunode.cluster.queueing.presets import Preset
    from gpunode.cluster.queueing.reasons import Reasons
    from gpunode.cluster.queueing.waitlist import DeadShapes, WaitList

ALL = "*"  # the one list of the "global" order
# After a failed victim search a job searches again this much later at the soonest (simulated or real
# seconds): a search walks the running jobs and makes placement trials, and most fail the same way in
# the next cycle. Against a notice period of minutes it delays a preemption by well under one.
PREEMPT_RETRY_S = 30.0
ANY = -float("inf")  # a shape dead at level 0 in a cycle: every job of it is passed over (engine._walk)


class Rooms:
    """Preemption, nomination and reservation state of a Scheduler (mixed into it)."""

    if TYPE_CHECKING:
        cap: ClusterCapacity
        running: dict[str, RunningJob]
        reasons: Reasons
        reclaim: bool
        share_reclaim: tuple[float, float] | None
        loss_budget: LossBudget | None
        reservations_per_queue: int
        reserve_after_s: float
        reserved_share: float
        priority_preemption: bool
        backfill: bool
        notice_s: float
        min_runtime_s: float
        default_runtime_s: float
        reservations_max: int
        _ends: list[tuple[float, str]]
        _why_cache: dict[tuple[int, frozenset[str], bool], str]
        _dead: dict[str, DeadShapes]
        _pending: dict[str, Pending]
        _lists: dict[str, WaitList]
        _version: int
        preset: Preset

        def _try(self, p: Pending, now: float, d: Decisions) -> str: ...
        def _stop(self, name: str, completed: bool = False) -> RunningJob: ...
        def _enqueue(self, job: Job, now: float) -> None: ...
        def _list_of(self, job: Job) -> WaitList: ...

    _nominated: dict[str, Nomination]
    _preempt_failed: dict[str, tuple[int, int, float, float]]
    _reserved: str | None = None
    _reservation: Reservation | None = None
    _reservation_stamp: tuple[int, int] | None = None
    _excl_base: frozenset[str] = frozenset()
    _released_nodes: set[str]
    _searches_left: int
    _extra: dict[str, Reservation]
    _res_starts: tuple[float, ...] = ()  # every reservation's start, earliest first
    _res_nodes: tuple[tuple[str, frozenset[str]], ...] = ()  # (job, nodes) in the same order
    _excl_levels: tuple[frozenset[str], ...] = (frozenset(),)  # base plus the first k reservations' nodes
    _reserved_names: frozenset[str] = frozenset()  # the jobs holding a reservation (as of _exclusions)
    _notices: list[tuple[float, str]]
    _young: list[tuple[float, str]]
    _restarted: set[str]
    fast_reserve = True  # backfill.reserve's fast search (False: the plain one, for tests comparing them)

    def _preempt(self, p: Pending, now: float, d: Decisions) -> bool:
        """Give notices to the victims that make room for p (nominating it to that room); True if any."""
        if not (self.reclaim or self.priority_preemption) or (not self.preset.gang and p.held):
            return False
        stamp = (self.cap.epoch, self._version)
        failed = self._preempt_failed.get(p.job.name)
        # The same search fails again until the cluster changes, a running job passes its minimum runtime
        # or p has waited long enough to reclaim towards its fair share; after a failure the job searches
        # again PREEMPT_RETRY_S later at the soonest.
        if failed is not None and (now < failed[3] or (failed[:2] == stamp and now < failed[2])):
            return False
        self._searches_left -= 1
        chosen = preemption_for(cast("PreemptionHost", self), p, now)
        if chosen is None:
            ripens = self._youngest_ripens(now)
            if self.share_reclaim is not None and (waited := p.since + self.share_reclaim[1]) > now:
                ripens = min(ripens, waited)
            if self.loss_budget is not None and not self.loss_budget.allows(now):
                ripens = min(ripens, now + PREEMPT_RETRY_S)  # the budget frees up as the cluster delivers
            self._preempt_failed[p.job.name] = (*stamp, ripens, now + PREEMPT_RETRY_S)
            return False
        victims, reasons = chosen
        deadline = now + self.notice_s
        for r in victims.jobs:
            r.notice_deadline = deadline
            heapq.heappush(self._notices, (deadline, r.job.name))
            r.preemptor = p.job.name
            d.notices.append(Notice(r.job.name, p.job.name, deadline, reasons[r.job.name]))
        self._nominated[p.job.name] = Nomination(
            victims=tuple(r.job.name for r in victims.jobs), nodes=victims.plan.nodes, deadline=deadline
        )
        self._exclusions()
        if self._reserved == p.job.name:
            self._drop_reservation()
        if self._extra.pop(p.job.name, None) is not None:
            self._exclusions()
        p.why = self.reasons.nominated(self._nominated[p.job.name])
        if self.notice_s <= 0:
            self._expire(now, d)
            self._admit_nominated(now, d)
        return True

    def _reserve(self, p: Pending, now: float) -> None:
        """Make p the head of line with a backfill reservation, when backfill is on and none is held."""
        if not self.backfill or self._reserved is not None or p.job.name in self._extra:
            return
        res = reserve(
            p.job,
            (),
            self.cap,
            now,
            self.default_runtime_s,
            self._others(""),
            ends=self._ends,
            fast=self.fast_reserve,
        )
        if res is None or res.nodes & self._excl_base:  # room promised to a preemptor is not reservable
            return
        self._reserved, self._reservation = p.job.name, res
        self._reservation_stamp = (self.cap.epoch, self._version)
        self._exclusions()
        p.why = self.reasons.reserved(p, res)

    def _refresh_reservation(self, now: float) -> None:
        """Recompute the head of line's reservation after releases; drop it once the job is gone."""
        released, self._released_nodes = self._released_nodes, set()
        for extra in list(self._extra):
            self._refresh_extra(extra, now, released)
        name = self._reserved
        if name is None:
            return
        p = self._pending.get(name)
        if p is None or name in self._nominated:
            self._drop_reservation()
            return
        res = self._reservation
        if res is not None and (now < res.start or not released & res.nodes):
            # Releases only bring the start closer and backfill never pushes it back, so the reservation
            # holds until its start; past it (estimates ran over), it is recomputed once some of its nodes
            # free up. The head itself is tried in every cycle and starts as soon as it fits anywhere.
            return
        res = reserve(
            p.job,
            (),
            self.cap,
            now,
            self.default_runtime_s,
            self._others(name),
            ends=self._ends,
            fast=self.fast_reserve,
        )
        if res is None or res.nodes & self._excl_base:
            self._drop_reservation()
            return
        self._reservation = res
        self._reservation_stamp = (self.cap.epoch, self._version)
        self._exclusions()
        p.why = self.reasons.reserved(p, res)

    def _drop_reservation(self) -> None:
        self._reserved = self._reservation = self._reservation_stamp = None
        self._exclusions()

    def _reserve_extra(self, p: Pending, now: float) -> bool:
        """Give p, a multi-GPU or multi-pod job that does not fit, one of the further reservations."""
        name = p.job.name
        if (
            not self.backfill
            or len(self._extra) >= self.reservations_max - 1
            or name == self._reserved
            or name in self._extra
            or name in self._nominated
            or (p.demand.get(GPU, 0) <= MILLI_PER_GPU and len(p.job.pods) == 1)
            or now - p.since < self.reserve_after_s
        ):
            return False
        if self.reserved_share < 1.0 and not self._within_reserved_share(p):
            return False
        if self.reservations_per_queue < self.reservations_max - 1:  # one queue may not take them all
            queue, pending = p.job.queue, self._pending
            held = sum(1 for n in self._extra if (o := pending.get(n)) is not None and o.job.queue == queue)
            if held >= self.reservations_per_queue:
                return False
        exclude = self._excl_base | self._others(name)
        res = reserve(
            p.job, (), self.cap, now, self.default_runtime_s, exclude, ends=self._ends, fast=self.fast_reserve
        )
        if res is not None:
            self._extra[name] = res
            self._exclusions()
            p.why = self.reasons.reserved(p, res)
        return True

    def _within_reserved_share(self, p: Pending) -> bool:
        """Whether p's GPUs and those of the jobs already holding a reservation stay within the share."""
        pending = self._pending
        held = sum(
            o.demand.get(GPU, 0) for n, _ in self._all_reservations() if (o := pending.get(n)) is not None
        )
        return held + p.demand.get(GPU, 0) <= self.reserved_share * self.cap.capacity().get(GPU, 0)

    def _refresh_extra(self, name: str, now: float, released: set[str]) -> None:
        """As _refresh_reservation, for one of the further reservations."""
        p = self._pending.get(name)
        res = self._extra[name]
        if p is not None and name not in self._nominated and (now < res.start or not released & res.nodes):
            return
        del self._extra[name]
        if p is not None and name not in self._nominated:
            exclude = self._excl_base | self._others(name)
            new = reserve(
                p.job,
                (),
                self.cap,
                now,
                self.default_runtime_s,
                exclude,
                ends=self._ends,
                fast=self.fast_reserve,
            )
            if new is not None:
                self._extra[name] = new
                p.why = self.reasons.reserved(p, new)
        self._exclusions()

    def _all_reservations(self) -> Iterator[tuple[str, Reservation]]:
        if self._reserved is not None and self._reservation is not None:
            yield self._reserved, self._reservation
        yield from self._extra.items()

    def _others(self, name: str) -> frozenset[str]:
        """The nodes of every reservation but `name`'s (a reservation is computed off them)."""
        return frozenset(n for other, res in self._all_reservations() if other != name for n in res.nodes)

    def _is_reserved(self, name: str) -> bool:
        return name == self._reserved or name in self._extra

    def _level(self, p: Pending, now: float) -> int:
        """How many reservations start before p would end (p must keep off their nodes)."""
        return bisect.bisect_left(self._res_starts, now + p.runtime) if self._res_starts else 0

    def _reserved_exclusion(self, p: Pending, now: float) -> frozenset[str]:
        """A reserved job keeps off the other reservations that start before it would end."""
        end, name = now + p.runtime, p.job.name
        nodes = [
            ns
            for start, (other, ns) in zip(self._res_starts, self._res_nodes, strict=True)
            if start < end and other != name
        ]
        return self._excl_base.union(*nodes) if nodes else self._excl_base

    def _exclusions(self) -> None:
        """Recompute the node sets admissions stay off (see _exclusion), by reservations' starts."""
        base = frozenset(n for nom in self._nominated.values() for n in nom.nodes)
        self._excl_base = base
        ordered = sorted(self._all_reservations(), key=lambda item: (item[1].start, item[0]))
        self._res_starts = tuple(res.start for _, res in ordered)
        self._res_nodes = tuple((name, res.nodes) for name, res in ordered)
        levels, acc = [base], base
        for _, res in ordered:
            acc = acc | res.nodes
            levels.append(acc)
        self._excl_levels = tuple(levels)
        self._reserved_names = frozenset(name for name, _ in ordered)
        self._why_cache.clear()
        dead = getattr(self, "_dead", None)
        if dead:  # failures recorded against reservation levels that have moved: forget them
            for shapes in dead.values():
                shapes.forget_levels(ANY)

    def _expire(self, now: float, d: Decisions) -> None:
        """Stop the victims whose notice has run out; they go back to the pending jobs."""
        due: list[RunningJob] = []
        heap = self._notices
        while heap and heap[0][0] <= now:
            deadline, name = heapq.heappop(heap)
            r = self.running.get(name)
            if r is not None and r.notice_deadline == deadline and (not due or due[-1] is not r):
                due.append(r)  # entries of jobs that stopped, or whose notice was lifted, are passed over
        for r in due:
            self._stop(r.job.name)
            self._restarted.add(r.job.name)
            self._enqueue(r.job, now)
            d.kill.append(r.job.name)

    def _youngest_ripens(self, now: float) -> float:
        """When the next running job younger than the minimum runtime reaches it (inf: none is younger)."""
        heap, running = self._young, self.running
        while heap:
            start, name = heap[0]
            r = running.get(name)
            if r is not None and r.start == start and now - start < self.min_runtime_s:
                return start + self.min_runtime_s
            heapq.heappop(heap)  # stopped, or old enough for good (time only moves forward)
        return float("inf")

    def _admit_nominated(self, now: float, d: Decisions) -> None:
        """Admit preemptors whose victims are all gone, on the room freed for them."""
        for name in sorted(self._nominated, key=lambda n: (self._nominated[n].deadline, n)):
            nom = self._nominated[name]
            if any(v in self.running for v in nom.victims):
                continue
            p = self._pending.get(name)
            self._preempt_failed.pop(name, None)
            # tried while still nominated: it may use its own room whatever else was reserved since
            if p is not None and self._try(p, now, d) == "admitted":
                lst = self._list_of(p.job)
                del lst[lst.index_of(p)]
            del self._nominated[name]
            self._exclusions()
