"""The agent's record of unusable memory-cap regions: logged once, counted, then skipped.

A container can rewrite, truncate or remove its usage file at any moment and as
often as it likes, so a region may flip between usable and unusable many times
a second. Every agent path that reads a region (listing, usage, reclaim)
reports here; a region's problem is logged once per reason, stays recorded
(for the metric and for readers) until the region has read cleanly for
RECOVERY_S seconds, and disappears with the region's directory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpunode.errors import RegionDamaged

log = logging.getLogger("gpunode.node.memcap")

RECOVERY_S = 60.0


@dataclass(frozen=True)
class RegionProblem:
    """Why a region is unusable: its key and directory, the reason label, the one-line message and a hint."""

    key: str
    path: Path
    reason: str
    message: str
    hint: str

    @classmethod
    def of(cls, path: Path, err: RegionDamaged) -> RegionProblem:
        """The problem an error describes, for the region directory at path."""
        return cls(err.key, path, err.reason, str(err), err.hint)


@dataclass
class _Entry:
    problem: RegionProblem
    last_bad: float
    logged: set[str] = field(default_factory=set)


class ProblemLog:
    """Unusable regions by directory; thread-safe. clock is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, recovery_s: float = RECOVERY_S) -> None:
        self._clock = clock
        self.recovery_s = recovery_s
        self._lock = threading.Lock()
        self._entries: dict[Path, _Entry] = {}

    def bad(self, path: Path, err: RegionDamaged) -> None:
        """Record that the region at path is unusable; logs only a reason not logged for it yet.

        A region whose directory is gone (removed or replaced meanwhile) is not a problem.
        """
        if not path.is_dir():
            self.gone(path)
            return
        problem = RegionProblem.of(path, err)
        with self._lock:
            entry = self._entries.setdefault(path, _Entry(problem, 0.0))
            entry.problem, entry.last_bad = problem, self._clock()
            first = problem.reason not in entry.logged
            entry.logged.add(problem.reason)
        if first:
            log.warning(
                "memory-cap region %s skipped: %s (hint: %s)", problem.key, problem.message, problem.hint
            )

    def good(self, path: Path) -> None:
        """Record a clean read; the problem is dropped once no fault was seen for recovery_s."""
        with self._lock:
            entry = self._entries.get(path)
            if entry is None or self._clock() - entry.last_bad < self.recovery_s:
                return
            del self._entries[path]
        log.info("memory-cap region %s is usable again", entry.problem.key)

    def gone(self, path: Path) -> None:
        """Forget a region whose directory was removed."""
        with self._lock:
            self._entries.pop(path, None)

    def current(self, root: Path | None = None) -> tuple[RegionProblem, ...]:
        """The regions recorded as unusable (under root, if given) whose directory still exists, by key."""
        with self._lock:
            entries = [e for p, e in self._entries.items() if root is None or p.parent == root]
        out = []
        for entry in entries:
            if entry.problem.path.is_dir():
                out.append(entry.problem)
            else:
                self.gone(entry.problem.path)
        return tuple(sorted(out, key=lambda p: (str(p.path.parent), p.key)))


PROBLEMS = ProblemLog()


def region_problems(root: str | Path | None = None) -> tuple[RegionProblem, ...]:
    """The regions this process found unusable (under root, if given) and still considers so."""
    return PROBLEMS.current(Path(root) if root is not None else None)
