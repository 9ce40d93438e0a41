"""The node agent's composition root: builds the parts and runs them in one asyncio TaskGroup.

Start-up order matters: the backend is opened and the inventory built (and the
whole configuration validated) before any socket is created, so a bad config
or a missing driver stops the agent with one clear message and nothing
half-started. Then the device plugins, the topology watch (hot-plug), the event
pump, and the optional parts run side by side until SIGTERM/SIGINT; SIGHUP
reloads the configuration and re-advertises. This module wires; it holds no
policy of its own.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpunode.config.agent import Config
from gpunode.errors import BackendUnavailable, ConfigError, GpunodeError
from gpunode.infra import sdnotify
from gpunode.node.allocation.allocator import Allocator
from gpunode.node.devices.base import Backend, DeviceEvent, EventKind
from gpunode.node.inventory import Inventory, build_inventory
from gpunode.node.kubelet.deviceplugin import PluginManager, socket_name
from gpunode.node.memcap.checkpoint import Checkpoint
from gpunode.node.parts import (
    build_health,
    build_metrics,
    build_publisher,
    build_region_keeper,
    serve_sim_control,
)
from gpunode.node.state import DeviceState

log = logging.getLogger(__name__)

EVENT_WAIT_S = 0.2  # how long one backend.wait_event call blocks in the pump thread


@dataclass(frozen=True)
class ResourceSummary:
    """One advertised resource: its device count and plugin socket path."""

    resource: str
    count: int
    socket: str


def summarize(inventory: Inventory, config: Config) -> list[ResourceSummary]:
    """One ResourceSummary per resource in the inventory."""
    return [
        ResourceSummary(r, len(inventory.by_resource(r)), str(config.kubelet_dir / socket_name(r)))
        for r in inventory.resources()
    ]


class Agent:
    """One node agent. Tests drive it in-process; the CLI runs it under signals."""

    def __init__(
        self,
        config: Config,
        *,
        backend: Backend | None = None,
        config_loader: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        self._backend = backend
        self._config_loader = config_loader
        self.state: DeviceState | None = None
        self.plugins: PluginManager | None = None
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_async: asyncio.Event | None = None
        self._reload_async: asyncio.Event | None = None
        self._rediscover_async: asyncio.Event | None = None
        self.event_listeners: list[Callable[[DeviceEvent], None]] = []
        self.health: Any = None  # gpunode.node.health.HealthMonitor once running
        self.remediator: Any = None
        self.metrics: Any = None  # gpunode.node.metrics.MetricsCollector once running
        self.metrics_ready: asyncio.Event | None = None
        self.publisher: Any = None  # gpunode.node.publish.NodeStatePublisher when publishing
        self.region_keeper: Any = None  # gpunode.node.memcap.gc.RegionKeeper when memory caps are in use
        self.checkpoint = Checkpoint(config.state_dir)

    @property
    def backend(self) -> Backend:
        """The opened backend; raises RuntimeError if the agent has not opened it."""
        if self._backend is None:
            raise RuntimeError("the agent has not opened its backend yet")
        return self._backend

    # -- thread-safe controls ------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the agent to stop (thread-safe)."""
        self._stop.set()
        self._signal(lambda: self._stop_async)

    def request_reload(self) -> None:
        """Ask the agent to reload its configuration (thread-safe)."""
        self._signal(lambda: self._reload_async)

    def request_rediscovery(self) -> None:
        """Ask the agent to rediscover devices (thread-safe)."""
        self._signal(lambda: self._rediscover_async)

    def _signal(self, which: Callable[[], asyncio.Event | None]) -> None:
        loop = self._loop

        def fire() -> None:
            event = which()
            if event is not None:
                event.set()

        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fire)

    # -- start-up ------------------------------------------------------------------------------

    def open(self) -> Inventory:
        """Open the backend and build the inventory: everything that can fail on bad input, nothing served."""
        if self._backend is None:
            from gpunode.node.devices.select import detect_backend

            sim_profile = self.config.sim_profile if self.config.backend == "sim" else None
            self._backend = detect_backend(self.config.backend, sim_profile)
        inventory = build_inventory(self.backend.gpus(), self.config)
        for warning in inventory.warnings:
            log.warning("%s", warning)
        return inventory

    async def run(self, *, ready: asyncio.Event | None = None, handle_signals: bool = False) -> None:
        """Open the backend and run plugins, health, metrics and publishing until stopped; sets ready when serving."""
        self._loop = asyncio.get_running_loop()
        self._stop_async = asyncio.Event()
        self._reload_async = asyncio.Event()
        self._rediscover_async = asyncio.Event()
        if self._stop.is_set():
            return
        try:
            inventory = await asyncio.to_thread(self.open)
        except BackendUnavailable as exc:
            if self.config.fail_on_init_error:
                raise
            log.error("%s (hint: %s)", exc, exc.hint)
            log.error("failOnInitError is false: the agent stays up and advertises nothing")
            await self._stop_async.wait()
            return
        if handle_signals:
            self._install_signal_handlers()
        self.state = DeviceState(inventory)
        self._restore_caps(inventory)
        allocator = Allocator(config=self.config, checkpoint=self.checkpoint)
        allocator.preload_lib = self._stage_preload(inventory)
        self.plugins = PluginManager(config=self.config, state=self.state, allocator=allocator)
        self._announce(inventory)
        plugins_ready = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.plugins.run(ready=plugins_ready), name="device-plugins")
                tg.create_task(self._pump_events(), name="event-pump")
                tg.create_task(self._watch_topology(), name="topology-watch")
                tg.create_task(self._reloader(), name="reloader")
                tg.create_task(self._rediscoverer(), name="rediscoverer")
                tg.create_task(self._sim_control(), name="sim-control")
                self._start_health(tg)
                self._start_metrics(tg)
                self._start_publisher(tg)
                self._start_region_keeper(tg)
                await plugins_ready.wait()
                sdnotify.notify("READY=1")
                interval = sdnotify.watchdog_interval_s()
                if interval is not None:
                    tg.create_task(sdnotify.run_watchdog(interval_s=interval), name="watchdog")
                if ready is not None:
                    ready.set()
                await self._stop_async.wait()
                raise _Stop
        except* _Stop:
            pass
        finally:
            sdnotify.notify("STOPPING=1")
            if handle_signals:
                self._remove_signal_handlers()
            log.info("agent stopped; sockets removed")

    def _announce(self, inventory: Inventory) -> None:
        log.info("backend %s: %d GPU(s)", self.backend.name, len(inventory.gpus))
        for s in summarize(inventory, self.config):
            log.info("advertising %d x %s on %s", s.count, s.resource, s.socket)

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    # -- the long-running parts ----------------------------------------------------------------

    async def rediscover(self) -> None:
        """Re-read the GPUs and re-advertise; vanished devices stay listed as unhealthy."""
        assert self.state is not None
        try:
            gpus = await asyncio.to_thread(self.backend.gpus)
        except GpunodeError as exc:
            log.warning("rediscovery failed: %s", exc)
            return
        try:
            inventory = build_inventory(gpus, self.config, strict=False)
        except ConfigError as exc:
            log.error(
                "rediscovery: the configuration no longer fits the GPUs, keeping the last inventory: "
                "%s (hint: %s)",
                exc,
                exc.hint,
            )
            return
        before = {d.id for d in self.state.snapshot().inventory.devices}
        self.state.set_inventory(inventory)
        after = {d.id for d in inventory.devices}
        if before != after:
            log.info("rediscovery: %d device(s) added, %d gone", len(after - before), len(before - after))

    async def _rediscoverer(self) -> None:
        assert self._rediscover_async is not None
        while True:
            await self._rediscover_async.wait()
            self._rediscover_async.clear()
            await self.rediscover()

    async def _watch_topology(self) -> None:
        from gpunode.node.devices.watch import watch_topology

        await watch_topology(
            backend=self.backend,
            on_change=self.request_rediscovery,
            poll_interval_s=self.config.rediscover_interval_s,
        )

    async def _reloader(self) -> None:
        assert self._reload_async is not None and self.state is not None
        while True:
            await self._reload_async.wait()
            self._reload_async.clear()
            if self._config_loader is None:
                log.warning("SIGHUP: no configuration source to reload from")
                continue
            try:
                config = self._config_loader()
                inventory = build_inventory(await asyncio.to_thread(self.backend.gpus), config)
            except GpunodeError as exc:
                log.error("reload refused, keeping the running configuration: %s (hint: %s)", exc, exc.hint)
                continue
            sdnotify.notify("RELOADING=1")
            for section in ("health", "remediation", "metrics"):
                if getattr(config, section) != getattr(self.config, section):
                    log.warning(
                        "SIGHUP: gpunode.%s changed; it takes effect when the agent restarts", section
                    )
            self.config = config
            assert self.plugins is not None
            self.plugins.config = config
            self.plugins.allocator.config = config
            for srv in self.plugins.servers.values():
                srv.servicer.config = config
            self.state.set_inventory(inventory)
            self.state.forget_vanished()
            sdnotify.notify("READY=1")
            log.info("configuration reloaded from %s", config.source)
            self._announce(inventory)

    async def _pump_events(self) -> None:
        """Carry backend events (from a blocking wait in a thread) to rediscovery and listeners."""
        while True:
            event = await asyncio.to_thread(self.backend.wait_event, EVENT_WAIT_S)
            if event is None:
                continue
            log.info(
                "device event: %s on %s%s",
                event.kind.value,
                event.gpu_uuid,
                f" xid {event.xid}" if event.xid else "",
            )
            if event.kind in (EventKind.GPU_ADDED, EventKind.GPU_REMOVED):
                self.request_rediscovery()
            for listener in list(self.event_listeners):
                try:
                    listener(event)
                except Exception:
                    log.exception("event listener failed")

    def unhealthy_devices(self) -> dict[str, str]:
        """Device ID -> reason for every advertised device that is unhealthy now (for the metrics)."""
        assert self.state is not None
        snap = self.state.snapshot()
        out: dict[str, str] = {}
        for resource in snap.resources():
            for st in snap.statuses(resource):
                if not st.healthy:
                    out[st.device.id] = st.reason
        return out

    def _start_health(self, tg: asyncio.TaskGroup) -> None:
        assert self.state is not None
        self.health, remediator = build_health(self.config, self.backend, self.state)
        self.remediator = remediator
        self.event_listeners.append(self.health.handle_event)
        tg.create_task(self.health.run(), name="health")
        if remediator is not None:
            tg.create_task(remediator.run(), name="remediation")

    def _start_metrics(self, tg: asyncio.TaskGroup) -> None:
        from gpunode.node.metrics import serve_metrics

        assert self.state is not None
        collector = build_metrics(self.config, self.backend, self.state, self.unhealthy_devices)
        if collector is None:
            return
        cfg = self.config.metrics
        self.metrics = collector
        self.event_listeners.append(self.metrics.record_event)
        tg.create_task(self.metrics.run(), name="metrics-collector")
        self.metrics_ready = asyncio.Event()
        tg.create_task(
            serve_metrics(collector=self.metrics, listen=cfg.listen, ready=self.metrics_ready),
            name="metrics-server",
        )

    def _uses_caps(self, inventory: Inventory) -> bool:
        return any(d.memory_cap_bytes is not None for d in inventory.devices) or bool(
            self.checkpoint.records()
        )

    def _stage_preload(self, inventory: Inventory) -> Path | None:
        if not self._uses_caps(inventory):
            return None
        try:
            from gpunode.node.memcap.gc import stage_preload_library

            return stage_preload_library(self.config.state_dir)
        except (ImportError, OSError, GpunodeError) as exc:
            log.error("memory caps unavailable (%s): capped devices cannot be allocated", exc)
            return None

    def _restore_caps(self, inventory: Inventory) -> None:
        """Load the checkpoint and re-create missing regions, so caps survive an agent restart."""
        self.checkpoint.load()
        if not self._uses_caps(inventory):
            return
        try:
            from gpunode.node.memcap.gc import restore_regions

            restore_regions(self.checkpoint, self.config.state_dir / "memcap")
        except ImportError as exc:
            log.error("memory caps unavailable (%s): capped devices cannot be allocated", exc)

    def _start_region_keeper(self, tg: asyncio.TaskGroup) -> None:
        assert self.state is not None
        if not self._uses_caps(self.state.snapshot().inventory):
            return
        self.region_keeper = build_region_keeper(self.config, self.checkpoint)
        tg.create_task(self.region_keeper.run(), name="memcap-regions")

    def _start_publisher(self, tg: asyncio.TaskGroup) -> None:
        """Annotate this node's Node object with its GPU state, for the scheduler extender."""
        assert self.state is not None
        publisher = build_publisher(self.config, self.state)
        if publisher is None:
            return
        self.publisher = publisher
        tg.create_task(self.publisher.run(), name="node-state-publisher")

    async def _sim_control(self) -> None:
        await serve_sim_control(self.config, self.backend)


class _Stop(Exception):
    """Raised inside the TaskGroup to end it cleanly."""
