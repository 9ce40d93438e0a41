"""The metrics endpoint: a small HTTP/1.1 server on asyncio for /metrics and /health.

Prometheus keeps its connection open between scrapes, so the server speaks
keep-alive; it answers GET and HEAD, refuses anything else, and closes idle or
misbehaving connections. A scrape costs one call to MetricsCollector.render(),
which returns bytes prepared by the background collector: nothing here reads
the backend or waits for a collection.

This module must not collect anything and must not block the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Protocol

from gpunode.config.metrics import ListenAddress, parse_listen
from gpunode.errors import GpunodeError

log = logging.getLogger(__name__)

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
IDLE_TIMEOUT_S = 300.0  # longer than any sensible scrape interval, so Prometheus can keep its connection
REQUEST_TIMEOUT_S = 10.0  # a started request must arrive whole within this time
MAX_CONNECTIONS = 64  # scrapers are few; more open connections than this are refused with 503

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}
_INDEX = (
    b"<html><head><title>gpunode metrics</title></head><body><h1>gpunode</h1>"
    b'<p><a href="/metrics">/metrics</a> (DCGM-compatible) and <a href="/health">/health</a></p></body></html>\n'
)


class MetricsSource(Protocol):
    """What the server needs from a collector."""

    def render(self) -> bytes: ...

    def health_status(self) -> tuple[bool, str]: ...


class MetricsServerError(GpunodeError):
    """The metrics endpoint could not listen."""

    default_hint = "choose another gpunode.metrics.listen address, or stop what already listens there"


class _BadRequest(Exception):
    pass


class MetricsServer:
    """Serves a MetricsSource on one TCP address; start() binds, stop() closes."""

    def __init__(self, source: MetricsSource, listen: str | ListenAddress) -> None:
        self._source = source
        self.address = listen if isinstance(listen, ListenAddress) else parse_listen(listen, "listen")
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.requests = 0

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the metrics server is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        host = self.address.host or None  # None: every interface, IPv4 and IPv6
        try:
            self._server = await asyncio.start_server(
                self._serve_connection,
                host=host,
                port=self.address.port,
                reuse_address=True,
                limit=MAX_HEADER_BYTES,
            )
        except OSError as err:
            raise MetricsServerError(
                f"cannot listen for metrics on {self.address}: {err.strerror or err}"
            ) from None
        log.info(
            "metrics: serving /metrics on %s",
            ", ".join(str(s.getsockname()[:2]) for s in self._server.sockets),
        )

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        self._server = None

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= MAX_CONNECTIONS:
            with contextlib.suppress(ConnectionError):
                await self._respond(writer, 503, b"too many connections\n", keep_alive=False)
            writer.close()
            return
        self._connections.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while await self._serve_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection should close."""
        try:
            first = await asyncio.wait_for(reader.readline(), IDLE_TIMEOUT_S)
            if not first:
                return False
            method, path, version, headers = await asyncio.wait_for(
                self._read_head(first, reader), REQUEST_TIMEOUT_S
            )
        except (_BadRequest, asyncio.LimitOverrunError, ValueError):
            await self._respond(writer, 400, b"bad request\n", keep_alive=False)
            return False
        keep_alive = _wants_keep_alive(version, headers.get("connection", ""))
        self.requests += 1
        route = path.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            await self._respond(writer, 405, b"only GET and HEAD\n", keep_alive=keep_alive, allow=True)
            return keep_alive
        if route == "/metrics":
            status, body, ctype = 200, self._source.render(), CONTENT_TYPE
        elif route == "/health":
            ok, detail = self._source.health_status()
            status, body, ctype = (
                (200 if ok else 503),
                f"{'OK' if ok else 'KO'}: {detail}\n".encode(),
                b"text/plain",
            )
        elif route == "/":
            status, body, ctype = 200, _INDEX, b"text/html"
        else:
            status, body, ctype = 404, b"not found\n", b"text/plain"
        await self._respond(
            writer, status, body, keep_alive=keep_alive, content_type=ctype, head=method == "HEAD"
        )
        return keep_alive

    async def _read_head(
        self, first: bytes, reader: asyncio.StreamReader
    ) -> tuple[str, str, str, dict[str, str]]:
        parts = first.decode("latin-1").rstrip("\r\n").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(first)
        headers: dict[str, str] = {}
        size = len(first)
        while True:
            line = await reader.readline()
            size += len(line)
            if size > MAX_HEADER_BYTES:
                raise _BadRequest("headers too large")
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise asyncio.IncompleteReadError(b"", None)
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise _BadRequest(line)
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or "0")
        if length < 0 or length > MAX_BODY_BYTES or "transfer-encoding" in headers:
            raise _BadRequest("request body not accepted")
        if length:
            await reader.readexactly(length)
        return parts[0], parts[1], parts[2], headers

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        *,
        keep_alive: bool,
        content_type: bytes = b"text/plain",
        head: bool = False,
        allow: bool = False,
    ) -> None:
        head_lines = [
            f"HTTP/1.1 {status} {_REASONS[status]}".encode(),
            b"Content-Type: " + content_type,
            f"Content-Length: {len(body)}".encode(),
            b"Connection: keep-alive" if keep_alive else b"Connection: close",
        ]
        if allow:
            head_lines.append(b"Allow: GET, HEAD")
        writer.write(b"\r\n".join(head_lines) + b"\r\n\r\n")
        if not head:
            writer.write(body)
        await writer.drain()


def _wants_keep_alive(version: str, connection: str) -> bool:
    tokens = {t.strip().lower() for t in connection.split(",")}
    if version == "HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


async def serve_metrics(*, collector: MetricsSource, listen: str, ready: asyncio.Event | None = None) -> None:
    """Serve /metrics and /health on `listen` until cancelled (cancelling the task stops it)."""
    server = MetricsServer(collector, parse_listen(listen, "gpunode.metrics.listen"))
    await server.start()
    if ready is not None:
        ready.set()
    try:
        await asyncio.get_running_loop().create_future()  # until cancelled
    finally:
        await server.stop()
