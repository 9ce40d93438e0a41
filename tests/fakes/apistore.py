"""The object store behind the API server stand-in (tests.fakes.apiserver): what it holds and how it answers.

ApiStore keeps pods, nodes, Events, the recorded requests, the injected faults
and the change history that watches read, under one condition variable, and
routes a request to its answer (status code, body, headers) with the API
server's semantics for the paths gpunode uses. The HTTP side, watch streaming
and the test-facing methods are in tests.fakes.apiserver.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any
    at: float  # time.monotonic() when the request arrived
    authorization: str = ""  # the Authorization header as sent


@dataclass
class Failure:
    method: str
    pattern: re.Pattern[str]
    status: int
    times: int | None  # None: until cleared
    retry_after_s: float | None = None


@dataclass
class Hang:
    pattern: re.Pattern[str]
    seconds: float


@dataclass
class _State:
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    leases: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # coordination.k8s.io/v1
    configmaps: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    requests: list[Recorded] = field(default_factory=list)
    pdb_blocks: dict[tuple[str, str], int | None] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    hangs: list[Hang] = field(default_factory=list)
    termination_s: float = 0.0
    eviction_versions: tuple[str, ...] = ("policy/v1",)  # ("policy/v1beta1",): as Kubernetes 1.20 answers
    version: int = 1
    history: list[tuple[int, str, str, dict[str, Any]]] = field(
        default_factory=list
    )  # (version, type, kind, object)
    compacted: int = 0  # a watch from a version older than this gets 410 Expired


def status_body(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 300 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 JSON patch for object members (test, add, replace, remove). Raises ValueError on a failed test."""
    doc = json.loads(json.dumps(target))
    for op in ops:
        parts = _pointer(op["path"])
        parent: Any = doc
        for p in parts[:-1]:
            parent = parent.setdefault(p, {})
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            if parent.get(last) != op["value"]:
                raise ValueError(f"test failed at {op['path']}: {parent.get(last)!r} != {op['value']!r}")
        elif kind in ("add", "replace"):
            parent[last] = op["value"]
        elif kind == "remove":
            parent.pop(last, None)
        else:
            raise ValueError(f"unsupported op {kind}")
    return doc


REASONS = {
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}
_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
_BINDING = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/binding$")
_NAMESPACED_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
EVICT = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction$")
_EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
_NODE = re.compile(r"^/api/v1/nodes/([^/]+)$")
_NODE_STATUS = re.compile(r"^/api/v1/nodes/([^/]+)/status$")
_LEASES = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?$")
_CONFIGMAPS = re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps(?:/([^/]+))?$")


def selected(obj: dict[str, Any], query: dict[str, str]) -> bool:
    """Whether `obj` passes the query's fieldSelector: comma-separated `path=value` / `path!=value`
    terms over dotted fields (spec.nodeName=node-a), as the API server reads them for pods."""
    for term in filter(None, (query.get("fieldSelector") or "").split(",")):
        negate = "!=" in term
        path, _, want = term.partition("!=" if negate else "=")
        value: Any = obj
        for part in path.strip().split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if ((value if value is not None else "") == want.lstrip("=")) == negate:
            return False
    return True


def collection_of(path: str) -> tuple[str, str | None]:
    """("pods" or "nodes", the namespace or None) for a collection path, ("", None) for anything else."""
    if path == "/api/v1/nodes":
        return "nodes", None
    if path == "/api/v1/pods":
        return "pods", None
    if m := _NAMESPACED_PODS.match(path):
        return "pods", m.group(1)
    return "", None


