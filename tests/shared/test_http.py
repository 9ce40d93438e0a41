"""gpunode.infra.http over real sockets: backlog, keep-alive, logging, limits, bind errors, stopping, TLS,
and the attacks the limits are there for (half-sent heads, slowloris, slow and oversized bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import os
import re
import resource
import select
import shutil
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from aiohttp import web

from gpunode.errors import GpunodeError, ListenError, TlsConfigError
from gpunode.infra.http import BACKLOG, HttpServer, ServerThread, server_tls_context
from tests.shared.tls_files import TlsFiles, make_tls_files

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


def test_idle_connections_at_the_limit_make_room_for_a_new_request() -> None:
    async def body(server: HttpServer) -> tuple[list[int], int, bytes, bytes]:
        def scenario() -> tuple[list[int], int, bytes, bytes]:
            held = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=10) for _ in range(2)]
            statuses = []
            for conn in held:  # both answered and kept alive: idle
                conn.request("GET", "/")
                response = conn.getresponse()
                response.read()
                statuses.append(response.status)
            fresh = get(server.port)[0]  # a third connection: the oldest idle one makes room
            oldest, newer = held[0].sock.recv(1), None
            held[1].sock.settimeout(0.5)
            try:
                newer = held[1].sock.recv(1)
            except TimeoutError:
                newer = b"open"
            for conn in held:
                conn.close()
            return statuses, fresh, oldest, newer

        return await asyncio.to_thread(scenario)

    statuses, fresh, oldest, newer = with_server(body, max_connections=2)
    assert statuses == [200, 200] and fresh == 200
    assert oldest == b"" and newer == b"open"  # the oldest was closed, the other left alone


def held_at_wait(release: asyncio.Event) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler that answers "ok", holding a request for /wait until `release` is set (a busy
    connection)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/wait":
            await release.wait()
        return web.Response(text="ok")

    return handler


def test_when_every_connection_is_busy_a_new_one_gets_503() -> None:
    release = asyncio.Event()
    handler = held_at_wait(release)

    async def scenario() -> tuple[bytes, int, list[int]]:
        server = HttpServer(
            handler, name="test", host="127.0.0.1", max_body_bytes=0, max_connections=2, log=log
        )
        await server.start()

        def busy() -> int:
            return get(server.port, "/wait")[0]

        def refused() -> bytes:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                return read_all(s)

        try:
            waiting = [asyncio.create_task(asyncio.to_thread(busy)) for _ in range(2)]
            while server.connections < 2:
                await asyncio.sleep(0.01)
            answer = await asyncio.to_thread(refused)
            release.set()
            after = (await asyncio.to_thread(get, server.port))[0]
            return answer, after, [await w for w in waiting]
        finally:
            await server.stop()

    answer, after, busy_statuses = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(b"too many connections\n")
    assert busy_statuses == [200, 200] and after == 200


def test_a_flooder_whose_connections_are_all_busy_cannot_close_another_clients_connection() -> None:
    # At the limit of 2: the attacker (127.0.0.2) holds one connection busy with a slow request, a probe
    # (127.0.0.1) has connected and not yet sent its request (idle). The attacker's next connection must
    # not make room by closing the probe's, the only idle one: it is refused, and the probe is answered.
    release = asyncio.Event()
    handler = held_at_wait(release)

    async def scenario() -> tuple[bytes, int, int]:
        server = HttpServer(
            handler, name="test", host="127.0.0.1", max_body_bytes=0, max_connections=2, log=log
        )
        await server.start()

        def busy() -> int:
            conn = http.client.HTTPConnection(
                "127.0.0.1", server.port, timeout=10, source_address=("127.0.0.2", 0)
            )
            try:
                conn.request("GET", "/wait")
                return conn.getresponse().status
            finally:
                conn.close()

        def attack() -> bytes:
            with socket.create_connection(
                ("127.0.0.1", server.port), timeout=10, source_address=("127.0.0.2", 0)
            ) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                return read_all(s)

        probe = http.client.HTTPConnection(
            "127.0.0.1", server.port, timeout=10, source_address=("127.0.0.1", 0)
        )
        try:
            waiting = asyncio.create_task(asyncio.to_thread(busy))
            while server.connections < 1:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(probe.connect)
            while server.connections < 2:
                await asyncio.sleep(0.01)
            answer = await asyncio.to_thread(attack)

            def ask() -> int:
                probe.request("GET", "/")
                return probe.getresponse().status

            probed = await asyncio.to_thread(ask)
            release.set()
            return answer, probed, await waiting
        finally:
            release.set()
            probe.close()
            await server.stop()

    answer, probed, waited = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 503 ")  # the attacker's own connection is refused
    assert probed == 200  # the probe's connection was left open and is answered
    assert waited == 200


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


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


# -- attacks: each one performed over real sockets ----------------------------------------------------


def threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024


def wait_closed(socks: list[socket.socket], within_s: float) -> tuple[int, bytes]:
    """Wait until the server has closed every socket; (how many it closed, what it sent on any)."""
    import selectors

    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed, received = 0, b""
    deadline = time.monotonic() + within_s
    while closed < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1):
            try:
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except ConnectionResetError:
                data = b""
            if data:
                received += data
                continue
            sel.unregister(key.fileobj)
            closed += 1
    sel.close()
    return closed, received


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def test_thousands_of_half_sent_heads_are_closed_after_the_header_timeout_without_threads() -> None:
    # Both ends live in this process: two descriptors per connection, and some room for the rest.
    count = min(3000, (raise_fd_limit() - len(os.listdir("/proc/self/fd")) - 200) // 2)
    assert count >= 500, "the open-file limit is too low for this test"

    async def body(server: HttpServer) -> tuple[int, int, int, int, bytes, int]:
        def attack() -> tuple[int, int, int, int, bytes, int]:
            before = threads()
            socks = []
            for _ in range(count):
                s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finished
                socks.append(s)
            during = threads()
            fresh = get(server.port)[0]  # a real client is served meanwhile
            try:
                closed, received = wait_closed(socks, within_s=120)
            finally:
                for s in socks:
                    s.close()
            return before, during, threads(), closed, received, fresh

        return await asyncio.to_thread(attack)

    before, during, after, closed, received, fresh = with_server(
        body, header_timeout_s=2, keepalive_timeout_s=600, max_connections=count + 100
    )
    assert closed == count and received == b""  # every one closed by the server, none answered
    # no thread per connection: thousands of connections, at most a couple of threads that other parts
    # of this process (the event loop's executor) may start or end meanwhile
    assert during <= before + 2 and after <= before + 2
    assert fresh == 200


def test_half_sent_heads_beyond_the_limit_cannot_starve_a_new_request() -> None:
    raise_fd_limit()

    async def body(server: HttpServer) -> tuple[int, list[int], int]:
        def attack() -> tuple[int, list[int], int]:
            socks = []
            statuses = []
            for i in range(600):
                s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
                s.sendall(b"GET / HTTP/1.1\r\n")
                socks.append(s)
                if i % 200 == 199:
                    statuses.append(get(server.port)[0])  # a probe in the middle of the flood
            open_now = server.connections
            closed, _ = wait_closed(socks, within_s=60)
            for s in socks:
                s.close()
            return open_now, statuses, closed

        return await asyncio.to_thread(attack)

    open_now, statuses, closed = with_server(body, max_connections=64)  # header timeout: the default
    assert statuses == [200, 200, 200]
    assert open_now <= 64
    assert closed == 600


def test_a_flood_of_new_connections_from_one_address_churns_only_its_own() -> None:
    # The attacker (127.0.0.2) opens connections as fast as it can, each replacing one the server closed;
    # the probe (127.0.0.1, another client address, as a kubelet or Prometheus is) is always answered.
    raise_fd_limit()

    async def body(server: HttpServer) -> tuple[list[int], int]:
        stop = threading.Event()
        opened = 0

        def flood() -> None:
            nonlocal opened
            socks: list[socket.socket] = []
            while not stop.is_set():
                try:
                    s = socket.create_connection(
                        ("127.0.0.1", server.port), timeout=5, source_address=("127.0.0.2", 0)
                    )
                except OSError:
                    continue
                opened += 1
                socks.append(s)
                if len(socks) > 200:
                    socks.pop(0).close()
            for s in socks:
                s.close()

        def probes() -> list[int]:
            out = []
            for _ in range(40):
                time.sleep(0.05)
                try:
                    out.append(get(server.port)[0])
                except OSError:
                    out.append(0)
            return out

        attacker = threading.Thread(target=flood, daemon=True)
        attacker.start()
        try:
            statuses = await asyncio.to_thread(probes)
        finally:
            stop.set()
            await asyncio.to_thread(attacker.join, 30)
        return statuses, opened

    statuses, opened = with_server(body, max_connections=16)
    assert opened > 16 * 10  # the flood really churned the limit many times over
    assert statuses == [200] * 40


def trickle(port: int, prefix: bytes, head: bytes, pause_s: float) -> tuple[bytes, int]:
    """Send `prefix` at once, then `head` one byte every pause_s; (the answers read, head bytes sent)
    once the server has closed the connection (or the whole head was sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(prefix)
        answers = b""
        sent = 0
        for byte in head:
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                return answers, sent
            sent += 1
            readable, _, _ = select.select([s], [], [], pause_s)
            if readable:
                try:
                    data = s.recv(65536)
                except ConnectionResetError:
                    return answers, sent
                if not data:
                    return answers, sent
                answers += data
        return answers, sent


@pytest.mark.parametrize("after_a_request", [False, True], ids=["fresh-connection", "kept-alive"])
def test_a_slowloris_head_is_closed(after_a_request: bool) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 150 + b"\r\n\r\n"
    first = b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n" if after_a_request else b""

    async def body(server: HttpServer) -> tuple[bytes, int]:
        return await asyncio.to_thread(trickle, server.port, first, head, 0.2)

    answers, sent = with_server(body, header_timeout_s=1)
    assert sent < len(head)  # closed before the head could be finished (~40 s at this pace)
    assert answers == (b"" if not after_a_request else answers)
    if after_a_request:
        assert answers.startswith(b"HTTP/1.1 200 OK") and answers.count(b"HTTP/1.1") == 1


def test_a_body_slower_than_the_bound_gets_408_and_a_close() -> None:
    async def body(server: HttpServer) -> bytes:
        def slow() -> bytes:
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
                s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
                return read_all(s)

        return await asyncio.to_thread(slow)

    answer = with_server(body, max_body_bytes=1000, body_timeout_s=1)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"Connection: close" in answer


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50_mb_body_is_refused_with_413_without_being_buffered(chunked: bool) -> None:
    calls: list[str] = []
    total = 50 * 2**20

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(request.path)
        return web.Response(text="ok")

    async def scenario() -> tuple[bytes, bytes, int]:
        server = HttpServer(handler, name="test", host="127.0.0.1", max_body_bytes=2**20, log=log)
        await server.start()

        def attack() -> tuple[bytes, bytes, int]:
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
                framing = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}".encode()
                s.sendall(b"POST /big HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n")
                early = b""
                if not chunked:  # the answer comes before a byte of the body was sent
                    s.settimeout(10)
                    early = s.recv(65536)
                chunk = b"x" * 2**20
                try:
                    for _ in range(total // len(chunk)):
                        s.sendall(b"100000\r\n" + chunk + b"\r\n" if chunked else chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                rest = b""
                with contextlib.suppress(OSError):
                    rest = read_all(s)
                return early, rest, rss_bytes()

        try:
            start_rss = rss_bytes()
            early, rest, end_rss = await asyncio.to_thread(attack)
            return early, early + rest, end_rss - start_rss
        finally:
            await server.stop()

    early, answer, grown = asyncio.run(scenario())
    if not chunked:
        assert early.startswith(b"HTTP/1.1 413 ")
    assert answer.startswith(b"HTTP/1.1 413 ") or not answer  # chunked: the reply may be lost to a reset
    assert calls == []  # the handler never saw it
    assert grown < 40 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB"


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def reset_peak_rss() -> int:
    """Reset this process's peak resident memory (VmHWM) to what it holds now, and return that in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmHWM") * 1024


async def until(condition: Callable[[], bool], within_s: float = 60.0) -> None:
    """Wait until `condition` holds; fail after within_s (generous: this is no speed test)."""
    async with asyncio.timeout(within_s):
        while not condition():
            await asyncio.sleep(0.01)


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(), 30)
    except ConnectionResetError:
        return b""


def test_bodies_beyond_the_body_budget_get_503_before_a_byte_is_read() -> None:
    limit, clients = 2 * 2**20, 16
    budget = 2 * limit  # two bodies of the largest size at once
    length = limit - 1  # each just under the limit
    piece = b"x" * 2**16
    received: list[int] = []
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        received.append(len(await request.read()))
        await release.wait()  # every admitted body stays held until the test has measured
        return web.Response(text=f"{received[-1]}\n")

    async def scenario() -> tuple[list[tuple[bytes, int]], int, int, int, tuple[int, bytes]]:
        server = HttpServer(
            handler,
            name="test",
            host="127.0.0.1",
            max_body_bytes=limit,
            max_inflight_body_bytes=budget,
            log=log,
        )
        await server.start()
        go = asyncio.Event()
        refused: list[int] = []

        async def client(i: int) -> tuple[bytes, int]:
            """(the answer, body bytes sent before it came)"""
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                writer.write(b"POST /%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" % i)
                writer.write(b"Content-Length: %d\r\n\r\n" % length)
                await writer.drain()
                answer = asyncio.ensure_future(reader.read(65536))
                started = asyncio.ensure_future(go.wait())
                await asyncio.wait({answer, started}, return_when=asyncio.FIRST_COMPLETED)
                started.cancel()
                if answer.done():  # answered with no body sent
                    refused.append(i)
                    return answer.result() + await read_to_eof(reader), 0
                sent = 0
                while sent < length:  # slowly, so that the admitted bodies overlap
                    n = min(len(piece), length - sent)
                    writer.write(piece[:n])
                    await writer.drain()
                    sent += n
                    await asyncio.sleep(0.005)
                return await answer + await read_to_eof(reader), sent
            finally:
                writer.close()

        try:
            base = reset_peak_rss()
            tasks = [asyncio.create_task(client(i)) for i in range(clients)]
            await until(lambda: len(refused) == clients - 2)  # fails here if every body is admitted
            in_use = server.body_bytes_in_use
            go.set()
            await until(lambda: len(received) == 2)  # both admitted bodies are read and held
            grown = status_kib("VmHWM") * 1024 - base
            release.set()
            answers = [await t for t in tasks]
            await until(lambda: server.body_bytes_in_use == 0)
            after = await asyncio.to_thread(get, server.port, "/after", "POST", b"y" * limit)
            return answers, in_use, grown, server.body_bytes_in_use, after
        finally:
            release.set()
            await server.stop()

    answers, in_use, grown, left, after = asyncio.run(scenario())
    assert in_use == 2 * length  # taken before a byte of either body arrived
    turned_away = [a for a, sent in answers if a.startswith(b"HTTP/1.1 503 ")]
    assert len(turned_away) == clients - 2
    assert all(sent == 0 for a, sent in answers if a.startswith(b"HTTP/1.1 503 "))
    assert all(b"Retry-After: 1\r\n" in a and b"Connection: close" in a for a in turned_away)
    served = [(a, sent) for a, sent in answers if a.startswith(b"HTTP/1.1 200 ")]
    assert len(served) == 2 and all(sent == length and a.endswith(b"%d\n" % length) for a, sent in served)
    assert received == [length, length, limit]  # the handler saw only the admitted ones (and /after)
    assert grown < budget + 16 * 2**20, f"peak resident memory grew by {grown / 2**20:.1f} MiB"
    assert left == 0 and after == (200, b"%d\n" % limit)


def test_a_chunked_body_that_outgrows_the_budget_is_cut_off_and_a_lost_one_gives_its_share_back() -> None:
    limit, budget, chunk = 4096, 6144, b"c" * 1024
    release = asyncio.Event()
    seen: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen.append(request.path)
        if request.path == "/hold":
            await release.wait()
        return web.Response(text=f"{len(body)}\n")

    async def chunked(port: int, path: str, chunks: int) -> tuple[bytes, int]:
        """Send `chunks` chunks one by one (stopping once answered); (the answer, chunks sent)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            )
            answer = asyncio.ensure_future(read_to_eof(reader))
            sent = 0
            with contextlib.suppress(ConnectionError):
                while sent < chunks and not answer.done():
                    writer.write(b"400\r\n" + chunk + b"\r\n")
                    await writer.drain()
                    sent += 1
                    await asyncio.sleep(0.05)
                if not answer.done():
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
            return await answer, sent
        finally:
            writer.close()

    async def scenario() -> tuple[bytes, int, int, bytes, int, tuple[bytes, int]]:
        server = HttpServer(
            handler,
            name="test",
            host="127.0.0.1",
            max_body_bytes=limit,
            max_inflight_body_bytes=budget,
            log=log,
        )
        await server.start()
        try:
            hold = asyncio.create_task(asyncio.to_thread(get, server.port, "/hold", "POST", b"h" * limit))
            await until(lambda: seen == ["/hold"])  # 4096 of 6144 bytes held
            cut, sent = await chunked(
                server.port, "/chunked", 4
            )  # 4096 bytes: under the limit, not the budget
            in_use = server.body_bytes_in_use
            release.set()
            held = await hold
            await until(lambda: server.body_bytes_in_use == 0)
            # A client that leaves mid-body gives its share back.
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /gone HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n" + chunk)
            await writer.drain()
            await until(lambda: server.body_bytes_in_use == 4096)
            writer.close()
            await until(lambda: server.body_bytes_in_use == 0)
            return (
                cut,
                sent,
                in_use,
                held[1],
                server.body_bytes_in_use,
                await chunked(server.port, "/again", 4),
            )
        finally:
            release.set()
            await server.stop()

    cut, sent, in_use, held, left, again = asyncio.run(scenario())
    assert cut.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1\r\n" in cut and b"Connection: close" in cut
    assert sent >= 3  # cut off at the chunk that did not fit (the 3rd), then closed (read_to_eof ended)
    assert in_use == limit  # what /hold took; the cut-off request gave back what it had taken
    assert held == b"4096\n" and left == 0
    assert seen == ["/hold", "/again"]  # neither the cut-off body nor the lost one reached the handler
    assert again[0].startswith(b"HTTP/1.1 200 ") and again[0].endswith(b"\r\n\r\n4096\n")


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def body(server: HttpServer) -> tuple[bytes, bytes]:
        def send() -> tuple[bytes, bytes]:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
                interim = s.recv(65536)
                s.sendall(b"hello")
                s.shutdown(socket.SHUT_WR)
                return interim, read_all(s)

        return await asyncio.to_thread(send)

    interim, final = with_server(body, max_body_bytes=10)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert final.startswith(b"HTTP/1.1 200 OK") and final.endswith(b"POST /p 5\n")


# -- TLS ----------------------------------------------------------------------------------------------


def https_get(port: int, ctx: ssl.SSLContext, path: str = "/") -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=ctx)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    return make_tls_files(tmp_path)


