"""The extender's calls to the Kubernetes API server: read a pod, annotate it with its GPUs, bind it, list nodes
and pods, label a pod (the leader's role label, ha.py).

KubeApi holds one gpunode.infra.kube.KubeClient (asyncio) and the event loop
that client lives on. The Extender core calls `bind` synchronously from the
HTTP server's worker threads, so the sync methods hand their coroutine to that
loop (asyncio.run_coroutine_threadsafe) and wait for the answer; the async
methods (`bind_async`, `list_nodes_async`) are for code already on the loop,
such as refresh_nodes_periodically.

The loop is bound lazily, because KubeApi is built from the flags before any
loop runs: `attach(loop)` binds it to the loop the HTTP server runs on (the
CLI attaches the running loop as it starts serving; a server started with
ExtenderServer.start() has its own, `server.loop`), and an async method called
before any attach binds the loop it runs on. Its connections are opened on that
loop only. Errors from the API server are KubeError, raised as they are.

check_reservations_periodically ends the reservations of bound pods that are
gone (deleted, finished, bound elsewhere) before their node's annotation ever
listed them, reading each such pod every RESERVATION_CHECK_S.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import msgspec
from lightkube.resources.core_v1 import Pod

from gpunode.cluster.extender.core import Extender
from gpunode.cluster.extender.reservations import gone_reason
from gpunode.contract.names import ASSIGNMENT_ANNOTATION
from gpunode.errors import ConfigError, KubeError, KubeNotFound, KubeUnreachable
from gpunode.infra.kube import KubeClient, resource_path
from gpunode.infra.kube.client import MERGE_PATCH

log = logging.getLogger(__name__)
USER_AGENT = "gpunode-extender"
RESERVATION_CHECK_S = 10.0

T = TypeVar("T")


class KubeApi:
    """The extender's API access: read a pod, annotate and bind it, list nodes (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        token_file: Path | None = None,
        ca_file: Path | None = None,
        timeout_s: float = 10.0,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """An API server address, a bearer token file (re-read when it rotates) and a CA bundle for https."""
        try:
            self.client = KubeClient.for_host(
                base_url,
                token_file=token_file,
                ca_file=ca_file,
                request_timeout_s=timeout_s,
                user_agent=USER_AGENT,
            )
        except ConfigError as exc:
            raise ConfigError(
                f"--kube-api {base_url}: {exc}", hint="check --kube-ca-file and --kube-token-file"
            ) from None
        self.timeout_s = timeout_s
        self._loop = loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the client lives on, once bound."""
        return self._loop

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the client to the loop the extender serves on (once; again with the same loop is a no-op)."""
        if self._loop is not None and self._loop is not loop:
            raise RuntimeError("this KubeApi already lives on another event loop")
        self._loop = loop

    async def close(self) -> None:
        """Close the client's connections (on its loop)."""
        self._on_this_loop()
        await self.client.close()

    # -- on the loop ---------------------------------------------------------------------------

    def _on_this_loop(self) -> None:
        running = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = running
        elif self._loop is not running:
            raise RuntimeError("KubeApi called on an event loop other than the one it lives on")

    async def read_pod_async(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as v1 JSON; None when it does not exist."""
        self._on_this_loop()
        try:
            pod = await self.client.get(Pod, name, namespace=namespace)
        except KubeNotFound:
            return None
        out = msgspec.to_builtins(pod)
        return out if isinstance(out, dict) else None

    async def bind_async(
        self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]
    ) -> None:
        """Record the GPUs chosen on the pod (an annotation), then bind it to the node."""
        self._on_this_loop()
        if gpu_uuids:
            await self.client.patch_pod_annotations(
                namespace, name, {ASSIGNMENT_ANNOTATION: ",".join(gpu_uuids)}
            )
        # A uid made up of namespace/name (the scheduler sent none) is no precondition.
        await self.client.bind_pod(namespace, name, node, uid=uid if "/" not in uid else None)

    async def list_pods_async(
        self,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """Pods (of one namespace, or all), as v1 JSON; the selectors are passed to the API server."""
        self._on_this_loop()
        pods, _ = await self.client.list_json(
            Pod, namespace=namespace, label_selector=label_selector, field_selector=field_selector
        )
        return pods

    async def label_pod_async(self, *, namespace: str, name: str, labels: Mapping[str, str | None]) -> None:
        """Set (or, with None, remove) labels of a pod with a JSON merge patch."""
        self._on_this_loop()
        await self.client.transport.request(
            "PATCH",
            f"{resource_path(Pod, namespace)}/{quote(name, safe='')}",
            body={"metadata": {"labels": dict(labels)}},
            content_type=MERGE_PATCH,
            what=f"label pod {namespace}/{name}",
        )

    async def list_nodes_async(self) -> list[dict[str, Any]]:
        """Every Node, as the v1 JSON objects the Extender's node cache reads."""
        self._on_this_loop()
        return await self.client.list_nodes()

    # -- from worker threads -----------------------------------------------------------------

    def read_pod(self, *, namespace: str, name: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        """read_pod_async, from a thread that is not the loop's (the Extender's Binder protocol); unanswered
        within timeout_s (default: the client's timeout and a second): KubeUnreachable."""
        coro = self.read_pod_async(namespace=namespace, name=name)
        limit = self.timeout_s + 1.0 if timeout_s is None else timeout_s
        return self._wait(coro, f"read pod {namespace}/{name}", limit)

    def bind(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        gpu_uuids: tuple[str, ...],
        timeout_s: float | None = None,
    ) -> None:
        """bind_async, from a thread that is not the loop's (the Extender's Binder protocol).

        Two requests, each bounded by the client's timeout; with timeout_s, both together within that
        (unanswered by then: KubeUnreachable, and the requests are abandoned).
        """
        coro = self.bind_async(namespace=namespace, name=name, uid=uid, node=node, gpu_uuids=gpu_uuids)
        limit = 2 * self.timeout_s + 1.0 if timeout_s is None else timeout_s
        self._wait(coro, f"bind pod {namespace}/{name} to {node}", limit)

    def list_nodes(self) -> list[dict[str, Any]]:
        """list_nodes_async, from a thread that is not the loop's."""
        return self._wait(self.list_nodes_async(), "list nodes", self.timeout_s + 1.0)

    def _wait(self, coro: Coroutine[Any, Any, T], what: str, timeout_s: float) -> T:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            coro.close()
            raise RuntimeError(
                f"{what}: KubeApi's synchronous methods need the client's loop running in another thread "
                "(attach() it to the serving loop, and call them from worker threads)"
            )
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KubeUnreachable(f"{what}: no answer within {timeout_s:g} s") from None


async def refresh_nodes_once(*, api: KubeApi, extender: Extender) -> bool:
    """List the nodes into the extender's node cache once; False (logged) when the API server failed."""
    try:
        nodes = await api.list_nodes_async()
    except KubeError as exc:
        log.warning("node refresh failed: %s (hint: %s)", exc, exc.hint)
        return False
    extender.refresh_nodes(nodes)
    return True


async def refresh_nodes_periodically(
    *, api: KubeApi, extender: Extender, interval_s: float, ready: asyncio.Event | None = None
) -> None:
    """Feed the extender's node cache from the API server every interval (for NodeNames mode)."""
    while True:
        await refresh_nodes_once(api=api, extender=extender)
        if ready is not None and not ready.is_set():
            ready.set()
        await asyncio.sleep(interval_s)


async def check_reservations(*, api: KubeApi, extender: Extender) -> int:
    """Release the bound pods' reservations whose pods are gone (reservations.gone_reason); returns how many.

    An API error ends the pass (logged); the reservations it did not reach wait for the next one.
    """
    released = 0
    for r in extender.reservations.bound():
        namespace, _, name = r.pod_key.partition("/")
        try:
            pod = await api.read_pod_async(namespace=namespace, name=name)
        except KubeError as exc:
            log.warning("reservation check: %s (hint: %s)", exc, exc.hint)
            break
        why = gone_reason(pod, r)
        if why is not None and extender.reservations.release(r.pod_uid, only=r):
            log.info("reservation of pod %s on node %s released: %s", r.pod_key, r.node, why)
            released += 1
    return released


async def check_reservations_periodically(
    *, api: KubeApi, extender: Extender, interval_s: float = RESERVATION_CHECK_S
) -> None:
    """check_reservations every interval, until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await check_reservations(api=api, extender=extender)
