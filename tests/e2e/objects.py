"""Nodes and pods on the real API server: fake Nodes that the scheduler takes for ready ones, pods, and the
Events recorded about them.

A fake Node has no kubelet, so the test does what one does: it writes the Node's status once and renews
the Node's Lease (kube-node-lease) every few seconds from a daemon thread, so that kube-controller-manager's
node lifecycle controller keeps taking it for a live node (without a renewed Lease it marks the Node
Unknown after its grace period, taints it unreachable and evicts its pods). Should a renewal still come
late (a loaded machine), the thread posts Ready again as a kubelet would on its next status update, and
says so on stderr: the controller then lifts the taints (a Node left Unknown would stay unschedulable).
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from gpunode.contract.names import GIB, NODE_STATE_ANNOTATION, Sharing
from gpunode.contract.nodestate import encode
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.placement import GpuState, NodeState
from gpunode.placement.published import published_state
from tests.e2e.api import MERGE, STRATEGIC, Api, ApiError, eventually

NOT_READY_TAINT = "node.kubernetes.io/not-ready"
BASE_CAPACITY = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
NODE_LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
LEASE_RENEW_S = 5.0
NAMESPACE_WAIT_S = 60.0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _NodeHeartbeats:
    """Renews the Lease of every fake Node (see the module docstring) until the Node is gone."""

    def __init__(self) -> None:
        self._nodes: dict[tuple[str, str], Api] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, api: Api, name: str) -> None:
        """Create (or take over) the Node's Lease and keep renewing it."""
        node = api.get(f"/api/v1/nodes/{name}")
        owner = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}
        api.apply(
            f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases",
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": name, "namespace": NODE_LEASE_NAMESPACE, "ownerReferences": [owner]},
                "spec": {
                    "holderIdentity": name,
                    "leaseDurationSeconds": LEASE_DURATION_S,
                    "renewTime": _micro_now(),
                },
            },
        )
        with self._lock:
            self._nodes[(api.server, name)] = api
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fake-node-heartbeats", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(LEASE_RENEW_S)
            with self._lock:
                nodes = list(self._nodes.items())
            for (server, name), api in nodes:
                try:
                    api.patch(
                        f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases/{name}",
                        {"spec": {"renewTime": _micro_now()}},
                        content_type=MERGE,
                    )
                    node = api.get(f"/api/v1/nodes/{name}")
                    if not _ready(node):
                        # The node lifecycle controller marked it Unknown (a renewal came late on a loaded
                        # machine) and tainted it unreachable: as a kubelet does, post Ready again, so the
                        # controller lifts the taints instead of the node staying unschedulable for good.
                        print(
                            f"fake node {name}: Ready was {_ready_status(node)}; posting Ready again",
                            file=sys.stderr,
                        )
                        _post_ready(api, name)
                except ApiError as exc:
                    if exc.status == 404:  # the Node (or its Lease, collected with it) is gone
                        with self._lock:
                            self._nodes.pop((server, name), None)
                except OSError:
                    continue  # the API server is stopping or busy: the next round tries again


_HEARTBEATS = _NodeHeartbeats()


def create_fake_node(
    api: Api,
    name: str,
    *,
    capacity: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Node with no kubelet behind it: created, its status written (capacity, allocatable, Ready), its
    Lease renewed from now on, and the not-ready taint (added by the TaintNodesByCondition admission
    plugin) removed at once rather than at the node lifecycle controller's next pass, so that
    kube-scheduler places pods on it. Returns the Node."""
    api.create(
        "/api/v1/nodes",
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})},
                "annotations": dict(annotations or {}),
            },
        },
    )
    write_ready_status(api, name, {**BASE_CAPACITY, **(capacity or {})})
    _HEARTBEATS.add(api, name)
    return remove_not_ready_taint(api, name)


def _ready_status(node: Mapping[str, Any]) -> str:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("status"))
    return "absent"


def _ready(node: Mapping[str, Any]) -> bool:
    return _ready_status(node) == "True"


def _ready_condition() -> dict[str, str]:
    now = _now()
    return {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "written by the e2e test",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


def _post_ready(api: Api, name: str) -> None:
    """Set the Node's Ready condition to True again (conditions merge by type)."""
    api.patch(
        f"/api/v1/nodes/{name}/status",
        {"status": {"conditions": [_ready_condition()]}},
        content_type=STRATEGIC,
    )


def write_ready_status(api: Api, name: str, capacity: Mapping[str, str]) -> None:
    """Write a Node's status as a kubelet would: capacity = allocatable, Ready, an address."""
    api.patch(
        f"/api/v1/nodes/{name}/status",
        {
            "status": {
                "capacity": dict(capacity),
                "allocatable": dict(capacity),
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": name},
                ],
                "conditions": [_ready_condition()],
            }
        },
        content_type=STRATEGIC,
    )


