"""Usage memory and fair shares: who is entitled to what, and which queue gets the next admission.

API:
    UsageLedger(half_life_s, window_s) (or UsageLedger.from_settings(config.fair_share))
        .charge(queue, amounts, t0, t1)       amounts held over [t0, t1) (charge only the past)
        .usage(now, config=None)              decayed resource-seconds per leaf (and per inner queue
                                              when config is given): {queue: {resource: float}}
        .seed(queue, amounts, at)             add usage another process saved (usage() figures at `at`)
    fair_shares(config, capacity, demand, usage, *, k=None) -> {queue: Amounts}   every queue, inner too
    dominant_share(amounts, capacity) -> float    max over resources of amount / capacity
    over_quota_weights(weights, usages, k) -> list[float]   the renormalised P of one group of siblings
    roll_up(config, per_leaf) -> per leaf and inner queue (sums up the tree)
    QueueOrder(config, shares, allocated)     the admission order, kept up to date cheaply:
        .set_allocation(leaf, amounts) / .charge(leaf, delta)   after an admission or a release
        .order(among=None) -> list[str]       leaves, the one to serve first first
    queue_order(config, allocated, shares, among=None) -> list[str]   the same in one call

Fair shares are divided down the tree, level by level, among the children of each queue
(the roots share the capacity). A queue never receives more than it can use: its capped
demand is min(demand, guarantee + borrowLimit), summed up the tree. At each level:

1. Guarantees: each queue receives min(guarantee, capped demand) per resource. If the
   pool is smaller than the sum (a cluster smaller than its promises), the pool is split in
   proportion to those amounts.
2. Over-quota: the rest of the pool goes to the queues that still want more, water-filling
   (a queue that reaches its capped demand drops out and its part is shared again), in
   proportion to P = max(W' + k (W' - U'), 0) / sum(P), where, over the siblings that want
   more: W' = weight / sum of weights; U' = u / sum of u, u being the queue's decayed usage
   as a dominant share (max over resources of resource-seconds / capacity). When none of them
   has usage, U' = W' (no memory, P = W'). Since W' and U' each sum to 1, the P before
   clipping sum to 1, so at least one is positive; clipping only removes negative parts.
   k = 0 divides by weight alone. A queue clipped to P = 0 receives capacity above its
   guarantee only once every sibling with a positive P has all it asked for; then what is
   left goes to the clipped ones by W' (capacity is never held back because of past usage).

Usage relative to the siblings' usage (rather than to the cluster's capacity over the window)
needs no capacity history, behaves the same at every level of the tree, and has the
fixed point the issue asks for: P = W' exactly when usage is split as the weights are.
Resources are divided independently (each GPU model key too); dominant-resource fairness
enters through the usage (dominant share) and the admission order (dominant ratio).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence

from gpunode.cluster.queueing.config import FairShareSettings, QueueConfig
from gpunode.cluster.queueing.model import Amounts

BUCKETS = 64  # the window is kept as this many buckets: usage is forgotten bucket by bucket
_REBASE = 300.0  # rebase stored values when they reach e**300 (far below float overflow)
_EPS = 1e-9


def dominant_share(amounts: Mapping[str, float], capacity: Mapping[str, float]) -> float:
    """max over resources of amount / capacity (resources without capacity are ignored); 0 when empty."""
    best = 0.0
    for resource, amount in amounts.items():
        cap = capacity.get(resource, 0)
        if cap > 0 and amount / cap > best:
            best = amount / cap
    return best


def roll_up(config: QueueConfig, per_leaf: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Leaves' amounts and every inner queue's sum of its leaves' (entries for inner queues are ignored)."""
    out: dict[str, dict[str, float]] = {}
    for queue_name in config.queues:
        out[queue_name] = {}
    for leaf in config.leaves:
        amounts = per_leaf.get(leaf)
        if not amounts:
            continue
        for queue in (leaf, *config.ancestors(leaf)):
            bucket = out[queue]
            for resource, value in amounts.items():
                bucket[resource] = bucket.get(resource, 0) + value
    return out


