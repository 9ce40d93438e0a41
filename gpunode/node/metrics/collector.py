"""The background collector: reads the node at a fixed interval, off the scrape path.

A collection asks the agent's providers for the inventory and the health of
each device, the kubelet (through PodAttribution, cached) for which container
holds which device, then reads the backend and the memory-cap regions in one
worker thread, and leaves a frozen NodeSnapshot with its rendered exposition
behind. A scrape only concatenates that with the agent's own metrics: it never
calls the backend and never waits for a collection.

A value that could not be read is omitted, never carried over or invented;
when collections stop succeeding for longer than `stale_after_s`, the device
series disappear altogether and only the agent's own metrics remain, which say
how old the last good collection is.

A node that is a DRA driver also has the regions of its prepared claims, under
`<stateDir>/dra/memcap`, and the records of those claims (gpunode.node.dra.checkpoint):
the kubelet lists which container uses which claim's devices, so a whole GPU or
MIG instance held by a claim, and a claim's share of a GPU, are charged to the
claim and its pod.

XID events arrive from the agent's event fan-out through `record_event`, from
any thread. This module does not serve HTTP (server.py does) and does not
decide health (the health provider does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest

from gpunode.config.metrics import MetricsConfig
from gpunode.errors import BackendError, DeviceNotFound, GpuLostError, GpunodeError, KubeError
from gpunode.node.devices.base import Backend, DeviceEvent, EventKind, Gpu, GpuSample
from gpunode.node.inventory import Inventory
from gpunode.node.metrics.own import OwnMetrics
from gpunode.node.metrics.regions import ComputeHistory, read_regions
from gpunode.node.metrics.render import XidState, render_body
from gpunode.node.metrics.snapshot import (
    ClaimDeviceUse,
    EntityKey,
    LabelStyle,
    NodeSnapshot,
    build_snapshot,
    claim_device_uses,
)

if TYPE_CHECKING:
    from gpunode.node.dra.claims import ClaimPlan
    from gpunode.node.kubelet.podresources import AttributionSnapshot, PodAttribution

log = logging.getLogger(__name__)

InventoryProvider = Callable[[], Inventory | None]
HealthProvider = Callable[[], Mapping[str, str]]  # device ID -> reason, for the unhealthy ones only


class MetricsCollector:
    """Collects the node's telemetry in the background and renders it for scrapes.

    Dependencies are keyword-only: the backend; an inventory provider (the
    advertised devices now, or None before the first discovery); a health
    provider (device ID -> reason for the unhealthy ones); a PodAttribution
    (None: no pod labels); the root of the memory-cap regions (None: no
    per-container memory); the section's config; the node's name for the
    Hostname label; and, on a DRA node, the driver's name and the DRA plugin's
    state directory (`<stateDir>/dra`, holding the claims' regions and records).
    """

    def __init__(
        self,
        *,
        backend: Backend,
        hostname: str,
        config: MetricsConfig | None = None,
        inventory: InventoryProvider | None = None,
        health: HealthProvider | None = None,
        attribution: PodAttribution | None = None,
        regions_root: Path | None = None,
        dra_driver: str | None = None,
        dra_root: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config or MetricsConfig()
        self._backend = backend
        self._inventory = inventory
        self._health = health
        self._attribution = attribution if self.config.pod_labels else None
        self._regions_root = regions_root
        self._dra_driver = dra_driver if dra_root is not None else None
        self._dra_root = dra_root
        self._clock = clock
        # The Hostname label is never empty: the configured value, else the node name, else the host's name.
        self.hostname = self.config.hostname or hostname or socket.gethostname()
        self.interval_s = self.config.interval_s
        self.stale_after_s = max(3 * self.interval_s, 30.0)

        self.registry = CollectorRegistry(auto_describe=False)
        self._own = OwnMetrics(self.registry)
        self._own.sample_age.set_function(self._sample_age_s)
        self._own.attribution_age.set_function(self._attribution_age_s)

        self._collect_lock = threading.Lock()  # one collection at a time touches the state below
        self._lock = threading.Lock()  # guards the XID state and the rendered body
        self._snapshot: NodeSnapshot | None = None
        self._last_success_s: float | None = None
        self._last_error: str | None = None
        self._seq = 0
        self._driver_version: str | None = None
        self._prev_samples: dict[str, GpuSample] = {}
        self._compute = ComputeHistory()
        self._last_sample_times: dict[str, float] = {}
        self._known_pairs: dict[EntityKey, tuple[tuple[str, str], ...]] = {}
        self._xid_last: dict[EntityKey, int] = {}
        self._xid_counts: dict[tuple[EntityKey, int], int] = {}
        self._xid_unknown: dict[int, int] = {}
        self._xid_version = 0
        self._body: tuple[tuple[int, int], bytes] | None = None
        self._attribution_error: str | None = None

    # -- the loop --------------------------------------------------------------------------

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Collect every interval until cancelled; `ready` is set after the first attempt."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.collect_once()
            except GpunodeError as err:
                log.warning("metrics collection failed: %s", err)
            except Exception:
                log.exception("metrics collection failed unexpectedly")
            if ready is not None and not ready.is_set():
                ready.set()
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    async def collect_once(self) -> NodeSnapshot:
        """One collection; raises BackendError when the GPUs could not even be listed."""
        attribution = await self._read_attribution()
        inventory = self._call_provider("inventory", self._inventory)
        health = self._call_provider("health", self._health)
        unhealthy = {str(k): str(v) for k, v in health.items()} if isinstance(health, Mapping) else {}
        return await _in_daemon_thread(
            lambda: self._collect_blocking(
                inventory if isinstance(inventory, Inventory) else None, unhealthy, attribution
            )
        )

    # -- inputs from the agent --------------------------------------------------------------

    def record_event(self, event: DeviceEvent) -> None:
        """Take one device event from the agent's fan-out (thread safe); XIDs update the XID series."""
        self._own.event_counts.labels(kind=event.kind.value).inc()
        if event.kind is not EventKind.XID or event.xid is None:
            return
        code = event.xid
        with self._lock:
            if event.gpu_uuid is None:
                self._xid_unknown[code] = self._xid_unknown.get(code, 0) + 1
            else:
                key: EntityKey = (event.gpu_uuid, event.mig_uuid)
                self._xid_counts[(key, code)] = self._xid_counts.get((key, code), 0) + 1
                self._xid_last[key] = code
                if event.mig_uuid is not None:
                    self._xid_last[(event.gpu_uuid, None)] = code
            self._xid_version += 1

    @property
    def snapshot(self) -> NodeSnapshot | None:
        """The last successful collection, however old; None before the first one."""
        return self._snapshot

    @property
    def backend_name(self) -> str:
        """The backend the agent reads its GPUs from: `nvml`, or `sim:<profile>` (for /agent)."""
        return str(getattr(self._backend, "name", "unknown"))

    # -- what a scrape gets -----------------------------------------------------------------

    def render(self) -> bytes:
        """The exposition for one scrape: the last snapshot's series plus the agent's own metrics."""
        snap = self._snapshot
        body = b""
        if snap is not None and not self._is_stale():
            body = self._body_for(snap)
        return body + generate_latest(self.registry)

    def health_status(self) -> tuple[bool, str]:
        """(healthy, one line) for the /health endpoint."""
        if self._last_success_s is None:
            why = f": {self._last_error}" if self._last_error else ""
            return False, f"no successful collection yet{why}"
        age_s = self._clock() - self._last_success_s
        if age_s > self.stale_after_s:
            why = f"; last error: {self._last_error}" if self._last_error else ""
            return (
                False,
                f"last successful collection {age_s:.0f}s ago (stale after {self.stale_after_s:.0f}s){why}",
            )
        return True, f"last successful collection {age_s:.1f}s ago"

    # -- internals --------------------------------------------------------------------------

    def _is_stale(self) -> bool:
        return self._last_success_s is None or self._clock() - self._last_success_s > self.stale_after_s

    def _sample_age_s(self) -> float:
        return math.nan if self._last_success_s is None else max(0.0, self._clock() - self._last_success_s)

    def _attribution_age_s(self) -> float:
        last = self._attribution.last if self._attribution is not None else None
        return math.nan if last is None else max(0.0, self._clock() - last.fetched_at_s)

    def _call_provider(self, what: str, provider: Callable[[], object] | None) -> object:
        if provider is None:
            return None
        try:
            return provider()
        except GpunodeError as err:
            log.warning("metrics: the %s provider failed: %s", what, err)
            return None

    async def _read_attribution(self) -> AttributionSnapshot | None:
        if self._attribution is None:
            return None
        try:
            snapshot = await self._attribution.snapshot()
        except KubeError as err:
            self._own.attribution_errors.inc()
            if str(err) != self._attribution_error:  # once per streak, not every collection
                log.warning("metrics: pod attribution unavailable, using the last answer: %s", err)
            self._attribution_error = str(err)
            return self._attribution.last
        if self._attribution_error is not None:
            log.info("metrics: pod attribution is back")
            self._attribution_error = None
        return snapshot

    def _body_for(self, snap: NodeSnapshot) -> bytes:
        with self._lock:
            key = (snap.seq, self._xid_version)
            if self._body is not None and self._body[0] == key:
                return self._body[1]
            xid = self._xid_state()
        body = render_body(snap, xid, hostname_label=self.config.hostname_label, hostname=self.hostname)
        with self._lock:
            if self._body is None or self._body[0] <= key:
                self._body = (key, body)
        return body

    def _xid_state(self) -> XidState:
        """A copy of the XID state; call with self._lock held."""
        return XidState(
            last=dict(self._xid_last),
            counts=dict(self._xid_counts),
            unknown_device=dict(self._xid_unknown),
            base_pairs=dict(self._known_pairs),
        )

    def _count_backend_error(self, call: str, err: GpunodeError) -> None:
        kind = (
            "gpu_lost"
            if isinstance(err, GpuLostError)
            else "not_found"
            if isinstance(err, DeviceNotFound)
            else "error"
        )
        self._own.backend_errors.labels(call=call, error=kind).inc()

    def _collect_blocking(
        self,
        inventory: Inventory | None,
        unhealthy: Mapping[str, str],
        attribution: AttributionSnapshot | None,
    ) -> NodeSnapshot:
        try:
            with self._collect_lock:
                return self._collect(inventory, unhealthy, attribution)
        except Exception as err:
            self._own.collections.labels(result="failed").inc()
            self._last_error = str(err) if isinstance(err, GpunodeError) else f"{type(err).__name__}: {err}"
            raise

    def _collect(
        self,
        inventory: Inventory | None,
        unhealthy: Mapping[str, str],
        attribution: AttributionSnapshot | None,
    ) -> NodeSnapshot:
        started = time.perf_counter()
        try:
            gpus = self._backend.gpus()
        except BackendError as err:
            self._count_backend_error("gpus", err)
            raise
        samples, failed = self._read_samples(gpus)
        regions = read_regions(self._regions_root, self._own.region_errors, self._own.bad_regions)
        claims: tuple[ClaimDeviceUse, ...] = ()
        if self._dra_root is not None:
            regions += read_regions(self._dra_root / "memcap", self._own.region_errors)
            claims = claim_device_uses(attribution, self._dra_driver, self._claim_plans())
        now = self._clock()
        for uuid, s in samples.items():
            self._last_sample_times[uuid] = s.timestamp
        self._seq += 1
        snap = build_snapshot(
            seq=self._seq,
            collected_at_s=now,
            gpus=gpus,
            samples=samples,
            previous_samples=self._prev_samples,
            last_sample_times=self._last_sample_times,
            style=LabelStyle(self.hostname, self.config.hostname_label, self._read_driver_version()),
            inventory=inventory,
            unhealthy=unhealthy,
            attribution=attribution,
            regions=[(r.key, r.device_uuid, r.used_bytes, r.limit_bytes) for r in regions],
            compute=self._compute.update(now, regions),
            claims=claims,
        )
        # Rates need the previous sample of the same GPU; a GPU that failed loses its rate once.
        self._prev_samples = dict(samples)
        with self._lock:
            for e in snap.entities:
                self._known_pairs[e.key] = e.base_pairs
        self._snapshot = snap
        self._last_success_s = now
        self._own.last_success.set(now)
        self._body_for(snap)  # render here, in the worker, so that scrapes find it ready
        self._own.collections.labels(result="partial" if failed else "ok").inc()
        self._last_error = f"{failed} GPU(s) could not be read" if failed else None
        self._own.duration.observe(time.perf_counter() - started)
        return snap

    def _claim_plans(self) -> dict[str, ClaimPlan]:
        """The plans of the DRA claims prepared on this node, by claim UID (from the plugin's records)."""
        from gpunode.node.dra.checkpoint import PREPARED, ClaimCheckpoint

        assert self._dra_root is not None
        records = ClaimCheckpoint(self._dra_root / "claims")
        plans: dict[str, ClaimPlan] = {}
        for uid in records.uids():
            try:
                record = records.load(uid)
            except (ValueError, OSError):  # the plugin reports and removes a damaged record itself
                continue
            if record is not None and record.state == PREPARED:
                plans[uid] = record.plan
        return plans

    def _read_samples(self, gpus: tuple[Gpu, ...]) -> tuple[dict[str, GpuSample], int]:
        samples: dict[str, GpuSample] = {}
        failed = 0
        for g in gpus:
            try:
                samples[g.uuid] = self._backend.sample(g.uuid)
            except BackendError as err:  # GpuLostError included: its values are simply absent
                failed += 1
                self._count_backend_error("sample", err)
            except DeviceNotFound as err:  # removed between gpus() and sample()
                failed += 1
                self._count_backend_error("sample", err)
        return samples, failed

    def _read_driver_version(self) -> str | None:
        if self._driver_version is None:
            try:
                self._driver_version = self._backend.driver_version()
            except BackendError as err:
                self._count_backend_error("driver_version", err)
        return self._driver_version


async def _in_daemon_thread(work: Callable[[], NodeSnapshot]) -> NodeSnapshot:
    """Run blocking backend work in a daemon thread of its own.

    Not a thread pool: a driver call that never returns must neither hold up
    the agent's exit (pool workers are joined at interpreter exit) nor starve
    the pool the rest of the agent uses for asyncio.to_thread.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[NodeSnapshot] = loop.create_future()

    def deliver(result: NodeSnapshot | None, error: BaseException | None) -> None:
        if future.done():  # the awaiting task was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            assert result is not None
            future.set_result(result)

    def body() -> None:
        result: NodeSnapshot | None = None
        error: BaseException | None = None
        try:
            result = work()
        except BaseException as err:  # handed to the awaiting task, which decides
            error = err
        with contextlib.suppress(RuntimeError):  # the loop closed while the driver call hung
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=body, name="gpunode-metrics-collect", daemon=True).start()
    return await future
