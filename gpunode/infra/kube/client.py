"""KubeClient: the one asyncio Kubernetes client of gpunode, for the node agent, the extender and controllers.

Every call is a coroutine, bounded by the request timeout, and made exactly once:
retrying and backing off is the caller's business, except in watch(), which
keeps a list+watch going. Errors come out as the KubeError subclasses of
gpunode.errors (see gpunode.infra.kube.transport).

Objects read from the API server are lightkube's typed models (msgspec
structs); what the client writes is built here as JSON, field by field, so the
wire format is exactly the one the API documents. The client decides nothing
about health or placement.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import msgspec
from lightkube.resources.core_v1 import Node, Pod

from gpunode.errors import KubeApiError
from gpunode.infra.kube import config as kconfig
from gpunode.infra.kube.models import NodeCondition, ObjectRef, PodInfo, Taint, WatchEvent
from gpunode.infra.kube.transport import Transport, decode, resource_path
from gpunode.infra.kube.watch import list_and_watch

R = TypeVar("R")

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
COMPONENT = "gpunode"
LIST_CHUNK = 500
# The Eviction version: policy/v1, served from Kubernetes 1.22 on (gpunode supports 1.34 to 1.37).
EVICTION_VERSION = "policy/v1"


class _ListMeta(msgspec.Struct):
    resourceVersion: str | None = None
    continue_: str | None = msgspec.field(name="continue", default=None)


class _Page(msgspec.Struct):
    items: list[msgspec.Raw] | None = None
    metadata: _ListMeta | None = None


class KubeClient:
    """One API server: credentials, a connection pool, the request timeout. Close it with `await close()`."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.request_timeout_s = transport.request_timeout_s
        self.host = transport.host

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def for_host(
        cls,
        host: str,
        *,
        token: str | None = None,
        token_file: Path | None = None,
        ca_file: Path | None = None,
        request_timeout_s: float = kconfig.DEFAULT_REQUEST_TIMEOUT_S,
        user_agent: str = COMPONENT,
    ) -> KubeClient:
        """A client for an explicit API server address (tests, `kubectl proxy`, the extender's --kube-api).

        A token_file is re-read when the server answers 401, as rotated service-account tokens need.
        """
        config = kconfig.explicit(host, token=token, token_file=token_file, ca_file=ca_file)
        pool = kconfig.http_pool(config, request_timeout_s=request_timeout_s, user_agent=user_agent)
        return cls(Transport(pool, request_timeout_s=request_timeout_s))

    @classmethod
    def from_environment(
        cls,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        request_timeout_s: float = kconfig.DEFAULT_REQUEST_TIMEOUT_S,
        service_account_dir: Path = kconfig.SERVICE_ACCOUNT_DIR,
        environ: Mapping[str, str] | None = None,
        user_agent: str = f"{COMPONENT}-agent",
    ) -> KubeClient:
        """In-cluster service account when no kubeconfig is named and one is mounted, else a kubeconfig.

        In-cluster means KUBERNETES_SERVICE_HOST/PORT in `environ` (the process environment by
        default) and `token` and `ca.crt` in service_account_dir; the token is re-read as the
        kubelet rotates it. The kubeconfig is the one named, else $KUBECONFIG, else
        ~/.kube/config. Raises KubeError naming every source tried when none can be loaded.
        """
        config = kconfig.from_environment(
            kubeconfig=kubeconfig,
            context=context,
            service_account_dir=service_account_dir,
            environ=os.environ if environ is None else environ,
        )
        pool = kconfig.http_pool(config, request_timeout_s=request_timeout_s, user_agent=user_agent)
        return cls(Transport(pool, request_timeout_s=request_timeout_s))

    async def close(self) -> None:
        """Close the pooled connections; the client cannot be used afterwards."""
        await self.transport.close()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- typed reads -------------------------------------------------------------------------

    async def get(self, resource: type[R], name: str, *, namespace: str | None = None) -> R:
        """One object, as the resource's typed model."""
        what = f"get {resource.__name__.lower()} {namespace + '/' if namespace else ''}{name}"
        raw = await self.transport.request(
            "GET", f"{resource_path(resource, namespace)}/{quote(name, safe='')}", what=what
        )
        return decode(raw, resource, what)

    async def list_objects(
        self,
        resource: type[R],
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[R], str]:
        """Every matching object, typed (pages followed), and the resourceVersion the list was read at."""
        what = f"list {resource.__name__.lower()}s" + (f" in {namespace}" if namespace else "")
        items, version = await self._list_raw(resource, namespace, label_selector, field_selector, what)
        return [decode(item, resource, what) for item in items], version

    async def list_json(
        self,
        resource: type[Any],
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """As list_objects, the objects as plain v1 JSON: for readers that must tolerate an object
        the typed model refuses (a field missing that the model requires, from another API version)."""
        what = f"list {resource.__name__.lower()}s" + (f" in {namespace}" if namespace else "")
        items, version = await self._list_raw(resource, namespace, label_selector, field_selector, what)
        return [decode(item, dict[str, Any], what) for item in items], version

    async def _list_raw(
        self,
        resource: type[Any],
        namespace: str | None,
        label_selector: str | None,
        field_selector: str | None,
        what: str,
    ) -> tuple[list[msgspec.Raw], str]:
        params = {"limit": str(LIST_CHUNK)}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        items: list[msgspec.Raw] = []
        while True:
            raw = await self.transport.request(
                "GET", resource_path(resource, namespace), params=params, what=what
            )
            page = decode(raw, _Page, what)
            items.extend(page.items or ())
            meta = page.metadata or _ListMeta()
            if not meta.continue_:
                return items, meta.resourceVersion or ""
            params["continue"] = meta.continue_

    def watch(
        self,
        resource: type[R],
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        server_timeout_s: int = 300,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 30.0,
    ) -> AsyncGenerator[WatchEvent[R], None]:
        """List, then watch from the list's resourceVersion, for as long as the caller iterates.

        Yields a SYNC event with the whole collection first and after every re-list (a 410 Gone:
        the version is too old), then ADDED/MODIFIED/DELETED events. A watch the server ends is
        resumed from the last version seen; no answer or a server error is retried with
        backoff; any other error is raised. Iterate it inside contextlib.aclosing() so the
        stream is closed when the caller stops early.
        """
        return list_and_watch(
            self,
            resource,
            namespace=namespace,
            label_selector=label_selector,
            field_selector=field_selector,
            server_timeout_s=server_timeout_s,
            retry_initial_s=retry_initial_s,
            retry_max_s=retry_max_s,
        )

    # -- any object, as JSON (ResourceSlices and other objects the client has no typed call for) ------

    async def create_json(
        self, resource: type[Any], body: Mapping[str, Any], *, namespace: str | None = None
    ) -> dict[str, Any]:
        """Create an object (POST to its collection); the object as the API server stored it."""
        name = str(body.get("metadata", {}).get("name", ""))
        what = f"create {resource.__name__.lower()} {name}"
        raw = await self.transport.request(
            "POST", resource_path(resource, namespace), body=dict(body), what=what
        )
        return decode(raw, dict[str, Any], what)

    async def replace_json(
        self, resource: type[Any], body: Mapping[str, Any], *, namespace: str | None = None
    ) -> dict[str, Any]:
        """Replace an object (PUT; KubeConflict when metadata.resourceVersion is not the stored one)."""
        name = str(body["metadata"]["name"])
        what = f"replace {resource.__name__.lower()} {name}"
        raw = await self.transport.request(
            "PUT",
            f"{resource_path(resource, namespace)}/{quote(name, safe='')}",
            body=dict(body),
            what=what,
        )
        return decode(raw, dict[str, Any], what)

    async def get_json(
        self, resource: type[Any], name: str, *, namespace: str | None = None
    ) -> dict[str, Any]:
        """One object as plain JSON (ResourceClaims: read field by field, as the version served gives them)."""
        what = f"get {resource.__name__.lower()} {namespace + '/' if namespace else ''}{name}"
        raw = await self.transport.request(
            "GET", f"{resource_path(resource, namespace)}/{quote(name, safe='')}", what=what
        )
        return decode(raw, dict[str, Any], what)

    async def delete_json(
        self, resource: type[Any], name: str, *, namespace: str | None = None, resource_version: str = ""
    ) -> None:
        """Delete an object (only at this resourceVersion when one is given); KubeNotFound when gone."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if resource_version:
            body["preconditions"] = {"resourceVersion": resource_version}
        await self.transport.request(
            "DELETE",
            f"{resource_path(resource, namespace)}/{quote(name, safe='')}",
            body=body,
            what=f"delete {resource.__name__.lower()} {name}",
        )

    async def patch_json(
        self,
        resource: type[Any],
        name: str,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str = "",
        content_type: str = MERGE_PATCH,
    ) -> None:
        """Patch an object (a JSON merge patch unless `content_type` says otherwise; `subresource`: status)."""
        path = f"{resource_path(resource, namespace)}/{quote(name, safe='')}"
        if subresource:
            path += f"/{subresource}"
        where = f"{namespace}/{name}" if namespace else name
        await self.transport.request(
            "PATCH",
            path,
            body=dict(body),
            content_type=content_type,
            what=f"patch {resource.__name__.lower()}{f' {subresource}' if subresource else ''} {where}",
        )

    # -- pods ------------------------------------------------------------------------------

    async def get_pod(self, namespace: str, name: str) -> PodInfo:
        """The pod's UID, node, phase and whether it is terminating."""
        pod = await self.get(Pod, name, namespace=namespace)
        meta, spec, status = pod.metadata, pod.spec, pod.status
        return PodInfo(
            namespace=namespace,
            name=name,
            uid=(meta.uid if meta else None) or "",
            node_name=(spec.nodeName if spec else None) or "",
            phase=(status.phase if status else None) or "",
            deleting=meta is not None and meta.deletionTimestamp is not None,
        )

    async def evict_pod(
        self,
        namespace: str,
        name: str,
        *,
        uid: str | None = None,
        grace_period_s: int | None = None,
        dry_run: bool = False,
    ) -> None:
        """Ask for an eviction (policy/v1). Raises EvictionBlocked on 429 (a PDB), KubeNotFound when gone."""
        delete_options: dict[str, Any] = {}
        if uid:
            delete_options["preconditions"] = {"uid": uid}
        if grace_period_s is not None:
            delete_options["gracePeriodSeconds"] = grace_period_s
        if dry_run:
            delete_options["dryRun"] = ["All"]
        body: dict[str, Any] = {
            "apiVersion": EVICTION_VERSION,
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if delete_options:
            body["deleteOptions"] = delete_options
        await self.transport.request(
            "POST",
            f"{_pod_path(namespace, name)}/eviction",
            body=body,
            what=f"evict pod {namespace}/{name}",
            eviction=True,
        )

    async def delete_pod(
        self, namespace: str, name: str, *, uid: str | None = None, grace_period_s: int | None = None
    ) -> None:
        """Delete a pod, only if it still has this UID (KubeConflict otherwise)."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        await self.transport.request(
            "DELETE", _pod_path(namespace, name), body=body, what=f"delete pod {namespace}/{name}"
        )

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> None:
        """Set (or, with None, remove) a pod's annotations with a JSON merge patch."""
        await self.transport.request(
            "PATCH",
            _pod_path(namespace, name),
            body={"metadata": {"annotations": dict(annotations)}},
            content_type=MERGE_PATCH,
            what=f"annotate pod {namespace}/{name}",
        )

    async def patch_pod_spec(self, namespace: str, name: str, spec: Mapping[str, Any], *, what: str) -> None:
        """Change fields of a pod's spec with a JSON merge patch (lists are replaced whole; None removes a
        field). The API server allows few such changes: those of a pod that still has scheduling gates."""
        await self.transport.request(
            "PATCH",
            _pod_path(namespace, name),
            body={"spec": dict(spec)},
            content_type=MERGE_PATCH,
            what=f"{what} of pod {namespace}/{name}",
        )

    async def bind_pod(self, namespace: str, name: str, node: str, *, uid: str | None = None) -> None:
        """Bind a pod to a node (the pods/binding subresource), only if it still has this UID."""
        meta: dict[str, str] = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        await self.transport.request(
            "POST",
            f"{_pod_path(namespace, name)}/binding",
            body={
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": meta,
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            },
            what=f"bind pod {namespace}/{name} to {node}",
        )

    # -- events ----------------------------------------------------------------------------

    async def post_event(
        self,
        about: ObjectRef,
        *,
        reason: str,
        message: str,
        event_type: str = "Warning",
        host: str = "",
        action: str = "",
    ) -> None:
        """Create a core/v1 Event about a pod or a node (node Events go to the default namespace, like the kubelet's)."""
        namespace = about.namespace or "default"
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        involved: dict[str, str] = {"kind": about.kind, "name": about.name, "apiVersion": about.api_version}
        if about.namespace:
            involved["namespace"] = about.namespace
        if about.uid:
            involved["uid"] = about.uid
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{about.name}.{time.time_ns():x}", "namespace": namespace},
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": event_type,
            "source": {"component": COMPONENT, "host": host},
            "reportingComponent": f"{COMPONENT}.io/agent",
            "reportingInstance": host or COMPONENT,
            "action": action or reason,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self.transport.request(
            "POST",
            f"/api/v1/namespaces/{quote(namespace, safe='')}/events",
            body=body,
            what=f"post event {reason} on {about.kind} {about.name}",
        )

    # -- nodes -----------------------------------------------------------------------------

    async def get_node(self, name: str) -> Node:
        """One Node, typed."""
        return await self.get(Node, name)

    async def list_nodes(self) -> list[dict[str, Any]]:
        """Every Node of the cluster as v1 JSON (the extender's cache reads those, and skips a bad one)."""
        nodes, _ = await self.list_json(Node)
        return nodes

    async def patch_node_annotations(self, name: str, annotations: Mapping[str, str | None]) -> None:
        """Set (or, with None, remove) annotations with a JSON merge patch."""
        await self._merge_node_metadata(name, "annotations", annotations, what=f"annotate node {name}")

    async def patch_node_labels(self, name: str, labels: Mapping[str, str | None]) -> None:
        """Set (or, with None, remove) labels with a JSON merge patch."""
        await self._merge_node_metadata(name, "labels", labels, what=f"label node {name}")

    async def _merge_node_metadata(
        self, name: str, field: str, values: Mapping[str, str | None], *, what: str
    ) -> None:
        await self.transport.request(
            "PATCH",
            f"/api/v1/nodes/{quote(name, safe='')}",
            body={"metadata": {field: dict(values)}},
            content_type=MERGE_PATCH,
            what=what,
        )

    async def set_node_taint(self, name: str, key: str, taint: Taint | None, *, attempts: int = 3) -> None:
        """Add, replace (same key) or remove (None) one taint, guarded by the node's resourceVersion."""
        for attempt in range(attempts):
            node = await self.get_node(name)
            version = (node.metadata.resourceVersion if node.metadata else None) or ""
            current = (node.spec.taints if node.spec else None) or []
            taints: list[Any] = [msgspec.to_builtins(t) for t in current if t.key != key]
            if taint is not None:
                taints.append({"key": taint.key, "value": taint.value, "effect": taint.effect})
            ops = [
                {"op": "test", "path": "/metadata/resourceVersion", "value": version},
                {"op": "add", "path": "/spec/taints", "value": taints},
            ]
            try:
                await self.transport.request(
                    "PATCH",
                    f"/api/v1/nodes/{quote(name, safe='')}",
                    body=ops,
                    content_type=JSON_PATCH,
                    what=f"taint node {name}",
                )
                return
            except KubeApiError as exc:
                if exc.status not in (409, 422) or attempt == attempts - 1:
                    raise

    async def set_node_condition(self, name: str, condition: NodeCondition) -> None:
        """Set one node condition (merged by type) through the status subresource."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cond = {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message[:1024],
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        await self.transport.request(
            "PATCH",
            f"/api/v1/nodes/{quote(name, safe='')}/status",
            body={"status": {"conditions": [cond]}},
            content_type=STRATEGIC_MERGE_PATCH,
            what=f"set condition {condition.type} on node {name}",
        )


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
