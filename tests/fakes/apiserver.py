"""An HTTP stand-in for the Kubernetes API server on loopback, for the calls gpunode.infra.kube makes.

It serves the handful of core/v1 and policy/v1 paths the agent and the extender
use, with the API server's status codes and metav1.Status bodies: GET and
merge-PATCH a pod, POST a pod eviction (201, or 429 while a
PodDisruptionBudget blocks it), POST a pod binding (409 when already bound),
DELETE a pod (UID preconditions answered with 409), POST Events, GET and PATCH a
node (JSON merge patch, strategic merge of conditions on the status subresource,
JSON patch with `test`), create, get and update coordination.k8s.io/v1 Leases and v1 ConfigMaps
(an update whose metadata.resourceVersion is not the stored one is a 409
Conflict), and list and watch pods and nodes: lists carry the
resourceVersion (and pages with limit/continue), a watch streams every change
after its resourceVersion, BOOKMARKs when asked, until timeoutSeconds, and an
ERROR 410 Expired when the version is older than the last compact(). Every
request is recorded with its decoded body. Tests can make it answer 429/500 a
number of times, hang before answering, or stop listening altogether (and come
back on the same port).

It keeps no admission, no authentication and no label selectors (a fieldSelector on
equality of fields, such as spec.nodeName=<node>, is honoured by lists and watches):
it stands in for what
gpunode can see of an API server, nothing more.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from tests.fakes.apistore import (
    EVICT,
    REASONS,
    ApiStore,
    Failure,
    Hang,
    Recorded,
    collection_of,
    selected,
    status_body,
)


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
            reason = REASONS.get(injected.status, "Injected")
            self._reply(injected.status, status_body(injected.status, reason, "injected failure"), headers)
            return
        kind, namespace = collection_of(parts.path)
        if self.command == "GET" and kind and rec.query.get("watch") in ("1", "true"):
            self._watch(kind, namespace, rec.query)
            return
        with owner._cond:
            code, out, headers = owner._route(
                self.command, parts.path, body, self.headers.get("Content-Type", ""), rec.query
            )
            owner._cond.notify_all()
        self._reply(code, out, headers)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, kind: str, namespace: str | None, query: dict[str, str]) -> None:
        """Stream the changes after query's resourceVersion until timeoutSeconds, as the API server does."""
        owner = self.server.owner
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("1", "true")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            with owner._cond:
                if since == 0:  # "from now": the current objects as ADDED first
                    lines = [
                        {"type": "ADDED", "object": o}
                        for o in owner._objects(kind, namespace)
                        if selected(o, query)
                    ]
                    since = owner._state.version
                    if lines:
                        self._chunk(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
            while not self.server.closing and time.monotonic() < deadline:
                with owner._cond:
                    st = owner._state
                    if since < st.compacted:
                        gone = status_body(
                            410, "Expired", f"too old resource version: {since} ({st.compacted})"
                        )
                        self._chunk(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
                        break
                    first = bisect.bisect_right(st.history, since, key=lambda e: e[0])  # versions ascend
                    lines = [
                        {"type": t, "object": o}
                        for _, t, k, o in st.history[first:]
                        if k == kind
                        and (t != "BOOKMARK" or bookmarks)
                        and (namespace is None or o["metadata"].get("namespace") == namespace)
                        and (t == "BOOKMARK" or selected(o, query))
                    ]
                    since = st.version
                    if not lines:
                        owner._cond.wait(0.05)
                if lines:  # one chunk for what arrived together
                    self._chunk(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
            self._chunk(b"")
        except OSError:
            self.close_connection = True  # the client went away

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # clients that open connections in parallel are not reset (the default is 5)

    def __init__(self, address: tuple[str, int], owner: ApiServerStandIn) -> None:
        self.owner = owner
        self.closing = False  # ends the watches being streamed
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


class ApiServerStandIn(ApiStore):
    """Serves on http://127.0.0.1:<port> until stopped; `url` is the address for KubeClient.for_host."""

    def __init__(self, port: int = 0, *, tls: tuple[str, str] | None = None) -> None:
        """tls: (certificate file, key file) to serve HTTPS, as a real API server does."""
        self._tls = tls
        super().__init__()
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
        self._server.closing = True
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
                "spec": {
                    "nodeName": node_name,
                    "containers": [{"name": "main", "image": "registry.example/app:1"}],
                },
                "status": {"phase": "Running"},
            }
            self._record("ADDED", "pods", self._state.pods[(namespace, name)])
        return uid

    def put_pod(self, pod: dict[str, Any]) -> str:
        """Store a whole v1 Pod as given (a pending one with its own spec, say); returns its UID."""
        pod = json.loads(json.dumps(pod))
        meta = pod.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        with self._cond:
            meta["resourceVersion"] = self._bump()
            self._state.pods[(meta.get("namespace") or "default", meta["name"])] = pod
            self._record("ADDED", "pods", pod)
        return str(meta["uid"])

    def add_node(
        self, name: str, *, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
    ) -> None:
        with self._cond:
            self._state.nodes[name] = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "uid": str(uuid.uuid4()),
                    "labels": dict(labels or {}),
                    "annotations": dict(annotations or {}),
                    "resourceVersion": self._bump(),
                },
                "spec": {},
                "status": {"conditions": []},
            }
            self._record("ADDED", "nodes", self._state.nodes[name])

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        with self._cond:
            return json.loads(json.dumps(self._state.pods[(namespace, name)]))

    def lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored Lease, or None when there is none."""
        with self._cond:
            found = self._state.leases.get((namespace, name))
            return json.loads(json.dumps(found)) if found is not None else None

    def delete_node(self, name: str) -> None:
        with self._cond:
            node = self._state.nodes.pop(name)
            node["metadata"]["resourceVersion"] = self._bump()
            self._record("DELETED", "nodes", node)

    def compact(self) -> None:
        """Forget the change history so far: a watch from an older resourceVersion gets 410 Expired."""
        with self._cond:
            self._state.compacted = self._state.version
            self._state.history.clear()

    def bookmark(self, kind: str) -> str:
        """Send watchers of `kind` ("pods", "nodes") that asked for them a BOOKMARK; returns its resourceVersion."""
        with self._cond:
            version = self._bump()
            self._state.history.append(
                (int(version), "BOOKMARK", kind, {"metadata": {"resourceVersion": version}})
            )
            self._cond.notify_all()
            return version

    def watches(self, path: str | None = None) -> list[Recorded]:
        """The watch requests received, optionally only paths matching a regular expression."""
        return [r for r in self.requests("GET", path) if r.query.get("watch") in ("1", "true")]

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
            m = EVICT.match(r.path)
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

    def serve_eviction_versions(self, *versions: str) -> None:
        """The Eviction versions the pods/eviction subresource accepts (policy/v1 by default; a 1.20 API
        server accepts only policy/v1beta1 and answers 400 BadRequest to a policy/v1 body)."""
        with self._cond:
            self._state.eviction_versions = versions

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
            self._state.failures.append(Failure(method, re.compile(path), status, times, retry_after_s))

    def hang(self, path: str, seconds: float) -> None:
        """Wait `seconds` before answering requests whose path matches the regex."""
        with self._cond:
            self._state.hangs.append(Hang(re.compile(path), seconds))

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
