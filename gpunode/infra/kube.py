"""The few Kubernetes API calls the node agent makes, with errors translated into KubeError.

The agent reads one pod (for its UID), evicts pods through the Eviction API
(policy/v1, which honours PodDisruptionBudgets), deletes a pod when told to,
posts core/v1 Events, and patches its own Node (annotations, labels, taints,
conditions). Credentials come from the in-cluster service account when the
agent runs in a pod, otherwise from a kubeconfig, through the `kubernetes`
client library, which also handles TLS and token refresh.

Every call is synchronous, bounded by a request timeout, and made exactly once:
retrying and backing off is the caller's business (gpunode.node.health.remediation
runs these calls in worker threads so that a slow API server never blocks the
device plugin or the metrics). This module decides nothing about health and
never lists pods across the cluster.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import InClusterConfigLoader

from gpunode.errors import KubeError

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 10.0
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
COMPONENT = "gpunode"
RBAC_HINT = "check the agent's service account RBAC (docs/health.md lists the verbs it needs)"


class KubeApiError(KubeError):
    """The API server answered with an error status."""

    def __init__(self, message: str, *, status: int, reason: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        self.reason = reason


class KubeNotFound(KubeApiError):
    """404: the object does not exist (any more)."""


class KubeConflict(KubeApiError):
    """409: a precondition (UID, resourceVersion) did not hold."""


class EvictionBlocked(KubeApiError):
    """429 on an eviction: a PodDisruptionBudget does not allow it now."""

    default_hint = "the eviction is retried until the deadline; check the pod's PodDisruptionBudget"

    def __init__(self, message: str, *, retry_after_s: float | None) -> None:
        super().__init__(message, status=429, reason="TooManyRequests")
        self.retry_after_s = retry_after_s


class KubeUnreachable(KubeError):
    """No answer: connection refused, reset, or the request timed out."""

    default_hint = "check that the API server is reachable from the node (network policy, proxy, DNS)"


@dataclass(frozen=True)
class PodInfo:
    namespace: str
    name: str
    uid: str
    node_name: str
    phase: str
    deleting: bool  # metadata.deletionTimestamp is set


@dataclass(frozen=True)
class ObjectRef:
    """What an Event is about."""

    kind: str  # "Pod" | "Node"
    name: str
    namespace: str = ""  # empty for cluster-scoped objects
    uid: str = ""
    api_version: str = "v1"


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str  # NoSchedule | PreferNoSchedule | NoExecute


@dataclass(frozen=True)
class NodeCondition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status_message(body: bytes) -> tuple[str, str]:
    """(reason, message) of a metav1.Status body, or ("", raw text)."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return "", text.strip()[:300]
    if isinstance(data, dict):
        return str(data.get("reason", "")), str(data.get("message", text))[:500]
    return "", text[:300]


