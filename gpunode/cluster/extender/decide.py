"""Deciding a bind and reserving its GPUs as one step, so that concurrent binds never share a GPU share.

kube-scheduler binds many pods at once, each from its own connection, and the
HTTP server runs them in several worker threads. If one bind computed a node's
state, then another bind reserved on that node, and only then the first one
reserved, both could take the same GPU. So the node's state (annotation plus
every live reservation), the fit, the choice of GPUs and the reservation happen
under one lock of that node (NodeLocks: a fixed set of locks, a node hashed to
one of them). Nothing slow runs under it: the pod is read and the workload and
policy are looked up before, and the Binding is written after, by the caller,
who releases the reservation (`Reservations.release(uid, only=...)`) if that
write fails. Requests about other nodes, and filter and prioritize, never wait
for it. No I/O.
"""

from __future__ import annotations

import threading

from gpunode.cluster.extender.nodes import NodeCache
from gpunode.cluster.extender.queued import marked_fit
from gpunode.cluster.extender.reservations import Reservation, Reservations, apply_reservations
from gpunode.placement import Request, TargetWorkload, score_node, unfit_reason

STRIPES = 64


class NodeLocks:
    """One lock per node, out of a fixed set of STRIPES (two nodes may share one; no node has two)."""

    def __init__(self, stripes: int = STRIPES) -> None:
        self._locks = tuple(threading.Lock() for _ in range(stripes))

    def of(self, node: str) -> threading.Lock:
        """The lock that guards deciding and reserving on `node`."""
        return self._locks[hash(node) % len(self._locks)]


def decide_and_reserve(
    *,
    locks: NodeLocks,
    nodes: NodeCache,
    reservations: Reservations,
    uid: str,
    key: str,
    node: str,
    request: Request,
    policy: str,
    workload: TargetWorkload | None,
    gpus: tuple[str, ...] | None = None,
) -> Reservation | str:
    """Reserve GPUs of `node` for the pod (a final reservation), or say why not (the bind's Error).

    The state the decision sees counts every live reservation on the node but the pod's own
    provisional one; a pod that already holds a final reservation (a bind of it in progress or
    done) is refused, so two binds of one pod cannot both go ahead. `gpus`: the GPUs the queue
    controller's admission names; exactly these are reserved, or the bind is refused when they no
    longer take the pod (the controller re-plans), never others.
    """
    with locks.of(node):
        view = nodes.get(node)
        state = apply_reservations(view, reservations, skip_pod=uid)
        if state is None:
            return f"node {node}: {view.reason}"
        held = reservations.final_of(uid)
        if held is not None:
            return f"pod {key} is already being bound (GPUs reserved on node {held.node})"
        if gpus is not None:
            if (why := marked_fit(state, request, node, gpus)) is not None:
                return f"pod {key}: {why}"
            chosen = gpus
        elif (why := unfit_reason(state, request)) is not None:
            return f"pod {key} no longer fits node {node}: {why}"
        else:
            choice = score_node(state, request, policy=policy, workload=workload)
            if choice is None:
                return f"pod {key} no longer fits node {node}: no GPU choice"
            chosen = choice.gpu_uuids
        return reservations.reserve(
            pod_uid=uid,
            pod_key=key,
            node=node,
            gpu_uuids=chosen,
            request=request,
            final=True,
            annotation=view.fingerprint,
        )