class ApiStore:
    """Pods, nodes, Events, requests, faults and history, guarded by one condition variable."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._state = _State()

    # -- request handling (called with the lock held) --------------------------------------

    def _bump(self) -> str:
        self._state.version += 1
        return str(self._state.version)

    def _record(self, event_type: str, kind: str, obj: dict[str, Any]) -> None:
        """Keep a copy of a changed object for watches (its resourceVersion is already bumped)."""
        copy = json.loads(json.dumps(obj))
        self._state.history.append((int(copy["metadata"]["resourceVersion"]), event_type, kind, copy))
        self._cond.notify_all()

    def _objects(self, kind: str, namespace: str | None) -> list[dict[str, Any]]:
        source = self._state.nodes.values() if kind == "nodes" else self._state.pods.values()
        return [
            json.loads(json.dumps(o))
            for o in source
            if namespace is None or o["metadata"].get("namespace") == namespace
        ]

    def _list(
        self, kind: str, namespace: str | None, query: dict[str, str]
    ) -> tuple[int, Any, dict[str, str]]:
        source = self._state.nodes.values() if kind == "nodes" else self._state.pods.values()
        items = [
            o
            for o in source
            if (namespace is None or o["metadata"].get("namespace") == namespace) and selected(o, query)
        ]
        start, limit = int(query.get("continue") or 0), int(query.get("limit") or 0)
        meta = {"resourceVersion": str(self._state.version)}
        if limit and start + limit < len(items):
            meta["continue"] = str(start + limit)
        page = json.loads(json.dumps(items[start : start + limit] if limit else items[start:]))  # copies
        list_kind = "NodeList" if kind == "nodes" else "PodList"
        return 200, {"kind": list_kind, "apiVersion": "v1", "metadata": meta, "items": page}, {}

    def _take_failure(self, method: str, path: str) -> Failure | None:
        for f in self._state.failures:
            if f.method == method and f.pattern.search(path):
                if f.times is not None:
                    f.times -= 1
                    if f.times <= 0:
                        self._state.failures.remove(f)
                return f
        return None

    def _route(
        self, method: str, path: str, body: Any, content_type: str, query: dict[str, str]
    ) -> tuple[int, Any, dict[str, str]]:
        st = self._state
        kind, namespace = collection_of(path)
        if kind:
            if method != "GET":
                return 405, status_body(405, "MethodNotAllowed", "method not allowed"), {}
            return self._list(kind, namespace, query)
        if m := _BINDING.match(path):
            if method != "POST":
                return 405, status_body(405, "MethodNotAllowed", "method not allowed"), {}
            return self._bind(m.group(1), m.group(2), body)
        if m := EVICT.match(path):
            if method != "POST":
                return 405, status_body(405, "MethodNotAllowed", "method not allowed"), {}
            return self._evict(m.group(1), m.group(2), body)
        if m := _POD.match(path):
            key = (m.group(1), m.group(2))
            pod = st.pods.get(key)
            if pod is None:
                return (
                    404,
                    status_body(404, "NotFound", f'pods "{key[1]}" not found', name=key[1], kind="pods"),
                    {},
                )
            if method == "GET":
                return 200, pod, {}
            if method == "DELETE":
                want = ((body or {}).get("preconditions") or {}).get("uid")
                if want and want != pod["metadata"]["uid"]:
                    return (
                        409,
                        status_body(
                            409, "Conflict", "Precondition failed: UID in precondition does not match"
                        ),
                        {},
                    )
                del st.pods[key]
                pod["metadata"]["resourceVersion"] = self._bump()
                self._record("DELETED", "pods", pod)
                return 200, pod, {}
            if method == "PATCH":
                if content_type.split(";")[0].strip() != "application/merge-patch+json" or not isinstance(
                    body, dict
                ):
                    return (
                        415,
                        status_body(415, "UnsupportedMediaType", "the stand-in takes merge patches"),
                        {},
                    )
                new = merge_patch(pod, {k: v for k, v in body.items() if k != "status"})
                new["metadata"]["resourceVersion"] = self._bump()
                st.pods[key] = new
                self._record("MODIFIED", "pods", new)
                return 200, new, {}
            return 405, status_body(405, "MethodNotAllowed", "method not allowed"), {}
        if m := _EVENTS.match(path):
            if method != "POST" or not isinstance(body, dict):
                return 400, status_body(400, "BadRequest", "expected an Event"), {}
            if body.get("metadata", {}).get("namespace", m.group(1)) != m.group(1):
                return (
                    400,
                    status_body(400, "BadRequest", "the namespace of the object does not match the URL"),
                    {},
                )
            st.events.append(body)
            return 201, body, {}
        if m := _LEASES.match(path):
            return self._lease(m.group(1), m.group(2), method, body)
        if m := _CONFIGMAPS.match(path):
            return self._lease(m.group(1), m.group(2), method, body, self._state.configmaps, "configmaps")
        if m := _NODE_STATUS.match(path):
            return self._patch_node(m.group(1), method, body, content_type, status=True)
        if m := _NODE.match(path):
            return self._patch_node(m.group(1), method, body, content_type, status=False)
        return (
            404,
            status_body(404, "NotFound", f"the server could not find the requested resource ({path})"),
            {},
        )

    def _bind(self, namespace: str, name: str, body: Any) -> tuple[int, Any, dict[str, str]]:
        pod = self._state.pods.get((namespace, name))
        if pod is None:
            return 404, status_body(404, "NotFound", f'pods "{name}" not found', name=name, kind="pods"), {}
        if (
            not isinstance(body, dict)
            or body.get("kind") != "Binding"
            or not (body.get("target") or {}).get("name")
        ):
            return 400, status_body(400, "BadRequest", "expected a v1 Binding with a target"), {}
        want = (body.get("metadata") or {}).get("uid")
        if want and want != pod["metadata"]["uid"]:
            return (
                409,
                status_body(409, "Conflict", "Precondition failed: UID in precondition does not match"),
                {},
            )
        if pod["spec"].get("nodeName"):
            message = f"pod {name} is already assigned to node {pod['spec']['nodeName']!r}"
            return 409, status_body(409, "Conflict", message), {}
        pod["spec"]["nodeName"] = body["target"]["name"]
        pod["metadata"]["resourceVersion"] = self._bump()
        self._record("MODIFIED", "pods", pod)
        return 201, status_body(201, "", ""), {}

    def _lease(
        self,
        namespace: str,
        name: str | None,
        method: str,
        body: Any,
        store: dict[tuple[str, str], dict[str, Any]] | None = None,
        kind: str = "leases.coordination.k8s.io",
    ) -> tuple[int, Any, dict[str, str]]:
        """Leases (or, with `store` and `kind`, ConfigMaps) as the API server keeps them: create (409
        AlreadyExists), get, and update guarded by metadata.resourceVersion when the body carries one
        (409 Conflict when it is not the stored one)."""
        leases = self._state.leases if store is None else store
        plural = kind.split(".")[0]
        if name is None:
            if method != "POST" or not isinstance(body, dict) or not (body.get("metadata") or {}).get("name"):
                return 400, status_body(400, "BadRequest", f"expected one of {plural} with metadata.name"), {}
            key = (namespace, body["metadata"]["name"])
            if key in leases:
                message = f'{kind} "{key[1]}" already exists'
                return 409, status_body(409, "AlreadyExists", message, name=key[1], kind=plural), {}
            lease = json.loads(json.dumps(body))
            uid = f"{plural[:-1]}-{key[1]}"
            lease["metadata"].update(namespace=namespace, uid=uid, resourceVersion=self._bump())
            leases[key] = lease
            return 201, lease, {}
        key = (namespace, name)
        if key not in leases:
            message = f'{kind} "{name}" not found'
            return 404, status_body(404, "NotFound", message, name=name, kind=plural), {}
        if method == "GET":
            return 200, leases[key], {}
        if method != "PUT" or not isinstance(body, dict):
            return 405, status_body(405, "MethodNotAllowed", "method not allowed"), {}
        want = (body.get("metadata") or {}).get("resourceVersion")
        if want and want != leases[key]["metadata"]["resourceVersion"]:
            message = (
                f'Operation cannot be fulfilled on {kind} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again"
            )
            return 409, status_body(409, "Conflict", message, name=name, kind=plural), {}
        lease = json.loads(json.dumps(body))
        lease["metadata"].update(
            namespace=namespace, uid=leases[key]["metadata"]["uid"], resourceVersion=self._bump()
        )
        leases[key] = lease
        return 200, lease, {}

    def _evict(self, namespace: str, name: str, body: Any) -> tuple[int, Any, dict[str, str]]:
        st = self._state
        pod = st.pods.get((namespace, name))
        if pod is None:
            return 404, status_body(404, "NotFound", f'pods "{name}" not found', name=name, kind="pods"), {}
        if not isinstance(body, dict) or body.get("kind") != "Eviction":
            return 400, status_body(400, "BadRequest", "expected an Eviction"), {}
        version = str(body.get("apiVersion"))
        if version not in st.eviction_versions:  # the words of a 1.20 API server asked for policy/v1
            group, _, short = version.rpartition("/")
            message = (
                f'Eviction in version "{short}" cannot be handled as a Eviction: no kind "Eviction" is '
                f'registered for version "{version}" in scheme "pkg/api/legacyscheme/scheme.go:30"'
            )
            return 400, status_body(400, "BadRequest", message if group == "policy" else "bad group"), {}
        want = ((body.get("deleteOptions") or {}).get("preconditions") or {}).get("uid")
        if want and want != pod["metadata"]["uid"]:
            return (
                409,
                status_body(409, "Conflict", "Precondition failed: UID in precondition does not match"),
                {},
            )
        key = (namespace, name)
        if key in st.pdb_blocks:
            left = st.pdb_blocks[key]
            if left is None or left > 0:
                if left is not None:
                    st.pdb_blocks[key] = left - 1
                return (
                    429,
                    status_body(
                        429,
                        "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                        causes=[
                            {
                                "reason": "DisruptionBudget",
                                "message": "The disruption budget needs 1 healthy pods",
                            }
                        ],
                    ),
                    {},
                )
            del st.pdb_blocks[key]
        if "All" not in ((body.get("deleteOptions") or {}).get("dryRun") or []):
            self._terminate(key)
        return 201, status_body(201, "", ""), {}

    def _terminate(self, key: tuple[str, str]) -> None:
        """Delete a pod: at once, or (with a termination delay) mark it terminating and delete it later."""
        st = self._state
        if not st.termination_s:
            pod = st.pods.pop(key)
            pod["metadata"]["resourceVersion"] = self._bump()
            self._record("DELETED", "pods", pod)
            return
        pod = st.pods[key]
        pod["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod["metadata"]["resourceVersion"] = self._bump()
        self._record("MODIFIED", "pods", pod)
        uid = pod["metadata"]["uid"]

        def remove() -> None:
            with self._cond:
                if st.pods.get(key, {}).get("metadata", {}).get("uid") == uid:
                    gone = st.pods.pop(key)
                    gone["metadata"]["resourceVersion"] = self._bump()
                    self._record("DELETED", "pods", gone)
                    self._cond.notify_all()

        timer = threading.Timer(st.termination_s, remove)
        timer.daemon = True
        timer.start()

    def _patch_node(
        self, name: str, method: str, body: Any, content_type: str, *, status: bool
    ) -> tuple[int, Any, dict[str, str]]:
        st = self._state
        node = st.nodes.get(name)
        if node is None:
            return 404, status_body(404, "NotFound", f'nodes "{name}" not found', name=name, kind="nodes"), {}
        if method == "GET":
            return 200, node, {}
        if method != "PATCH":
            return 405, status_body(405, "MethodNotAllowed", "method not allowed"), {}
        ctype = content_type.split(";")[0].strip()
        if ctype == "application/merge-patch+json" and isinstance(body, dict):
            if status:
                body = {"status": body.get("status", {})}
            else:
                body = {k: v for k, v in body.items() if k != "status"}
            new = merge_patch(node, body)
        elif ctype == "application/strategic-merge-patch+json" and isinstance(body, dict):
            conditions = (body.get("status") or {}).get("conditions") if status else None
            rest = {k: v for k, v in body.items() if k != "status"} if not status else {}
            new = merge_patch(node, rest)
            if conditions:
                merged = {c["type"]: c for c in node.get("status", {}).get("conditions", [])}
                for c in conditions:
                    merged[c["type"]] = {**merged.get(c["type"], {}), **c}
                new.setdefault("status", {})["conditions"] = list(merged.values())
        elif ctype == "application/json-patch+json" and isinstance(body, list):
            try:
                new = json_patch(node, body)
            except ValueError as exc:
                return 422, status_body(422, "Invalid", str(exc)), {}
        else:
            return (
                415,
                status_body(
                    415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype}"
                ),
                {},
            )
        new["metadata"]["resourceVersion"] = self._bump()
        st.nodes[name] = new
        self._record("MODIFIED", "nodes", new)
        return 200, new, {}
