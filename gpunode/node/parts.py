"""The agent's optional parts, each built from the configuration, and the checks of its directories.

Health checks and remediation, the metrics collector and its endpoint, the
memory-cap region keeper, the node-state publisher, the book of the extender's
GPU assignments, the idle-GPU watch, the DRA kubelet plugin and the simulated node's control socket. Each part's modules are imported only when it is built, so a
node that does not use it never loads them. The Agent (agent.py) starts what
these return under its supervisor (supervise.py) and keeps them.

The directories are checked before anything is served (check_kubelet_dir,
check_state_dir: one line naming the path and what is wrong) and watched while
the agent runs: watch_kubelet says plainly, every KUBELET_WARN_INTERVAL_S, that
no kubelet is there; watch_state_dir marks the memory-capped devices unhealthy
while the state directory cannot be written (their Allocate would fail).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpunode.config.agent import Config
from gpunode.errors import KubeletDirError, StateDirError
from gpunode.node.devices.base import Backend
from gpunode.node.kubelet.deviceplugin import socket_name
from gpunode.node.memcap.checkpoint import Checkpoint
from gpunode.node.state import DeviceState

log = logging.getLogger("gpunode.node.agent")  # the parts report as the agent


def build_health(config: Config, backend: Backend, state: DeviceState) -> tuple[Any, Any]:
    """The health monitor and the remediator the configuration asks for (None for mode: off)."""
    from gpunode.node.health import HealthMonitor
    from gpunode.node.health.holds import HoldStore
    from gpunode.node.health.remediation import build_remediator

    health_cfg = config.health
    rem_cfg = config.remediation
    if rem_cfg.mode == "kubernetes" and not config.node_name:
        log.warning(
            "remediation: no node name (set NODE_NAME or --node-name), so no pod is evicted; "
            "devices are still marked unhealthy"
        )
        rem_cfg = replace(rem_cfg, mode="off")
    remediator = build_remediator(
        rem_cfg,
        backend=backend,
        node_name=config.node_name,
        pod_resources_socket=str(config.pod_resources_socket),
    )
    store = HoldStore(config.state_dir / "health")  # fatal XIDs held across restarts; operators' clears
    monitor = HealthMonitor(
        backend=backend, state=state, config=health_cfg, remediator=remediator, store=store
    )
    return monitor, remediator


def build_metrics(
    config: Config, backend: Backend, state: DeviceState, unhealthy: Callable[[], Mapping[str, str]]
) -> Any:
    """The metrics collector, or None when gpunode.metrics is disabled."""
    from gpunode.node.kubelet.podresources import PodAttribution
    from gpunode.node.metrics import MetricsCollector

    cfg = config.metrics
    if not cfg.enabled:
        return None
    attribution = PodAttribution(
        cfg.pod_resources_socket or str(config.pod_resources_socket), ttl_s=cfg.attribution_ttl_s
    )
    return MetricsCollector(
        backend=backend,
        hostname=config.node_name,
        config=cfg,
        inventory=lambda: state.snapshot().inventory,
        health=unhealthy,
        attribution=attribution,
        regions_root=config.state_dir / "memcap",
        dra_driver=config.dra.driver_name,
        dra_root=config.state_dir / "dra" if config.dra.enabled else None,
    )


def build_region_keeper(config: Config, checkpoint: Checkpoint) -> Any:
    """The loop that removes the memory-cap regions of containers the kubelet no longer lists."""
    from gpunode.node.kubelet.podresources import list_container_devices
    from gpunode.node.memcap.gc import RegionKeeper

    socket_path = str(config.pod_resources_socket)
    frac = config.fractional
    return RegionKeeper(
        root=config.state_dir / "memcap",
        checkpoint=checkpoint,
        list_containers=lambda: list_container_devices(socket_path, timeout_s=5.0),
        interval_s=frac.gc_interval_s,
        grace_s=frac.gc_grace_s,
        state_dir=config.state_dir,
    )


def build_compute_shares(config: Config, checkpoint: Checkpoint, assignments: Any, publisher: Any) -> Any:
    """The loop that writes each capped container's compute share (its pod's gpunode.io/gpu-milli, else its
    memory share) into its region, and gives the shares pods asked for to the node-state publisher. The
    pods' annotations come from the assignment book's watch; without API access only the defaults hold."""
    from gpunode.node.allocation.allocator import mps_region
    from gpunode.node.allocation.shares import ComputeShares
    from gpunode.node.kubelet.podresources import list_container_devices
    from gpunode.node.memcap.compute import DEFAULT_MODE, ComputeMode

    socket_path = str(config.pod_resources_socket)
    shares = ComputeShares(
        checkpoint=checkpoint,
        regions_root=config.state_dir / "memcap",
        list_containers=lambda: list_container_devices(socket_path, timeout_s=5.0),
        asks=(lambda: assignments.compute_asks) if assignments is not None else dict,
        mode_of=lambda rec: ComputeMode.HARD if mps_region(config, rec.resource) else DEFAULT_MODE,
        fixed=lambda rec: mps_region(config, rec.resource),
    )
    if assignments is not None:
        assignments.on_compute_ask = shares.poke
    if publisher is not None:
        publisher.explicit_shares = shares.explicit
        shares.on_change = publisher.poke
    return shares


def build_share_check(
    config: Config,
    backend: Backend,
    shares: Any,
    assignments: Any,
    metrics: Any,
    proc_root: Path = Path("/proc"),
) -> Any:
    """The cross-check of each capped pod's compute share against the driver's per-process figures, with
    its metrics; Events (and evictions) need API access (the assignment book's); None when the backend
    cannot say what each process used."""
    from gpunode.infra.kube import KubeClient
    from gpunode.node.allocation.allocator import mps_region
    from gpunode.node.allocation.sharecheck import ShareCheck
    from gpunode.node.memcap.compute import DEFAULT_MODE, ComputeMode

    if getattr(backend, "process_utilization", None) is None:
        return None
    rem_cfg = config.remediation
    check = ShareCheck(
        backend=backend,
        shares=shares,
        config=config.compute_share,
        pod_uids=(lambda: assignments.pod_uids) if assignments is not None else dict,
        api=(
            (
                lambda: KubeClient.from_environment(
                    kubeconfig=rem_cfg.kubeconfig, request_timeout_s=rem_cfg.request_timeout_s
                )
            )
            if assignments is not None
            else None
        ),
        node_name=config.node_name,
        mode_of=lambda rec: ComputeMode.HARD if mps_region(config, rec.resource) else DEFAULT_MODE,
        proc_root=proc_root,
    )
    if metrics is not None:
        metrics.registry.register(check.collector())
    return check


def build_publisher(config: Config, state: DeviceState) -> Any:
    """The node-state publisher (the Node's GPU-state annotation, for the scheduler extender),
    or None when publishing is off or the node has no name."""
    from gpunode.infra.kube import KubeClient
    from gpunode.node.kubelet.podresources import list_container_devices
    from gpunode.node.publish import NodeStatePublisher

    if not config.publish_node_state:
        return None
    if not config.node_name:
        log.info("node state: no node name (NODE_NAME), so the GPU-state annotation is not published")
        return None
    rem_cfg = config.remediation
    socket_path = str(config.pod_resources_socket)
    clients: list[KubeClient] = []

    async def patch(node: str, annotations: Mapping[str, str | None]) -> None:
        if not clients:
            clients.append(
                KubeClient.from_environment(
                    kubeconfig=rem_cfg.kubeconfig, request_timeout_s=rem_cfg.request_timeout_s
                )
            )
        await clients[0].patch_node_annotations(node, annotations)

    async def holders() -> dict[str, str]:
        out: dict[str, str] = {}
        for c in await list_container_devices(socket_path, timeout_s=5.0):
            for dev in c.device_ids:
                out[dev] = f"{c.namespace}/{c.pod}"
        return out

    return NodeStatePublisher(
        state=state,
        node_name=config.node_name,
        patch=patch,
        read_holders=holders,
        interval_s=config.publish_interval_s,
    )


def build_dra_slices(
    config: Callable[[], Config], backend: Backend, state: DeviceState, health: Callable[[], Any]
) -> Any:
    """The publisher of this node's ResourceSlices (gpunode.node.dra.slices) for the GPUs gpunode.dra
    serves, tainted by the health monitor's verdicts; None when DRA is off or the node has no name.
    `config` and `health` are read at each publication (a reload applies at once)."""
    from gpunode.config.dra import MIG_STATIC, time_sliced_replicas
    from gpunode.infra.kube import KubeClient
    from gpunode.node.devices.base import MigPartitioner
    from gpunode.node.dra.order import ClaimUsage
    from gpunode.node.dra.prepare import created_migs
    from gpunode.node.dra.slices import Pool, SlicePublisher, build_pool
    from gpunode.node.dra.taints import device_taints

    first = config()
    if not first.dra.enabled:
        return None
    if not first.node_name:
        log.warning("DRA: no node name (NODE_NAME or --node-name), so no ResourceSlice is published")
        return None
    driver_version = backend.driver_version()

    def pool() -> Pool:
        cfg, monitor = config(), health()
        verdicts = monitor.verdicts() if monitor is not None else {}
        served = [g for g in state.snapshot().inventory.gpus if cfg.dra.serves(g.index, g.uuid)]
        return build_pool(
            served,
            unit_bytes=cfg.fractional.unit_bytes,
            driver_version=driver_version,
            taints=device_taints(verdicts, cfg.health.xid),
            time_sliced={
                g.uuid: n
                for g in served
                if (n := time_sliced_replicas(cfg.dra, cfg.time_slicing, g.index, g.uuid)) is not None
            },
            mig_partitioning=cfg.dra.mig_partitioning if isinstance(backend, MigPartitioner) else MIG_STATIC,
            mig_owned=created_migs(cfg.state_dir),
        )

    async def changed(version: int) -> int:
        return (await state.wait_for_change(version)).version

    rem_cfg = first.remediation

    def client() -> KubeClient:
        return KubeClient.from_environment(
            kubeconfig=rem_cfg.kubeconfig, request_timeout_s=rem_cfg.request_timeout_s
        )

    # The devices in gpunode's order of preference, from what the node's claims hold (gpunode.node.dra.order).
    order = ClaimUsage(client_factory=client, node_name=first.node_name, driver=first.dra.driver_name)
    return SlicePublisher(
        client_factory=client,
        node_name=first.node_name,
        driver=first.dra.driver_name,
        pool=pool,
        changed=changed,
        order=order,
    )


def build_dra_plugin(config: Config, backend: Backend, state: DeviceState) -> Any:
    """The DRA kubelet plugin (gpunode.dra), or None when it is off. It reads ResourceClaims and the
    node's ResourceSlices with the agent's Kubernetes credentials (gpunode.remediation.kubeconfig, else
    in-cluster or $KUBECONFIG)."""
    if not config.dra.enabled:
        return None
    from gpunode.errors import ConfigError
    from gpunode.infra.kube import KubeClient
    from gpunode.node.devices.base import MigPartitioner
    from gpunode.node.dra.claims import ClaimRef
    from gpunode.node.dra.devices import DeviceDirectory, kube_slice_lister
    from gpunode.node.dra.plugin import DraPlugin
    from gpunode.node.dra.prepare import Preparer
    from gpunode.node.memcap.gc import stage_preload_library

    if not config.node_name:
        raise ConfigError(
            "gpunode.dra.enabled: the DRA plugin needs the node's name (its ResourceSlices and claims name it)",
            hint="set NODE_NAME (the chart sets it from spec.nodeName) or gpunode.nodeName",
        )
    rem_cfg = config.remediation
    client = KubeClient.from_environment(
        kubeconfig=rem_cfg.kubeconfig, request_timeout_s=rem_cfg.request_timeout_s
    )
    driver = config.dra.driver_name

    async def fetch(ref: ClaimRef) -> dict[str, Any]:
        from lightkube.resources.resource_v1 import ResourceClaim

        claim: dict[str, Any] = await client.get_json(ResourceClaim, ref.name, namespace=ref.namespace)
        return claim

    async def fetch_pod(namespace: str, name: str) -> dict[str, Any]:
        from lightkube.resources.core_v1 import Pod

        pod: dict[str, Any] = await client.get_json(Pod, name, namespace=namespace)
        return pod

    preparer = Preparer(
        config=config,
        fetch_claim=fetch,
        directory=DeviceDirectory(
            kube_slice_lister(client, driver=driver, node=config.node_name),
            driver=driver,
            node=config.node_name,
        ),
        gpus=backend.gpus,
        preload_lib=stage_preload_library(config.state_dir),
        with_device_nodes=not backend.name.startswith("sim"),
        fetch_pod=fetch_pod,
        mig=backend if isinstance(backend, MigPartitioner) else None,
    )
    return DraPlugin(
        preparer=preparer,
        state=state,
        registration_socket=config.dra.registration_socket(config.kubelet_dir),
        service_socket=config.dra.service_socket(config.kubelet_dir),
    )


def build_assignments(config: Config, state: DeviceState, plugins: Any, publisher: Any, metrics: Any) -> Any:
    """The book of the scheduler extender's GPU assignments to carry out (gpunode.node.assignments), wired
    into the device plugins' hooks and the metrics, with every Allocate told to the publisher; None
    without API access (no publisher), where the node decides alone as before."""
    from gpunode.infra.kube import KubeClient
    from gpunode.node.assignments import AssignmentBook

    if publisher is None:
        return None
    rem_cfg = config.remediation
    book = AssignmentBook(
        node_name=config.node_name,
        state_dir=config.state_dir,
        client_factory=lambda: KubeClient.from_environment(
            kubeconfig=rem_cfg.kubeconfig, request_timeout_s=rem_cfg.request_timeout_s
        ),
        served=lambda: state.snapshot().resources(),
    )
    plugins.hooks.assignments = book
    plugins.hooks.allocated.append(publisher.note_allocation)
    if metrics is not None:
        metrics.registry.register(book.collector())
    return book


def build_idle_watch(config: Config, backend: Backend, state: DeviceState, metrics: Any) -> Any:
    """The watch that flags pods whose GPUs stay idle (gpunode.node.idle), with its series in the
    metrics registry; None unless gpunode.idle.enabled."""
    from gpunode.infra.kube import KubeClient
    from gpunode.node.idle import IdleWatch
    from gpunode.node.kubelet.podresources import list_container_devices

    if not config.idle.enabled:
        return None
    rem_cfg = config.remediation
    socket_path = str(config.pod_resources_socket)
    watch = IdleWatch(
        config=config.idle,
        backend=backend,
        inventory=lambda: state.snapshot().inventory,
        list_containers=lambda: list_container_devices(socket_path, timeout_s=5.0),
        client_factory=lambda: KubeClient.from_environment(
            kubeconfig=rem_cfg.kubeconfig, request_timeout_s=rem_cfg.request_timeout_s
        ),
        node_name=config.node_name,
    )
    if metrics is not None:
        metrics.registry.register(watch.collector())
    return watch


async def serve_sim_control(config: Config, backend: Backend, ready: asyncio.Event | None = None) -> None:
    """Serve the simulated node's control socket until cancelled; nothing without a SimBackend and a socket path.

    Sets `ready` once the socket is served (at once when there is nothing to serve).
    """
    from gpunode.node.devices.simnode.backend import SimBackend
    from gpunode.node.devices.simnode.control import serve_control

    path = config.sim_control_socket
    if path is None or not isinstance(backend, SimBackend):
        if ready is not None:
            ready.set()
        return
    handle = await asyncio.to_thread(serve_control, backend, path)
    log.info("simulated node control socket: %s (try `gpunode sim list --socket %s`)", path, path)
    try:
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            handle.close()


# -- the metrics endpoint ----------------------------------------------------------------------


class _AgentHealth:
    """The collector as the endpoint sees it, with the agent's own problems added to /health."""

    def __init__(self, collector: Any, problems: Callable[[], list[str]]) -> None:
        self._collector = collector
        self._problems = problems

    def render(self) -> bytes:
        """The collector's exposition."""
        return bytes(self._collector.render())

    @property
    def snapshot(self) -> object | None:
        """The collector's last successful collection."""
        return self._collector.snapshot

    def health_status(self) -> tuple[bool, str]:
        """The collector's verdict, made KO by any problem of the agent (named first)."""
        ok, detail = self._collector.health_status()
        problems = self._problems()
        if not problems:
            return ok, detail
        return False, "; ".join([*problems, detail])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collector, name)


class MetricsEndpoint:
    """The metrics endpoint as the agent runs it: run() binds, then sets ready; url names the bound port."""

    def __init__(self, collector: Any, config: Config, problems: Callable[[], list[str]]) -> None:
        self.collector = collector
        self.config = config
        self.source = _AgentHealth(collector, problems)
        self.server: Any = None
        self._tls = False

    @property
    def url(self) -> str:
        """The /metrics URL on the bound address, e.g. http://localhost:9400/metrics."""
        if self.server is None:
            raise RuntimeError("the metrics endpoint is not listening")
        host = self.server.address.host
        host = "localhost" if host in ("", "0.0.0.0", "::") else host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self._tls else 'http'}://{host}:{self.server.port}/metrics"

    async def run(self, ready: asyncio.Event) -> None:
        """Listen (MetricsServerError, one line, when the address cannot be bound), set ready, serve."""
        from gpunode.config.metrics import parse_listen
        from gpunode.config.webconfig import load_web_config
        from gpunode.node.metrics import MetricsServer

        cfg = self.config.metrics
        web_config = load_web_config(cfg.web_config_file) if cfg.web_config_file else None
        self._tls = web_config is not None and web_config.tls is not None
        server = MetricsServer(
            self.source, parse_listen(cfg.listen, "gpunode.metrics.listen"), web_config=web_config
        )
        await server.start()
        self.server = server
        ready.set()
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            await server.stop()


