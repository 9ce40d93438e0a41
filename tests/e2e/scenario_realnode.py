"""The scenario's fifth node: a real kubelet v1.20 + containerd (tests.e2e.node.RealNode) whose device
plugin is `gpunode agent --backend sim` (a T4: GPUs 0 and 1 shared as 1 GiB memory units, 2 and 3
whole), publishing its node-state annotation with the chart's agent RBAC.

The Node is tainted REAL_TAINT so that only the pods meant for it land there: REAL_PODS carry a
toleration and a nodeSelector for its hostname, run the local busybox image with hostNetwork (the node
has loopback-only CNI) and print the NVIDIA_VISIBLE_DEVICES that the device plugin's Allocate answer
gave them. kube-scheduler places them through the extender like every other pod; the real kubelet
calls GetPreferredAllocation and Allocate itself.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpunode.contract.names import GPU_MEMORY_RESOURCE, GPU_RESOURCE, NODE_STATE_ANNOTATION
from tests.e2e.api import eventually
from tests.e2e.conftest import REAL_NODE
from tests.e2e.controlplane import ControlPlane
from tests.e2e.node import RealNode, node_missing_reason
from tests.e2e.objects import pod_body
from tests.e2e.procs import Proc
from tests.ports import free_port

WAIT_S = 180.0
REAL_TAINT = {"key": "gpunode.io/e2e-real-kubelet", "value": "true", "effect": "NoSchedule"}
# name -> limits. Two whole GPUs, all the node has whole, placed first, while the shared GPUs 0 and 1
# are still fully free: the node offers only GPUs 2 and 3 as nvidia.com/gpu and publishes servesWhole
# false for 0 and 1, so the extender must assign 2 and 3. Then the fractions of the two shared GPUs:
# two 8 GiB pods cannot share a 15 GiB GPU, so both shared GPUs hold one.
REAL_FRACTIONS: dict[str, dict[str, str]] = {
    "real-frac-0": {GPU_MEMORY_RESOURCE: "8"},
    "real-frac-1": {GPU_MEMORY_RESOURCE: "8"},
    "real-frac-2": {GPU_MEMORY_RESOURCE: "4"},
    "real-frac-3": {GPU_MEMORY_RESOURCE: "3"},
}
REAL_WHOLE: dict[str, dict[str, str]] = {
    "real-whole-0": {GPU_RESOURCE: "1"},
    "real-whole-1": {GPU_RESOURCE: "1"},
}
REAL_PODS = {**REAL_FRACTIONS, **REAL_WHOLE}
_VISIBLE = re.compile(r"visible=(\S*)")
# The real kubelet's E-lines that concern the device plugin or device allocation; kubelet 1.20 logs other
# E-lines here that are about this environment (no cAdvisor rootfs stats for the private mounts, no
# CNI networks, cgroup and eviction managers without a systemd host) and not about GPUs.
_KUBELET_ERROR = re.compile(r"^E\d{4} ")
_ABOUT_DEVICES = re.compile(
    r"device|plugin|alloc|gpunode|nvidia\.com|UnexpectedAdmission|topologymanager|podresources", re.I
)
# The CSI volume plugin (csi_plugin.go) retries CSINode's set-up until the kubelet has registered its Node
# and logs each failed try ("Failed to initialize CSINode ... nodes "X" not found"): not about devices
# (kubelet 1.36 names its source file in every line, so the file name alone matched "plugin").
_NOT_ABOUT_DEVICES = re.compile(r"^E\d{4} [^\]]* csi_plugin\.go:\d+\]")


@dataclass
class RealAgentNode:
    """The real node, its agent, and where the kubelet's log of this cluster starts."""

    node: RealNode
    agent: Proc
    kubelet_log_from: int

    @property
    def name(self) -> str:
        """The Node's name."""
        return self.node.name

    def stop(self) -> None:
        """Stop the agent, then the node (containers, containerd, the Node object)."""
        self.agent.stop()
        self.node.stop()


