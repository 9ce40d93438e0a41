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
  time, slow on purpose) in a pool of CONCURRENT_CHECKS threads of its own, so
  password checks never hold the threads the rest of the process uses; at most
  MAX_WAITING_CHECKS more wait for it, beyond that a request is answered 503 at
  once; one client address has at most CHECKS_PER_CLIENT checks running or
  waiting (more are answered 429 at once), so one address cannot fill the queue. An unknown user is checked against a dummy hash with the salt and cost
  of the costliest hash in the file, so that it costs exactly as much as a
  wrong password for a known user (the answer's timing does not tell which
  users exist). A successful check is remembered for CACHE_TTL_S so that a
  scraper does not pay for bcrypt on every scrape. A client address with
  FAILURES_PER_CLIENT failed checks within FAILURE_WINDOW_S is answered 429 at
  once, without bcrypt, until the window has passed (credentials that passed a
  check before are still accepted from it), so a flood of wrong passwords from
  one address costs no bcrypt work and cannot hold the connection slots;
- auth_excluded_paths (the probes) are served before any authentication work:
  they never wait behind password checks;
- with rate_limit, requests beyond it are answered 429;
- the configured headers are added to every answer.

As exporter-toolkit does, the file is read again when it changes, so that
certificates can be renewed (cert-manager) and users changed without a restart:
on a new connection and on a request, at most once every RELOAD_CHECK_S, a
check is started in a thread of its own (never on the event loop): the file and the
TLS files it names are looked at (inode, size, modification time) and, when one
changed, read (without blocking: a FIFO or a leased file is refused,
gpunode.config.files) and checked again. A request waits for a check in flight
(a few small reads, at most RELOAD_WAIT_S); a new connection is wrapped with what is current. A usable
configuration replaces the old one for new connections and requests
(certificate, client CA, TLS settings, users, excluded paths, headers, rate
limit); an unusable one is logged as one error line and the old one stays,
until the files change again. A reload never takes away protection the running
configuration has: one that would turn TLS on or off, drop basic auth (no
basic_auth_users where there were some: an empty file, `{}`, a file caught
half written) or stop requiring client certificates is refused the same way;
such a change takes a restart with the new file.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import secrets
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
RELOAD_WAIT_S = 2.0  # how long a request waits, at most, for a check in flight (then served as before)
CACHE_TTL_S = 300.0
CACHE_SIZE = 256
CONCURRENT_CHECKS = 2  # bcrypt checks at once (threads of the guard's own pool)
MAX_WAITING_CHECKS = 16  # checks that may wait for the pool; beyond, 503 at once
CHECKS_PER_CLIENT = 1  # checks one client address may have running or waiting; beyond, 429 at once
FAILURES_PER_CLIENT = 10  # failed checks from one address within the window before it is answered 429 at once
FAILURE_WINDOW_S = 60.0
MAX_CLIENTS_TRACKED = 4096  # addresses whose failures are counted; the oldest windows are dropped first
_BCRYPT_ALPHABET = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}


def dummy_hash(hashes: list[bytes]) -> bytes:
    """What an unknown user's password is checked against: the salt and cost of the costliest of `hashes`
    with a random checksum (no password matches it), so the check costs as much as a real user's."""
    if not hashes:
        return b""
    costliest = max(hashes, key=lambda h: int(h[4:6]))
    return costliest[:29] + "".join(secrets.choice(_BCRYPT_ALPHABET) for _ in range(31)).encode()


def _password_matches(password: bytes, hashed: bytes) -> bool:
    return bool(bcrypt.checkpw(password, hashed))


