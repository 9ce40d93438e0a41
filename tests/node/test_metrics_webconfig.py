"""The metrics endpoint with an exporter-toolkit web configuration: TLS, client certificates, basic auth,
excluded paths, headers, rate limit, and the one-line errors for files that cannot be used."""

from __future__ import annotations

import asyncio
import base64
import http.client
import logging
import os
import re
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import bcrypt
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from gpunode.config.webconfig import load_web_config
from gpunode.errors import TlsConfigError, WebConfigError
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.metrics import MetricsCollector, MetricsServer, serve_metrics
from tests.shared.tls_files import TlsFiles, issue_server_cert, make_tls_files

T = TypeVar("T")
PASSWORD = "s3cret pass"


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    return make_tls_files(tmp_path)


def web_config(directory: Path, doc: dict[str, Any]) -> Path:
    path = directory / "web-config.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def users() -> dict[str, str]:
    return {"prometheus": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()}


def with_server(config: Path, body: Callable[[MetricsServer], Awaitable[T]]) -> T:
    async def scenario() -> T:
        collector = MetricsCollector(backend=SimBackend.from_profile("t4"), hostname="node-1")
        await collector.collect_once()
        server = MetricsServer(collector, "127.0.0.1:0", web_config=load_web_config(config))
        await server.start()
        try:
            return await body(server)
        finally:
            await server.stop()

    return asyncio.run(scenario())


def fetch(
    port: int, path: str, *, ctx: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn: http.client.HTTPConnection
    if ctx is not None:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=ctx)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_tls_serves_metrics_to_a_client_that_trusts_the_ca(tls: TlsFiles) -> None:
    config = web_config(tls.ca.parent, {"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"}})

    async def body(server: MetricsServer) -> None:
        status, _, payload = await asyncio.to_thread(
            fetch, server.port, "/metrics", ctx=tls.client_context(with_cert=False)
        )
        assert status == 200 and b"DCGM_FI_DEV_GPU_TEMP" in payload
        with pytest.raises(http.client.RemoteDisconnected):  # plain HTTP gets nothing
            await asyncio.to_thread(fetch, server.port, "/metrics")

    with_server(config, body)


