"""Per-node views of a ClusterCapacity, for the shortcuts of the engine and of backfill (earliest.py).

- free_gpu(): free()[gpu] alone, without the per-model amounts;
- footprint(name), footprints(names), committed(names), free_by_row(),
  show_without(gone, rows, freed, freed_gpu, origin): what a committed job takes from each
  node (and GPU), every node's free GPU/CPU/memory, and (on a fork) nodes set to their state without
  some jobs, built as arrays and kept in ShownStates for the next searches;
- released_sums(names, key): per-node and per-GPU sums of what a group of jobs holds (the overdue
  jobs, or a group of equal expected end), kept between backfill searches and updated by differences
  (ReleasedSums);
- pods_bound(pod, exclude), pod_room(pod, exclude): how many pods the open nodes could take, now or
  with some jobs counted as released before they are (PodRoom, for the victim search).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from gpunode.cluster.queueing.nodetable import Allocation, LazyNode, VersionedArrays
from gpunode.placement.arrays import MAX_GPUS, BoolArray, IntArray
from gpunode.placement.model import MILLI_PER_GPU, NodeState

_FOOTPRINT = operator.attrgetter("footprint")

# Per pod of a committed job: (row, milli-GPU, CPU milli, memory bytes, mark, kind, GPU slots, GPU memory):
# what it takes from its node; its commit's mark (a random 62-bit number, the same for each pod of the
# commit); its kind (the KIND_* below); the slots of its GPUs on the node as a bit mask; and, for a fraction,
# the GPU memory it asks (the milli-GPU column is then its compute share; for whole GPUs and MIG instances
# it is 1000 per GPU).
Footprint = tuple[tuple[int, int, int, int, int, int, int, int], ...]
KIND_CPU, KIND_WHOLE, KIND_FRACTION, KIND_MIG = 0, 1, 2, 3

# How many groups of equal expected end NodeView.released_sums keeps the sums of (besides the overdue jobs').
KEPT_GROUPS = 16

_SLOT_BITS = 1 << np.arange(MAX_GPUS, dtype=np.int64)


def released_columns(pods: IntArray, sign: int = 1) -> tuple[IntArray, IntArray, IntArray]:
    """For np.add.at: the rows of these pods (footprint entries, one per array row), what releasing them
    frees there per row (milli-GPU, CPU milli, memory bytes, 1 pod, the mark, 1 if a MIG instance) and
    per GPU slot (whole GPUs freed, a fraction's milli-GPU and GPU memory), all times `sign` (sums wrap
    around in int64, the same whatever the order)."""
    kind = pods[:, 5]
    per_row = np.empty((len(pods), 6), dtype=np.int64)
    per_row[:, :3] = pods[:, 1:4]
    per_row[:, 3] = 1
    per_row[:, 4] = pods[:, 4]
    per_row[:, 5] = kind == KIND_MIG
    bits = (pods[:, 6:7] & _SLOT_BITS) != 0  # (pods, slots)
    fraction = (kind == KIND_FRACTION)[:, None]
    per_gpu = np.empty((len(pods), MAX_GPUS, 3), dtype=np.int64)
    per_gpu[:, :, 0] = bits & (kind == KIND_WHOLE)[:, None]
    per_gpu[:, :, 1] = np.where(bits & fraction, pods[:, 1:2], 0)
    per_gpu[:, :, 2] = np.where(bits & fraction, pods[:, 7:8], 0)
    if sign < 0:
        return pods[:, 0], -per_row, -per_gpu
    return pods[:, 0], per_row, per_gpu


def _allocatable_share(milli: IntArray, gmem_free: IntArray, gmem_total: IntArray, ok_whole: BoolArray,
                       ok_frac: BoolArray) -> IntArray:  # fmt: skip
    """placement.fit.allocatable_share over arrays of GPUs: a fractional GPU's free share (the scarcer of
    compute and memory), a whole-mode GPU's 1000 when it is fully free, else 0."""
    by_memory = np.where(gmem_total > 0, gmem_free * MILLI_PER_GPU // np.maximum(gmem_total, 1), milli)
    fractional = np.minimum(milli, by_memory)
    fully_free = (milli == MILLI_PER_GPU) & (gmem_free == gmem_total)
    whole = np.where(fully_free, MILLI_PER_GPU, 0)
    out: IntArray = np.where(ok_frac, fractional, np.where(ok_whole, whole, 0))
    return out


class _Committed(Protocol):
    """What NodeView reads of a committed job (capacity._Held)."""

    @property
    def footprint(self) -> Footprint: ...


@dataclass(frozen=True)
class InitialGpus:
    """Per row and GPU slot, the free milli-GPU and GPU memory of the nodes as given (before any commit):
    what a whole GPU goes back to when released (NodeView.show_without)."""

    milli: IntArray
    gmem_free: IntArray


class _SharedStates(Protocol):
    """What NodeView reads of the state an original shares with its forks (capacity._Shared)."""

    @property
    def shown(self) -> ShownStates: ...

    @property
    def overdue(self) -> ReleasedSums: ...

    @property
    def initial(self) -> InitialGpus: ...

    @property
    def groups(self) -> dict[float, ReleasedSums]: ...


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
        """Per pod of a committed job: what it takes from its node and GPUs, and its commit's mark (worked
        out when the job was committed; Footprint names the fields)."""
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

    def released_sums(self, names: Sequence[str], key: float | None = None) -> tuple[IntArray, IntArray, int]:
        """What releasing these committed jobs would free: per node row and per GPU slot of each row (the
        sums of released_columns), and the milli-GPU in all. Kept up to date between calls (ReleasedSums)
        for backfill's groups of jobs, which change little from one search to the next: key None, the
        jobs past their expected end; else a group of equal expected end, by that end (the KEPT_GROUPS
        asked for last are kept). The arrays are the cache's: read them, never change them."""
        shared = self._shared
        if key is None:
            sums = shared.overdue
        else:
            groups = shared.groups
            found = groups.pop(key, None)
            if found is None and len(groups) >= KEPT_GROUPS:
                del groups[next(iter(groups))]  # the one asked for longest ago
            sums = groups[key] = found or ReleasedSums()
        return sums.update(self, names, len(self._base))

    @property
    def released_log(self) -> list[str]:
        """The names of the jobs this capacity released, oldest first (a new list when it was started
        afresh): whatever record a name outside it holds now, it held when the list was at any shorter
        length. Read it, never change it."""
        return self._released

    def show_without(
        self, gone: set[str], rows: IntArray, freed: IntArray, freed_gpu: IntArray, origin: NodeView
    ) -> None:
        """Set these rows to their state without the jobs `gone` (only for plans on a fork: the jobs stay
        committed in the books, so never commit or release on it afterwards). `origin`: the capacity the
        fork was made from, unchanged since (its rows' versions are the real ones). `freed` and `freed_gpu`, per
        row of `rows`: what the jobs gone from it free there, per row and per GPU slot (released_columns'
        sums).

        A state shown before (the same row, real version, pods gone and marks' sum) is put back from
        ShownStates with its version, so neither the node state nor its scores are computed again: a
        row's version changes with every change of its allocations, so the version names the
        allocations held, and the marks' sum which of them are gone (each commit's mark is a random
        62-bit number, so two sets of jobs on a row share a sum with a chance of about 2^-64). The other
        rows are built as arrays, all at once: origin's row plus what the gone jobs free on each GPU (a
        whole GPU freed goes back to its initial state); their NodeState is built from their allocations
        outside `gone` only when a plan places a pod on them (LazyNode). A row that frees a MIG instance
        is built as a NodeState at once.
        """
        base, table, src = self._base, self._shared.shown, origin._arrays
        key = np.column_stack((src.version[rows], freed[:, 3], freed[:, 4]))  # version, pods, marks' sum
        places = table.find(rows, key, len(base))
        found = places >= 0
        if found.any():  # put back before adding: adding may empty the table
            old = rows[found]
            self._arrays.set_rows_state(old, *table.take(places[found]))
            self._mark_use(old)
        missed = np.flatnonzero(~found)
        if not len(missed):
            return
        mig = freed[missed, 5] > 0
        alloc = self._alloc
        lazy = [
            LazyNode(base[row], tuple(a for a in alloc.get(row, ()) if a.job not in gone))
            for row in rows[missed].tolist()
        ]
        if mig.any():
            self._set_rows({int(rows[i]): lazy[k].node() for k, i in enumerate(missed) if mig[k]})
        plain = missed[~mig]
        if len(plain):
            r, initial = rows[plain], self._shared.initial
            whole = freed_gpu[plain, :, 0] > 0
            milli = np.where(whole, initial.milli[r], src.milli[r] + freed_gpu[plain, :, 1])
            gmem_free = np.where(whole, initial.gmem_free[r], src.gmem_free[r] + freed_gpu[plain, :, 2])
            share = _allocatable_share(milli, gmem_free, src.gmem_total[r], src.ok_whole[r], src.ok_frac[r])
            cpu, mem = src.cpu[r] + freed[plain, 1], src.mem[r] + freed[plain, 2]
            self._arrays.show_rows(r, cpu, mem, share, milli, gmem_free,
                                   [lazy[k] for k in np.flatnonzero(~mig).tolist()])  # fmt: skip
            self._mark_use(r)
        new = rows[missed]
        table.add(new, key[missed], self._arrays.rows_state(new), self._arrays.lazy_nodes(new))


class ShownStates:
    """Node states shown to backfill trials (NodeView.show_without), kept for the next searches.

    Consecutive reservation searches release mostly the same jobs (the running jobs past or near their
    expected end) on mostly unchanged nodes; a node's state without them is built once and then copied
    back as arrays. Each row indexes the last PER_ROW states kept for it by their keys (real version,
    pods gone, marks' sum), so a search looks all its rows up at once. Shared by a capacity and its forks;
    emptied when it reaches LIMIT states.
    """

    LIMIT = 1 << 16
    PER_ROW = 16

    def __init__(self) -> None:
        self._fields: dict[str, np.ndarray] = {}
        self._nodes: npt.NDArray[np.object_] = np.empty(0, dtype=object)
        self._count = 0
        self._keys = np.full((0, self.PER_ROW, 4), -1, dtype=np.int64)  # per row and slot: key, place
        self._next = np.zeros(0, dtype=np.int64)  # per row: the slot the next state kept takes

    def find(self, rows: IntArray, keys: IntArray, count: int) -> IntArray:
        """Per row: where its state under this key (version, pods gone, marks' sum) is kept, or -1.
        `count`: how many rows the capacity has."""
        if len(self._next) != count:
            self._keys = np.full((count, self.PER_ROW, 4), -1, dtype=np.int64)
            self._next = np.zeros(count, dtype=np.int64)
        kept = self._keys[rows]
        hit = np.all(kept[:, :, :3] == keys[:, None, :], axis=2) & (kept[:, :, 3] >= 0)
        slot = hit.argmax(axis=1)
        places: IntArray = np.where(hit.any(axis=1), kept[np.arange(len(rows)), slot, 3], -1)
        return places

    def add(
        self, rows: IntArray, keys: IntArray, state: dict[str, np.ndarray], nodes: npt.NDArray[np.object_]
    ) -> None:
        """Keep these rows' states (NodeArrays.rows_state; distinct rows, looked up by find before) under
        their keys (emptying the table first when it would grow past LIMIT: places found before are then
        gone)."""
        n, count = self._count, len(rows)
        if n + count > self.LIMIT:
            self._keys[:, :, 3] = -1
            n = 0
        for f, values in state.items():
            arr = self._fields.get(f)
            if arr is None or len(arr) < n + count:
                grown = np.empty((max(2 * (n + count), 1024), *values.shape[1:]), dtype=values.dtype)
                if arr is not None:
                    grown[:n] = arr[:n]
                arr = self._fields[f] = grown
            arr[n : n + count] = values
        if len(self._nodes) < n + count:
            grown_nodes = np.empty(max(2 * (n + count), 1024), dtype=object)
            grown_nodes[:n] = self._nodes[:n]
            self._nodes = grown_nodes
        self._nodes[n : n + count] = nodes
        slot = self._next[rows] % self.PER_ROW
        self._keys[rows, slot, :3] = keys
        self._keys[rows, slot, 3] = np.arange(n, n + count)
        self._next[rows] += 1
        self._count = n + count

    def take(self, at: IntArray) -> tuple[dict[str, np.ndarray], npt.NDArray[np.object_]]:
        """The states kept at these places (VersionedArrays.set_rows_state's arguments but the rows)."""
        return {f: arr[at] for f, arr in self._fields.items()}, self._nodes[at]


class _Records(Protocol):
    """What ReleasedSums reads of a capacity (NodeView)."""

    def footprints(self, names: Sequence[str]) -> list[Footprint]: ...
    def held_gpu(self, job_name: str) -> int: ...

    @property
    def released_log(self) -> list[str]: ...


class ReleasedSums:
    """Per-node and per-GPU sums of what a set of committed jobs holds, updated by differences
    (NodeView.released_sums).

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
        self._rows: IntArray = np.zeros((0, 6), dtype=np.int64)
        self._gpus: IntArray = np.zeros((0, MAX_GPUS, 3), dtype=np.int64)
        self._gpu = 0
        self._log: list[str] | None = None  # the released_log of the capacity last answered
        self._seen = 0  # its length then

    def update(self, cap: _Records, names: Sequence[str], rows: int) -> tuple[IntArray, IntArray, int]:
        """The sums for `names` (committed in cap) over `rows` node rows: per row, per GPU slot, in all."""
        footprints, held = self._footprints, self._held
        if len(self._rows) != rows:
            footprints.clear()
            held.clear()
            self._rows = np.zeros((rows, 6), dtype=np.int64)
            self._gpus = np.zeros((rows, MAX_GPUS, 3), dtype=np.int64)
            self._gpu = 0
        out: list[tuple[int, ...]] = []
        into: list[tuple[int, ...]] = []
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
                at, per_row, per_gpu = released_columns(np.array(pods, dtype=np.int64), sign)
                np.add.at(self._rows, at, per_row)
                np.add.at(self._gpus, at, per_gpu)
        return self._rows, self._gpus, self._gpu


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
            for row, milli, *_ in footprint(name):
                share[row] += milli

    def bound(self) -> int:
        """At most how many pods of the pod's share the nodes could take with the counted jobs released."""
        per_node = self._share // self._pod
        if self._excluded is not None:
            per_node[self._excluded] = 0
        return int(per_node.sum())
