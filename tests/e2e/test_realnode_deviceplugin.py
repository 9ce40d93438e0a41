"""`gpunode agent --backend sim` as the device plugin of a real kubelet v1.20 (containerd, runc).

The kubelet registers the Node with the real API server; the agent registers its plugin over the
kubelet's real Registration socket; the Node's capacity then shows nvidia.com/gpu from our plugin, the
agent publishes the node-state annotation with the chart's agent RBAC, and a pod asking for a GPU runs
(hostNetwork, the local busybox image) with the device the plugin allocated in its environment.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import yaml

from gpunode.contract.names import GPU_RESOURCE, NODE_STATE_ANNOTATION
from gpunode.contract.nodestate import decode
from tests.e2e import chart
from tests.e2e.api import Api, eventually
from tests.e2e.conftest import E2E_USERS, REAL_NODE
from tests.e2e.controlplane import ControlPlane
from tests.e2e.node import RealNode, node_missing_reason
from tests.e2e.objects import create_pod, ensure_namespace, get_pod, pod_body
from tests.e2e.procs import Proc, free_port

NAMESPACE = "e2e-node"
WAIT_S = 180.0  # generous: pods start in seconds, but the two cores are shared
SIM_GPUS = 4  # the t4 profile


@pytest.fixture(scope="module")
def node_with_agent(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNode]:
    """A real kubelet + containerd node and the gpunode agent (sim backend) as its device plugin."""
    reason = node_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("node")
    docs = chart.render({}, tmp)
    admin = control_plane.api()
    ensure_namespace(admin, chart.NAMESPACE)
    ensure_namespace(admin, NAMESPACE)
    assert chart.apply_rbac(admin, docs, "agent") == E2E_USERS["agent"].name
    node = RealNode(control_plane, REAL_NODE, tmp / "n")
    try:
        node.start()
        config = {
            "version": "v1",
            "flags": {"migStrategy": "none", "failOnInitError": True},
            "gpunode": {
                "backend": "sim",
                "simProfile": "t4",
                "kubeletDir": str(node.device_plugins),
                "stateDir": str(tmp / "agent-state"),
                "podResourcesSocket": str(node.pod_resources_socket),
                "nodeName": REAL_NODE,
                "metrics": {"listen": f"127.0.0.1:{free_port()}"},
                "remediation": {"mode": "kubernetes", "kubeconfig": str(control_plane.kubeconfig("agent"))},
            },
        }
        (tmp / "agent.yaml").write_text(yaml.safe_dump(config))
        agent = Proc(
            "gpunode-agent",
            [sys.executable, "-m", "gpunode.cli", "agent", "--config", str(tmp / "agent.yaml")],
            control_plane.logs,
        ).start()
        control_plane.procs.append(agent)
        try:
            yield node
        finally:
            agent.stop()
    finally:
        node.stop()


def _capacity(api: Api, name: str) -> dict[str, Any] | None:
    node = api.get(f"/api/v1/nodes/{name}")
    capacity: dict[str, Any] = node["status"].get("capacity", {})
    return capacity if capacity.get(GPU_RESOURCE) == str(SIM_GPUS) else None


def test_agent_registers_with_the_real_kubelet_and_the_node_advertises_its_gpus(
    node_with_agent: RealNode, control_plane: ControlPlane
) -> None:
    admin = control_plane.api()
    capacity = eventually(
        partial(_capacity, admin, REAL_NODE), timeout_s=WAIT_S, what=f"{SIM_GPUS} {GPU_RESOURCE} on the Node"
    )
    assert capacity[GPU_RESOURCE] == str(SIM_GPUS)
    kubelet_log = (control_plane.logs / "kubelet.log").read_text(errors="replace")
    assert f'Got registration request from device plugin with resource name "{GPU_RESOURCE}"' in kubelet_log

    def published() -> str | None:
        node = admin.get(f"/api/v1/nodes/{REAL_NODE}")
        value = node["metadata"].get("annotations", {}).get(NODE_STATE_ANNOTATION)
        return str(value) if value else None

    # The agent, with the chart's RBAC and nothing more, publishes the annotation the extender reads.
    state = decode(
        eventually(published, timeout_s=WAIT_S, what="the agent's node-state annotation"), node=REAL_NODE
    )
    assert len(state.gpus) == SIM_GPUS


def test_pod_requesting_a_gpu_runs_with_the_allocated_device(
    node_with_agent: RealNode, control_plane: ControlPlane
) -> None:
    admin = control_plane.api()
    eventually(partial(_capacity, admin, REAL_NODE), timeout_s=WAIT_S, what=f"{GPU_RESOURCE} on the Node")
    body = pod_body(
        "gpu-pod",
        limits={GPU_RESOURCE: "1"},
        node_name=REAL_NODE,  # no scheduler in this module: the kubelet admits it directly
        host_network=True,
        command=["/bin/sh", "-c", 'echo "visible=$NVIDIA_VISIBLE_DEVICES"; sleep 3600'],
    )
    create_pod(admin, NAMESPACE, body)

    def running() -> dict[str, Any] | None:
        pod = get_pod(admin, NAMESPACE, "gpu-pod")
        return pod if pod["status"].get("phase") == "Running" else None

    eventually(running, timeout_s=WAIT_S, what="gpu-pod Running")

    def output() -> str | None:
        text = node_with_agent.container_log(NAMESPACE, "gpu-pod", "main")
        return text if "visible=" in text else None

    # The device plugin's Allocate answer reached the container: a GPU's UUID in its environment.
    line = eventually(output, timeout_s=WAIT_S, what="the pod's output")
    assert "visible=GPU-" in line, line
