"""The HTTP endpoint over real loopback sockets: /metrics, /health, keep-alive, bad requests."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.metrics import MetricsCollector, MetricsServer, MetricsServerError, serve_metrics
from tests.node.test_metrics_render import parse_exposition
from tests.ports import free_port
from tests.shared.test_http import accept_queue

server_log = "gpunode.node.metrics.server"

T = TypeVar("T")


def with_server(collect: bool, body: Callable[[MetricsServer, MetricsCollector], Awaitable[T]]) -> T:
    """Run `body` against a started server on 127.0.0.1 with an ephemeral port."""

    async def scenario() -> T:
        collector = MetricsCollector(backend=SimBackend.from_profile("t4"), hostname="node-1")
        if collect:
            await collector.collect_once()
        server = MetricsServer(collector, "127.0.0.1:0")
        await server.start()
        try:
            return await body(server, collector)
        finally:
            await server.stop()

    return asyncio.run(scenario())


def request(
    port: int, method: str, path: str, conn: http.client.HTTPConnection | None = None
) -> tuple[int, dict[str, str], bytes]:
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request(method, path)
    r = c.getresponse()
    body = r.read()
    headers = {k.lower(): v for k, v in r.getheaders()}
    if conn is None:
        c.close()
    return r.status, headers, body


def test_metrics_is_served_in_the_text_format() -> None:
    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        status, headers, payload = await asyncio.to_thread(request, server.port, "GET", "/metrics")
        assert status == 200
        assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert int(headers["content-length"]) == len(payload)
        out = parse_exposition(payload.decode())
        assert len(out.named("DCGM_FI_DEV_GPU_TEMP")) == 4

    with_server(True, body)


def test_head_gives_headers_only() -> None:
    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        status, headers, payload = await asyncio.to_thread(request, server.port, "HEAD", "/metrics")
        assert status == 200 and payload == b"" and int(headers["content-length"]) > 1000

    with_server(True, body)


def test_one_connection_serves_many_scrapes() -> None:
    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        def three_on_one_connection() -> list[int]:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            statuses = [request(server.port, "GET", p, conn)[0] for p in ("/metrics", "/health", "/metrics")]
            conn.close()
            return statuses

        assert await asyncio.to_thread(three_on_one_connection) == [200, 200, 200]
        assert server.requests == 3

    with_server(True, body)


@pytest.mark.parametrize(
    ("collect", "status", "starts"),
    [
        pytest.param(True, 200, b"OK: last successful collection", id="healthy-after-a-collection"),
        pytest.param(False, 503, b"KO: no successful collection yet", id="unhealthy-before-any"),
    ],
)
def test_health(collect: bool, status: int, starts: bytes) -> None:
    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        got, _, payload = await asyncio.to_thread(request, server.port, "GET", "/health")
        assert got == status and payload.startswith(starts)
        ready, _, _ = await asyncio.to_thread(request, server.port, "GET", "/ready")
        assert ready == status  # ready once a collection succeeded

    with_server(collect, body)


def test_agent_says_which_backend_it_reads() -> None:
    """/agent, for `gpunode doctor` run beside the agent: the backend, before any collection too."""

    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        got, headers, payload = await asyncio.to_thread(request, server.port, "GET", "/agent")
        assert got == 200 and headers["content-type"].startswith("application/json")
        assert json.loads(payload) == {"backend": "sim:t4"}

    with_server(False, body)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        pytest.param("GET", "/nope", 404, id="unknown-path"),
        pytest.param("POST", "/metrics", 405, id="post-refused"),
        pytest.param("DELETE", "/health", 405, id="delete-refused"),
        pytest.param("GET", "/metrics?collect[]=x", 200, id="query-string-ignored"),
        pytest.param("GET", "/", 200, id="index"),
    ],
)
def test_routes(method: str, path: str, status: int) -> None:
    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        got, headers, _ = await asyncio.to_thread(request, server.port, method, path)
        assert got == status
        if status == 405:
            assert headers["allow"] == "GET, HEAD"

    with_server(True, body)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"HELLO\r\n\r\n", id="not-http"),
        pytest.param(b"GET /metrics HTTP/2.0\r\n\r\n", id="wrong-version"),
        pytest.param(b"GET /metrics HTTP/1.1\r\nno-colon-here\r\n\r\n", id="bad-header"),
        pytest.param(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", id="huge-header"),
        pytest.param(b"POST /metrics HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n", id="huge-body"),
    ],
)
def test_bad_requests_get_400_and_a_closed_connection(raw: bytes) -> None:
    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        def send() -> bytes:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(raw)
                chunks = []
                while chunk := s.recv(65536):
                    chunks.append(chunk)
                return b"".join(chunks)

        reply = await asyncio.to_thread(send)  # returns only once the server has closed the connection
        # The status line carries the request's HTTP version; aiohttp answers a request it cannot parse
        # as HTTP/1.0 (where closing needs no Connection header).
        assert re.match(rb"HTTP/[12]\.[01] 400 Bad Request\r\n", reply)
        # The server is still serving others.
        assert (await asyncio.to_thread(request, server.port, "GET", "/health"))[0] == 200

    with_server(True, body)


def test_http_1_0_closes_after_the_answer() -> None:
    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        def send() -> bytes:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                chunks = []
                while chunk := s.recv(65536):  # returns b"" only because the server closes
                    chunks.append(chunk)
                return b"".join(chunks)

        reply = await asyncio.to_thread(send)
        assert reply.startswith(b"HTTP/1.0 200 OK\r\n") and reply.endswith(b"\n")  # answered in its version

    with_server(True, body)


def test_an_address_in_use_is_a_clear_error() -> None:
    async def scenario() -> None:
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        collector = MetricsCollector(backend=SimBackend.from_profile("t4"), hostname="n")
        try:
            with pytest.raises(MetricsServerError) as info:
                await MetricsServer(collector, f"127.0.0.1:{port}").start()
            assert f"127.0.0.1:{port}" in str(info.value)
            assert "listen" in info.value.hint
            assert str(info.value) == f"cannot listen for metrics on 127.0.0.1:{port}: Address already in use"
        finally:
            holder.close()

    asyncio.run(scenario())


def test_serve_metrics_runs_until_cancelled() -> None:
    async def scenario() -> None:
        port = free_port()
        collector = MetricsCollector(backend=SimBackend.from_profile("t4"), hostname="n")
        await collector.collect_once()
        ready = asyncio.Event()
        task = asyncio.create_task(
            serve_metrics(collector=collector, listen=f"127.0.0.1:{port}", ready=ready)
        )
        await asyncio.wait_for(ready.wait(), 10)
        assert (await asyncio.to_thread(request, port, "GET", "/metrics"))[0] == 200
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(request, port, "GET", "/metrics")

    asyncio.run(scenario())


def test_idle_connections_at_the_limit_make_room_for_a_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpunode.node.metrics.server as server_module

    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 2)

    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        def scenario() -> tuple[list[int], int, bytes]:
            held = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=10) for _ in range(2)]
            statuses = [request(server.port, "GET", "/health", c)[0] for c in held]  # both stay open, idle
            probe = request(server.port, "GET", "/health")[0]
            oldest = held[0].sock.recv(1)  # b"": closed to make room
            for c in held:
                c.close()
            return statuses, probe, oldest

        statuses, probe, oldest = await asyncio.to_thread(scenario)
        assert statuses == [200, 200] and probe == 200 and oldest == b""

    with_server(True, body)


@pytest.mark.parametrize("idle", [64, 1000])
def test_idle_connections_cannot_make_health_or_metrics_fail(idle: int) -> None:
    """The attack of an agent restart: fill the endpoint with idle connections, then probe it."""

    async def body(server: MetricsServer, collector: MetricsCollector) -> None:
        def scenario() -> list[int]:
            socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(idle)]
            for s in socks[: idle // 2]:
                s.sendall(b"GET /metrics HTTP/1.1\r\n")  # half of them half-sent heads
            try:
                return [request(server.port, "GET", p)[0] for p in ("/health", "/metrics", "/ready") * 3]
            finally:
                for s in socks:
                    s.close()

        assert await asyncio.to_thread(scenario) == [200] * 9
        assert server.connections <= server_module.MAX_CONNECTIONS

    import gpunode.node.metrics.server as server_module

    with_server(True, body)


def test_start_line_at_info_requests_at_debug_and_a_deep_backlog(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=server_log)

    async def body(server: MetricsServer, collector: MetricsCollector) -> tuple[int, int]:
        assert (await asyncio.to_thread(request, server.port, "GET", "/health"))[0] == 200
        return server.port, accept_queue(server.port)[1]

    port, backlog = with_server(True, body)
    assert backlog >= 128
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == server_log]
    assert (logging.INFO, f"metrics: serving HTTP on 127.0.0.1:{port}") in lines
    (access,) = [(level, m) for level, m in lines if '"GET /health" 200' in m]
    assert access[0] == logging.DEBUG
