"""The real kube-scheduler (1.36) places GPU pods through `gpunode extender`, as the Helm chart sets them up.

What is real here: etcd, kube-apiserver with RBAC, kube-controller-manager, kube-scheduler, and the
extender as a subprocess of the `gpunode` command. The chart (rendered by helm) supplies the extender's
RBAC, applied to the API server, and kube-scheduler's whole configuration: its
kubescheduler.config.k8s.io/v1 KubeSchedulerConfiguration, used as the chart renders it but for the
extender's address and the certificates' paths, which name this test's. kube-scheduler and the extender
talk HTTPS with client certificates, as with extender.tls.enabled. The three Nodes are fake (no
kubelet): the test writes their status and the gpunode.io/gpu-state annotation an agent would publish,
and renews their Leases (tests/e2e/objects.py).
"""

from __future__ import annotations

import copy
import json
import ssl
import sys
import time
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.contract.names import ASSIGNMENT_ANNOTATION, GPU_RESOURCE, NODE_STATE_ANNOTATION
from gpunode.contract.nodestate import GpuRecord, NodeGpuState, encode
from tests.e2e import chart
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import ControlPlane
from tests.e2e.objects import create_fake_node, create_pod, ensure_namespace, get_pod, pod_body, pod_events
from tests.e2e.pki import CertFiles
from tests.e2e.procs import Proc
from tests.ports import free_port

GIB = 2**30
NAMESPACE = "e2e-extender"
FREE_GPUS = {"e2e-gpu-a": 4, "e2e-gpu-b": 2, "e2e-gpu-c": 1}  # of 4 GPUs each; the rest fully assigned
WAIT_S = 120.0  # generous: two shared cores


CHART_VALUES = {
    "extender": {
        "enabled": True,
        "bind": True,
        "nodeCacheCapable": True,
        "tls": {"enabled": True, "existingSecret": "gpunode-extender-tls"},
    }
}


def gpu_state(node: str, free: int) -> str:
    """The annotation an agent publishes for 4 80 GiB GPUs, the first `free` of them idle."""
    return encode(
        NodeGpuState(
            node=node,
            updated=time.time(),  # as an agent publishes it: fresh
            generation=1,
            gpus=tuple(
                GpuRecord(
                    uuid=f"GPU-{node}-{i}",
                    index=i,
                    model="NVIDIA A100-SXM4-80GB",
                    memory_total_bytes=80 * GIB,
                    milli_assigned=0 if i < free else 1000,
                    memory_assigned_bytes=0 if i < free else 80 * GIB,
                    pods=() if i < free else (f"other/holder-{i}",),
                )
                for i in range(4)
            ),
        )
    )


def _https_ok(url: str, ca: Path, cert: Path, key: Path) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
        return int(resp.status) == 200


