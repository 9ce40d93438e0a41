"""Per-node views of a ClusterCapacity, for the shortcuts of the engine and of backfill (earliest.py).

- free_gpu(): free()[gpu] alone, without the per-model amounts;
- footprint(name), footprints(names), committed(names), free_by_row(), row_versions(),
  show_without(gone, rows, real, marks): what a committed job takes from each node, every
  node's free GPU/CPU/memory, and (on a fork) nodes set to their state without some jobs, kept in
  ShownStates for the next searches;
- released_sums(names): per-node sums of what the overdue jobs hold, kept between backfill searches
  and updated by differences (ReleasedSums);
- pods_bound(pod, exclude), pod_room(pod, exclude): how many pods the open nodes could take, now or
  with some jobs counted as released before they are (PodRoom, for the victim search).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from gpunode.cluster.queueing.nodetable import Allocation, VersionedArrays, rebuild
from gpunode.placement.arrays import BoolArray, IntArray
from gpunode.placement.model import NodeState

_FOOTPRINT = operator.attrgetter("footprint")

# Per pod of a committed job: (row, milli-GPU, CPU milli, memory bytes, mark): what it takes from its node,
# and its commit's mark (a random 62-bit number, the same for each pod of the commit).
Footprint = tuple[tuple[int, int, int, int, int], ...]

# A node state shown without some jobs (ShownStates): (row, real version, pods gone, sum of their marks).
ShownKey = tuple[int, int, int, int]


def released_columns(pods: IntArray, sign: int = 1) -> tuple[IntArray, IntArray]:
    """For np.add.at: the rows of these pods (footprint entries, one per array row) and what releasing
    them frees there, times `sign`: milli-GPU, CPU milli, memory bytes, 1 pod, the mark (sums wrap
    around in int64, the same whatever the order)."""
    values = np.empty((len(pods), 5), dtype=np.int64)
    values[:, :3] = pods[:, 1:4]
    values[:, 3] = 1
    values[:, 4] = pods[:, 4]
    return pods[:, 0], values if sign > 0 else -values


class _Committed(Protocol):
    """What NodeView reads of a committed job (capacity._Held)."""

    @property
    def footprint(self) -> Footprint: ...


class _SharedStates(Protocol):
    """What NodeView reads of the state an original shares with its forks (capacity._Shared)."""

    @property
    def shown(self) -> ShownStates: ...

    @property
    def overdue(self) -> ReleasedSums: ...


class NodeView:
    """Per-node views of a ClusterCapacity (mixed into it)."""

    if TYPE_CHECKING:
        _arrays: VersionedArrays
        _alloc: dict[int, tuple[Allocation, ...]]
        _base: tuple[NodeState, ...]
        _jobs: Mapping[str, _Committed]
        _released: list[str]
        _usable: BoolArray
        _shared: _SharedStates

        def _mark_use(self, rows: IntArray) -> None: ...

        def _mask(self, exclude: frozenset[str]) -> BoolArray | None: ...
        def _set_rows(self, states: dict[int, NodeState]) -> None: ...
        def held_gpu(self, job_name: str) -> int: ...  # noqa: D102 (ClusterCapacity.held_gpu)

    def free_gpu(self) -> int:
        """free()[gpu] alone: the allocatable milli-GPU of the GPUs requests use."""
        return int(np.where(self._usable, self._arrays.share, 0).sum())

    def pods_bound(self, pod_milli: int, exclude: frozenset[str]) -> int:
        """At most how many pods asking pod_milli GPU (> 0) the nodes outside `exclude` could take now: each
        node's free share summed over its GPUs, // pod_milli (a bound: CPU, memory and how the share is
        split among the GPUs are not looked at)."""
        return self.pod_room(pod_milli, exclude).bound()

    def pod_room(self, pod_milli: int, exclude: frozenset[str]) -> PodRoom:
        """pods_bound(pod_milli, exclude) now, as a PodRoom to count releases into before they are made."""
        share = np.where(self._usable, self._arrays.share, 0).sum(axis=1)
        return PodRoom(share, pod_milli, self._mask(exclude), self.footprint)

    def footprint(self, job_name: str) -> Footprint:
        """Per pod of a committed job: (row, milli-GPU, CPU milli, memory bytes) it takes from its node
        (worked out when the job was committed), and the commit's mark (Footprint)."""
        return self._jobs[job_name].footprint

    def footprints(self, names: Sequence[str]) -> list[Footprint]:
        """footprint(name) of each of these committed jobs, in one pass."""
        return list(map(_FOOTPRINT, map(self._jobs.__getitem__, names)))

    def committed(self, names: Iterable[str]) -> list[str]:
        """Those of these names that are committed jobs, in their order."""
        jobs = self._jobs
        return [n for n in names if n in jobs]

    def free_by_row(self) -> tuple[IntArray, IntArray, IntArray]:
        """Per node row now: free milli-GPU summed over its GPUs, free CPU milli, free memory bytes."""
        a = self._arrays
        return a.milli.sum(axis=1), a.cpu.copy(), a.mem.copy()

    def row_versions(self) -> IntArray:
        """Each row's version now (a copy): with the books, it names the allocations the row holds."""
        return self._arrays.version.copy()

    def released_sums(self, names: Sequence[str]) -> tuple[IntArray, int]:
        """What releasing these committed jobs would free: per node row (milli-GPU, CPU milli, memory
        bytes, pods, their marks' sum: released_columns), and the milli-GPU in all. Kept up to date between calls (ReleasedSums): for backfill's
        group of the jobs past their expected end, which changes little from one search to the next. The
        array is the cache's: read it, never change it."""
        return self._shared.overdue.update(self, names, len(self._base))

    @property
    def released_log(self) -> list[str]:
        """The names of the jobs this capacity released, oldest first (a new list when it was started
        afresh): whatever record a name outside it holds now, it held when the list was at any shorter
        length. Read it, never change it."""
        return self._released

    def show_without(self, gone: set[str], rows: IntArray, real: IntArray, marks: IntArray) -> None:
        """Set these rows to their state without the jobs `gone` (only for plans on a fork: the jobs stay
        committed in the books, so never commit or release on it afterwards). `real`: row_versions() of
        the capacity the fork was made from, when it was made. `marks`, per row of `rows`: the pods the
        jobs gone from it hold there and the sum of their footprints' marks (columns 3 and 4 of
        released_sums' array).

        A state shown before (the same row, real version, pods gone and marks' sum) is put back from
        ShownStates with its version, so neither the node state nor its scores are computed again: a
        row's version changes with every change of its allocations, so the version names the
        allocations held, and the marks' sum which of them are gone (each commit's mark is a random
        62-bit number, so two sets of jobs on a row share a sum with a chance of about 2^-64). Only the
        rows not kept are built, from their allocations outside `gone`.
        """
        alloc, base, table = self._alloc, self._base, self._shared.shown
        keys = list(
            zip(rows.tolist(), real[rows].tolist(), marks[:, 0].tolist(), marks[:, 1].tolist(), strict=True)
        )
        places = table.find(keys)
        kept = [i for i, place in enumerate(places) if place >= 0]
        if kept:  # put back before adding: adding may empty the table
            old = rows[kept]
            at_old = np.array([places[i] for i in kept], dtype=np.int64)
            self._arrays.set_rows_state(old, *table.take(at_old))
            self._mark_use(old)
        built: dict[int, NodeState] = {}
        new_keys: list[ShownKey] = []
        for i, place in enumerate(places):
            if place < 0:
                key = keys[i]
                row = key[0]
                built[row] = rebuild(base[row], tuple(a for a in alloc.get(row, ()) if a.job not in gone))
                new_keys.append(key)
        if built:
            self._set_rows(built)
            new = np.fromiter(built, dtype=np.int64, count=len(built))
            table.add(new_keys, self._arrays.rows_state(new), list(built.values()))


