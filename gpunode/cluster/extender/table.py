"""The extender's node table: the nodes it knows, in placement's batch form, scored in bulk.

kube-scheduler asks about thousands of nodes per pod; scoring them one by one
with the per-node functions takes seconds. NodeTable keeps every node the
extender has seen as a row of a placement.batch.ClusterArrays (annotation state
plus live reservations), reloads a row when its annotation or reservations
change, and answers fit and score for a whole request in a few array
operations, the cached scores of unchanged nodes included. Nodes the batch form
does not cover are left to the per-node functions. No I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt

from gpunode.cluster.extender.nodes import NodeView
from gpunode.cluster.extender.reservations import Reservations, live_on, reserved_state
from gpunode.errors import InvalidState
from gpunode.placement import NodeState, Request, TargetWorkload
from gpunode.placement.arrays import check_batchable
from gpunode.placement.batch import ClusterArrays

log = logging.getLogger(__name__)


class NodeTable:
    """The nodes the extender knows, in placement's batch form, to fit and score thousands at once.

    Rows hold each node's annotation state with its live reservations applied;
    a row is reloaded when its annotation or reservations change, and the table
    is rebuilt when unknown nodes appear or the workload changes. Nodes the batch
    form does not cover, and a node holding the pod's own reservation, are left
    to the per-node functions (verdicts() leaves them out).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: ClusterArrays | None = None
        self._rows: dict[str, tuple[int, str, tuple[str, ...]]] = {}  # name -> (row, fingerprint, held)
        self._outside: set[str] = set()  # names the batch form does not cover
        self._workload_key: tuple[int, bool] = (-1, False)

    def _rebuild(
        self,
        views: Iterable[NodeView],
        reservations: Reservations,
        workload: TargetWorkload | None,
        version: int,
    ) -> None:
        states: list[NodeState] = []
        rows: dict[str, tuple[int, str, tuple[str, ...]]] = {}
        self._outside = set()
        for view in views:
            if view.state is None or view.name in rows:
                continue
            live = live_on(view, reservations)
            state = reserved_state(view.state, live)
            try:
                check_batchable(state)
            except InvalidState:
                self._outside.add(view.name)
                continue
            rows[view.name] = (len(states), view.fingerprint, tuple(sorted(r.pod_uid for r in live)))
            states.append(state)
        self._table = ClusterArrays(states, workload=workload)
        self._rows = rows
        self._workload_key = (version, workload is not None)

    def verdicts(
        self, views: list[NodeView], request: Request, **kwargs: object
    ) -> tuple[list[int], npt.NDArray[np.bool_], npt.NDArray[np.float64]]:
        """(positions in views the table covers, whether each fits, its score); keyword arguments as
        _verdicts. Should the batch form fail (a defect, a state it cannot hold), the table is dropped
        (rebuilt at the next request) and every node is left to the per-node functions, so that no node's
        state fails a request."""
        try:
            return self._verdicts(views, request, **kwargs)  # type: ignore[arg-type]
        except Exception as exc:
            log.warning("node table: batch scoring failed, nodes scored one by one: %r", exc)
            with self._lock:
                self._table, self._rows, self._outside = None, {}, set()
            return [], np.zeros(0, dtype=bool), np.zeros(0)

    def _verdicts(
        self,
        views: list[NodeView],
        request: Request,
        *,
        uid: str,
        known: Callable[[], Iterable[NodeView]],
        reservations: Reservations,
        reserved: frozenset[str],
        workload: TargetWorkload | None,
        version: int,
        policy: str,
    ) -> tuple[list[int], npt.NDArray[np.bool_], npt.NDArray[np.float64]]:
        """(positions in views the table covers, whether each fits, its score)."""
        empty: tuple[list[int], npt.NDArray[np.bool_], npt.NDArray[np.float64]] = (
            [],
            np.zeros(0, dtype=bool),
            np.zeros(0),
        )
        if request.kind == "mig":
            return empty
        with self._lock:
            positions: list[int] = []
            rows: list[int] = []
            table: ClusterArrays | None = None
            for attempt in (0, 1):
                table = self._table
                if table is None or (version, workload is not None) != self._workload_key:
                    self._rebuild([*known(), *views], reservations, workload, version)
                    continue
                positions, rows, unknown = self._collect(views, uid, reservations, reserved, table)
                if not unknown or attempt == 1:
                    break
                self._rebuild([*known(), *views], reservations, workload, version)
            if not positions or table is None:
                return empty
            feasible, score, _ = table.scores(request, policy)
            index = np.array(rows, dtype=np.int64)
            return positions, feasible[index], score[index]

    def _collect(
        self,
        views: list[NodeView],
        uid: str,
        reservations: Reservations,
        reserved: frozenset[str],
        table: ClusterArrays,
    ) -> tuple[list[int], list[int], bool]:
        positions: list[int] = []
        rows: list[int] = []
        unknown = False
        table_rows, outside = self._rows, self._outside
        for pos, view in enumerate(views):
            if view.state is None:
                continue
            known_row = table_rows.get(view.name)
            if known_row is None:
                unknown = unknown or view.name not in outside
                continue
            row, fingerprint, held = known_row
            if view.name in reserved:
                live = live_on(view, reservations)
                if any(r.pod_uid == uid for r in live):
                    continue  # its own reservation: the per-node path leaves it out
                now_held = tuple(sorted(r.pod_uid for r in live))
            else:
                live, now_held = [], ()
            if fingerprint != view.fingerprint or held != now_held:
                try:
                    table.replace_node(reserved_state(view.state, live))
                except (InvalidState, ArithmeticError, ValueError):
                    outside.add(view.name)
                    del table_rows[view.name]
                    continue
                table_rows[view.name] = (row, view.fingerprint, now_held)
            positions.append(pos)
            rows.append(row)
        return positions, rows, unknown
