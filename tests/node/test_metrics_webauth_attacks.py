"""Attacks on the metrics endpoint's web configuration and basic auth, each performed and its outcome asserted.

- a flood of keep-alive connections sending a wrong password must not starve
  the probe (/health, excluded from auth) or an authenticated scrape;
- an unknown user must cost the same bcrypt work as a known user with a wrong
  password (the answer's timing must not tell which users exist);
- a reload that would drop authentication or TLS (an empty file, `{}`, a file
  without basic_auth_users, one caught half written) is refused, the running
  configuration kept;
- a FIFO put in place of the web configuration or of the TLS certificate must
  not block the server: metrics still answer, the reload is refused with one line.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import logging
import os
import ssl
import threading
from collections import Counter
from pathlib import Path

import bcrypt
import pytest
import yaml

from gpunode.infra import webauth
from gpunode.node.metrics import MetricsServer
from tests.node.test_metrics_webconfig import PASSWORD, eventually, fetch, web_config, with_server
from tests.shared.tls_files import TlsFiles, make_tls_files

FLOOD_CONNECTIONS = 66  # over the endpoint's 64 connection slots
FLOOD_ROUNDS = 15  # wrong-password requests per flooding connection
PROBES = 30


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    return make_tls_files(tmp_path)


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def _flood(port: int, statuses: Counter[int], go: threading.Event) -> None:
    """One keep-alive connection sending FLOOD_ROUNDS wrong passwords (reconnecting when closed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    go.wait()
    for _ in range(FLOOD_ROUNDS):
        try:
            conn.request("GET", "/metrics", headers=_basic("prometheus", "wrong"))
            r = conn.getresponse()
            r.read()
            statuses[r.status] += 1
            if r.will_close:
                conn.close()
        except (OSError, http.client.HTTPException):
            statuses[0] += 1
            conn.close()
    conn.close()


def _one(port: int, path: str, headers: dict[str, str], source: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        r.read()
        return r.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


@pytest.mark.timeout(300)
def test_a_wrong_password_flood_starves_neither_the_probe_nor_a_scrape(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()  # a real cost: ~50 ms a check
    config = web_config(
        tmp_path, {"basic_auth_users": {"prometheus": hashed}, "auth_excluded_paths": ["/health"]}
    )

    async def body(server: MetricsServer) -> tuple[Counter[int], list[int], list[int]]:
        flood: Counter[int] = Counter()
        go = threading.Event()
        attackers = [
            threading.Thread(target=_flood, args=(server.port, flood, go), daemon=True)
            for _ in range(FLOOD_CONNECTIONS)
        ]
        for t in attackers:
            t.start()
        go.set()
        await asyncio.sleep(0.5)  # the flood is under way

        def probes() -> tuple[list[int], list[int]]:
            health, scrapes = [], []
            # Fresh connections, as a kubelet probe and Prometheus make them, from addresses of their own (the
            # HTTP layer makes room for a new connection by closing an idle one of the busiest address).
            for _ in range(PROBES):
                health.append(_one(server.port, "/health", {}, "127.0.0.3"))
                scrapes.append(_one(server.port, "/metrics", _basic("prometheus", PASSWORD), "127.0.0.2"))
            return health, scrapes

        health, scrapes = await asyncio.to_thread(probes)
        for t in attackers:
            await asyncio.to_thread(t.join, 240)
        return flood, health, scrapes

    flood, health, scrapes = with_server(config, body)
    assert sum(flood.values()) == FLOOD_CONNECTIONS * FLOOD_ROUNDS
    assert flood[200] == 0 and flood[429] > 0, flood  # the flood's address is answered at once, no bcrypt
    assert health == [200] * PROBES, (Counter(health), flood, Counter(scrapes))
    assert scrapes == [200] * PROBES, Counter(scrapes)


def test_an_unknown_user_costs_the_same_bcrypt_work_as_a_known_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cheap = bcrypt.hashpw(b"other", bcrypt.gensalt(4)).decode()
    costly = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(6)).decode()
    config = web_config(tmp_path, {"basic_auth_users": {"cheap": cheap, "prometheus": costly}})
    costs: list[bytes] = []
    real = bcrypt.checkpw

    def recording(password: bytes, hashed: bytes) -> bool:
        costs.append(hashed[:7])  # "$2b$06$": the scheme and the cost this check pays
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", recording)

    async def body(server: MetricsServer) -> tuple[int, int]:
        known = await asyncio.to_thread(fetch, server.port, "/metrics", auth=("prometheus", "wrong"))
        unknown = await asyncio.to_thread(fetch, server.port, "/metrics", auth=("nobody", "wrong"))
        return known[0], unknown[0]

    assert with_server(config, body) == (401, 401)
    known_cost, unknown_cost = costs
    assert known_cost == costly.encode()[:7]
    assert unknown_cost[4:6] == known_cost[4:6] == b"06", costs  # the costliest hash in the file


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == webauth.__name__ and r.levelno >= logging.ERROR
    ]


def _replace(path: Path, text: str) -> None:
    aside = path.with_name(path.name + ".new")
    aside.write_text(text)
    os.replace(aside, path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "dropping",
    [
        pytest.param("", id="empty"),
        pytest.param("{}\n", id="empty-mapping"),
        pytest.param(
            yaml.safe_dump({"http_server_config": {"headers": {"X-Frame-Options": "deny"}}}), id="no-users"
        ),
    ],
)
def test_a_reload_that_would_drop_basic_auth_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, dropping: str
) -> None:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    config = web_config(tmp_path, {"basic_auth_users": {"prometheus": hashed}})
    caplog.set_level(logging.INFO, logger=webauth.__name__)

    async def body(server: MetricsServer) -> None:
        def status(user: str, password: str) -> int:
            return fetch(server.port, "/metrics", auth=(user, password))[0]

        assert await asyncio.to_thread(status, "prometheus", PASSWORD) == 200
        _replace(config, dropping)  # as a file caught mid-write, or an operator's mistake
        # A request starts the reload check; the good password is remembered (no failures counted).
        await eventually(lambda: status("prometheus", PASSWORD) == 200 and bool(_errors(caplog)))
        (line,) = _errors(caplog)
        assert "would turn basic authentication off" in line and "takes a restart" in line, line
        assert "\n" not in line
        for user, password in (("prometheus", "wrong"), ("nobody", "x")):  # the running users still apply
            assert await asyncio.to_thread(status, user, password) == 401
        assert (await asyncio.to_thread(fetch, server.port, "/metrics"))[0] == 401
        assert await asyncio.to_thread(status, "prometheus", PASSWORD) == 200
        # The write completes: the new users apply.
        renewed = bcrypt.hashpw(b"renewed", bcrypt.gensalt(4)).decode()
        _replace(config, yaml.safe_dump({"basic_auth_users": {"prometheus": renewed}}))
        await eventually(lambda: status("prometheus", "renewed") == 200)
        assert await asyncio.to_thread(status, "prometheus", PASSWORD) == 401
        assert len(_errors(caplog)) == 1

    with_server(config, body)


