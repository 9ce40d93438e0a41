"""The one way gpunode serves HTTP: a small, bounded server on aiohttp's low-level web.Server.

API (stable; other parts of gpunode build on it):

    HttpServer(handler, *, name, max_body_bytes, host=None, port=0, unix_path=None,
               max_connections=MAX_CONNECTIONS, max_inflight_body_bytes=None,
               keepalive_timeout_s=KEEPALIVE_TIMEOUT_S,
               header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S,
               send_timeout_s=SEND_TIMEOUT_S, ssl_context=None, error_response=None,
               backlog=BACKLOG, log=..., error=ListenError, hint=None)
        await start() / await stop(); .port, .addresses, .loop, .connections, .body_bytes_in_use
    server_tls_context(cert_file, key_file, client_ca_file=None) -> ssl.SSLContext
        (TLS 1.2 or later; a client certificate signed by client_ca_file is required when it is given;
        TlsConfigError, one line, for a file that cannot be read or a key that does not fit)
    ServerThread(server): start()/stop() on an event loop of its own in a thread
    closing(response): the response, marked to close its connection

Every HTTP endpoint of gpunode (the agent's metrics endpoint, the scheduler
extender, the simulated node's control socket) is an HttpServer: one request
handler on a TCP address or a Unix socket, optionally over TLS. The handler gets
every request and does its own routing; the requests the layer refuses itself
(400, 408, 413, 417, 503 below) are answered by `error_response(status, message)`
when given, so that each server answers in its own format (plain text
otherwise). Anything that can reach the port is
treated as an adversary; every resource a client can hold is bounded:

- connections: one event loop serves them all (no thread per connection). At
  most `max_connections` are open: when a new one arrives at the limit, the
  oldest connection with no request in progress (an idle keep-alive one or one
  still sending its request head) of the client address holding the most
  connections is closed to make room, so a fresh client (a probe, a scrape) is
  always served, and one address opening connections as fast as it can churns
  only its own: a connection is only ever closed for a newcomer whose address
  holds no more connections than the connection's. When no connection may be
  closed so (every one of those addresses has a request in progress on each),
  the new one is answered 503 and closed. The limit is
  applied when a connection is accepted (with TLS, when its handshake is done;
  a handshake must finish within `header_timeout_s`);
- the request head: it must arrive complete within `header_timeout_s` of the
  connection being opened, or of the first byte of a later request on a
  kept-alive connection; a client that trickles its head (slowloris) is closed.
  The head is also bounded in size (aiohttp: 8 KiB per line, 128 header lines);
- idle keep-alive: a connection with nothing to do for `keepalive_timeout_s`
  after a response is closed (HTTP/1.1 keep-alive; HTTP/1.0 closes after the answer);
- the body: a Content-Length over `max_body_bytes` is answered 413 before a
  byte of the body is read (with limit 0, any body, chunked included, is
  refused); a chunked body is counted as it arrives and refused with 413 once
  over the limit; a body not received within `body_timeout_s` is answered 408.
  The handler is called with the body already read (request.read() returns it
  at once). "Expect: 100-continue" is answered before the body is read;
- the bodies together: the bytes of the bodies a server is receiving or holding
  at once are bounded by `max_inflight_body_bytes` (default
  INFLIGHT_BODY_FACTOR x max_body_bytes), not by max_connections x
  max_body_bytes. A request takes its whole Content-Length from that budget
  before a byte of its body is read; when it does not fit in what is left it is
  answered 503 with Retry-After and its connection closed, its body unread. A
  chunked body takes its share as it arrives and is cut off the same way (503,
  close) once it does not fit. The share is given back once the handler has
  returned and its response is sent, or the connection is gone (a client that
  leaves mid-body gives it back at once). Beyond the budget, a connection holds at
  most aiohttp's read buffer (~128 KiB: reading from the socket pauses above
  it), and joining a body's chunks briefly holds it twice;
- the response: it must be taken by the client within `send_timeout_s`, or the
  connection is closed;
- a request line that names another major HTTP version than 1 is answered 400.

Routine client behaviour (a request aiohttp cannot parse: 400; a closed
connection; a timeout) is logged at debug, never with a traceback; one debug
line per request (the access log); one info line when the server starts,
naming the addresses it bound. An address that is in use or cannot be bound
raises a one-line GpunodeError (ListenError unless the caller names its own
class) with a hint. stop() closes the listening sockets, then the connections,
waiting at most STOP_TIMEOUT_S for requests in progress.

How it hooks into aiohttp (3.10+, public classes), in gpunode.infra.httpconn:
web.Server with our own request factory (BodyRequest objects: web.Request
holding the body the layer read; no web.Application) and a web.RequestHandler
subclass that overrides the asyncio Protocol methods (connection_made,
data_received, connection_lost) to apply the connection limit and the head
timer (it also reads the handler's queue of parsed request heads, _messages, so
that a queued request is not taken for an idle connection); aiohttp's own
keep-alive timer does the idle timeout. The body and send bounds are applied
around the handler, in HttpServer._dispatch; the body is read chunk by chunk
from the request's stream (gpunode.infra.httpbody), so that no more than
aiohttp's read buffer waits outside the budget.

Handlers are coroutines on the server's event loop and must not block it:
blocking or CPU-bound work goes to a thread (asyncio.to_thread or an executor).
This module imports nothing from gpunode.node or gpunode.cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gpunode.errors import BodyRefused, GpunodeError, ListenError, one_line
from gpunode.infra.httpbody import BodyBudget, BodyHold, BodyRequest, read_body
from gpunode.infra.httpconn import Connection, Connections
from gpunode.infra.tls import server_tls_context

__all__ = ["HttpServer", "ServerThread", "closing", "server_tls_context"]

log = logging.getLogger(__name__)

BACKLOG = 1024  # the kernel caps it at net.core.somaxconn (4096 on current kernels, 128 on old ones)
MAX_CONNECTIONS = 1024
INFLIGHT_BODY_FACTOR = 4  # the default body budget: this many bodies of the largest size at once
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 30.0
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
    `error` (a GpunodeError class, with `hint` when given) if it cannot. The
    limits are described in the module's docstring.
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
        max_connections: int = MAX_CONNECTIONS,
        max_inflight_body_bytes: int | None = None,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        send_timeout_s: float = SEND_TIMEOUT_S,
        ssl_context: ssl.SSLContext | None = None,
        error_response: Callable[[int, str], web.Response] | None = None,
        backlog: int = BACKLOG,
        log: logging.Logger = log,
        error: type[GpunodeError] = ListenError,
        hint: str | None = None,
    ) -> None:
        if max_connections < 1 or max_body_bytes < 0:
            raise ValueError("max_connections must be >= 1 and max_body_bytes >= 0")
        if max_inflight_body_bytes is None:
            max_inflight_body_bytes = INFLIGHT_BODY_FACTOR * max_body_bytes
        if max_inflight_body_bytes < max_body_bytes:
            raise ValueError("max_inflight_body_bytes must be at least max_body_bytes")
        self.name = name
        self.log = log
        self._handler = handler
        self._host = host or None
        self._port = port
        self._unix_path = unix_path
        self.max_body_bytes = max_body_bytes
        self.max_connections = max_connections
        self._bodies = BodyBudget(max_inflight_body_bytes)
        self.keepalive_timeout_s = keepalive_timeout_s
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.send_timeout_s = send_timeout_s
        self._ssl = ssl_context
        self._error_response = error_response
        self._backlog = backlog
        self._error = error
        self._hint = hint
        self._web: Connections | None = None
        self._listener: asyncio.Server | None = None
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
        if self._listener is None:
            return []
        return [_address_text(s.getsockname()) for s in self._listener.sockets]

    @property
    def port(self) -> int:
        """The bound TCP port (useful with port 0)."""
        if self._listener is None or self._unix_path is not None:
            raise RuntimeError(f"the {self.name} server is not listening on TCP")
        return int(self._listener.sockets[0].getsockname()[1])

    @property
    def connections(self) -> int:
        """How many connections are open now."""
        return 0 if self._web is None else len(self._web.live())

    @property
    def max_inflight_body_bytes(self) -> int:
        """The body budget: how many bytes of request bodies may be received or held at once."""
        return self._bodies.limit

    @property
    def body_bytes_in_use(self) -> int:
        """How much of the body budget requests have taken now."""
        return self._bodies.used

    async def start(self) -> None:
        """Bind and start serving on the running event loop."""
        loop = asyncio.get_running_loop()
        web_server = Connections(self, self._dispatch, loop)
        tls: dict[str, Any] = {}
        if self._ssl is not None:
            tls = {"ssl": self._ssl, "ssl_handshake_timeout": self.header_timeout_s}
        try:
            if self._unix_path is not None:
                listener = await loop.create_unix_server(
                    web_server, self._unix_path, backlog=self._backlog, **tls
                )
            else:
                listener = await loop.create_server(
                    web_server, self._host, self._port, backlog=self._backlog, **tls
                )
        except OSError as err:
            # asyncio rewords a bind error ("error while attempting to bind on address ..."): name it plainly
            why = os.strerror(err.errno) if err.errno and err.errno > 0 else (err.strerror or str(err))
            raise self._error(
                f"cannot listen for {self.name} on {self.where}: {why}", hint=self._hint
            ) from None
        self._web, self._listener, self.loop = web_server, listener, loop
        scheme = "HTTPS" if self._ssl is not None else "HTTP"
        self.log.info("%s: serving %s on %s", self.name, scheme, ", ".join(self.addresses))

    async def stop(self) -> None:
        """Stop listening, close the connections; harmless when not started."""
        listener, web_server, self._listener, self._web = self._listener, self._web, None, None
        if listener is not None:
            listener.close()
        if web_server is not None:
            await asyncio.sleep(0)  # requests that arrived before the close start to be handled
            web_server.pre_shutdown()
            await web_server.shutdown(STOP_TIMEOUT_S)
        if listener is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(listener.wait_closed(), STOP_TIMEOUT_S)

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        assert isinstance(request, BodyRequest)
        conn = request.protocol
        assert isinstance(conn, Connection)
        conn.begin_request()
        hold = self._bodies.hold()
        try:
            try:
                response = await self._answer(request, hold)
            except web.HTTPException as exc:  # aiohttp answers it; sent here within the send bound
                await self._send(request, exc)
                raise
            await self._send(request, response)
            return response
        finally:
            hold.release()
            conn.end_request()

    async def _answer(self, request: BodyRequest, hold: BodyHold) -> web.StreamResponse:
        if request.version.major != 1:
            return self._refusal(400, "only HTTP/1.x is served here")
        limit, length = self.max_body_bytes, request.content_length
        too_large = f"the body must be at most {limit} bytes" + (f", got {length}" if length else "")
        if (length is not None and length > limit) or (limit == 0 and "Transfer-Encoding" in request.headers):
            return self._refusal(413, too_large)
        if request.body_exists:
            if length is not None and not hold.take(length):
                return self._busy(length)
            expect = request.headers.get("Expect", "")
            if expect.lower() == "100-continue" and request.version.minor >= 1:
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            elif expect:
                return self._refusal(417, f"unknown expectation {expect!r}")
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    request.hold_body(await read_body(request.content, hold, limit, length))
            except TimeoutError:
                self.log.debug("%s: request body not received within %gs", self.name, self.body_timeout_s)
                return self._refusal(408, f"the body was not received within {self.body_timeout_s:g}s")
            except BodyRefused as refused:
                return self._refusal(413, too_large) if refused.status == 413 else self._busy(None)
            except web.RequestPayloadError as err:
                return self._refusal(400, f"bad request body: {one_line(str(err))}")
            except ConnectionError:  # the client went away mid-body: nobody is left to answer
                self.log.debug("%s: connection lost while receiving a request body", self.name)
                return self._refusal(400, "connection lost")
        return await self._handler(request)

    def _refusal(self, status: int, message: str) -> web.Response:
        """A request refused by the layer, in the server's own format, closing its connection."""
        if self._error_response is not None:
            return closing(self._error_response(status, message))
        return closing(web.Response(status=status, text=message + "\n"))

    def _busy(self, length: int | None) -> web.Response:
        """503 for a body that does not fit in what is left of the body budget."""
        budget = self._bodies
        self.log.debug(
            "%s: body budget: %d of %d bytes in use, refusing a body of %s bytes",
            self.name,
            budget.used,
            budget.limit,
            "unknown" if length is None else length,
        )
        response = self._refusal(
            503, f"too many request bodies are being received at once ({budget.limit} bytes); retry"
        )
        response.headers["Retry-After"] = "1"
        return response

    async def _send(self, request: web.Request, response: web.StreamResponse) -> None:
        """Write the response within send_timeout_s; a client that does not take it is disconnected."""
        if response.prepared:
            return
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await response.prepare(request)
                await response.write_eof()
        except (TimeoutError, ConnectionError):
            self.log.debug("%s: response not taken by the client within %gs", self.name, self.send_timeout_s)
            request.protocol.force_close()


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
