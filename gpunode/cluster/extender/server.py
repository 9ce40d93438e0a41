"""The extender's HTTP server.

ExtenderServer routes POST <prefix>/filter, /prioritize, /bind and GET /healthz
to an Extender. Malformed JSON and wrong shapes get 400 with {"Error": "..."};
an oversized body 413; an unknown path 404; a wrong method 405. Only a defect in
our code gives 500, and the server keeps serving. serve_extender() runs one
until cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson

from gpunode.cluster.extender.core import BadRequest, Extender
from gpunode.errors import ConfigError
from gpunode.placement import PlacementError

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 256 * 2**20
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ASSIGNMENT_ANNOTATION = "gpunode.io/gpu-assigned"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; without TCP_NODELAY the second one waits for the
    # client's delayed ACK (~40 ms on Linux) on every keep-alive request.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, payload: object) -> None:
        body = orjson.dumps(payload)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _verb(self) -> str | None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        prefix = self.server.path_prefix
        if prefix and not path.startswith(prefix + "/"):
            return None
        return path[len(prefix) :].lstrip("/")

    def do_GET(self) -> None:
        verb = self._verb()
        if verb in ("healthz", "readyz"):
            self._send(200, {"status": "ok", "nodes": len(self.server.extender.nodes)})
        elif verb in ("filter", "prioritize", "bind"):
            self._send(405, {"Error": f"{verb} takes POST"})
        else:
            self._send(404, {"Error": f"no such path {self.path}"})

    def do_POST(self) -> None:
        verb = self._verb()
        handlers = {
            "filter": self.server.extender.filter,
            "prioritize": self.server.extender.prioritize,
            "bind": self.server.extender.bind,
        }
        if verb not in handlers:
            self._drain()
            self._send(404, {"Error": f"no such verb {self.path}; use filter, prioritize or bind"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            self._send(
                411 if "Content-Length" not in self.headers else 400, {"Error": "need a valid Content-Length"}
            )
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(413, {"Error": f"body of {length} bytes is over the {MAX_BODY_BYTES} accepted"})
            return
        raw = self.rfile.read(length)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:  # also bad UTF-8 and nesting over 1,024 levels
            self._send(400, {"Error": f"malformed JSON: {exc}"})
            return
        try:
            result = handlers[verb](body)
        except (BadRequest, PlacementError) as exc:
            self._send(400, {"Error": exc.message})
            return
        except Exception as exc:  # a defect of ours: answer, log, keep serving
            log.exception("extender %s failed", verb)
            self._send(500, {"Error": f"internal error in {verb}: {type(exc).__name__}: {exc}"})
            return
        self._send(200, result)

    def _drain(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = 0
        if 0 < length <= MAX_BODY_BYTES:
            self.rfile.read(length)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], extender: Extender, path_prefix: str) -> None:
        super().__init__(address, _Handler)
        self.extender = extender
        self.path_prefix = path_prefix.rstrip("/")


class ExtenderServer:
    """The extender's HTTP server on a thread: start(), .port, stop()."""

    def __init__(
        self, extender: Extender, *, host: str = "127.0.0.1", port: int = 0, path_prefix: str = ""
    ) -> None:
        try:
            self._server = _Server((host, port), extender, path_prefix)
        except OSError as exc:
            raise ConfigError(f"--listen {host}:{port}: cannot listen: {exc}") from exc
        self._thread = threading.Thread(
            target=lambda: self._server.serve_forever(poll_interval=0.05), name="extender-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


async def serve_extender(
    *,
    extender: Extender,
    host: str,
    port: int,
    path_prefix: str = "",
    ready: asyncio.Event | None = None,
    bound: list[int] | None = None,
) -> None:
    """Serve the extender over HTTP until cancelled; `bound` receives the port actually bound."""
    server = ExtenderServer(extender, host=host, port=port, path_prefix=path_prefix)
    server.start()
    if bound is not None:
        bound.append(server.port)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.to_thread(server.stop)
