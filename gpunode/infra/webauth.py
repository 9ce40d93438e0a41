"""A web configuration (gpunode.config.webconfig) applied to an HttpServer: TLS, basic auth, headers, rate limit.

WebGuard(cfg) builds the TLS context when the file asks for TLS (TlsConfigError
or WebConfigError, one line, for files that cannot be used) and wraps a request
handler so that, as exporter-toolkit does, every request except those to
auth_excluded_paths must authenticate:

- with client_auth_type RequireAndVerifyClientCert the TLS handshake itself
  fails without a certificate signed by client_ca_file; when some paths are
  excluded from authentication, the handshake accepts a connection without a
  certificate (one that is presented is still verified) and the requests to the
  other paths are answered 401 instead;
- with basic_auth_users, a request without valid credentials is answered 401
  with `WWW-Authenticate: Basic`. Passwords are checked with bcrypt (constant
  time, in a worker thread, two at a time: bcrypt is slow on purpose); an
  unknown user is checked against a dummy hash so that the answer takes as
  long; a successful check is remembered for CACHE_TTL_S so that a scraper does
  not pay for bcrypt on every scrape;
- with rate_limit, requests beyond it are answered 429;
- the configured headers are added to every answer.

As exporter-toolkit does, the file is read again when it changes, so that
certificates can be renewed (cert-manager) and users changed without a restart:
on a new connection (with TLS, before its handshake) and on a request, at most
once every RELOAD_CHECK_S, the file and the TLS files it names are looked at
(inode, size, modification time); when one changed, the configuration is read
and checked again. A usable one replaces the old one for new connections and
requests (certificate, client CA, TLS settings, users, excluded paths, headers,
rate limit); an unusable one (or one turning TLS on or off, which takes a
restart) is logged as one error line and the old one stays, until the files
change again.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import os
import ssl
import time

import bcrypt
from aiohttp import web

from gpunode.config.webconfig import WebConfig, load_web_config
from gpunode.errors import GpunodeError, WebConfigError
from gpunode.infra.http import Handler
from gpunode.infra.tls import server_tls_context

log = logging.getLogger(__name__)

RELOAD_CHECK_S = 1.0  # how often, at most, the files are looked at for a change
CACHE_TTL_S = 300.0
CACHE_SIZE = 256
CONCURRENT_CHECKS = 2
# bcrypt of a random password, cost 10: what an unknown user's password is checked against.
_DUMMY_HASH = b"$2b$10$Ckv2yxT8AowKsVSklB8yOOqjIVBG52WyOEsVnX9E06R5GDWpVTxT6"
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}


class WebGuard:
    """The runtime side of one web configuration file, kept up to date with it (see the module's docstring).

    `ssl_context` (None without TLS) is what the server listens with; it stays the same object while
    the configuration behind it changes.
    """

    def __init__(self, cfg: WebConfig) -> None:
        self._checks = asyncio.Semaphore(CONCURRENT_CHECKS)
        self._paths = _watched(cfg)
        self._stamp = _stamps(self._paths)
        self._checked = time.monotonic()
        self._use(cfg, *_tls_context(cfg))
        self.ssl_context: ssl.SSLContext | None = None
        if cfg.tls is not None:
            live = _LiveContext(ssl.PROTOCOL_TLS_SERVER)
            live.guard = self
            self.ssl_context = live

    def _use(self, cfg: WebConfig, context: ssl.SSLContext | None, cert_per_request: bool) -> None:
        self.cfg = cfg
        self.context = context  # what new connections are wrapped with
        self.require_cert_per_request = cert_per_request
        self._users = {user.encode(): hashed.encode() for user, hashed in cfg.users}
        self._verified: dict[bytes, float] = {}  # digest of a good (user, hash, password) -> expiry
        self._tokens = float(cfg.rate_limit.burst) if cfg.rate_limit else 0.0
        self._refilled = time.monotonic()

    def refresh(self) -> None:
        """Read the configuration again if its file or a TLS file it names changed (checked at most once
        every RELOAD_CHECK_S); keep the current one, with one error line, if the new one is unusable."""
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        stamp = _stamps(self._paths)
        if stamp == self._stamp:
            return
        self._stamp = stamp  # looked at before reading: a change made while reading is seen next time
        path = self.cfg.path
        try:
            cfg = load_web_config(path)
            self._paths = _watched(cfg)  # from now on, the files the new configuration names
            self._stamp = stamp[:1] + _stamps(self._paths[1:])
            if (cfg.tls is None) != (self.cfg.tls is None):
                raise WebConfigError(f"{path}: turning TLS {'on' if cfg.tls else 'off'} takes a restart")
            context, cert_per_request = _tls_context(cfg)
        except GpunodeError as err:
            log.error("web configuration changed but not applied, the previous one stays in use: %s", err)
            return
        self._use(cfg, context, cert_per_request)
        log.info("%s: web configuration reloaded", path)

    def wrap(self, handler: Handler) -> Handler:
        """`handler` behind this configuration's rate limit, authentication and headers."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            self.refresh()
            response = await self._refusal(request) or await handler(request)
            for name, value in self.cfg.headers:
                response.headers[name] = value
            return response

        return guarded

    async def _refusal(self, request: web.Request) -> web.Response | None:
        if not self._take_token():
            return web.Response(status=429, text="Too Many Requests\n")
        if request.path in self.cfg.auth_excluded_paths:
            return None
        if self.require_cert_per_request and not (
            request.transport and request.transport.get_extra_info("peercert")
        ):
            return web.Response(status=401, text="Unauthorized: a client certificate is required\n")
        if self._users and not await self._password_ok(request.headers.get("Authorization", "")):
            return web.Response(status=401, text="Unauthorized\n", headers={"WWW-Authenticate": "Basic"})
        return None

    def _take_token(self) -> bool:
        limit = self.cfg.rate_limit
        if limit is None:
            return True
        now = time.monotonic()
        self._tokens = min(float(limit.burst), self._tokens + (now - self._refilled) / limit.interval_s)
        self._refilled = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    async def _password_ok(self, authorization: str) -> bool:
        scheme, _, encoded = authorization.partition(" ")
        if scheme.lower() != "basic" or len(encoded) > 4096:
            return False
        try:
            user, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        if not sep:
            return False
        hashed = self._users.get(user)
        digest = hashlib.sha256(b"\0".join((user, hashed or b"", password))).digest()
        now = time.monotonic()
        if hashed is not None and self._verified.get(digest, 0.0) > now:
            return True
        async with self._checks:
            good = await asyncio.to_thread(bcrypt.checkpw, password, hashed or _DUMMY_HASH)
        if not (good and hashed is not None):
            return False
        if len(self._verified) >= CACHE_SIZE:
            self._verified = {k: t for k, t in self._verified.items() if t > now}
            while len(self._verified) >= CACHE_SIZE:
                del self._verified[next(iter(self._verified))]
        self._verified[digest] = now + CACHE_TTL_S
        return True


class _LiveContext(ssl.SSLContext):
    """The context the server listens with: each new connection is wrapped with its guard's current one,
    after the guard has looked for a changed configuration (as exporter-toolkit does per connection)."""

    guard: WebGuard

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        """A new connection's TLS object, from the current configuration."""
        self.guard.refresh()
        assert self.guard.context is not None
        return self.guard.context.wrap_bio(
            incoming, outgoing, server_side=server_side, server_hostname=server_hostname, session=session
        )


def _tls_context(cfg: WebConfig) -> tuple[ssl.SSLContext | None, bool]:
    """The TLS context a configuration asks for (None without TLS), and whether client certificates
    are checked per request (some paths are excluded from authentication) rather than at the handshake."""
    t = cfg.tls
    if t is None:
        return None, False
    verify = t.client_auth_type != "NoClientCert"
    required = t.client_auth_type == "RequireAndVerifyClientCert"
    per_request = required and bool(cfg.auth_excluded_paths)
    ctx = server_tls_context(
        t.cert_file,
        t.key_file,
        t.client_ca_file if verify else None,
        require_client_cert=required and not per_request,
    )
    ctx.minimum_version, ctx.maximum_version = _VERSIONS[t.min_version], _VERSIONS[t.max_version]
    if t.ciphers:
        try:
            ctx.set_ciphers(":".join(t.ciphers))
        except ssl.SSLError:
            raise WebConfigError(
                f"{cfg.path}: tls_server_config.cipher_suites: none of them is available in this OpenSSL"
            ) from None
    if t.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    return ctx, per_request


def _watched(cfg: WebConfig) -> tuple[str, ...]:
    """The configuration file, then the TLS files it names."""
    t = cfg.tls
    tls_files = () if t is None else (t.cert_file, t.key_file, t.client_ca_file)
    return (cfg.path, *(f for f in tls_files if f))


def _stamps(paths: tuple[str, ...]) -> tuple[tuple[int, ...] | None, ...]:
    """What tells a changed file (through symbolic links, as Secret volumes swap them): its device,
    inode, size and modification time; None for a file that cannot be looked at."""
    out: list[tuple[int, ...] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)
