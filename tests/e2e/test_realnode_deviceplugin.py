"""`gpunode agent --backend sim` as the device plugin of a real kubelet 1.36 (containerd 2.2, runc 1.4).

The kubelet registers the Node with the real API server; the agent registers its plugins over the
kubelet's real Registration socket (GPUs 0 and 1 as gpunode.io/gpu-memory units, 2 and 3 whole); the
Node's capacity then shows both resources, the agent publishes the node-state annotation with the
chart's agent RBAC, and a pod asking for a GPU runs (hostNetwork, the local busybox image) with the
device the plugin allocated in its environment.

A fractional pod runs tests/e2e/capprobe.c under the interposer and the tests' fake libcuda (from an
image built here: the program, the fake driver and the host's libc), with exactly the environment and
mounts of Allocate's answer, set up by the kubelet and runc: its allocations stop at its cap. An XID
injected into its simulated GPU gets it evicted through the real API server with one policy/v1 Eviction
(the audit log shows its body, and no refused one) and the kubelet stops it. A kubelet restart is
followed by the agent's re-registration.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.contract.names import GPU_RESOURCE, NODE_STATE_ANNOTATION
from gpunode.contract.nodestate import decode
from tests.e2e import chart
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.capped import (
    CAPPED_IMAGE,
    PROBE_IN_IMAGE,
    ProbeReport,
    build_capped_image,
    container_memory,
    probe_report,
    toolchain_missing_reason,
)
from tests.e2e.conftest import E2E_USERS, REAL_NODE
from tests.e2e.controlplane import ControlPlane
from tests.e2e.node import RealNode, node_missing_reason
from tests.e2e.objects import create_pod, ensure_namespace, get_pod, pod_body
from tests.e2e.procs import Proc
from tests.ports import free_port

NAMESPACE = "e2e-node"
WAIT_S = 180.0  # generous: pods start in seconds, but the two cores are shared
SIM_GPUS = 4  # the t4 profile
WHOLE_GPUS = 2  # GPUs 2 and 3; 0 and 1 are shared as memory units
MEM_RESOURCE = "gpunode.io/gpu-memory"
GIB = 2**30
T4_BYTES = 15360 * 2**20
MEM_UNITS = 2 * (T4_BYTES // GIB)
CUDA_OUT_OF_MEMORY = 2
FATAL_XID = 79  # fell off the bus: fatal in the default health settings
SIM_CLI = (sys.executable, "-m", "gpunode.cli", "sim")
REGISTERED = "Got registration request from device plugin with resource"  # kubelet's log, resourceName="..."


@dataclass
class AgentNode:
    """The real node, and where to reach the agent that is its device plugin."""

    node: RealNode
    metrics_url: str
    sim_socket: Path


@pytest.fixture(scope="module")
def node_with_agent(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentNode]:
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
        metrics_port = free_port()
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
                "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
                "fractional": {"devices": [0, 1], "unit": "1Gi"},
                "simControlSocket": str(tmp / "sim.sock"),
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
            yield AgentNode(node, f"http://127.0.0.1:{metrics_port}/metrics", tmp / "sim.sock")
        finally:
            agent.stop()
    finally:
        node.stop()


def _capacity(api: Api, name: str) -> dict[str, Any] | None:
    node = api.get(f"/api/v1/nodes/{name}")
    capacity: dict[str, Any] = node["status"].get("capacity", {})
    wanted = capacity.get(GPU_RESOURCE) == str(WHOLE_GPUS) and capacity.get(MEM_RESOURCE) == str(MEM_UNITS)
    return capacity if wanted else None


def test_agent_registers_with_the_real_kubelet_and_the_node_advertises_its_gpus(
    node_with_agent: AgentNode, control_plane: ControlPlane
) -> None:
    admin = control_plane.api()
    capacity = eventually(
        partial(_capacity, admin, REAL_NODE),
        timeout_s=WAIT_S,
        what=f"{WHOLE_GPUS} {GPU_RESOURCE} and {MEM_UNITS} {MEM_RESOURCE} on the Node",
    )
    assert (capacity[GPU_RESOURCE], capacity[MEM_RESOURCE]) == (str(WHOLE_GPUS), str(MEM_UNITS))
    kubelet_log = (control_plane.logs / "kubelet.log").read_text(errors="replace")
    for resource in (GPU_RESOURCE, MEM_RESOURCE):
        assert f'{REGISTERED}" resourceName="{resource}"' in kubelet_log

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
    node_with_agent: AgentNode, control_plane: ControlPlane
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
        text = node_with_agent.node.container_log(NAMESPACE, "gpu-pod", "main")
        return text if "visible=" in text else None

    # The device plugin's Allocate answer reached the container: a GPU's UUID in its environment.
    line = eventually(output, timeout_s=WAIT_S, what="the pod's output")
    assert "visible=GPU-" in line, line


@pytest.fixture(scope="module")
def capped_image(node_with_agent: AgentNode, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The capprobe image (tests/e2e/capped.py), loaded into the node's containerd."""
    reason = toolchain_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    node_with_agent.node.import_image(build_capped_image(tmp_path_factory.mktemp("capped-image")))
    return CAPPED_IMAGE