class UsageLedger:
    """Decayed usage per queue: resource-seconds weighted by 2**(-age / half_life), within the window.

    Values are kept relative to a reference time, so advancing time costs nothing and usage()
    is one multiplication per queue and resource. The window is kept as BUCKETS buckets: a
    bucket is forgotten once all of it is older than the window (its last bucket is counted
    whole, an error of at most window / BUCKETS of usage, itself decayed by the whole window).
    Charges may come out of order (a job charged when it ends), as long as usage() is never
    asked for a time before the end of a charge.
    """

    def __init__(self, half_life_s: float, window_s: float) -> None:
        if not (half_life_s > 0 and window_s > 0 and math.isfinite(half_life_s) and math.isfinite(window_s)):
            raise ValueError(f"half-life and window must be positive, got {half_life_s}, {window_s}")
        self.half_life_s = half_life_s
        self.window_s = window_s
        self._rate = math.log(2) / half_life_s
        self._width = window_s / BUCKETS
        self._ref: float | None = None
        self._buckets: dict[int, dict[str, dict[str, float]]] = {}
        self._heap: list[int] = []
        self._totals: dict[str, dict[str, float]] = {}
        self._horizon = -math.inf  # buckets below this index are gone for good
        self._latest = -math.inf  # the end of the latest charge

    @classmethod
    def from_settings(cls, settings: FairShareSettings) -> UsageLedger:
        """A ledger with the configured half-life and window."""
        return cls(settings.half_life_s, settings.window_s)

    def charge(self, queue: str, amounts: Mapping[str, int], t0: float, t1: float) -> None:
        """Record that `queue` held `amounts` over [t0, t1)."""
        if not (math.isfinite(t0) and math.isfinite(t1)) or t1 < t0:
            raise ValueError(f"charge over [{t0}, {t1}): expected finite t0 <= t1")
        self._latest = max(self._latest, t1)
        t0 = max(t0, t1 - self.window_s - self._width)  # older parts never count at a time >= t1
        if t1 <= t0 or not any(amounts.values()):
            return
        if self._ref is None:
            self._ref = t0
        if self._rate * (t1 - self._ref) > _REBASE:
            self._rebase(t1)
        ref = self._ref
        index = math.floor(t0 / self._width)
        start = t0
        while start < t1:
            end = min(t1, (index + 1) * self._width)
            if end > start and index >= self._horizon:
                # the integral of 2**((t - ref) / half_life) over [start, end)
                weight = (
                    math.exp(self._rate * (start - ref)) * math.expm1(self._rate * (end - start)) / self._rate
                )
                self._add(index, queue, amounts, weight)
            start = end
            index += 1

    def _add(self, index: int, queue: str, amounts: Mapping[str, float], weight: float) -> None:
        """Add `amounts` x `weight` to `queue` in bucket `index` and in its totals."""
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = self._buckets[index] = {}
            heapq.heappush(self._heap, index)
        held = bucket.setdefault(queue, {})
        total = self._totals.setdefault(queue, {})
        for resource, amount in amounts.items():
            if amount:
                held[resource] = held.get(resource, 0.0) + amount * weight
                total[resource] = total.get(resource, 0.0) + amount * weight

    def seed(self, queue: str, amounts: Mapping[str, float], at: float) -> None:
        """Add usage already decayed to `at` (from usage(at), saved by another process) as charged at `at`.

        It is kept in the bucket of `at`, so it is forgotten whole once `at` is older than the
        window: by then it is decayed by the whole window, the bound of the bucketing error above.
        """
        if not math.isfinite(at) or not all(math.isfinite(v) and v >= 0 for v in amounts.values()):
            raise ValueError(f"seed of {queue} at {at}: expected finite, non-negative figures")
        index = math.floor(at / self._width)
        if index < self._horizon or not any(amounts.values()):
            return
        self._latest = max(self._latest, at)
        if self._ref is None:
            self._ref = at
        if self._rate * (at - self._ref) > _REBASE:
            self._rebase(at)
        self._add(index, queue, amounts, math.exp(self._rate * (at - self._ref)))

    def usage(self, now: float, config: QueueConfig | None = None) -> dict[str, dict[str, float]]:
        """Decayed resource-seconds per charged queue at `now`; with config, per leaf and inner queue."""
        if now < self._latest - 1e-6:
            raise ValueError(f"usage({now}) asked before the end of a charge ({self._latest})")
        self._forget(now)
        if self._ref is None:
            per: dict[str, dict[str, float]] = {}
        else:
            scale = math.exp(-self._rate * (now - self._ref))
            per = {q: {r: max(0.0, v) * scale for r, v in t.items()} for q, t in self._totals.items()}
        return roll_up(config, per) if config is not None else per

    def _forget(self, now: float) -> None:
        """Drop the buckets that lie wholly before now - window, and recompute the totals if any went."""
        first_kept = math.floor((now - self.window_s) / self._width)
        self._horizon = max(self._horizon, first_kept)
        dropped = False
        while self._heap and self._heap[0] < first_kept:
            del self._buckets[heapq.heappop(self._heap)]
            dropped = True
        if dropped:  # summing afresh avoids drift from subtracting floats
            totals: dict[str, dict[str, float]] = {}
            for index in sorted(self._buckets):
                for queue, held in self._buckets[index].items():
                    total = totals.setdefault(queue, {})
                    for resource, value in held.items():
                        total[resource] = total.get(resource, 0.0) + value
            self._totals = totals

    def _rebase(self, new_ref: float) -> None:
        assert self._ref is not None
        scale = math.exp(-self._rate * (new_ref - self._ref))
        for bucket in self._buckets.values():
            for held in bucket.values():
                for resource in held:
                    held[resource] *= scale
        for total in self._totals.values():
            for resource in total:
                total[resource] *= scale
        self._ref = new_ref