def remove_not_ready_taint(api: Api, name: str) -> dict[str, Any]:
    """Drop node.kubernetes.io/not-ready from a Node that is Ready (the node lifecycle controller would
    remove it too, at its next pass)."""
    node: dict[str, Any] = api.get(f"/api/v1/nodes/{name}")
    taints = node.get("spec", {}).get("taints") or []
    kept = [t for t in taints if t.get("key") != NOT_READY_TAINT]
    if len(kept) != len(taints):
        node = api.patch(f"/api/v1/nodes/{name}", {"spec": {"taints": kept or None}})
    return node


def set_node_annotation(api: Api, name: str, key: str, value: str | None) -> dict[str, Any]:
    """Set (or with None remove) one annotation on a Node."""
    result: dict[str, Any] = api.patch(f"/api/v1/nodes/{name}", {"metadata": {"annotations": {key: value}}})
    return result


def pod_body(
    name: str,
    *,
    limits: Mapping[str, str] | None = None,
    requests: Mapping[str, str] | None = None,
    image: str = "gpunode.local/pause-busybox:1",
    command: Sequence[str] | None = None,
    node_name: str | None = None,
    host_network: bool = False,
    scheduler_name: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A one-container pod; extended resources go in `limits` (requests default to them)."""
    container: dict[str, Any] = {
        "name": "main",
        "image": image,
        "imagePullPolicy": "Never",
        "resources": {"limits": dict(limits or {}), "requests": dict(requests or limits or {})},
    }
    if command:
        container["command"] = list(command)
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    spec: dict[str, Any] = {
        "containers": [container],
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "enableServiceLinks": False,
    }
    if node_name:
        spec["nodeName"] = node_name
    if host_network:
        spec["hostNetwork"] = True
    if scheduler_name:
        spec["schedulerName"] = scheduler_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def create_pod(api: Api, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """Create a pod in `namespace`."""
    created: dict[str, Any] = api.create(f"/api/v1/namespaces/{namespace}/pods", body)
    return created


def get_pod(api: Api, namespace: str, name: str) -> dict[str, Any]:
    """Read a pod."""
    pod: dict[str, Any] = api.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    return pod


def pod_events(api: Api, namespace: str, name: str) -> list[dict[str, Any]]:
    """The core/v1 Events about a pod (kube-scheduler 1.20 writes events.k8s.io/v1 ones: the same objects)."""
    selector = quote(f"involvedObject.kind=Pod,involvedObject.name={name}")
    listed = api.get(f"/api/v1/namespaces/{namespace}/events?fieldSelector={selector}")
    return list(listed.get("items") or [])


def ensure_namespace(api: Api, name: str) -> None:
    """Create a namespace unless it exists, and wait for its default ServiceAccount (the ServiceAccount
    admission plugin refuses pods until kube-controller-manager has made it)."""
    api.apply("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    eventually(
        lambda: api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        timeout_s=NAMESPACE_WAIT_S,
        what=f"the default ServiceAccount of namespace {name}",
    )


def create_dra_fake_node(admin: Api, name: str, backend: SimBackend) -> None:
    """A fake node whose node-state annotation is the agent's for GPUs served through DRA: every GPU of
    `backend` `sharing: dra`, nothing held (its ResourceSlices are the caller's to publish)."""
    view = NodeState(
        name,
        tuple(
            GpuState(
                uuid=g.uuid,
                index=g.index,
                model=g.model,
                milli_free=1000,
                memory_total_bytes=g.memory_total_bytes,
                memory_free_bytes=g.memory_total_bytes,
                numa_node=g.numa_node,
                sharing=Sharing.DRA,
                serves_whole=False,
            )
            for g in backend.gpus()
        ),
        cpu_milli_free=8000,
        memory_free_bytes=64 * GIB,
    )
    create_fake_node(admin, name, annotations={NODE_STATE_ANNOTATION: encode(published_state(view))})
