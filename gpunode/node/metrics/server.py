"""The metrics endpoint: /metrics, /health, /ready, /agent and an index page over HTTP/1.1 (gpunode.infra.http).

/health (the liveness probe) answers 200 while the background collector keeps
succeeding, 503 once its last success is older than its staleness bound (the
agent is stuck: a restart may help); /ready (readiness and startup) answers 200
once a first collection has succeeded, so a fresh agent is not scraped before
it has anything to say. Both are cheap: neither renders the metrics. /agent says,
as JSON, which GPU backend the agent reads (`{"backend": "sim:dgx-h100"}`), so
`gpunode doctor` run beside it checks the same GPUs.

The endpoint cannot be starved by idle clients: at most MAX_CONNECTIONS are
open, and a new connection at that limit closes the oldest idle one (a request
head must arrive within HEADER_TIMEOUT_S; an idle keep-alive connection lasts
IDLE_TIMEOUT_S, more than any usual scrape interval, so Prometheus keeps its
connection between scrapes). It answers GET and HEAD, refuses other methods
with 405 and any request body with 413. A scrape costs one call to
MetricsCollector.render(), which returns bytes prepared by the background
collector: nothing here reads the backend or waits for a collection.

With a web configuration file (--web-config-file, gpunode.config.webconfig) the
endpoint serves HTTPS and/or requires credentials, as exporters built on
prometheus/exporter-toolkit do (gpunode.infra.webauth); a changed file
(renewed certificates, other users) applies to new connections without a
restart.

This module must not collect anything and must not block the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Protocol

from aiohttp import web

from gpunode.config.metrics import ListenAddress, parse_listen
from gpunode.config.webconfig import WebConfig, load_web_config
from gpunode.errors import MetricsServerError
from gpunode.infra.http import HttpServer
from gpunode.infra.webauth import WebGuard

__all__ = ["CONTENT_TYPE", "MetricsServer", "MetricsServerError", "MetricsSource", "serve_metrics"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_BODY_BYTES = 0  # nothing here takes a body
IDLE_TIMEOUT_S = 90.0  # over the longest usual scrape interval (60s): Prometheus keeps its connection
HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64  # scrapers and probes are few; at the limit the oldest idle connection makes room
_INDEX = (
    "<html><head><title>gpunode metrics</title></head><body><h1>gpunode</h1>"
    '<p><a href="/metrics">/metrics</a> (DCGM-compatible) and <a href="/health">/health</a>, <a href="/ready">/ready</a>, <a href="/agent">/agent</a></p></body></html>\n'
)


class MetricsSource(Protocol):
    """What the server needs from a collector."""

    def render(self) -> bytes:
        """The metrics in Prometheus text format."""
        ...

    def health_status(self) -> tuple[bool, str]:
        """Whether the agent is healthy, with a reason."""
        ...

    @property
    def snapshot(self) -> object | None:
        """The last successful collection; None before the first one."""
        ...


class MetricsServer:
    """Serves a MetricsSource on one TCP address; start() binds (MetricsServerError if it cannot), stop() closes.

    `web_config`: TLS and authentication (a parsed web configuration file); None serves plain HTTP to all.
    """

    def __init__(
        self, source: MetricsSource, listen: str | ListenAddress, *, web_config: WebConfig | None = None
    ) -> None:
        self._source = source
        self.address = listen if isinstance(listen, ListenAddress) else parse_listen(listen, "listen")
        self.requests = 0
        guard = WebGuard(web_config) if web_config is not None else None
        self._http = HttpServer(
            guard.wrap(self._handle) if guard is not None else self._handle,
            name="metrics",
            host=self.address.host,
            port=self.address.port,
            max_body_bytes=MAX_BODY_BYTES,
            max_connections=MAX_CONNECTIONS,
            keepalive_timeout_s=IDLE_TIMEOUT_S,
            header_timeout_s=HEADER_TIMEOUT_S,
            ssl_context=guard.ssl_context if guard is not None else None,
            log=log,
            error=MetricsServerError,
        )

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return self._http.port

    @property
    def connections(self) -> int:
        """How many client connections are open now."""
        return self._http.connections

    async def start(self) -> None:
        """Bind and serve on the running event loop."""
        await self._http.start()

    async def stop(self) -> None:
        """Close the listening sockets and the connections."""
        await self._http.stop()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="only GET and HEAD\n", headers={"Allow": "GET, HEAD"})
        if request.path == "/metrics":
            return web.Response(body=self._source.render(), headers={"Content-Type": CONTENT_TYPE})
        if request.path == "/health":
            ok, detail = self._source.health_status()
            return web.Response(status=200 if ok else 503, text=f"{'OK' if ok else 'KO'}: {detail}\n")
        if request.path == "/ready":
            ready = self._source.snapshot is not None
            return web.Response(
                status=200 if ready else 503,
                text="OK: collecting\n" if ready else "KO: no successful collection yet\n",
            )
        if request.path == "/agent":
            backend = getattr(self._source, "backend_name", None)
            return web.Response(text=json.dumps({"backend": backend}) + "\n", content_type="application/json")
        if request.path == "/":
            return web.Response(text=_INDEX, content_type="text/html")
        return web.Response(status=404, text="not found\n")


async def serve_metrics(
    *,
    collector: MetricsSource,
    listen: str,
    ready: asyncio.Event | None = None,
    web_config_file: str | None = None,
) -> None:
    """Serve /metrics, /health and /ready on `listen` until cancelled (cancelling the task stops it).

    `web_config_file`: an exporter-toolkit web configuration (TLS, basic auth); WebConfigError or
    TlsConfigError, one line, when it cannot be used.
    """
    web_config = load_web_config(web_config_file) if web_config_file else None
    server = MetricsServer(collector, parse_listen(listen, "gpunode.metrics.listen"), web_config=web_config)
    await server.start()
    if ready is not None:
        ready.set()
    try:
        await asyncio.get_running_loop().create_future()  # until cancelled
    finally:
        await server.stop()
