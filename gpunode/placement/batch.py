"""The same placement decisions as policies.py, for many nodes at once with numpy.

The simulator places thousands of pods on a thousand-node cluster per run; asking
the per-node functions for every node and pod is too slow for that. ClusterArrays
keeps the cluster as arrays (free CPU, memory and per-GPU free share, plus the
per-node fragmentation terms of the target workload) and scores all nodes of one
request in a few array operations. Scores are cached per request shape and node
and recomputed only for nodes that changed since.

It covers the nodes the simulator builds: healthy GPUs in `fractional` mode, one
model per node, no GPU memory size (requests by compute share or whole GPUs), no
topology. For those, every decision equals the per-node functions' decision
(tests/test_placement_batch.py checks it on random states); anything else is
refused with InvalidState. Randomness only through the numpy Generator passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpunode.placement.fit import model_matches
from gpunode.placement.frag import TargetWorkload
from gpunode.placement.model import MILLI_PER_GPU, GpuState, InvalidRequest, InvalidState, NodeState, Request
from gpunode.placement.ours import FRACTION_FIT_WEIGHT, SCARCITY_WEIGHT, TIE_SCALE
from gpunode.placement.policies import MAX_SCORE, MAX_SPEC_CPU_MILLI, MAX_SPEC_GPU_MILLI

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
MAX_GPUS = 8
BATCH_POLICIES = ("fgd", "bestfit", "packing", "spread", "random", "dotprod", "gpunode")


@dataclass(frozen=True)
class BatchChoice:
    """The node (index), the GPU slots (indices into the node's GPUs) and the score."""

    node: int
    gpus: tuple[int, ...]
    score: float


class _ScoreCache:
    __slots__ = ("feasible", "gpu", "score", "stamp")

    def __init__(self, n: int) -> None:
        self.stamp = np.full(n, -1, dtype=np.int64)
        self.feasible = np.zeros(n, dtype=bool)
        self.score = np.zeros(n, dtype=np.float64)
        self.gpu = np.zeros(n, dtype=np.int64)


class ClusterArrays:
    """A cluster as arrays, with vectorised fit, score and apply for one request at a time."""

    def __init__(self, nodes: Sequence[NodeState], *, workload: TargetWorkload | None = None) -> None:
        if not nodes:
            raise InvalidState("a cluster needs at least one node")
        self.names = tuple(n.name for n in nodes)
        self.uuids = tuple(tuple(g.uuid for g in n.gpus) for n in nodes)
        self._templates = tuple(n.gpus for n in nodes)
        self._labels = tuple(n.labels for n in nodes)
        n = len(nodes)
        self.cpu = np.array([x.cpu_milli_free for x in nodes], dtype=np.int64)
        self.mem = np.array([x.memory_free_bytes for x in nodes], dtype=np.int64)
        self.share = np.zeros((n, MAX_GPUS), dtype=np.int64)
        self.gpu_count = np.zeros(n, dtype=np.int64)
        models: list[str] = []
        for i, node in enumerate(nodes):
            if len(node.gpus) > MAX_GPUS:
                raise InvalidState(f"node {node.name}: at most {MAX_GPUS} GPUs per node in batch form")
            for j, g in enumerate(node.gpus):
                self._check_gpu(node, g)
                self.share[i, j] = g.milli_free
            self.gpu_count[i] = len(node.gpus)
            node_models = {g.model for g in node.gpus}
            if len(node_models) > 1:
                raise InvalidState(f"node {node.name}: batch form needs one GPU model per node")
            models.append(node_models.pop() if node_models else "")
        self.models = tuple(models)
        self._model_names = tuple(dict.fromkeys(models))
        self._model_of = np.array([self._model_names.index(m) for m in models], dtype=np.int64)
        self.version = np.zeros(n, dtype=np.int64)
        self._caches: dict[tuple[Request, str], _ScoreCache] = {}
        self._model_ok: dict[frozenset[str] | None, BoolArray] = {}
        self.workload = workload
        if workload is not None:
            self._init_frag(workload)

    @staticmethod
    def _check_gpu(node: NodeState, g: GpuState) -> None:
        if g.sharing != "fractional" or not g.healthy or g.memory_total_bytes or g.nvlink_peers:
            raise InvalidState(
                f"node {node.name} GPU {g.uuid}: batch form covers healthy fractional GPUs "
                "without memory size or NVLink only"
            )

    # ----- fragmentation terms -------------------------------------------------------------

    def _init_frag(self, workload: TargetWorkload) -> None:
        pods = workload.pods
        self._t_milli = np.array([p.gpu_milli for p in pods], dtype=np.int64)
        self._t_gpus = np.array([p.gpus for p in pods], dtype=np.int64)
        self._t_cpu = np.array([p.cpu_milli for p in pods], dtype=np.int64)
        self._t_weight = np.array([p.weight for p in pods], dtype=np.int64)
        self._t_access = np.array(
            [[p.gpus > 0 and model_matches(m, p.gpu_models) for p in pods] for m in self._model_names],
            dtype=bool,
        )
        self._thresholds = np.array(workload.fgd_thresholds, dtype=np.float64)
        self._pressure = np.array([workload.model_pressure.get(m, 0.0) for m in self._model_names])
        self._t_total = int(self._t_weight.sum())
        self._t_whole = self._t_milli >= MILLI_PER_GPU
        self._t_milli_safe = np.maximum(self._t_milli, 1)
        self._t_gpus_safe = np.maximum(self._t_gpus, 1)
        self._t_cpu_safe = np.maximum(self._t_cpu, 1)
        self._t_per_copy = self._t_milli * self._t_gpus
        everyone = np.arange(len(self.names))
        self.frag = self._frag_of(self.share, self.cpu, everyone)
        self.fill = self._fill_of(self.share, self.cpu, everyone)

    def _frag_of(self, share: IntArray, cpu: IntArray, nodes: IntArray) -> IntArray:
        """Fragmentation (scaled) of node states: share [..., G], cpu [...], nodes [...] (for the model)."""
        ge = share[..., :, None] >= self._t_milli  # [..., G, T]
        cnt = ge.sum(axis=-2)
        sum_ge = (share[..., :, None] * ge).sum(axis=-2)
        total = share.sum(axis=-1)
        sat = self._t_access[self._model_of[nodes]] & (cnt >= self._t_gpus) & (cpu[..., None] >= self._t_cpu)
        return total * self._t_total - (sat * sum_ge * self._t_weight).sum(axis=-1)

    # ----- fit --------------------------------------------------------------------------------

    def _model_mask(self, models: frozenset[str] | None) -> BoolArray:
        if models not in self._model_ok:
            ok = np.array([model_matches(m, models) and m != "" for m in self.models], dtype=bool)
            self._model_ok[models] = ok if models is not None else np.ones(len(self.models), dtype=bool)
        return self._model_ok[models]

    def _check_request(self, request: Request) -> None:
        if request.kind == "mig" or request.gpu_memory_bytes:
            raise InvalidRequest("batch form places whole-GPU, compute-share and CPU requests only")

    def feasible_in(self, request: Request, idx: IntArray) -> BoolArray:
        """Which of the nodes `idx` the request fits."""
        ok = (self.cpu[idx] >= request.cpu_milli) & (self.mem[idx] >= request.memory_bytes)
        kind = request.kind
        if kind == "cpu":
            return ok
        ok &= self._model_mask(request.gpu_models)[idx]
        if kind == "fraction":
            return ok & (self.share[idx] >= request.gpu_milli).any(axis=1)
        return ok & ((self.share[idx] == MILLI_PER_GPU).sum(axis=1) >= request.gpus)

    # ----- scores -----------------------------------------------------------------------------

    def _gpu_total(self, idx: IntArray) -> IntArray:
        return self.share[idx].sum(axis=1)

    def _request_milli(self, request: Request) -> int:
        return request.gpus * MILLI_PER_GPU if request.kind == "whole" else request.gpu_milli

    def _tightest(self, request: Request, idx: IntArray) -> IntArray:
        share = self.share[idx]
        masked = np.where(share >= request.gpu_milli, share, MILLI_PER_GPU + 1)
        return masked.argmin(axis=1)

    def _emptiest(self, request: Request, idx: IntArray) -> IntArray:
        share = self.share[idx]
        masked = np.where(share >= request.gpu_milli, share, -1)
        return masked.argmax(axis=1)

    def _leftover(self, request: Request, idx: IntArray) -> npt.NDArray[np.float64]:
        cpu_left = (self.cpu[idx] - request.cpu_milli).astype(np.float64)
        gpu_left = (self._gpu_total(idx) - self._request_milli(request)).astype(np.float64)
        return cpu_left / MAX_SPEC_CPU_MILLI * 0.5 + gpu_left / MAX_SPEC_GPU_MILLI * 0.5

    @staticmethod
    def _clamp(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return np.clip(np.trunc(values), 0, MAX_SCORE)

    def _score_bestfit(self, request: Request, idx: IntArray) -> tuple[npt.NDArray[np.float64], IntArray]:
        return self._clamp((1.0 - self._leftover(request, idx)) * MAX_SCORE), self._tightest(request, idx)

    def _score_spread(self, request: Request, idx: IntArray) -> tuple[npt.NDArray[np.float64], IntArray]:
        return self._clamp(self._leftover(request, idx) * MAX_SCORE), self._emptiest(request, idx)

    def _score_dotprod(self, request: Request, idx: IntArray) -> tuple[npt.NDArray[np.float64], IntArray]:
        free_cpu = self.cpu[idx] / MAX_SPEC_CPU_MILLI
        free_gpu = self._gpu_total(idx) / MAX_SPEC_GPU_MILLI
        dot = free_cpu * (request.cpu_milli / MAX_SPEC_CPU_MILLI) + free_gpu * (
            self._request_milli(request) / MAX_SPEC_GPU_MILLI
        )
        return self._clamp(MAX_SCORE * (1 - dot / 2)), self._tightest(request, idx)

    def _score_random(self, request: Request, idx: IntArray) -> tuple[npt.NDArray[np.float64], IntArray]:
        return np.zeros(len(idx)), np.zeros(len(idx), dtype=np.int64)

    def _score_packing(self, request: Request, idx: IntArray) -> tuple[npt.NDArray[np.float64], IntArray]:
        gpu = self._tightest(request, idx)
        if request.kind == "cpu":
            return np.zeros(len(idx)), gpu
        share = self.share[idx]
        fully = (share == MILLI_PER_GPU).sum(axis=1)
        all_free = fully == self.gpu_count[idx]
        case3 = np.maximum(MAX_SCORE // 3 - fully, fully)
        if request.kind == "whole":
            case2 = np.maximum(MAX_SCORE // 2 - request.gpus, MAX_SCORE // 3)
            score = np.where(all_free, case3, case2)
        else:
            chosen = share[np.arange(len(idx)), gpu]
            case2 = np.full(len(idx), max(MAX_SCORE // 2 - 1, MAX_SCORE // 3))
            case1 = np.maximum(MAX_SCORE - (chosen * 100 // MILLI_PER_GPU) // 10, MAX_SCORE // 2)
            score = np.where(all_free, case3, np.where(chosen == MILLI_PER_GPU, case2, case1))
        return score.astype(np.float64), gpu

    def _after(self, request: Request, idx: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """Node states after placing the request: share [K, C, G], cpu [K, C], node [K, C].

        C is one candidate per GPU slot for a fraction (slots that do not fit hold
        meaningless values, masked by the caller), else one candidate.
        """
        share = self.share[idx]
        cpu = self.cpu[idx] - request.cpu_milli
        kind = request.kind
        if kind == "fraction":
            after = share[:, None, :] - request.gpu_milli * np.eye(MAX_GPUS, dtype=np.int64)[None, :, :]
            cpus = np.repeat(cpu[:, None], MAX_GPUS, axis=1)
            return np.maximum(after, 0), cpus, np.repeat(idx[:, None], MAX_GPUS, axis=1)
        if kind == "whole":
            after = share.copy()
            rows = np.arange(len(idx))
            for _ in range(request.gpus):
                after[rows, (after == MILLI_PER_GPU).argmax(axis=1)] = 0
            share = after
        return share[:, None, :], cpu[:, None], idx[:, None]

    def _fill_of(self, share: IntArray, cpu: IntArray, nodes: IntArray) -> IntArray:
        """Fill-based fragmentation (scaled) of node states, as placement.ours.fill_fragmentation."""
        total = share.sum(axis=-1)
        per_gpu = (share[..., :, None] // self._t_milli_safe).sum(axis=-2)
        full = (share >= MILLI_PER_GPU).sum(axis=-1)[..., None] // self._t_gpus_safe
        copies = np.where(self._t_whole, full, per_gpu)
        by_cpu = np.maximum(cpu, 0)[..., None] // self._t_cpu_safe
        copies = np.where(self._t_cpu > 0, np.minimum(copies, by_cpu), copies)
        copies = copies * self._t_access[self._model_of[nodes]]
        used = np.minimum(copies * self._t_per_copy, total[..., None])
        return total * self._t_total - (used * self._t_weight).sum(axis=-1)

    def _need_workload(self, policy: str) -> None:
        if self.workload is None:
            raise InvalidRequest(f"the {policy} policy needs a target workload")

    def _score_fgd(self, request: Request, idx: IntArray) -> tuple[npt.NDArray[np.float64], IntArray]:
        self._need_workload("fgd")
        after = self._frag_of(*self._after(request, idx))
        scores = np.searchsorted(self._thresholds, self.frag[idx][:, None] - after, side="right")
        if request.kind == "fraction":
            scores = np.where(self.share[idx] >= request.gpu_milli, scores, -1)
            gpu = scores.argmax(axis=1)
            return scores[np.arange(len(idx)), gpu].astype(np.float64), gpu
        return scores[:, 0].astype(np.float64), np.zeros(len(idx), dtype=np.int64)

    def _score_gpunode(self, request: Request, idx: IntArray) -> tuple[npt.NDArray[np.float64], IntArray]:
        self._need_workload("gpunode")
        share, cpu, nodes = self._after(request, idx)
        first = np.searchsorted(
            self._thresholds, self.frag[idx][:, None] - self._frag_of(share, cpu, nodes), side="right"
        )
        second = (self.fill[idx][:, None] - self._fill_of(share, cpu, nodes)) / self._t_total
        pressure = self._pressure[self._model_of[idx]]
        if request.kind == "fraction":
            left = self.share[idx] - request.gpu_milli
            scarcity = pressure[:, None] * request.gpu_milli
            score = first * TIE_SCALE + ((second - FRACTION_FIT_WEIGHT * left) - SCARCITY_WEIGHT * scarcity)
            score = np.where(left >= 0, score, -np.inf)
            gpu = score.argmax(axis=1)
            return score[np.arange(len(idx)), gpu], gpu
        scarcity = pressure * request.gpus * MILLI_PER_GPU
        score = first[:, 0] * TIE_SCALE + (
            (second[:, 0] - FRACTION_FIT_WEIGHT * 0) - SCARCITY_WEIGHT * scarcity
        )
        return score, np.zeros(len(idx), dtype=np.int64)

    # ----- choose and apply ---------------------------------------------------------------------

    def scores(self, request: Request, policy: str) -> tuple[BoolArray, npt.NDArray[np.float64], IntArray]:
        """(feasible, score, chosen GPU slot for fractions) for every node, from the cache where valid."""
        if policy not in BATCH_POLICIES:
            raise InvalidRequest(f"unknown policy {policy!r}; known: {', '.join(BATCH_POLICIES)}")
        self._check_request(request)
        cache = self._caches.get((request, policy))
        if cache is None:
            cache = self._caches[(request, policy)] = _ScoreCache(len(self.names))
        stale = np.flatnonzero(cache.stamp != self.version)
        if len(stale):
            ok = self.feasible_in(request, stale)
            cache.feasible[stale] = ok
            todo = stale[ok]
            if len(todo):
                score, gpu = getattr(self, f"_score_{policy}")(request, todo)
                cache.score[todo] = score
                cache.gpu[todo] = gpu
            cache.stamp[stale] = self.version[stale]
        return cache.feasible, cache.score, cache.gpu

    def choose(
        self,
        request: Request,
        policy: str,
        *,
        rng: np.random.Generator,
        priority: IntArray | None = None,
    ) -> BatchChoice | None:
        """The node with the best score and its GPUs; None if no node fits.

        Among equal best scores the node with the lowest `priority` wins when one is
        given (a fixed order of the nodes, as the FGD simulator's scheduler has), else
        a uniformly random one. The random policy always picks a uniformly random
        fitting node.
        """
        feasible, score, gpu = self.scores(request, policy)
        candidates = np.flatnonzero(feasible)
        if not len(candidates):
            return None
        if policy == "random":
            node = int(candidates[rng.integers(len(candidates))])
        else:
            best = score[candidates]
            top = candidates[best == best.max()]
            if len(top) == 1:
                node = int(top[0])
            elif priority is not None:
                node = int(top[priority[top].argmin()])
            else:
                node = int(top[rng.integers(len(top))])
        kind = request.kind
        if kind == "fraction":
            if policy == "random":
                fitting = np.flatnonzero(self.share[node] >= request.gpu_milli)
                slots: tuple[int, ...] = (int(fitting[rng.integers(len(fitting))]),)
            else:
                slots = (int(gpu[node]),)
        elif kind == "whole":
            slots = tuple(int(s) for s in np.flatnonzero(self.share[node] == MILLI_PER_GPU)[: request.gpus])
        else:
            slots = ()
        return BatchChoice(node=node, gpus=slots, score=float(score[node]))

    def apply(self, request: Request, node: int, slots: Sequence[int]) -> None:
        """Account the request on the node (the GPU slots as chosen)."""
        take = MILLI_PER_GPU if request.kind == "whole" else request.gpu_milli
        for s in slots:
            if self.share[node, s] < take:
                raise InvalidState(f"node {self.names[node]} GPU slot {s} has not {take} milli-GPU free")
        self.cpu[node] -= request.cpu_milli
        self.mem[node] -= request.memory_bytes
        for s in slots:
            self.share[node, s] -= take
        self.version[node] += 1
        if self.workload is not None:
            self.frag[node] = self._frag_of(self.share[node], self.cpu[node], np.array(node))
            self.fill[node] = self._fill_of(self.share[node], self.cpu[node], np.array(node))

    def node_state(self, i: int) -> NodeState:
        """Node i as a NodeState, for the per-node functions."""
        from dataclasses import replace

        gpus = tuple(replace(g, milli_free=int(self.share[i, j])) for j, g in enumerate(self._templates[i]))
        return NodeState(
            name=self.names[i],
            gpus=gpus,
            cpu_milli_free=int(self.cpu[i]),
            memory_free_bytes=int(self.mem[i]),
            labels=self._labels[i],
        )

    def allocated_gpu_milli(self) -> int:
        return int((self.gpu_count * MILLI_PER_GPU).sum() - self.share.sum())
