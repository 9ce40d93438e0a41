"""Preemption: which running jobs to stop so that a pending job fits, losing the least work.

choose_victims() takes the running jobs the engine found eligible (for reclaim:
borrowed work of queues above their guarantee; for priority: jobs of strictly
lower priority), drops those it must not touch (not preemptible, already under
notice, younger than the minimum runtime), orders the rest by the work they
would lose (GPU-seconds since their last checkpoint, or since their start), then
by fewest pods, then by name, and releases them one by one on a fork of the
cluster until the preemptor plans: once over all candidates, and once per node
over the candidates on that node; the set losing the least work wins. A victim whose loss would take its queue
below its guarantee is passed over. Victims that turn out not to be needed are
then given back (most lost work first), so the final set is minimal in that
sense: dropping any one of them leaves the preemptor without a placement.

With preemption.idleFirst, idle best-effort candidates come before every other
one (the `idle` names): those flagged idle (RunningJob.idle_since) for at least
preemption.idleMinimum that are best-effort for this preemptor, i.e. admitted
above their queue's guarantee (borrowed) or of lower priority than it. Their lost
work counts after everyone else's: a set of idle victims beats any set with a
busy one. Idleness widens nothing: the same candidates, guarantees, minimum
runtime and preemptible flag apply; the notice's reason is "idle".

Nothing here changes the cluster: every what-if runs inside ClusterCapacity.trial(), which undoes it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gpunode.cluster.queueing.model import GPU, Amounts, Job, Plan, RunningJob
from gpunode.cluster.queueing.quotas import QuotaBook
from gpunode.contract.names import MILLI_PER_GPU

if TYPE_CHECKING:
    from gpunode.cluster.queueing.capacity import ClusterCapacity
    from gpunode.cluster.queueing.config import QueueConfig
    from gpunode.cluster.queueing.lossbudget import LossBudget
    from gpunode.cluster.queueing.nodeview import PodRoom
    from gpunode.cluster.queueing.pending import Pending
    from gpunode.cluster.queueing.presets import Preset

# The most candidates one preemption attempt considers (those losing the least work): bounds the
# placement trials a single decision may make on a large cluster.
MAX_CANDIDATES = 256
MAX_NODES = 4  # the most nodes the node-by-node search tries (those whose cheapest candidate loses least)
MAX_VICTIMS = 32  # the most jobs one search releases before it gives up (each release rebuilds a node)
NODE_GPU_MILLI = 8000  # what a node's own free GPUs can add at most (8 GPUs), for the quick check

Unit = tuple[str, Job, Plan]  # a capacity key, the (sub-)job committed under it and its placement


class Forkable(Protocol):
    """The part of ClusterCapacity preemption uses."""

    def trial(self) -> AbstractContextManager[Forkable]:
        """A block whose commits and releases are undone on exit."""
        ...

    def release(self, job_name: str) -> None:
        """Give back what the job holds."""
        ...

    def commit(self, job_name: str, job: Job, plan: Plan) -> None:
        """Hold what the plan places."""
        ...

    def plan(self, job: Job, *, exclude_nodes: frozenset[str] = frozenset()) -> Plan | None:
        """A placement for every pod of the job, or None."""
        ...

    def free(self) -> Amounts:
        """What is free, per resource."""
        ...

    def pods_bound(self, pod_milli: int, exclude: frozenset[str]) -> int:
        """At most how many pods of pod_milli GPU the nodes outside `exclude` could take now."""
        ...

    def pod_room(self, pod_milli: int, exclude: frozenset[str]) -> PodRoom:
        """pods_bound now, to count releases into before they are made."""
        ...


@dataclass(frozen=True)
class Victims:
    """The jobs to stop and where the preemptor will go once they have."""

    jobs: tuple[RunningJob, ...]
    plan: Plan


class PreemptionHost(Protocol):
    """What preemption_for reads of its scheduler (engine.Scheduler, through rooms.Rooms)."""

    config: QueueConfig
    cap: ClusterCapacity
    preset: Preset
    book: QuotaBook
    running: dict[str, RunningJob]
    shares: dict[str, Amounts]
    reclaim: bool
    share_reclaim: tuple[float, float] | None
    loss_budget: LossBudget | None
    priority_preemption: bool
    idle_first: bool
    idle_minimum_s: float
    min_runtime_s: float

    @property
    def excluded_for_preemptors(self) -> frozenset[str]:
        """Nodes already promised to preemptors."""

    def share_exclusion(self, p: Pending, now: float) -> frozenset[str]:
        """The nodes a share reclaim for p keeps off: promised to preemptors, or reserved (keepReservations)."""

    def lowest_priority(self, queue: str) -> int | None:
        """The lowest priority among the leaf's running jobs (None: it runs none)."""

    def running_in(self, queue: str) -> Iterable[RunningJob]:
        """The running jobs of one leaf queue."""

    def by_lost_work(self, queues: Iterable[str], now: float) -> Iterator[tuple[float, int, str]]:
        """(lost work, pods, name) of the running jobs of these leaves, least lost work first."""

    def units_of(self, r: RunningJob) -> list[Unit]:
        """The capacity entries a running job holds."""


