"""Runtime estimates corrected from history: what backfill plans a job with, learned per queue.

Users' runtime estimates are poor and biased (most under- or over-estimate by a factor
that is steady for one team): EASY backfill that trusts them either lets jobs run past
a reservation's start (optimistic estimates) or passes over jobs that would have fitted
(pessimistic ones). RuntimeHistory learns, per leaf queue, from the jobs that completed:

- with an estimate: the mean of log(actual / estimate) over the queue's last WINDOW
  completions; a new job's estimate is multiplied by exp(that mean) once MIN_SAMPLES
  have completed (before that, the estimate as given);
- without one: the geometric mean of the actual runtimes of the queue's last WINDOW
  completions without an estimate, per size (one GPU or less, a node's worth, more);
  the configured default until MIN_SAMPLES have completed.

Only completions count (a preempted job's runtime is not its length). The history lives
in memory: a restarted controller learns again from the jobs that complete after it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TypeVar

from gpunode.cluster.queueing.model import Job
from gpunode.contract.names import MILLI_PER_GPU

K = TypeVar("K")
WINDOW = 50
MIN_SAMPLES = 3
FACTOR_BOUNDS = (1 / 50, 50.0)  # a learned factor is kept within these


def _size(job: Job) -> int:
    gpus = job.gpu_milli / MILLI_PER_GPU
    return 0 if gpus <= 1 else 1 if gpus <= 8 else 2


class RuntimeHistory:
    """The per-queue record of completed jobs' runtimes against their estimates (see the module docstring)."""

    def __init__(self) -> None:
        self._ratios: dict[str, deque[float]] = {}
        self._ratio_sums: dict[str, float] = {}
        self._runtimes: dict[tuple[str, int], deque[float]] = {}
        self._runtime_sums: dict[tuple[str, int], float] = {}

    def completed(self, job: Job, runtime: float) -> None:
        """A job of this queue ran `runtime` seconds to completion."""
        if runtime <= 0:
            return
        if job.runtime_estimate is not None and job.runtime_estimate > 0:
            _push(self._ratios, self._ratio_sums, job.queue, math.log(runtime / job.runtime_estimate))
        else:
            _push(self._runtimes, self._runtime_sums, (job.queue, _size(job)), math.log(runtime))

    def estimate(self, job: Job, default: float) -> float:
        """The runtime to plan the job with: its estimate corrected by its queue's history, else learned."""
        if job.runtime_estimate is not None:
            seen = self._ratios.get(job.queue)
            if seen is None or len(seen) < MIN_SAMPLES:
                return job.runtime_estimate
            lo, hi = FACTOR_BOUNDS
            factor = min(max(math.exp(self._ratio_sums[job.queue] / len(seen)), lo), hi)
            return job.runtime_estimate * factor
        key = (job.queue, _size(job))
        runs = self._runtimes.get(key)
        if runs is None or len(runs) < MIN_SAMPLES:
            return default
        return math.exp(self._runtime_sums[key] / len(runs))


def _push(values: dict[K, deque[float]], sums: dict[K, float], key: K, x: float) -> None:
    q = values.setdefault(key, deque())
    q.append(x)
    sums[key] = sums.get(key, 0.0) + x
    if len(q) > WINDOW:
        sums[key] -= q.popleft()
