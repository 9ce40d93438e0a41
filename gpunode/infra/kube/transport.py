"""The one request path to an API server: timeouts, and every failure translated into KubeError.

Transport makes single requests and streams (watch) over a connection pool
that gpunode.infra.kube.config sets up. A 2xx answer gives its body; any other
status becomes a KubeApiError subclass naming the call, the status, the
API server's reason and message (404 KubeNotFound, 409 KubeConflict, 429 on an
eviction EvictionBlocked with its Retry-After); no answer within the timeout, a
refused or reset connection KubeUnreachable. Nothing is retried here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncGenerator, Iterator, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import httpx2
import msgspec
from lightkube import ConfigError as LightkubeConfigError
from lightkube.core.resource import api_info

from gpunode.errors import (
    EvictionBlocked,
    KubeApiError,
    KubeConflict,
    KubeError,
    KubeNotFound,
    KubeUnreachable,
)
from gpunode.infra.kube.config import CREDENTIALS_HINT

R = TypeVar("R")

JSON = "application/json"
RBAC_HINT = (
    "check the service account's RBAC (docs/health.md lists the verbs the agent needs, "
    "helm/gpunode grants the extender's)"
)


def is_retryable(exc: KubeError) -> bool:
    """Whether the same call may succeed later: no answer, a server error, or throttling."""
    if isinstance(exc, KubeUnreachable):
        return True
    return isinstance(exc, KubeApiError) and (exc.status >= 500 or exc.status == 429)


def resource_path(resource: type[Any], namespace: str | None = None) -> str:
    """The collection URL path of a lightkube resource class (all namespaces when namespace is None)."""
    info = api_info(resource)
    ref = info.parent or info.resource
    root = f"/apis/{ref.group}/{ref.version}" if ref.group else f"/api/{ref.version}"
    if namespace:
        root += f"/namespaces/{quote(namespace, safe='')}"
    return f"{root}/{info.plural}"


class Transport:
    """Requests to one API server, each bounded by request_timeout_s."""

    def __init__(self, pool: httpx2.AsyncClient, *, request_timeout_s: float) -> None:
        self._pool = pool
        self.request_timeout_s = request_timeout_s
        self.host = str(pool.base_url).rstrip("/")

    async def close(self) -> None:
        """Close the pooled connections."""
        await self._pool.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        content_type: str = JSON,
        params: Mapping[str, str] | None = None,
        what: str,
        eviction: bool = False,
    ) -> bytes:
        """Make one request; return the body of a 2xx answer, raise KubeError otherwise.

        `what` names the call in error messages; `eviction` makes a 429 an EvictionBlocked.
        """
        headers = {"Accept": JSON}
        content = None
        if body is not None:
            content = msgspec.json.encode(body)
            headers["Content-Type"] = content_type
        try:
            with self._translated(what):
                async with asyncio.timeout(self.request_timeout_s):
                    resp = await self._pool.request(
                        method, path, params=dict(params or {}), content=content, headers=headers
                    )
        except (TimeoutError, httpx2.TimeoutException):
            raise KubeUnreachable(
                f"{what}: the API server at {self.host} did not answer within {self.request_timeout_s:g} s"
            ) from None
        if resp.is_success:
            return resp.content
        raise _api_error(what, resp.status_code, resp.content, resp.headers, eviction=eviction)

    async def stream_lines(
        self, path: str, *, params: Mapping[str, str], what: str, idle_timeout_s: float
    ) -> AsyncGenerator[bytes, None]:
        """The non-empty lines of one streamed GET (a watch), until the server ends it.

        A connection silent for idle_timeout_s counts as lost (KubeUnreachable).
        """
        timeout = httpx2.Timeout(self.request_timeout_s, read=idle_timeout_s)
        try:
            with self._translated(what):
                async with self._pool.stream(
                    "GET", path, params=dict(params), headers={"Accept": JSON}, timeout=timeout
                ) as resp:
                    if not resp.is_success:
                        raw = await resp.aread()
                        raise _api_error(what, resp.status_code, raw, resp.headers, eviction=False)
                    async for line in resp.aiter_lines():
                        if line.strip():
                            yield line.encode()
        except httpx2.TimeoutException:
            raise KubeUnreachable(
                f"{what}: the API server at {self.host} sent nothing for {idle_timeout_s:g} s"
            ) from None

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        """Connection failures become KubeUnreachable, credential failures KubeError; timeouts pass
        through (TimeoutError is an OSError), for the caller to word."""
        try:
            yield
        except (TimeoutError, httpx2.TimeoutException):
            raise
        except (httpx2.TransportError, OSError) as exc:
            raise KubeUnreachable(
                f"{what}: the API server at {self.host} did not answer "
                f"({type(exc).__name__}: {_root_cause(exc)})"
            ) from None
        except LightkubeConfigError as exc:  # the token file went away, an exec plugin failed
            raise KubeError(f"{what}: no usable credentials: {exc}", hint=CREDENTIALS_HINT) from None


_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}
_DECODERS_LOCK = threading.Lock()


def _decoder(model: type[R]) -> msgspec.json.Decoder[R]:
    """The decoder of `model`, made once under a lock.

    msgspec builds a struct type's decoding tables on its first use and does so without a lock: two
    threads decoding the same new type at once crash the process (SIGSEGV). A Decoder builds them when
    it is made, so making each one under this lock, once, leaves only ready tables to the threads.
    """
    found = _DECODERS.get(model)
    if found is None:
        with _DECODERS_LOCK:
            found = _DECODERS.get(model)
            if found is None:
                found = _DECODERS[model] = msgspec.json.Decoder(model)
    return found


def decode(raw: bytes, model: type[R], what: str) -> R:
    """JSON from the API server as `model` (a typed struct, or a plain type); KubeError when it does not fit."""
    try:
        return _decoder(model).decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KubeError(
            f"{what}: the API server's answer is not a valid {model.__name__}: {exc}",
            hint="check that --kube-api or the kubeconfig points at a Kubernetes API server",
        ) from None


def _status_message(body: bytes) -> tuple[str, str]:
    """(reason, message) of a metav1.Status body, or ("", raw text)."""
    text = body.decode("utf-8", "replace")
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return "", text.strip()[:300]
    if isinstance(data, dict):
        return str(data.get("reason", "")), str(data.get("message", text))[:500]
    return "", text[:300]


def _api_error(
    what: str, status: int, body: bytes, headers: Mapping[str, str], *, eviction: bool
) -> KubeApiError:
    reason, message = _status_message(body)
    text = f"{what}: HTTP {status} {reason}: {message}".rstrip(": ")
    if status == 404:
        return KubeNotFound(text, status=status, reason=reason)
    if status == 409:
        return KubeConflict(text, status=status, reason=reason)
    if status in (401, 403):
        return KubeApiError(text, status=status, reason=reason, hint=RBAC_HINT)
    if status == 429 and eviction:
        return EvictionBlocked(text, retry_after_s=_retry_after_s(headers))
    if status == 429:
        hint = "the API server is throttling this client; the call is worth retrying later"
        return KubeApiError(text, status=status, reason=reason, hint=hint)
    return KubeApiError(text, status=status, reason=reason)


def _retry_after_s(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _root_cause(exc: BaseException) -> str:
    """The innermost OS error text ("Connection refused") under the HTTP library's wrappers."""
    seen: set[int] = set()
    current: BaseException | None = exc
    best = str(exc) or type(exc).__name__
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno:
            return os.strerror(current.errno)
        if isinstance(current, BaseExceptionGroup) and current.exceptions:
            current = current.exceptions[0]
            continue
        current = current.__cause__ or current.__context__
    return best
