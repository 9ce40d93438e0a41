"""The metrics endpoint: /metrics, /health and an index page over HTTP/1.1 (gpunode.infra.http).

Prometheus keeps its connection open between scrapes, so connections stay open
(keep-alive) for IDLE_TIMEOUT_S; the endpoint answers GET and HEAD and refuses
anything else with 405, a chunked request body or one over MAX_BODY_BYTES with
400, and requests on connections beyond MAX_CONNECTIONS with 503. A scrape
costs one call to MetricsCollector.render(), which returns bytes prepared by
the background collector: nothing here reads the backend or waits for a
collection.

This module must not collect anything and must not block the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from aiohttp import web

from gpunode.config.metrics import ListenAddress, parse_listen
from gpunode.errors import MetricsServerError
from gpunode.infra.http import HttpServer, closing

__all__ = ["CONTENT_TYPE", "MetricsServer", "MetricsServerError", "MetricsSource", "serve_metrics"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_BODY_BYTES = 64 * 1024
IDLE_TIMEOUT_S = 300.0  # longer than any sensible scrape interval, so Prometheus can keep its connection
MAX_CONNECTIONS = 64  # scrapers are few; requests on more open connections than this get 503
_INDEX = (
    "<html><head><title>gpunode metrics</title></head><body><h1>gpunode</h1>"
    '<p><a href="/metrics">/metrics</a> (DCGM-compatible) and <a href="/health">/health</a></p></body></html>\n'
)


class MetricsSource(Protocol):
    """What the server needs from a collector."""

    def render(self) -> bytes:
        """The metrics in Prometheus text format."""
        ...

    def health_status(self) -> tuple[bool, str]:
        """Whether the agent is healthy, with a reason."""
        ...


class MetricsServer:
    """Serves a MetricsSource on one TCP address; start() binds (MetricsServerError if it cannot), stop() closes."""

    def __init__(self, source: MetricsSource, listen: str | ListenAddress) -> None:
        self._source = source
        self.address = listen if isinstance(listen, ListenAddress) else parse_listen(listen, "listen")
        self.requests = 0
        self._http = HttpServer(
            self._handle,
            name="metrics",
            host=self.address.host,
            port=self.address.port,
            max_body_bytes=MAX_BODY_BYTES,
            max_connections=MAX_CONNECTIONS,
            keepalive_timeout_s=IDLE_TIMEOUT_S,
            log=log,
            error=MetricsServerError,
        )

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return self._http.port

    async def start(self) -> None:
        """Bind and serve on the running event loop."""
        await self._http.start()

    async def stop(self) -> None:
        """Close the listening sockets and the connections."""
        await self._http.stop()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        length = request.content_length or 0
        if length > MAX_BODY_BYTES or "Transfer-Encoding" in request.headers:
            return closing(web.Response(status=400, text="request body not accepted\n"))
        self.requests += 1
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="only GET and HEAD\n", headers={"Allow": "GET, HEAD"})
        if request.path == "/metrics":
            return web.Response(body=self._source.render(), headers={"Content-Type": CONTENT_TYPE})
        if request.path == "/health":
            ok, detail = self._source.health_status()
            return web.Response(status=200 if ok else 503, text=f"{'OK' if ok else 'KO'}: {detail}\n")
        if request.path == "/":
            return web.Response(text=_INDEX, content_type="text/html")
        return web.Response(status=404, text="not found\n")


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