def add_gauge(collector: Any, name: str, documentation: str, value: Callable[[], float]) -> None:
    """An agent-level gauge (read at each scrape) in the collector's registry."""
    from prometheus_client import Gauge

    Gauge(name, documentation, registry=collector.registry).set_function(value)


# -- the directories -----------------------------------------------------------------------------

MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes with the terminating NUL
KUBELET_WARN_INTERVAL_S = 60.0  # how often "no kubelet" is said again while it stays absent
KUBELET_POLL_S = 1.0
STATE_DIR_CHECK_S = 5.0
STATE_DIR_SOURCE = "state-dir"  # the DeviceState health source of watch_state_dir


def writable_problem(path: Path) -> str | None:
    """None when a file can be created (and removed) in directory `path`, else why not."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".gpunode-probe-", dir=path)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def _ensure_dir(path: Path, what: str, error: type[KubeletDirError] | type[StateDirError]) -> bool:
    """Make sure `path` is a directory; True when it had to be created."""
    try:
        if path.is_dir():
            return False
        if path.exists() or path.is_symlink():
            raise error(f"{what} {path} is not a directory")
        path.mkdir(parents=True)
        return True
    except FileExistsError:
        return _ensure_dir(path, what, error)
    except OSError as exc:
        raise error(f"{what} {path} does not exist and cannot be created: {exc.strerror or exc}") from None


def check_kubelet_dir(config: Config, resources: Iterable[str]) -> None:
    """Socket paths that fit a Unix socket, a writable directory (created, and said, when missing)."""
    d = config.kubelet_dir
    for resource in resources:
        path = d / socket_name(resource)
        size = len(os.fsencode(path))
        if size > MAX_SOCKET_PATH_BYTES:
            raise KubeletDirError(
                f"the device-plugin socket path {path} is {size} bytes; a Unix socket path may have "
                f"at most {MAX_SOCKET_PATH_BYTES}",
                hint="choose a shorter --kubelet-dir (gpunode.kubeletDir); the kubelet's own is "
                "/var/lib/kubelet/device-plugins",
            )
    if _ensure_dir(d, "the kubelet directory", KubeletDirError):
        log.warning(
            "the kubelet directory %s did not exist: no kubelet runs there (or --kubelet-dir points "
            "elsewhere); created it, and the device plugins register when %s appears",
            d,
            config.kubelet_socket.name,
        )
    why = writable_problem(d)
    if why is not None:
        raise KubeletDirError(f"the kubelet directory {d} is not writable: {why}")


def check_state_dir(config: Config) -> None:
    """A writable state directory (created when missing); StateDirError, one line, otherwise."""
    d = config.state_dir
    _ensure_dir(d, "the state directory", StateDirError)
    why = writable_problem(d)
    if why is not None:
        raise StateDirError(f"the state directory {d} is not writable: {why}")


async def watch_kubelet(config: Config, present: list[bool]) -> None:
    """Say plainly, now and every KUBELET_WARN_INTERVAL_S, while no kubelet socket is there.

    `present[0]` follows the kubelet socket's existence (for the metric).
    """
    loop = asyncio.get_running_loop()
    said_at: float | None = None
    sock = config.kubelet_socket
    while True:
        there = await asyncio.to_thread(sock.exists)
        present[0] = there
        now = loop.time()
        if not there and (said_at is None or now - said_at >= KUBELET_WARN_INTERVAL_S):
            log.warning(
                "no kubelet at %s: nothing is registered and pods cannot get these GPUs until the kubelet "
                "creates it (check --kubelet-dir; `gpunode doctor` diagnoses)",
                sock,
            )
            said_at = now
        elif there and said_at is not None:
            log.info("the kubelet socket %s is there now", sock)
            said_at = None
        await asyncio.sleep(KUBELET_POLL_S)


class StateDirWatch:
    """Marks the memory-capped devices unhealthy while the state directory cannot be written."""

    def __init__(self, config: Config, state: DeviceState) -> None:
        self.config = config
        self.state = state
        self.problem: str | None = None  # why the directory cannot be written, while it cannot

    def problems(self) -> list[str]:
        """The problem as /health names it, when capped devices suffer from it."""
        if self.problem is None or not self._capped():
            return []
        return [f"memory-capped devices unhealthy: {self.problem}"]

    def _capped(self) -> dict[str, str]:
        return {
            d.target_uuid: f"the state directory cannot be written: {self.problem}"
            for d in self.state.snapshot().inventory.devices
            if d.memory_cap_bytes is not None
        }

    def check(self) -> None:
        """Probe the directory once and publish the verdict (from a thread)."""
        d = self.config.state_dir
        why = writable_problem(d)
        problem = None if why is None else f"{d} is not writable ({why})"
        if problem != self.problem:
            if problem is not None:
                log.error(
                    "the state directory %s is not writable (%s): memory caps cannot be set up, so the "
                    "capped devices are advertised Unhealthy until it is writable again",
                    d,
                    why,
                )
            else:
                log.info("the state directory %s is writable again", d)
        self.problem = problem
        self.state.set_unhealthy(STATE_DIR_SOURCE, self._capped() if problem else {})

    async def run(self) -> None:
        """Check every STATE_DIR_CHECK_S until cancelled."""
        while True:
            await asyncio.to_thread(self.check)
            await asyncio.sleep(STATE_DIR_CHECK_S)
