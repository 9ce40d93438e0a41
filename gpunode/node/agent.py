"""The node agent's composition root: builds the parts and runs them under one supervisor.

Start-up order matters: the backend is opened and the inventory built (and the
whole configuration validated), then the state and kubelet directories are
checked, before any socket is created, so a bad config, a missing driver or an
unusable directory stops the agent with one clear message and nothing
half-started. Then the device plugins, the topology watch (hot-plug), the event
pump, and the optional parts run side by side (supervise.py) until
SIGTERM/SIGINT or until one of them fails, which ends the agent with that
part's one-line error; the agent is ready (and says so) only once every
endpoint listens. SIGHUP reloads the configuration and re-advertises, through
the gate that keeps a GPU with live holders sold as it is until they are gone
(drain.py). This module wires; it holds no policy of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpunode.config.agent import Config
from gpunode.errors import BackendUnavailable, ConfigError, GpunodeError, ProfileError
from gpunode.infra import sdnotify
from gpunode.node.allocation.allocator import Allocator
from gpunode.node.devices.base import Backend, DeviceEvent, EventKind
from gpunode.node.inventory import Inventory, build_inventory
from gpunode.node.kubelet.deviceplugin import PluginManager, socket_name
from gpunode.node.memcap.checkpoint import Checkpoint
from gpunode.node.parts import (
    MetricsEndpoint,
    StateDirWatch,
    add_gauge,
    build_assignments,
    build_compute_shares,
    build_dra_plugin,
    build_dra_slices,
    build_health,
    build_idle_watch,
    build_metrics,
    build_publisher,
    build_region_keeper,
    build_share_check,
    check_kubelet_dir,
    check_state_dir,
    serve_sim_control,
    watch_kubelet,
)
from gpunode.node.state import DeviceState
from gpunode.node.supervise import ProcessControl, Supervisor

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
        self.metrics_endpoint: MetricsEndpoint | None = None  # its HTTP endpoint (url: the bound port)
        self.supervisor: Supervisor | None = None
        self.state_dir_watch: StateDirWatch | None = None
        self.kubelet_present = [False]  # whether kubelet.sock exists, as last seen (for the metric)
        self.publisher: Any = None  # gpunode.node.publish.NodeStatePublisher when publishing
        self.assignments: Any = None  # gpunode.node.assignments.AssignmentBook, with the publisher
        self.region_keeper: Any = None  # gpunode.node.memcap.gc.RegionKeeper when memory caps are in use
        self.compute_shares: Any = (
            None  # gpunode.node.allocation.shares.ComputeShares, with the region keeper
        )
        self.share_check: Any = None  # gpunode.node.allocation.sharecheck.ShareCheck, with the compute shares
        self.proc_root = Path("/proc")  # where the share check reads each driver process's cgroup
        self.checkpoint = Checkpoint(config.state_dir)
        self.gate: Any = None  # gpunode.node.drain.SharingGate: reloads and rediscovery go through it
        self.dra: Any = None  # gpunode.node.dra.plugin.DraPlugin when gpunode.dra.enabled
        self.dra_slices: Any = None  # gpunode.node.dra.slices.SlicePublisher when DRA is enabled

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
            try:
                self._backend = detect_backend(self.config.backend, sim_profile)
            except ProfileError as exc:  # name the flag, variable or file key that chose the profile
                where = self.config.origin("sim_profile", "gpunode.simProfile")
                raise ProfileError(f"{where}: {exc}", hint=exc.hint) from None
        inventory = build_inventory(self.backend.gpus(), self.config)
        for warning in inventory.warnings:
            log.warning("%s", warning)
        return inventory

    async def run(self, *, ready: asyncio.Event | None = None, process: ProcessControl | None = None) -> None:
        """Open the backend and run plugins, health, metrics and publishing until stopped.

        Sets `ready` once everything listens. The first part that fails ends the run with that part's
        one-line error (a GpunodeError); the others get STOP_GRACE_S to stop. `process`: the signals and
        exit deadline of `gpunode agent` (armed as soon as the agent begins to stop).
        """
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
        # Nothing is created or served before the directories are known to be usable.
        await asyncio.to_thread(check_state_dir, self.config)
        await asyncio.to_thread(check_kubelet_dir, self.config, inventory.resources())
        from gpunode.node.drain import SharingGate, load_served

        # How the node sold each GPU before this start: a GPU a container still holds keeps that.
        before = await asyncio.to_thread(load_served, self.config.state_dir, inventory)
        self.state = DeviceState(before or inventory)
        self._restore_caps(inventory)
        allocator = Allocator(config=self.config, checkpoint=self.checkpoint)
        self.plugins = PluginManager(config=self.config, state=self.state, allocator=allocator)
        self._wire_holds(self.plugins)
        self.gate = SharingGate(
            state=self.state,
            holds=self.plugins.holds,
            checkpoint=self.checkpoint,
            state_dir=self.config.state_dir,
        )
        await self.plugins.holds.seed_from_kubelet()  # what containers held before this start
        inventory = await self.gate.apply(inventory)
        await asyncio.to_thread(allocator.trim, inventory)  # regions an agent without the bound left
        allocator.preload_lib = self._stage_preload(inventory)
        self._announce(inventory)
        self.dra = build_dra_plugin(self.config, self.backend, self.state)  # refused here, before serving
        if self.dra is not None:  # a MIG instance created or destroyed for a claim: rediscover, republish
            self.dra.preparer.on_mig_change = self.request_rediscovery
        sup = self.supervisor = Supervisor()
        stopper = asyncio.ensure_future(self._stop_async.wait())
        stopper.add_done_callback(lambda _: sup.stop())
        try:
            if await self._start_parts(sup):
                sdnotify.notify("READY=1")
                if ready is not None:
                    ready.set()
                await sup.wait()
        finally:
            stopper.cancel()
            error = sup.error()
            if process is not None:
                process.error = error
                process.arm()
            sdnotify.notify("STOPPING=1")
            stuck = await sup.shutdown()
            if stuck:
                log.warning("%s did not stop within %g s; leaving it behind", ", ".join(stuck), sup.grace_s)
            log.info("agent stopped; sockets removed")
        if error is not None:
            raise error

    async def _start_parts(self, sup: Supervisor) -> bool:
        """Start every part; True once all of them listen, False if the agent ended first."""
        assert self.state is not None and self.plugins is not None
        gates = {"device plugins": asyncio.Event(), "sim control": asyncio.Event()}
        sup.start("device plugins", self.plugins.run(ready=gates["device plugins"]))
        sup.start("event pump", self._pump_events())
        sup.start("topology watch", self._watch_topology())
        sup.start("reloader", self._reloader())
        sup.start("sharing drain", self.gate.run())
        sup.start("rediscovery", self._rediscoverer())
        sup.start("sim control", serve_sim_control(self.config, self.backend, gates["sim control"]))
        sup.start("kubelet watch", watch_kubelet(self.config, self.kubelet_present))
        self.state_dir_watch = StateDirWatch(self.config, self.state)
        sup.start("state directory watch", self.state_dir_watch.run())
        self._start_health(sup)
        if self._start_metrics(sup):
            gates["metrics endpoint"] = asyncio.Event()
            assert self.metrics_endpoint is not None
            sup.start("metrics endpoint", self.metrics_endpoint.run(gates["metrics endpoint"]))
        self._start_publisher(sup)
        self.dra_slices = build_dra_slices(lambda: self.config, self.backend, self.state, lambda: self.health)
        if self.dra_slices is not None:
            sup.start("DRA slices", self.dra_slices.run())
        if self.dra is not None:  # the DRA kubelet plugin, for the GPUs gpunode.dra.devices gives it
            gates["DRA plugin"] = asyncio.Event()
            sup.start("DRA plugin", self.dra.run(ready=gates["DRA plugin"]))
        self._start_region_keeper(sup)
        if self.region_keeper is not None:  # capped containers: their compute shares too
            self.compute_shares = build_compute_shares(
                self.config, self.checkpoint, self.assignments, self.publisher
            )
            sup.start("compute shares", self.compute_shares.run())
            self.share_check = build_share_check(
                self.config, self.backend, self.compute_shares, self.assignments, self.metrics, self.proc_root
            )
            if self.share_check is not None:
                sup.start("compute-share check", self.share_check.run())
        idle = build_idle_watch(self.config, self.backend, self.state, self.metrics)
        if idle is not None:
            sup.start("idle GPU watch", idle.run())
        interval = sdnotify.watchdog_interval_s()
        if interval is not None:
            sup.start("watchdog", sdnotify.run_watchdog(interval_s=interval))
        for event in gates.values():
            if not await sup.until(event):
                return False
        return True

    def stuck_cleanup(self) -> None:
        """Remove this agent's plugin sockets (from any thread), when the process must exit at once."""
        if self.dra is not None:  # registration first: the kubelet's plugin watcher forgets the driver
            for sock in (self.dra.registrar, self.dra.service):
                if sock.inode is not None and sock.intact():
                    sock.path.unlink(missing_ok=True)
        if self.plugins is None:
            return
        for srv in list(self.plugins.servers.values()):
            if srv.inode is not None and srv.socket_intact():
                srv.socket_path.unlink(missing_ok=True)

    def _wire_holds(self, plugins: PluginManager) -> None:
        """The Allocate check of who holds a device: the kubelet's List, and the checkpointed caps."""
        from gpunode.node.allocation.holds import LIST_TIMEOUT_S
        from gpunode.node.kubelet.podresources import list_container_devices

        socket_path = str(self.config.pod_resources_socket)
        plugins.holds.list_containers = lambda: list_container_devices(socket_path, timeout_s=LIST_TIMEOUT_S)
        plugins.holds.seed((r.key, r.device_ids) for r in self.checkpoint.records().values())

    def _announce(self, inventory: Inventory) -> None:
        log.info("backend %s: %d GPU(s)", self.backend.name, len(inventory.gpus))
        for s in summarize(inventory, self.config):
            log.info("advertising %d x %s on %s", s.count, s.resource, s.socket)

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
        inventory = await self.gate.apply(inventory)
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
                # Read, validate and build off to the side (in a thread, bounded by the configuration's
                # limits); the running configuration and inventory are replaced only if all of it succeeds.
                config, inventory = await asyncio.to_thread(self._load_for_reload, self._config_loader)
            except GpunodeError as exc:
                log.error("reload refused, keeping the running configuration: %s (hint: %s)", exc, exc.hint)
                continue
            if config.dra != self.config.dra:  # which GPUs DRA serves moves GPUs between the two APIs
                log.error(
                    "reload refused, keeping the running configuration: gpunode.dra changed "
                    "(hint: restart the agent to apply it; prepared claims are kept across the restart)"
                )
                continue
            sdnotify.notify("RELOADING=1")
            for section in ("health", "remediation", "metrics", "idle"):
                if getattr(config, section) != getattr(self.config, section):
                    log.warning(
                        "SIGHUP: gpunode.%s changed; it takes effect when the agent restarts", section
                    )
            if config.log_level != self.config.log_level:
                logging.getLogger().setLevel(config.log_level.upper())
                log.warning("SIGHUP: log level is now %s", config.log_level)
            self.config = config
            assert self.plugins is not None
            self.plugins.config = config
            self.plugins.allocator.config = config
            for srv in self.plugins.servers.values():
                srv.servicer.config = config
            inventory = await self.gate.apply(inventory)  # GPUs with holders keep their mode for now
            self.state.forget_vanished()
            if self.dra_slices is not None:
                self.dra_slices.poke()  # the slices follow the new configuration
            sdnotify.notify("READY=1")
            log.info("configuration reloaded from %s", config.source)
            self._announce(inventory)

    def _load_for_reload(self, loader: Callable[[], Config]) -> tuple[Config, Inventory]:
        """The new configuration and the inventory it gives on the current GPUs; touches nothing running."""
        config = loader()
        return config, build_inventory(self.backend.gpus(), config)

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

    def _start_health(self, sup: Supervisor) -> None:
        assert self.state is not None
        self.health, remediator = build_health(self.config, self.backend, self.state)
        self.remediator = remediator
        self.event_listeners.append(self.health.handle_event)
        sup.start("health monitor", self.health.run())
        if remediator is not None:
            sup.start("remediation", remediator.run())

    def _start_metrics(self, sup: Supervisor) -> bool:
        """Start the collector; True when there is an endpoint to serve (metrics enabled)."""
        assert self.state is not None
        collector = build_metrics(self.config, self.backend, self.state, self.unhealthy_devices)
        if collector is None:
            return False
        self.metrics = collector
        self.event_listeners.append(self.metrics.record_event)
        add_gauge(
            collector,
            "gpunode_kubelet_socket_present",
            "1 while the kubelet's registration socket (kubelet.sock) exists in the kubelet directory, else 0.",
            lambda: float(self.kubelet_present[0]),
        )
        add_gauge(
            collector,
            "gpunode_memcap_cleanup_blocked",
            "1 while the memory-cap regions of ended containers cannot be collected (the kubelet's "
            "pod-resources API cannot be asked), else 0.",
            lambda: float(self.region_keeper is not None and self.region_keeper.problem is not None),
        )
        add_gauge(
            collector,
            "gpunode_state_dir_writable",
            "1 while the state directory can be written, else 0 (memory-capped devices are then Unhealthy).",
            lambda: float(self.state_dir_watch is None or self.state_dir_watch.problem is None),
        )
        if self.gate is not None:
            collector.registry.register(self.gate.collector())
        sup.start("metrics collector", self.metrics.run())
        self.metrics_endpoint = MetricsEndpoint(collector, self.config, self._problems)
        return True

    def _problems(self) -> list[str]:
        """What the agent itself knows is wrong now, for /health."""
        return self.state_dir_watch.problems() if self.state_dir_watch is not None else []

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

    def _start_region_keeper(self, sup: Supervisor) -> None:
        assert self.state is not None
        if not self._uses_caps(self.state.snapshot().inventory):
            return
        self.region_keeper = build_region_keeper(self.config, self.checkpoint)
        sup.start("memcap regions", self.region_keeper.run())

    def _start_publisher(self, sup: Supervisor) -> None:
        """Annotate this node's Node object with its GPU state, for the scheduler extender."""
        assert self.state is not None
        publisher = build_publisher(self.config, self.state)
        if publisher is None:
            return
        self.publisher = publisher
        sup.start("node-state publisher", self.publisher.run())
        self.assignments = build_assignments(self.config, self.state, self.plugins, publisher, self.metrics)
        if self.assignments is not None:
            sup.start("assignment watch", self.assignments.run())
