"""The node table under queueing.capacity: forkable arrays, the allocations on a node, and rebuilds.

VersionedArrays is a placement.batch.ClusterArrays whose node versions are drawn
from one counter shared by an original and its forks, so a version names one node
state and the forks can share the score caches. rebuild() gives a node's state
from its initial state and the allocations it holds: releasing a job is rebuilding
its nodes without it, so a release is an exact undo.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from gpunode.placement.arrays import IntArray
from gpunode.placement.batch import ClusterArrays
from gpunode.placement.fit import apply_request
from gpunode.placement.frag import TargetWorkload
from gpunode.placement.model import NodeState, Request


class VersionedArrays(ClusterArrays):
    """ClusterArrays whose node versions are unique among an original and its forks.

    A version then names one node state, so the score caches (keyed by version) can
    be shared between an original and its forks without ever serving a stale score.
    A row may hold its state as arrays only, with its NodeState built when it is first
    asked for (show_rows, LazyNode).
    """

    def __init__(
        self, nodes: Sequence[NodeState], *, workload: TargetWorkload | None, stamps: Iterator[int]
    ) -> None:
        super().__init__(nodes, workload=workload)
        self._stamps = stamps
        self._lazy: npt.NDArray[np.object_] = np.full(len(nodes), None, dtype=object)  # per row: a LazyNode
        # while its NodeState is not built, else None

    def replace_nodes(self, nodes: Sequence[NodeState]) -> None:
        """As ClusterArrays.replace_nodes (and so replace_node), with versions no other state of the nodes
        has had."""
        super().replace_nodes(nodes)
        lazy = self._lazy
        for node in nodes:
            row = self._index[node.name]
            self.version[row] = next(self._stamps)
            lazy[row] = None

    def set_rows_state(
        self,
        rows: IntArray,
        state: dict[str, np.ndarray],
        nodes: npt.NDArray[np.object_],
    ) -> None:
        """Put back states taken by rows_state (version included: the same state keeps its version, and
        so its cached scores); `nodes` are those states, each built when its row is asked for."""
        for f, values in state.items():
            getattr(self, f)[rows] = values
        self._lazy[rows] = nodes

    def show_rows(self, rows: IntArray, cpu: IntArray, mem: IntArray, share: IntArray, milli: IntArray,
                  gmem_free: IntArray, nodes: Sequence[LazyNode]) -> None:  # fmt: skip
        """Give these rows a new state as arrays (free CPU, memory, and per GPU slot the allocatable share,
        free milli-GPU and free GPU memory; every other field of a row stays: its GPUs' modes and health do
        not change) with new versions; each row's NodeState is built from `nodes` when asked for."""
        self.cpu[rows], self.mem[rows] = cpu, mem
        self.share[rows], self.milli[rows], self.gmem_free[rows] = share, milli, gmem_free
        self.version[rows] = [next(self._stamps) for _ in range(len(rows))]
        self._agg_stale[rows] = True
        lazy = np.empty(len(nodes), dtype=object)
        lazy[:] = nodes
        self._lazy[rows] = lazy

    def node_state(self, i: int) -> NodeState:
        """Node i as a NodeState (built now if the row holds its state as arrays only)."""
        lazy = self._lazy[i]
        if lazy is not None:
            self._templates[i] = lazy.node()
            self._lazy[i] = None
        return self._templates[i]

    def lazy_nodes(self, rows: IntArray) -> npt.NDArray[np.object_]:
        """What set_rows_state takes back for these rows' states."""
        out = self._lazy[rows]
        for k in np.flatnonzero(out == None).tolist():  # noqa: E711 (elementwise)
            out[k] = LazyNode.of(self._templates[int(rows[k])])
        return out

    def fork(self) -> VersionedArrays:
        """A copy with its own state arrays and node list; caches and constant lookups are shared."""
        new = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray):
                setattr(new, name, value.copy())
        new._templates = list(self._templates)
        return new


class LazyNode:
    """A node state built from its initial state and allocations when first asked for (rebuild)."""

    __slots__ = ("_allocs", "_base", "_node")

    def __init__(self, base: NodeState, allocs: tuple[Allocation, ...]) -> None:
        self._base, self._allocs = base, allocs
        self._node: NodeState | None = None

    @classmethod
    def of(cls, node: NodeState) -> LazyNode:
        """A state already built."""
        lazy = cls(node, ())
        lazy._node = node
        return lazy

    def node(self) -> NodeState:
        """The state (built once)."""
        if self._node is None:
            self._node = rebuild(self._base, self._allocs)
        return self._node


@dataclass(frozen=True)
class Allocation:
    """One pod of an admitted job on a node."""

    job: str
    request: Request
    gpus: tuple[str, ...]


_T = TypeVar("_T")


def _with(obj: _T, **changes: object) -> _T:
    """dataclasses.replace without re-running validation: for values apply_request already checked.

    Every allocation rebuild() applies was applied by apply_request when its job was
    committed, so the sums stay within the ranges GpuState and NodeState check; a
    release rebuilds thousands of GPU states, and re-validating them dominated its cost.
    """
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


def rebuild(base: NodeState, allocs: Sequence[Allocation]) -> NodeState:
    """The initial state with these allocations applied: what apply_request gives one by one, in one pass."""
    if any(a.request.kind == "mig" for a in allocs):
        for a in allocs:
            base = apply_request(base, a.request, a.gpus)
        return base
    cpu = sum(a.request.cpu_milli for a in allocs)
    mem = sum(a.request.memory_bytes for a in allocs)
    whole = {u for a in allocs if a.request.kind == "whole" for u in a.gpus}
    frac: dict[str, tuple[int, int]] = {}
    for a in allocs:
        if a.request.kind == "fraction":
            m, b = frac.get(a.gpus[0], (0, 0))
            frac[a.gpus[0]] = (m + a.request.gpu_milli, b + a.request.gpu_memory_bytes)
    gpus = tuple(
        _with(g, milli_free=0, memory_free_bytes=0)
        if g.uuid in whole
        else _with(
            g,
            milli_free=g.milli_free - frac[g.uuid][0],
            memory_free_bytes=g.memory_free_bytes - frac[g.uuid][1],
        )
        if g.uuid in frac
        else g
        for g in base.gpus
    )
    return _with(
        base,
        gpus=gpus,
        cpu_milli_free=base.cpu_milli_free - cpu,
        memory_free_bytes=base.memory_free_bytes - mem,
    )
