"""The scheduling gate gpunode.io/admission: which pods carry it, the spec change that releases a pod to its
planned node, and the patch the mutating webhook adds the gate with. No I/O.

A pod with any scheduling gate is never considered by kube-scheduler: no filter, no preemption for it, no
events. While a pod is gated the API server lets its spec narrow where it may run (nodeSelector keys
added, node affinity requirements added) and its gates be removed; once the last gate is gone, none of
that can change again. The controller admits a gated pod in two writes, in this order:

1. the signed admission mark (an annotation, as for any pod: gpunode.cluster.queuemark), on every
   member of the gang;
2. once every member carries it: one update of each member's spec that adds the plan's node as a
   required node-affinity requirement (matchFields metadata.name In [node], added to each of the pod's
   own terms: the exact Node, whatever its labels) and removes the gate (release_spec).

The node requirement and the gate's removal are one update, so a gang undone between the two writes
(the controller stopped after marking part of it) never keeps a node requirement it could not lose;
and a member is released only once the whole gang is marked, so no member of a partial gang is ever
offered to kube-scheduler. The extender still places the released pod on exactly the mark's GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpunode.contract.names import ADMISSION_GATE

NODE_NAME_FIELD = "metadata.name"


def gates_of(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The pod's scheduling gates (v1 JSON), [] when none or unreadable."""
    spec = pod.get("spec") or {}
    gates = spec.get("schedulingGates") if isinstance(spec, Mapping) else None
    if not isinstance(gates, Sequence) or isinstance(gates, str):
        return []
    return [g for g in gates if isinstance(g, Mapping)]


def gated(pod: Mapping[str, Any]) -> bool:
    """Whether the pod carries the admission gate."""
    return any(g.get("name") == ADMISSION_GATE for g in gates_of(pod))


def _node_requirement(node: str) -> dict[str, Any]:
    return {"key": NODE_NAME_FIELD, "operator": "In", "values": [node]}


def release_spec(pod: Mapping[str, Any], node: str) -> dict[str, Any]:
    """The spec merge patch that pins the pod to `node` and removes the admission gate (other gates stay).

    The pod's own required node-affinity terms are kept, each with the node requirement added (the
    API server allows only additions while the pod is gated); without terms, one term names the node.
    Lists are replaced whole by a merge patch, so the patch carries every term and every other gate.
    """
    spec = pod.get("spec") or {}
    affinity = spec.get("affinity") if isinstance(spec, Mapping) else None
    node_affinity = affinity.get("nodeAffinity") if isinstance(affinity, Mapping) else None
    required = (
        node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(node_affinity, Mapping)
        else None
    )
    terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    want = _node_requirement(node)
    new_terms: list[dict[str, Any]] = []
    for term in terms if isinstance(terms, Sequence) and not isinstance(terms, str) else ():
        if not isinstance(term, Mapping):
            continue
        fields = [f for f in term.get("matchFields") or () if isinstance(f, Mapping)]
        if want not in fields:
            fields.append(want)
        new_terms.append({**term, "matchFields": fields})
    if not new_terms:
        new_terms = [{"matchFields": [want]}]
    rest = [dict(g) for g in gates_of(pod) if g.get("name") != ADMISSION_GATE]
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": new_terms}
            }
        },
        "schedulingGates": rest or None,
    }


def add_gate_patch(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that adds the admission gate to a pod being created; [] when it has it."""
    if gated(pod):
        return []
    spec = pod.get("spec") or {}
    if isinstance(spec, Mapping) and isinstance(spec.get("schedulingGates"), list):
        return [{"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": ADMISSION_GATE}}]
    return [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": ADMISSION_GATE}]}]