def _extender_knows(port: int, client: CertFiles, ca: Path) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(client.cert), str(client.key))
    probe = {"Pod": pod_body("probe", limits={GPU_RESOURCE: "1"}), "NodeNames": sorted(FREE_GPUS)}
    req = urllib.request.Request(
        f"https://127.0.0.1:{port}/filter",
        data=json.dumps(probe).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
        result = json.loads(resp.read())
    return sorted(result.get("NodeNames") or []) == sorted(FREE_GPUS)


@pytest.fixture(scope="module")
def cluster(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The chart's RBAC applied, the extender running with it, the fake nodes, and kube-scheduler."""
    tmp = tmp_path_factory.mktemp("extender")
    docs = chart.render(CHART_VALUES, tmp)
    admin = control_plane.api()
    ensure_namespace(admin, NAMESPACE)
    ensure_namespace(admin, chart.NAMESPACE)
    assert chart.apply_rbac(admin, docs, "extender") == E2E_USERS["extender"].name

    # HTTPS both ways between kube-scheduler and the extender, from the control plane's CA.
    serving = control_plane.issue(
        "extender", common_name="gpunode-extender", server=True, hosts=("127.0.0.1",)
    )
    client = control_plane.issue("scheduler-client", common_name="kube-scheduler", client=True)
    port, health = free_port(), free_port()
    extender = Proc(
        "gpunode-extender",
        [
            sys.executable, "-m", "gpunode.cli", "extender",
            "--listen", f"127.0.0.1:{port}",
            "--health-listen", f"127.0.0.1:{health}",
            "--kube-api", control_plane.server,
            "--kube-token-file", str(control_plane.token_file("extender")),
            "--kube-ca-file", str(control_plane.ca_file),
            "--node-refresh", "1s",
            "--bind",
            "--tls-cert-file", str(serving.cert),
            "--tls-key-file", str(serving.key),
            "--client-ca-file", str(control_plane.ca_file),
            "--allowed-client-names", "kube-scheduler",
        ],
        control_plane.logs,
    ).start()  # fmt: skip
    control_plane.procs.append(extender)
    extender.wait_until(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=5).status == 200,
        timeout_s=WAIT_S,
        what="ready extender",
    )
    for node, free in FREE_GPUS.items():
        create_fake_node(
            admin,
            node,
            capacity={GPU_RESOURCE: "8"},
            annotations={NODE_STATE_ANNOTATION: gpu_state(node, free)},
        )

    # kube-scheduler retries a pod that every node failed only after its backoff or a cluster event: wait
    # until the extender's node refresh has seen the nodes (a filter call for a one-GPU pod passes all
    # three; with more than one node passing, filter reserves nothing), so the first attempt counts.
    eventually(
        partial(_extender_knows, port, client, control_plane.ca_file),
        timeout_s=WAIT_S,
        what="the extender's node cache holding the nodes",
    )

    # The chart's scheduler configuration, whole, with the extender's address and the certificates'
    # files where this test has them.
    config_map = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("scheduler-config")
    )
    chart_config = yaml.safe_load(config_map["data"]["scheduler-config.yaml"])
    assert chart_config["apiVersion"] == "kubescheduler.config.k8s.io/v1", chart_config["apiVersion"]
    config = copy.deepcopy(chart_config)
    entries = config["extenders"]
    assert len(entries) == 1 and entries[0]["bindVerb"] == "bind" and entries[0]["enableHTTPS"] is True
    assert entries[0]["preemptVerb"] == "preempt", entries[0]
    entries[0]["urlPrefix"] = f"https://127.0.0.1:{port}"
    entries[0]["tlsConfig"] = {
        "certFile": str(client.cert),
        "keyFile": str(client.key),
        "caFile": str(control_plane.ca_file),
    }
    scheduler = control_plane.start_scheduler(name="kube-scheduler-extender", config=config)
    # What kube-scheduler read is the chart's configuration: only those three settings differ, and the
    # harness added its client connection and leader election (which the chart leaves to the cluster).
    used = yaml.safe_load((control_plane.workdir / "kube-scheduler-extender.yaml").read_text())
    assert {k: v for k, v in used.items() if k not in ("clientConnection", "leaderElection")} == config
    differing = {k for k in chart_config["extenders"][0] if chart_config["extenders"][0][k] != entries[0][k]}
    assert differing == {"urlPrefix", "tlsConfig"}, differing
    assert {k: v for k, v in config.items() if k != "extenders"} == {
        k: v for k, v in chart_config.items() if k != "extenders"
    }
    try:
        yield {"extender": extender, "scheduler": scheduler, "port": port, "client": client}
    finally:
        for proc in (scheduler, extender):
            proc.stop()
        for node in FREE_GPUS:
            admin.delete(f"/api/v1/nodes/{node}")


def _bound_pod(api: Api, name: str) -> dict[str, Any] | None:
    pod = get_pod(api, NAMESPACE, name)
    return pod if pod["spec"].get("nodeName") else None


