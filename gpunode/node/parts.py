"""The node agent's optional parts, each built from the configuration.

Health checks and remediation, the metrics collector, the memory-cap region
keeper, the node-state publisher and the simulated node's control socket. Each
part's modules are imported only when it is built, so a node that does not use
it never loads them. The Agent (agent.py) starts what these return in its
TaskGroup and keeps them; this module only builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from gpunode.config.agent import Config
from gpunode.node.devices.base import Backend
from gpunode.node.memcap.checkpoint import Checkpoint
from gpunode.node.state import DeviceState

log = logging.getLogger("gpunode.node.agent")  # the parts report as the agent


def build_health(config: Config, backend: Backend, state: DeviceState) -> tuple[Any, Any]:
    """The health monitor and the remediator the configuration asks for (None for mode: off)."""
    from gpunode.node.health import HealthMonitor
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
    monitor = HealthMonitor(backend=backend, state=state, config=health_cfg, remediator=remediator)
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
    )


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


async def serve_sim_control(config: Config, backend: Backend) -> None:
    """Serve the simulated node's control socket until cancelled; nothing without a SimBackend and a socket path."""
    from gpunode.node.devices.simnode.backend import SimBackend
    from gpunode.node.devices.simnode.control import serve_control

    path = config.sim_control_socket
    if path is None or not isinstance(backend, SimBackend):
        return
    handle = await asyncio.to_thread(serve_control, backend, path)
    log.info("simulated node control socket: %s (try `gpunode sim list --socket %s`)", path, path)
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            handle.close()
