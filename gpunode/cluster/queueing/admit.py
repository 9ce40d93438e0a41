"""Admission trials of the Scheduler (engine.py): one job now, whole or (kube's way) pod by pod.

Part of the Scheduler, split from engine.py to keep modules small. A job's
shape (its pods) that failed to place is remembered with the capacity epoch and
the nodes it had to keep off; at the same epoch it fails again without a trial.
Within one epoch, a one-pod job is not tried when a pod of the same kind asking
no more of any resource (GPUs, share, GPU memory, CPU, memory) failed with no
more nodes excluded: feasibility on a node only shrinks as a request grows, so
the trial would fail. Within one cycle the same rule lets the walk pass over the
jobs of larger shapes at once (Larger; only when no waiting reasons are read, as
in the time simulator, since a job passed over keeps its last reason).
tests/cluster/queueing/test_reserve_engine.py compares whole runs with these
shortcuts and the fast reservation search switched off.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from gpunode.cluster.queueing.model import GPU, Amounts, Decisions, Job, Plan
from gpunode.placement.model import Request

if TYPE_CHECKING:
    from gpunode.cluster.queueing.capacity import ClusterCapacity
    from gpunode.cluster.queueing.pending import Nomination, Pending
    from gpunode.cluster.queueing.presets import Preset
    from gpunode.cluster.queueing.quotas import QuotaBook
    from gpunode.cluster.queueing.reasons import Reasons


class Admit:
    """_try, _try_pods and _exclusion of a Scheduler (mixed into it)."""

    if TYPE_CHECKING:
        cap: ClusterCapacity
        book: QuotaBook
        preset: Preset
        reasons: Reasons
        partial_gangs: set[str]
        _failed: dict[tuple[int, frozenset[str]], tuple[int, str]]
        _fits_empty: dict[int, bool]  # shape -> fits the empty cluster
        _why_cache: dict[tuple[int, frozenset[str], bool], str]  # emptied by _exclusions
        _reserved: str | None
        _planned_fail: dict[
            int, tuple[int, frozenset[str]]
        ]  # shape -> (epoch, excluded) of its last failed plan
        _nominated: dict[str, Nomination]
        _excl_levels: tuple[frozenset[str], ...]
        _version: int

        def _start(
            self,
            p: Pending,
            plan: Plan,
            amounts: Amounts,
            now: float,
            d: Decisions,
            units: list[tuple[str, Job, Plan]] | None = None,
        ) -> None: ...
        def _free_gpu(self) -> int: ...
        def _shape_of(self, pods: tuple[object, ...]) -> int: ...
        def _is_reserved(self, name: str) -> bool: ...
        def _level(self, p: Pending, now: float) -> int: ...
        def _reserved_exclusion(self, p: Pending, now: float) -> frozenset[str]: ...

    def _try(self, p: Pending, now: float, d: Decisions) -> str:
        """Try to admit p now: "admitted", "quota", "capacity" or "never"."""
        job = p.job
        over = self.book.over_limit(job.queue, {GPU: p.demand.get(GPU, 0)})
        if over is not None:
            p.why = self.reasons.over_quota(p, *over)
            return "quota"
        if not self.preset.gang:
            return self._try_pods(p, now, d)
        fits = self._fits_empty.get(p.shape)
        if fits is None:
            fits = self._fits_empty[p.shape] = self.cap.fits_empty(job)
        if not fits:
            p.why = self.reasons.never_fits(p)
            return "never"
        exclude = self._exclusion(p, now)
        key = (p.shape, exclude)
        failed = self._failed.get(key)
        if failed is not None and failed[0] == self.cap.epoch:
            p.why = failed[1]
            return "capacity"
        plan = None
        placed: int | None = None  # members placed before one found no room, when a plan was tried
        if p.demand.get(GPU, 0) <= self._free_gpu() and not self._smaller_failed(job, exclude):
            single = len(job.pods) == 1
            mark = self._fail_marks.get(key) if single else None
            if mark is None or not self.cap.still_fails(job.pods[0], exclude, mark):
                plan, placed = self.cap.plan_counted(job, exclude_nodes=exclude)
            if plan is None and single:
                self._add_small_fail(job.pods[0], exclude)
                if len(self._fail_marks) > 65536:
                    self._fail_marks.clear()
                self._fail_marks[key] = self.cap.freed_mark()
        if plan is None:
            p.why = self._no_room(p, exclude, placed)
            self._failed[key] = (self.cap.epoch, p.why)
            return "capacity"
        amounts = self.cap.amounts(job, plan)
        over = self.book.over_limit(job.queue, amounts)
        if over is not None:
            p.why = self.reasons.over_quota(p, *over)
            return "quota"
        self._start(p, plan, amounts, now, d)
        return "admitted"

    def _try_pods(self, p: Pending, now: float, d: Decisions) -> str:
        """kube-scheduler's way: place the job's remaining pods one by one; each placed pod is held."""
        job = p.job
        exclude = self._exclusion(p, now)
        while len(p.held) < len(job.pods):
            i = len(p.held)
            pod_job = replace(job, name=f"{job.name}/{i}", pods=(job.pods[i],))
            key = (self._shape_of(pod_job.pods), exclude)
            failed = self._failed.get(key)
            if failed is not None and failed[0] == self.cap.epoch:
                plan = None
            else:
                plan = self.cap.plan(pod_job, exclude_nodes=exclude)
            if plan is None:
                self._failed[key] = (self.cap.epoch, "")
                p.why = self.reasons.pods_placed(p)
                return "capacity"
            self.cap.commit(pod_job.name, pod_job, plan)
            self._version += 1
            p.held.append((pod_job.name, pod_job, plan))
            if len(p.held) < len(job.pods) and job.gang:
                self.partial_gangs.add(job.name)
        plan = Plan(pods=tuple(pl.pods[0] for _, _, pl in p.held))
        units = list(p.held)
        p.held.clear()
        self._start(p, plan, self.cap.amounts(job, plan), now, d, units=units)
        return "admitted"

    def _exclusion(self, p: Pending, now: float) -> frozenset[str]:
        """Nodes p must stay off: room promised to other preemptors and the nodes of every
        reservation (but its own) that starts before p would end."""
        if p.job.name in self._nominated:
            nodes = {n for name, nom in self._nominated.items() if name != p.job.name for n in nom.nodes}
            return frozenset(nodes)
        if self._is_reserved(p.job.name):
            return self._reserved_exclusion(p, now)
        return self._excl_levels[self._level(p, now)]

    def _smaller_failed(self, job: Job, exclude: frozenset[str]) -> bool:
        """Whether a one-pod job fails for sure: a pod of its family asking no more of anything failed a
        trial at this epoch, keeping off no more nodes (a pod plans exactly when a node outside its
        excluded nodes fits it, a node that does not fit a pod fits no larger one, and commits only take
        room away)."""
        return len(job.pods) == 1 and self._pod_failed(job.pods[0], exclude)

    def _pod_failed(self, q: Request, exclude: frozenset[str]) -> bool:
        """_smaller_failed for one pod."""
        if self._small_fails_epoch != self.cap.epoch:
            self._small_fails_epoch = self.cap.epoch
            self._small_fails = {}
            return False
        gpus, milli, gmem, cpu, mem = q.gpus, q.gpu_milli, q.gpu_memory_bytes, q.cpu_milli, q.memory_bytes
        for f, excluded in self._small_fails.get(_family(q), ()):  # the hot loop: _no_more, inlined
            if (
                f.gpus <= gpus
                and f.gpu_milli <= milli
                and f.gpu_memory_bytes <= gmem
                and f.cpu_milli <= cpu
                and f.memory_bytes <= mem
                and excluded <= exclude
            ):
                return True
        return False

    def pod_fits_now(self, q: Request, exclude: frozenset[str]) -> bool:
        """Whether some node outside `exclude` has room for the one pod q now (a gang member, for its
        waiting reason); a pod found not to fit is remembered with the failed one-pod trials."""
        if self._pod_failed(q, exclude):
            return False
        if self.cap.fits_now(q, exclude_nodes=exclude):
            return True
        self._add_small_fail(q, exclude)
        return False

    def _add_small_fail(self, q: Request, exclude: frozenset[str]) -> None:
        """Remember a failed one-pod trial for _smaller_failed, keeping only the failures no other one
        covers (one asking no more of anything and keeping off no more nodes covers every pod it would)."""
        fails = self._small_fails.setdefault(_family(q), [])
        fails[:] = [(f, excluded) for f, excluded in fails if not (_no_more(q, f) and exclude <= excluded)]
        fails.append((q, exclude))

    def _no_room(self, p: Pending, exclude: frozenset[str], placed: int | None = None) -> str:
        """reasons.no_room, kept for one-pod jobs until the head of line's reservation changes (it is the
        only state that text reads besides the job's GPUs, its exclusion and whether it is that head).
        `placed`: the members the failed plan placed, when a plan was tried."""
        if p.job.gang:
            return self.reasons.no_room(p, exclude, placed)
        key = (p.job.gpu_milli, exclude, p.job.name == self._reserved)
        why = self._why_cache.get(key)
        if why is None:
            why = self._why_cache[key] = self.reasons.no_room(p, exclude)
        return why

    _small_fails_epoch = -1
    _fail_marks: dict[tuple[int, frozenset[str]], tuple[object, int]]  # (shape, excluded) -> freed mark
    _small_fails: dict[tuple[str, frozenset[str] | None], list[tuple[Request, frozenset[str]]]]


class Larger:
    """For each one-pod shape of at most one GPU, the shapes of its family asking no less of anything.

    When such a shape fails to place, every larger one fails too (a node that does not fit a pod fits
    no larger one), so engine._walk marks them dead with it and passes over their jobs without a trial.
    Only shapes of at most one GPU: a failing multi-GPU job may get a further reservation
    (rooms._reserve_extra), so each of those is tried. Shapes are numbered by engine._shape_of.
    """

    def __init__(self) -> None:
        self._requests: dict[int, Request] = {}
        self._larger: dict[int, list[int]] = {}
        self._arrays: dict[int, npt.NDArray[np.int64]] = {}

    def add(self, shape: int, pods: tuple[Request, ...]) -> None:
        """Register a new shape."""
        if len(pods) != 1 or pods[0].kind == "mig" or pods[0].gpus > 1:
            return
        q = pods[0]
        mine = self._larger[shape] = []
        for other, r in self._requests.items():
            if _family(r) != _family(q):
                continue
            if _no_more(q, r):
                mine.append(other)
            if _no_more(r, q):
                self._larger[other].append(shape)
                self._arrays.pop(other, None)
        self._requests[shape] = q

    def of(self, shape: int) -> npt.NDArray[np.int64] | None:
        """The shapes larger than this one, or None when there are none (or it is not a one-pod shape of
        at most one GPU)."""
        larger = self._arrays.get(shape)
        if larger is None:
            found = self._larger.get(shape)
            if not found:
                return None
            larger = self._arrays[shape] = np.array(found, dtype=np.int64)
        return larger


def _family(q: Request) -> tuple[str, frozenset[str] | None]:
    """Pods comparable by size: the same kind of GPU request and the same accepted models."""
    return q.kind, q.gpu_models


def _no_more(f: Request, q: Request) -> bool:
    """Whether f asks no more than q of any resource."""
    return (
        f.gpus <= q.gpus
        and f.gpu_milli <= q.gpu_milli
        and f.gpu_memory_bytes <= q.gpu_memory_bytes
        and f.cpu_milli <= q.cpu_milli
        and f.memory_bytes <= q.memory_bytes
    )