def start_real_node(cp: ControlPlane, tmp: Path) -> RealAgentNode | None:
    """Start the node and its agent and wait for its capacity and published state; None where a real
    node cannot run here (node_missing_reason)."""
    if node_missing_reason() is not None:
        return None
    log = cp.logs / "kubelet.log"
    start = log.stat().st_size if log.exists() else 0
    admin = cp.api()
    # Pods an earlier test left bound to this Node name (test_realnode_deviceplugin's) would come back
    # with the new kubelet and hold its GPUs: gone first (no kubelet runs for them, so at once).
    for pod in admin.get(f"/api/v1/pods?fieldSelector=spec.nodeName={REAL_NODE}")["items"]:
        meta = pod["metadata"]
        admin.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}?gracePeriodSeconds=0")
    node = RealNode(cp, REAL_NODE, tmp / "real")
    node.start()
    admin.patch(f"/api/v1/nodes/{REAL_NODE}", {"spec": {"taints": [REAL_TAINT]}})
    config = {
        "version": "v1",
        "flags": {"migStrategy": "none", "failOnInitError": True},
        "gpunode": {
            "backend": "sim",
            "simProfile": "t4",
            "kubeletDir": str(node.device_plugins),
            "stateDir": str(tmp / "real-agent-state"),
            "podResourcesSocket": str(node.pod_resources_socket),
            "nodeName": REAL_NODE,
            "metrics": {"listen": f"127.0.0.1:{free_port()}"},
            "fractional": {"devices": [0, 1], "unit": "1Gi"},
            "remediation": {"mode": "off", "kubeconfig": str(cp.kubeconfig("agent"))},
        },
    }
    (tmp / "real-agent.yaml").write_text(yaml.safe_dump(config))
    agent = Proc(
        f"gpunode-agent-{REAL_NODE}",
        [sys.executable, "-m", "gpunode.cli", "agent", "--config", str(tmp / "real-agent.yaml")],
        cp.logs,
    ).start()
    cp.procs.append(agent)
    real = RealAgentNode(node, agent, start)

    def ready() -> bool:
        got = admin.get(f"/api/v1/nodes/{REAL_NODE}")
        capacity = got["status"].get("capacity", {})
        return (
            capacity.get(GPU_RESOURCE) == "2"
            and capacity.get(GPU_MEMORY_RESOURCE) == "30"
            and NODE_STATE_ANNOTATION in got["metadata"].get("annotations", {})
        )

    try:
        eventually(ready, timeout_s=WAIT_S, what=f"{REAL_NODE}'s GPU capacity and published state")
    except BaseException:
        real.stop()
        raise
    return real


def real_pod(name: str, limits: dict[str, str]) -> dict[str, Any]:
    """A pod for the real node (see the module docstring)."""
    body = pod_body(
        name,
        limits=limits,
        host_network=True,
        command=["/bin/sh", "-c", 'echo "visible=$NVIDIA_VISIBLE_DEVICES"; sleep 3600'],
    )
    body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": REAL_NODE}
    body["spec"]["tolerations"] = [{**REAL_TAINT, "operator": "Equal"}]
    return body


def visible_devices(real: RealAgentNode, namespace: str, pod: str) -> list[str] | None:
    """The NVIDIA_VISIBLE_DEVICES the pod's container printed, None before it has."""
    m = _VISIBLE.search(real.node.container_log(namespace, pod, "main"))
    return [v for v in m[1].split(",") if v] if m else None


def kubelet_error_lines(real: RealAgentNode) -> list[str]:
    """The real kubelet's E-lines of this cluster about device plugins or device allocation."""
    with (real.node.cp.logs / "kubelet.log").open("rb") as f:
        f.seek(real.kubelet_log_from)
        text = f.read().decode(errors="replace")
    return [
        f"kubelet {real.name}: {line}"
        for line in text.splitlines()
        if _KUBELET_ERROR.match(line) and _ABOUT_DEVICES.search(line) and not _NOT_ABOUT_DEVICES.match(line)
    ]