def over_quota_weights(weights: Sequence[float], usages: Sequence[float], k: float) -> list[float]:
    """The renormalised over-quota shares P of one group of siblings (see the module docstring)."""
    w_sum = sum(weights)
    u_sum = sum(usages)
    w_norm = [w / w_sum for w in weights]
    u_norm = [u / u_sum for u in usages] if u_sum > 0 else w_norm
    p = [max(w + k * (w - u), 0.0) for w, u in zip(w_norm, u_norm, strict=True)]
    p_sum = sum(p)
    return [x / p_sum for x in p] if p_sum > 0 else w_norm


def fair_shares(
    config: QueueConfig,
    capacity: Mapping[str, int],
    demand: Mapping[str, Mapping[str, int]],
    usage: Mapping[str, Mapping[str, float]],
    *,
    k: float | None = None,
) -> dict[str, Amounts]:
    """Each queue's fair share (inner queues too), per resource of `capacity`, in model.Amounts units.

    demand: per leaf, what it holds plus what it waits for. usage: decayed resource-seconds per
    leaf (UsageLedger.usage; inner entries are ignored). k: the usage factor (default: the
    configured fairShare.k). Amounts are rounded down.
    """
    factor = config.fair_share.k if k is None else k
    resources = [r for r, v in capacity.items() if v > 0]
    capped = _capped_demand(config, demand, resources)
    used = roll_up(config, usage)
    dominant = {q: dominant_share(used[q], capacity) for q in config.queues}
    shares: dict[str, dict[str, float]] = {}
    pool: dict[str, float] = {r: float(capacity[r]) for r in resources}
    levels: list[tuple[dict[str, float], tuple[str, ...]]] = [(pool, config.root_names)]
    while levels:
        pool, group = levels.pop()
        for name, share in _divide(config, pool, group, capped, dominant, factor, resources).items():
            shares[name] = share
            children = config.queues[name].children
            if children:
                levels.append((share, children))
    return {q: {r: int(shares[q].get(r, 0.0) + _EPS) for r in capacity} for q in config.queues}


def _capped_demand(
    config: QueueConfig, demand: Mapping[str, Mapping[str, int]], resources: Sequence[str]
) -> dict[str, dict[str, float]]:
    """min(demand, guarantee + borrowLimit) per queue, bottom up (a parent wants what its children can use)."""
    capped: dict[str, dict[str, float]] = {}
    for name in reversed(list(config.queues)):  # declaration order has parents first
        spec = config.queues[name]
        if spec.leaf:
            want = {r: float(max(0, demand.get(name, {}).get(r, 0))) for r in resources}
        else:
            want = {r: sum(capped[c][r] for c in spec.children) for r in resources}
        limit = config.limit(name)
        if limit:
            for r in resources:
                if r in limit:
                    want[r] = min(want[r], float(limit[r]))
        capped[name] = want
    return capped


def _divide(
    config: QueueConfig,
    pool: Mapping[str, float],
    group: Sequence[str],
    capped: Mapping[str, Mapping[str, float]],
    dominant: Mapping[str, float],
    k: float,
    resources: Sequence[str],
) -> dict[str, dict[str, float]]:
    """Split one queue's share (or the capacity) among its children: guarantees, then P by water-filling."""
    share: dict[str, dict[str, float]] = {n: {} for n in group}
    for r in resources:
        wanted = [min(float(config.queues[n].guarantee.get(r, 0)), capped[n][r]) for n in group]
        total = sum(wanted)
        scale = 1.0 if total <= pool[r] else pool[r] / total
        for n, amount in zip(group, wanted, strict=True):
            share[n][r] = amount * scale
    wanting = [n for n in group if any(capped[n][r] - share[n][r] > _EPS for r in resources)]
    if not wanting:
        return share
    weights = [config.queues[n].weight for n in wanting]
    p = dict(zip(wanting, over_quota_weights(weights, [dominant[n] for n in wanting], k), strict=True))
    w_sum = sum(weights)
    w_norm = {n: config.queues[n].weight / w_sum for n in wanting}
    for r in resources:
        left = pool[r] - sum(share[n][r] for n in group)
        active = [n for n in wanting if capped[n][r] - share[n][r] > _EPS]
        while active and left > _EPS:
            shares_of = p if sum(p[n] for n in active) > 0 else w_norm
            mass = sum(shares_of[n] for n in active)
            full = [n for n in active if capped[n][r] - share[n][r] <= left * shares_of[n] / mass]
            if not full:
                for n in active:
                    share[n][r] += left * shares_of[n] / mass
                break
            for n in full:
                left -= capped[n][r] - share[n][r]
                share[n][r] = capped[n][r]
            active = [n for n in active if n not in full]
    return share