class WebGuard:
    """The runtime side of one web configuration file, kept up to date with it (see the module's docstring).

    `ssl_context` (None without TLS) is what the server listens with; it stays the same object while
    the configuration behind it changes.
    """

    def __init__(self, cfg: WebConfig) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(CONCURRENT_CHECKS, thread_name_prefix="bcrypt")
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="web-config")
        self._pending = 0  # password checks running or waiting for the pool
        self._pending_by_client: dict[str, int] = {}  # the same, by client address
        self._failures: dict[str, tuple[float, int]] = {}  # client address -> (window start, failures)
        self._paths = _watched(cfg)
        self._stamp = _stamps(self._paths)
        self._checked = time.monotonic()
        self._reload: asyncio.Task[None] | None = None
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
        self._dummy = dummy_hash(list(self._users.values()))
        self._verified: dict[bytes, float] = {}  # digest of a good (user, hash, password) -> expiry
        self._tokens = float(cfg.rate_limit.burst) if cfg.rate_limit else 0.0
        self._refilled = time.monotonic()

    def refresh(self) -> asyncio.Task[None] | None:
        """Start a check of the configuration's files in a worker thread if one is due (at most once every
        RELOAD_CHECK_S, one at a time); the check in flight, if any. Called on the event loop."""
        if self._reload is not None:
            return self._reload
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return None
        self._checked = now
        self._reload = asyncio.get_running_loop().create_task(self._check_files())
        return self._reload

    async def _check_files(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            changed = await loop.run_in_executor(
                self._reader, self._read_changed, self.cfg, self._paths, self._stamp
            )
        finally:
            self._reload = None
        if changed is None:
            return
        stamp, paths, loaded = changed
        self._stamp, self._paths = stamp, paths  # a change made while reading is seen next time
        if isinstance(loaded, GpunodeError):
            log.error("web configuration changed but not applied, the previous one stays in use: %s", loaded)
            return
        self._use(*loaded)
        log.info("%s: web configuration reloaded", self.cfg.path)

    @staticmethod
    def _read_changed(
        running: WebConfig, paths: tuple[str, ...], old_stamp: tuple[tuple[int, ...] | None, ...]
    ) -> (
        tuple[
            tuple[tuple[int, ...] | None, ...],
            tuple[str, ...],
            GpunodeError | tuple[WebConfig, ssl.SSLContext | None, bool],
        ]
        | None
    ):
        """In a worker thread: None if no watched file changed; else the new stamps and watched paths, and
        the new configuration (with its TLS context) or why it is refused."""
        stamp = _stamps(paths)
        if stamp == old_stamp:
            return None
        path = running.path
        try:
            cfg = load_web_config(path)
            new_paths = _watched(cfg)  # from now on, the files the new configuration names
            stamp = stamp[:1] + _stamps(new_paths[1:])
            paths = new_paths
            _check_keeps_protection(running, cfg)
            context, cert_per_request = _tls_context(cfg)
        except GpunodeError as err:
            return stamp, paths, err
        return stamp, paths, (cfg, context, cert_per_request)

    def wrap(self, handler: Handler) -> Handler:
        """`handler` behind this configuration's rate limit, authentication and headers."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            reload = self.refresh()
            if reload is not None:  # small non-blocking reads in a thread of its own; the loop goes on
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(reload), RELOAD_WAIT_S)
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
        if self._users:
            return await self._password_refusal(
                request.headers.get("Authorization", ""), request.remote or ""
            )
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

    async def _password_refusal(self, authorization: str, client: str) -> web.Response | None:
        """None if `authorization` holds a user's good password; else the answer (401, 429 or 503)."""
        unauthorized = web.Response(status=401, text="Unauthorized\n", headers={"WWW-Authenticate": "Basic"})
        scheme, _, encoded = authorization.partition(" ")
        if scheme.lower() != "basic" or len(encoded) > 4096:
            return unauthorized
        try:
            user, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return unauthorized
        if not sep:
            return unauthorized
        hashed = self._users.get(user)
        digest = hashlib.sha256(b"\0".join((user, hashed or b"", password))).digest()
        now = time.monotonic()
        if hashed is not None and self._verified.get(digest, 0.0) > now:
            return None
        if self._failed_recently(client, now) >= FAILURES_PER_CLIENT:
            return web.Response(
                status=429,
                text="Too Many Requests: too many failed password checks from this address\n",
                headers={"Retry-After": str(int(FAILURE_WINDOW_S))},
            )
        if self._pending_by_client.get(client, 0) >= CHECKS_PER_CLIENT:
            return web.Response(
                status=429,
                text="Too Many Requests: a password check from this address is already in progress\n",
                headers={"Retry-After": "1"},
            )
        if self._pending >= CONCURRENT_CHECKS + MAX_WAITING_CHECKS:
            return web.Response(
                status=503,
                text="Service Unavailable: too many password checks at once\n",
                headers={"Retry-After": "1"},
            )
        self._pending += 1
        self._pending_by_client[client] = self._pending_by_client.get(client, 0) + 1
        try:
            loop = asyncio.get_running_loop()
            good = await loop.run_in_executor(self._pool, _password_matches, password, hashed or self._dummy)
        finally:
            self._pending -= 1
            left = self._pending_by_client.pop(client) - 1
            if left:
                self._pending_by_client[client] = left
        if not (good and hashed is not None):
            self._count_failure(client, time.monotonic())
            return unauthorized
        if len(self._verified) >= CACHE_SIZE:
            self._verified = {k: t for k, t in self._verified.items() if t > now}
            while len(self._verified) >= CACHE_SIZE:
                del self._verified[next(iter(self._verified))]
        self._verified[digest] = now + CACHE_TTL_S
        return None

    def _failed_recently(self, client: str, now: float) -> int:
        """How many checks from `client` failed in its current window."""
        window = self._failures.get(client)
        if window is None or now - window[0] >= FAILURE_WINDOW_S:
            return 0
        return window[1]

    def _count_failure(self, client: str, now: float) -> None:
        window = self._failures.pop(client, None)
        if window is None or now - window[0] >= FAILURE_WINDOW_S:
            window = (now, 0)
        if len(self._failures) >= MAX_CLIENTS_TRACKED:
            self._failures = {c: w for c, w in self._failures.items() if now - w[0] < FAILURE_WINDOW_S}
            while len(self._failures) >= MAX_CLIENTS_TRACKED:
                del self._failures[next(iter(self._failures))]
        self._failures[client] = (window[0], window[1] + 1)


def _check_keeps_protection(running: WebConfig, new: WebConfig) -> None:
    """WebConfigError (one line) if `new` would take away TLS or authentication that `running` has."""
    path = new.path
    restart = "takes a restart with the new file"
    if (new.tls is None) != (running.tls is None):
        raise WebConfigError(f"{path}: turning TLS {'on' if new.tls else 'off'} {restart}")
    if running.users and not new.users:
        raise WebConfigError(
            f"{path}: the new file has no basic_auth_users and would turn basic authentication off "
            f"(an empty or half-written file?); that {restart}"
        )
    required = "RequireAndVerifyClientCert"
    if running.tls and new.tls and running.tls.client_auth_type == required != new.tls.client_auth_type:
        raise WebConfigError(
            f"{path}: client_auth_type {new.tls.client_auth_type} would stop requiring client certificates; "
            f"that {restart}"
        )


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
