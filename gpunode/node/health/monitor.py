"""HealthMonitor: turns backend events and periodic probes into device health and remediation.

Two inputs feed one HealthTracker under a lock: `handle_event` (called by the
agent's event pump, from any thread, for XID / ECC / lost-GPU events) and the
probe loop in `run` (every probe interval, each GPU probed in a daemon thread
of its own, with a timeout: a driver call that hangs counts as a failed probe,
is not stacked up, and cannot keep the agent from exiting). After each input the verdict is recomputed and
published as a level through `DeviceState.set_unhealthy("health", ...)`, which
re-sends ListAndWatch at once; devices that just turned unhealthy are handed
to the remediator as Faults (non-blocking). This module never evicts, kills or
calls the API server itself, and never blocks the event loop on the backend.

With a HoldStore (the agent's state directory), the targets a fatal XID holds
are saved whenever that set changes and put back when the monitor is built, so
they are Unhealthy before the device plugins first answer; operators' clear
requests are applied at the start of each probe round.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from gpunode.config.health import HealthConfig
from gpunode.errors import DeviceNotFound, GpunodeError, HealthStateError
from gpunode.node.devices.base import Backend, DeviceEvent, EventKind, GpuProbe
from gpunode.node.health.evidence import HealthTracker, Verdict
from gpunode.node.health.holds import ClearRequest, HoldStore
from gpunode.node.health.model import Fault, HealthCounters, Remediator
from gpunode.node.state import DeviceState

log = logging.getLogger("gpunode.node.health")

SOURCE = "health"  # the DeviceState health source this monitor owns


class HealthMonitor:
    """Detects faults on every GPU and MIG instance of a node and publishes their health as a level."""

    def __init__(
        self,
        *,
        backend: Backend,
        state: DeviceState,
        config: HealthConfig,
        remediator: Remediator | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        store: HoldStore | None = None,
    ) -> None:
        self.backend = backend
        self.state = state
        self.config = config
        self.remediator = remediator
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._tracker = HealthTracker(config)
        self._topology: tuple[Any, ...] | None = None
        self._unhealthy: dict[str, Verdict] = {}
        self._inflight: dict[str, concurrent.futures.Future[GpuProbe]] = {}
        # counters for the metrics
        self._xids: Counter[tuple[str, int]] = Counter()
        self._sbe: Counter[str] = Counter()
        self._dbe: Counter[str] = Counter()
        self._lost: Counter[str] = Counter()
        self._probe_failures: Counter[str] = Counter()
        self._probes = 0
        self._became_unhealthy: Counter[str] = Counter()
        self._recovered: Counter[str] = Counter()
        self.store = store
        self._saved_holds: frozenset[str] = frozenset()
        self._notes: dict[str, tuple[str, str]] = {}  # target -> (Event reason, message) for its recovery
        if store is not None and config.enabled:
            self._restore(store)

    def _restore(self, store: HoldStore) -> None:
        held = store.load()
        if not held:
            return
        log.warning(
            "health: %d fault(s) held when the agent last ran are held again until a reset or a clear: %s",
            len(held),
            "; ".join(f"{h.target_uuid}: {h.reason}" for h in held),
        )
        with self._lock:
            self._saved_holds = frozenset(h.target_uuid for h in held)
            self._tracker.restore(held, self._clock())
            self._publish_locked()

    # -- inputs ---------------------------------------------------------------------------------

    def handle_event(self, event: DeviceEvent) -> None:
        """Record one backend event and republish health. Thread-safe; returns quickly."""
        with self._lock:
            gpu = event.gpu_uuid or "unknown"
            if event.kind == EventKind.XID and event.xid is not None:
                self._xids[(gpu, event.xid)] += 1
            elif event.kind == EventKind.ECC_SBE:
                self._sbe[gpu] += event.count
            elif event.kind == EventKind.ECC_DBE:
                self._dbe[gpu] += event.count
            elif event.kind == EventKind.GPU_LOST:
                self._lost[gpu] += 1
            if not self.config.enabled:
                return
            self._refresh_topology()  # MIG attribution needs the current GPUs
            self._tracker.record_event(event, self._clock())
            self._publish_locked()

    def _apply_clear(self, request: ClearRequest) -> None:
        with self._lock:
            self._refresh_topology()
            cleared = self._tracker.clear(request.uuid)
            if not cleared:
                log.warning(
                    "health: %s asked to clear %s (%s), which is not unhealthy",
                    request.by,
                    request.uuid,
                    request.reason,
                )
                return
            for target in cleared:
                log.warning(
                    "health: %s cleared by %s: %s (it was unhealthy: %s)",
                    target,
                    request.by,
                    request.reason,
                    self._unhealthy[target].reason if target in self._unhealthy else "a fault",
                )
                self._notes[target] = ("GpuHealthCleared", f"cleared by {request.by}: {request.reason}")
            self._publish_locked()

    async def probe_once(self) -> None:
        """Probe every advertised GPU once (in parallel, each bounded by the probe timeout) and republish.

        Operators' clear requests waiting in the store are applied first.
        """
        if self.store is not None:
            self.store.take_clears(self._apply_clear)
        gpus = [g.uuid for g in self.state.snapshot().inventory.gpus]
        timeout_s = self.config.probe_timeout_s
        waits: dict[str, asyncio.Future[GpuProbe]] = {}
        hung: list[str] = []
        for uuid in gpus:
            previous = self._inflight.get(uuid)
            if previous is not None and not previous.done():
                hung.append(uuid)  # the last call still hangs: do not stack another one on it
                continue
            fut = self._start_probe(uuid)
            self._inflight[uuid] = fut
            waits[uuid] = asyncio.wrap_future(fut)
        if waits:
            await asyncio.wait(waits.values(), timeout=timeout_s)
        now = self._clock()
        with self._lock:
            self._refresh_topology()
            for uuid in hung:
                self._probes += 1
                self._probe_failures[uuid] += 1
                self._tracker.record_probe_failure(uuid, "the previous probe still has not answered", now)
            for uuid, waiter in waits.items():
                self._probes += 1
                if not waiter.done():
                    self._probe_failures[uuid] += 1
                    detail = f"no answer within {timeout_s:g} s (the driver call hangs)"
                    self._tracker.record_probe_failure(uuid, detail, now)
                    continue
                exc = waiter.exception()
                if isinstance(exc, DeviceNotFound):
                    continue  # gone from the node: rediscovery lists its devices as vanished
                if exc is not None:
                    self._probe_failures[uuid] += 1
                    text = str(exc) if isinstance(exc, GpunodeError) else f"{type(exc).__name__}: {exc}"
                    self._tracker.record_probe_failure(uuid, text, now)
                    continue
                probe = waiter.result()
                if not probe.reachable:
                    self._probe_failures[uuid] += 1
                self._tracker.record_probe(probe, now)
            self._publish_locked()

    def evaluate(self) -> Mapping[str, str]:
        """Recompute the verdict now (recoveries are time-based) and publish it; returns UUID -> reason."""
        with self._lock:
            self._publish_locked()
            return {u: v.reason for u, v in self._unhealthy.items()}

    # -- the long-running part --------------------------------------------------------------------

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Probe every GPU each probe interval and keep health published, until cancelled."""
        if not self.config.enabled:
            log.info("health checks are disabled (gpunode.health.enabled: false)")
            self.state.set_unhealthy(SOURCE, {})
            if ready is not None:
                ready.set()
            return
        while True:
            started = self._clock()
            await self.probe_once()
            if ready is not None and not ready.is_set():
                ready.set()
            left = self.config.probe_interval_s - (self._clock() - started)
            await asyncio.sleep(max(left, 0.0))

    # -- outputs ----------------------------------------------------------------------------------

    @property
    def unhealthy(self) -> Mapping[str, str]:
        """GPU/MIG UUID -> reason, as last published."""
        with self._lock:
            return {u: v.reason for u, v in self._unhealthy.items()}

    def verdicts(self) -> dict[str, Verdict]:
        """GPU/MIG UUID -> its Verdict (kind, XID, reason), as last published (for the DRA device taints)."""
        with self._lock:
            return dict(self._unhealthy)

    def counters(self) -> HealthCounters:
        """The cumulative event, probe and transition counts and the current verdict, for the metrics."""
        with self._lock:
            return HealthCounters(
                xid_total=dict(self._xids),
                ecc_sbe_events=dict(self._sbe),
                ecc_dbe_events=dict(self._dbe),
                gpu_lost_events=dict(self._lost),
                probe_failures=dict(self._probe_failures),
                probes=self._probes,
                became_unhealthy=dict(self._became_unhealthy),
                recovered=dict(self._recovered),
                unhealthy={u: v.reason for u, v in self._unhealthy.items()},
            )

    # -- internals ----------------------------------------------------------------------------------

    def _start_probe(self, uuid: str) -> concurrent.futures.Future[GpuProbe]:
        """Probe in a daemon thread of its own: a driver call that never returns must not keep the
        agent from exiting (a pool's worker threads are joined at exit)."""
        fut: concurrent.futures.Future[GpuProbe] = concurrent.futures.Future()
        fut.add_done_callback(_retrieve)

        def probe() -> None:
            try:
                fut.set_result(self.backend.probe(uuid))
            except BaseException as exc:
                fut.set_exception(exc)

        fut.set_running_or_notify_cancel()
        threading.Thread(target=probe, name=f"gpunode-probe-{uuid[:12]}", daemon=True).start()
        return fut

    # (the methods below are called with self._lock held)

    def _refresh_topology(self) -> None:
        gpus = self.state.snapshot().inventory.gpus
        if gpus is not self._topology:
            if self._topology is not None:
                gone = {g.uuid for g in self._topology} - {g.uuid for g in gpus}
                self._tracker.forget(gone)
            self._topology = gpus
            self._tracker.set_topology(gpus)

    def _publish_locked(self) -> None:
        self._refresh_topology()
        verdicts = self._tracker.evaluate(self._clock())
        for target, why in self._tracker.released:
            log.warning("health: the hold on %s is released: %s", target, why)
            self._notes[target] = ("GpuHealthy", f"{why}; its probes then passed for the recovery window")
        self._tracker.released.clear()
        before = self._unhealthy
        self._unhealthy = verdicts
        new = [v for u, v in verdicts.items() if u not in before]
        gone = [u for u in before if u not in verdicts]
        self.state.set_unhealthy(SOURCE, {u: v.reason for u, v in verdicts.items()})
        for v in new:
            self._became_unhealthy[v.target_uuid] += 1
            log.warning("%s is unhealthy: %s", _name(v.target_uuid, v.gpu_uuid), v.reason)
        note_recovery = getattr(self.remediator, "note_recovery", None)
        for u in gone:
            self._recovered[u] += 1
            note = self._notes.pop(u, None)
            if note is not None and note[0] == "GpuHealthCleared":
                log.info("%s is healthy again: %s", u, note[1])
            else:
                log.info("%s is healthy again: its probes passed for %g s", u, self.config.recovery_window_s)
            if note is not None and note_recovery is not None:
                note_recovery(u, *note)
        self._save_holds_locked()
        if self.remediator is not None and (new or gone):
            faults = [self._fault(v) for v in new]
            self.remediator.notify({u: v.reason for u, v in verdicts.items()}, faults)

    def _save_holds_locked(self) -> None:
        if self.store is None:
            return
        holds = self._tracker.holds()
        if frozenset(holds) == self._saved_holds:
            return
        try:
            self.store.save(holds.values())
        except HealthStateError as exc:
            log.error("health: %s (hint: %s); the holds stay in effect until the agent stops", exc, exc.hint)
            return
        self._saved_holds = frozenset(holds)

    def _fault(self, v: Verdict) -> Fault:
        inventory = self.state.snapshot().inventory
        if v.mig_uuid is not None:
            ids = tuple(d.id for d in inventory.devices if d.mig_uuid == v.mig_uuid)
        else:
            ids = tuple(d.id for d in inventory.devices if d.gpu_uuid == v.gpu_uuid)
        return Fault(
            target_uuid=v.target_uuid,
            gpu_uuid=v.gpu_uuid,
            mig_uuid=v.mig_uuid,
            kind=v.kind,
            reason=v.reason,
            xid=v.xid,
            device_ids=ids,
            detected_at=self._wall_clock(),
        )


def _name(target: str, gpu: str) -> str:
    return f"MIG device {target} of GPU {gpu}" if target != gpu else f"GPU {gpu}"


def _retrieve(fut: concurrent.futures.Future[GpuProbe]) -> None:
    """Consume a probe's exception so a late failure of a timed-out probe is not reported as unhandled."""
    if not fut.cancelled():
        fut.exception()