def test_a_required_client_certificate_fails_the_handshake_without_one(tls: TlsFiles) -> None:
    config = web_config(
        tls.ca.parent,
        {"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key",
                               "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "ca.crt"}},
    )  # fmt: skip

    async def body(server: MetricsServer) -> None:
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            await asyncio.to_thread(fetch, server.port, "/health", ctx=tls.client_context(with_cert=False))
        status, _, _ = await asyncio.to_thread(
            fetch, server.port, "/metrics", ctx=tls.client_context(with_cert=True)
        )
        assert status == 200

    with_server(config, body)


def test_basic_auth_guards_every_path_but_the_excluded_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = web_config(
        tmp_path,
        {"basic_auth_users": users(), "auth_excluded_paths": ["/health"],
         "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}}},
    )  # fmt: skip
    checks: list[bytes] = []
    real = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        checks.append(password)
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counting)

    async def body(server: MetricsServer) -> None:
        def get(path: str, auth: tuple[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
            return fetch(server.port, path, auth=auth)

        status, headers, _ = await asyncio.to_thread(get, "/metrics")
        assert status == 401 and headers["www-authenticate"] == "Basic"
        assert headers["x-content-type-options"] == "nosniff"
        assert (await asyncio.to_thread(get, "/metrics", ("prometheus", "wrong")))[0] == 401
        assert (await asyncio.to_thread(get, "/metrics", ("nobody", PASSWORD)))[0] == 401
        assert (await asyncio.to_thread(get, "/ready", ("prometheus", "wrong")))[0] == 401
        checks.clear()
        for _ in range(3):
            status, headers, payload = await asyncio.to_thread(get, "/metrics", ("prometheus", PASSWORD))
            assert status == 200 and b"DCGM_FI_DEV_GPU_TEMP" in payload
        assert len(checks) == 1  # bcrypt once; the success is remembered
        status, headers, _ = await asyncio.to_thread(get, "/health")  # excluded: a probe needs no password
        assert status == 200 and headers["x-content-type-options"] == "nosniff"

    with_server(config, body)


def test_client_certificates_with_excluded_probe_paths(tls: TlsFiles) -> None:
    config = web_config(
        tls.ca.parent,
        {"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key",
                               "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "ca.crt"},
         "auth_excluded_paths": ["/health", "/ready"]},
    )  # fmt: skip

    async def body(server: MetricsServer) -> None:
        anonymous = tls.client_context(with_cert=False)
        assert (await asyncio.to_thread(fetch, server.port, "/health", ctx=anonymous))[0] == 200
        assert (await asyncio.to_thread(fetch, server.port, "/ready", ctx=anonymous))[0] == 200
        assert (await asyncio.to_thread(fetch, server.port, "/metrics", ctx=anonymous))[0] == 401
        with_cert = tls.client_context(with_cert=True)
        assert (await asyncio.to_thread(fetch, server.port, "/metrics", ctx=with_cert))[0] == 200

    with_server(config, body)


def test_the_rate_limit_answers_429(tmp_path: Path) -> None:
    config = web_config(tmp_path, {"rate_limit": {"interval": "1h", "burst": 2}})

    async def body(server: MetricsServer) -> list[int]:
        return [(await asyncio.to_thread(fetch, server.port, "/health"))[0] for _ in range(3)]

    assert with_server(config, body) == [200, 200, 429]


UNUSABLE = {
    "unknown-key": ({"basic_auth_user": {}}, r"web-config\.yml: unknown key basic_auth_user \(did you mean basic_auth_users\?\)$"),
    "unknown-tls-key": ({"tls_server_config": {"cert_fil": "x"}}, r"unknown key cert_fil \(did you mean cert_file\?\)$"),
    "unverified-client-certs": ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key",
                                 "client_auth_type": "RequireAnyClientCert"}},
                                r"tls_server_config\.client_auth_type: RequireAnyClientCert accepts client certificates"),
    "ca-without-policy": ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key",
                           "client_ca_file": "ca.crt"}}, r"client_ca_file: set, but client_auth_type is NoClientCert$"),
    "missing-key-file": ({"tls_server_config": {"cert_file": "tls.crt"}}, r"tls_server_config\.key_file: required"),
    "curves": ({"tls_server_config": {"curve_preferences": ["X25519"]}}, r"curve_preferences: Python's ssl"),
    "inline-cert": ({"tls_server_config": {"cert": "-----BEGIN"}}, r"tls_server_config\.cert: PEM given inline"),
    "bad-hash": ({"basic_auth_users": {"p": "plaintext"}}, r"basic_auth_users\.p: expected a bcrypt hash"),
    "bad-header": ({"http_server_config": {"headers": {"X-Frame-Options": "allow"}}}, r"X-Frame-Options: expected one of deny, sameorigin"),
    "other-header": ({"http_server_config": {"headers": {"Server": "x"}}}, r"headers: unknown key Server$"),
    "unknown-cipher": ({"tls_server_config": {"cipher_suites": ["TLS_RSA_WITH_RC4_128_SHA"]}}, r"unknown cipher suite"),
    "versions": ({"tls_server_config": {"min_version": "TLS13", "max_version": "TLS12"}}, r"min_version: TLS13 is above"),
    "not-yaml": ("tls_server_config: [", r"web-config\.yml: not valid YAML at line"),
}  # fmt: skip


@pytest.mark.parametrize(("doc", "message"), UNUSABLE.values(), ids=UNUSABLE.keys())
def test_an_unusable_web_config_is_one_line_at_start(tls: TlsFiles, doc: Any, message: str) -> None:
    path = tls.ca.parent / "web-config.yml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    with pytest.raises(WebConfigError) as info:
        load_web_config(path)
    assert re.search(message, str(info.value)), str(info.value)
    assert "\n" not in str(info.value) and info.value.hint and info.value.exit_code == 2