def _ratio(held: Mapping[str, float], limits: Iterable[tuple[str, float]]) -> float:
    """max over the given resources of held / limit (limit > 0)."""
    best = 0.0
    for resource, limit in limits:
        value = held.get(resource, 0) / limit
        if value > best:
            best = value
    return best


class QueueOrder:
    """The order in which leaves get the next admission, cheap to keep current as allocations change.

    A queue's key: below its guarantee (some guaranteed resource held below it, by the dominant
    ratio allocated / guarantee) comes first, most starved first; then the lowest dominant ratio
    allocated / fair share (a resource held without any share counts as infinite); ties by name.
    Leaves are ordered by their root's key, then their parent's, ... then their own, so the tree's
    fairness applies at every level. set_allocation/charge recompute the keys of one leaf and its
    ancestors only; order() re-sorts the leaves (a few hundred at most) by cached keys.
    """

    def __init__(
        self, config: QueueConfig, shares: Mapping[str, Mapping[str, int]], allocated: Mapping[str, Amounts]
    ) -> None:
        self._config = config
        self._chain = {leaf: (*reversed(config.ancestors(leaf)), leaf) for leaf in config.leaves}
        self._same_root: dict[str, list[str]] = {root: [] for root in config.root_names}
        for leaf, chain in self._chain.items():
            self._same_root[chain[0]].append(leaf)
        self._guarantee = {
            q: [(r, float(v)) for r, v in sorted(s.guarantee.items()) if v > 0]
            for q, s in config.queues.items()
        }
        self._share = {
            q: [(r, float(v)) for r, v in sorted(shares.get(q, {}).items())] for q in config.queues
        }
        self._held: dict[str, dict[str, float]] = {q: dict(v) for q, v in roll_up(config, allocated).items()}
        self._key = {q: self._key_of(q) for q in config.queues}
        self._leaf_key: dict[str, tuple[tuple[int, float, str], ...]] = {}
        for leaf in config.leaves:
            self._leaf_key[leaf] = tuple(self._key[q] for q in self._chain[leaf])

    def _key_of(self, queue: str) -> tuple[int, float, str]:
        held = self._held[queue]
        guarantee = self._guarantee[queue]
        if guarantee:
            below = _ratio(held, guarantee)
            if below < 1.0 - _EPS:
                return (0, below, queue)
        best = 0.0
        for resource, share in self._share[queue]:
            value = held.get(resource, 0)
            if value <= 0:
                continue
            ratio = value / share if share > 0 else math.inf
            if ratio > best:
                best = ratio
        return (1, best, queue)

    def charge(self, leaf: str, delta: Mapping[str, float]) -> None:
        """Add delta (negative on release) to the leaf's allocation and update the keys it changes."""
        for queue in self._chain[leaf]:
            held = self._held[queue]
            for resource, value in delta.items():
                held[resource] = held.get(resource, 0) + value
        self._rekey(leaf)

    def set_allocation(self, leaf: str, amounts: Mapping[str, int]) -> None:
        """Set the leaf's allocation to `amounts` (its ancestors follow)."""
        old = self._held[leaf]
        delta = {r: amounts.get(r, 0) - old.get(r, 0) for r in {*old, *amounts}}
        self.charge(leaf, delta)

    def _rekey(self, leaf: str) -> None:
        for queue in self._chain[leaf]:
            self._key[queue] = self._key_of(queue)
        for other in self._same_root[self._chain[leaf][0]]:
            self._leaf_key[other] = tuple(self._key[q] for q in self._chain[other])

    def key(self, queue: str) -> tuple[int, float, str]:
        """The queue's own key (below-guarantee flag, ratio, name): lower is served earlier."""
        return self._key[queue]

    def order(self, among: Iterable[str] | None = None) -> list[str]:
        """The leaves (all, or those in `among`: e.g. the ones with pending jobs), first served first."""
        leaves = self._config.leaves if among is None else [q for q in among if q in self._leaf_key]
        return sorted(leaves, key=self._leaf_key.__getitem__)


def queue_order(
    config: QueueConfig,
    allocated: Mapping[str, Amounts],
    shares: Mapping[str, Mapping[str, int]],
    among: Iterable[str] | None = None,
) -> list[str]:
    """The leaves in the order they get the next admission (QueueOrder, in one call)."""
    return QueueOrder(config, shares, allocated).order(among)
