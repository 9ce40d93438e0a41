"""The one way gpunode serves HTTP: a small wrapper over aiohttp.web.

Every HTTP endpoint of gpunode (the agent's metrics endpoint, the scheduler
extender, the simulated node's control socket) is an HttpServer: one request
handler, served on a TCP address or a Unix socket by aiohttp's AppRunner and a
TCPSite or UnixSite. The handler gets every request and does its own routing,
so that each server answers unknown paths and wrong methods in its own format.
All servers behave the same way:

- the listen backlog is BACKLOG, so a burst of clients (kube-scheduler opens
  dozens of connections at once) waits in the kernel's accept queue instead of
  being reset;
- HTTP/1.1 with keep-alive; a connection idle for `keepalive_timeout_s` is closed;
- a request body larger than `max_body_bytes` cannot be read (request.read()
  raises aiohttp's 413); with `max_connections`, a request arriving on a
  connection beyond that many open ones is answered 503 and the connection closed;
- a request line that names another major HTTP version than 1 is answered 400;
- one info line when the server starts, naming the addresses it bound (the real
  port when port 0 was asked); one debug line per request (the access log is
  at debug, never info); a request aiohttp cannot parse is answered 400 by
  aiohttp and logged at debug, as the client's mistake;
- an address that is in use or cannot be bound raises a one-line GpunodeError
  (ListenError unless the caller names its own class) with a hint;
- stop() closes the listening sockets, then the connections, waiting at most
  STOP_TIMEOUT_S for requests in progress.

aiohttp answers in the request's HTTP version (HTTP/1.0 to an HTTP/1.0 client,
closing after the answer), requires the Host header of HTTP/1.1 (RFC 9112), and
gives no answer to a client that half-closes its side right after the request.

Handlers are coroutines on the server's event loop and must not block it:
blocking or CPU-bound work goes to a thread (asyncio.to_thread or an executor).
ServerThread runs a server on its own event loop in a thread, for callers that
are not asynchronous. This module imports nothing from gpunode.node or
gpunode.cluster.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gpunode.errors import GpunodeError, ListenError, one_line

log = logging.getLogger(__name__)

BACKLOG = 1024  # the kernel caps it at net.core.somaxconn (4096 on current kernels, 128 on old ones)
KEEPALIVE_TIMEOUT_S = 75.0
STOP_TIMEOUT_S = 5.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def closing(response: web.Response) -> web.Response:
    """`response`, marked to close its connection after it is sent (and saying so in its headers)."""
    response.headers["Connection"] = "close"
    response.force_close()
    return response


class HttpServer:
    """Serves one request handler on a TCP address (`host`, `port`) or a Unix socket (`unix_path`).

    `host` None or "" listens on every interface. `name` names the server in
    log lines and errors; log lines go to `log`. start() binds and raises
    `error` (a GpunodeError class, with `hint` when given) if it cannot.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        name: str,
        max_body_bytes: int,
        host: str | None = None,
        port: int = 0,
        unix_path: str | None = None,
        max_connections: int | None = None,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
        backlog: int = BACKLOG,
        log: logging.Logger = log,
        error: type[GpunodeError] = ListenError,
        hint: str | None = None,
    ) -> None:
        self.name = name
        self.log = log
        self._handler = handler
        self._host = host or None
        self._port = port
        self._unix_path = unix_path
        self._max_body_bytes = max_body_bytes
        self._max_connections = max_connections
        self._keepalive_timeout_s = keepalive_timeout_s
        self._backlog = backlog
        self._error = error
        self._hint = hint
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | web.UnixSite | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it serves on, once started

    @property
    def where(self) -> str:
        """The address asked for, as errors name it."""
        if self._unix_path is not None:
            return self._unix_path
        host = self._host or "*"
        return f"[{host}]:{self._port}" if ":" in host else f"{host}:{self._port}"

    @property
    def addresses(self) -> list[str]:
        """The addresses actually bound, e.g. ["127.0.0.1:9400"] or ["0.0.0.0:9400", "[::]:9400"]."""
        if self._runner is None:
            return []
        return [_address_text(a) for a in self._runner.addresses]

    @property
    def port(self) -> int:
        """The bound TCP port (useful with port 0)."""
        if self._runner is None or not isinstance(self._site, web.TCPSite):
            raise RuntimeError(f"the {self.name} server is not listening on TCP")
        return int(self._runner.addresses[0][1])

    async def start(self) -> None:
        """Bind and start serving on the running event loop."""
        app = web.Application(client_max_size=self._max_body_bytes)
        app.router.add_route("*", "/{path:.*}", self._handle)
        runner = web.AppRunner(
            app,
            access_log_class=_AccessLog,
            access_log=self.log,
            logger=_ProtocolLog(self.log, {}),
            keepalive_timeout=self._keepalive_timeout_s,
            shutdown_timeout=STOP_TIMEOUT_S,
        )
        await runner.setup()
        site: web.TCPSite | web.UnixSite
        if self._unix_path is not None:
            site = web.UnixSite(runner, self._unix_path, backlog=self._backlog)
        else:
            site = web.TCPSite(runner, self._host, self._port, backlog=self._backlog)
        try:
            await site.start()
        except OSError as err:
            await runner.cleanup()
            # asyncio rewords a bind error ("error while attempting to bind on address ..."): name it plainly
            why = os.strerror(err.errno) if err.errno and err.errno > 0 else (err.strerror or str(err))
            raise self._error(
                f"cannot listen for {self.name} on {self.where}: {why}", hint=self._hint
            ) from None
        self._runner, self._site = runner, site
        self.loop = asyncio.get_running_loop()
        self.log.info("%s: serving HTTP on %s", self.name, ", ".join(self.addresses))

    async def stop(self) -> None:
        """Stop listening, close the connections; harmless when not started."""
        runner, self._runner, self._site = self._runner, None, None
        if runner is not None:
            await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        server = self._runner.server if self._runner is not None else None
        if (
            self._max_connections is not None
            and server is not None
            and len(server.connections) > self._max_connections
        ):
            return closing(web.Response(status=503, text="too many connections\n"))
        if request.version.major != 1:
            return closing(web.Response(status=400, text="only HTTP/1.x is served here\n"))
        return await self._handler(request)


class ServerThread:
    """Runs an HttpServer on its own event loop in a daemon thread, for callers that are not asynchronous."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"http-{server.name}", daemon=True)
        self._started = False

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the thread and the server; raises what HttpServer.start() raises."""
        self._thread.start()
        self._started = True
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout_s)
        except BaseException:
            self._end_loop()
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server and end the thread; harmless when not started or already stopped."""
        if not self._started or self.loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout_s)
        finally:
            self._end_loop()

    def _end_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


def _address_text(sockname: Any) -> str:
    if isinstance(sockname, str | bytes):  # a Unix socket
        return f"unix:{sockname.decode() if isinstance(sockname, bytes) else sockname}"
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _AccessLog(web.AbstractAccessLogger):
    """One debug line per request: client, method, path, status, body bytes and time taken."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.debug(
            '%s "%s %s" %d %d %.1fms',
            request.remote or "local",
            request.method,
            request.path_qs,
            response.status,
            response.body_length,
            time * 1000,
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.DEBUG)


class _ProtocolLog(logging.LoggerAdapter):
    """aiohttp's connection-level log. A request aiohttp cannot parse was answered 400: that is the
    client's mistake, logged as one debug line without a traceback; anything else (a handler's defect)
    is logged as aiohttp logs it, with its traceback."""

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            super().log(logging.DEBUG, f"{msg}: %s", *args, one_line(str(exc_info.message)))
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)
