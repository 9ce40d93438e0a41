"""The target workload the fgd and gpunode policies score against: learned from the pods seen
(the most frequent request shapes), or fixed from a trace. Thread safe; no I/O."""

from __future__ import annotations

import threading
from collections import Counter, deque

from gpunode.contract.names import GIB
from gpunode.placement import MILLI_PER_GPU, Request, TargetPod, TargetWorkload
from gpunode.placement.frag import shapes_with_counts


class WorkloadTracker:
    """The target workload: a fixed one (from a trace), or learned from the pods seen.

    Learning keeps the request shapes of the last `window` pods and, every
    REFRESH_EVERY pods, takes the most frequent shapes covering `popularity` of
    them, weighted in per-mille of the window. The version (part of every cached
    score's key) only moves when that result changes, so a steady workload does
    not invalidate the extender's caches.
    """

    REFRESH_EVERY = 500

    def __init__(
        self,
        *,
        window: int = 10_000,
        popularity: float = 0.95,
        seed: TargetWorkload | None = None,
        learn: bool | None = None,
        memory_reference_bytes: int = 80 * GIB,
    ) -> None:
        self._lock = threading.Lock()
        self._recent: deque[tuple[int, int, int, frozenset[str] | None]] = deque(maxlen=window)
        self._popularity = popularity
        self._cached: TargetWorkload | None = seed
        self._demand: tuple[TargetPod, ...] | None = None
        self._learn = seed is None if learn is None else learn
        self._unseen = 0
        self.memory_reference_bytes = memory_reference_bytes
        self.version = 0

    def shape(self, request: Request) -> tuple[int, int, int, frozenset[str] | None] | None:
        """(CPU, milli-GPU per GPU, GPUs, models); a request by memory counts as its share of the reference GPU."""
        kind = request.kind
        if kind == "whole":
            return (request.cpu_milli, MILLI_PER_GPU, request.gpus, request.gpu_models)
        if kind == "fraction":
            by_memory = -(-request.gpu_memory_bytes * MILLI_PER_GPU // max(self.memory_reference_bytes, 1))
            share = min(MILLI_PER_GPU - 1, max(request.gpu_milli, by_memory, 1))
            return (request.cpu_milli, share, 1, request.gpu_models)
        if kind == "cpu":
            return (request.cpu_milli, 0, 0, None)
        return None

    def observe(self, request: Request) -> None:
        """Count one pod's request shape (when learning)."""
        shape = self.shape(request)
        if shape is None or not self._learn:
            return
        with self._lock:
            self._recent.append(shape)
            self._unseen += 1

    def _learned(self) -> TargetWorkload | None:
        counts = Counter(self._recent)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][:3]))
        chosen, covered, total = [], 0, len(self._recent)
        for (cpu, milli, gpus, models), n in ranked:
            if covered >= self._popularity * total:
                break
            weight = max(1, round(1000 * n / total))
            chosen.append(
                TargetPod(cpu_milli=cpu, gpu_milli=milli, gpus=gpus, gpu_models=models, weight=weight)
            )
            covered += n
        return TargetWorkload(tuple(chosen)) if chosen else None

    def _learned_demand(self) -> tuple[TargetPod, ...]:
        """Every shape of the window with its count (node pressure spreads this demand)."""
        return shapes_with_counts(Counter(self._recent))

    def workload(self) -> TargetWorkload | None:
        """The workload to score against; None when nothing was seen and none was given."""
        with self._lock:
            if self._learn and self._unseen and (self._cached is None or self._unseen >= self.REFRESH_EVERY):
                learned = self._learned()
                demand = self._learned_demand() or None
                self._unseen = 0
                if learned is not None and (learned, demand) != (self._cached, self._demand):
                    self._cached, self._demand = learned, demand
                    self.version += 1
            return self._cached

    def demand(self) -> tuple[TargetPod, ...] | None:
        """All the shapes seen with their counts; None (use the typical pods) when not learning."""
        with self._lock:
            return self._demand
