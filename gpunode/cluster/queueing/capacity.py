"""The cluster as admission sees it: whole-job placement trials, commits and exact releases.

ClusterCapacity keeps the cluster as a placement.batch.ClusterArrays (vectorised fit
and score, the same decisions as the extender and the trace simulator) plus, per
node, the allocations of admitted jobs, so that releasing a job rebuilds each of
its nodes from the node's initial state and the allocations that remain.

API (all deterministic for a given seed):
- ClusterCapacity(nodes, *, workload=None, policy="gpunode", power=None, energy_weight=0.0, seed=0)
- .plan(job, *, exclude_nodes=frozenset(), hide=None) -> Plan | None: a placement for EVERY pod of the job,
  members placed one after another (largest first) on the arrays, then rolled back (nothing held);
  None when any member does not fit. Nodes in exclude_nodes are not used (backfill reservations).
  .plan_counted(job, *, exclude_nodes) -> (Plan | None, members placed before one did not fit).
  .fits_now(pod, *, exclude_nodes) -> bool: some node has room for this one pod now.
- .commit(job_name, job, plan): hold the plan's resources (InvalidState if it no longer fits;
  nothing is held then). .release(job_name) / .release_many(names): the exact undo of commit;
  bumps .epoch.
- .held(job_name) / .amounts(job, plan) -> Amounts: what a job holds (gpu, gpu_memory, gpu/<model>);
  .plan_of(job_name), .job_of(job_name), .jobs, `name in cap`.
- .free_gpu(), .footprint(name), .footprints(names), .committed(names), .released_sums(names),
  .free_by_row(), .show_without(gone, rows, freed, freed_gpu, origin), .pods_bound(pod, exclude),
  .pod_room(pod, exclude): per-node views for the engine's, backfill's and preemption's shortcuts
  (nodeview.py).
- .free() / .capacity() -> Amounts; .fits_empty(job): could it ever fit (on the initial cluster).
- .epoch: changes with every release (and only then): a job that failed to plan at the same
  epoch, with the same exclude_nodes, still fails, because commits only take resources away.
- .fork(): an independent copy for what-if (backfill shadow time, preemption trials); score
  caches are shared with the original, so a fork's plans stay fast.
- .trial(): a context manager that undoes, on exit, every commit and release made inside it on
  this very object (cheaper than fork: only the nodes and the records of jobs it touched are restored).
- .nodes_busy(), .gpu_activity(): powered nodes and busy/idle GPUs per model (energy.py's model).

Energy-aware placement: with energy_weight w > 0 a node's score is (1 - w) * (policy score) +
w * (energy term), both scaled to 0..1 over the feasible nodes (min-max: with w above 0.5 energy
wins every conflict); the energy term ranks nodes by the watts the placement adds under
energy.PowerModel (energy.extra_watts_rank): GPUs on nodes already busy are preferred, so idle
nodes stay idle.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from gpunode.cluster.queueing.energy import DEFAULT_POWER, GpuActivity, PowerModel, extra_watts_rank
from gpunode.cluster.queueing.freed import FreedLog
from gpunode.cluster.queueing.model import GPU, GPU_MEMORY, Amounts, Job, Plan, PodPlacement, model_key
from gpunode.cluster.queueing.nodetable import Allocation, VersionedArrays, rebuild
from gpunode.cluster.queueing.nodeview import (
    KIND_CPU,
    KIND_FRACTION,
    KIND_MIG,
    KIND_WHOLE,
    Footprint,
    InitialGpus,
    NodeView,
    ReleasedSums,
    ShownStates,
)
from gpunode.errors import InvalidRequest, InvalidState
from gpunode.placement.arrays import BoolArray, FloatArray, IntArray
from gpunode.placement.batch import BATCH_POLICIES
from gpunode.placement.fit import apply_request
from gpunode.placement.frag import TargetWorkload
from gpunode.placement.model import MILLI_PER_GPU, NodeState, Request

_K = TypeVar("_K")
_V = TypeVar("_V")

_KINDS = {"cpu": KIND_CPU, "whole": KIND_WHOLE, "fraction": KIND_FRACTION, "mig": KIND_MIG}

# How many released names a capacity lists (NodeView.released_log) before it starts a new list.
RELEASED_LOG_MAX = 100_000


@dataclass(frozen=True)
class _Held:
    job: Job
    plan: Plan
    rows: tuple[int, ...]
    amounts: Amounts
    footprint: Footprint  # NodeView.footprint


@dataclass
class _BooksUndo:
    """A trial's record of what it changed in the books: each row's allocations and each job's record
    as they were before it first changed (None: absent), so the trial's end puts back only those."""

    alloc: dict[int, tuple[Allocation, ...] | None] = field(default_factory=dict)
    jobs: dict[str, _Held | None] = field(default_factory=dict)

    def put_back(self, alloc: dict[int, tuple[Allocation, ...]], jobs: dict[str, _Held]) -> None:
        """Set these books' noted entries back in place (removing those that were absent)."""
        _put_back(alloc, self.alloc)
        _put_back(jobs, self.jobs)


