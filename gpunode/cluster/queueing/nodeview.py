"""Per-node views of a ClusterCapacity, for the shortcuts of the engine and of backfill (earliest.py).

- free_gpu(): free()[gpu] alone, without the per-model amounts;
- footprint(name), free_by_row(), show_without(gone, rows): what a committed job
  takes from each node, every node's free GPU/CPU/memory, and (on a fork) nodes set
  to their state without some jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from gpunode.cluster.queueing.nodetable import Allocation, VersionedArrays, rebuild
from gpunode.placement.arrays import BoolArray, IntArray
from gpunode.placement.model import MILLI_PER_GPU, NodeState

if TYPE_CHECKING:
    from gpunode.cluster.queueing.capacity import _Held


class NodeView:
    """Per-node views of a ClusterCapacity (mixed into it)."""

    if TYPE_CHECKING:
        _arrays: VersionedArrays
        _alloc: dict[int, tuple[Allocation, ...]]
        _base: tuple[NodeState, ...]
        _jobs: dict[str, _Held]
        _usable: BoolArray

        def _mask(self, exclude: frozenset[str]) -> BoolArray | None: ...
        def _set_rows(self, states: dict[int, NodeState]) -> None: ...

    def free_gpu(self) -> int:
        """free()[gpu] alone: the allocatable milli-GPU of the GPUs requests use."""
        return int(np.where(self._usable, self._arrays.share, 0).sum())

    def footprint(self, job_name: str) -> list[tuple[int, int, int, int]]:
        """Per pod of a committed job: (row, milli-GPU, CPU milli, memory bytes) it takes from its node."""
        held, index = self._jobs[job_name], self._arrays.index_of
        return [
            (index(pod.node), q.gpu_milli if q.kind == "fraction" else MILLI_PER_GPU * len(pod.gpus),
             q.cpu_milli, q.memory_bytes)
            for q, pod in zip(held.job.pods, held.plan.pods, strict=True)
        ]  # fmt: skip

    def free_by_row(self) -> tuple[IntArray, IntArray, IntArray]:
        """Per node row now: free milli-GPU summed over its GPUs, free CPU milli, free memory bytes."""
        a = self._arrays
        return a.milli.sum(axis=1), a.cpu.copy(), a.mem.copy()

    def show_without(self, gone: set[str], rows: Sequence[int]) -> None:
        """Set these rows to their state without the jobs `gone` (only for plans on a fork: the jobs stay
        committed in the books, so never commit or release on it afterwards)."""
        alloc, base = self._alloc, self._base
        self._set_rows(
            {
                row: rebuild(base[row], tuple(a for a in alloc.get(row, ()) if a.job not in gone))
                for row in rows
            }
        )
