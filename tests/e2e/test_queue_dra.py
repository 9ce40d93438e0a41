"""The queue controller counts GPUs served through DRA, on a real Kubernetes 1.36.

What is real: kube-apiserver (the chart's RBAC for the queue controller and the agent's DRA part, the
chart's DeviceClasses), kube-scheduler's DRA allocator (which allocates the claims once the controller
removes the gate), `gpunode queue` with the chart Deployment's arguments, and gpunode's SlicePublisher
publishing the node's pool as the agent does. The node is fake (pods are bound, not run).

A governed pod whose claim holds a whole DRA GPU counts in its queue's usage (the controller's
gpunode_queue_gpus_used); a second governed DRA pod, over that queue's quota of one GPU, stays gated with
the quota reason, and is admitted once the first is gone. A pod whose claim comes from a template is
admitted by the claim the real resourceclaim controller makes for it while it is gated.
"""

from __future__ import annotations

import re
import sys
import urllib.request
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from gpunode.contract import dra as names
from gpunode.contract.names import (
    ADMISSION_GATE,
    GIB,
    QUEUE_LABEL,
    QUEUE_REASON_ANNOTATION,
)
from gpunode.infra.kube import KubeClient
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.order import ClaimUsage
from gpunode.node.dra.slices import SlicePublisher, build_pool
from tests.e2e import chart
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import KUBE_MINOR, ControlPlane
from tests.e2e.objects import create_dra_fake_node, ensure_namespace
from tests.e2e.procs import Proc
from tests.e2e.test_dra_placement import Loop
from tests.ports import free_port

pytestmark = pytest.mark.skipif(
    KUBE_MINOR < 36, reason=f"DRA mode needs Kubernetes 1.36+ (this is 1.{KUBE_MINOR})"
)
DRIVER = names.DEFAULT_DRIVER
NAMESPACE = "e2e-queue-dra"
NODE = "e2e-queue-dra-t4"
RESOURCE = "/apis/resource.k8s.io/v1"
WAIT_S = 120.0
QUEUES = """\
queues:
  - name: team-dra
    guarantee: {gpu: 1}
    borrowLimit: {gpu: 0}
  - name: team-other
"""


