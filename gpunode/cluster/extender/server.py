"""The extender's HTTP server, on gpunode.infra.http.

ExtenderServer routes POST <prefix>/filter, /prioritize, /prioritize-claims (pods with ResourceClaims,
drasteer.py), /bind, /preempt and GET /healthz
(and /readyz) to an Extender. Malformed JSON and wrong shapes (bad UTF-8,
nesting deeper than 1,024 levels, an empty body) get 400 with {"Error": "..."};
an unknown path 404; a wrong method 405. Only a defect in our code gives 500,
and the server keeps serving.

Anyone who can reach the port is treated as an adversary:
- with an ssl.SSLContext (gpunode.infra.http.server_tls_context with a client CA),
  it serves HTTPS and a client without a certificate signed by that CA fails the
  handshake; with `allowed_client_names`, a certificate whose subject does not hold
  exactly one commonName, one of those names, is answered 403 (DNS names do not count);
- the HTTP layer bounds connections (MAX_CONNECTIONS), the time for a request's
  head and body, and the body: over `max_body_bytes` (DEFAULT_MAX_BODY_BYTES,
  32 MiB) is 413 before the body is read. kube-scheduler sends ~4 KB per node with
  full Node objects (~20 MB at 5,000 nodes) and a pod plus node names otherwise
  (well under 1 MiB: `--max-request-bytes 4Mi` suits that mode);
- the work queue is bounded: at most `max_pending` requests (MAX_PENDING) wait for
  or run in the worker threads; beyond that a request is answered 503 with
  Retry-After, and kube-scheduler retries the pod later;
- the memory of request bodies is bounded by `request_memory_bytes`
  (--request-memory, DEFAULT_REQUEST_MEMORY_BYTES, half of the chart's 512Mi
  memory limit): a quarter of it (at least one body of max_body_bytes) for the
  bodies being received (the HTTP layer's body budget), the rest for the bodies
  being decoded and answered. Decoded JSON takes 10-40 times its text (a 32 MiB
  NodeList of real Nodes ~460 MiB), so a body takes its decoded_size() (an upper
  bound, counted from its text) before it is decoded: one that could never fit is
  answered 413, one that does not fit now waits up to BUDGET_WAIT_S for the
  bodies ahead of it, then 503 with Retry-After. Large clusters send node names
  (nodeCacheCapable), well under 1 MiB a request.

The Extender's methods are synchronous and CPU-bound (a filter over 5,000 nodes
takes ~20 ms): they run, with the JSON decoding and encoding around them, in a
pool of WORKERS threads of the server's own, so that the event loop keeps
accepting connections and answering /healthz. Extender.bind calls its binder
(the Kubernetes API) from such a worker thread: a binder built on asyncio
submits its coroutine to the loop the server runs on, `ExtenderServer.loop`,
with asyncio.run_coroutine_threadsafe(coro, server.loop).result(); it must not
be called from that loop itself. The pool is not the loop's default executor,
so work the loop hands to that one (DNS lookups of an HTTP client) never waits
behind binds that wait for it.

With a `gate` (ha.Leadership, --leader-elect), a replica that is not the leader answers every
verb with 503, Retry-After and a closed connection, and /healthz and /readyz say its role.

With `health_port`, a second, plain-HTTP server answers /healthz, /readyz and /metrics only
(kubelet probes and Prometheus present no client certificate), on `health_host`. GET /metrics
(on either server) gives the extender's own metrics in the Prometheus text format
(promfeed.FeedMetrics: scores made without the energy and load terms, failed refreshes).

start()/stop() run the server on its own event loop in a thread (tests, the
benchmark); open()/close() run it on the caller's loop, as serve_extender()
does for `gpunode extender`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import orjson
from aiohttp import web
from prometheus_client import generate_latest

from gpunode.cluster.extender.core import Extender
from gpunode.errors import BadRequest, ListenError, PlacementError
from gpunode.infra.http import HttpServer, ServerThread, closing

log = logging.getLogger(__name__)
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
WORKERS = 8  # the Extender serialises on its lock; more threads only let binds wait on the API together
MAX_PENDING = 256  # requests read, queued or running at once (kube-scheduler opens dozens at a time)
MAX_CONNECTIONS = 1024
DEFAULT_REQUEST_MEMORY_BYTES = (
    256 * 2**20
)  # half of the chart's 512Mi: the rest for the process and its caches
BUDGET_WAIT_S = 2.0  # how long a body waits for room in the budget before 503
VERBS = ("filter", "prioritize", "prioritize-claims", "bind", "preempt")
_HINT = "choose another --listen address, or stop the process that already listens there"


class Gate(Protocol):
    """Whether this replica answers the verbs now (ha.Leadership)."""

    def refusal(self) -> str | None:
        """None: answer; else why not (the 503's message)."""
        ...

    def status(self) -> dict[str, str]:
        """What /healthz and /readyz add (role, leader)."""
        ...


class ExtenderServer:
    """The extender's HTTP server: start(), .port, stop() from synchronous code, or open()/close() on a loop."""

    def __init__(
        self,
        extender: Extender,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        path_prefix: str = "",
        ssl_context: ssl.SSLContext | None = None,
        allowed_client_names: Iterable[str] = (),
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_pending: int = MAX_PENDING,
        request_memory_bytes: int = DEFAULT_REQUEST_MEMORY_BYTES,
        health_host: str = "0.0.0.0",
        health_port: int | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.extender = extender
        self.gate = gate
        self.path_prefix = path_prefix.rstrip("/")
        self.allowed_client_names = frozenset(allowed_client_names)
        self.max_body_bytes = max_body_bytes
        self.max_pending = max_pending
        self.request_memory_bytes = request_memory_bytes
        receiving = min(max(max_body_bytes, request_memory_bytes // 4), request_memory_bytes)
        self.decode_budget = DecodeBudget(request_memory_bytes - receiving)
        self.http = HttpServer(
            self._handle,
            name="extender",
            host=host,
            port=port,
            max_body_bytes=max_body_bytes,
            max_connections=MAX_CONNECTIONS,
            max_inflight_body_bytes=receiving,
            ssl_context=ssl_context,
            error_response=lambda status, message: _json(status, {"Error": message}),  # the layer's 413...
            log=log,
            error=ListenError,
            hint=_HINT,
        )
        self.health: HttpServer | None = None
        if health_port is not None:
            self.health = HttpServer(
                self._handle_health,
                name="extender health",
                host=health_host,
                port=health_port,
                max_body_bytes=1024,
                max_connections=64,
                log=log,
                error=ListenError,
                hint="choose another --health-listen address",
            )
        self._pending = 0  # requests admitted and not yet answered (counted on the loop only)
        self._executor: ThreadPoolExecutor | None = None
        self._thread: ServerThread | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return self.http.port

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop serving HTTP, once started: where a binder submits its coroutines."""
        if self.http.loop is None:
            raise RuntimeError("the extender server is not started")
        return self.http.loop

    @property
    def health_port(self) -> int | None:
        """The bound port of the health server, when there is one."""
        return self.health.port if self.health is not None else None

    async def open(self) -> None:
        """Bind and serve on the running event loop; ListenError if an address cannot be bound."""
        self._executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="extender")
        try:
            await self.http.start()
            if self.health is not None:
                await self.health.start()
        except BaseException:
            await self.http.stop()
            self._executor.shutdown(wait=False)
            raise

    async def close(self) -> None:
        """Stop serving: close the listening sockets and the connections, end the worker threads."""
        if self.health is not None:
            await self.health.stop()
        await self.http.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def start(self) -> None:
        """Serve on an event loop of its own in a thread; ListenError if an address cannot be bound."""
        self._thread = ServerThread(self.http)
        self._executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="extender")
        try:
            self._thread.start()
            if self.health is not None:
                asyncio.run_coroutine_threadsafe(self.health.start(), self._thread.loop).result(30)
        except BaseException:
            self._thread.stop()
            self._executor.shutdown(wait=False)
            raise

    def stop(self) -> None:
        """Stop what start() started."""
        if self._thread is not None:
            if self.health is not None and not self._thread.loop.is_closed():
                asyncio.run_coroutine_threadsafe(self.health.stop(), self._thread.loop).result(30)
            self._thread.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _verb(self, path: str) -> str | None:
        path = path.rstrip("/")
        if self.path_prefix and not path.startswith(self.path_prefix + "/"):
            return None
        return path[len(self.path_prefix) :].lstrip("/")

    async def _handle_health(self, request: web.Request) -> web.StreamResponse:
        verb = request.path.rstrip("/").lstrip("/")
        if verb not in ("healthz", "readyz", "metrics"):
            return _json(
                404, {"Error": f"no such path {request.path_qs}; this port serves healthz, readyz, metrics"}
            )
        if request.method not in ("GET", "HEAD"):
            return _json(405, {"Error": f"{verb} takes GET"}, allow="GET, HEAD")
        return self._metrics() if verb == "metrics" else _json(200, self._health())

    def _metrics(self) -> web.Response:
        """The extender's own metrics (the Prometheus feed's: fallback, failures, age) in the text format."""
        body = generate_latest(self.extender.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    def _health(self) -> dict[str, object]:
        """/healthz and /readyz: a standby is healthy and ready too (its Service routes by label)."""
        out: dict[str, object] = {"status": "ok", "nodes": len(self.extender.nodes)}
        if self.gate is not None:
            out.update(self.gate.status())
        return out

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.allowed_client_names and (refusal := self._client_refusal(request)) is not None:
            log.warning("extender: refused %s from %s: %s", request.path, request.remote, refusal)
            return closing(_json(403, {"Error": refusal}))
        verb = self._verb(request.path)
        reading = request.method in ("GET", "HEAD")
        if verb in ("healthz", "readyz", "metrics"):
            if not reading:
                return _json(405, {"Error": f"{verb} takes GET"}, allow="GET, HEAD")
            return self._metrics() if verb == "metrics" else _json(200, self._health())
        if verb not in VERBS:
            if request.method == "POST":
                return _json(404, {"Error": f"no such verb {request.path_qs}; use {', '.join(VERBS)}"})
            return _json(404, {"Error": f"no such path {request.path_qs}"})
        if request.method != "POST":
            return _json(405, {"Error": f"{verb} takes POST"}, allow="POST")
        if self.gate is not None and (refusal := self.gate.refusal()) is not None:
            # Closing the connection makes kube-scheduler's next one go through the Service again.
            return closing(_json(503, {"Error": refusal}, retry_after="1"))
        raw = (
            await request.read()
        )  # the HTTP layer has read it already, within max_body_bytes and its timeout
        if self._pending >= self.max_pending:
            busy = f"the extender is busy ({self._pending} requests waiting)"
            log.warning("extender: %s: answering %s with 503", busy, verb)
            return closing(_json(503, {"Error": f"{busy}; retry"}, retry_after="1"))
        self._pending += 1
        try:
            return await self._decode_and_answer(verb, raw)
        finally:
            self._pending -= 1

    async def _decode_and_answer(self, verb: str, raw: bytes) -> web.Response:
        """Take the body's decoded size from the budget (413/503 when it does not fit), then answer."""
        loop = asyncio.get_running_loop()
        budget = self.decode_budget
        # a small body is counted on the loop (microseconds), a large one in a worker
        size = (
            await loop.run_in_executor(self._executor, decoded_size, raw)
            if len(raw) > 65536
            else decoded_size(raw)
        )
        if size > budget.limit:
            message = (
                f"a {len(raw)}-byte {verb} body would take about {size >> 20} MiB decoded, more than the "
                f"{budget.limit >> 20} MiB of --request-memory {self.request_memory_bytes >> 20}Mi left for "
                "decoding: configure kube-scheduler to send node names (nodeCacheCapable: true), or raise "
                "--request-memory with the memory limit"
            )
            log.warning("extender: %s", message)
            return closing(_json(413, {"Error": message}))
        if not await budget.take(size, BUDGET_WAIT_S):
            message = (
                f"the extender is decoding other requests ({budget.used >> 20} of {budget.limit >> 20} MiB "
                f"of request memory in use, --request-memory); retry"
            )
            log.warning("extender: %s: answering %s with 503", message, verb)
            return closing(_json(503, {"Error": message}, retry_after="1"))
        call = {
            "filter": self.extender.filter,
            "prioritize": self.extender.prioritize,
            "prioritize-claims": self.extender.prioritize_claims,
            "bind": self.extender.bind,
            "preempt": self.extender.preempt,
        }
        try:
            status, body = await loop.run_in_executor(self._executor, _answer, verb, call[verb], raw)
        finally:
            budget.give(size)
        return web.Response(status=status, body=body, content_type="application/json")

    def _client_refusal(self, request: web.Request) -> str | None:
        """Why the client's certificate is not one of the allowed names (None: it is)."""
        transport = request.transport
        cert = transport.get_extra_info("peercert") if transport is not None else None
        return client_name_refusal(cert, self.allowed_client_names)


def client_name_refusal(cert: Any, allowed: frozenset[str]) -> str | None:
    """Why a client certificate (as ssl's getpeercert() gives it) is refused, None when it is accepted.

    The subject must hold exactly one commonName, and that name must be one of `allowed`. Subject
    alternative names do not count: a certificate with several common names, or whose CN is not
    allowed while a DNS name is, could be read as another identity by another verifier.
    """
    if not cert:
        return "no client certificate; one whose subject CN is an allowed name is required (--allowed-client-names)"
    names = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    if len(names) != 1:
        shown = ", ".join(repr(n) for n in names) or "none"
        return (
            f"client certificate has {len(names)} subject common names ({shown}); exactly one, an allowed "
            "name, is required (--allowed-client-names)"
        )
    if names[0] not in allowed:
        return f"client certificate CN {names[0]!r} is not an allowed name (--allowed-client-names)"
    return None


class DecodeBudget:
    """Bytes of decoded request bodies in flight, against `limit`: take() waits for room (on the loop)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._room: asyncio.Condition | None = None
        self._waking: set[asyncio.Task[None]] = set()

    async def take(self, size: int, wait_s: float) -> bool:
        """Take `size` bytes once they fit, waiting at most `wait_s`; False (nothing taken) if they never do."""
        if self._room is None:
            self._room = asyncio.Condition()
        async with self._room:
            try:
                async with asyncio.timeout(wait_s):
                    await self._room.wait_for(lambda: self.used + size <= self.limit)
            except TimeoutError:
                return False
            self.used += size
            return True

    def give(self, size: int) -> None:
        """Give back what take() took, waking the bodies that wait for room (on the loop)."""
        self.used -= size
        if self._room is not None and size:
            task = asyncio.get_running_loop().create_task(self._wake())
            self._waking.add(task)
            task.add_done_callback(self._waking.discard)

    async def _wake(self) -> None:
        assert self._room is not None
        async with self._room:
            self._room.notify_all()


def decoded_size(raw: bytes) -> int:
    """An upper bound on the memory orjson.loads(raw) peaks at, counted from the text (~70 ms for 32 MiB).

    Per byte of text and per object, array, value and string it opens, the most CPython takes for it
    (measured with tracemalloc over real NodeLists and the densest shapes: `[{},{},...]`, `[0,0,...]`,
    `["a",...]`, `[{"a":{}},...]`): the estimate is 1.0-1.8 times the measured peak.
    """
    return (
        16 * len(raw)
        + 96 * raw.count(b"{")
        + 64 * raw.count(b"[")
        + 24 * raw.count(b",")
        + 32 * raw.count(b'"')
    )


def _answer(verb: str, method: Callable[[Any], object], raw: bytes) -> tuple[int, bytes]:
    """Decode a request body, call the Extender, encode its answer (in a worker thread)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:  # also bad UTF-8, nesting over 1,024 levels and an empty body
        return 400, orjson.dumps({"Error": f"malformed JSON: {exc}"})
    try:
        return 200, orjson.dumps(method(body))
    except (BadRequest, PlacementError) as exc:
        return 400, orjson.dumps({"Error": str(exc)})
    except Exception as exc:  # a defect of ours: answer, log, keep serving
        log.exception("extender %s failed", verb)
        return 500, orjson.dumps({"Error": f"internal error in {verb}: {type(exc).__name__}: {exc}"})


def _json(
    status: int, payload: object, *, allow: str | None = None, retry_after: str | None = None
) -> web.Response:
    headers = {}
    if allow:
        headers["Allow"] = allow
    if retry_after:
        headers["Retry-After"] = retry_after
    return web.Response(
        status=status, body=orjson.dumps(payload), content_type="application/json", headers=headers
    )


async def serve_extender(
    *,
    extender: Extender,
    host: str,
    port: int,
    path_prefix: str = "",
    ready: asyncio.Event | None = None,
    bound: list[int] | None = None,
    **options: Any,
) -> None:
    """Serve the extender on the running loop until cancelled; `bound` receives the port bound.

    `options` are ExtenderServer's (ssl_context, allowed_client_names, max_body_bytes, health_port, ...).
    """
    server = ExtenderServer(extender, host=host, port=port, path_prefix=path_prefix, **options)
    await server.open()
    try:
        if bound is not None:
            bound.append(server.port)
        if ready is not None:
            ready.set()
        await asyncio.get_running_loop().create_future()  # until cancelled
    finally:
        await server.close()
