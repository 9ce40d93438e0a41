"""Nodes and pods on the real API server: fake Nodes that the scheduler takes for ready ones, pods, and the
Events recorded about them."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from tests.e2e.api import STRATEGIC, Api

NOT_READY_TAINT = "node.kubernetes.io/not-ready"
BASE_CAPACITY = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def create_fake_node(
    api: Api,
    name: str,
    *,
    capacity: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Node with no kubelet behind it: created, its status written (capacity, allocatable, Ready) and
    the not-ready taint removed, so that kube-scheduler places pods on it. Returns the Node."""
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
    return remove_not_ready_taint(api, name)


def write_ready_status(api: Api, name: str, capacity: Mapping[str, str]) -> None:
    """Write a Node's status as a kubelet would: capacity = allocatable, Ready, an address."""
    now = _now()
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
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "written by the e2e test",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
            }
        },
        content_type=STRATEGIC,
    )


def remove_not_ready_taint(api: Api, name: str) -> dict[str, Any]:
    """Drop node.kubernetes.io/not-ready (a kubelet adds it; kube-controller-manager would remove it)."""
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
    """Create a namespace unless it exists."""
    api.apply("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
