"""An HTTP stand-in for the Kubernetes API server on loopback, for the calls the node agent makes.

It serves the handful of core/v1 and policy/v1 paths gpunode.infra.kube uses, with
the API server's status codes and metav1.Status bodies: GET a pod, POST a pod
eviction (201, or 429 while a PodDisruptionBudget blocks it), DELETE a pod
(UID preconditions answered with 409), POST Events, GET and PATCH a node (JSON
merge patch, strategic merge of conditions on the status subresource, JSON
patch with `test`). Every request is recorded with its decoded body. Tests can
make it answer 429/500 a number of times, hang before answering, or stop
listening altogether (and come back on the same port).

It keeps no watch, no admission, no authentication: it stands in for what the
agent can see of an API server, nothing more.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlsplit


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
class _Failure:
    method: str
    pattern: re.Pattern[str]
    status: int
    times: int | None  # None: until cleared
    retry_after_s: float | None = None


@dataclass
class _Hang:
    pattern: re.Pattern[str]
    seconds: float


@dataclass
class _State:
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    requests: list[Recorded] = field(default_factory=list)
    pdb_blocks: dict[tuple[str, str], int | None] = field(default_factory=dict)
    failures: list[_Failure] = field(default_factory=list)
    hangs: list[_Hang] = field(default_factory=list)
    termination_s: float = 0.0
    version: int = 1


def _status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
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


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes; do not wait for ACKs

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.server.connections_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.connections_lock:
            self.server.connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def _reply(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        owner = self.server.owner
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        rec = Recorded(
            method=self.command,
            path=parts.path,
            query=dict(parse_qsl(parts.query)),
            content_type=self.headers.get("Content-Type", ""),
            body=body,
            at=time.monotonic(),
            authorization=self.headers.get("Authorization", ""),
        )
        with owner._cond:
            owner._state.requests.append(rec)
            owner._cond.notify_all()
            hang = next((h.seconds for h in owner._state.hangs if h.pattern.search(parts.path)), 0.0)
        if hang:
            time.sleep(hang)
        with owner._cond:
            injected = owner._take_failure(self.command, parts.path)
        if injected is not None:
            headers = {}
            if injected.retry_after_s is not None:
                headers["Retry-After"] = str(int(injected.retry_after_s))
            reason = _REASONS.get(injected.status, "Injected")
            self._reply(injected.status, _status(injected.status, reason, "injected failure"), headers)
            return
        with owner._cond:
            code, out, headers = owner._route(
                self.command, parts.path, body, self.headers.get("Content-Type", "")
            )
            owner._cond.notify_all()
        self._reply(code, out, headers)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], owner: ApiServerStandIn) -> None:
        self.owner = owner
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (timeout, stop()) is not an error of the stand-in

    def close_connections(self) -> None:
        """Drop every open (keep-alive) connection, as a server going down does."""
        with self.connections_lock:
            conns = list(self.connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


_REASONS = {
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}
_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
_EVICT = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction$")
_EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
_NODE = re.compile(r"^/api/v1/nodes/([^/]+)$")
_NODE_STATUS = re.compile(r"^/api/v1/nodes/([^/]+)/status$")


class ApiServerStandIn:
    """Serves on http://127.0.0.1:<port> until stopped; `url` is the address for KubeClient.for_host."""

    def __init__(self, port: int = 0, *, tls: tuple[str, str] | None = None) -> None:
        """tls: (certificate file, key file) to serve HTTPS, as a real API server does."""
        self._tls = tls
        self._cond = threading.Condition()
        self._state = _State()
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> ApiServerStandIn:
        if self._server is not None:
            raise RuntimeError("the API server stand-in is already running")
        self._server = _Server(("127.0.0.1", self._port), self)
        self._port = self._server.server_address[1]
        if self._tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*self._tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening (connections are refused until start() again, on the same port)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        self._server = None

    def __enter__(self) -> ApiServerStandIn:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    # -- objects ---------------------------------------------------------------------------

    def add_pod(self, namespace: str, name: str, *, node_name: str = "node-a", uid: str | None = None) -> str:
        uid = uid or str(uuid.uuid4())
        with self._cond:
            self._state.pods[(namespace, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": uid,
                    "resourceVersion": self._bump(),
                },
                "spec": {"nodeName": node_name},
                "status": {"phase": "Running"},
            }
        return uid

    def add_node(self, name: str, *, labels: dict[str, str] | None = None) -> None:
        with self._cond:
            self._state.nodes[name] = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "uid": str(uuid.uuid4()),
                    "labels": dict(labels or {}),
                    "annotations": {},
                    "resourceVersion": self._bump(),
                },
                "spec": {},
                "status": {"conditions": []},
            }

    def pods(self) -> list[tuple[str, str]]:
        with self._cond:
            return sorted(self._state.pods)

    def node(self, name: str) -> dict[str, Any]:
        with self._cond:
            return json.loads(json.dumps(self._state.nodes[name]))

    def events(self) -> list[dict[str, Any]]:
        with self._cond:
            return list(self._state.events)

    def requests(self, method: str | None = None, path: str | None = None) -> list[Recorded]:
        """Recorded requests, optionally only one method and paths matching a regular expression."""
        with self._cond:
            out = list(self._state.requests)
        return [
            r
            for r in out
            if (method is None or r.method == method) and (path is None or re.search(path, r.path))
        ]

    def evictions(self) -> list[tuple[str, str]]:
        """(namespace, pod) of every eviction request received, in order, answered or not."""
        out = []
        for r in self.requests("POST", r"/eviction$"):
            m = _EVICT.match(r.path)
            assert m is not None
            out.append((m.group(1), m.group(2)))
        return out

    # -- faults ----------------------------------------------------------------------------

    def block_evictions(self, namespace: str, name: str, times: int | None = None) -> None:
        """Answer 429 (a PodDisruptionBudget) to this pod's evictions: `times` times, or until cleared (None)."""
        with self._cond:
            self._state.pdb_blocks[(namespace, name)] = times

    def unblock_evictions(self, namespace: str, name: str) -> None:
        with self._cond:
            self._state.pdb_blocks.pop((namespace, name), None)

    def fail(
        self,
        method: str,
        path: str,
        status: int,
        *,
        times: int | None = 1,
        retry_after_s: float | None = None,
    ) -> None:
        """Answer `status` to requests with this method whose path matches the regex, `times` times (None: always)."""
        with self._cond:
            self._state.failures.append(_Failure(method, re.compile(path), status, times, retry_after_s))

    def hang(self, path: str, seconds: float) -> None:
        """Wait `seconds` before answering requests whose path matches the regex."""
        with self._cond:
            self._state.hangs.append(_Hang(re.compile(path), seconds))

    def clear_faults(self) -> None:
        with self._cond:
            self._state.failures.clear()
            self._state.hangs.clear()
            self._state.pdb_blocks.clear()

    def set_termination(self, seconds: float) -> None:
        """Evicted pods stay this long, terminating (deletionTimestamp set), before they are gone."""
        with self._cond:
            self._state.termination_s = seconds

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"API server stand-in: timed out waiting for {what}")
                self._cond.wait(min(left, 0.05))

    # -- request handling (called with the lock held) --------------------------------------

    def _bump(self) -> str:
        self._state.version += 1
        return str(self._state.version)

    def _take_failure(self, method: str, path: str) -> _Failure | None:
        for f in self._state.failures:
            if f.method == method and f.pattern.search(path):
                if f.times is not None:
                    f.times -= 1
                    if f.times <= 0:
                        self._state.failures.remove(f)
                return f
        return None

    def _route(self, method: str, path: str, body: Any, content_type: str) -> tuple[int, Any, dict[str, str]]:
        st = self._state
        if m := _EVICT.match(path):
            if method != "POST":
                return 405, _status(405, "MethodNotAllowed", "method not allowed"), {}
            return self._evict(m.group(1), m.group(2), body)
        if m := _POD.match(path):
            key = (m.group(1), m.group(2))
            pod = st.pods.get(key)
            if pod is None:
                return (
                    404,
                    _status(404, "NotFound", f'pods "{key[1]}" not found', name=key[1], kind="pods"),
                    {},
                )
            if method == "GET":
                return 200, pod, {}
            if method == "DELETE":
                want = ((body or {}).get("preconditions") or {}).get("uid")
                if want and want != pod["metadata"]["uid"]:
                    return (
                        409,
                        _status(409, "Conflict", "Precondition failed: UID in precondition does not match"),
                        {},
                    )
                del st.pods[key]
                return 200, pod, {}
            return 405, _status(405, "MethodNotAllowed", "method not allowed"), {}
        if m := _EVENTS.match(path):
            if method != "POST" or not isinstance(body, dict):
                return 400, _status(400, "BadRequest", "expected an Event"), {}
            if body.get("metadata", {}).get("namespace", m.group(1)) != m.group(1):
                return (
                    400,
                    _status(400, "BadRequest", "the namespace of the object does not match the URL"),
                    {},
                )
            st.events.append(body)
            return 201, body, {}
        if m := _NODE_STATUS.match(path):
            return self._patch_node(m.group(1), method, body, content_type, status=True)
        if m := _NODE.match(path):
            return self._patch_node(m.group(1), method, body, content_type, status=False)
        return 404, _status(404, "NotFound", f"the server could not find the requested resource ({path})"), {}

    def _evict(self, namespace: str, name: str, body: Any) -> tuple[int, Any, dict[str, str]]:
        st = self._state
        pod = st.pods.get((namespace, name))
        if pod is None:
            return 404, _status(404, "NotFound", f'pods "{name}" not found', name=name, kind="pods"), {}
        if (
            not isinstance(body, dict)
            or body.get("kind") != "Eviction"
            or body.get("apiVersion") != "policy/v1"
        ):
            return 400, _status(400, "BadRequest", "expected a policy/v1 Eviction"), {}
        want = ((body.get("deleteOptions") or {}).get("preconditions") or {}).get("uid")
        if want and want != pod["metadata"]["uid"]:
            return (
                409,
                _status(409, "Conflict", "Precondition failed: UID in precondition does not match"),
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
                    _status(
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
        return 201, _status(201, "", ""), {}

    def _terminate(self, key: tuple[str, str]) -> None:
        """Delete a pod: at once, or (with a termination delay) mark it terminating and delete it later."""
        st = self._state
        if not st.termination_s:
            del st.pods[key]
            return
        pod = st.pods[key]
        pod["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        uid = pod["metadata"]["uid"]

        def remove() -> None:
            with self._cond:
                if st.pods.get(key, {}).get("metadata", {}).get("uid") == uid:
                    del st.pods[key]
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
            return 404, _status(404, "NotFound", f'nodes "{name}" not found', name=name, kind="nodes"), {}
        if method == "GET":
            return 200, node, {}
        if method != "PATCH":
            return 405, _status(405, "MethodNotAllowed", "method not allowed"), {}
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
                return 422, _status(422, "Invalid", str(exc)), {}
        else:
            return (
                415,
                _status(
                    415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype}"
                ),
                {},
            )
        new["metadata"]["resourceVersion"] = self._bump()
        st.nodes[name] = new
        return 200, new, {}