@pytest.mark.timeout(300)
def test_a_reload_that_would_drop_tls_or_client_certificates_is_refused(
    tls: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    mutual = {"cert_file": "tls.crt", "key_file": "tls.key",
              "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "ca.crt"}  # fmt: skip
    config = web_config(tls.ca.parent, {"tls_server_config": mutual})
    caplog.set_level(logging.INFO, logger=webauth.__name__)

    async def body(server: MetricsServer) -> None:
        with_cert, anonymous = tls.client_context(with_cert=True), tls.client_context(with_cert=False)

        def anonymous_refused() -> bool:
            try:
                return fetch(server.port, "/metrics", ctx=anonymous)[0] == 401
            except (ssl.SSLError, OSError):
                return True

        for dropping, words in (
            ("", "turning TLS off"),
            ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"}}, "stop requiring client"),
        ):
            seen = len(_errors(caplog))
            _replace(config, dropping if isinstance(dropping, str) else yaml.safe_dump(dropping))
            await eventually(lambda n=seen: anonymous_refused() and len(_errors(caplog)) > n)  # type: ignore[misc]
            assert words in _errors(caplog)[-1] and "takes a restart" in _errors(caplog)[-1]
            assert await asyncio.to_thread(anonymous_refused)
            assert (await asyncio.to_thread(fetch, server.port, "/metrics", ctx=with_cert))[0] == 200

    with_server(config, body)


@pytest.mark.timeout(120)  # without the fix the server's event loop blocks in open() for good
@pytest.mark.parametrize("which", ["web-config.yml", "tls.crt"])
def test_a_fifo_in_place_of_a_watched_file_never_blocks_the_server(
    tls: TlsFiles, caplog: pytest.LogCaptureFixture, which: str
) -> None:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    config = web_config(
        tls.ca.parent,
        {
            "tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"},
            "basic_auth_users": {"p": hashed},
        },
    )
    caplog.set_level(logging.INFO, logger=webauth.__name__)

    async def body(server: MetricsServer) -> list[int]:
        ctx = tls.client_context(with_cert=False)
        victim = tls.ca.parent / which
        victim.unlink()
        os.mkfifo(victim)  # nobody ever writes to it: a blocking open() would wait for good
        statuses = []
        for _ in range(10):  # requests over several reload checks, each on a new connection
            statuses.append(
                (await asyncio.to_thread(fetch, server.port, "/metrics", ctx=ctx, auth=("p", PASSWORD)))[0]
            )
            await asyncio.sleep(0.3)
        await eventually(lambda: bool(_errors(caplog)) or not fetch(server.port, "/health", ctx=ctx))
        statuses.append(
            (await asyncio.to_thread(fetch, server.port, "/metrics", ctx=ctx, auth=("p", PASSWORD)))[0]
        )
        return statuses

    assert with_server(config, body) == [200] * 11
    (line,) = _errors(caplog)
    assert f"{which}" in line and "not a regular file (a FIFO)" in line and "\n" not in line, line
