"""The web configuration file of Prometheus exporters (exporter-toolkit's --web.config.file format).

node_exporter, dcgm-exporter and other exporters built on prometheus/exporter-toolkit
take one YAML file for TLS and authentication of their endpoint; the agent takes
the same file with --web-config-file (or gpunode.metrics.webConfigFile):

    tls_server_config:        # TLS is on when cert_file, key_file, client_auth_type or client_ca_file is set
      cert_file: tls.crt      # relative paths are relative to the file's own directory
      key_file: tls.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default), VerifyClientCertIfGiven
      client_ca_file: ca.crt
      min_version: TLS12      # TLS10..TLS13; max_version likewise (default TLS13)
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # TLS 1.2 suites, by their Go names
      prefer_server_cipher_suites: true
    http_server_config:
      http2: true             # accepted; the agent serves HTTP/1.1 (clients fall back through ALPN)
      headers: {X-Content-Type-Options: nosniff}   # the five headers exporter-toolkit allows
    basic_auth_users: {prometheus: $2y$10$...}     # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\\n')
    auth_excluded_paths: [/health, /ready]          # served without credentials (probes)
    rate_limit: {interval: 100ms, burst: 20}        # every request; over it: 429

What Python's ssl module cannot do as Go's crypto/tls does is refused with a
one-line WebConfigError naming the key: client certificates accepted without
verification (RequestClientCert, RequireAnyClientCert), curve_preferences,
client_allowed_sans, and PEM given inline (cert, key, client_ca). This module
parses and validates; gpunode.infra.webauth applies the result, and reads the
file again when it (or a TLS file it names) changes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpunode.config.files import read_regular
from gpunode.config.reader import load_yaml
from gpunode.contract.reader import SectionReader
from gpunode.errors import WebConfigError

TLS_VERSIONS = ("TLS10", "TLS11", "TLS12", "TLS13")
CLIENT_AUTH_TYPES = ("NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
# Go's TLS 1.2 cipher suite names and OpenSSL's for the same suites.
CIPHER_SUITES = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
}
# TLS 1.3 suites are not configurable in Go either: named, accepted, without effect.
TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")
ALLOWED_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_BCRYPT = re.compile(r"\$2[abxy]\$(0[4-9]|[12]\d|3[01])\$[./A-Za-z0-9]{53}")
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class TlsServerConfig:
    """tls_server_config, checked: absolute paths, OpenSSL cipher names."""

    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"  # one of CLIENT_AUTH_TYPES
    client_ca_file: str | None = None
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    ciphers: tuple[str, ...] = ()  # OpenSSL names; empty: OpenSSL's defaults
    prefer_server_cipher_suites: bool = True


@dataclass(frozen=True)
class RateLimit:
    """A token bucket over every request: one token every `interval_s`, at most `burst` saved up."""

    interval_s: float
    burst: int


@dataclass(frozen=True)
class WebConfig:
    """A parsed web configuration file."""

    path: str
    tls: TlsServerConfig | None = None
    headers: tuple[tuple[str, str], ...] = ()
    users: tuple[tuple[str, str], ...] = ()  # (user, bcrypt hash)
    auth_excluded_paths: tuple[str, ...] = ()
    rate_limit: RateLimit | None = None


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read and check a web configuration file; WebConfigError (one line) if it cannot be used."""
    name = os.fspath(path)
    try:
        raw = read_regular(name, MAX_FILE_BYTES)  # never blocks: a FIFO or a leased file is refused at once
    except OSError as err:
        raise WebConfigError(
            f"cannot read the web configuration file {name}: {err.strerror or err}",
            hint="give --web-config-file a readable file, or leave the flag out to serve plain HTTP",
        ) from None
    if len(raw) > MAX_FILE_BYTES:
        raise WebConfigError(f"{name}: larger than {MAX_FILE_BYTES} bytes; not a web configuration file")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise WebConfigError(f"{name}: not UTF-8 text") from None
    try:
        data = load_yaml(text, where=name)
    except Exception as err:  # ConfigError from the YAML reader: same message, our class
        raise WebConfigError(str(err)) from None
    return parse_web_config(data, name)