def _run_capped_pod(admin: Api, node: RealNode, name: str, image: str, units: int) -> ProbeReport:
    """Start a pod asking for `units` memory units that runs capprobe; its report once it has one."""
    body = pod_body(
        name,
        limits={MEM_RESOURCE: str(units)},
        node_name=REAL_NODE,
        host_network=True,
        image=image,
        command=[PROBE_IN_IMAGE, str(256 * 2**20), name],  # the name: to find its process
        env={"FAKE_CUDA_TOTAL_BYTES": str(T4_BYTES), "GPUNODE_MEMCAP_LOG_LEVEL": "info"},
    )
    create_pod(admin, NAMESPACE, body)
    return eventually(
        lambda: probe_report(node.container_log(NAMESPACE, name, "main")),
        timeout_s=WAIT_S,
        what=f"{name}'s report",
    )


def test_fractional_pod_is_capped_inside_its_container(
    node_with_agent: AgentNode, capped_image: str, control_plane: ControlPlane
) -> None:
    admin = control_plane.api()
    eventually(partial(_capacity, admin, REAL_NODE), timeout_s=WAIT_S, what=f"{MEM_RESOURCE} on the Node")
    report = _run_capped_pod(admin, node_with_agent.node, "capped", capped_image, units=2)
    log = node_with_agent.node.container_log(NAMESPACE, "capped", "main")
    # The device has 15 GiB: only the interposer, loaded from the kubelet's mount, stops it at 2 GiB.
    assert report.uuid.startswith("GPU-"), log
    assert (report.allocated, report.refused_with) == (2 * GIB, CUDA_OUT_OF_MEMORY), log
    assert report.total == 2 * GIB, "cuMemGetInfo shows the cap as the GPU's size"
    # The agent reads the same region: the pod's usage and cap, attributed through pod-resources.
    charged = eventually(
        lambda: m if (m := container_memory(node_with_agent.metrics_url, "capped")) and m[0] > 0 else None,
        timeout_s=WAIT_S,
        what="the capped pod's memory in the agent's metrics",
    )
    assert charged == (2 * GIB, 2 * GIB)


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _evictions(control_plane: ControlPlane, pod: str) -> list[dict[str, Any]]:
    return [
        e
        for e in control_plane.audit_events()
        if e.get("objectRef", {}).get("subresource") == "eviction" and e["objectRef"].get("name") == pod
    ]


def test_xid_gets_the_pod_evicted_through_the_real_api_server(
    node_with_agent: AgentNode, capped_image: str, control_plane: ControlPlane
) -> None:
    admin = control_plane.api()
    eventually(partial(_capacity, admin, REAL_NODE), timeout_s=WAIT_S, what=f"{MEM_RESOURCE} on the Node")
    victim = "xid-victim"
    report = _run_capped_pod(admin, node_with_agent.node, victim, capped_image, units=1)
    assert report.allocated == GIB
    assert _processes_with(victim), "the container's process runs on this machine"
    injected = subprocess.run(
        [
            *SIM_CLI,
            "xid",
            "--socket",
            str(node_with_agent.sim_socket),
            "--gpu",
            report.uuid,
            "--code",
            str(FATAL_XID),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert injected.returncode == 0, injected.stdout + injected.stderr

    def gone() -> bool:
        try:
            get_pod(admin, NAMESPACE, victim)
        except ApiError as exc:
            return exc.status == 404
        return False

    # The API server deletes the pod object only once the kubelet has stopped its container.
    eventually(gone, timeout_s=WAIT_S, what=f"{victim} evicted and gone")
    eventually(lambda: not _processes_with(victim), timeout_s=WAIT_S, what=f"{victim}'s process ended")
    agent_user = E2E_USERS["agent"].name
    events = [e for e in _evictions(control_plane, victim) if e["user"]["username"] == agent_user]
    accepted = [e for e in events if e["responseStatus"]["code"] == 201]
    assert len(accepted) == 1 and len(events) == 1, json.dumps(events)
    # One policy/v1 Eviction of that pod, by its UID, and no refused request of any version before it.
    sent = accepted[0]["requestObject"]
    assert (sent["apiVersion"], sent["kind"], sent["metadata"]["name"]) == (
        "policy/v1",
        "Eviction",
        victim,
    ), sent
    pod_uid = sent.get("deleteOptions", {}).get("preconditions", {}).get("uid")
    assert pod_uid, sent
    refused = [
        e
        for pod in (victim, "capped")
        for e in _evictions(control_plane, pod)
        if e["user"]["username"] == agent_user and e["responseStatus"]["code"] >= 400
    ]
    assert refused == [], json.dumps(refused)


def test_kubelet_restart_is_followed_by_re_registration(
    node_with_agent: AgentNode, capped_image: str, control_plane: ControlPlane
) -> None:
    admin = control_plane.api()
    node = node_with_agent.node
    eventually(partial(_capacity, admin, REAL_NODE), timeout_s=WAIT_S, what=f"{MEM_RESOURCE} on the Node")
    kubelet_log = control_plane.logs / "kubelet.log"
    before = kubelet_log.stat().st_size
    node.restart_kubelet()

    def registered_again() -> bool:
        with kubelet_log.open("rb") as f:
            f.seek(before)
            text = f.read().decode(errors="replace")
        return all(f'{REGISTERED}" resourceName="{r}"' in text for r in (GPU_RESOURCE, MEM_RESOURCE))

    eventually(registered_again, timeout_s=WAIT_S, what="both plugins registered with the new kubelet")
    eventually(partial(_capacity, admin, REAL_NODE), timeout_s=WAIT_S, what="the Node's GPU capacity")
    # The re-registered plugin serves Allocate: a new capped pod runs under its cap.
    report = _run_capped_pod(admin, node, "after-restart", capped_image, units=1)
    assert (report.allocated, report.refused_with) == (GIB, CUDA_OUT_OF_MEMORY)
