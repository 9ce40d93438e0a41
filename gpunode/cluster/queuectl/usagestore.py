"""Saving the fair-share usage memory to a ConfigMap and loading it when a controller takes the lead.

UsageStore reads and writes the one ConfigMap (usage.json in its data) through the controller's
KubeClient: GET it; write it with an unconditional PUT (the leader is its only writer), and POST it
when it does not exist yet. UsageKeeper drives it for the controller:

- on taking the lead (start or takeover), before the first cycle, it loads the saved usage once
  (usage.decode); QueueCore puts it into the Scheduler it builds (usage.seed), decayed to now by
  the ledger itself. Usage that is refused (one warning line, gpunode_queue_usage_loads_total
  {outcome="refused"}) or absent leaves the controller to start with none;
- every `every_s` the leader saves the usage charged up to then, and once more when it stops
  (SIGTERM), before it gives up its Lease. Nothing is saved before this leadership's load is done:
  a read that failed (the API server, RBAC) is tried again at each save period instead, so a saved
  state is never overwritten by one that forgot it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import msgspec
from lightkube.resources.core_v1 import ConfigMap

from gpunode.cluster.queuectl.usage import DATA_KEY, MAX_BYTES, Outcome, decode, encode
from gpunode.errors import KubeConflict, KubeError, KubeNotFound, QueueUsageRefused
from gpunode.infra.kube import KubeClient, resource_path

if TYPE_CHECKING:
    from gpunode.cluster.queuectl.core import QueueCore
    from gpunode.cluster.queuectl.metrics import QueueMetrics

log = logging.getLogger(__name__)


class _Stored(msgspec.Struct):
    data: dict[str, str] | None = None


class UsageStore:
    """The ConfigMap holding the saved usage (each call made once; errors are KubeError)."""

    def __init__(self, client: KubeClient, namespace: str, name: str) -> None:
        self.client, self.namespace, self.name = client, namespace, name
        self._collection = resource_path(ConfigMap, namespace)
        self._path = f"{self._collection}/{quote(name, safe='')}"
        self.where = f"ConfigMap {namespace}/{name}"

    async def read(self) -> str | None:
        """The saved text; None when there is no ConfigMap. QueueUsageRefused when it holds no usage.json."""
        try:
            raw = await self.client.transport.request("GET", self._path, what=f"get {self.where}")
        except KubeNotFound:
            return None
        if len(raw) > 2 * MAX_BYTES + 65536:
            raise QueueUsageRefused(f"{self.where}: {len(raw)} bytes, far more than a saved usage takes")
        try:
            data = msgspec.json.decode(raw, type=_Stored).data or {}
        except msgspec.MsgspecError as exc:
            raise QueueUsageRefused(f"{self.where}: its data is not text: {exc}") from None
        if DATA_KEY not in data:
            raise QueueUsageRefused(f"{self.where}: no {DATA_KEY} in its data")
        return data[DATA_KEY]

    def _body(self, text: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {"app.kubernetes.io/component": "queue-usage"},
            },
            "data": {DATA_KEY: text},
        }

    async def write(self, text: str) -> None:
        """Replace the ConfigMap's content (creating it when there is none)."""
        body = self._body(text)
        try:
            await self.client.transport.request("PUT", self._path, body=body, what=f"update {self.where}")
            return
        except KubeNotFound:
            pass
        try:
            await self.client.transport.request(
                "POST", self._collection, body=body, what=f"create {self.where}"
            )
        except KubeConflict:  # created meanwhile (by an earlier leader's last save): replace it
            await self.client.transport.request("PUT", self._path, body=body, what=f"update {self.where}")


class UsageKeeper:
    """Loads the usage on taking the lead, saves it periodically and on stopping (module docstring)."""

    def __init__(
        self,
        store: UsageStore,
        core: Callable[[], QueueCore],
        metrics: QueueMetrics,
        *,
        leading: Callable[[], bool],
        clock: Callable[[], float],
        identity: str = "",
        every_s: float = 30.0,
    ) -> None:
        self.store, self._core, self.metrics = store, core, metrics
        self.leading, self.clock, self.identity = leading, clock, identity
        self.every_s = every_s
        self.loaded = False  # this leadership's load is done: loaded, absent, discarded or refused
        self._tried = False
        self._lock = asyncio.Lock()

    def lost_lead(self) -> None:
        """The lead is lost: the next leadership loads again (another leader may have saved since)."""
        self.loaded = self._tried = False

    async def on_lead(self) -> None:
        """Before a leadership's first cycle: one load (after an error the save period tries again)."""
        if not self._tried:
            self._tried = True
            await self.load()

    async def load(self) -> None:
        """Read the saved usage and hand it to the core (to be seeded into its Scheduler)."""
        async with self._lock:
            if self.loaded:
                return
            now = self.clock()
            refused: Outcome | None = None
            state = None
            try:
                text = await self.store.read()
                if text is not None:
                    state = decode(text, now, self.store.where)
            except QueueUsageRefused as exc:
                refused = Outcome("refused", f"{exc}: fair-share usage starts afresh", exc.hint)
            except KubeError as exc:
                self._count(Outcome("error", f"{exc} (tried again in {self.every_s:g} s)", exc.hint))
                return
            if not self.leading():
                return
            self.loaded = True
            if refused is not None:
                self._count(refused)
            elif state is None:
                self._count(Outcome("absent", f"no {self.store.where}: fair-share usage starts from none"))
            else:
                self._core().seed_usage(state, self.store.where)
                self.report()

    def report(self) -> None:
        """Count and log what became of saved usage the core has put into its Scheduler, if any."""
        out = self._core().take_seeded()
        if out is not None:
            self._count(out)

    def _count(self, out: Outcome) -> None:
        self.metrics.usage_loads.labels(out.outcome).inc()
        if out.outcome in ("refused", "error"):
            log.warning("queue usage not loaded: %s (hint: %s)", out.message, out.hint)
        else:
            log.info("queue usage: %s", out.message)

    async def save(self) -> bool:
        """Save the usage charged up to now, when leading and loaded; True when written."""
        if not self.loaded or not self.leading():
            return False
        state = self._core().usage_state(self.clock(), self.identity)
        if state is None:
            return False
        text = encode(state).decode()
        if len(text) > MAX_BYTES:
            self.metrics.usage_saves.labels("error").inc()
            log.warning(
                "queue usage not saved: %d bytes, more than the %d a saved usage may take (hint: fewer "
                "queues or per-model quotas)",
                len(text),
                MAX_BYTES,
            )
            return False
        try:
            await self.store.write(text)
        except KubeError as exc:
            self.metrics.usage_saves.labels("error").inc()
            log.warning("queue usage not saved to %s: %s (hint: %s)", self.store.where, exc, exc.hint)
            return False
        self.metrics.usage_saves.labels("saved").inc()
        return True

    async def run(self) -> None:
        """Every `every_s`: save (or, while this leadership's load failed, load again)."""
        while True:
            await asyncio.sleep(self.every_s)
            if not self.leading():
                continue
            if not self.loaded:
                if self._tried:
                    await self.load()
                continue
            await self.save()

    async def final_save(self) -> None:
        """On stopping: save once more if leading, within the client's request timeout."""
        try:
            async with asyncio.timeout(self.store.client.request_timeout_s + 1.0):
                await self.save()
        except TimeoutError:
            log.warning("queue usage not saved on stopping: the API server did not answer in time")
