"""The extender's calls to the Kubernetes API server: annotate a pod with its GPUs, bind it, list nodes.

Errors from the API server become KubeError at this edge.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from gpunode.cluster.extender.core import Extender
from gpunode.errors import ConfigError, KubeError

log = logging.getLogger(__name__)
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ASSIGNMENT_ANNOTATION = "gpunode.io/gpu-assigned"


class KubeApi:
    """A minimal Kubernetes API client: patch a pod's annotations, bind it, list nodes."""

    def __init__(
        self, base_url: str, *, token: str | None = None, ca_file: Path | None = None, timeout_s: float = 10.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._timeout = timeout_s
        self._context: ssl.SSLContext | None = None
        if self.base_url.startswith("https://"):
            try:
                self._context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"--kube-ca-file {ca_file}: cannot load: {exc}") from exc

    def _call(
        self, method: str, path: str, body: object = None, content_type: str = "application/json"
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        if self._token:
            req.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._context) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise KubeError(f"{method} {path}: HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise KubeError(f"{method} {path}: {exc}") from exc
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError as exc:
            raise KubeError(f"{method} {path}: the API server answered something that is not JSON") from exc

    def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
        ns, pod = urllib.parse.quote(namespace, safe=""), urllib.parse.quote(name, safe="")
        if gpu_uuids:
            patch = {"metadata": {"annotations": {ASSIGNMENT_ANNOTATION: ",".join(gpu_uuids)}}}
            self._call("PATCH", f"/api/v1/namespaces/{ns}/pods/{pod}", patch, "application/merge-patch+json")
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, **({"uid": uid} if "/" not in uid else {})},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        self._call("POST", f"/api/v1/namespaces/{ns}/pods/{pod}/binding", binding)

    def list_nodes(self) -> list[Any]:
        result = self._call("GET", "/api/v1/nodes")
        items = result.get("items") if isinstance(result, dict) else None
        if not isinstance(items, list):
            raise KubeError("GET /api/v1/nodes: the answer has no items list")
        return items


async def refresh_nodes_periodically(
    *, api: KubeApi, extender: Extender, interval_s: float, ready: asyncio.Event | None = None
) -> None:
    """Feed the extender's node cache from the API server every interval (for NodeNames mode)."""
    while True:
        try:
            nodes = await asyncio.to_thread(api.list_nodes)
            extender.refresh_nodes(nodes)
        except KubeError as exc:
            log.warning("node refresh failed: %s", exc)
        if ready is not None and not ready.is_set():
            ready.set()
        await asyncio.sleep(interval_s)
