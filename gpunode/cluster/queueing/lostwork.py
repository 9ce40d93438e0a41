"""The running jobs of each leaf queue in order of the work a stop would lose, for the victim search.

preempt.preemption_for takes the eligible running jobs with the least lost work first: by
(now - since) x milli-GPU held, then fewest pods, then name, where since is the start or the
last checkpoint. Among the jobs of one queue holding the same milli-GPU that order is the order
of since, latest first, whatever `now` is; so LostWork keeps one sorted list per (queue,
milli-GPU held), updated when a job starts, stops or checkpoints, and the search merges those
few lists, reading only as many jobs as it needs instead of every running job.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Iterator

from gpunode.cluster.queueing.model import GPU, RunningJob

_Key = tuple[float, int, str]  # (-since, pods, name); (0.0, pods, name) for jobs that hold no GPU


class LostWork:
    """Sorted lists of running jobs per (queue, milli-GPU held); see the module docstring."""

    def __init__(self) -> None:
        self._lists: dict[str, dict[int, list[_Key]]] = {}
        self._where: dict[str, tuple[str, int, _Key]] = {}

    def add(self, r: RunningJob) -> None:
        """A job started (or checkpointed: call remove first)."""
        job = r.job
        held = r.usage.get(GPU, 0)
        key = (-r.since if held else 0.0, len(job.pods), job.name)
        bisect.insort(self._lists.setdefault(job.queue, {}).setdefault(held, []), key)
        self._where[job.name] = (job.queue, held, key)

    def remove(self, name: str) -> None:
        """A job stopped (ignored if not known)."""
        where = self._where.pop(name, None)
        if where is None:
            return
        queue, held, key = where
        lst = self._lists[queue][held]
        del lst[bisect.bisect_left(lst, key)]

    def in_order(self, queues: Iterable[str], now: float) -> Iterator[tuple[float, int, str]]:
        """(lost work, pods, name) of the running jobs of these queues, least lost work first, as
        preemption_for orders them ((now - since) x milli-GPU held)."""
        heap: list[tuple[float, int, str, int, int, list[_Key]]] = []
        for q in queues:
            for held, lst in self._lists.get(q, {}).items():
                if lst:
                    neg, pods, name = lst[0]
                    heap.append(((now + neg) * held, pods, name, 0, held, lst))
        heapq.heapify(heap)  # names are unique, so entries never compare past the name
        while heap:
            lost, pods, name, i, held, lst = heap[0]
            yield lost, pods, name
            i += 1
            if i < len(lst):
                neg, pods, name = lst[i]
                heapq.heapreplace(heap, ((now + neg) * held, pods, name, i, held, lst))
            else:
                heapq.heappop(heap)
