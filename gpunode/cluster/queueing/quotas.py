"""What each queue holds against its guarantee and limit, as the scheduling engine checks it.

A QuotaBook keeps every queue's allocation (a leaf's running jobs; an inner
queue's, the sum over its subtree) and answers the three questions admission
and preemption ask: may this leaf take these amounts (its limits, up the tree),
would that keep it within its guarantee (not borrowing), and may a victim be
taken from a queue without taking it below its guarantee.

The preset chooses which queues count: "hierarchical" (every level), "flat"
(leaves only, as Kueue's ClusterQueues in one cohort) or "none" (no quotas).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.model import GPU, GPU_MEMORY, MODEL_PREFIX, Amounts, Job
from gpunode.contract.names import GIB, MILLI_PER_GPU

QUOTA_MODES = ("hierarchical", "flat", "none")


def job_demand(job: Job, memory_per_gpu: int) -> Amounts:
    """What a job charges to its queue: milli-GPU, GPU memory and, for pods pinned to one model, that model.

    GPU memory is the job's own figure when it gives one, else its pods' memory
    requests plus, for whole GPUs and compute shares, that share of a nominal GPU
    of `memory_per_gpu` bytes (the cluster's mean).
    """
    memory = 0
    models: Amounts = {}
    for pod in job.pods:
        milli = pod.gpus * MILLI_PER_GPU + pod.gpu_milli
        if pod.gpu_memory_bytes:
            memory += max(pod.gpu_memory_bytes, milli * memory_per_gpu // MILLI_PER_GPU)
        else:
            memory += milli * memory_per_gpu // MILLI_PER_GPU
        if pod.gpu_models is not None and len(pod.gpu_models) == 1 and milli:
            key = MODEL_PREFIX + next(iter(pod.gpu_models))
            models[key] = models.get(key, 0) + milli
    out: Amounts = {GPU: job.gpu_milli, GPU_MEMORY: job.gpu_memory_bytes if job.gpu_memory_bytes else memory}
    out.update(models)
    return out


def describe(resource: str, amount: int) -> str:
    """An amount for people: '3 GPUs', '0.5 GPUs of A100', '40 GiB of GPU memory'."""
    if resource == GPU_MEMORY:
        return f"{amount / GIB:g} GiB of GPU memory"
    text = f"{amount / MILLI_PER_GPU:g} GPU{'' if amount == MILLI_PER_GPU else 's'}"
    if resource.startswith(MODEL_PREFIX):
        text += f" of {resource.removeprefix(MODEL_PREFIX)}"
    return text


class QuotaBook:
    """Allocations per queue, checked against guarantees and limits (guarantee + borrowLimit)."""

    def __init__(self, config: QueueConfig, mode: str) -> None:
        if mode not in QUOTA_MODES:
            raise ValueError(f"quota mode must be one of {QUOTA_MODES}, got {mode!r}")
        self.config = config
        self.mode = mode
        self.allocated: dict[str, Amounts] = {name: {} for name in config.queues}
        self._chain: dict[str, tuple[str, ...]] = {}
        for leaf in config.leaves:
            if mode == "hierarchical":
                self._chain[leaf] = (leaf, *config.ancestors(leaf))
            elif mode == "flat":
                self._chain[leaf] = (leaf,)
            else:
                self._chain[leaf] = ()
        self._book_chain = {leaf: (leaf, *config.ancestors(leaf)) for leaf in config.leaves}
        self._limits = {name: config.limit(name) for name in config.queues}

    def chain(self, leaf: str) -> tuple[str, ...]:
        """The queues whose quotas a job of `leaf` counts against (leaf first)."""
        return self._chain[leaf]

    def guarantee(self, queue: str) -> Amounts:
        """The queue's guarantee."""
        return self.config.queues[queue].guarantee

    def charge(self, leaf: str, amounts: Mapping[str, int], sign: int = 1) -> None:
        """Add (sign 1) or remove (sign -1) amounts held by a job of `leaf`, up the tree."""
        for name in self._book_chain[leaf]:
            held = self.allocated[name]
            for k, v in amounts.items():
                held[k] = held.get(k, 0) + sign * v

    def over_limit(self, leaf: str, amounts: Mapping[str, int]) -> tuple[str, str] | None:
        """(queue, resource) whose limit admitting `amounts` to `leaf` would pass; None when it may."""
        for name in self._chain[leaf]:
            limit = self._limits[name]
            if limit is None:
                continue
            held = self.allocated[name]
            for k, v in amounts.items():
                if v and k in limit and held.get(k, 0) + v > limit[k]:
                    return name, k
        return None

    def within_guarantee(self, leaf: str, amounts: Mapping[str, int]) -> bool:
        """After adding `amounts`, is every counted queue of `leaf` within its guarantee (not borrowing)?

        A resource a queue has no guarantee for counts as guaranteed 0 only when
        the queue names it; GPU is always counted. With no quotas, always True.
        """
        for name in self._chain[leaf]:
            guarantee = self.guarantee(name)
            held = self.allocated[name]
            for k, v in amounts.items():
                if not v or (k not in guarantee and k != GPU):
                    continue
                if held.get(k, 0) + v > guarantee.get(k, 0):
                    return False
        return True

    def may_reclaim(self, leaf: str, amounts: Mapping[str, int], victim_leaf: str) -> bool:
        """May a job of `leaf` asking for `amounts` reclaim from jobs of `victim_leaf`?

        Reclaim is decided where the two leaves' chains part: below their lowest
        common queue, every counted queue of `leaf`'s side must stay within its
        guarantee with `amounts` added, and some counted queue of `victim_leaf`'s side
        must hold more GPU than it is guaranteed (it is borrowing). The common queues
        (a parent of both) are not asked: they hold the victims too and get their
        share back. Without a common queue (roots, or flat quotas) that is every
        counted queue of either chain. Never from `leaf` itself.
        """
        mine, theirs = self._chain[leaf], self._chain[victim_leaf]
        if leaf == victim_leaf or not theirs:
            return False
        common = set(mine) & set(theirs)
        for name in mine:
            if name in common:
                break
            guarantee = self.guarantee(name)
            held = self.allocated[name]
            for k, v in amounts.items():
                if v and (k in guarantee or k == GPU) and held.get(k, 0) + v > guarantee.get(k, 0):
                    return False
        return any(
            self.allocated[name].get(GPU, 0) > self.guarantee(name).get(GPU, 0)
            for name in theirs
            if name not in common
        )

    def below_guarantee(self, queue: str) -> bool:
        """The queue holds less GPU than it is guaranteed."""
        return self.allocated[queue].get(GPU, 0) < self.guarantee(queue).get(GPU, 0)

    def may_take(self, preemptor_leaf: str, taken: Iterable[tuple[str, Mapping[str, int]]]) -> bool:
        """May these (leaf, amounts) be taken away without any queue dropping below its guarantee?

        Queues that also hold the preemptor (its own chain) are exempt: the
        preemptor's admission gives back what they lose. With no quotas, always True.
        """
        if self.mode == "none":
            return True
        exempt = set(self._book_chain[preemptor_leaf]) if self.mode == "hierarchical" else {preemptor_leaf}
        loss: dict[str, Amounts] = {}
        for leaf, amounts in taken:
            for name in self._chain[leaf]:
                if name in exempt:
                    continue
                acc = loss.setdefault(name, {})
                for k, v in amounts.items():
                    acc[k] = acc.get(k, 0) + v
        for name, lost in loss.items():
            guarantee = self.guarantee(name)
            held = self.allocated[name]
            for k, v in lost.items():
                if v and (k in guarantee or k == GPU) and held.get(k, 0) - v < guarantee.get(k, 0):
                    return False
        return True

    def above_guarantee(self, leaf: str) -> bool:
        """Some counted queue of the leaf holds more GPU than it is guaranteed (it is borrowing)."""
        return any(
            self.allocated[name].get(GPU, 0) > self.guarantee(name).get(GPU, 0) for name in self._chain[leaf]
        )