def test_tls_serves_https_and_requires_a_client_certificate(tls: TlsFiles) -> None:
    async def scenario() -> None:
        plain = server_tls_context(str(tls.cert), str(tls.key))
        mutual = server_tls_context(str(tls.cert), str(tls.key), str(tls.ca))
        for ctx, needs_cert in ((plain, False), (mutual, True)):
            server = HttpServer(
                echo, name="test", host="127.0.0.1", max_body_bytes=0, ssl_context=ctx, log=log
            )
            await server.start()
            try:
                assert await asyncio.to_thread(
                    https_get, server.port, tls.client_context(with_cert=True)
                ) == (
                    200,
                    b"GET / 0\n",
                )
                if needs_cert:
                    with pytest.raises((ssl.SSLError, ConnectionResetError)):
                        await asyncio.to_thread(https_get, server.port, tls.client_context(with_cert=False))
                else:
                    assert (
                        await asyncio.to_thread(https_get, server.port, tls.client_context(with_cert=False))
                    )[0] == 200
                with pytest.raises(http.client.RemoteDisconnected):  # plain HTTP to a TLS port
                    await asyncio.to_thread(get, server.port)
            finally:
                await server.stop()

    asyncio.run(scenario())


def test_a_tls_handshake_that_never_comes_is_closed(tls: TlsFiles) -> None:
    async def scenario() -> tuple[int, bytes]:
        ctx = server_tls_context(str(tls.cert), str(tls.key))
        server = HttpServer(
            echo,
            name="test",
            host="127.0.0.1",
            max_body_bytes=0,
            ssl_context=ctx,
            header_timeout_s=1,
            log=log,
        )
        await server.start()
        try:
            socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(20)]
            for s in socks:
                s.sendall(b"\x16\x03\x01")  # the start of a ClientHello, and nothing more
            try:
                return await asyncio.to_thread(wait_closed, socks, 60)
            finally:
                for s in socks:
                    s.close()
        finally:
            await server.stop()

    closed, _ = asyncio.run(scenario())
    assert closed == 20