def eligible(r: RunningJob, now: float, min_runtime_s: float) -> bool:
    """May this job be preempted at all now: preemptible, not under notice, past its minimum runtime."""
    return r.job.preemptible and r.notice_deadline is None and now - r.start >= min_runtime_s


def victim_order(
    r: RunningJob, now: float, idle: frozenset[str] = frozenset()
) -> tuple[bool, float, int, str]:
    """The order victims are taken in: idle ones first, then least lost work, then fewest pods, then name."""
    return (r.job.name not in idle, r.lost_work(now), len(r.job.pods), r.job.name)


def _set_cost(v: Victims, now: float, idle: frozenset[str]) -> tuple[float, float, int, tuple[str, ...]]:
    """How much a set of victims costs: busy lost work, then idle lost work, then pods, then names."""
    busy = sum(r.lost_work(now) for r in v.jobs if r.job.name not in idle)
    quiet = sum(r.lost_work(now) for r in v.jobs if r.job.name in idle)
    return (busy, quiet, sum(len(r.job.pods) for r in v.jobs), tuple(r.job.name for r in v.jobs))


def choose_victims(
    preemptor: Job,
    demand: Amounts,
    candidates: Sequence[RunningJob],
    cap: Forkable,
    book: QuotaBook,
    now: float,
    *,
    min_runtime_s: float,
    units: Callable[[RunningJob], Sequence[Unit]],
    exclude_nodes: frozenset[str] = frozenset(),
    idle: frozenset[str] = frozenset(),
) -> Victims | None:
    """The least-loss set of candidates whose stopping lets `preemptor` place; None if there is none.

    For a one-pod preemptor, node by node first (only the candidates on one node,
    as kube-scheduler does; this finds the room one node can give when the
    cheapest victims are spread over many), on the MAX_NODES nodes whose cheapest
    candidate loses least; then, if none works (or for a gang), over all
    candidates at once. Among the sets found the one losing the least work wins
    (then fewest pods, then names). demand: what the preemptor will hold
    (a quick check that enough could be freed before any placement trial).
    units(r): the capacity entries a running job holds. exclude_nodes: nodes the
    preemptor must not use (room already promised to other preemptors). idle: the
    candidates taken first and whose lost work counts last (see the module docstring).
    """
    pool = sorted(
        (r for r in candidates if eligible(r, now, min_runtime_s)), key=lambda r: victim_order(r, now, idle)
    )
    pool = pool[:MAX_CANDIDATES]
    if not pool:
        return None
    found: list[Victims | None] = []
    if len(preemptor.pods) == 1:
        by_node: dict[str, list[RunningJob]] = {}
        for r in pool:
            for node in sorted(r.plan.nodes):
                by_node.setdefault(node, []).append(r)
        need = demand.get(GPU, 0)
        nodes = sorted(
            (n for n, rs in by_node.items() if sum(r.usage.get(GPU, 0) for r in rs) + NODE_GPU_MILLI >= need),
            key=lambda n: (min(victim_order(r, now, idle)[:2] for r in by_node[n]), n),
        )
        for node in nodes[:MAX_NODES]:
            found.append(
                _greedy(preemptor, demand, by_node[node], cap, book, now, units, exclude_nodes, idle)
            )
    if not any(found):
        found.append(_greedy(preemptor, demand, pool, cap, book, now, units, exclude_nodes, idle))
    results = [v for v in found if v is not None]
    if not results:
        return None
    return min(results, key=lambda v: _set_cost(v, now, idle))


