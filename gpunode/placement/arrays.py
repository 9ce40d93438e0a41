"""The rows of placement.batch.ClusterArrays: a cluster as numpy arrays.

Per node: free CPU and memory; per GPU: allocatable share, free compute and
memory, and which requests it serves; per node and typical pod shape: the
aggregates both fragmentation measures are made of, with the aggregates after a
candidate placement computed for every node and GPU at once. batch.py scores
and chooses on top of these (see its docstring for what the batch form covers).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from gpunode.errors import InvalidRequest, InvalidState
from gpunode.placement.fit import allocatable_share, model_matches, takes_whole
from gpunode.placement.frag import TargetWorkload
from gpunode.placement.model import MILLI_PER_GPU, NodeState, Request

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]
MAX_GPUS = 8


class ScoreCache:
    """One (request, policy) per node: feasibility valid while the node's version equals `stamp`,
    score and GPU slot while it equals `score_stamp` (scored only when a feasible node is asked for)."""

    __slots__ = ("feasible", "gpu", "score", "score_stamp", "stamp")

    def __init__(self, n: int) -> None:
        self.stamp = np.full(n, -1, dtype=np.int64)
        self.score_stamp = np.full(n, -1, dtype=np.int64)
        self.feasible = np.zeros(n, dtype=bool)
        self.score = np.zeros(n, dtype=np.float64)
        self.gpu = np.zeros(n, dtype=np.int64)


def check_batchable(node: NodeState) -> None:
    """InvalidState unless the node is one the batch form covers (see the module docstring)."""
    if len(node.gpus) > MAX_GPUS:
        raise InvalidState(f"node {node.name}: batch form covers up to {MAX_GPUS} GPUs")
    if len({g.model for g in node.gpus}) > 1:
        raise InvalidState(f"node {node.name}: batch form needs one GPU model per node")
    if len({g.sharing for g in node.gpus if g.healthy and g.sharing in ("whole", "fractional")}) > 1:
        raise InvalidState(f"node {node.name}: batch form needs its usable GPUs all whole or all fractional")


class NodeArrays:
    """The rows of a ClusterArrays: per-node arrays, the typical shapes' aggregates and vectorised fit."""

    def __init__(self, nodes: Sequence[NodeState], *, workload: TargetWorkload | None = None) -> None:
        n = len(nodes)
        self.names = tuple(x.name for x in nodes)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._templates: list[NodeState] = list(nodes)
        self.cpu = np.zeros(n, dtype=np.int64)
        self.mem = np.zeros(n, dtype=np.int64)
        self.share = np.zeros((n, MAX_GPUS), dtype=np.int64)  # allocatable share (0 where nothing lands)
        self.milli = np.zeros((n, MAX_GPUS), dtype=np.int64)
        self.gmem_free = np.zeros((n, MAX_GPUS), dtype=np.int64)
        self.gmem_total = np.zeros((n, MAX_GPUS), dtype=np.int64)
        self.ok_whole = np.zeros((n, MAX_GPUS), dtype=bool)  # whole requests may land (fit.takes_whole)
        self.ok_frac = np.zeros((n, MAX_GPUS), dtype=bool)  # healthy, fractional
        self.gpu_count = np.zeros(n, dtype=np.int64)  # GPUs in whole or fractional mode (packing's node size)
        self.version = np.zeros(n, dtype=np.int64)
        self._agg_stale = np.zeros(n, dtype=bool)  # rows whose aggregates wait for the next scoring
        models = [next(iter({g.model for g in x.gpus}), "") for x in nodes]
        self._model_names = tuple(dict.fromkeys(models)) or ("",)
        self._model_of = np.array([self._model_names.index(m) for m in models], dtype=np.int64)
        self._caches: dict[tuple[Request, str], ScoreCache] = {}
        self._model_ok: dict[frozenset[str] | None, BoolArray] = {}
        self.workload = workload
        for i, node in enumerate(nodes):
            self._load_row(i, node)
        if workload is not None:
            self._init_shapes(workload)
            self._refresh_aggregates(np.arange(n))

    @property
    def models(self) -> tuple[str, ...]:
        """The GPU model of each node, by row."""
        return tuple(self._model_names[i] for i in self._model_of)

    def index_of(self, name: str) -> int:
        """The row of the named node."""
        return self._index[name]

    def _load_row(self, i: int, node: NodeState) -> None:
        check_batchable(node)
        if node.gpus and self._model_names[self._model_of[i]] != node.gpus[0].model:
            raise InvalidState(f"node {node.name}: a row keeps its GPU model")
        self.cpu[i], self.mem[i] = node.cpu_milli_free, node.memory_free_bytes
        for arr in (self.share, self.milli, self.gmem_free, self.gmem_total, self.ok_whole, self.ok_frac):
            arr[i] = 0
        for j, g in enumerate(node.gpus):
            self.share[i, j] = allocatable_share(g)
            self.milli[i, j], self.gmem_free[i, j], self.gmem_total[i, j] = (
                g.milli_free,
                g.memory_free_bytes,
                g.memory_total_bytes,
            )
            self.ok_whole[i, j] = takes_whole(g)
            self.ok_frac[i, j] = g.healthy and g.sharing == "fractional"
        self.gpu_count[i] = sum(1 for g in node.gpus if g.sharing in ("whole", "fractional"))

    _ROW_STATE = ("cpu", "mem", "share", "milli", "gmem_free", "gmem_total", "ok_whole", "ok_frac",
                  "gpu_count", "version", "_agg_stale")  # fmt: skip
    _AGGREGATES = ("cnt", "sum_ge", "copies", "total", "frag", "fill")

    def rows_state(self, rows: IntArray) -> dict[str, np.ndarray]:
        """Everything a row holds of its node's state, for these rows (copies; aggregates fresh): what a
        state seen before needs to be put back on a row without loading it again (the queueing node
        table's set_rows_state)."""
        self._fresh_aggregates()
        fields = self._ROW_STATE + (self._AGGREGATES if self.workload is not None else ())
        return {f: getattr(self, f)[rows] for f in fields}

    def replace_node(self, node: NodeState) -> None:
        """Put a new state for a known node (same name and GPUs); its cached scores go stale."""
        self.replace_nodes((node,))

    def replace_nodes(self, nodes: Sequence[NodeState]) -> None:
        """replace_node for several distinct nodes (their aggregates are refreshed at the next scoring)."""
        rows = [self._index[node.name] for node in nodes]
        for i, node in zip(rows, nodes, strict=True):
            self._load_row(i, node)
            self._templates[i] = node
            self.version[i] += 1
        self._agg_stale[rows] = True

    # ----- the typical shapes and per-node aggregates -------------------------------------------------

    def _init_shapes(self, workload: TargetWorkload) -> None:
        pods = workload.pods
        self._t_milli = np.array([p.gpu_milli for p in pods], dtype=np.int64)
        self._t_gpus = np.array([p.gpus for p in pods], dtype=np.int64)
        self._t_cpu = np.array([p.cpu_milli for p in pods], dtype=np.int64)
        self._t_weight = np.array([p.weight for p in pods], dtype=np.int64)
        self._t_whole = self._t_milli >= MILLI_PER_GPU
        self._t_milli_safe = np.maximum(self._t_milli, 1)
        self._t_gpus_safe = np.maximum(self._t_gpus, 1)
        self._t_cpu_safe = np.maximum(self._t_cpu, 1)
        self._t_per_copy = self._t_milli * self._t_gpus
        self._t_total = int(self._t_weight.sum())
        self._t_access = np.array(
            [
                [p.gpus > 0 and m != "" and model_matches(m, p.gpu_models) for p in pods]
                for m in self._model_names
            ],
            dtype=bool,
        )
        self._thresholds = np.array(workload.fgd_thresholds, dtype=np.float64)
        self._pressure = np.array(
            [
                workload.pressure(name, self._model_names[m])
                for name, m in zip(self.names, self._model_of, strict=True)
            ]
        )
        n, t = len(self.names), len(pods)
        self.cnt = np.zeros((n, t), dtype=np.int64)
        self.sum_ge = np.zeros((n, t), dtype=np.int64)
        self.copies = np.zeros((n, t), dtype=np.int64)
        self.total = np.zeros(n, dtype=np.int64)
        self.frag = np.zeros(n, dtype=np.int64)
        self.fill = np.zeros(n, dtype=np.int64)

    def _usable(self, idx: IntArray) -> BoolArray:
        """[K, G, T]: which GPU of which node each shape could use (ignoring its free share)."""
        per_mode = np.where(self._t_whole, self.ok_whole[idx][:, :, None], self.ok_frac[idx][:, :, None])
        return per_mode & self._t_access[self._model_of[idx]][:, None, :]

    def _gpu_terms(self, share: IntArray, usable: BoolArray) -> tuple[IntArray, IntArray, IntArray]:
        """Per GPU and shape: counts toward cnt, sum_ge and copies. share [..., G] -> [..., G, T]."""
        ge = usable & (share[..., None] >= self._t_milli)
        copies = np.where(self._t_whole, ge, share[..., None] // self._t_milli_safe) * usable
        return ge.astype(np.int64), share[..., None] * ge, copies

    def _fresh_aggregates(self) -> None:
        """Refresh the aggregates of the rows replaced since the last scoring, in one vectorised pass.

        Only scoring reads them (frag, fill and what _candidates derives), and most replaced rows
        (commits and releases while admission retries jobs that find no node) are replaced again
        before any score is asked of them. Integer arithmetic: the same values as refreshing at once.
        """
        rows = np.flatnonzero(self._agg_stale)
        if len(rows):
            if self.workload is not None:
                self._refresh_aggregates(rows)
            self._agg_stale[rows] = False

    def _refresh_aggregates(self, idx: IntArray) -> None:
        cnt, sum_ge, copies = self._gpu_terms(self.share[idx], self._usable(idx))
        self.cnt[idx], self.sum_ge[idx], self.copies[idx] = (
            cnt.sum(axis=1),
            sum_ge.sum(axis=1),
            copies.sum(axis=1),
        )
        self.total[idx] = self.share[idx].sum(axis=1)
        args = (self.total[idx], self.cnt[idx], self.sum_ge[idx], self.copies[idx], self.cpu[idx], idx)
        self.frag[idx] = self._frag(*args)
        self.fill[idx] = self._fill(*args)

    def _frag(self, total: IntArray, cnt: IntArray, sum_ge: IntArray, copies: IntArray, cpu: IntArray,
              nodes: IntArray) -> IntArray:  # fmt: skip
        """FGD fragmentation (scaled), as placement.frag.fragmentation, from aggregates [..., T]."""
        sat = self._t_access[self._model_of[nodes]] & (cnt >= self._t_gpus) & (cpu[..., None] >= self._t_cpu)
        return total * self._t_total - (sat * sum_ge * self._t_weight).sum(axis=-1)

    def _fill(self, total: IntArray, cnt: IntArray, sum_ge: IntArray, copies: IntArray, cpu: IntArray,
              nodes: IntArray) -> IntArray:  # fmt: skip
        """Fill fragmentation (scaled), as placement.ours.fill_fragmentation, from aggregates [..., T]."""
        whole_copies = copies // self._t_gpus_safe
        fits = np.where(self._t_whole, whole_copies, copies)
        by_cpu = np.maximum(cpu, 0)[..., None] // self._t_cpu_safe
        fits = np.where(self._t_cpu > 0, np.minimum(fits, by_cpu), fits)
        used = np.minimum(fits * self._t_per_copy, total[..., None])
        return total * self._t_total - (used * self._t_weight).sum(axis=-1)

    # ----- fit ----------------------------------------------------------------------------------------

    def _model_mask(self, models: frozenset[str] | None) -> BoolArray:
        if models not in self._model_ok:
            per_model = np.array(
                [m != "" and model_matches(m, models) for m in self._model_names], dtype=bool
            )
            self._model_ok[models] = per_model[self._model_of]
        return self._model_ok[models]

    @staticmethod
    def _check_request(request: Request) -> None:
        if request.kind == "mig":
            raise InvalidRequest("batch form places whole-GPU, fractional and CPU requests only")

    def _fraction_fits(self, request: Request, idx: IntArray) -> BoolArray:
        """[K, G]: which GPUs take the fraction."""
        ok = self.ok_frac[idx] & (self.milli[idx] >= request.gpu_milli)
        if request.gpu_memory_bytes:
            ok &= (self.gmem_total[idx] > 0) & (self.gmem_free[idx] >= request.gpu_memory_bytes)
        return ok

    def _share_on(self, request: Request, idx: IntArray) -> IntArray:
        """[K, G]: the share the fraction takes of each GPU (Request.share_on)."""
        share = np.full((len(idx), MAX_GPUS), request.gpu_milli, dtype=np.int64)
        if request.gpu_memory_bytes:
            total = self.gmem_total[idx]
            by_memory = -(-request.gpu_memory_bytes * MILLI_PER_GPU // np.maximum(total, 1))
            share = np.where(total > 0, np.maximum(share, by_memory), share)
        return share

    def _whole_free(self, idx: IntArray) -> BoolArray:
        return self.ok_whole[idx] & (self.share[idx] == MILLI_PER_GPU)

    def feasible_in(self, request: Request, idx: IntArray) -> BoolArray:
        """Which of the nodes `idx` the request fits."""
        ok = (self.cpu[idx] >= request.cpu_milli) & (self.mem[idx] >= request.memory_bytes)
        kind = request.kind
        if kind == "cpu":
            return ok
        ok &= self._model_mask(request.gpu_models)[idx]
        if kind == "fraction":
            return ok & self._fraction_fits(request, idx).any(axis=1)
        return ok & (self._whole_free(idx).sum(axis=1) >= request.gpus)

    # ----- candidate states -------------------------------------------------------------------------------

    def _fraction_after(self, request: Request, idx: IntArray) -> IntArray:
        """[K, G]: each GPU's allocatable share after the fraction lands on it (where it fits)."""
        milli = self.milli[idx] - request.gpu_milli
        free = self.gmem_free[idx] - request.gpu_memory_bytes
        total = self.gmem_total[idx]
        by_memory = np.maximum(free, 0) * MILLI_PER_GPU // np.maximum(total, 1)
        return np.maximum(np.where(total > 0, np.minimum(milli, by_memory), milli), 0)

    def _candidates(self, request: Request, idx: IntArray) -> tuple[IntArray, ...]:
        """Aggregates after placing the request: total, cnt, sum_ge, copies, cpu, nodes, shaped [K, C(, T)]."""
        self._fresh_aggregates()
        cpu = np.repeat(
            (self.cpu[idx] - request.cpu_milli)[:, None], MAX_GPUS if request.kind == "fraction" else 1, 1
        )
        nodes = np.repeat(idx[:, None], cpu.shape[1], axis=1)
        total, cnt, sum_ge, copies = self.total[idx], self.cnt[idx], self.sum_ge[idx], self.copies[idx]
        if request.kind == "fraction":
            usable = self._usable(idx)
            before = self._gpu_terms(self.share[idx], usable)
            after_share = self._fraction_after(request, idx)
            after = self._gpu_terms(after_share, usable)
            delta = [a - b for a, b in zip(after, before, strict=True)]  # [K, G, T]
            total = total[:, None] - self.share[idx] + after_share
            return (
                total,
                cnt[:, None] + delta[0],
                sum_ge[:, None] + delta[1],
                copies[:, None] + delta[2],
                cpu,
                nodes,
            )
        if request.kind == "whole":
            g = request.gpus
            # the GPUs taken are fully free and alike (one mode per node), so which ones does not matter
            frac_node: BoolArray = np.asarray(self.ok_frac[idx].any(axis=1))
            taken = np.where(self._t_whole, True, frac_node[:, None]) & self._t_access[self._model_of[idx]]
            per_gpu_copies = np.where(self._t_whole, 1, MILLI_PER_GPU // self._t_milli_safe)
            total = total - g * MILLI_PER_GPU
            cnt = cnt - g * taken
            sum_ge = sum_ge - g * MILLI_PER_GPU * taken
            copies = copies - g * per_gpu_copies * taken
        return (total[:, None], cnt[:, None], sum_ge[:, None], copies[:, None], cpu, nodes)
