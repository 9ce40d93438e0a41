"""The extender's HTTP server, on gpunode.infra.http.

ExtenderServer routes POST <prefix>/filter, /prioritize, /bind and GET /healthz
(and /readyz) to an Extender. Malformed JSON and wrong shapes (bad UTF-8,
nesting deeper than 1,024 levels, an empty body) get 400 with {"Error": "..."};
an oversized body 413; an unknown path 404; a wrong method 405. Only a defect
in our code gives 500, and the server keeps serving.

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

start()/stop() run the server on its own event loop in a thread (tests, the
benchmark); open()/close() run it on the caller's loop, as serve_extender()
does for `gpunode extender`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from aiohttp import web

from gpunode.cluster.extender.core import Extender
from gpunode.errors import BadRequest, ListenError, PlacementError
from gpunode.infra.http import HttpServer, ServerThread, closing

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 256 * 2**20
WORKERS = 8  # the Extender serialises on its lock; more threads only let binds wait on the API together
VERBS = ("filter", "prioritize", "bind")


class ExtenderServer:
    """The extender's HTTP server: start(), .port, stop() from synchronous code, or open()/close() on a loop."""

    def __init__(
        self, extender: Extender, *, host: str = "127.0.0.1", port: int = 0, path_prefix: str = ""
    ) -> None:
        self.extender = extender
        self.path_prefix = path_prefix.rstrip("/")
        self.http = HttpServer(
            self._handle,
            name="extender",
            host=host,
            port=port,
            max_body_bytes=MAX_BODY_BYTES,
            log=log,
            error=ListenError,
            hint="choose another --listen address, or stop the process that already listens there",
        )
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

    async def open(self) -> None:
        """Bind and serve on the running event loop; ListenError if the address cannot be bound."""
        self._executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="extender")
        try:
            await self.http.start()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    async def close(self) -> None:
        """Stop serving: close the listening socket and the connections, end the worker threads."""
        await self.http.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def start(self) -> None:
        """Serve on an event loop of its own in a thread; ListenError if the address cannot be bound."""
        self._thread = ServerThread(self.http)
        self._executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="extender")
        try:
            self._thread.start()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    def stop(self) -> None:
        """Stop what start() started."""
        if self._thread is not None:
            self._thread.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _verb(self, path: str) -> str | None:
        path = path.rstrip("/")
        if self.path_prefix and not path.startswith(self.path_prefix + "/"):
            return None
        return path[len(self.path_prefix) :].lstrip("/")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        verb = self._verb(request.path)
        reading = request.method in ("GET", "HEAD")
        if verb in ("healthz", "readyz"):
            if not reading:
                return _json(405, {"Error": f"{verb} takes GET"}, allow="GET, HEAD")
            return _json(200, {"status": "ok", "nodes": len(self.extender.nodes)})
        if verb not in VERBS:
            if request.method == "POST":
                return _json(
                    404, {"Error": f"no such verb {request.path_qs}; use filter, prioritize or bind"}
                )
            return _json(404, {"Error": f"no such path {request.path_qs}"})
        if request.method != "POST":
            return _json(405, {"Error": f"{verb} takes POST"}, allow="POST")
        length = request.content_length
        if length is not None and length > MAX_BODY_BYTES:
            return closing(
                _json(413, {"Error": f"body of {length} bytes is over the {MAX_BODY_BYTES} accepted"})
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body over the limit
            return closing(_json(413, {"Error": f"body over the {MAX_BODY_BYTES} bytes accepted"}))
        call = {
            "filter": self.extender.filter,
            "prioritize": self.extender.prioritize,
            "bind": self.extender.bind,
        }
        status, body = await asyncio.get_running_loop().run_in_executor(
            self._executor, _answer, verb, call[verb], raw
        )
        return web.Response(status=status, body=body, content_type="application/json")


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


def _json(status: int, payload: object, *, allow: str | None = None) -> web.Response:
    headers = {"Allow": allow} if allow else None
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
) -> None:
    """Serve the extender over HTTP on the running loop until cancelled; `bound` receives the port bound."""
    server = ExtenderServer(extender, host=host, port=port, path_prefix=path_prefix)
    await server.open()
    try:
        if bound is not None:
            bound.append(server.port)
        if ready is not None:
            ready.set()
        await asyncio.get_running_loop().create_future()  # until cancelled
    finally:
        await server.close()
