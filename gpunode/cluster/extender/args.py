"""The extender protocol's ExtenderArgs (filter and prioritize) and ExtenderFilterResult, as dicts. No I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.cluster.extender.binding import json_field
from gpunode.errors import BadRequest


@dataclass(frozen=True)
class ExtenderArgs:
    """ExtenderArgs: the pod, and the nodes as full Node objects or as names."""

    pod: Mapping[str, Any]
    node_objects: list[Any] | None  # Nodes.items when kube-scheduler sends full nodes
    node_list: Mapping[str, Any] | None
    node_names: list[str] | None


def parse_args(body: object) -> ExtenderArgs:
    """ExtenderArgs from decoded JSON; BadRequest when the shape is wrong."""
    if not isinstance(body, Mapping):
        raise BadRequest("ExtenderArgs must be a JSON object")
    pod = json_field(body, "Pod")
    if not isinstance(pod, Mapping):
        raise BadRequest("ExtenderArgs.Pod is missing or not an object")
    nodes, names = json_field(body, "Nodes"), json_field(body, "NodeNames")
    if nodes is None and names is None:
        raise BadRequest("ExtenderArgs needs Nodes (a v1.NodeList) or NodeNames")
    if nodes is not None:
        items = json_field(nodes, "items") if isinstance(nodes, Mapping) else None
        if items is None and isinstance(nodes, Mapping):
            items = []
        if not isinstance(items, list):
            raise BadRequest("ExtenderArgs.Nodes must be a v1.NodeList with an items list")
        return ExtenderArgs(pod=pod, node_objects=items, node_list=nodes, node_names=None)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadRequest("ExtenderArgs.NodeNames must be a list of strings")
    return ExtenderArgs(pod=pod, node_objects=None, node_list=None, node_names=names)


def filter_result(
    args: ExtenderArgs, passing: list[str], failed: dict[str, str], unresolvable: dict[str, str]
) -> dict[str, Any]:
    """The ExtenderFilterResult: the passing nodes in the form they came in, the failed ones with reasons."""
    out: dict[str, Any] = {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": failed,
        "FailedAndUnresolvableNodes": unresolvable,
        "Error": "",
    }
    if args.node_objects is not None:
        keep = set(passing)
        items = [n for n in args.node_objects if isinstance(n, Mapping) and node_name(n) in keep]
        node_list = dict(args.node_list or {})
        node_list["items"] = items
        out["Nodes"] = node_list
    else:
        out["NodeNames"] = passing
    return out


def node_name(node: Mapping[str, Any]) -> str:
    """metadata.name of a v1.Node ("" when it has none)."""
    meta = node.get("metadata") or {}
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""
