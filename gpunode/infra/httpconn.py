"""The connections of gpunode.infra.http: aiohttp's connection manager and handler, with the connection
limit (evicting the oldest idle connection) and the request-head timer. See gpunode.infra.http."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gpunode.infra.httpbody import BodyRequest
from gpunode.infra.httplog import AccessLog, ProtocolLog

if TYPE_CHECKING:
    from gpunode.infra.http import HttpServer

LINGER_S = 2.0  # how long an unread body is drained (and dropped) after a refusal, so the client sees it
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n"
)


class Connections(web.Server):
    """aiohttp's connection manager, making Connection handlers and BodyRequest objects."""

    def __init__(
        self,
        http: HttpServer,
        dispatch: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.http = http
        self._handler_options: dict[str, Any] = {
            "keepalive_timeout": http.keepalive_timeout_s,
            "access_log_class": AccessLog,
            "access_log": http.log,
            "logger": ProtocolLog(http.log, {}),
            "lingering_time": LINGER_S,
        }
        super().__init__(dispatch, request_factory=self._request, loop=loop)
        self.event_loop = loop

    def __call__(self) -> Connection:
        """A handler for one new connection."""
        return Connection(self, loop=self.event_loop, **self._handler_options)

    def live(self) -> list[Connection]:
        """The open connections, oldest first."""
        return [c for c in self.connections if isinstance(c, Connection) and c.transport is not None]

    def _request(self, message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> BodyRequest:
        size = max(self.http.max_body_bytes, 1)  # aiohttp reads 0 as "no limit"; _answer checks the real one
        return BodyRequest(message, payload, protocol, writer, task, self.event_loop, client_max_size=size)


class Connection(web.RequestHandler):
    """One client connection: aiohttp's handler plus the connection limit and the head timer."""

    def __init__(self, manager: Connections, **options: Any) -> None:
        super().__init__(manager, **options)
        self.http = manager.http
        self.connections = manager
        self.busy = False  # a request is being read, handled or answered
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._refused_transport: asyncio.Transport | None = None
        self.peer = ""  # the client's address (host part); "" for a Unix socket

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """A connection is accepted: make room at the limit (or refuse it) and start the head timer."""
        self.peer = _peer_host(transport)
        live = self.connections.live()
        if len(live) >= self.http.max_connections:
            idle = _eviction_victim(live, self.peer)
            if idle is None:
                self._refuse(transport)
                return
            self.http.log.debug(
                "%s: at %d connections, closing the oldest idle one of %s",
                self.http.name,
                len(live),
                idle.peer or "local",
            )
            idle.force_close()
        super().connection_made(transport)
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        """Bytes arrived: a new request head starts the head timer; a complete one makes it busy."""
        if self._refused:
            return
        if data and not self.busy and self._head_timer is None:
            self._start_head_timer()
        super().data_received(data)
        if self._has_queued_request():
            self.begin_request()  # a complete head waits for its turn: not idle, not to be evicted

    def eof_received(self) -> None:
        """The client finished sending."""
        if self._refused and self._refused_transport is not None:
            self._refused_transport.close()  # the client has read the answer and is done
            return
        super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        """The connection is gone."""
        self._cancel_head_timer()
        if not self._refused:
            super().connection_lost(exc)

    def begin_request(self) -> None:
        """A complete request head arrived: the connection is busy until its response is sent."""
        self.busy = True
        self._cancel_head_timer()

    def end_request(self) -> None:
        """The response is sent: idle, unless more pipelined requests are waiting."""
        self.busy = self._has_queued_request()

    def _has_queued_request(self) -> bool:
        # aiohttp queues the parsed request heads a connection has not handled yet in _messages.
        return bool(getattr(self, "_messages", None))

    def _start_head_timer(self) -> None:
        self._head_timer = self.connections.event_loop.call_later(
            self.http.header_timeout_s, self._head_timeout
        )

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self.busy and self.transport is not None:
            self.http.log.debug(
                "%s: closing a connection that sent no complete request head within %gs",
                self.http.name,
                self.http.header_timeout_s,
            )
            self.force_close()

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        """Every connection is busy: answer 503, then close once the client has read it (or after LINGER_S)."""
        self._refused = True
        self.http.log.debug(
            "%s: %d connections, all busy: refusing one", self.http.name, self.http.max_connections
        )
        assert isinstance(transport, asyncio.Transport)
        self._refused_transport = transport
        transport.write(_REFUSED)
        if transport.can_write_eof():
            transport.write_eof()
        self.connections.event_loop.call_later(LINGER_S, transport.close)


def _peer_host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


def _eviction_victim(live: list[Connection], newcomer: str) -> Connection | None:
    """The connection to close so a new one from `newcomer` fits: the oldest idle connection of the
    client address holding the most connections (the newcomer counted) among those holding at least as
    many as the newcomer's, so one address flooding the server churns its own connections and never
    those of another (a kubelet probe, a scraper), even when all of its own are busy. None when no such
    connection is idle (the newcomer is then refused)."""
    held: dict[str, int] = {newcomer: 1}
    oldest_idle: dict[str, Connection] = {}
    for c in live:  # oldest first
        held[c.peer] = held.get(c.peer, 0) + 1
        if not c.busy:
            oldest_idle.setdefault(c.peer, c)
    mine = held[newcomer]
    peers = [p for p in oldest_idle if held[p] >= mine]
    if not peers:
        return None
    return oldest_idle[max(peers, key=lambda p: held[p])]
