"""The extender's calls to the Kubernetes API server: annotate a pod with its GPUs, bind it, list nodes.

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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from gpunode.cluster.extender.core import Extender
from gpunode.contract.names import ASSIGNMENT_ANNOTATION
from gpunode.errors import ConfigError, KubeError, KubeUnreachable
from gpunode.infra.kube import KubeClient

log = logging.getLogger(__name__)
USER_AGENT = "gpunode-extender"

T = TypeVar("T")


class KubeApi:
    """The extender's API access: annotate a pod with its GPUs, bind it, list nodes (see the module docstring)."""

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

    async def list_nodes_async(self) -> list[dict[str, Any]]:
        """Every Node, as the v1 JSON objects the Extender's node cache reads."""
        self._on_this_loop()
        return await self.client.list_nodes()

    # -- from worker threads -----------------------------------------------------------------

    def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
        """bind_async, from a thread that is not the loop's (the Extender's Binder protocol)."""
        coro = self.bind_async(namespace=namespace, name=name, uid=uid, node=node, gpu_uuids=gpu_uuids)
        # Two requests, each bounded by the client's timeout.
        self._wait(coro, f"bind pod {namespace}/{name} to {node}", 2 * self.timeout_s + 1.0)

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


async def refresh_nodes_periodically(
    *, api: KubeApi, extender: Extender, interval_s: float, ready: asyncio.Event | None = None
) -> None:
    """Feed the extender's node cache from the API server every interval (for NodeNames mode)."""
    while True:
        try:
            nodes = await api.list_nodes_async()
            extender.refresh_nodes(nodes)
        except KubeError as exc:
            log.warning("node refresh failed: %s (hint: %s)", exc, exc.hint)
        if ready is not None and not ready.is_set():
            ready.set()
        await asyncio.sleep(interval_s)