@pytest.fixture(scope="module")
def cluster(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The chart's DeviceClasses and RBAC; one fake T4 node (4 GPUs, all served through DRA) whose pool the
    agent's publisher keeps; kube-scheduler; `gpunode queue` as the chart runs it, with the queues above."""
    tmp = tmp_path_factory.mktemp("queue-dra")
    docs = chart.render(
        {"config": {"gpunode": {"dra": {"enabled": True}}}, "queue": {"enabled": True, "resync": "1s"}}, tmp
    )
    admin = control_plane.api()
    ensure_namespace(admin, chart.NAMESPACE)
    ensure_namespace(admin, NAMESPACE)
    assert chart.apply_rbac(admin, docs, "agent-dra") == E2E_USERS["agent"].name
    assert chart.apply_rbac(admin, docs, "queue") == E2E_USERS["queue"].name
    classes = [d for d in docs if d["kind"] == "DeviceClass"]
    for c in classes:
        admin.apply(f"{RESOURCE}/deviceclasses", c)
    backend = SimBackend.from_profile("t4")
    gpus = tuple(backend.gpus())
    create_dra_fake_node(admin, NODE, backend)

    def client() -> KubeClient:
        return KubeClient.for_host(
            control_plane.server, token_file=control_plane.token_file("agent"), ca_file=control_plane.ca_file
        )

    order = ClaimUsage(client_factory=client, node_name=NODE, driver=DRIVER, retry_s=1.0)
    pool = build_pool(gpus, unit_bytes=GIB, driver_version=backend.driver_version())
    publisher = SlicePublisher(
        client_factory=client, node_name=NODE, driver=DRIVER, pool=lambda: pool, order=order
    )
    loop = Loop()
    loop.start(publisher.run())
    config = tmp / "queues.yaml"
    config.write_text(QUEUES)
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-queue"))
    args = [str(a) for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]]
    for flag in (
        "--admission-key-file",
        "--webhook-listen",
        "--webhook-tls-cert-file",
        "--webhook-tls-key-file",
    ):
        if flag in args:
            del args[args.index(flag) : args.index(flag) + 2]
    assert args[args.index("--dra-driver") + 1] == DRIVER, args
    port = free_port()
    args[args.index("--config") + 1] = str(config)
    args[args.index("--metrics-listen") + 1] = f"127.0.0.1:{port}"
    args[args.index("--usage-configmap") + 1] = ""
    args += [
        "--kube-api", control_plane.server,
        "--kube-token-file", str(control_plane.token_file("queue")),
        "--kube-ca-file", str(control_plane.ca_file),
    ]  # fmt: skip
    proc = Proc("gpunode-queue-dra", [sys.executable, "-m", "gpunode.cli", *args], control_plane.logs)
    proc.start()
    control_plane.procs.append(proc)
    scheduler = control_plane.start_scheduler(name="kube-scheduler-queue-dra")
    try:
        proc.wait_until(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200,
            timeout_s=WAIT_S,
            what="its /healthz",
        )
        yield {"admin": admin, "port": port, "proc": proc}
    finally:
        proc.stop()
        scheduler.stop()
        loop.stop()
        admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods")
        admin.delete(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims")
        admin.delete(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaimtemplates")
        admin.delete(f"/api/v1/nodes/{NODE}")
        for c in classes:
            admin.delete(f"{RESOURCE}/deviceclasses/{c['metadata']['name']}")


def submit(api: Api, name: str) -> None:
    """A whole-GPU claim and a pod of team-dra using it, gated as the chart's webhook creates it."""
    api.create(
        f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": f"c-{name}"},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": names.CLASS_WHOLE}}]}
            },
        },
    )
    api.create(
        f"/api/v1/namespaces/{NAMESPACE}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {QUEUE_LABEL: "team-dra"}},
            "spec": {
                "schedulingGates": [{"name": ADMISSION_GATE}],
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "resourceClaims": [{"name": "gpu", "resourceClaimName": f"c-{name}"}],
                "containers": [
                    {
                        "name": "main",
                        "image": "gpunode.local/none:1",
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": False,
            },
        },
    )


def pod(api: Api, name: str) -> dict[str, Any]:
    return dict(api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}"))


def bound_with_device(api: Api, name: str) -> str | None:
    """The device kube-scheduler allocated to the pod's claim, once the pod is bound."""
    if not pod(api, name)["spec"].get("nodeName"):
        return None
    c = api.get(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/c-{name}")
    results = ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
    return str(results[0]["device"]) if results else None


def gpus_used(port: int, queue: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf'^gpunode_queue_gpus_used\{{queue="{queue}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def test_a_dra_gpu_counts_in_its_queue_and_the_next_pod_waits_over_the_quota(cluster: dict[str, Any]) -> None:
    api: Api = cluster["admin"]
    port: int = cluster["port"]
    submit(api, "first")
    eventually(partial(bound_with_device, api, "first"), timeout_s=WAIT_S, what="first allocated and bound")
    assert eventually(
        lambda: gpus_used(port, "team-dra") == 1.0 or None, timeout_s=WAIT_S, what="team-dra holding 1 GPU"
    )
    submit(api, "second")

    def reason() -> str | None:
        return pod(api, "second")["metadata"].get("annotations", {}).get(QUEUE_REASON_ANNOTATION)

    text = eventually(reason, timeout_s=WAIT_S, what="second's queue-reason")
    assert "team-dra is over its quota: it holds 1 GPU of at most 1 GPU" in text, text
    second = pod(api, "second")
    assert second["spec"].get("schedulingGates") == [{"name": ADMISSION_GATE}] and not second["spec"].get(
        "nodeName"
    )
    claim = api.get(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/c-second")
    assert not (claim.get("status") or {}).get("allocation"), claim["status"]
    assert gpus_used(port, "team-dra") == 1.0
    # the first ends: its GPU is no longer counted, and the second is admitted and allocated
    delete(api, "first")
    eventually(partial(bound_with_device, api, "second"), timeout_s=WAIT_S, what="second allocated and bound")
    assert not pod(api, "second")["metadata"].get("annotations", {}).get(QUEUE_REASON_ANNOTATION)
    assert gpus_used(port, "team-dra") == 1.0
    delete(api, "second")
    assert eventually(
        lambda: gpus_used(port, "team-dra") == 0.0 or None, timeout_s=WAIT_S, what="team-dra holding none"
    )


def delete(api: Api, name: str) -> None:
    """Delete a pod at once and wait until it is gone."""
    api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", {"gracePeriodSeconds": 0})

    def gone() -> bool:
        try:
            pod(api, name)
        except ApiError as exc:
            return exc.status == 404
        return False

    eventually(gone, timeout_s=WAIT_S, what=f"{name} deleted")


def test_a_pod_with_a_claim_template_is_admitted_by_the_claim_made_for_it(cluster: dict[str, Any]) -> None:
    """A claim template's claim is made by the real resourceclaim controller while the pod is gated; the
    controller reads its request (one whole GPU) and admits the pod within team-dra's quota."""
    api: Api = cluster["admin"]
    api.create(
        f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaimtemplates",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-gpu"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": names.CLASS_WHOLE}}]
                    }
                }
            },
        },
    )
    api.create(
        f"/api/v1/namespaces/{NAMESPACE}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "templated", "labels": {QUEUE_LABEL: "team-dra"}},
            "spec": {
                "schedulingGates": [{"name": ADMISSION_GATE}],
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
                "containers": [
                    {
                        "name": "main",
                        "image": "gpunode.local/none:1",
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": False,
            },
        },
    )

    def bound() -> str | None:
        p = pod(api, "templated")
        made = (p.get("status") or {}).get("resourceClaimStatuses") or []
        return p["spec"].get("nodeName") if made else None

    assert (
        eventually(bound, timeout_s=WAIT_S, what="templated admitted, its claim made and allocated") == NODE
    )
    assert eventually(
        lambda: gpus_used(cluster["port"], "team-dra") == 1.0 or None, timeout_s=WAIT_S, what="1 GPU counted"
    )
    delete(api, "templated")
