"""The scheduling engine: who is admitted when, for every policy (presets.py switches it).

How a driver uses it (the time simulator, later the live controller):

    sched = Scheduler(config, cap, preset("gpunode"))   # cap: a ClusterCapacity nothing else commits to
    sched.submit(job, now)           # a job arrives (names are unique; a killed victim is requeued by the
                                     # scheduler itself, do not submit it again)
    d = sched.cycle(now)             # after each batch of same-time events; time never goes back
      d.admit:     start these jobs now, on Admission.plan (already held on cap)
      d.notices:   tell these victims to stop by Notice.deadline (they may checkpoint until then); the
                   driver must call cycle() again at that deadline (sched.next_deadline() says when)
      d.kill:      victims whose notice ran out: the scheduler has already released them and put them
                   back among the pending jobs (same Job, same arrival); stop them now
      d.timed_out: gangs waiting longer than their timeout, each reported once, with the reason
      d.waiting:   pending jobs whose waiting reason changed in this cycle (for events)
    sched.finished(name, now)        # a running job completed: its GPUs are released
    sched.killed(name, now)          # a running job stopped early (a victim that checkpointed before its
                                     # deadline, or a failure): released and requeued; a name that is not
                                     # running is ignored, so reporting a d.kill victim again is harmless
    sched.checkpoint(name, t)        # a running job saved its state at t (less work lost if preempted)
    sched.adopt(job, plan, start, now, notice_deadline=, preemptor=)   # an admitted job, after a restart
    sched.mark_idle(name, since)     # a running job's GPUs idle since `since` (None: busy); see preempt.py
    sched.withdraw(name, now)        # a pending job left (its pods were deleted)
    sched.running: dict[str, RunningJob]; sched.pending_count; sched.allocated_by_queue()
    sched.waiting() -> list[Waiting] (every pending job's current reason); sched.partial_gangs (kube)

One cycle: stop victims whose notice ran out, admit preemptors whose room is
free, then serve queues one admission at a time in the preset's order (fair
share and DRF, Kueue's head order, or one global order), each queue's jobs by
priority then arrival. A job is admitted when its queue's limits allow it and
the cluster places every pod (gangs whole). The first job that does not fit
(the head of line) may preempt, else gets a backfill reservation; multi-GPU
jobs that do not fit may get further ones (rooms.py). Every later admission
must respect each reservation (end before it starts, or stay off its nodes).

Speed: a pending job whose shape (its pods) failed to place at the current
capacity epoch, with the same excluded nodes, is skipped without a trial
(commits only take room away; only a release can make it fit); a job whose
GPUs exceed the free GPUs is skipped; the queue's limit is checked before any
placement; a queue that cannot admit is not walked again in the same cycle;
a one-pod job is not tried when a smaller pod of its kind failed at this epoch
(admit.py). Running jobs are kept sorted by expected end for backfill, whose
search builds only the nodes that can take the head (earliest.py).
Fair shares are recomputed only when they can have moved (ordering.py); notices
and young jobs are heaps and running jobs are indexed by queue, so no cycle
walks all running jobs; a failed victim search waits PREEMPT_RETRY_S (rooms.py).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Iterator
from operator import itemgetter

from gpunode.cluster.queueing.admit import Admit, Larger
from gpunode.cluster.queueing.adoption import Adoption
from gpunode.cluster.queueing.backfill import Reservation
from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.fairshare import UsageLedger
from gpunode.cluster.queueing.history import RuntimeHistory
from gpunode.cluster.queueing.lossbudget import LossBudget
from gpunode.cluster.queueing.lostwork import LostWork
from gpunode.cluster.queueing.model import (
    GPU,
    GPU_MEMORY,
    Admission,
    Amounts,
    Decisions,
    Job,
    Plan,
    RunningJob,
    Waiting,
    sub,
)
from gpunode.cluster.queueing.ordering import Ordering
from gpunode.cluster.queueing.pending import Nomination, Pending
from gpunode.cluster.queueing.preempt import Unit
from gpunode.cluster.queueing.presets import Preset
from gpunode.cluster.queueing.quotas import QuotaBook, job_demand
from gpunode.cluster.queueing.reasons import Reasons
from gpunode.cluster.queueing.rooms import ALL, ANY, Rooms
from gpunode.cluster.queueing.waitlist import DeadShapes, WaitList
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.placement.model import Request

# The shortest runtime an overdue job is planned again with (backfill.overdueRemaining grows it from there).
MIN_PLANNED_S = 60.0


# Victim searches per cycle (each walks the running jobs and makes placement trials); heads of other queues
# search in later cycles. Notices take minutes, so this delays a preemption by a cycle, not a notice period.
PREEMPTION_SEARCHES_PER_CYCLE = 1
# New further backfill reservations per cycle (each searches the running jobs' expected ends); a queue's
# multi-GPU job that misses one this cycle asks again in the next. Filling 31 places takes 31 cycles
# instead of 8, and no cycle pays for more than one search on top of the refreshes.
RESERVATION_SEARCHES_PER_CYCLE = 1


class Scheduler(Adoption, Rooms, Ordering, Admit):
    """Admission for one cluster: queues, quotas, fair share, gangs, preemption and backfill."""

    report_waiting = True  # Decisions.waiting filled (the time simulator turns it off: it reads none)

    def __init__(self, config: QueueConfig, cap: ClusterCapacity, preset: Preset) -> None:
        self.config = config
        self.cap = cap
        self.preset = preset
        self.book = QuotaBook(config, preset.quotas)
        self.running: dict[str, RunningJob] = {}
        self.partial_gangs: set[str] = set()  # gangs that held GPUs with members still unplaced
        self._lists: dict[str, WaitList] = {}
        self._pending: dict[str, Pending] = {}
        self._units: dict[str, list[tuple[str, Job, Plan]]] = {}
        self._pending_demand: dict[str, Amounts] = {q: {} for q in config.leaves}
        self._nominated: dict[str, Nomination] = {}
        self._reserved: str | None = None
        self._reservation: Reservation | None = None
        self._reservation_stamp: tuple[int, int] | None = None
        self._extra: dict[str, Reservation] = {}  # the further reservations of multi-GPU jobs (rooms.py)
        self._released_nodes: set[str] = set()
        self._ends: list[tuple[float, str]] = []  # running jobs' (expected end, name), sorted (backfill)
        self._shapes: dict[tuple[object, ...], int] = {}
        self._larger = Larger()
        self._failed: dict[tuple[int, frozenset[str]], tuple[int, str]] = {}
        self._fits_empty: dict[int, bool] = {}
        self._why_cache: dict[tuple[int, frozenset[str], bool], str] = {}
        self._small_fails: dict[tuple[str, frozenset[str] | None], list[tuple[Request, frozenset[str]]]] = {}
        self._fail_marks: dict[tuple[int, frozenset[str]], tuple[object, int]] = {}
        self._preempt_failed: dict[str, tuple[int, int, float, float]] = {}
        self._by_queue: dict[str, dict[str, RunningJob]] = {q: {} for q in config.leaves}
        self._lost = LostWork()  # the running jobs by lost work, for the victim search (preempt.py)
        self._priorities: dict[str, dict[int, int]] = {
            q: {} for q in config.leaves
        }  # running jobs' priorities
        self._timeouts: list[tuple[float, int, str]] = []
        self._notices: list[tuple[float, str]] = []  # (deadline, victim) of notices, earliest first
        self._young: list[tuple[float, str]] = []  # (start, name) of admissions, earliest first
        self._seq = itertools.count()
        self._version = 0  # bumped by every commit and release this scheduler makes
        self._now = -float("inf")
        self._ledger = UsageLedger.from_settings(config.fair_share) if preset.usage_memory else None
        self._charged_to: float | None = None
        capacity = cap.capacity()
        self._capacity = capacity
        self._memory_per_gpu = capacity.get(GPU_MEMORY, 0) * MILLI_PER_GPU // max(capacity.get(GPU, 0), 1)
        pre = config.preemption
        self.notice_s = pre.notice_s if preset.notice_s is None else preset.notice_s
        self.min_runtime_s = pre.min_runtime_s if preset.min_runtime_s is None else preset.min_runtime_s
        self.reclaim = preset.reclaim and pre.reclaim
        # reclaim towards the fair share: (above, after_s) of preempt.preemption_for, or None
        self.share_reclaim: tuple[float, float] | None = None
        if self.reclaim and preset.share_reclaim == "always":
            self.share_reclaim = (1.0, 0.0)
        elif self.reclaim and preset.share_reclaim == "configured" and pre.share_above is not None:
            self.share_reclaim = (pre.share_above, pre.share_after_s)
        # what share reclaim may spend in lost work (lossbudget.py); the kai preset's reclaim has no budget
        self.loss_budget: LossBudget | None = None
        if (
            preset.share_reclaim == "configured"
            and self.share_reclaim is not None
            and pre.share_loss_budget is not None
        ):
            self.loss_budget = LossBudget(pre.share_loss_budget)
        self.priority_preemption = preset.priority_preemption and pre.priority
        self.idle_first, self.idle_minimum_s = pre.idle_first, pre.idle_minimum_s
        self.backfill = preset.backfill and config.backfill.enabled
        self.default_runtime_s = config.backfill.default_runtime_s
        self.reservations_max = config.backfill.reservations
        self.reservations_per_queue = config.backfill.reservations_per_queue
        self.reserve_after_s = config.backfill.reserve_after_s
        self.reserved_share = config.backfill.reserved_share
        # backfill plans with the runtimes learned from history; the size order may read them on its own
        self._plan_learned = self.backfill and config.backfill.learn_estimates
        self._plan_missing = self.backfill and config.backfill.learn_missing  # only jobs without an estimate
        # a running job past its planned end: its planned runtime grows by this factor until it ends later
        self._overdue_growth = 1.0 + config.backfill.overdue_remaining if self.backfill else 1.0
        self._size_learned = preset.size_order and config.order.learned_size and config.order.shift_max_s > 0
        learns = self._plan_learned or self._plan_missing or self._size_learned
        self._history = RuntimeHistory() if learns else None
        self._restarted: set[str] = set()  # jobs stopped before completing once (their runtime is no length)
        self.shares: dict[str, Amounts] = {}
        self._touched: list[Pending] = []
        self.reasons = Reasons(self)

    # ----- the driver's calls ---------------------------------------------------------------------------

    def submit(self, job: Job, now: float) -> None:
        """A job arrives; it waits until a cycle admits it."""
        if job.queue not in self._pending_demand:
            raise ValueError(f"job {job.name}: no leaf queue is named {job.queue}")
        if job.name in self._pending or job.name in self.running:
            raise ValueError(f"job {job.name} is already pending or running")
        self._enqueue(job, now)

    def finished(self, name: str, now: float) -> None:
        """A running job completed: release what it holds."""
        self._advance(now)
        if name in self.running:
            r = self._stop(name, completed=True)
            if self._history is not None and name not in self._restarted:
                self._history.completed(r.job, now - r.start)
            self._restarted.discard(name)

    def killed(self, name: str, now: float) -> None:
        """A running job stopped before completing: release it and requeue its job (ignored if not running)."""
        self._advance(now)
        if name in self.running:
            job = self._stop(name).job
            self._restarted.add(name)
            self._enqueue(job, now)

    def checkpoint(self, name: str, t: float) -> None:
        """A running job saved its state at t."""
        r = self.running.get(name)
        if r is not None:
            self._lost.remove(name)
            r.last_checkpoint = t
            self._lost.add(r)

    @property
    def pending_count(self) -> int:
        """How many jobs wait."""
        return len(self._pending)

    def allocated_by_queue(self) -> dict[str, Amounts]:
        """What each queue holds (leaves and inner queues), whatever the preset counts for quotas."""
        return {q: dict(v) for q, v in self.book.allocated.items()}

    def next_deadline(self) -> float | None:
        """The earliest notice deadline still to come (the driver cycles again then), or None."""
        return min((n.deadline for n in self._nominated.values()), default=None)

    def running_in(self, queue: str) -> Iterable[RunningJob]:
        """The running jobs of one leaf queue."""
        return self._by_queue[queue].values()

    def by_lost_work(self, queues: Iterable[str], now: float) -> Iterator[tuple[float, int, str]]:
        """(lost work, pods, name) of the running jobs of these leaves, least lost work first (lostwork.py)."""
        return self._lost.in_order(queues, now)

    def lowest_priority(self, queue: str) -> int | None:
        """The lowest priority among the leaf's running jobs (None: it runs none)."""
        return min(self._priorities[queue], default=None)

    def units_of(self, r: RunningJob) -> list[Unit]:
        """The capacity entries a running job holds (one per job; one per pod without gangs)."""
        return self._units[r.job.name]

    @property
    def excluded_for_preemptors(self) -> frozenset[str]:
        """Nodes already promised to preemptors: a new preemptor's room must be elsewhere."""
        return self._excl_base

    def share_exclusion(self, p: Pending, now: float) -> frozenset[str]:
        """The nodes a share reclaim for p keeps off (preempt.preemption_for): promised to preemptors and, with
        preemption.shareReclaim.keepReservations, those of every reservation but p's own that starts before p ends."""
        if not self.config.preemption.share_keeps_reservations:
            return self._excl_base
        return self._exclusion(p, now)

    @property
    def reservation(self) -> tuple[str, Reservation] | None:
        """The head of line's backfill reservation: (job name, reservation), or None."""
        if self._reserved is None or self._reservation is None:
            return None
        return self._reserved, self._reservation

    @property
    def reservations(self) -> dict[str, Reservation]:
        """Every backfill reservation by job: the head of line's and the further ones of multi-GPU jobs."""
        return dict(self._all_reservations())

    def waiting(self) -> list[Waiting]:
        """Every pending job with its current reason, queue by queue, in queue order."""
        out: list[Waiting] = []
        for lst in self._lists.values():
            for i, p in enumerate(lst):
                out.append(self.reasons.waiting(p, i + 1))
        return out

    # ----- one cycle -------------------------------------------------------------------------------------

    def cycle(self, now: float) -> Decisions:
        """Decide what starts, what gets a notice and what is stopped now (see the module docstring)."""
        self._advance(now)
        if self._overdue_growth > 1.0:
            self._extend_overdue(now)
        d = Decisions()
        self._expire(now, d)
        self._admit_nominated(now, d)
        self._refresh_reservation(now)
        order = self._orderer()
        self._dead: dict[str, DeadShapes] = {}
        self._heads_tried: set[str] = set()
        self._reservation_searches_left = RESERVATION_SEARCHES_PER_CYCLE
        self._searches_left = PREEMPTION_SEARCHES_PER_CYCLE
        cursors = dict.fromkeys(self._lists, 0)
        exhausted: set[str] = set()
        while True:
            live = [q for q, lst in self._lists.items() if q not in exhausted and cursors[q] < len(lst)]
            if not live:
                break
            for q in order(live, cursors):
                if self._walk(q, cursors, now, d):
                    break
                exhausted.add(q)
            else:
                break
        self.reasons.report(now, d)
        return d

    # ----- walking a queue -------------------------------------------------------------------------------

    def _walk(self, q: str, cursors: dict[str, int], now: float, d: Decisions) -> bool:
        """Admit the next admissible job of queue q (True), or find it has none now (False).

        Within a cycle a shape that failed stays failed (commits only take room away and
        allocations only grow), so its other jobs are passed over without a trial: all of
        them after a quota failure or one without reservations' nodes excluded (level 0),
        after one that kept off the first k reservations (level k, by start) those that
        would end after the k-th starts. Preemption and the head-of-line reservation are
        tried for the queue's first job that does not fit, once per cycle; a further
        reservation for its first multi-GPU job that does not fit (rooms.py).
        """
        lst = self._lists[q]
        dead = self._dead.get(q)  # shape -> the k-th start (level k), or -inf (level 0)
        if dead is None or not dead.covers(len(self._shapes)):
            dead = self._dead[q] = (
                DeadShapes(len(self._shapes)) if dead is None else dead.grown(len(self._shapes))
            )
        limit_of, nominated = dead.limit_of, self._nominated
        larger_of = None if self.report_waiting else self._larger.of  # a job passed over keeps its reason
        i = cursors[q]
        n = len(lst)
        pins = self._pins(lst)
        while i < n:  # the skips are this loop's hot path: now + runtime > k-th start is p's level >= k
            p = lst[i]
            limit = limit_of(p.shape)  # +inf: not dead
            if now + p.runtime > limit and (limit == ANY or p.job.name not in self._reserved_names):
                k = bisect.bisect_right(pins, i)
                i = lst.next_unskipped(i + 1, pins[k] if k < len(pins) else n, now, dead)
                continue
            if p.job.name in nominated:
                p.why = self.reasons.nominated(self._nominated[p.job.name])
                i += 1
                continue
            verdict = self._try(p, now, d)
            self._touched.append(p)
            if verdict == "admitted":
                lst.pop(i)
                cursors[q] = i
                return True
            if verdict == "capacity" and q not in self._heads_tried:
                self._heads_tried.add(q)
                if self._searches_left > 0 and self._preempt(p, now, d):
                    i += 1
                    n = len(lst)  # a notice of 0 s stops and requeues victims at once
                    pins = self._pins(lst)
                    continue
                self._reserve(p, now)
                pins = self._pins(lst)
            if (
                verdict == "capacity"
                and self._reservation_searches_left > 0
                and len(self._extra) < self.reservations_max - 1
                and self._reserve_extra(p, now)
            ):
                self._reservation_searches_left -= 1
                pins = self._pins(lst)
            if self.preset.head_blocks and verdict != "never":
                break
            if not self._is_reserved(p.job.name) and p.held == []:
                level = self._level(p, now) if verdict == "capacity" else 0
                limit = self._res_starts[level - 1] if level else ANY
                dead.set(p.shape, limit)
                larger = larger_of(p.shape) if larger_of is not None and verdict == "capacity" else None
                if larger is not None:
                    dead.lower(larger, limit)
            i += 1
        cursors[q] = i
        return False

    # ----- state changes ---------------------------------------------------------------------------------

    def _enqueue(self, job: Job, now: float) -> None:
        runtime = self._planned_runtime(job)
        p = Pending(
            job=job,
            demand=job_demand(job, self._memory_per_gpu),
            seq=next(self._seq),
            since=now,
            shape=self._shape_of(job.pods),
            runtime=runtime,
            shift=self._shift(job, runtime),
        )
        self._pending[job.name] = p
        lst = self._lists.setdefault(ALL if self.preset.order == "global" else job.queue, WaitList())
        lst.add(p)
        acc = self._pending_demand[job.queue]
        for k, v in p.demand.items():
            acc[k] = acc.get(k, 0) + v
        if job.gang:
            timeout = self.config.gang_timeout_s if job.gang_timeout is None else job.gang_timeout
            heapq.heappush(self._timeouts, (now + timeout, p.seq, job.name))

    def _start(
        self,
        p: Pending,
        plan: Plan,
        amounts: Amounts,
        now: float,
        d: Decisions,
        units: list[tuple[str, Job, Plan]] | None = None,
    ) -> None:
        job = p.job
        borrowed = not self.book.within_guarantee(job.queue, amounts)
        if units is None:
            self.cap.commit(job.name, job, plan)
            units = [(job.name, job, plan)]
        self._version += 1
        self._units[job.name] = units
        self.book.charge(job.queue, amounts)
        self._order_charge(job.queue, amounts, 1)
        del self._pending[job.name]
        self._preempt_failed.pop(job.name, None)
        self._pending_demand[job.queue] = sub(self._pending_demand[job.queue], p.demand)
        r = self.running[job.name] = RunningJob(
            job=job, start=now, plan=plan, usage=amounts, borrowed=borrowed, estimate=p.runtime
        )
        self._by_queue[job.queue][job.name] = r
        self._lost.add(r)
        bisect.insort(self._ends, (r.expected_end(self.default_runtime_s), job.name))
        count = self._priorities[job.queue]
        count[job.priority] = count.get(job.priority, 0) + 1
        heapq.heappush(self._young, (now, job.name))
        d.admit.append(Admission(job=job, plan=plan, borrowed=borrowed))
        if self._reserved == job.name:
            self._drop_reservation()
        elif self._extra.pop(job.name, None) is not None:
            self._exclusions()

    def _extend_overdue(self, now: float) -> None:
        """Plan each running job past its planned end to run on (backfill.overdueRemaining).

        Runtimes are heavy-tailed and estimates poor: a job that has run past its plan is more
        likely to run on than to end at once, so its planned runtime grows by the configured factor
        until it ends after now, and it moves in the running jobs' order of expected end. Planning
        it to end now held a reservation's nodes idle for every job that could have run there
        meanwhile. The result depends only on the job's start, its first plan and now, so a restart
        that adopts the job plans it the same way again.
        """
        ends, growth = self._ends, self._overdue_growth
        i = bisect.bisect_right(ends, now, key=itemgetter(0))
        if not i:
            return
        moved = []
        for _, name in ends[:i]:
            r = self.running[name]
            runtime = max(r.estimate if r.estimate is not None else self.default_runtime_s, MIN_PLANNED_S)
            while r.start + runtime <= now:
                runtime *= growth
            r.estimate = runtime
            moved.append((r.start + runtime, name))
        del ends[:i]
        ends.extend(moved)
        ends.sort()

    def _stop(self, name: str, completed: bool = False) -> RunningJob:
        r = self.running.pop(name)
        if self.loss_budget is not None and r.notice_deadline is not None and not completed:
            self.loss_budget.lost(r.lost_work(self._now), self._now)  # a victim stopped (lossbudget.py)
        del self._by_queue[r.job.queue][name]
        self._lost.remove(name)
        del self._ends[bisect.bisect_left(self._ends, (r.expected_end(self.default_runtime_s), name))]
        count = self._priorities[r.job.queue]
        count[r.job.priority] -= 1
        if not count[r.job.priority]:
            del count[r.job.priority]
        self._released_nodes |= r.plan.nodes
        for key, _, _ in self._units.pop(name):
            self.cap.release(key)
        self._version += 1
        self.book.charge(r.job.queue, r.usage, -1)
        self._order_charge(r.job.queue, r.usage, -1)
        if r.preemptor is not None:
            nom = self._nominated.get(r.preemptor)
            if nom is not None and all(v not in self.running for v in nom.victims):
                nom.deadline = min(nom.deadline, self._now)
        return r

    def _advance(self, now: float) -> None:
        """Move time to `now`: charge every leaf's allocation since the last call to the usage ledger, and the
        GPU-time delivered to the loss budget."""
        if now < self._now:
            raise ValueError(f"time went back: {now} after {self._now}")
        ledger, budget, since = self._ledger, self.loss_budget, self._charged_to
        if (ledger is not None or budget is not None) and since is not None and now > since:
            milli = 0  # GPUs held by the running jobs, for the loss budget's delivered GPU-time
            for leaf in self.config.leaves:
                held = self.book.allocated[leaf]
                if ledger is not None and any(held.values()):
                    ledger.charge(leaf, held, since, now)
                milli += held.get(GPU, 0)
            if budget is not None:
                budget.delivered(milli / MILLI_PER_GPU, since, now)
        self._charged_to = now
        self._now = now

    # ----- order and reports -----------------------------------------------------------------------------

    def _pins(self, lst: WaitList) -> list[int]:
        """The sorted indices in lst of the reserved jobs (the level rule does not pass over them)."""
        out = []
        for name in self._reserved_names:
            p = self._pending.get(name)
            if p is not None and self._list_of(p.job) is lst:
                out.append(lst.index_of(p))
        return sorted(out)

    def _list_of(self, job: Job) -> WaitList:
        return self._lists[ALL if self.preset.order == "global" else job.queue]

    def _free_gpu(self) -> int:
        stamp = (self.cap.epoch, self._version)
        if self._free_stamp != stamp:
            self._free_cache = self.cap.free_gpu()
            self._free_stamp = stamp
        return self._free_cache

    _free_stamp: tuple[int, int] | None = None
    _free_cache = 0

    def _planned_runtime(self, job: Job) -> float:
        """What backfill plans the job with: its estimate (or the default), corrected by history when on."""
        if self._history is not None and (
            self._plan_learned or (self._plan_missing and job.runtime_estimate is None)
        ):
            return self._history.estimate(job, self.default_runtime_s)
        return self.default_runtime_s if job.runtime_estimate is None else job.runtime_estimate

    def _shift(self, job: Job, runtime: float) -> float:
        """How far back the job's place in its queue moves for its size (config.OrderSettings)."""
        order = self.config.order
        if not self.preset.size_order or order.shift_max_s <= 0:
            return 0.0
        if order.shift_up_to_gpus and job.gpu_milli > order.shift_up_to_gpus * MILLI_PER_GPU:
            return 0.0  # a big job keeps its arrival as its place
        if self._size_learned and not self._plan_learned and self._history is not None:
            runtime = self._history.estimate(job, self.default_runtime_s)
        gpu_hours = job.gpu_milli / MILLI_PER_GPU * runtime / 3600.0
        return min(order.shift_per_gpu_hour_s * gpu_hours, order.shift_max_s)

    def _shape_of(self, pods: tuple[object, ...]) -> int:
        shape = self._shapes.get(pods)
        if shape is None:
            shape = self._shapes[pods] = len(self._shapes)
            self._larger.add(shape, pods)  # type: ignore[arg-type]
        return shape