class ShownStates:
    """Node states shown to backfill trials (NodeView.show_without), kept for the next searches.

    Consecutive reservation searches release mostly the same jobs (the running jobs past or near their
    expected end) on mostly unchanged nodes; a node's state without them is built once and then copied
    back as arrays. Shared by a capacity and its forks; emptied when it reaches LIMIT states.
    """

    LIMIT = 1 << 16

    def __init__(self) -> None:
        self._index: dict[ShownKey, int] = {}
        self._fields: dict[str, np.ndarray] = {}
        self._nodes: list[NodeState] = []

    def find(self, keys: Sequence[ShownKey]) -> list[int]:
        """Per key: where its state is kept, or -1."""
        get = self._index.get
        return [get(key, -1) for key in keys]

    def add(self, keys: Sequence[ShownKey], state: dict[str, np.ndarray], nodes: Sequence[NodeState]) -> None:
        """Keep these rows' states (NodeArrays.rows_state) under their keys (emptying the table first when
        it would grow past LIMIT: places found before are then gone)."""
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

    def take(self, at: IntArray) -> tuple[dict[str, np.ndarray], list[NodeState]]:
        """The states kept at these places (NodeArrays.set_rows_state's arguments but the rows)."""
        return {f: arr[at] for f, arr in self._fields.items()}, [self._nodes[i] for i in at.tolist()]


