"""A node for the DRA plugin tests: an API server stand-in with ResourceClaims and ResourceSlices, the
plugin on real Unix sockets, and a kubelet stand-in that speaks to it over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import grpc

from gpunode.config.agent import Config, parse_config
from gpunode.infra.kube import KubeClient
from gpunode.node.devices.base import Gpu
from gpunode.node.dra.claims import ClaimRef
from gpunode.node.dra.devices import DeviceDirectory, kube_slice_lister
from gpunode.node.dra.plugin import DraPlugin
from gpunode.node.dra.prepare import Preparer
from gpunode.node.inventory import Inventory
from gpunode.node.kubelet._proto import dra_v1_pb2 as v1
from gpunode.node.kubelet._proto import dra_v1_pb2_grpc as v1_grpc
from gpunode.node.kubelet._proto import dra_v1beta1_pb2 as v1beta1
from gpunode.node.kubelet._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from gpunode.node.kubelet._proto import drahealth_v1alpha1_pb2_grpc as health_grpc
from gpunode.node.kubelet._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from gpunode.node.state import DeviceState
from tests.fakes.kubelet import short_socket_dir

GIB = 2**30
NODE = "node-a"
DRIVER = "gpu.gpunode.io"
GPUS = tuple(
    Gpu(
        index=i,
        uuid=f"GPU-0000000{i}-0000-4000-8000-00000000000{i}",
        model="NVIDIA H100 80GB HBM3",
        memory_total_bytes=80 * GIB,
        pci_bus_id=f"00000000:1{i}:00.0",
        numa_node=0,
        minor=i,
    )
    for i in range(3)
)


def slice_devices(node: str = NODE) -> list[dict[str, Any]]:
    """The node's ResourceSlice: per GPU a whole device and a shared one, plus a MIG placement."""
    devices = []
    for g in GPUS:
        for name, sharing in ((f"gpu-{g.index}", "whole"), (f"gpu-{g.index}-shared", "shared")):
            devices.append(
                {
                    "name": name,
                    "attributes": {
                        "uuid": {"string": g.uuid},
                        "type": {"string": "gpu"},
                        "sharing": {"string": sharing},
                    },
                    "capacity": {"memory": {"value": "80Gi"}},
                }
            )
    devices.append(
        {
            "name": "gpu-0-mig-1g",
            "attributes": {"uuid": {"string": GPUS[0].uuid}, "type": {"string": "mig"}},
        }
    )
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}"},
            "spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node}, "devices": devices},
        }
    ]


def new_uid() -> str:
    return str(uuid.uuid4())


def claim(
    name: str,
    *,
    uid: str | None = None,
    namespace: str = "team-a",
    device: str = "gpu-0-shared",
    memory: str | None = "4Gi",
    pool: str = NODE,
    share: str | None = "share-1",
    parameters: Any = None,
    driver: str = DRIVER,
) -> dict[str, Any]:
    """A ResourceClaim allocated one device of the driver (with its consumed memory and share)."""
    result: dict[str, Any] = {"request": "gpu", "driver": driver, "pool": pool, "device": device}
    if memory is not None:
        result["consumedCapacity"] = {"memory": memory}
    if share is not None:
        result["shareID"] = share
    config = []
    if parameters is not None:
        config = [
            {"source": "FromClaim", "requests": [], "opaque": {"driver": driver, "parameters": parameters}}
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": new_uid() if uid is None else uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        "status": {"allocation": {"devices": {"results": [result], "config": config}}},
    }


def ref(obj: dict[str, Any]) -> ClaimRef:
    meta = obj["metadata"]
    return ClaimRef(meta["namespace"], meta["uid"], meta["name"])