def _greedy(
    preemptor: Job,
    demand: Amounts,
    pool: Sequence[RunningJob],
    cap: Forkable,
    book: QuotaBook,
    now: float,
    units: Callable[[RunningJob], Sequence[Unit]],
    exclude_nodes: frozenset[str],
    idle: frozenset[str],
) -> Victims | None:
    """Release pool's jobs in order on a fork until the preemptor plans, then give back the unneeded."""
    need_gpu = demand.get(GPU, 0)
    free_gpu = cap.free().get(GPU, 0)
    if free_gpu + sum(r.usage.get(GPU, 0) for r in pool) < need_gpu:
        return None
    # The search plans only while the open nodes could take every pod (_release_until_placed); if they
    # could not even with the whole pool released, it would release and give back without one plan.
    pod_need = _smallest_pod(preemptor)
    if pod_need > 0:
        room = cap.pod_room(pod_need, exclude_nodes)
        room.count(key for r in pool for key, _, _ in units(r))
        if room.bound() < len(preemptor.pods):
            return None
    with cap.trial() as fork:
        return _release_until_placed(
            preemptor, pool, fork, book, now, units, exclude_nodes, need_gpu, free_gpu, idle
        )


def _smallest_pod(job: Job) -> int:
    """The fewest milli-GPU any pod asks: a node whose free share is below it can take no pod of the job."""
    return min((p.gpus * MILLI_PER_GPU if p.gpus else p.gpu_milli) for p in job.pods)


def _release_until_placed(
    preemptor: Job,
    pool: Sequence[RunningJob],
    fork: Forkable,
    book: QuotaBook,
    now: float,
    units: Callable[[RunningJob], Sequence[Unit]],
    exclude_nodes: frozenset[str],
    need_gpu: int,
    free_gpu: int,
    idle: frozenset[str],
) -> Victims | None:
    chosen: list[RunningJob] = []
    plan: Plan | None = None
    pod_need = _smallest_pod(preemptor)
    waiting: list[str] = []  # keys of chosen jobs not yet released on the fork (released before a plan)
    room = fork.pod_room(pod_need, exclude_nodes) if pod_need > 0 else None  # counts every chosen job
    for r in pool:
        if len(chosen) >= MAX_VICTIMS:
            break
        if not book.may_take(preemptor.queue, [(v.job.queue, v.usage) for v in (*chosen, r)]):
            continue
        keys = [key for key, _, _ in units(r)]
        if room is not None:
            room.count(keys)
        waiting.extend(keys)
        chosen.append(r)
        free_gpu += r.usage.get(GPU, 0)
        if free_gpu < need_gpu:
            continue
        # A pod lands whole on one node: unless the open nodes' free GPUs could take as many pods as the
        # job has (each node counted for its free share // the smallest pod's), no placement can succeed.
        # The bound with the waiting releases counted in comes first: releasing rebuilds nodes.
        if room is not None and room.bound() < len(preemptor.pods):
            continue
        for key in waiting:
            fork.release(key)
        waiting.clear()
        if pod_need > 0 and fork.pods_bound(pod_need, exclude_nodes) < len(preemptor.pods):
            continue
        plan = fork.plan(preemptor, exclude_nodes=exclude_nodes)
        if plan is not None:
            break
    if plan is None:
        return None
    # Give back the victims not needed, the costliest first; each stays stopped only if the preemptor
    # would no longer place without it.
    for r in sorted(chosen, key=lambda v: victim_order(v, now, idle), reverse=True):
        if len(chosen) == 1:
            break
        for key, job, held in units(r):
            fork.commit(key, job, held)
        # Without it the open nodes may be unable to take every pod at all: then it is needed, no plan asked.
        again = None
        if pod_need <= 0 or fork.pods_bound(pod_need, exclude_nodes) >= len(preemptor.pods):
            again = fork.plan(preemptor, exclude_nodes=exclude_nodes)
        if again is not None:
            chosen.remove(r)
            plan = again
        else:
            for key, _, _ in units(r):
                fork.release(key)
    return Victims(jobs=tuple(sorted(chosen, key=lambda v: victim_order(v, now, idle))), plan=plan)


