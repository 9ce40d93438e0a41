"""Per-node views of a ClusterCapacity, for the shortcuts of the engine and of backfill (earliest.py).

- free_gpu(): free()[gpu] alone, without the per-model amounts;
- footprint(name), free_by_row(), row_versions(), show_without(gone, rows, real): what a
  committed job takes from each node, every node's free GPU/CPU/memory, and (on a fork)
  nodes set to their state without some jobs, kept in ShownStates for the next searches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from gpunode.cluster.queueing.nodetable import Allocation, VersionedArrays, rebuild
from gpunode.placement.arrays import BoolArray, IntArray
from gpunode.placement.model import NodeState


class _Committed(Protocol):
    """What NodeView reads of a committed job (capacity._Held)."""

    @property
    def footprint(self) -> tuple[tuple[int, int, int, int], ...]: ...


class _SharedStates(Protocol):
    """What NodeView reads of the state an original shares with its forks (capacity._Shared)."""

    @property
    def shown(self) -> ShownStates: ...


class NodeView:
    """Per-node views of a ClusterCapacity (mixed into it)."""

    if TYPE_CHECKING:
        _arrays: VersionedArrays
        _alloc: dict[int, tuple[Allocation, ...]]
        _base: tuple[NodeState, ...]
        _jobs: Mapping[str, _Committed]
        _usable: BoolArray
        _shared: _SharedStates

        def _mark_use(self, rows: IntArray) -> None: ...

        def _mask(self, exclude: frozenset[str]) -> BoolArray | None: ...
        def _set_rows(self, states: dict[int, NodeState]) -> None: ...

    def free_gpu(self) -> int:
        """free()[gpu] alone: the allocatable milli-GPU of the GPUs requests use."""
        return int(np.where(self._usable, self._arrays.share, 0).sum())

    def pods_bound(self, pod_milli: int, exclude: frozenset[str]) -> int:
        """At most how many pods asking pod_milli GPU (> 0) the nodes outside `exclude` could take now: each
        node's free share summed over its GPUs, // pod_milli (a bound: CPU, memory and how the share is
        split among the GPUs are not looked at)."""
        per_node = np.where(self._usable, self._arrays.share, 0).sum(axis=1) // pod_milli
        mask = self._mask(exclude)
        if mask is not None:
            per_node[mask] = 0
        return int(per_node.sum())

    def footprint(self, job_name: str) -> tuple[tuple[int, int, int, int], ...]:
        """Per pod of a committed job: (row, milli-GPU, CPU milli, memory bytes) it takes from its node
        (worked out when the job was committed)."""
        return self._jobs[job_name].footprint

    def free_by_row(self) -> tuple[IntArray, IntArray, IntArray]:
        """Per node row now: free milli-GPU summed over its GPUs, free CPU milli, free memory bytes."""
        a = self._arrays
        return a.milli.sum(axis=1), a.cpu.copy(), a.mem.copy()

    def row_versions(self) -> IntArray:
        """Each row's version now (a copy): with the books, it names the allocations the row holds."""
        return self._arrays.version.copy()

    def show_without(self, gone: set[str], rows: Sequence[int], real: IntArray) -> None:
        """Set these rows to their state without the jobs `gone` (only for plans on a fork: the jobs stay
        committed in the books, so never commit or release on it afterwards). `real`: row_versions() of
        the capacity the fork was made from, when it was made.

        A state shown before (the same row, real version and jobs gone from it) is put back from
        ShownStates with its version, so neither the node state nor its scores are computed again: a
        row's version changes with every change of its allocations, so the key names the allocations
        left, and those the state.
        """
        alloc, base, table = self._alloc, self._base, self._shared.shown
        built: dict[int, NodeState] = {}
        keys: list[tuple[int, int, tuple[str, ...]]] = []
        hits: list[int] = []
        at: list[int] = []
        for row in rows:
            held = alloc.get(row, ())
            key = (row, int(real[row]), tuple(a.job for a in held if a.job in gone))
            found = table.find(key)
            if found is None:
                built[row] = rebuild(base[row], tuple(a for a in held if a.job not in gone))
                keys.append(key)
            else:
                hits.append(row)
                at.append(found)
        if built:
            self._set_rows(built)
            new = np.fromiter(built, dtype=np.int64, count=len(built))
            table.add(keys, self._arrays.rows_state(new), list(built.values()))
        if hits:
            old = np.array(hits, dtype=np.int64)
            self._arrays.set_rows_state(old, *table.take(at))
            self._mark_use(old)


class ShownStates:
    """Node states shown to backfill trials (NodeView.show_without), kept for the next searches.

    Consecutive reservation searches release mostly the same jobs (the running jobs past or near their
    expected end) on mostly unchanged nodes; a node's state without them is built once and then copied
    back as arrays. Shared by a capacity and its forks; emptied when it reaches LIMIT states.
    """

    LIMIT = 1 << 16

    def __init__(self) -> None:
        self._index: dict[tuple[int, int, tuple[str, ...]], int] = {}
        self._fields: dict[str, np.ndarray] = {}
        self._nodes: list[NodeState] = []

    def find(self, key: tuple[int, int, tuple[str, ...]]) -> int | None:
        """Where the state of this key is kept, or None."""
        return self._index.get(key)

    def add(self, keys: Sequence[tuple[int, int, tuple[str, ...]]], state: dict[str, np.ndarray],
            nodes: Sequence[NodeState]) -> None:  # fmt: skip
        """Keep these rows' states (NodeArrays.rows_state) under their keys."""
        n = len(self._nodes)
        if n + len(keys) > self.LIMIT:
            self._index.clear()
            self._nodes.clear()
            n = 0
        for f, values in state.items():
            arr = self._fields.get(f)
            if arr is None or len(arr) < n + len(values):
                grown = np.empty((max(2 * (n + len(values)), 1024), *values.shape[1:]), dtype=values.dtype)
                if arr is not None:
                    grown[:n] = arr[:n]
                arr = self._fields[f] = grown
            arr[n : n + len(values)] = values
        self._index.update(zip(keys, range(n, n + len(keys)), strict=True))
        self._nodes.extend(nodes)

    def take(self, at: Sequence[int]) -> tuple[dict[str, np.ndarray], list[NodeState]]:
        """The states kept at these places (NodeArrays.set_rows_state's arguments but the rows)."""
        idx = np.asarray(at, dtype=np.int64)
        return {f: arr[idx] for f, arr in self._fields.items()}, [self._nodes[i] for i in at]