@pytest.mark.parametrize(
    ("files", "error", "message"),
    [
        pytest.param(None, WebConfigError, r"^cannot read the web configuration file .*/absent\.yml: No such file", id="no-file"),
        pytest.param({"cert_file": "tls.crt", "key_file": "missing.key"}, TlsConfigError, r"cannot read the TLS key file .*/missing\.key", id="no-key"),
        pytest.param({"cert_file": "tls.crt", "key_file": "other.key"}, TlsConfigError, r"the key does not belong to the certificate$", id="wrong-key"),
    ],
)  # fmt: skip
def test_serve_metrics_stops_at_start_on_files_it_cannot_use(
    tls: TlsFiles, files: dict[str, str] | None, error: type[Exception], message: str
) -> None:
    path = tls.ca.parent / "absent.yml"
    if files is not None:
        path = web_config(tls.ca.parent, {"tls_server_config": files})

    async def scenario() -> None:
        collector = MetricsCollector(backend=SimBackend.from_profile("t4"), hostname="n")
        await serve_metrics(collector=collector, listen="127.0.0.1:0", web_config_file=str(path))

    with pytest.raises(error) as info:
        asyncio.run(scenario())
    assert re.search(message, str(info.value)), str(info.value)
    assert "\n" not in str(info.value)


