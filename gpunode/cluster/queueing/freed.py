"""Which nodes may have gained room since a moment: the history a failed one-pod plan is checked against.

A one-pod job plans exactly when some node outside its excluded nodes fits its pod, and a node
gains room only when a job on it is released (or a trial is undone); commits only take room away.
So a one-pod job that failed at some moment still fails now when none of the nodes that gained room
since then fits it: checking those few nodes is exact and much cheaper than scoring the cluster
(ClusterCapacity.still_fails; admit.py uses it). FreedLog is that history, with marks.
"""

from __future__ import annotations

import numpy as np

from gpunode.placement.arrays import IntArray

KEEP = 2048  # entries kept; a mark older than that is answered "unknown" (the caller plans in full)


class FreedLog:
    """The rows that gained room, release by release, and marks to ask which did since."""

    def __init__(self) -> None:
        self._entries: list[IntArray] = []
        self._base = 0  # the number of entries dropped from the front
        self._token = object()  # marks of another log (a fork's) are not this log's

    def add(self, rows: IntArray) -> None:
        """Record rows that may have gained room."""
        self._entries.append(rows)
        if len(self._entries) >= 2 * KEEP:
            del self._entries[:KEEP]
            self._base += KEEP

    def mark(self) -> tuple[object, int]:
        """A mark of now."""
        return self._token, self._base + len(self._entries)

    def since(self, mark: tuple[object, int], limit: int) -> IntArray | None:
        """The rows that gained room after the mark (sorted, unique); None when not known (a mark of
        another log, or one older than the history kept) or more than `limit` entries ago."""
        token, seq = mark
        if token is not self._token or seq < self._base:
            return None
        entries = self._entries[seq - self._base :]
        if len(entries) > limit:
            return None
        if not entries:
            return np.zeros(0, dtype=np.int64)
        return np.unique(np.concatenate(entries))
