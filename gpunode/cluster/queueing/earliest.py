"""Backfill's search for the earliest start of a head of line (backfill.reserve).

The running jobs are taken in groups of equal expected end (Groups); the search
finds the fewest groups to release before the head plans: galloping (1, 2, 4, ...
groups), then bisection. Search makes each trial on a fork where the groups are
really released (each node rebuilt, scored again) and committed again going back.

FastSearch makes the very same trials in the same order, with the same random
generator (a copy of the cluster's), but does not release anything: for a trial
after k groups it sets to their state after those releases only the nodes where
a member of the head could then fit (by a necessary test on the node's free GPU,
CPU and memory once its released pods are added back); every other node keeps
the state it has on the fork, and is hidden from the trial's plan if an earlier
trial showed it with more jobs released. That changes no trial's outcome: a node
without releases is in its state after k groups already; a node that fails the
test cannot take any member after k groups, nor in a state that releases fewer
of the same jobs (now, or after fewer groups), and a hidden one is one that cannot
take any member after k groups; and a node's feasibility and score depend only on
its own state. So each trial sees the same feasible nodes with the same scores,
breaks ties with the same draws, and returns the same plan as the plain search's;
a trial costs the nodes where the head may fit after its releases, not every node
the released jobs touched, nor every node an earlier trial of the search showed
(tests/cluster/queueing/test_earliest.py compares the two).

The first group, the jobs already past their expected end, is often most of the
running jobs and changes little from one search to the next, and so do the other
large groups (LARGE_GROUP jobs or more: jobs started together and planned again
together): their per-node and per-GPU sums are kept on the capacity and updated
by differences (NodeView.released_sums). A trial's node state is put back from
those kept before (ShownStates) when the node's version and the jobs released
from it are the same: the per-node sums carry the pods released and the sum of
their commits' random marks, so all nodes are looked up at once. A state not
kept is built as arrays, for all such nodes at once (the node's present arrays
plus what the released pods free on each GPU); its NodeState is built only if a
trial places a pod on it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.model import GPU, Job, Plan
from gpunode.cluster.queueing.nodeview import released_columns
from gpunode.placement.arrays import MAX_GPUS, BoolArray, IntArray


def _end(item: tuple[float, str]) -> float:
    return item[0]


class Groups:
    """The committed running jobs by expected end, in groups of equal end, earliest first.

    A job already past its expected end is expected to end now: all of those make the
    first group. Groups are built as the search reaches them (reach), so a head that
    fits after the first few ends costs a few bisections of `ends`, not a pass over it.
    """

    def __init__(self, ends: Sequence[tuple[float, str]], now: float, cap: ClusterCapacity) -> None:
        self.ends, self.cap = ends, cap
        self.items: list[tuple[float, list[str]]] = []
        self.next = bisect.bisect_right(ends, now, key=_end)
        first = sorted(cap.committed([name for _, name in ends[: self.next]]))
        self.overdue = bool(first)  # the first group is the jobs past their expected end
        if first:
            self.items.append((now, first))

    def reach(self, k: int) -> int:
        """Build groups until there are k or no more; how many there are then."""
        ends, cap, items = self.ends, self.cap, self.items
        while len(items) < k and self.next < len(ends):
            end = ends[self.next][0]
            stop = bisect.bisect_right(ends, end, lo=self.next, key=_end)
            names = cap.committed([name for _, name in ends[self.next : stop]])
            self.next = stop
            if names:
                items.append((end, names))
        return len(items)


class Search:
    """The fewest end-time groups to release before the head plans: galloping, then bisection.

    Going forward releases groups (release_many, each node rebuilt once per step);
    going back commits them again with their own plans. A step whose released GPUs
    cannot cover the head's in all is decided without a placement trial.
    """

    def __init__(self, cap: ClusterCapacity, head: Job, groups: Groups, exclude: frozenset[str]) -> None:
        self.cap, self.head, self.groups, self.exclude = cap, head, groups, exclude
        self.pos = 0
        self.free = [cap.free()[GPU]]  # free GPU after releasing the first k groups, extended as needed
        self.kept: dict[str, tuple[Job, Plan]] = {}

    def _free_after(self, k: int) -> int:
        items, held = self.groups.items, self.cap.held_gpu
        while len(self.free) <= k:
            names = items[len(self.free) - 1][1]
            self.free.append(self.free[-1] + sum(held(name) for name in names))
        return self.free[k]

    def _probe(self, k: int) -> Plan | None:
        if self._free_after(k) < self.head.gpu_milli:
            return None
        cap, items = self.cap, self.groups.items
        if k > self.pos:
            names = [n for _, group in items[self.pos : k] for n in group]
            for name in names:
                self.kept.setdefault(name, (cap.job_of(name), cap.plan_of(name)))
            cap.release_many(names)
        for _, group in items[k : self.pos]:
            for name in group:
                cap.commit(name, *self.kept[name])
        self.pos = k
        return cap.plan(self.head, exclude_nodes=self.exclude)

    def earliest(self) -> tuple[int, Plan] | None:
        """(k, plan): the fewest groups after whose release the head plans, with that plan; None: never."""
        groups = self.groups
        low, k = 0, 1  # releasing `low` groups is known not to be enough
        best: tuple[int, Plan] | None = None
        while groups.reach(k) >= k:
            plan = self._probe(k)
            if plan is not None:
                best = (k, plan)
                break
            n = groups.reach(2 * k)  # min(2k, the number of groups)
            if n <= k:
                return None
            low, k = k, n
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


# The fewest jobs a group of equal expected end has for FastSearch to keep its sums on the capacity.
LARGE_GROUP = 64


class FastSearch(Search):
    """Search's trials on one fork that only shows, per trial, the nodes that can matter (module docstring).

    The per-node sums are dense arrays over the node rows, and a group's pods are one array, so a step
    of the search costs a few array operations, not a pass in Python over the released pods and nodes.
    """

    def __init__(self, cap: ClusterCapacity, head: Job, groups: Groups, exclude: frozenset[str]) -> None:
        super().__init__(cap.fork(books=False), head, groups, exclude)  # only planned on
        self.origin = cap  # unchanged while the search runs: the real state of each row
        # the real state (the fork's rows change as trials show them): free milli-GPU, CPU, memory per row
        self.now_free = np.stack(cap.free_by_row(), axis=1).astype(np.int64, copy=False)
        needs = {(q.gpus * 1000 + q.gpu_milli, q.cpu_milli, q.memory_bytes) for q in head.pods}
        self.needs = np.array(sorted(needs), dtype=np.int64)  # (kinds of pod, 3)
        rows = len(self.now_free)
        self.gone: set[str] = set()  # the jobs of the first `pos` groups
        self.freed = np.zeros((rows, 6), dtype=np.int64)  # per row: what they free (released_columns)
        self.freed_gpu = np.zeros((rows, MAX_GPUS, 3), dtype=np.int64)  # and per GPU slot
        self.shown = np.zeros(rows, dtype=np.int64)  # per row: the released pods its state on the fork
        # leaves out (0: its present state)
        # per group: its jobs' footprint entries (one per array row), or for a large group its sums per row
        # and per GPU slot kept on the capacity (NodeView.released_sums); and the milli-GPU it holds
        self.parts: list[IntArray | tuple[IntArray, IntArray]] = []
        self.held: list[int] = []

    def _part(self, i: int) -> IntArray | tuple[IntArray, IntArray]:
        parts = self.parts
        while len(parts) <= i:
            end, names = self.groups.items[len(parts)]
            if len(parts) == 0 and self.groups.overdue:  # the jobs past their expected end
                per_row, per_gpu, held = self.origin.released_sums(names)
                parts.append((per_row, per_gpu))
            elif len(names) >= LARGE_GROUP:
                per_row, per_gpu, held = self.origin.released_sums(names, key=end)
                parts.append((per_row, per_gpu))
            else:
                footprint, held_gpu = self.cap.footprint, self.cap.held_gpu
                flat = [t for name in names for t in footprint(name)]
                parts.append(np.array(flat, dtype=np.int64) if flat else np.zeros((0, 8), dtype=np.int64))
                held = sum(held_gpu(name) for name in names)
            self.held.append(held)
        return parts[i]

    def _free_after(self, k: int) -> int:
        while len(self.free) <= k:
            self._part(len(self.free) - 1)
            self.free.append(self.free[-1] + self.held[len(self.free) - 1])
        return self.free[k]

    def _move(self, k: int) -> None:
        forward = k > self.pos
        lo, hi = (self.pos, k) if forward else (k, self.pos)
        gone = self.gone
        for _, group in self.groups.items[lo:hi]:
            if forward:
                gone.update(group)
            else:
                gone.difference_update(group)
        pods: list[IntArray] = []
        for i in range(lo, hi):
            part = self._part(i)
            if isinstance(part, tuple):
                per_row, per_gpu = part
                if forward:
                    self.freed += per_row
                    self.freed_gpu += per_gpu
                else:
                    self.freed -= per_row
                    self.freed_gpu -= per_gpu
            elif len(part):
                pods.append(part)
        if pods:
            at, per_row, per_gpu = released_columns(
                pods[0] if len(pods) == 1 else np.concatenate(pods), 1 if forward else -1
            )
            np.add.at(self.freed, at, per_row)
            np.add.at(self.freed_gpu, at, per_gpu)
        self.pos = k

    def _probe(self, k: int) -> Plan | None:
        if self._free_after(k) < self.head.gpu_milli:
            return None
        self._move(k)
        freed, shown = self.freed, self.shown
        differ = np.flatnonzero(shown != freed[:, 3])  # rows the fork shows in another state than after k
        hide: BoolArray | None = None
        if len(differ):  # a necessary test: some member of the head fits in the row's room plus its releases
            room: IntArray = self.now_free[differ] + freed[differ, :3]
            fits: BoolArray = np.any(np.all(room[:, None, :] >= self.needs[None, :, :], axis=2), axis=1)
            show = differ[fits]
            # shown with more released than after k (an earlier trial's), and no member can fit after k
            stale = differ[~fits & (shown[differ] > freed[differ, 3])]
            if len(show):
                self.cap.show_without(self.gone, show, freed[show], self.freed_gpu[show], self.origin)
                shown[show] = freed[show, 3]
            if len(stale):
                hide = np.zeros(len(shown), dtype=bool)
                hide[stale] = True
        return self.cap.plan(self.head, exclude_nodes=self.exclude, hide=hide)