@pytest.mark.parametrize(
    ("case", "message"),
    [
        pytest.param("missing-cert", r"^cannot read the TLS certificate file .*/nope\.crt: No such file or directory$", id="missing-cert"),
        pytest.param("mismatched-key", r"^cannot use the TLS certificate .*tls\.crt with the key .*other\.key: the key does not belong to the certificate$", id="mismatched-key"),
        pytest.param("not-pem", r"^cannot use the TLS certificate .*ca\.crt with the key .*ca\.crt: not a PEM certificate chain and private key", id="not-pem"),
        pytest.param("bad-ca", r"^the client CA file .*tls\.key holds no usable PEM certificate", id="bad-ca"),
    ],
)  # fmt: skip
def test_unusable_tls_files_are_one_line_errors(tls: TlsFiles, case: str, message: str) -> None:
    args = {
        "missing-cert": (str(tls.cert.parent / "nope.crt"), str(tls.key), None),
        "mismatched-key": (str(tls.cert), str(tls.other_key), None),
        "not-pem": (str(tls.ca), str(tls.ca), None),
        "bad-ca": (str(tls.cert), str(tls.key), str(tls.key)),
    }[case]
    with pytest.raises(TlsConfigError) as info:
        server_tls_context(*args)
    assert re.match(message, str(info.value)), str(info.value)
    assert "\n" not in str(info.value) and info.value.hint