class _Records(Protocol):
    """What ReleasedSums reads of a capacity (NodeView)."""

    def footprints(self, names: Sequence[str]) -> list[Footprint]: ...
    def held_gpu(self, job_name: str) -> int: ...

    @property
    def released_log(self) -> list[str]: ...


class ReleasedSums:
    """Per-node sums of what a set of committed jobs holds, updated by differences (NodeView.released_sums).

    Each job's record is the footprint its commit made (a new tuple per commit), so a job released and
    committed again under the same name is seen by identity and counted afresh; any capacity sharing the
    node rows may ask, and gets the sums of its own records. Asked again by the capacity it last
    answered, only the names that joined the set and those the capacity released since (its
    released_log) are looked up: a record changes only by a release (a commit under a committed name
    is refused), and a trial puts back the records it changed.
    """

    def __init__(self) -> None:
        self._footprints: dict[str, Footprint] = {}
        self._held: dict[str, int] = {}
        self._rows: IntArray = np.zeros((0, 5), dtype=np.int64)
        self._gpu = 0
        self._log: list[str] | None = None  # the released_log of the capacity last answered
        self._seen = 0  # its length then

    def update(self, cap: _Records, names: Sequence[str], rows: int) -> tuple[IntArray, int]:
        """The sums for `names` (committed in cap) over `rows` node rows."""
        footprints, held = self._footprints, self._held
        if len(self._rows) != rows:
            footprints.clear()
            held.clear()
            self._rows = np.zeros((rows, 5), dtype=np.int64)
            self._gpu = 0
        out: list[tuple[int, int, int, int, int]] = []
        into: list[tuple[int, int, int, int, int]] = []
        log = cap.released_log
        if self._log is log:  # the same capacity: look up only what may have changed since
            wanted = set(names)
            gone = footprints.keys() - wanted
            maybe = list((wanted - footprints.keys()) | (wanted.intersection(log[self._seen :]) - gone))
            now = dict(zip(maybe, cap.footprints(maybe), strict=True))
        else:
            now = dict(zip(names, cap.footprints(names), strict=True))
            gone = footprints.keys() - now.keys()
        self._log, self._seen = log, len(log)
        for name in gone:
            out.extend(footprints.pop(name))
            self._gpu -= held.pop(name)
        get = footprints.get
        for name in [n for n, f in now.items() if get(n) is not f]:
            before = get(name)
            if before is not None:
                out.extend(before)
                self._gpu -= held[name]
            footprints[name] = now[name]
            into.extend(now[name])
            held[name] = cap.held_gpu(name)
            self._gpu += held[name]
        for pods, sign in ((out, -1), (into, 1)):
            if pods:
                np.add.at(self._rows, *released_columns(np.array(pods, dtype=np.int64), sign))
        return self._rows, self._gpu


class PodRoom:
    """An upper bound of pods_bound once some committed jobs are released, counted before releasing them.

    Each node's free GPU share plus the share the counted jobs hold on it, // the pod's share, summed
    over the nodes not excluded. Releasing a job frees no more than it holds on a node, so the bound
    holds after any of the counted releases are made (the victim search releases only when it says a
    placement may succeed: a release rebuilds nodes).
    """

    def __init__(
        self,
        share: IntArray,
        pod_milli: int,
        excluded: BoolArray | None,
        footprint: Callable[[str], Footprint],
    ) -> None:
        self._share, self._pod, self._excluded, self._footprint = share, pod_milli, excluded, footprint

    def count(self, names: Iterable[str]) -> None:
        """Count in what these committed jobs hold (each name once)."""
        share, footprint = self._share, self._footprint
        for name in names:
            for row, milli, _, _, _ in footprint(name):
                share[row] += milli

    def bound(self) -> int:
        """At most how many pods of the pod's share the nodes could take with the counted jobs released."""
        per_node = self._share // self._pod
        if self._excluded is not None:
            per_node[self._excluded] = 0
        return int(per_node.sum())