def test_extender_rbac_from_the_chart_is_enforced(
    cluster: dict[str, Any], control_plane: ControlPlane
) -> None:
    as_extender = control_plane.api("extender")
    assert as_extender.get("/api/v1/nodes")["items"]  # list nodes: granted (nodeCacheCapable)
    for path in ("/api/v1/secrets", f"/api/v1/namespaces/{NAMESPACE}/pods"):
        with pytest.raises(ApiError) as denied:
            as_extender.get(path)
        assert denied.value.status == 403


def test_extender_refuses_a_client_without_the_scheduler_certificate(
    cluster: dict[str, Any], control_plane: ControlPlane, tmp_path: Path
) -> None:
    # The attack: reach the bind port with a certificate from the right CA but the wrong name, and
    # with none at all. Neither gets an answer from the extender.
    stranger = control_plane.issue("stranger", common_name="not-the-scheduler", client=True)
    url = f"https://127.0.0.1:{cluster['port']}/filter"
    with pytest.raises(OSError):
        _https_ok(url, control_plane.ca_file, stranger.cert, stranger.key)
    with pytest.raises(OSError):
        urllib.request.urlopen(
            url, timeout=5, context=ssl.create_default_context(cafile=str(control_plane.ca_file))
        )


def test_whole_gpu_pods_are_bound_by_the_real_scheduler_through_the_extender(
    cluster: dict[str, Any], control_plane: ControlPlane
) -> None:
    admin = control_plane.api()
    names = [f"whole-{i}" for i in range(4)]
    for name in names:
        create_pod(admin, NAMESPACE, pod_body(name, limits={GPU_RESOURCE: "1"}))
    pods = [eventually(partial(_bound_pod, admin, n), timeout_s=WAIT_S, what=f"{n} bound") for n in names]
    chosen: list[tuple[str, str]] = []
    for pod in pods:
        node = pod["spec"]["nodeName"]
        assigned = pod["metadata"].get("annotations", {}).get(ASSIGNMENT_ANNOTATION)
        assert node in FREE_GPUS and assigned, pod["metadata"]
        # The extender bound it (its annotation is on the pod) to a GPU the node's annotation shows idle.
        uuids = [u for u in assigned.replace(",", " ").split() if u.startswith("GPU-")]
        assert len(uuids) == 1, assigned
        index = int(uuids[0].rsplit("-", 1)[1])
        assert uuids[0].startswith(f"GPU-{node}-") and index < FREE_GPUS[node], (node, assigned)
        chosen.append((node, uuids[0]))
    assert len(set(chosen)) == len(chosen), f"two pods were given the same GPU: {chosen}"

    def scheduled_events() -> list[dict[str, Any]] | None:
        # kube-scheduler records its Scheduled events asynchronously, after the binding.
        found = [e for n in names for e in pod_events(admin, NAMESPACE, n) if e.get("reason") == "Scheduled"]
        return found if len(found) == len(names) else None

    eventually(scheduled_events, timeout_s=WAIT_S, what="a Scheduled event for every pod")


def test_unfittable_pod_stays_pending_with_the_extenders_reason(
    cluster: dict[str, Any], control_plane: ControlPlane
) -> None:
    admin = control_plane.api()
    # kube-scheduler's own count (8 per node) lets 5 GPUs through; only the extender knows that no node
    # has 5 idle GPUs.
    create_pod(admin, NAMESPACE, pod_body("too-big", limits={GPU_RESOURCE: "5"}))

    def failed_with_reason() -> str | None:
        for event in pod_events(admin, NAMESPACE, "too-big"):
            message = str(event.get("message") or event.get("note") or "")
            if event.get("reason") == "FailedScheduling" and "insufficient whole GPUs" in message:
                return message
        return None

    message = eventually(
        failed_with_reason, timeout_s=WAIT_S, what="a FailedScheduling event from the extender"
    )
    assert "5 requested" in message and "0/3 nodes are available" in message, message
    pod = get_pod(admin, NAMESPACE, "too-big")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
    assert conditions["PodScheduled"]["status"] == "False", conditions
