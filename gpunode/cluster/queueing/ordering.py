"""Which queue is served next: fair shares kept current cheaply, the DRF queue order, Kueue's head order.

Part of the Scheduler (engine.py), split from it to keep modules small.

Fair shares (fairshare.fair_shares) depend on every leaf's demand (what it holds
plus what it waits for), the capacity and the decayed usage. They are not
recomputed in every cycle, only when they can have moved enough to matter:

- at least every SHARE_REFRESH_S of (simulated or real) time, for the usage
  decay (the configured half-life is hours: a minute moves usage by well under 1%);
- at once when a leaf's demand of some resource moved by more than
  SHARE_DEMAND_STEP of the cluster's capacity of it since the last computation,
  or a leaf's demand went from nothing to something or back.

Between two computations the queue order is still exact for the shares in use:
QueueOrder is charged with every admission and release. The effect: on a large
cluster, shares lag demand by up to one step (2% of the GPUs per queue) or one
minute, and the order between two queues whose ratios differ by less than that
may differ from a recomputation in every cycle; on a small cluster (tests, under
50 GPUs) every one-GPU change is a step, so shares are as fresh as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gpunode.cluster.queueing.fairshare import QueueOrder, UsageLedger, fair_shares
from gpunode.cluster.queueing.model import Amounts, add

if TYPE_CHECKING:
    from gpunode.cluster.queueing.config import QueueConfig
    from gpunode.cluster.queueing.presets import Preset
    from gpunode.cluster.queueing.quotas import QuotaBook
    from gpunode.cluster.queueing.waitlist import WaitList

SHARE_REFRESH_S = 60.0
SHARE_DEMAND_STEP = 0.02
Orderer = Callable[[Sequence[str], dict[str, int]], list[str]]


class Ordering:
    """Fair shares and queue order of a Scheduler (mixed into it)."""

    if TYPE_CHECKING:
        config: QueueConfig
        book: QuotaBook
        preset: Preset
        _ledger: UsageLedger | None
        _now: float
        _capacity: Amounts
        _pending_demand: dict[str, Amounts]
        _lists: dict[str, WaitList]

    shares: dict[str, Amounts]
    _order_state: QueueOrder | None = None
    _shares_at = -float("inf")  # when the shares in use were computed
    _shares_demand: dict[str, Amounts]
    share_computations = 0  # how many times the shares were computed (for benchmarks)

    def _orderer(self) -> Orderer:
        """The function that orders the queues with pending jobs for this cycle."""
        if self.preset.order == "fairshare":
            state = self._refresh_shares()
            return lambda live, cursors: state.order(live)
        if self.preset.order == "kueue":
            return self._kueue_order
        return lambda live, cursors: list(live)

    def _refresh_shares(self) -> QueueOrder:
        """The queue order, with the shares recomputed first when the rule in the module docstring says so."""
        leaves = self.config.leaves
        demand = {q: add(self.book.allocated[q], self._pending_demand[q]) for q in leaves}
        state = self._order_state
        if state is not None and not self._shares_stale(demand):
            return state
        usage = self._ledger.usage(self._now) if self._ledger is not None else {}
        k = None if self.preset.usage_memory else 0.0
        self.shares = fair_shares(self.config, self._capacity, demand, usage, k=k)
        state = self._order_state = QueueOrder(
            self.config, self.shares, {q: self.book.allocated[q] for q in leaves}
        )
        self._shares_at = self._now
        self._shares_demand = demand
        self.share_computations += 1
        return state

    def _shares_stale(self, demand: Mapping[str, Amounts]) -> bool:
        if self._now - self._shares_at >= SHARE_REFRESH_S:
            return True
        for q, wants in demand.items():
            before = self._shares_demand[q]
            if any(wants.values()) != any(before.values()):
                return True
            for r, total in self._capacity.items():
                if total > 0 and abs(wants.get(r, 0) - before.get(r, 0)) > SHARE_DEMAND_STEP * total:
                    return True
        return False

    def _order_charge(self, leaf: str, amounts: Mapping[str, int], sign: int) -> None:
        """Keep the queue order current with an admission (sign 1) or a release (sign -1)."""
        if self._order_state is not None:
            self._order_state.charge(leaf, {k: sign * v for k, v in amounts.items()})

    def _kueue_order(self, live: Sequence[str], cursors: dict[str, int]) -> list[str]:
        """Kueue's order of ClusterQueue heads: not borrowing first, then priority, then arrival."""

        def key(q: str) -> tuple[bool, int, float, int]:
            p = self._lists[q][cursors[q]]
            borrowing = not self.book.within_guarantee(q, p.demand)
            return (borrowing, -p.job.priority, p.job.arrival, p.seq)

        return sorted(live, key=key)