class KubeClient:
    """A small, typed wrapper around one `kubernetes` ApiClient."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
        self.api = api_client
        self.request_timeout_s = request_timeout_s
        self.host = api_client.configuration.host

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def for_host(
        cls, host: str, *, token: str | None = None, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    ) -> KubeClient:
        """A client for an explicit API server address (tests, `kubectl proxy`)."""
        conf = k8s.Configuration()
        conf.host = host.rstrip("/")
        if token:
            conf.api_key = {"authorization": token}
            conf.api_key_prefix = {"authorization": "Bearer"}
        return cls(_prepare(conf), request_timeout_s=request_timeout_s)

    @classmethod
    def from_environment(
        cls,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
        environ: Mapping[str, str] | None = None,
    ) -> KubeClient:
        """In-cluster service account when no kubeconfig is named and one is mounted, else a kubeconfig.

        In-cluster means KUBERNETES_SERVICE_HOST/PORT in `environ` (the process environment by
        default) and `token` and `ca.crt` in service_account_dir; the token is re-read as the
        kubelet rotates it. Raises KubeError naming both sources when neither can be loaded.
        """
        conf = k8s.Configuration()
        in_cluster_error: str | None = None
        if kubeconfig is None:
            loader = InClusterConfigLoader(
                token_filename=str(service_account_dir / "token"),
                cert_filename=str(service_account_dir / "ca.crt"),
                **({} if environ is None else {"environ": environ}),
            )
            try:
                loader.load_and_set(conf)
                return cls(_prepare(conf), request_timeout_s=request_timeout_s)
            except ConfigException as exc:
                in_cluster_error = str(exc)
        try:
            k8s_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=conf)
        except (ConfigException, OSError, TypeError, ValueError) as exc:
            where = kubeconfig or os.path.expanduser("~/.kube/config")
            tried = f"in-cluster service account ({in_cluster_error}); " if in_cluster_error else ""
            raise KubeError(
                f"no Kubernetes credentials: tried {tried}kubeconfig {where} ({exc})",
                hint=(
                    "run the agent in a pod with a service account, or set "
                    "gpunode.remediation.kubeconfig; or set gpunode.remediation.mode to baremetal or off"
                ),
            ) from None
        return cls(_prepare(conf), request_timeout_s=request_timeout_s)

    def close(self) -> None:
        self.api.close()

    # -- the one request path ----------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        content_type: str = "application/json",
        query: Sequence[tuple[str, str]] = (),
        what: str,
    ) -> tuple[int, Any, Mapping[str, str]]:
        """Make one request; return (status, decoded JSON body, headers) for 2xx, raise KubeError otherwise."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        m, url, hdrs, data, _ = self.api.param_serialize(
            method,
            path,
            query_params=list(query) or None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        timeout = (min(self.request_timeout_s, 5.0), self.request_timeout_s)
        try:
            resp = self.api.call_api(m, url, header_params=hdrs, body=data, _request_timeout=timeout)
            raw = resp.read()
        except ApiException as exc:  # raised by the REST layer for some transport problems
            raise KubeUnreachable(f"{what}: {exc.reason or exc}") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeUnreachable(
                f"{what}: the API server at {self.host} did not answer ({type(exc).__name__}: {exc})"
            ) from None
        status = resp.status
        if 200 <= status < 300:
            try:
                decoded = json.loads(raw) if raw else None
            except ValueError:
                decoded = None
            return status, decoded, dict(resp.headers or {})
        reason, message = _status_message(raw or b"")
        text = f"{what}: HTTP {status} {reason}: {message}".rstrip(": ")
        if status == 404:
            raise KubeNotFound(text, status=status, reason=reason)
        if status == 409:
            raise KubeConflict(text, status=status, reason=reason)
        if status in (401, 403):
            raise KubeApiError(text, status=status, reason=reason, hint=RBAC_HINT)
        if status == 429:
            retry_after = _retry_after_s(resp.headers)
            raise (
                EvictionBlocked(text, retry_after_s=retry_after)
                if "eviction" in path
                else KubeApiError(
                    text,
                    status=status,
                    reason=reason,
                    hint="the API server is throttling; the call is retried",
                )
            )
        raise KubeApiError(text, status=status, reason=reason)

    # -- pods ------------------------------------------------------------------------------

    def get_pod(self, namespace: str, name: str) -> PodInfo:
        _, pod, _ = self._request(
            "GET", f"/api/v1/namespaces/{namespace}/pods/{name}", what=f"get pod {namespace}/{name}"
        )
        meta = (pod or {}).get("metadata", {})
        return PodInfo(
            namespace=namespace,
            name=name,
            uid=str(meta.get("uid", "")),
            node_name=str((pod or {}).get("spec", {}).get("nodeName", "")),
            phase=str((pod or {}).get("status", {}).get("phase", "")),
            deleting=bool(meta.get("deletionTimestamp")),
        )

    def evict_pod(
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
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if delete_options:
            body["deleteOptions"] = delete_options
        self._request(
            "POST",
            f"/api/v1/namespaces/{namespace}/pods/{name}/eviction",
            body=body,
            what=f"evict pod {namespace}/{name}",
        )

    def delete_pod(
        self, namespace: str, name: str, *, uid: str | None = None, grace_period_s: int | None = None
    ) -> None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        self._request(
            "DELETE",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            body=body,
            what=f"delete pod {namespace}/{name}",
        )

    # -- events ----------------------------------------------------------------------------

    def post_event(
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
        now = _now_rfc3339()
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
        self._request(
            "POST",
            f"/api/v1/namespaces/{namespace}/events",
            body=body,
            what=f"post event {reason} on {about.kind} {about.name}",
        )

    # -- the node --------------------------------------------------------------------------

    def get_node(self, name: str) -> dict[str, Any]:
        _, node, _ = self._request("GET", f"/api/v1/nodes/{name}", what=f"get node {name}")
        return node if isinstance(node, dict) else {}

    def patch_node_annotations(self, name: str, annotations: Mapping[str, str | None]) -> None:
        """Set (or, with None, remove) annotations with a JSON merge patch."""
        self._request(
            "PATCH",
            f"/api/v1/nodes/{name}",
            body={"metadata": {"annotations": dict(annotations)}},
            content_type="application/merge-patch+json",
            what=f"annotate node {name}",
        )

    def patch_node_labels(self, name: str, labels: Mapping[str, str | None]) -> None:
        """Set (or, with None, remove) labels with a JSON merge patch."""
        self._request(
            "PATCH",
            f"/api/v1/nodes/{name}",
            body={"metadata": {"labels": dict(labels)}},
            content_type="application/merge-patch+json",
            what=f"label node {name}",
        )

    def set_node_taint(self, name: str, key: str, taint: Taint | None, *, attempts: int = 3) -> None:
        """Add, replace (same key) or remove (None) one taint, guarded by the node's resourceVersion."""
        for attempt in range(attempts):
            node = self.get_node(name)
            version = str(node.get("metadata", {}).get("resourceVersion", ""))
            taints = [t for t in node.get("spec", {}).get("taints", []) or [] if t.get("key") != key]
            if taint is not None:
                taints.append({"key": taint.key, "value": taint.value, "effect": taint.effect})
            ops: list[dict[str, Any]] = [
                {"op": "test", "path": "/metadata/resourceVersion", "value": version}
            ]
            ops.append({"op": "add", "path": "/spec/taints", "value": taints})
            try:
                self._request(
                    "PATCH",
                    f"/api/v1/nodes/{name}",
                    body=ops,
                    content_type="application/json-patch+json",
                    what=f"taint node {name}",
                )
                return
            except KubeApiError as exc:
                if exc.status not in (409, 422) or attempt == attempts - 1:
                    raise
                log.debug("node %s changed while tainting it; retrying", name)

    def set_node_condition(self, name: str, condition: NodeCondition) -> None:
        """Set one node condition (merged by type) through the status subresource."""
        now = _now_rfc3339()
        cond = {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message[:1024],
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        self._request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            body={"status": {"conditions": [cond]}},
            content_type="application/strategic-merge-patch+json",
            what=f"set condition {condition.type} on node {name}",
        )


def _prepare(conf: k8s.Configuration) -> k8s.ApiClient:
    # gpunode retries with its own backoff; urllib3's own retries would multiply every timeout.
    conf.retries = False
    api = k8s.ApiClient(configuration=conf)
    api.user_agent = f"{COMPONENT}-agent"
    return api


def _retry_after_s(headers: Mapping[str, str] | None) -> float | None:
    if not headers:
        return None
    value = headers.get("Retry-After") or headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
