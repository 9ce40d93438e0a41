"""The extender's preempt verb: kube-scheduler's own preemption never acts for a pod a queue governs.

kube-scheduler (its DefaultPreemption PostFilter) runs when a pod fits no node. It dry-runs its in-tree
filters with lower-priority pods removed, and before it evicts anyone it POSTs the candidates to the
extenders that have a preemptVerb and manage one of the pod's resources: ExtenderPreemptionArgs
{Pod, NodeNameToVictims: {node: {Pods: [v1.Pod], NumPDBViolations}}} or, with nodeCacheCapable,
{Pod, NodeNameToMetaVictims: {node: {Pods: [{UID}], NumPDBViolations}}}. The answer,
ExtenderPreemptionResult {NodeNameToMetaVictims}, is the candidates it may still use: each node's victims
named by UID, only ones it sent (any other UID is an error there); an empty map ends the preemption.

kube-scheduler 1.20 counts nodes the extender's filter failed as worth preempting on (it does not read
FailedAndUnresolvableNodes). Without this verb a tenant could give a pod the queue holds a high
PriorityClass and have kube-scheduler evict other tenants' pods for it, which the filter would then still
refuse: a jump over the queue at others' expense. So:

- a GPU pod that belongs to a queue (waiting or admitted, queued.queue_hold): no candidates. The queue
  controller alone preempts for queues, with its notice; an admitted pod goes where its plan says;
- a GPU pod with an invalid request: no candidates (it fails every node whatever is evicted);
- any other pod (no GPU request, or GPUs outside every queue): the candidates as sent, kube-scheduler's
  own behaviour.

The body is checked whatever the verdict: a malformed one is BadRequest (400), as for the other verbs.
No I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.cluster.extender.binding import json_field
from gpunode.cluster.extender.pods import pod_key, request_from_pod
from gpunode.cluster.extender.queued import queue_hold
from gpunode.cluster.queuemark import MarkKey
from gpunode.errors import BadRequest, InvalidRequest, PlacementError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidates:
    """ExtenderPreemptionArgs read: the pod, and per node the victims' UIDs and PDB violations."""

    pod: Mapping[str, Any]
    victims: dict[str, dict[str, Any]]  # node -> MetaVictims {"Pods": [{"UID"}], "NumPDBViolations"}


def parse_preemption_args(body: object) -> Candidates:
    """ExtenderPreemptionArgs from decoded JSON (either victims form); BadRequest when the shape is wrong."""
    if not isinstance(body, Mapping):
        raise BadRequest("ExtenderPreemptionArgs must be a JSON object")
    pod = json_field(body, "Pod")
    if not isinstance(pod, Mapping):
        raise BadRequest("ExtenderPreemptionArgs.Pod is missing or not an object")
    meta, full = json_field(body, "NodeNameToMetaVictims"), json_field(body, "NodeNameToVictims")
    if meta is not None:
        return Candidates(pod, _victims(meta, "NodeNameToMetaVictims", _meta_uid))
    if full is not None:
        return Candidates(pod, _victims(full, "NodeNameToVictims", _pod_uid))
    raise BadRequest("ExtenderPreemptionArgs needs NodeNameToMetaVictims or NodeNameToVictims")


def _victims(value: object, field: str, uid_of: Callable[[object, str], str]) -> dict[str, dict[str, Any]]:
    if not isinstance(value, Mapping):
        raise BadRequest(f"ExtenderPreemptionArgs.{field} must be an object of node names")
    out: dict[str, dict[str, Any]] = {}
    for node, victims in value.items():
        where = f"ExtenderPreemptionArgs.{field}[{str(node)[:64]!r}]"
        if not isinstance(victims, Mapping):
            raise BadRequest(f"{where} must be an object with Pods and NumPDBViolations")
        pods = json_field(victims, "Pods")
        if pods is None:
            pods = []  # Go writes an empty slice as null
        if not isinstance(pods, list):
            raise BadRequest(f"{where}.Pods must be a list")
        violations = json_field(victims, "NumPDBViolations")
        violations = 0 if violations is None else violations
        if isinstance(violations, bool) or not isinstance(violations, int) or violations < 0:
            raise BadRequest(f"{where}.NumPDBViolations must be a count")
        uids = [uid_of(p, where) for p in pods]
        out[str(node)] = {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": violations}
    return out


def _meta_uid(pod: object, where: str) -> str:
    uid = json_field(pod, "UID") if isinstance(pod, Mapping) else None
    if not isinstance(uid, str) or not uid:
        raise BadRequest(f"{where}.Pods has an entry without a UID")
    return uid


def _pod_uid(pod: object, where: str) -> str:
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    if not isinstance(uid, str) or not uid:
        raise BadRequest(f"{where}.Pods has a pod without metadata.uid")
    return uid


def preemption_refusal(
    pod: Mapping[str, Any],
    *,
    memory_unit_bytes: int,
    namespaces: Mapping[str, str],
    mark_key: MarkKey | None = None,
) -> str | None:
    """Why kube-scheduler may not preempt for this pod (None: it may, as it would without the extender)."""
    try:
        request = request_from_pod(pod, memory_unit_bytes=memory_unit_bytes)
    except PlacementError as exc:
        return f"its GPU request is invalid ({exc}); no eviction makes room for it"
    if request is None:
        return None
    hold = queue_hold(pod, namespaces, mark_key)
    if hold is None:
        return None
    if hold.admitted is None:
        return f"it waits in queue {hold.queue}; only the queue controller preempts for queues"
    return f"the queue controller admitted it to node {hold.admitted.node}; only it preempts for queues"


def answer_preemption(
    body: object, *, memory_unit_bytes: int, namespaces: Mapping[str, str], mark_key: MarkKey | None = None
) -> dict[str, Any]:
    """The ExtenderPreemptionResult for ExtenderPreemptionArgs `body`; BadRequest when it is malformed."""
    args = parse_preemption_args(body)
    try:
        _, key = pod_key(args.pod)
    except InvalidRequest as exc:
        raise BadRequest(str(exc)) from exc
    why = preemption_refusal(
        args.pod, memory_unit_bytes=memory_unit_bytes, namespaces=namespaces, mark_key=mark_key
    )
    if why is None:
        return {"NodeNameToMetaVictims": args.victims}
    if args.victims:
        log.info("no preemption for pod %s on %d candidate node(s): %s", key, len(args.victims), why)
    return {"NodeNameToMetaVictims": {}}
