"""gpunode.infra.http over real sockets: backlog, keep-alive, logging, limits, bind errors, stopping."""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from aiohttp import web

from gpunode.errors import GpunodeError, ListenError
from gpunode.infra.http import BACKLOG, HttpServer, ServerThread

T = TypeVar("T")
log = logging.getLogger("tests.http")


def accept_queue(port: int) -> tuple[int, int]:
    """(connections waiting to be accepted, the most that may wait) for this process's socket listening
    on 127.0.0.1:port, from Linux's TCP_INFO (tcpi_unacked and tcpi_sacked of a listening socket)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with sock:
            if (
                sock.family == socket.AF_INET
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                and sock.getsockname() == ("127.0.0.1", port)
            ):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
                queued, most = struct.unpack_from("8B6I", info)[12:14]
                return queued, most
    raise AssertionError(f"no socket of this process listens on 127.0.0.1:{port}")


async def echo(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    return web.Response(text=f"{request.method} {request.path} {len(body)}\n")


def with_server(body: Callable[[HttpServer], Awaitable[T]], **options: object) -> T:
    """Run `body` against a started HttpServer (the echo handler, 127.0.0.1, an ephemeral port)."""

    async def scenario() -> T:
        server = HttpServer(echo, name="test", host="127.0.0.1", port=0, log=log, **options)  # type: ignore[arg-type]
        await server.start()
        try:
            return await body(server)
        finally:
            await server.stop()

    options.setdefault("max_body_bytes", 1024)
    return asyncio.run(scenario())


def get(port: int, path: str = "/", method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_the_backlog_is_at_least_128() -> None:
    async def body(server: HttpServer) -> int:
        return accept_queue(server.port)[1]

    with open("/proc/sys/net/core/somaxconn") as f:
        somaxconn = int(f.read())
    assert BACKLOG >= 128
    assert with_server(body) == min(BACKLOG, somaxconn) >= 128


def test_start_names_the_real_port_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=log.name)

    async def body(server: HttpServer) -> int:
        return server.port

    port = with_server(body)
    assert port != 0
    (line,) = [r for r in caplog.records if r.name == log.name]
    assert line.levelno == logging.INFO and line.getMessage() == f"test: serving HTTP on 127.0.0.1:{port}"


def test_requests_are_logged_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    async def body(server: HttpServer) -> tuple[int, bytes]:
        return await asyncio.to_thread(get, server.port, "/some/where?x=1")

    caplog.set_level(logging.INFO, logger=log.name)
    assert with_server(body) == (200, b"GET /some/where 0\n")
    assert not [r for r in caplog.records if "/some/where" in r.getMessage()]  # nothing at info

    caplog.clear()
    caplog.set_level(logging.DEBUG, logger=log.name)
    with_server(body)
    (line,) = [r for r in caplog.records if "/some/where" in r.getMessage()]
    assert line.levelno == logging.DEBUG
    assert '127.0.0.1 "GET /some/where?x=1" 200' in line.getMessage()


def test_one_connection_carries_many_requests() -> None:
    peers: list[object] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(text="ok")

    async def scenario() -> list[int]:
        server = HttpServer(handler, name="test", host="127.0.0.1", max_body_bytes=0, log=log)
        await server.start()

        def three() -> list[int]:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            statuses = []
            for _ in range(3):
                conn.request("GET", "/")
                response = conn.getresponse()
                response.read()
                statuses.append(response.status)
            conn.close()
            return statuses

        try:
            return await asyncio.to_thread(three)
        finally:
            await server.stop()

    assert asyncio.run(scenario()) == [200, 200, 200]
    assert len(peers) == 3 and len(set(peers)) == 1  # one client address: one connection


def test_a_body_over_the_limit_is_refused_with_413() -> None:
    async def body(server: HttpServer) -> list[tuple[int, bytes]]:
        return [
            await asyncio.to_thread(get, server.port, "/", "POST", b"x" * 1024),
            await asyncio.to_thread(get, server.port, "/", "POST", b"x" * 1025),
        ]

    small, large = with_server(body, max_body_bytes=1024)
    assert small == (200, b"POST / 1024\n")
    assert large[0] == 413


def test_connections_beyond_the_limit_get_503() -> None:
    async def body(server: HttpServer) -> tuple[list[int], int]:
        def scenario() -> tuple[list[int], int]:
            held = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=10) for _ in range(2)]
            statuses = []
            for conn in held:
                conn.request("GET", "/")
                response = conn.getresponse()
                response.read()
                statuses.append(response.status)
            refused = get(server.port)[0]
            for conn in held:
                conn.close()
            return statuses, refused

        return await asyncio.to_thread(scenario)

    assert with_server(body, max_connections=2) == ([200, 200], 503)


@pytest.mark.parametrize(
    ("raw", "first_line"),
    [
        pytest.param(b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", b"HTTP/2.0 400 Bad Request", id="http-2-line"),
        pytest.param(b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.0 400 Bad Request", id="no-host"),
        pytest.param(b"NOT HTTP AT ALL\r\n\r\n", b"HTTP/1.0 400 Bad Request", id="garbage"),
    ],
)
def test_bad_requests_get_400_a_close_and_a_debug_line(
    raw: bytes, first_line: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)

    async def body(server: HttpServer) -> bytes:
        def send() -> bytes:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(raw)
                chunks = []
                while chunk := s.recv(65536):  # ends only when the server closes
                    chunks.append(chunk)
                return b"".join(chunks)

        reply = await asyncio.to_thread(send)
        assert (await asyncio.to_thread(get, server.port))[0] == 200  # still serving
        return reply

    assert with_server(body).split(b"\r\n", 1)[0] == first_line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.mark.parametrize("error", [ListenError, GpunodeError])
def test_an_address_in_use_is_one_line_naming_it(error: type[GpunodeError]) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]

    async def scenario() -> None:
        server = HttpServer(echo, name="test", host="127.0.0.1", port=port, max_body_bytes=0, error=error)
        await server.start()

    try:
        with pytest.raises(error) as info:
            asyncio.run(scenario())
    finally:
        holder.close()
    assert type(info.value) is error
    assert str(info.value) == f"cannot listen for test on 127.0.0.1:{port}: Address already in use"
    assert info.value.hint


def test_a_host_that_does_not_resolve_is_a_listen_error() -> None:
    async def scenario() -> None:
        await HttpServer(
            echo, name="test", host="no-such-host.invalid", max_body_bytes=0, hint="fix it"
        ).start()

    with pytest.raises(ListenError) as info:
        asyncio.run(scenario())
    assert str(info.value).startswith("cannot listen for test on no-such-host.invalid:0: ")
    assert "\n" not in str(info.value) and info.value.hint == "fix it"


def test_stop_closes_the_connections_and_the_port() -> None:
    async def scenario() -> None:
        server = HttpServer(echo, name="test", host="127.0.0.1", max_body_bytes=0, log=log)
        await server.start()
        port = server.port
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        await asyncio.to_thread(conn.request, "GET", "/")
        assert (await asyncio.to_thread(conn.getresponse)).status == 200
        await server.stop()
        await server.stop()  # harmless
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(get, port)
        assert await asyncio.to_thread(conn.sock.recv, 1) == b""  # the kept-alive connection was closed
        conn.close()

    asyncio.run(scenario())


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="http-", dir="/tmp"))  # Unix socket paths stay under 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_server_thread_serves_a_unix_socket(short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=log.name)
    path = str(short_dir / "s.sock")
    thread = ServerThread(HttpServer(echo, name="test", unix_path=path, max_body_bytes=10, log=log))
    thread.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            response = http.client.HTTPResponse(s)
            response.begin()
            assert (response.status, response.read()) == (200, b"POST /p 2\n")
        assert thread.server.loop is thread.loop
    finally:
        thread.stop()
    thread.stop()  # harmless
    assert any(r.getMessage() == f"test: serving HTTP on unix:{path}" for r in caplog.records)


def test_a_server_thread_that_cannot_bind_raises_and_ends(short_dir: Path) -> None:
    thread = ServerThread(
        HttpServer(echo, name="test", unix_path=str(short_dir / "missing" / "s.sock"), max_body_bytes=0)
    )
    with pytest.raises(ListenError, match=r"cannot listen for test on .*missing/s\.sock: No such file"):
        thread.start()
    assert thread.loop.is_closed()
    thread.stop()  # harmless