class FakeApi:
    """GET of ResourceClaims and the list of ResourceSlices (fieldSelector honoured), on loopback."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.slices: list[dict[str, Any]] = slice_devices()
        self.requests: list[str] = []
        self.lock = threading.Lock()
        self.version = 1
        self.node_uid = new_uid()
        self.claim_delay_s = 0.0
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # One write per response, headers and body together, as an API server sends it: two small
            # writes on a kept-alive connection would wait on the client's delayed ACK (Nagle), 40 ms.
            wbufsize = 1 << 16

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"null")

            def do_POST(self) -> None:  # create a ResourceSlice (the slice publisher's writes)
                body = self._body()
                with api.lock:
                    api.version += 1
                    body.setdefault("metadata", {})["resourceVersion"] = str(api.version)
                    body["metadata"].setdefault("uid", new_uid())
                    api.slices = [s for s in api.slices if s["metadata"]["name"] != body["metadata"]["name"]]
                    api.slices.append(body)
                self._send(201, body)

            do_PUT = do_POST

            def do_DELETE(self) -> None:
                name = unquote(urlsplit(self.path).path.rstrip("/").rsplit("/", 1)[-1])
                self._body()
                with api.lock:
                    api.slices = [s for s in api.slices if s["metadata"]["name"] != name]
                self._send(200, {"kind": "Status", "status": "Success"})

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                api.requests.append(url.path)
                parts = [unquote(p) for p in url.path.strip("/").split("/")]
                code, body = (
                    404,
                    {"kind": "Status", "code": 404, "reason": "NotFound", "message": "not found"},
                )
                if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4:  # the slices' owner
                    code, body = (
                        200,
                        {
                            "apiVersion": "v1",
                            "kind": "Node",
                            "metadata": {"name": parts[3], "uid": api.node_uid, "resourceVersion": "1"},
                        },
                    )
                if parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 6 and parts[4] == "pods":
                    found = api.pods.get((parts[3], parts[5]))
                    if found is not None:
                        code, body = 200, found
                if parts[:3] == ["apis", "resource.k8s.io", "v1"]:
                    rest = parts[3:]
                    if rest == ["resourceslices"]:
                        query = dict(parse_qsl(url.query))
                        terms = dict(t.split("=", 1) for t in query.get("fieldSelector", "").split(",") if t)
                        items = [
                            s
                            for s in list(api.slices)
                            if all(
                                {
                                    "spec.nodeName": s["spec"].get("nodeName"),
                                    "spec.driver": s["spec"].get("driver"),
                                }.get(k)
                                == v
                                for k, v in terms.items()
                            )
                        ]
                        code, body = (
                            200,
                            {
                                "kind": "ResourceSliceList",
                                "metadata": {"resourceVersion": str(api.version)},
                                "items": items,
                            },
                        )
                    elif len(rest) == 4 and rest[0] == "namespaces" and rest[2] == "resourceclaims":
                        time.sleep(api.claim_delay_s)  # a slow API server, for calls the kubelet gives up on
                        found = api.claims.get((rest[1], rest[3]))
                        if found is not None:
                            code, body = 200, found
                self._send(code, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig naming this server (no credentials), for the agent's own client."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": {}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                    "current-context": "fake",
                }
            )
        )
        return path

    def add(self, obj: dict[str, Any]) -> ClaimRef:
        meta = obj["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = obj
        return ref(obj)

    def add_with_pod(self, obj: dict[str, Any], pod: str) -> ClaimRef:
        """The claim reserved for a pod of its own (one container using it), as the scheduler leaves it."""
        meta = obj["metadata"]
        uid = new_uid()
        obj["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": uid}]
        self.pods[(meta["namespace"], pod)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": meta["namespace"], "uid": uid},
            "spec": {
                "resourceClaims": [{"name": "gpu", "resourceClaimName": meta["name"]}],
                "containers": [{"name": "main", "resources": {"claims": [{"name": "gpu"}]}}],
            },
        }
        return self.add(obj)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def dra_config(root: Path, **dra: Any) -> Config:
    section = {"enabled": True, "cdiDir": str(root / "cdi"), "kubeletRoot": str(root / "kubelet"), **dra}
    return parse_config(
        {
            "version": "v1",
            "gpunode": {
                "stateDir": str(root / "state"),
                "kubeletDir": str(root / "kubelet" / "device-plugins"),
                "nodeName": NODE,
                "dra": section,
            },
        },
        "test-config.yaml",
    )


@dataclass
class World:
    """One node: its configuration, API stand-in, device state and running plugin, and kubelet stubs."""

    root: Path
    api: FakeApi
    config: Config
    state: DeviceState
    client: KubeClient
    plugin: DraPlugin
    channel: grpc.aio.Channel
    stub_v1: Any = None
    stub_v1beta1: Any = None
    health: Any = None
    registration: Any = None
    task: asyncio.Task[None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cdi_dir(self) -> Path:
        return self.config.dra.cdi_dir

    @property
    def regions(self) -> Path:
        return self.config.state_dir / "dra" / "memcap"

    async def prepare(self, *claims: ClaimRef, version: Any = v1) -> Any:
        stub = self.stub_v1 if version is v1 else self.stub_v1beta1
        return await stub.NodePrepareResources(
            version.NodePrepareResourcesRequest(
                claims=[version.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
            ),
            timeout=10,
        )

    async def unprepare(self, *claims: ClaimRef, version: Any = v1) -> Any:
        stub = self.stub_v1 if version is v1 else self.stub_v1beta1
        return await stub.NodeUnprepareResources(
            version.NodeUnprepareResourcesRequest(
                claims=[version.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
            ),
            timeout=10,
        )


def make_plugin(config: Config, state: DeviceState, client: KubeClient) -> DraPlugin:
    directory = DeviceDirectory(kube_slice_lister(client, driver=DRIVER, node=NODE), driver=DRIVER, node=NODE)

    async def fetch(r: ClaimRef) -> dict[str, Any]:
        from lightkube.resources.resource_v1 import ResourceClaim

        return await client.get_json(ResourceClaim, r.name, namespace=r.namespace)

    async def fetch_pod(namespace: str, name: str) -> dict[str, Any]:
        from lightkube.resources.core_v1 import Pod

        return await client.get_json(Pod, name, namespace=namespace)

    preparer = Preparer(
        config=config,
        fetch_claim=fetch,
        directory=directory,
        gpus=lambda: GPUS,
        with_device_nodes=False,
        fetch_pod=fetch_pod,
    )
    return DraPlugin(
        preparer=preparer,
        state=state,
        registration_socket=config.dra.registration_socket(config.kubelet_dir),
        service_socket=config.dra.service_socket(config.kubelet_dir),
    )


@contextlib.asynccontextmanager
async def world(root: Path | None = None, **dra: Any) -> AsyncIterator[World]:
    """A running plugin on a short socket directory, and stubs dialling it."""
    root = root or short_socket_dir()
    api = FakeApi()
    config = dra_config(root, **dra)
    state = DeviceState(Inventory(gpus=GPUS))
    client = KubeClient.for_host(api.url)
    plugin = make_plugin(config, state, client)
    ready = asyncio.Event()
    task = asyncio.create_task(plugin.run(ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    channel = grpc.aio.insecure_channel(f"unix://{plugin.service.path}")
    reg_channel = grpc.aio.insecure_channel(f"unix://{plugin.registrar.path}")
    w = World(root, api, config, state, client, plugin, channel, task=task)
    w.stub_v1 = v1_grpc.DRAPluginStub(channel)
    w.stub_v1beta1 = v1beta1_grpc.DRAPluginStub(channel)
    w.health = health_grpc.DRAResourceHealthStub(channel)
    w.registration = reg_grpc.RegistrationStub(reg_channel)
    try:
        yield w
    finally:
        await channel.close()
        await reg_channel.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()
        api.close()


__all__ = [
    "DRIVER",
    "GIB",
    "GPUS",
    "NODE",
    "World",
    "claim",
    "make_plugin",
    "new_uid",
    "ref",
    "v1",
    "v1beta1",
    "world",
]
