"""The client's own small value types; objects read from the API server are lightkube's typed models.

PodInfo is the few fields of a Pod that eviction needs; ObjectRef, Taint and
NodeCondition describe what the agent writes; WatchEvent is one step of a
list+watch (see KubeClient.watch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")

SYNC = "SYNC"  # WatchEvent.type after every (re-)list: `items` is the whole collection
ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"


@dataclass(frozen=True)
class PodInfo:
    """The fields of a Pod that deciding an eviction needs."""

    namespace: str
    name: str
    uid: str
    node_name: str
    phase: str
    deleting: bool  # metadata.deletionTimestamp is set


@dataclass(frozen=True)
class ObjectRef:
    """What an Event is about."""

    kind: str  # "Pod" | "Node"
    name: str
    namespace: str = ""  # empty for cluster-scoped objects
    uid: str = ""
    api_version: str = "v1"


@dataclass(frozen=True)
class Taint:
    """One node taint."""

    key: str
    value: str
    effect: str  # NoSchedule | PreferNoSchedule | NoExecute


@dataclass(frozen=True)
class NodeCondition:
    """One node condition, as the agent sets it."""

    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


@dataclass(frozen=True)
class WatchEvent(Generic[R]):
    """One step of a list+watch.

    type SYNC carries the complete collection in `items` (after the first list
    and after every re-list, so a cache replaces its content); ADDED, MODIFIED
    and DELETED carry one `object`. `resource_version` is where the stream
    stands after this event.
    """

    type: str
    object: R | None = None
    items: tuple[R, ...] = ()
    resource_version: str = ""