def test_the_agent_refuses_an_unusable_web_config_before_it_starts(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "kubelet").mkdir()
    (tmp_path / "config.yaml").write_text("version: v1\n")
    (tmp_path / "web.yml").write_text("basic_auth_userz: {}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gpunode.cli", "agent", "--config", str(tmp_path / "config.yaml"), "--backend",
         "sim", "--kubelet-dir", str(tmp_path / "kubelet"), "--state-dir", str(tmp_path / "state"),
         "--node-name", "n1", "--web-config-file", str(tmp_path / "web.yml")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    first, hint = proc.stderr.strip().splitlines()
    assert (
        first
        == f"gpunode: {tmp_path / 'web.yml'}: unknown key basic_auth_userz (did you mean basic_auth_users?)"
    )
    assert hint.startswith("HINT: ")
    assert not list((tmp_path / "kubelet").iterdir())  # nothing was started


# ----- reloading: certificates renewed and users changed without a restart -------------------------------


def publish(volume: Path, files: dict[str, bytes]) -> None:
    """Replace every file of `volume` at once, as the kubelet updates a Secret volume: each file is a link
    through ..data to a directory of this version, and ..data is swapped to the new one."""
    versions = sorted(volume.glob("..v*"))
    version = volume / f"..v{len(versions)}"
    version.mkdir()
    for name, data in files.items():
        (version / name).write_bytes(data)
        link = volume / name
        if not link.is_symlink():
            link.symlink_to(Path("..data") / name)
    (volume / "..data-new").symlink_to(version.name)
    os.replace(volume / "..data-new", volume / "..data")


def served_cert(port: int, ctx: ssl.SSLContext) -> bytes:
    """The certificate (DER) a new TLS connection is given; the client checks it against the CA."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        cert = s.getpeercert(binary_form=True)
        assert cert is not None
        return cert


async def eventually(check: Callable[[], bool], within_s: float = 60.0) -> None:
    """Call `check` (in a thread: it talks to the server) until it holds; fail after within_s (generous)."""
    async with asyncio.timeout(within_s):
        while not await asyncio.to_thread(check):
            await asyncio.sleep(0.2)


def test_renewed_certificates_and_changed_users_apply_to_new_connections_without_a_restart(
    tls: TlsFiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    volume = tmp_path / "secret"
    volume.mkdir()
    cert_a, key_a = tls.cert.read_bytes(), tls.key.read_bytes()
    cert_b, key_b = issue_server_cert(tls)
    new_password = "renewed pass"

    def config(password: str) -> bytes:
        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
        doc = {"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"},
               "basic_auth_users": {"prometheus": hashed}}  # fmt: skip
        return yaml.safe_dump(doc).encode()

    publish(volume, {"web-config.yml": config(PASSWORD), "tls.crt": cert_a, "tls.key": key_a})
    der_a, der_b = (x509.load_pem_x509_certificate(c).public_bytes(Encoding.DER) for c in (cert_a, cert_b))
    caplog.set_level(logging.INFO, logger="gpunode.infra.webauth")

    def errors() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "gpunode.infra.webauth" and r.levelno >= logging.ERROR]

    async def body(server: MetricsServer) -> None:
        ctx = tls.client_context(with_cert=False)

        def status(password: str) -> int:
            return fetch(server.port, "/metrics", ctx=ctx, auth=("prometheus", password))[0]

        assert await asyncio.to_thread(served_cert, server.port, ctx) == der_a
        assert await asyncio.to_thread(status, PASSWORD) == 200
        # The certificate is renewed (same CA, new key): a new connection is given the new one.
        publish(volume, {"web-config.yml": config(PASSWORD), "tls.crt": cert_b, "tls.key": key_b})
        await eventually(lambda: served_cert(server.port, ctx) == der_b)
        assert await asyncio.to_thread(status, PASSWORD) == 200
        # A broken file: refused with one error line; the server goes on with what it had.
        publish(volume, {"web-config.yml": b"tls_server_config: [", "tls.crt": cert_b, "tls.key": key_b})
        await eventually(lambda: served_cert(server.port, ctx) == der_b and bool(errors()))
        for _ in range(4):  # more new connections over more than one check interval: no more lines
            assert await asyncio.to_thread(served_cert, server.port, ctx) == der_b
            await asyncio.sleep(0.5)
        assert await asyncio.to_thread(status, PASSWORD) == 200
        (line,) = errors()
        message = line.getMessage()
        assert "web-config.yml: not valid YAML" in message and "previous one stays" in message, message
        assert "\n" not in message and line.exc_info is None
        # The password is changed: the new one is accepted, the old one no longer.
        publish(volume, {"web-config.yml": config(new_password), "tls.crt": cert_b, "tls.key": key_b})
        await eventually(lambda: status(new_password) == 200)
        assert await asyncio.to_thread(status, PASSWORD) == 401
        assert await asyncio.to_thread(served_cert, server.port, ctx) == der_b
        assert len(errors()) == 1

    with_server(volume / "web-config.yml", body)


def test_a_renewal_caught_half_done_is_refused_until_it_is_complete(
    tls: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    config = web_config(tls.ca.parent, {"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"}})
    der_a = x509.load_pem_x509_certificate(tls.cert.read_bytes()).public_bytes(Encoding.DER)
    cert_b, key_b = issue_server_cert(tls)
    der_b = x509.load_pem_x509_certificate(cert_b).public_bytes(Encoding.DER)
    caplog.set_level(logging.INFO, logger="gpunode.infra.webauth")

    async def body(server: MetricsServer) -> None:
        ctx = tls.client_context(with_cert=False)
        aside = tls.cert.with_name("tls.crt.new")
        aside.write_bytes(cert_b)
        os.replace(aside, tls.cert)  # the new certificate, still with the old key

        def refused() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "does not belong to the certificate" in r.getMessage()]

        await eventually(lambda: served_cert(server.port, ctx) == der_a and bool(refused()))  # the old pair
        aside = tls.key.with_name("tls.key.new")
        aside.write_bytes(key_b)
        os.replace(aside, tls.key)  # now the pair is complete
        await eventually(lambda: served_cert(server.port, ctx) == der_b)
        assert len(refused()) == 1

    with_server(config, body)
