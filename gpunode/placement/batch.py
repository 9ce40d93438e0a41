"""The same placement decisions as policies.py and ours.py, for many nodes at once with numpy.

The simulator places thousands of pods on a thousand-node cluster per run, and
the extender scores thousands of nodes per pod; asking the per-node functions
for every node is too slow for either. ClusterArrays keeps the cluster as arrays
(free CPU and memory; per GPU: allocatable share, free compute and memory, and
which requests it serves) plus, per node and typical pod shape, the aggregates
both fragmentation measures are made of. A candidate placement changes one GPU
(or a few whole ones), so its effect on those aggregates is computed
incrementally, for every node and GPU at once. Scores are cached per request and
policy and recomputed only for nodes that changed since.

Covered: nodes whose GPUs all have one model and whose usable GPUs are all
`fractional` or all `whole` (MIG, time-sliced and unhealthy GPUs may be mixed
in: nothing here lands on them), requests for whole GPUs, fractions (by compute
and/or memory) and CPU. Not covered (InvalidState / InvalidRequest, so callers
fall back to the per-node functions): other nodes, MIG requests. Within that
range every decision equals the per-node functions' decision, scores to the
last bit (tests/shared/test_placement_batch.py). Randomness only through the numpy
Generator passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpunode.errors import InvalidRequest
from gpunode.placement.arrays import BoolArray, FloatArray, IntArray, NodeArrays, ScoreCache
from gpunode.placement.fit import apply_request
from gpunode.placement.model import MILLI_PER_GPU, NodeState, Request
from gpunode.placement.ours import FRACTION_FIT_WEIGHT, SCARCITY_WEIGHT, TIE_SCALE
from gpunode.placement.policies import MAX_SCORE, MAX_SPEC_CPU_MILLI, MAX_SPEC_GPU_MILLI

BATCH_POLICIES = ("fgd", "bestfit", "packing", "spread", "random", "dotprod", "gpunode")


@dataclass(frozen=True)
class BatchChoice:
    """The node (index), the GPU slots (indices into the node's GPUs) and the score."""

    node: int
    gpus: tuple[int, ...]
    score: float


class ClusterArrays(NodeArrays):
    """A cluster as arrays, with vectorised fit, score and apply for one request at a time."""

    # ----- scores -----------------------------------------------------------------------------------------

    def _need_workload(self, policy: str) -> None:
        if self.workload is None:
            raise InvalidRequest(f"the {policy} policy needs a target workload")

    def _tightest(self, request: Request, idx: IntArray) -> IntArray:
        masked = np.where(self._fraction_fits(request, idx), self.share[idx], MILLI_PER_GPU + 1)
        return masked.argmin(axis=1)

    def _emptiest(self, request: Request, idx: IntArray) -> IntArray:
        return np.where(self._fraction_fits(request, idx), self.share[idx], -1).argmax(axis=1)

    def _request_milli(self, request: Request, idx: IntArray, gpu: IntArray) -> IntArray:
        if request.kind == "whole":
            return np.full(len(idx), request.gpus * MILLI_PER_GPU, dtype=np.int64)
        if request.kind == "fraction":
            return self._share_on(request, idx)[np.arange(len(idx)), gpu]
        return np.zeros(len(idx), dtype=np.int64)

    def _leftover(self, request: Request, idx: IntArray, gpu: IntArray) -> FloatArray:
        cpu_left = (self.cpu[idx] - request.cpu_milli).astype(np.float64)
        gpu_left = (self.share[idx].sum(axis=1) - self._request_milli(request, idx, gpu)).astype(np.float64)
        return cpu_left / MAX_SPEC_CPU_MILLI * 0.5 + gpu_left / MAX_SPEC_GPU_MILLI * 0.5

    @staticmethod
    def _clamp(values: FloatArray) -> FloatArray:
        return np.clip(np.trunc(values), 0, MAX_SCORE)

    def _score_bestfit(self, request: Request, idx: IntArray) -> tuple[FloatArray, IntArray]:
        gpu = self._tightest(request, idx)
        return self._clamp((1.0 - self._leftover(request, idx, gpu)) * MAX_SCORE), gpu

    def _score_spread(self, request: Request, idx: IntArray) -> tuple[FloatArray, IntArray]:
        gpu = self._emptiest(request, idx)
        return self._clamp(self._leftover(request, idx, gpu) * MAX_SCORE), gpu

    def _score_dotprod(self, request: Request, idx: IntArray) -> tuple[FloatArray, IntArray]:
        gpu = self._tightest(request, idx)
        free_cpu = self.cpu[idx] / MAX_SPEC_CPU_MILLI
        free_gpu = self.share[idx].sum(axis=1) / MAX_SPEC_GPU_MILLI
        want_gpu = self._request_milli(request, idx, gpu) / MAX_SPEC_GPU_MILLI
        dot = free_cpu * (request.cpu_milli / MAX_SPEC_CPU_MILLI) + free_gpu * want_gpu
        return self._clamp(MAX_SCORE * (1 - dot / 2)), gpu

    def _score_random(self, request: Request, idx: IntArray) -> tuple[FloatArray, IntArray]:
        return np.zeros(len(idx)), np.zeros(len(idx), dtype=np.int64)

    def _score_packing(self, request: Request, idx: IntArray) -> tuple[FloatArray, IntArray]:
        gpu = self._tightest(request, idx)
        if request.kind == "cpu":
            return np.zeros(len(idx)), gpu
        share = self.share[idx]
        fully = (share == MILLI_PER_GPU).sum(axis=1)
        case3 = np.maximum(MAX_SCORE // 3 - fully, fully)
        if request.kind == "whole":
            case2 = np.full(len(idx), max(MAX_SCORE // 2 - request.gpus, MAX_SCORE // 3))
            score = np.where(fully == self.gpu_count[idx], case3, case2)
        else:
            chosen = share[np.arange(len(idx)), gpu]
            case2 = np.full(len(idx), max(MAX_SCORE // 2 - 1, MAX_SCORE // 3))
            case1 = np.maximum(MAX_SCORE - (chosen * 100 // MILLI_PER_GPU) // 10, MAX_SCORE // 2)
            score = np.where(
                fully == self.gpu_count[idx], case3, np.where(chosen == MILLI_PER_GPU, case2, case1)
            )
        return score.astype(np.float64), gpu

    def _score_fgd(self, request: Request, idx: IntArray) -> tuple[FloatArray, IntArray]:
        self._need_workload("fgd")
        after = self._frag(*self._candidates(request, idx))
        scores = np.searchsorted(self._thresholds, self.frag[idx][:, None] - after, side="right")
        if request.kind == "fraction":
            scores = np.where(self._fraction_fits(request, idx), scores, -1)
            gpu = scores.argmax(axis=1)
            return scores[np.arange(len(idx)), gpu].astype(np.float64), gpu
        return scores[:, 0].astype(np.float64), np.zeros(len(idx), dtype=np.int64)

    def _score_gpunode(self, request: Request, idx: IntArray) -> tuple[FloatArray, IntArray]:
        self._need_workload("gpunode")
        after = self._candidates(request, idx)
        first = np.searchsorted(self._thresholds, self.frag[idx][:, None] - self._frag(*after), side="right")
        second = (self.fill[idx][:, None] - self._fill(*after)) / self._t_total
        pressure = self._pressure[idx]
        if request.kind == "fraction":
            share_on = self._share_on(request, idx)
            left = self.share[idx] - share_on
            scarcity = (pressure * 1)[:, None] * share_on
            score = first * TIE_SCALE + ((second - FRACTION_FIT_WEIGHT * left) - SCARCITY_WEIGHT * scarcity)
            score = np.where(self._fraction_fits(request, idx), score, -np.inf)
            gpu = score.argmax(axis=1)
            return score[np.arange(len(idx)), gpu], gpu
        scarcity = pressure * request.gpus * MILLI_PER_GPU
        whole_score = first[:, 0] * TIE_SCALE + (
            (second[:, 0] - FRACTION_FIT_WEIGHT * 0) - SCARCITY_WEIGHT * scarcity
        )
        return whole_score.astype(np.float64), np.zeros(len(idx), dtype=np.int64)

    # ----- choose and apply ---------------------------------------------------------------------------------

    def _cache(self, request: Request, policy: str) -> ScoreCache:
        cache = self._caches.get((request, policy))
        if cache is None:
            if policy not in BATCH_POLICIES:
                raise InvalidRequest(f"unknown policy {policy!r}; known: {', '.join(BATCH_POLICIES)}")
            self._check_request(request)
            cache = self._caches[(request, policy)] = ScoreCache(len(self.names))
        return cache

    def feasible_now(self, request: Request, policy: str) -> BoolArray:
        """Whether the request fits each node, from the cache where valid; no scores are computed.

        For callers that often find no node at all (admission retrying waiting jobs): a score
        costs several times a feasibility check, and a node's score is computed only once it is
        asked for by scores() (the same value as when computed at once: a score depends on the
        node's state alone, and its version names that state).
        """
        cache = self._cache(request, policy)
        stale = np.flatnonzero(cache.stamp != self.version)
        if len(stale):
            cache.feasible[stale] = self.feasible_in(request, stale)
            cache.stamp[stale] = self.version[stale]
        return cache.feasible

    def scores(self, request: Request, policy: str) -> tuple[BoolArray, FloatArray, IntArray]:
        """(feasible, score, chosen GPU slot for fractions) for every node, from the cache where valid.

        score and slot are meaningful where feasible is True only.
        """
        feasible = self.feasible_now(request, policy)
        cache = self._caches[(request, policy)]
        todo = np.flatnonzero((cache.score_stamp != self.version) & feasible)
        if len(todo):
            score, gpu = getattr(self, f"_score_{policy}")(request, todo)
            cache.score[todo] = score
            cache.gpu[todo] = gpu
            cache.score_stamp[todo] = self.version[todo]
        return feasible, cache.score, cache.gpu

    def gpu_slots(
        self, request: Request, policy: str, node: int, rng: np.random.Generator | None = None
    ) -> tuple[int, ...]:
        """The GPU slots the policy takes on `node` (whole GPUs: the lowest fully free indices)."""
        kind = request.kind
        if kind == "fraction":
            if policy == "random" and rng is not None:
                fitting = np.flatnonzero(self._fraction_fits(request, np.array([node]))[0])
                return (int(fitting[rng.integers(len(fitting))]),)
            return (int(self.scores(request, policy)[2][node]),)
        if kind == "whole":
            return tuple(
                int(s) for s in np.flatnonzero(self._whole_free(np.array([node]))[0])[: request.gpus]
            )
        return ()

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
        feasible, score, _ = self.scores(request, policy)
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
        return BatchChoice(
            node=node, gpus=self.gpu_slots(request, policy, node, rng), score=float(score[node])
        )

    def apply(self, request: Request, node: int, slots: Sequence[int]) -> None:
        """Account the request on the node (the GPU slots as chosen)."""
        state = self.node_state(node)
        self.replace_node(apply_request(state, request, tuple(state.gpus[s].uuid for s in slots)))

    def node_state(self, i: int) -> NodeState:
        """Node i as a NodeState, for the per-node functions."""
        return self._templates[i]

    def allocated_gpu_milli(self) -> int:
        """The GPU share taken over the cluster, in milli-GPUs."""
        return int((self.gpu_count * MILLI_PER_GPU).sum() - self.share.sum())