def _mark(serial: int) -> int:
    """A commit's mark (NodeView.footprint): its serial number mixed to 62 random-looking bits
    (splitmix64's finalizer), so that sums of marks tell sets of commits apart."""
    z = (serial * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2


def _put_back(books: dict[_K, _V], noted: dict[_K, _V | None]) -> None:
    for key, value in noted.items():
        if value is None:
            books.pop(key, None)
        else:
            books[key] = value


_NONE: IntArray = np.zeros((0, 0), dtype=np.int64)


@dataclass
class _Shared:
    """What an original and its forks share: counters and caches of immutable facts."""

    stamps: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    marks: Iterator[int] = field(default_factory=lambda: itertools.count(1))  # commits, for _mark
    epochs: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    masks: dict[frozenset[str], BoolArray] = field(default_factory=dict)
    fits_empty: dict[tuple[Request, ...], bool] = field(default_factory=dict)
    empty: ClusterCapacity | None = None
    shown: ShownStates = field(default_factory=ShownStates)
    overdue: ReleasedSums = field(default_factory=ReleasedSums)
    initial: InitialGpus = field(default_factory=lambda: InitialGpus(_NONE, _NONE))  # set by ClusterCapacity
    slots: dict[int, dict[str, int]] = field(default_factory=dict)  # per row: each GPU's slot, by UUID
    groups: dict[float, ReleasedSums] = field(default_factory=dict)  # NodeView.released_sums, by key


class ClusterCapacity(NodeView):
    """The cluster's GPUs as admission sees them (see the module docstring for the API)."""

    _jobs: dict[str, _Held]
    _shared: _Shared

    def __init__(
        self,
        nodes: Sequence[NodeState],
        *,
        workload: TargetWorkload | None = None,
        policy: str = "gpunode",
        power: PowerModel | None = None,
        energy_weight: float = 0.0,
        seed: int = 0,
    ) -> None:
        if policy not in BATCH_POLICIES:
            raise InvalidRequest(
                f"unknown placement policy {policy!r}", hint=f"use one of: {', '.join(BATCH_POLICIES)}"
            )
        if not 0.0 <= energy_weight <= 1.0:
            raise InvalidRequest(
                f"energy weight must be within 0..1, got {energy_weight}", hint="set energy.weight to 0..1"
            )
        self.policy = policy
        self.energy_weight = float(energy_weight)
        self.power = power or DEFAULT_POWER
        self._shared = _Shared()
        self._arrays = VersionedArrays(nodes, workload=workload, stamps=self._shared.stamps)
        self._shared.initial = InitialGpus(self._arrays.milli.copy(), self._arrays.gmem_free.copy())
        self._base: tuple[NodeState, ...] = tuple(nodes)
        self._alloc: dict[int, tuple[Allocation, ...]] = {}
        self._jobs = {}
        self._epoch = 0
        self._rng = np.random.default_rng(seed)
        self._journal: dict[int, NodeState] | None = None
        self._books_undo: _BooksUndo | None = None  # in a trial: the records as they were before it
        self._released: list[str] = []  # NodeView.released_log
        self._freed = FreedLog()
        arr = self._arrays
        self._gpus = arr.gpu_count.copy()
        self._usable = np.zeros(arr.milli.shape, dtype=bool)  # GPUs our requests use (constant per node)
        for i, node in enumerate(nodes):
            for j, g in enumerate(node.gpus):
                self._usable[i, j] = g.healthy and g.sharing in ("whole", "fractional")
        models = arr.models
        self._idle_w = np.array([self.power.watts(m)[0] for m in models], dtype=np.float64)
        self._active_w = np.array([self.power.watts(m)[1] for m in models], dtype=np.float64)
        self._used = self._used_rows(np.arange(len(nodes)))
        self._busy = self._used.sum(axis=1)
        self._capacity = self._amounts_now()

    # ----- state ------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Changes with every release (a failed plan may succeed only after one)."""
        return self._epoch

    @property
    def in_trial(self) -> bool:
        """Whether a trial() block is open on this object."""
        return self._journal is not None

    @property
    def node_names(self) -> tuple[str, ...]:
        """The nodes, in row order."""
        return self._arrays.names

    @property
    def jobs(self) -> tuple[str, ...]:
        """The names of the committed jobs, in no set order (a trial may change it)."""
        return tuple(self._jobs)

    def __contains__(self, job_name: object) -> bool:
        """Whether a job of this name is committed."""
        return job_name in self._jobs

    def _used_rows(self, rows: IntArray) -> BoolArray:
        a = self._arrays
        used: BoolArray = self._usable[rows] & (
            (a.milli[rows] < MILLI_PER_GPU) | (a.gmem_free[rows] < a.gmem_total[rows])
        )
        return used

    def _set_row(self, row: int, state: NodeState) -> None:
        self._set_rows({row: state})

    def _set_rows(self, states: dict[int, NodeState]) -> None:
        if self._journal is not None:
            for row in states:
                self._journal.setdefault(row, self._arrays.node_state(row))
        self._arrays.replace_nodes(list(states.values()))
        self._mark_use(np.fromiter(states, dtype=np.int64, count=len(states)))

    def _mark_use(self, rows: IntArray) -> None:
        """Bring the busy GPUs of these rows (energy) in line with their node state."""
        self._used[rows] = self._used_rows(rows)
        self._busy[rows] = self._used[rows].sum(axis=1)

    # ----- planning -----------------------------------------------------------------------------------

    def _mask(self, exclude: frozenset[str]) -> BoolArray | None:
        if not exclude:
            return None
        mask = self._shared.masks.get(exclude)
        if mask is None:
            mask = np.zeros(len(self._base), dtype=bool)
            index = self._arrays._index
            mask[[index[n] for n in exclude if n in index]] = True
            if len(self._shared.masks) > 64:
                self._shared.masks.clear()
            self._shared.masks[exclude] = mask
        return mask

    def _energy_term(self, request: Request, cand: IntArray, gpu: IntArray) -> FloatArray:
        kind = request.kind
        if kind == "fraction":
            newly = (~self._used[cand, gpu[cand]]).astype(np.float64)
        else:
            newly = np.full(len(cand), request.gpus if kind == "whole" else 0, dtype=np.float64)
        return extra_watts_rank(
            newly, self._busy[cand] == 0, self._gpus[cand], self._idle_w[cand], self._active_w[cand]
        )

    def _choose(self, request: Request, mask: BoolArray | None) -> tuple[int, tuple[int, ...]] | None:
        arr = self._arrays
        feasible = arr.feasible_now(request, self.policy)  # most tries find no node: no scores for them
        ok = feasible if mask is None else feasible & ~mask
        cand = np.flatnonzero(ok)
        if not len(cand):
            return None
        _, score, gpu = arr.scores(request, self.policy)
        w = self.energy_weight
        if self.policy == "random" and w == 0:
            node = int(cand[self._rng.integers(len(cand))])
        else:
            s = score[cand]
            if w > 0:
                low, high = s.min(), s.max()
                norm = (s - low) / (high - low) if high > low else np.ones(len(cand))
                s = (1.0 - w) * norm + w * self._energy_term(request, cand, gpu)
            top = cand[s == s.max()]
            node = int(top[0]) if len(top) == 1 else int(top[self._rng.integers(len(top))])
        return node, arr.gpu_slots(request, self.policy, node, self._rng)

    def plan(
        self, job: Job, *, exclude_nodes: frozenset[str] = frozenset(), hide: BoolArray | None = None
    ) -> Plan | None:
        """A placement for every pod of the job on the cluster as it is now, or None; nothing is held.
        hide: per node row, True for rows not to use either (as if excluded)."""
        return self._plan_pods(job.pods, exclude_nodes, hide)[0]

    def fits_now(self, pod: Request, *, exclude_nodes: frozenset[str] = frozenset()) -> bool:
        """Whether some node outside exclude_nodes has room for this one pod now (no scores, no draws)."""
        feasible = self._arrays.feasible_now(pod, self.policy)
        mask = self._mask(exclude_nodes)
        return bool((feasible if mask is None else feasible & ~mask).any())

    def plan_counted(
        self, job: Job, *, exclude_nodes: frozenset[str] = frozenset()
    ) -> tuple[Plan | None, int]:
        """plan(job), and how many members were placed before one found no room (all of them when
        the plan is made). Members are placed largest first, each seeing those before it, so for a
        gang of like members the count is the largest k whose first k members place together."""
        return self._plan_pods(job.pods, exclude_nodes)

    def _plan_pods(
        self, pods: Sequence[Request], exclude: frozenset[str], hide: BoolArray | None = None
    ) -> tuple[Plan | None, int]:
        mask = self._mask(exclude)
        if hide is not None:
            mask = hide if mask is None else mask | hide
        undo: list[tuple[int, NodeState]] = []
        out: dict[int, PodPlacement] = {}
        # the largest members first (whole GPUs, then fractions, then CPU), so small ones fill around them
        order = sorted(range(len(pods)), key=lambda k: -(pods[k].gpus * MILLI_PER_GPU + pods[k].gpu_milli))
        try:
            for n, k in enumerate(order):
                choice = self._choose(pods[k], mask)
                if choice is None:
                    return None, n
                row, slots = choice
                state = self._arrays.node_state(row)
                uuids = tuple(state.gpus[s].uuid for s in slots)
                out[k] = PodPlacement(node=state.name, gpus=uuids)
                if n + 1 < len(pods):  # later members see this one
                    self._set_row(row, apply_request(state, pods[k], uuids))
                    undo.append((row, state))
            return Plan(pods=tuple(out[k] for k in range(len(pods)))), len(pods)
        finally:
            for row, state in reversed(undo):
                self._set_row(row, state)

    @contextmanager
    def draws_kept(self) -> Iterator[None]:
        """Plans made inside the block leave the tie-break generator as it was.

        For plans that only explain (a gang's waiting reason): reading why a job waits must not
        change which node a later job gets.
        """
        state = self._rng.bit_generator.state
        try:
            yield
        finally:
            self._rng.bit_generator.state = state

    def freed_mark(self) -> tuple[object, int]:
        """A mark of now for still_fails."""
        return self._freed.mark()

    def still_fails(self, pod: Request, exclude: frozenset[str], mark: tuple[object, int]) -> bool:
        """Whether a one-pod plan of `pod` that failed at `mark` (with these excluded nodes) fails now
        for sure: no node that gained room since fits it (freed.py); False when that is not known."""
        rows = self._freed.since(mark, limit=16)
        if rows is None:
            return False
        mask = self._mask(exclude)
        if mask is not None:
            rows = rows[~mask[rows]]
        return not (len(rows) and self._arrays.feasible_in(pod, rows).any())

    def fits_empty(self, job: Job) -> bool:
        """Whether the job could be placed on the initial cluster (with no job committed)."""
        key = tuple(job.pods)
        known = self._shared.fits_empty.get(key)
        if known is None:
            if self._shared.empty is None:
                empty = self.fork()
                empty.release_many(empty.jobs)
                self._shared.empty = empty
            empty = self._shared.empty
            if len(key) == 1:  # one pod: some node fits it (no scores needed)
                known = bool(empty._arrays.feasible_now(key[0], self.policy).any())
            else:
                known = empty._plan_pods(key, frozenset())[0] is not None
            self._shared.fits_empty[key] = known
        return known

    # ----- holding ------------------------------------------------------------------------------------

    def amounts(self, job: Job, plan: Plan) -> Amounts:
        """What the job holds under the plan: milli-GPU (total and per model) and GPU memory bytes.

        A whole GPU counts 1000 milli and its memory; a fraction its share of the GPU
        (the larger of compute and memory) and the memory asked, or, when asked by
        compute only, that share of the GPU's memory. CPU-only pods hold nothing here.
        """
        out: Amounts = {}
        for request, pod in zip(job.pods, plan.pods, strict=True):
            node = self._base[self._arrays.index_of(pod.node)]
            for uuid in pod.gpus:
                g = node.gpu(uuid)
                if request.kind == "fraction":
                    milli = request.share_on(g)
                    mem = request.gpu_memory_bytes or g.memory_total_bytes * milli // MILLI_PER_GPU
                else:
                    milli, mem = MILLI_PER_GPU, g.memory_total_bytes
                for key, value in ((GPU, milli), (GPU_MEMORY, mem), (model_key(g.model), milli)):
                    out[key] = out.get(key, 0) + value
        return out

    def commit(self, job_name: str, job: Job, plan: Plan) -> None:
        """Hold the plan's resources for the job; InvalidState (and nothing held) if it does not fit."""
        if job_name in self._jobs:
            raise InvalidState(
                f"job {job_name} is already committed", hint="release it before committing again"
            )
        if len(plan.pods) != len(job.pods):
            raise InvalidState(
                f"job {job_name}: the plan places {len(plan.pods)} pods, the job has {len(job.pods)}"
            )
        undo: list[tuple[int, NodeState]] = []
        try:
            for request, pod in zip(job.pods, plan.pods, strict=True):
                try:
                    row = self._arrays.index_of(pod.node)
                except KeyError:
                    raise InvalidState(f"job {job_name}: the plan names an unknown node {pod.node}") from None
                state = self._arrays.node_state(row)
                self._set_row(row, apply_request(state, request, pod.gpus))
                undo.append((row, state))
        except InvalidState:
            for row, state in reversed(undo):
                self._set_row(row, state)
            raise
        books_undo = self._books_undo
        if books_undo is not None:
            books_undo.jobs.setdefault(job_name, None)
            for row, _ in undo:
                books_undo.alloc.setdefault(row, self._alloc.get(row))
        for request, pod, (row, _) in zip(job.pods, plan.pods, undo, strict=True):
            self._alloc[row] = (*self._alloc.get(row, ()), Allocation(job_name, request, pod.gpus))
        rows = tuple(dict.fromkeys(row for row, _ in undo))
        mark = _mark(next(self._shared.marks))
        footprint = tuple(
            (
                row,
                q.gpu_milli if q.kind == "fraction" else MILLI_PER_GPU * len(pod.gpus),
                q.cpu_milli,
                q.memory_bytes,
                mark,
                _KINDS[q.kind],
                self._slot_mask(row, pod.gpus),
                q.gpu_memory_bytes if q.kind == "fraction" else 0,
            )
            for q, pod, (row, _) in zip(job.pods, plan.pods, undo, strict=True)
        )
        self._jobs[job_name] = _Held(
            job=job, plan=plan, rows=rows, amounts=self.amounts(job, plan), footprint=footprint
        )

    def _slot_mask(self, row: int, uuids: Sequence[str]) -> int:
        """The GPU slots of these GPUs of the row's node, as a bit mask (NodeView.footprint)."""
        slots = self._shared.slots.get(row)
        if slots is None:
            slots = self._shared.slots[row] = {g.uuid: s for s, g in enumerate(self._base[row].gpus)}
        mask = 0
        for uuid in uuids:
            mask |= 1 << slots[uuid]
        return mask

    def release(self, job_name: str) -> None:
        """Undo the job's commit exactly: each of its nodes is rebuilt from its initial state."""
        self.release_many((job_name,))

    def release_many(self, job_names: Sequence[str]) -> None:
        """Release several jobs at once (each touched node rebuilt once); InvalidState before any change
        if one is not committed."""
        gone = set(job_names)
        missing = [n for n in gone if n not in self._jobs]
        if missing:
            raise InvalidState(
                f"job {sorted(missing)[0]} is not committed", hint="release only jobs that were committed"
            )
        rows = dict.fromkeys(row for name in gone for row in self._jobs[name].rows)
        books_undo = self._books_undo
        if books_undo is not None:
            for name in gone:
                books_undo.jobs.setdefault(name, self._jobs[name])
            for row in rows:
                books_undo.alloc.setdefault(row, self._alloc[row])
        for name in gone:
            del self._jobs[name]
        if len(self._released) > RELEASED_LOG_MAX:  # started afresh: its next reader looks every record up
            self._released = []
        self._released.extend(gone)
        states: dict[int, NodeState] = {}
        for row in rows:
            remaining = tuple(a for a in self._alloc[row] if a.job not in gone)
            if remaining:
                self._alloc[row] = remaining
            else:
                del self._alloc[row]
            states[row] = rebuild(self._base[row], remaining)
        self._set_rows(states)
        self._freed.add(np.fromiter(states, dtype=np.int64, count=len(states)))
        if gone:
            self._epoch = next(self._shared.epochs)

    def held(self, job_name: str) -> Amounts:
        """What a committed job holds (see amounts)."""
        return dict(self._jobs[job_name].amounts)

    def held_gpu(self, job_name: str) -> int:
        """The milli-GPU a committed job holds (held()[gpu], without copying the amounts)."""
        return self._jobs[job_name].amounts.get(GPU, 0)

    def plan_of(self, job_name: str) -> Plan:
        """The plan a committed job holds."""
        return self._jobs[job_name].plan

    def job_of(self, job_name: str) -> Job:
        """The job committed under this name."""
        return self._jobs[job_name].job

    # ----- amounts ------------------------------------------------------------------------------------

    def _amounts_now(self) -> Amounts:
        a = self._arrays
        share = np.where(self._usable, a.share, 0).sum(axis=1)
        out: Amounts = {GPU: int(share.sum()), GPU_MEMORY: int(np.where(self._usable, a.gmem_free, 0).sum())}
        per_model = np.bincount(a._model_of, weights=share, minlength=len(a._model_names))
        for m, name in enumerate(a._model_names):
            if name and (a._model_of == m).any():
                out[model_key(name)] = int(per_model[m])
        return out

    def free(self) -> Amounts:
        """What is free now: allocatable milli-GPU (total and per model) and free GPU memory bytes."""
        return self._amounts_now()

    def capacity(self) -> Amounts:
        """What the initial cluster offers, in the units of free()."""
        return dict(self._capacity)

    # ----- energy -------------------------------------------------------------------------------------

    def nodes_busy(self) -> int:
        """How many nodes have at least one busy GPU (powered, in energy.py's model)."""
        return int((self._busy > 0).sum())

    def gpu_activity(self) -> dict[str, GpuActivity]:
        """Per GPU model: busy GPUs, idle GPUs on powered nodes, and GPUs on dark nodes, right now."""
        a = self._arrays
        out: dict[str, GpuActivity] = {}
        powered = self._busy > 0
        for m, name in enumerate(a._model_names):
            rows = a._model_of == m
            if not name or not rows.any():
                continue
            busy = int(self._busy[rows].sum())
            on = int(self._gpus[rows & powered].sum())
            out[name] = GpuActivity(
                busy=busy, idle_powered=on - busy, dark=int(self._gpus[rows & ~powered].sum())
            )
        return out

    # ----- what-if ------------------------------------------------------------------------------------

    def _fork_fields(self, books: bool = True) -> dict[str, object]:
        fields = dict(self.__dict__)
        fields.update(
            _arrays=self._arrays.fork(),
            _alloc=dict(self._alloc) if books else self._alloc,
            _jobs=dict(self._jobs) if books else self._jobs,
            _rng=copy.deepcopy(self._rng),
            _used=self._used.copy(),
            _busy=self._busy.copy(),
            _journal=None,
            _books_undo=None,
            _released=[] if books else self._released,
            _freed=FreedLog(),
        )
        return fields

    def fork(self, *, books: bool = True) -> ClusterCapacity:
        """An independent copy (same jobs, same free GPUs) for what-if; the original is untouched.

        books=False: the fork shares the records of committed jobs with the original, for a fork
        that is only planned on (and shown states, nodeview.py): never commit or release on it.
        """
        new = ClusterCapacity.__new__(ClusterCapacity)
        new.__dict__.update(self._fork_fields(books))
        return new

    @contextmanager
    def trial(self) -> Iterator[ClusterCapacity]:
        """Undo on exit every commit and release made inside the block (not nestable)."""
        if self._journal is not None:
            raise InvalidState("trials do not nest", hint="use fork() for a what-if inside a trial")
        saved = (self._epoch, copy.deepcopy(self._rng))
        self._journal = {}
        self._books_undo = _BooksUndo()
        try:
            yield self
        finally:
            journal, self._journal = self._journal, None
            books_undo, self._books_undo = self._books_undo, None
            for row, state in journal.items():
                self._set_row(row, state)
            self._freed.add(np.fromiter(journal, dtype=np.int64, count=len(journal)))
            books_undo.put_back(self._alloc, self._jobs)
            self._released.extend(books_undo.jobs)  # their records changed back: listed as releases are
            self._epoch, self._rng = saved