def parse_web_config(data: object, path: str) -> WebConfig:
    """Check a decoded web configuration document; relative file names are taken from `path`'s directory."""
    r = SectionReader(data, f"{path}: ", error=WebConfigError)
    base = Path(path).parent
    tls = _tls(r.section("tls_server_config"), base)
    h = r.section("http_server_config")
    h.flag("http2", True)
    headers = _headers(h.section("headers"))
    h.finish()
    users = r.section("basic_auth_users")
    checked_users = []
    for user in list(users.unread()):
        hashed = users.get(user, str)
        if not _BCRYPT.fullmatch(hashed):
            raise users.fail(user, "expected a bcrypt hash ($2y$10$ and 53 more characters)", hint=_HASH_HINT)
        checked_users.append((str(user), hashed))
    excluded = r.text_list("auth_excluded_paths", ())
    for p in excluded:
        if not p.startswith("/"):
            raise r.fail("auth_excluded_paths", f"expected paths starting with /, got {p!r}")
    rate = r.section("rate_limit")
    interval_s = rate.duration("interval", 0.0)
    burst = rate.integer("burst", 0, minimum=0, maximum=1_000_000)
    rate.finish()
    if interval_s > 0 and burst < 1:
        raise rate.fail("burst", "must be at least 1 when an interval is set")
    r.finish()
    return WebConfig(
        path=path,
        tls=tls,
        headers=headers,
        users=tuple(checked_users),
        auth_excluded_paths=excluded,
        rate_limit=RateLimit(interval_s, burst) if interval_s > 0 else None,
    )


_HASH_HINT = 'make one with: htpasswd -nBC 10 "" | tr -d \':\\n\' (or python -c "import bcrypt; ...hashpw")'


def _tls(t: SectionReader, base: Path) -> TlsServerConfig | None:
    for inline in ("cert", "key", "client_ca"):
        if t.raw(inline, None) is not None:
            raise t.fail(
                inline, f"PEM given inline is not supported; put it in a file and name it in {inline}_file"
            )
    curves = t.items("curve_preferences", [])
    if curves:
        raise t.fail(
            "curve_preferences", "Python's ssl module cannot set a curve preference list; leave it out"
        )
    if t.items("client_allowed_sans", []):
        raise t.fail(
            "client_allowed_sans",
            "not supported: Python's ssl module cannot match client SANs during the handshake",
            hint="issue client certificates from a CA of their own and name it in client_ca_file",
        )
    auth = t.get("client_auth_type", str, "NoClientCert") or "NoClientCert"
    if auth in UNVERIFIED_CLIENT_AUTH:
        raise t.fail(
            "client_auth_type",
            f"{auth} accepts client certificates no CA vouches for, which Python's ssl module cannot do",
            hint="use RequireAndVerifyClientCert (or VerifyClientCertIfGiven) with client_ca_file",
        )
    if auth not in CLIENT_AUTH_TYPES:
        raise t.fail("client_auth_type", f"expected one of {', '.join(CLIENT_AUTH_TYPES)}, got {auth!r}")
    versions = [t.choice(k, TLS_VERSIONS, d) for k, d in (("min_version", "TLS12"), ("max_version", "TLS13"))]
    if TLS_VERSIONS.index(versions[0]) > TLS_VERSIONS.index(versions[1]):
        raise t.fail("min_version", f"{versions[0]} is above max_version {versions[1]}")
    ciphers = []
    for name in t.text_list("cipher_suites", ()):
        if name in CIPHER_SUITES:
            ciphers.append(CIPHER_SUITES[name])
        elif name not in TLS13_SUITES:
            raise t.fail(
                "cipher_suites", f"unknown cipher suite {name!r}", hint=f"use {', '.join(CIPHER_SUITES)}"
            )
    prefer = t.flag("prefer_server_cipher_suites", True)
    cert, key, ca = (t.get(k, str, None) for k in ("cert_file", "key_file", "client_ca_file"))
    t.finish()
    if not (cert or key or ca or t.has("client_auth_type")):
        return None  # as exporter-toolkit: no TLS unless a certificate or client authentication is asked for
    for k, v in (("cert_file", cert), ("key_file", key)):
        if not v:
            raise t.fail(k, "required when TLS is configured")
    if ca and auth == "NoClientCert":
        raise t.fail(
            "client_ca_file", "set, but client_auth_type is NoClientCert", hint="set client_auth_type"
        )
    if auth != "NoClientCert" and not ca:
        raise t.fail(
            "client_auth_type", f"{auth} needs client_ca_file, the CA that signs client certificates"
        )
    return TlsServerConfig(
        cert_file=str(base / str(cert)),
        key_file=str(base / str(key)),
        client_auth_type=auth,
        client_ca_file=str(base / ca) if ca else None,
        min_version=versions[0],
        max_version=versions[1],
        ciphers=tuple(ciphers),
        prefer_server_cipher_suites=prefer,
    )


def _headers(h: SectionReader) -> tuple[tuple[str, str], ...]:
    out = []
    for name, allowed in ALLOWED_HEADERS.items():
        value = h.get(name, str, "")
        if value and allowed is not None and value not in allowed:
            raise h.fail(name, f"expected one of {', '.join(allowed)}, got {value!r}")
        if value:
            out.append((name, value))
    h.finish()
    return tuple(out)