def preemption_for(sched: PreemptionHost, p: Pending, now: float) -> tuple[Victims, dict[str, str]] | None:
    """The victims the engine's rules allow for pending job p, and each one's reason; None if none work.

    reclaim: candidates are the jobs of other leaves that p may reclaim from
    (QuotaBook.may_reclaim: where the two chains part, p's side stays within its
    guarantee after admitting p and the other side borrows; so siblings under one
    parent reclaim from each other even when the parent itself holds more than its
    guarantee) and, with the scheduler's share_reclaim (above, after), of queues holding
    more than `above` x their fair share, when p's queue stays within its own fair share
    after admitting p and p has waited at least `after` seconds. priority:
    candidates are jobs of strictly lower priority (only p's own queue when the
    preset says so). choose_victims then keeps every queue at or above its guarantee.
    With idle_first, the idle best-effort candidates go first (reason "idle"; module docstring).
    No share reclaim while a loss budget (lossbudget.py) is spent. With keepReservations the
    share reclaim's room keeps off the reservations that start before p would end; when that
    finds nothing, the search is made again without the share reclaim.
    """
    leaf = p.job.queue
    book = sched.book
    over_share: set[str] = set()
    share_reclaim = sched.share_reclaim
    budget = sched.loss_budget
    if (
        share_reclaim is not None
        and sched.shares
        and now - p.since >= share_reclaim[1]
        and (budget is None or budget.allows(now))
    ):
        above, shares = share_reclaim[0], sched.shares
        if book.allocated[leaf].get(GPU, 0) + p.demand.get(GPU, 0) <= shares.get(leaf, {}).get(GPU, 0):
            over_share = {
                q
                for q in sched.config.leaves
                if book.allocated[q].get(GPU, 0) > above * shares[q].get(GPU, 0)
            }
    if not over_share:
        return _search(sched, p, now, over_share, sched.excluded_for_preemptors)
    found = _search(sched, p, now, over_share, sched.share_exclusion(p, now))
    if found is not None or not sched.config.preemption.share_keeps_reservations:
        return found
    return _search(sched, p, now, set(), sched.excluded_for_preemptors)


def _search(
    sched: PreemptionHost, p: Pending, now: float, over_share: set[str], exclude: frozenset[str]
) -> tuple[Victims, dict[str, str]] | None:
    """preemption_for's search, share reclaim taking from the over_share queues, the room off `exclude`."""
    leaf = p.job.queue
    book = sched.book
    reclaim = sched.reclaim and book.mode != "none"
    reasons: dict[str, str] = {}
    keyed: list[tuple[bool, float, int, str, RunningJob]] = []
    idle: set[str] = set()
    idle_first, idle_minimum = sched.idle_first, sched.idle_minimum_s
    reclaimable = {
        q: q != leaf and ((reclaim and book.may_reclaim(leaf, p.demand, q)) or q in over_share)
        for q in sched.config.leaves
    }
    lower = sched.priority_preemption
    within = sched.preset.within_queue_only
    priority = p.job.priority
    min_runtime = sched.min_runtime_s
    queues = []  # the leaves whose running jobs may hold a candidate: reclaimable, or some lower priority
    for q in sched.config.leaves:
        lowest = sched.lowest_priority(q)
        if reclaimable[q] or (
            lower and (q == leaf or not within) and lowest is not None and lowest < priority
        ):
            queues.append(q)
    # (lost work, pods, name): (now - since) x milli-GPU held, the order the candidates are taken in
    if idle_first:  # quiet candidates go first, whatever their lost work: look at every running job
        found: Iterable[tuple[float, int, str]] = (
            ((now - r.since) * r.usage.get(GPU, 0), len(r.job.pods), r.job.name)
            for q in queues
            for r in sched.running_in(q)
        )
    else:  # least lost work first (lostwork.py): only as many as make MAX_CANDIDATES
        found = sched.by_lost_work(queues, now)
    running = sched.running
    for lost, pods, name in found:
        r = running[name]
        job = r.job
        if not job.preemptible or r.notice_deadline is not None or now - r.start < min_runtime:
            continue
        if not reclaimable[job.queue] and not job.priority < priority:
            continue
        quiet = (
            idle_first
            and r.idle_since is not None
            and now - r.idle_since >= idle_minimum
            and (r.borrowed or job.priority < priority)  # best-effort for this preemptor
        )
        keyed.append((not quiet, lost, pods, name, r))
        if not idle_first and len(keyed) == MAX_CANDIDATES:
            break
    if not keyed:
        return None
    chosen = heapq.nsmallest(MAX_CANDIDATES, keyed, key=lambda item: item[:4])
    candidates = [item[4] for item in chosen]
    for busy, _, _, name, r in chosen:
        if not busy:
            reasons[name] = "idle"
            idle.add(name)
        else:
            reasons[name] = "reclaim" if reclaimable[r.job.queue] else "priority"
    victims = choose_victims(
        p.job,
        p.demand,
        candidates,
        sched.cap,
        book,
        now,
        min_runtime_s=sched.min_runtime_s,
        units=sched.units_of,
        exclude_nodes=exclude,
        idle=frozenset(idle),
    )
    return None if victims is None else (victims, reasons)
