"""What the extender checks before it binds a pod: the filter results it gave, and the pod as it is.

Whoever can reach the extender can POST ExtenderBindingArgs, so a bind request is
never trusted by itself. The pod is read from the API server and the Binding is
created only when all of these hold:

- the pod exists and has no spec.nodeName (it is pending);
- its spec.schedulerName is one this extender serves (--scheduler-name);
- its UID is the request's PodUID, when the request names one;
- this extender's filter passed that node for that pod UID, less than FILTER_MEMORY_S
  ago, and the GPU request filter was asked about is the pod's own (a filter body
  made up to prepare a bind does not match the real pod).

FilterLog keeps those filter results: per pod UID the namespace/name, the GPU
request and the hashes of the node names that passed, bounded in pods, in node
names held and in age. Thread safe; no I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gpunode.cluster.extender.pods import request_from_pod
from gpunode.errors import BadRequest, PlacementError
from gpunode.placement import Request

log = logging.getLogger(__name__)
FILTER_MEMORY_S = 900.0  # kube-scheduler binds within its bind timeout (600 s) of filtering
MAX_REMEMBERED_PODS = 4096
MAX_REMEMBERED_NODES = 2_000_000  # node names held over all remembered pods (8 bytes each)
DEFAULT_SCHEDULER = "default-scheduler"


def json_field(obj: Mapping[str, Any], name: str) -> Any:
    """obj[name], matching the key case-insensitively like Go's encoding/json."""
    if name in obj:
        return obj[name]
    lowered = name.lower()
    for k, v in obj.items():
        if isinstance(k, str) and k.lower() == lowered:
            return v
    return None


@dataclass(frozen=True)
class BindArgs:
    """ExtenderBindingArgs: the pod (namespace, name, UID when sent) and the node chosen."""

    namespace: str
    name: str
    uid: str  # "" when the scheduler sent none
    node: str

    @property
    def key(self) -> str:
        """namespace/name."""
        return f"{self.namespace}/{self.name}"


def parse_bind_args(body: object) -> BindArgs:
    """ExtenderBindingArgs from decoded JSON; BadRequest when the shape is wrong."""
    if not isinstance(body, Mapping):
        raise BadRequest("ExtenderBindingArgs must be a JSON object")
    name, namespace = json_field(body, "PodName"), json_field(body, "PodNamespace") or "default"
    uid, node = json_field(body, "PodUID") or "", json_field(body, "Node")
    if not isinstance(name, str) or not name or not isinstance(node, str) or not node:
        raise BadRequest("ExtenderBindingArgs needs PodName and Node")
    if not isinstance(uid, str) or not isinstance(namespace, str):
        raise BadRequest("ExtenderBindingArgs.PodUID and PodNamespace must be strings")
    return BindArgs(namespace=namespace, name=name, uid=uid, node=node)


@dataclass(frozen=True)
class Filtered:
    """One filter answer: the pod, its GPU request, the nodes that passed (hashed, sorted), when."""

    key: str
    request: Request | None
    passed: npt.NDArray[np.int64]
    at: float

    def passed_node(self, node: str) -> bool:
        """Whether `node` was among the nodes that passed."""
        h = hash(node)
        i = int(np.searchsorted(self.passed, h))
        return i < len(self.passed) and int(self.passed[i]) == h


class FilterLog:
    """The recent filter results by pod UID (see the module docstring)."""

    def __init__(
        self,
        *,
        max_age_s: float = FILTER_MEMORY_S,
        max_pods: int = MAX_REMEMBERED_PODS,
        max_nodes: int = MAX_REMEMBERED_NODES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_age_s = max_age_s
        self._max_pods, self._max_nodes = max_pods, max_nodes
        self._clock = clock
        self._lock = threading.Lock()
        self._by_uid: OrderedDict[str, Filtered] = OrderedDict()
        self._nodes = 0

    def record(self, uid: str, key: str, request: Request | None, passed: Sequence[str]) -> None:
        """Remember that filter passed these nodes for the pod (replacing its earlier answer)."""
        hashes = np.unique(np.fromiter((hash(n) for n in passed), dtype=np.int64, count=len(passed)))
        entry = Filtered(key, request, hashes, self._clock())
        with self._lock:
            self._drop(uid)
            self._by_uid[uid] = entry
            self._nodes += len(hashes)
            while self._by_uid and (len(self._by_uid) > self._max_pods or self._nodes > self._max_nodes):
                self._drop(next(iter(self._by_uid)))

    def forget(self, uid: str) -> None:
        """Drop the pod's filter answer (it no longer passes anywhere)."""
        with self._lock:
            self._drop(uid)

    def clear(self) -> None:
        """Forget every filter answer (a replica that stops or starts leading)."""
        with self._lock:
            self._by_uid.clear()
            self._nodes = 0

    def _drop(self, uid: str) -> None:
        old = self._by_uid.pop(uid, None)
        if old is not None:
            self._nodes -= len(old.passed)

    def get(self, uid: str) -> Filtered | None:
        """The pod's filter answer, if it is recent enough."""
        with self._lock:
            entry = self._by_uid.get(uid)
        if entry is None or self._clock() - entry.at > self.max_age_s:
            return None
        return entry

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_uid)


@dataclass(frozen=True)
class Approved:
    """A bind that passed every check: the pod's UID and the GPU request to reserve for."""

    uid: str
    request: Request | None


def check_bind(
    args: BindArgs,
    pod: Mapping[str, Any] | None,
    *,
    filtered: FilterLog,
    schedulers: frozenset[str],
    memory_unit_bytes: int,
) -> Approved | str:
    """Approved when the pod (as read from the API server, None: not found) may be bound to args.node,
    else the reason it may not."""
    if pod is None:
        return f"pod {args.key} does not exist"
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return f"pod {args.key} has no readable metadata or spec"
    uid = meta.get("uid")
    if not isinstance(uid, str) or not uid:
        return f"pod {args.key} has no UID"
    if args.uid and args.uid != uid:
        return f"pod {args.key} has UID {uid}, not {args.uid}"
    if spec.get("nodeName"):
        return f"pod {args.key} is already bound to node {spec.get('nodeName')}"
    scheduler = spec.get("schedulerName") or DEFAULT_SCHEDULER
    if scheduler not in schedulers:
        served = ", ".join(sorted(schedulers))
        return f"pod {args.key} names scheduler {scheduler!r}; this extender serves {served}"
    entry = filtered.get(uid)
    if entry is None or entry.key != args.key:
        return f"pod {args.key} was not filtered by this extender recently"
    if not entry.passed_node(args.node):
        return f"this extender's filter did not pass node {args.node} for pod {args.key}"
    try:
        request = request_from_pod(pod, memory_unit_bytes=memory_unit_bytes)
    except PlacementError as exc:
        return f"pod {args.key}: invalid GPU request: {exc}"
    if request != entry.request:
        return f"pod {args.key} asks for other resources than the pod filter was asked about"
    return Approved(uid=uid, request=request)


def refuse(args: BindArgs, why: str) -> dict[str, str]:
    """The ExtenderBindingResult of a refused bind (and its one log line)."""
    log.warning("bind of pod %s to node %s refused: %s", args.key, args.node, why)
    return {"Error": f"bind refused: {why}"}
