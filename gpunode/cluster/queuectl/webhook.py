"""The mutating admission webhook `gpunode queue --webhook-listen` serves: governed pods get the scheduling gate.

The API server sends an AdmissionReview (admission.k8s.io/v1) for each pod being created that the
chart's MutatingWebhookConfiguration selects (pods labelled gpunode.io/queue; more with its
namespaceSelector). The answer always allows the pod; for a governed pod (one the controller will
queue: a queue by label or namespace, and a request for GPUs, as jobs.queued_pod reads it) without the
gate it carries a JSON patch adding gpunode.io/admission (gates.add_gate_patch). Every replica serves
it, leader or not: the answer depends on the pod and the queue configuration's namespaces only.

The same webhook takes the creation of `batch/v1` Jobs and of JobSets (jobset.x-k8s.io): a governed one
(workloads.workload_of: a queue named, GPUs asked by a pod template) is created suspended
(`spec.suspend: true`; the controller admits it by resuming it) and each of its pod templates that names
no queue gets the label gpunode.io/queue with its queue, so its pods are gated as governed pods. A Job
that a JobSet owns is left as it comes (its JobSet is the one queued).

The server is the HTTP layer's (gpunode.infra.http) over TLS. The certificate and key files are read
again when they change (checked every `reload_s`; cert-manager renews them in place): a connection
takes the newest good pair at its handshake, and a pair that cannot be used is logged, one line, and
the previous one kept.

When the webhook cannot be reached (down, its certificate expired or not trusted), the API server
follows the configuration's failurePolicy: the chart's Ignore creates the pod without the gate, and
the extender's hold keeps it from running until the controller admits it (docs/admission.md).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from gpunode.cluster.extender.pods import request_from_pod
from gpunode.cluster.extender.queued import queue_of
from gpunode.cluster.queuectl.gates import add_gate_patch
from gpunode.cluster.queuectl.workloads import (
    JOB,
    JOBSET,
    controller_owner,
    template_label_patch,
    workload_of,
)
from gpunode.cluster.queueing.config import NamespaceMap, QueueConfig
from gpunode.contract.names import ADMISSION_WEBHOOK_PATH
from gpunode.errors import GpunodeError, InvalidRequest, TlsConfigError
from gpunode.infra.http import HttpServer, server_tls_context

log = logging.getLogger(__name__)

REVIEW_VERSION = "admission.k8s.io/v1"
MAX_REVIEW_BYTES = 4 * 2**20  # an AdmissionReview carries the pod (at most ~1.5 MiB in etcd) and userInfo
RELOAD_S = 30.0


def governed(pod: Mapping[str, Any], namespaces: Mapping[str, str]) -> bool:
    """Whether the controller will queue this pod: it names a queue (label or namespace) and asks for GPUs
    (a request it cannot read counts: the controller reports it, and it stays gated meanwhile) or names
    ResourceClaims (released at once when none asks anything of gpunode's driver)."""
    if queue_of(pod, namespaces) is None:
        return False
    spec = pod.get("spec")
    if isinstance(spec, Mapping) and spec.get("resourceClaims"):
        return True  # DRA: the controller admits it by its claims of gpunode's driver (queuectl/dra.py)
    try:
        return request_from_pod(pod) is not None
    except GpunodeError:
        return True


WORKLOAD_KINDS = {("batch", JOB): JOB, ("jobset.x-k8s.io", JOBSET): JOBSET}


def suspend_patch(obj: Mapping[str, Any], kind: str, namespaces: Mapping[str, str]) -> list[dict[str, Any]]:
    """The JSON patch that creates a governed Job or JobSet suspended, its pod templates labelled with its
    queue; [] when it is not governed (or is a JobSet's Job)."""
    if kind == JOB and controller_owner(obj, JOBSET) is not None:
        return []
    routing = NamespaceMap(namespaces)
    routing.kueue_label = bool(getattr(namespaces, "kueue_label", False))
    probe = QueueConfig(queues={}, namespaces=routing)  # which queue it names is all that is read here
    w = workload_of(obj, kind, probe, {})
    if w is None:
        return []
    ops: list[dict[str, Any]] = []
    if (obj.get("spec") or {}).get("suspend") is not True:
        ops.append({"op": "add", "path": "/spec/suspend", "value": True})
    return ops + template_label_patch(obj, kind, w.queue)


def review_response(review: Any, namespaces: Mapping[str, str]) -> dict[str, Any]:
    """The AdmissionReview answering `review`; InvalidRequest (one line) when it is not one."""
    if not isinstance(review, Mapping) or review.get("apiVersion") != REVIEW_VERSION:
        raise InvalidRequest(f"expected an AdmissionReview of {REVIEW_VERSION}")
    request = review.get("request")
    if not isinstance(request, Mapping) or not isinstance(request.get("uid"), str):
        raise InvalidRequest("the AdmissionReview has no request with a uid")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    pod = request.get("object")
    kind = request.get("kind")
    is_pod = isinstance(kind, Mapping) and kind.get("kind") == "Pod" and not kind.get("group")
    if is_pod and request.get("operation") == "CREATE" and isinstance(pod, Mapping):
        meta = dict(pod.get("metadata") or {})
        meta.setdefault("namespace", request.get("namespace") or "default")  # absent at creation
        seen = {**pod, "metadata": meta}
        if governed(seen, namespaces) and (patch := add_gate_patch(pod)):
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    workload = (
        WORKLOAD_KINDS.get((str(kind.get("group")), str(kind.get("kind"))))
        if isinstance(kind, Mapping)
        else None
    )
    if workload and request.get("operation") == "CREATE" and isinstance(pod, Mapping):
        meta = dict(pod.get("metadata") or {})
        meta.setdefault("namespace", request.get("namespace") or "default")
        if patch := suspend_patch({**pod, "metadata": meta}, workload, namespaces):
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "response": response}


