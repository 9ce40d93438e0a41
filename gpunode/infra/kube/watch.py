"""List+watch of one kind of object, kept going: resourceVersion tracking, re-list on 410 Gone, retries.

The loop: list the collection (SYNC event with every object and the list's
resourceVersion), then watch from that version. Each event moves the version
on (BOOKMARK events only do that); when the server ends the watch (its
timeoutSeconds), it is opened again from the last version, without a re-list.
When the server says the version is too old (410 Gone, as an HTTP status or as
an ERROR event in the stream), the collection is listed again and a new SYNC
event tells the caller to replace what it holds. No answer, a server error or
throttling is retried with exponential backoff; any other error (403, a
malformed answer) ends the iteration with that KubeError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, TypeVar

import msgspec

from gpunode.errors import KubeApiError, KubeError
from gpunode.infra.kube.models import SYNC, WatchEvent
from gpunode.infra.kube.transport import decode, is_retryable, resource_path

if TYPE_CHECKING:
    from gpunode.infra.kube.client import KubeClient

log = logging.getLogger(__name__)

R = TypeVar("R")

GONE = 410
BOOKMARK, ERROR = "BOOKMARK", "ERROR"


class _Line(msgspec.Struct):
    type: str
    object: msgspec.Raw


class _Meta(msgspec.Struct):
    resourceVersion: str | None = None


class _Versioned(msgspec.Struct):
    metadata: _Meta | None = None


class _Status(msgspec.Struct):
    code: int = 0
    reason: str = ""
    message: str = ""


async def list_and_watch(
    client: KubeClient,
    resource: type[R],
    *,
    namespace: str | None,
    label_selector: str | None,
    field_selector: str | None,
    server_timeout_s: int,
    retry_initial_s: float,
    retry_max_s: float,
) -> AsyncGenerator[WatchEvent[R], None]:
    """See KubeClient.watch."""
    what = f"watch {resource.__name__.lower()}s" + (f" in {namespace}" if namespace else "")
    path = resource_path(resource, namespace)
    selectors = {"labelSelector": label_selector, "fieldSelector": field_selector}
    params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(server_timeout_s)}
    params.update({k: v for k, v in selectors.items() if v})
    version: str | None = None
    delay = retry_initial_s
    while True:
        try:
            if version is None:
                items, version = await client.list_objects(
                    resource,
                    namespace=namespace,
                    label_selector=label_selector,
                    field_selector=field_selector,
                )
                delay = retry_initial_s
                yield WatchEvent(SYNC, items=tuple(items), resource_version=version)
            lines = client.transport.stream_lines(
                path,
                params={**params, "resourceVersion": version},
                what=what,
                idle_timeout_s=server_timeout_s + client.request_timeout_s,
            )
            async with contextlib.aclosing(lines):  # the stream ends with this watch, however it ends
                async for line in lines:
                    event = _event(line, resource, what)
                    version = event.resource_version or version
                    delay = retry_initial_s
                    if event.type != BOOKMARK:
                        yield event
        except KubeError as exc:
            if isinstance(exc, KubeApiError) and exc.status == GONE:
                log.info("%s: resourceVersion %s is too old; listing again", what, version)
                version = None
                continue
            if not is_retryable(exc):
                raise
            log.warning("%s failed, retrying in %.1f s: %s", what, delay, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, retry_max_s)


def _event(line: bytes, resource: type[R], what: str) -> WatchEvent[R]:
    """One line of a watch stream; an ERROR event is raised as KubeApiError with its status code."""
    entry = decode(line, _Line, what)
    if entry.type == ERROR:
        status = decode(entry.object, _Status, what)
        raise KubeApiError(
            f"{what}: {status.reason or 'error'} ({status.code}): {status.message}",
            status=status.code,
            reason=status.reason,
        )
    versioned = decode(entry.object, _Versioned, what)
    version = (versioned.metadata.resourceVersion if versioned.metadata else None) or ""
    if entry.type == BOOKMARK:
        return WatchEvent(BOOKMARK, resource_version=version)
    return WatchEvent(entry.type, object=decode(entry.object, resource, what), resource_version=version)
