"""Publishes the node's GPU state as the `gpunode.io/gpu-state` annotation on its Node.

The extender reads the annotation to see, per GPU, what is assigned, how it is
shared, whether it is healthy, and how GPUs are connected. Assignment comes
from the kubelet (pod-resources List: the source of truth for which container
holds which device ID), plus the devices an Allocate just handed out until the
kubelet lists them; capacity and health from DeviceState. The agent publishes
on change, debounced (DEBOUNCE_S): of the device state, after every Allocate
(note_allocation), and of what pod-resources lists (read every HOLDERS_POLL_S),
so the cluster sees an allocation within about a second; and at least every
interval, with one PATCH of its own Node's annotations (RBAC: `patch` on `nodes`). A failing API server is retried
with backoff and never blocks anything else. This module builds and sends the
annotation; the schema itself lives in gpunode.contract.nodestate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace

from gpunode.contract.nodestate import ANNOTATION_KEY, NodeGpuState, encode
from gpunode.errors import GpunodeError
from gpunode.node.allocation.accounting import gpu_records
from gpunode.node.state import DeviceState, Snapshot

log = logging.getLogger(__name__)

DEBOUNCE_S = 0.2  # how long a burst of changes may settle before one PATCH
HOLDERS_POLL_S = 0.5  # how often pod-resources is read for changes between publications
FRESH_TTL_S = 30.0  # how long an allocated device counts held while the kubelet does not list it


def node_gpu_state(
    snapshot: Snapshot,
    *,
    node: str,
    holders: Mapping[str, str],
    generation: int = 0,
    updated: float = 0.0,
    explicit: Mapping[tuple[str, str], int] | None = None,
) -> NodeGpuState:
    """The annotation content: per GPU capacity, assignment (device ID -> "namespace/pod"), health, topology.

    The per-GPU accounting is gpunode.node.allocation.accounting's, the same the node's
    GetPreferredAllocation decides on.
    """
    return NodeGpuState(
        node=node, updated=updated, generation=generation, gpus=gpu_records(snapshot, holders, explicit)
    )


class NodeStatePublisher:
    """Keeps the Node's annotation equal to the agent's view, on change and every interval."""

    def __init__(
        self,
        *,
        state: DeviceState,
        node_name: str,
        patch: Callable[[str, Mapping[str, str | None]], Awaitable[None]],
        read_holders: Callable[[], object],
        interval_s: float = 60.0,
        debounce_s: float = DEBOUNCE_S,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 60.0,
        holders_poll_s: float = HOLDERS_POLL_S,
        fresh_ttl_s: float = FRESH_TTL_S,
    ) -> None:
        self.state = state
        self.node_name = node_name
        self._patch = patch
        self._read_holders = read_holders
        self.interval_s = interval_s
        self.debounce_s = debounce_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.generation = 0
        self.published: NodeGpuState | None = None
        self.failures = 0
        self._holders: dict[str, str] = {}
        self._holders_error: str | None = None
        self.holders_poll_s = holders_poll_s
        self.fresh_ttl_s = fresh_ttl_s
        self._fresh: dict[
            str, tuple[str, float]
        ] = {}  # device ID -> (holder, until): allocated, not yet listed
        self._poked = asyncio.Event()
        # (pod, GPU UUID) -> the compute share given to pods that asked for one (gpunode.node.allocation.shares)
        self.explicit_shares: Callable[[], Mapping[tuple[str, str], int]] | None = None

    def note_allocation(self, device_ids: Sequence[str], holder: str) -> None:
        """An Allocate handed out these devices (to "namespace/pod", or "" when unknown): count them held
        until pod-resources lists them (at most fresh_ttl_s), and publish after the debounce."""
        until = time.monotonic() + self.fresh_ttl_s
        for dev in device_ids:
            self._fresh[dev] = (holder, until)
        self._poked.set()

    def poke(self) -> None:
        """Something the annotation shows changed (a compute share): publish after the debounce."""
        self._poked.set()

    async def _refresh_holders(self) -> None:
        try:
            result = self._read_holders()
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                result = await result
            if isinstance(result, Mapping):
                self._holders = {str(k): str(v) for k, v in result.items()}
                now = time.monotonic()
                self._fresh = {d: v for d, v in self._fresh.items() if d not in self._holders and v[1] > now}
            self._holders_error = None
        except GpunodeError as exc:
            if str(exc) != self._holders_error:  # said once per problem, not at every poll
                log.warning(
                    "node state: cannot read assignments from the kubelet, using the last known: %s", exc
                )
            self._holders_error = str(exc)

    def current(self) -> NodeGpuState:
        """The node GPU state to publish, from the current snapshot."""
        now = time.monotonic()
        fresh = {d: holder for d, (holder, until) in self._fresh.items() if until > now}
        holders = {**fresh, **self._holders}
        explicit = self.explicit_shares() if self.explicit_shares is not None else None
        return node_gpu_state(self.state.snapshot(), node=self.node_name, holders=holders, explicit=explicit)

    async def publish_once(self, *, force: bool = False) -> bool:
        """Publish if the content changed (or force); returns whether a PATCH was sent successfully."""
        await self._refresh_holders()
        content = self.current()  # generation 0, updated 0: only what the annotation says
        changed = self.published is None or content != replace(self.published, generation=0, updated=0.0)
        if not changed and not force:
            return False
        generation = self.generation + 1 if changed else self.generation
        doc = replace(content, generation=generation, updated=time.time())
        await self._patch(self.node_name, {ANNOTATION_KEY: encode(doc)})
        self.generation = generation
        self.published = doc
        return True

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Publish on change (device state, an allocation, pod-resources) and periodically, retrying with
        backoff on failure, until cancelled."""
        version = -1
        delay = self.retry_initial_s
        next_refresh = 0.0
        loop = asyncio.get_running_loop()
        while True:
            force = loop.time() >= next_refresh
            failing = False
            self._poked.clear()  # an allocation noted from here on is published next time round
            try:
                sent = await self.publish_once(force=force)
                if sent:
                    log.debug("published %s generation %d", ANNOTATION_KEY, self.generation)
                if force:
                    next_refresh = loop.time() + self.interval_s
                delay = self.retry_initial_s
                wait_s = max(0.0, min(next_refresh - loop.time(), self.holders_poll_s))
            except GpunodeError as exc:
                self.failures += 1
                failing = True
                log.warning("node state: publishing failed (retry in %.0fs): %s", delay, exc)
                wait_s, delay = delay, min(delay * 2, self.retry_max_s)
            if ready is not None and not ready.is_set():
                ready.set()
            if await self._wait(version, wait_s, pokes=not failing):
                await asyncio.sleep(self.debounce_s)  # let a burst of changes settle
                version = self.state.snapshot().version

    async def _wait(self, version: int, wait_s: float, *, pokes: bool) -> bool:
        """Until the device state moves past `version`, an allocation is noted (with pokes) or wait_s
        passes; whether something happened. (asyncio.wait: Python 3.11's wait_for can swallow a
        cancellation.)"""
        waits: set[asyncio.Future[object]] = {asyncio.ensure_future(self.state.wait_for_change(version))}
        if pokes:
            waits.add(asyncio.ensure_future(self._poked.wait()))
        try:
            done, _ = await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return bool(done)
