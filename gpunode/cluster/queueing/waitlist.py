"""A queue's waiting jobs in order, with their shapes and runtimes alongside for fast passing over.

In a busy cycle most of a queue's waiting jobs belong to a few dozen shapes that already failed in
the same cycle (engine._walk passes over a job whose shape failed at level 0, or at a reservation's
level when the job would run past that reservation's start). A WaitList is the ordered Python list
of Pending jobs the engine walks by index, kept in step with numpy arrays of their shape numbers and
runtimes, so that a run of such jobs is passed over by a few vectorised lookups instead of a Python
step per job. Indices, order and every visit stay exactly those of the plain list (the time
simulator's results are byte-identical with and without it).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from gpunode.cluster.queueing.pending import Pending

_FIRST_STEP = 32  # jobs looked at by the first lookup; each further lookup looks at 4 x more


class WaitList(list["Pending"]):
    """list[Pending] in Pending.key order whose add, pop and del keep the jobs' shapes, runtimes and keys in
    step; other changes are refused."""

    def __init__(self) -> None:
        super().__init__()
        self._shapes: npt.NDArray[np.int64] = np.zeros(64, dtype=np.int64)
        self._runtimes: npt.NDArray[np.float64] = np.zeros(64, dtype=np.float64)
        self._keys: list[tuple[int, float, int]] = []  # the jobs' keys, for bisect without a key function

    def insert(self, index: SupportsIndex, p: Pending) -> None:
        """Insert p before index, its shape, runtime and key with it (add chooses the index that keeps the
        order)."""
        n = len(self)
        i = min(max(int(index) if int(index) >= 0 else n + int(index), 0), n)
        if n + 1 > len(self._shapes):
            self._shapes = np.concatenate([self._shapes, np.zeros_like(self._shapes)])
            self._runtimes = np.concatenate([self._runtimes, np.zeros_like(self._runtimes)])
        for arr, value in ((self._shapes, p.shape), (self._runtimes, p.runtime)):
            arr[i + 1 : n + 1] = arr[i:n]
            arr[i] = value
        super().insert(i, p)
        self._keys.insert(i, p.key)

    def pop(self, index: SupportsIndex = -1) -> Pending:
        """Remove and return the job at index, its shape with it."""
        n = len(self)
        i = int(index) if int(index) >= 0 else n + int(index)
        p = super().pop(i)
        del self._keys[i]
        self._shapes[i : n - 1] = self._shapes[i + 1 : n]
        self._runtimes[i : n - 1] = self._runtimes[i + 1 : n]
        return p

    def __delitem__(self, index: Any) -> None:
        if not isinstance(index, int):
            raise TypeError("WaitList deletes one job at a time")
        self.pop(index)

    def append(self, p: Pending) -> None:
        """Add p at the end."""
        self.insert(len(self), p)

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a WaitList changes only by insert, pop and del of one job")

    extend = remove = sort = reverse = clear = __setitem__ = __iadd__ = _refuse  # type: ignore[assignment]

    def add(self, p: Pending) -> None:
        """Insert p at its place in the order (Pending.key)."""
        self.insert(bisect.bisect_right(self._keys, p.key), p)

    def index_of(self, p: Pending) -> int:
        """The index of p, which must be in the list."""
        return bisect.bisect_left(self._keys, p.key)

    def next_unskipped(self, start: int, stop: int, now: float, dead: DeadShapes) -> int:
        """The first index in [start, stop) whose job engine._walk would not pass over by its shape's
        level alone (now + runtime > the shape's limit), or stop. The caller checks that job itself,
        and makes stop the next job the level rule does not apply to (a reserved job's)."""
        stop = min(stop, len(self))
        shapes, runtimes, limits = self._shapes, self._runtimes, dead.limits
        i, step = start, _FIRST_STEP
        while i < stop:
            j = min(stop, i + step)
            passed = (now + runtimes[i:j]) > limits[shapes[i:j]]
            k = int(passed.argmin())  # the first False, or 0 when all are True
            if not passed[k]:
                return i + k
            i, step = j, step * 4
        return stop


class DeadShapes:
    """The shapes of one queue that failed in this cycle: by shape number, the limit engine._walk reads.

    ANY (-inf) passes over every job of the shape; a reservation's start passes over the jobs that
    would end after it; +inf: not dead. `limit_of(shape)` gives the limit as a Python float (the
    walk's hot path), `limits` the array WaitList.next_unskipped reads.
    """

    def __init__(self, shapes: int) -> None:
        self.limits: npt.NDArray[np.float64] = np.full(shapes + 64, np.inf)
        self.limit_of = self.limits.item

    def get(self, shape: int) -> float | None:
        """The shape's limit, or None when it is not dead."""
        limit = float(self.limits[shape])
        return None if limit == np.inf else limit

    def set(self, shape: int, limit: float) -> None:
        """Mark shape dead up to limit."""
        self.limits[shape] = limit

    def lower(self, shapes: npt.NDArray[np.int64], limit: float) -> None:
        """Mark these shapes dead up to limit, where that passes over more of their jobs than before."""
        self.limits[shapes] = np.minimum(self.limits[shapes], limit)

    def covers(self, shapes: int) -> bool:
        """Whether the array has room for shape numbers below `shapes`."""
        return len(self.limits) >= shapes

    def grown(self, shapes: int) -> DeadShapes:
        """A copy with room for shape numbers below `shapes`."""
        out = DeadShapes(shapes)
        out.limits[: len(self.limits)] = self.limits
        return out

    def forget_levels(self, any_limit: float) -> None:
        """Drop the failures recorded against reservation levels (they moved), keep those at any_limit."""
        self.limits[self.limits != any_limit] = np.inf