class _Certificates:
    """The serving context, whose SNI callback hands each handshake the newest good certificate."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self._stamp = self._files_stamp()
        self.current = server_tls_context(cert_file, key_file)  # TlsConfigError at start: one line, exits
        self.context = server_tls_context(cert_file, key_file)
        self.context.sni_callback = self._pick

    def _pick(self, sock: Any, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        sock.context = self.current

    def _files_stamp(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for path in (self.cert_file, self.key_file):
            try:
                st = os.stat(path)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append((0, 0, 0))
        return tuple(out)

    def reload(self) -> bool:
        """Take the files again when they changed; True when a new pair is served from now on."""
        stamp = self._files_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            self.current = server_tls_context(self.cert_file, self.key_file)
        except TlsConfigError as exc:
            log.error("admission webhook: the new certificate is not used, the previous one stays: %s", exc)
            return False
        log.info("admission webhook: serving the certificate %s read again", self.cert_file)
        return True


class AdmissionWebhook:
    """The webhook's HTTPS server (see the module docstring); `namespaces` gives the configuration's map."""

    def __init__(
        self,
        namespaces: Callable[[], Mapping[str, str]],
        *,
        host: str,
        port: int,
        cert_file: str,
        key_file: str,
        reload_s: float = RELOAD_S,
    ) -> None:
        self.namespaces = namespaces
        self.certificates = _Certificates(cert_file, key_file)
        self.reload_s = reload_s
        self.reviews = 0
        self.server = HttpServer(
            self._handle,
            name="admission webhook",
            max_body_bytes=MAX_REVIEW_BYTES,
            host=host,
            port=port,
            ssl_context=self.certificates.context,
            log=log,
            hint="give --webhook-listen a free host:port",
        )
        self._reloader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen (ListenError, one line, when the address cannot be bound) and watch the certificate."""
        await self.server.start()
        self._reloader = asyncio.create_task(self._reload_loop())

    async def stop(self) -> None:
        """Stop listening and watching."""
        if self._reloader is not None:
            self._reloader.cancel()
            await asyncio.gather(self._reloader, return_exceptions=True)
        await self.server.stop()

    async def _reload_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reload_s)
            self.certificates.reload()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path != ADMISSION_WEBHOOK_PATH:
            return web.Response(
                status=404, text=f"not found: the webhook is served at {ADMISSION_WEBHOOK_PATH}\n"
            )
        if request.method != "POST":
            return web.Response(status=405, text="POST an AdmissionReview\n")
        try:
            review = json.loads(await request.read())
            answer = review_response(review, self.namespaces())
        except ValueError as exc:  # InvalidRequest is one
            text = str(exc) if isinstance(exc, InvalidRequest) else "the body is not JSON"
            log.warning("admission webhook: refused a request: %s", text)
            return web.Response(status=400, text=text + "\n")
        self.reviews += 1
        return web.json_response(answer)
