"""The kube-scheduler extender over real loopback HTTP: protocol round trips, bad input, in-flight accounting."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gpunode.cluster.extender.cli import build_extender, register_extender_cli
from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.kubeapi import KubeApi
from gpunode.cluster.extender.pods import request_from_pod
from gpunode.cluster.extender.server import ExtenderServer, serve_extender
from gpunode.contract.nodestate import ANNOTATION_KEY, GpuRecord, NodeGpuState, encode
from gpunode.errors import ConfigError, ListenError
from tests.shared.test_http import accept_queue

GIB = 2**30


# ----- realistic Kubernetes objects ---------------------------------------------------------------------


def gpu_state(
    node: str,
    shares: list[int],
    *,
    generation: int = 1,
    pods: dict[int, list[str]] | None = None,
    model: str = "NVIDIA A100-SXM4-80GB",
) -> str:
    pods = pods or {}
    return encode(
        NodeGpuState(
            node=node,
            updated=1732252800.0,
            generation=generation,
            gpus=tuple(
                GpuRecord(
                    uuid=f"GPU-{node}-{i}",
                    index=i,
                    model=model,
                    memory_total_bytes=80 * GIB,
                    milli_capacity=1000,
                    milli_assigned=1000 - free,
                    memory_assigned_bytes=(1000 - free) * 80 * GIB // 1000,
                    numa_node=0,
                    pods=tuple(pods.get(i, ())),
                )
                for i, free in enumerate(shares)
            ),
        )
    )


def v1_node(name: str, annotation: str | None) -> dict[str, Any]:
    annotations = {
        "node.alpha.kubernetes.io/ttl": "0",
        "volumes.kubernetes.io/controller-managed-attach-detach": "true",
    }
    if annotation is not None:
        annotations[ANNOTATION_KEY] = annotation
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "123456",
            "creationTimestamp": "2024-11-22T04:00:00Z",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "node.kubernetes.io/instance-type": "p4d.24xlarge",
                "nvidia.com/gpu.present": "true",
            },
            "annotations": annotations,
        },
        "spec": {"podCIDR": "10.244.1.0/24", "providerID": f"aws:///us-east-1a/{name}"},
        "status": {
            "capacity": {
                "cpu": "96",
                "memory": "1056499816Ki",
                "pods": "110",
                "nvidia.com/gpu": "8",
                "gpunode.io/gpu-memory": "640",
            },
            "allocatable": {
                "cpu": "95500m",
                "memory": "1047062632Ki",
                "pods": "110",
                "nvidia.com/gpu": "8",
                "gpunode.io/gpu-memory": "640",
            },
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "lastHeartbeatTime": "2024-11-22T04:10:00Z",
                    "lastTransitionTime": "2024-11-22T04:00:00Z",
                }
            ],
            "addresses": [
                {"type": "InternalIP", "address": "10.0.0.7"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "kubeletVersion": "v1.30.4",
                "containerRuntimeVersion": "containerd://1.7.20",
                "architecture": "amd64",
                "operatingSystem": "linux",
            },
        },
    }


def v1_pod(
    name: str = "train-0",
    *,
    limits: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    uid: str = "8e4f7c0a-1b2c-4d5e-9f00-0123456789ab",
) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "uid": uid,
            "resourceVersion": "998877",
            "creationTimestamp": "2024-11-22T04:12:00Z",
            "labels": {"app": "trainer"},
            "annotations": annotations or {},
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "train",
                    "uid": "job-uid",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "schedulerName": "default-scheduler",
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "nvcr.io/nvidia/pytorch:24.10-py3",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "train.py"],
                    "resources": {
                        "limits": limits or {"nvidia.com/gpu": "1"},
                        "requests": {"cpu": "8", "memory": "32Gi", **(limits or {"nvidia.com/gpu": "1"})},
                    },
                }
            ],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        "status": {
            "phase": "Pending",
            "qosClass": "Burstable",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
        },
    }


class PodBook:
    """The pods an API server has, as Extender(pod_reader=book.read) reads them: provisional reservations
    are made only for pods that exist and wait."""

    def __init__(self, *pods: dict[str, Any]) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.reads = 0
        self.add(*pods)

    def add(self, *pods: dict[str, Any]) -> None:
        for pod in pods:
            meta = pod["metadata"]
            self.pods[f"{meta['namespace']}/{meta['name']}"] = pod

    def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return self.pods.get(f"{namespace}/{name}")


def node_list(*nodes: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "NodeList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": "777"},
        "items": list(nodes),
    }


# ----- HTTP plumbing -----------------------------------------------------------------------------------------


class Client:
    def __init__(self, port: int) -> None:
        self.port = port

    def call(self, method: str, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        conn.close()
        return resp.status, json.loads(payload) if payload else None

    def post(self, verb: str, body: object) -> tuple[int, Any]:
        return self.call("POST", f"/{verb}", body)


class FakeApiServer:
    """An API server stand-in for binding: records PATCH/POST, answers like the real one."""

    def __init__(self, *, fail_binding: bool = False) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.pods: dict[str, dict[str, Any]] = {}  # path -> the pod a GET of it answers
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length", "0"))
                return json.loads(self.rfile.read(n)) if n else None

            def _answer(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PATCH(self) -> None:
                outer.calls.append(("PATCH", self.path, self._body()))
                self._answer(200, {"kind": "Pod", "apiVersion": "v1"})

            def do_POST(self) -> None:
                outer.calls.append(("POST", self.path, self._body()))
                if fail_binding:
                    self._answer(
                        409,
                        {
                            "kind": "Status",
                            "status": "Failure",
                            "reason": "Conflict",
                            "message": "pod team-a/train-0 is already assigned to node n9",
                        },
                    )
                else:
                    self._answer(201, {"kind": "Status", "status": "Success"})

            def do_GET(self) -> None:
                outer.calls.append(("GET", self.path, None))
                if "/pods/" in self.path:
                    pod = outer.pods.get(self.path)
                    self._answer(200 if pod else 404, pod or {"kind": "Status", "reason": "NotFound"})
                    return
                self._answer(200, node_list(v1_node("n1", gpu_state("n1", [1000, 1000]))))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=lambda: self.server.serve_forever(poll_interval=0.05), daemon=True
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add_pod(self, pod: dict[str, Any]) -> None:
        """Let GETs of this pod answer it (v1_pod: pending, for default-scheduler)."""
        meta = pod["metadata"]
        self.pods[f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"] = pod

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


def start(extender: Extender) -> tuple[ExtenderServer, Client]:
    server = ExtenderServer(extender, port=0)
    server.start()
    if isinstance(extender.binder, KubeApi):
        extender.binder.attach(server.loop)  # its binds run on the loop the server runs on
    return server, Client(server.port)


@pytest.fixture
def served(api: FakeApiServer) -> Iterator[tuple[Extender, Client, FakeApiServer]]:
    extender = Extender(config=ExtenderConfig(policy="gpunode"), binder=KubeApi(api.url))
    server, client = start(extender)
    yield extender, client, api
    server.stop()


# ----- filter / prioritize / bind over HTTP -------------------------------------------------------------------


def test_filter_round_trip_with_full_node_list(served: tuple[Extender, Client, FakeApiServer]) -> None:
    _, client, _ = served
    nodes = node_list(
        v1_node("n1", gpu_state("n1", [1000, 300])),
        v1_node("n2", gpu_state("n2", [200, 200])),
        v1_node("n3", None),
        v1_node("n4", "{broken"),
        v1_node("n5", gpu_state("n5", [1000], model="Tesla T4")),
    )
    status, result = client.post(
        "filter",
        {"Pod": v1_pod(annotations={"gpunode.io/gpu-model": "A100"}), "Nodes": nodes, "NodeNames": None},
    )
    assert status == 200
    assert set(result) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert result["Error"] == "" and result["NodeNames"] is None
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["n1"]
    assert result["Nodes"]["items"][0] == nodes["items"][0]  # passed back untouched
    failed = result["FailedNodes"]
    assert set(failed) == {"n2", "n3", "n4", "n5"}
    assert "insufficient whole GPUs" in failed["n2"]
    assert "no gpunode.io/gpu-state annotation" in failed["n3"]
    assert "broken JSON" in failed["n4"]
    assert "no GPU of model A100" in failed["n5"]


def test_filter_and_prioritize_with_node_names_and_a_refreshed_cache(
    served: tuple[Extender, Client, FakeApiServer],
) -> None:
    extender, client, _ = served
    assert (
        extender.refresh_nodes(
            [v1_node("a", gpu_state("a", [1000, 500, 1000, 1000])), v1_node("b", gpu_state("b", [300, 1000]))]
        )
        == 2
    )
    pod = v1_pod(limits={"gpunode.io/gpu-memory": "16"}, annotations={"gpunode.io/gpu-milli": "250"})
    status, result = client.post(
        "filter", {"pod": pod, "nodenames": ["a", "b", "ghost"]}
    )  # Go-style any case
    assert status == 200 and result["Nodes"] is None
    assert result["NodeNames"] == ["a", "b"]
    assert "unknown to the extender's cache" in result["FailedNodes"]["ghost"]
    status, priorities = client.post("prioritize", {"Pod": pod, "NodeNames": ["a", "b", "ghost"]})
    assert status == 200
    assert [p["Host"] for p in priorities] == ["a", "b", "ghost"]
    assert all(isinstance(p["Score"], int) and 0 <= p["Score"] <= 10 for p in priorities)
    assert max(p["Score"] for p in priorities) == 10 and priorities[2]["Score"] == 0


def test_pods_without_our_resources_pass_untouched(served: tuple[Extender, Client, FakeApiServer]) -> None:
    _, client, _ = served
    nodes = node_list(v1_node("n1", None), v1_node("n2", gpu_state("n2", [0])))
    status, result = client.post("filter", {"Pod": v1_pod(limits={"cpu": "1"}), "Nodes": nodes})
    assert status == 200 and [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["n1", "n2"]
    assert result["FailedNodes"] == {}


def test_an_impossible_request_fails_every_node_as_unresolvable(
    served: tuple[Extender, Client, FakeApiServer],
) -> None:
    _, client, _ = served
    pod = v1_pod(limits={"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"})
    status, result = client.post(
        "filter", {"Pod": pod, "Nodes": node_list(v1_node("n1", gpu_state("n1", [1000])))}
    )
    assert status == 200
    assert "invalid GPU request" in result["FailedAndUnresolvableNodes"]["n1"]
    # kube-scheduler 1.20 puts only FailedNodes in the pod's events: the reason must be there too.
    assert result["FailedNodes"]["n1"] == result["FailedAndUnresolvableNodes"]["n1"]
    assert result["Nodes"]["items"] == []


@pytest.mark.parametrize(
    ("method", "path", "raw", "status", "message"),
    [
        pytest.param("POST", "/filter", b"{not json", 400, "malformed JSON", id="malformed"),
        pytest.param("POST", "/filter", b'{"Pod": "\xff"}', 400, "malformed JSON", id="not-utf8"),
        pytest.param("POST", "/filter", b"[" * 5000 + b"]" * 5000, 400, "malformed JSON", id="nested-5000"),
        pytest.param("POST", "/filter", b"", 400, "malformed JSON", id="empty-body"),
        pytest.param("POST", "/prioritize", b"[1, 2]", 400, "must be a JSON object", id="not-object"),
        pytest.param("POST", "/filter", b'{"Nodes": {"items": []}}', 400, "Pod is missing", id="no-pod"),
        pytest.param(
            "POST", "/filter", b'{"Pod": {"metadata": {"name": "p"}}}', 400, "needs Nodes", id="no-nodes"
        ),
        pytest.param(
            "POST", "/filter", b'{"Pod": {}, "Nodes": {"items": 5}}', 400, "items list", id="bad-items"
        ),
        pytest.param(
            "POST",
            "/filter",
            b'{"Pod": {"metadata": {}}, "NodeNames": []}',
            400,
            "metadata.name",
            id="pod-without-name",
        ),
        pytest.param("POST", "/bind", b'{"PodName": "p"}', 400, "needs PodName and Node", id="bind-no-node"),
        pytest.param("POST", "/evict", b"{}", 404, "no such verb", id="unknown-verb"),
        pytest.param("GET", "/filter", None, 405, "takes POST", id="get-filter"),
        pytest.param("GET", "/nowhere", None, 404, "no such path", id="unknown-path"),
    ],
)
def test_bad_requests_get_4xx_with_a_json_message(
    served: tuple[Extender, Client, FakeApiServer],
    method: str,
    path: str,
    raw: bytes | None,
    status: int,
    message: str,
) -> None:
    _, client, _ = served
    got, body = client.call(method, path, raw=raw)
    assert got == status and message in body["Error"]
    # the server is still serving
    assert client.call("GET", "/healthz") == (200, {"status": "ok", "nodes": 0})


def test_bind_annotates_the_pod_binds_it_and_reserves_its_gpu(
    served: tuple[Extender, Client, FakeApiServer],
) -> None:
    _, client, api = served
    nodes = node_list(v1_node("n1", gpu_state("n1", [1000, 0])))
    pod = v1_pod()
    api.add_pod(pod)
    assert client.post("filter", {"Pod": pod, "Nodes": nodes})[1]["Nodes"]["items"]
    args = {"PodName": "train-0", "PodNamespace": "team-a", "PodUID": pod["metadata"]["uid"], "Node": "n1"}
    status, result = client.post("bind", args)
    assert (status, result) == (200, {"Error": ""})
    looked_up, read, (patch_method, patch_path, patch), (post_method, post_path, binding) = api.calls
    # read at filter (its provisional reservation is for a pod that exists), and read again before binding
    assert looked_up == read == ("GET", "/api/v1/namespaces/team-a/pods/train-0", None)
    assert (patch_method, patch_path) == ("PATCH", "/api/v1/namespaces/team-a/pods/train-0")
    assert patch == {"metadata": {"annotations": {"gpunode.io/gpu-assigned": "GPU-n1-0"}}}
    assert (post_method, post_path) == ("POST", "/api/v1/namespaces/team-a/pods/train-0/binding")
    assert binding["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
    assert binding["metadata"]["uid"] == pod["metadata"]["uid"]
    # The annotation still shows the GPU free; the reservation keeps a second pod off it.
    second = v1_pod("train-1", uid="uid-2")
    status, result = client.post("filter", {"Pod": second, "Nodes": nodes})
    assert result["Nodes"]["items"] == [] and "insufficient whole GPUs" in result["FailedNodes"]["n1"]


def test_bind_failure_is_reported_and_releases_the_reservation() -> None:
    api = FakeApiServer(fail_binding=True)
    extender = Extender(binder=KubeApi(api.url))
    server, client = start(extender)
    try:
        pod = v1_pod()
        api.add_pod(pod)
        client.post("filter", {"Pod": pod, "Nodes": node_list(v1_node("n1", gpu_state("n1", [1000])))})
        _, result = client.post(
            "bind",
            {"PodName": "train-0", "PodNamespace": "team-a", "PodUID": pod["metadata"]["uid"], "Node": "n1"},
        )
        assert "HTTP 409" in result["Error"] and "already assigned" in result["Error"]
        assert extender.reservations.get(pod["metadata"]["uid"]) is None
    finally:
        server.stop()
        api.close()


def test_bind_without_api_access_says_so() -> None:
    extender = Extender()
    extender.refresh_nodes([v1_node("n1", gpu_state("n1", [1000]))])
    result = extender.bind({"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "n1"})
    assert "no Kubernetes API access" in result["Error"]


# ----- CLI and the serving coroutine ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpunode")
    register_extender_cli(p.add_subparsers(dest="command"))
    return p


def test_cli_flags_build_an_extender(api: FakeApiServer, tmp_path: Any) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    args = parser().parse_args(
        [
            "extender",
            "--listen",
            "127.0.0.1:0",
            "--policy",
            "fgd",
            "--memory-unit",
            "512Mi",
            "--reservation-ttl",
            "90s",
            "--kube-api",
            api.url,
            "--kube-token-file",
            str(token),
        ]
    )
    extender, client = build_extender(args)
    assert extender.config == ExtenderConfig(policy="fgd", memory_unit_bytes=2**29, reservation_ttl_s=90.0)
    assert client is not None and asyncio.run(client.list_nodes_async())[0]["metadata"]["name"] == "n1"


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["extender", "--memory-unit", "lots"], id="bad-unit"),
        pytest.param(["extender", "--reservation-ttl", "soon"], id="bad-ttl"),
    ],
)
def test_cli_bad_flags_are_config_errors(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        build_extender(parser().parse_args(argv))


def test_serve_extender_coroutine_serves_until_cancelled() -> None:
    async def scenario() -> tuple[int, Any]:
        ready = asyncio.Event()
        bound: list[int] = []
        task = asyncio.create_task(
            serve_extender(extender=Extender(), host="127.0.0.1", port=0, ready=ready, bound=bound)
        )
        await asyncio.wait_for(ready.wait(), 5)
        result = await asyncio.to_thread(Client(bound[0]).call, "GET", "/healthz")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return result

    assert asyncio.run(scenario()) == (200, {"status": "ok", "nodes": 0})


# ----- the server under load, its worker threads and its loop --------------------------------------------------


@pytest.mark.parametrize("clients", [32, 128])
def test_simultaneous_connections_are_all_answered(clients: int) -> None:
    """kube-scheduler opens many connections at once: while the server's loop is held up, every one of them
    waits, complete, in the accept queue (none is refused or reset), and every request is then answered."""
    extender = Extender()
    extender.refresh_nodes([v1_node("n1", gpu_state("n1", [1000, 1000]))])
    server, client = start(extender)
    body = json.dumps({"Pod": v1_pod(), "NodeNames": ["n1"]}).encode()
    release = threading.Event()
    barrier = threading.Barrier(clients)
    results: list[object] = [None] * clients

    async def hold_the_loop() -> None:
        release.wait(30)  # blocks the server's event loop on purpose: nothing is accepted meanwhile

    def one(i: int) -> None:
        try:
            barrier.wait(30)
            results[i] = client.call("POST", "/filter", raw=body)[0]
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    try:
        held = asyncio.run_coroutine_threadsafe(hold_the_loop(), server.loop)
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while accept_queue(server.port)[0] < clients and time.monotonic() < deadline:
            time.sleep(0.01)
        assert accept_queue(server.port)[0] == clients
        release.set()
        held.result(30)
        for t in threads:
            t.join(60)
    finally:
        release.set()
        server.stop()
    assert results == [200] * clients


def test_healthz_answers_while_a_filter_runs_in_a_worker_thread() -> None:
    extender = Extender()
    entered, release = threading.Event(), threading.Event()
    real_filter = extender.filter

    def slow_filter(body: object) -> dict[str, Any]:
        entered.set()
        release.wait(30)
        return real_filter(body)

    extender.filter = slow_filter  # type: ignore[method-assign]
    server, client = start(extender)
    answers: list[tuple[int, Any]] = []
    body = {"Pod": v1_pod(), "Nodes": node_list(v1_node("n1", gpu_state("n1", [1000])))}
    filtering = threading.Thread(target=lambda: answers.append(client.post("filter", body)))
    try:
        filtering.start()
        assert entered.wait(10)
        assert client.call("GET", "/healthz") == (200, {"status": "ok", "nodes": 0})
        assert not answers  # the filter is still running
        release.set()
        filtering.join(30)
    finally:
        release.set()
        server.stop()
    assert answers[0][0] == 200 and answers[0][1]["Nodes"]["items"]


def test_a_binder_runs_its_coroutines_on_the_server_loop() -> None:
    """Extender.bind calls the binder in a worker thread; an asyncio binder submits to `server.loop`."""

    pod = v1_pod("p", uid="u")
    pod["metadata"]["namespace"] = "ns"

    class LoopBinder:
        server: ExtenderServer
        ran_on: list[asyncio.AbstractEventLoop] = []

        def read_pod(self, *, namespace: str, name: str) -> dict[str, Any] | None:
            return pod if (namespace, name) == ("ns", "p") else None

        def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
            async def call() -> None:
                self.ran_on.append(asyncio.get_running_loop())

            asyncio.run_coroutine_threadsafe(call(), self.server.loop).result(10)

    binder = LoopBinder()
    server, client = start(Extender(binder=binder))
    binder.server = server
    try:
        nodes = node_list(v1_node("n1", gpu_state("n1", [1000])))
        assert client.post("filter", {"Pod": pod, "Nodes": nodes})[1]["Nodes"]["items"]
        args = {"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "n1"}
        assert client.post("bind", args) == (200, {"Error": ""})
        assert binder.ran_on == [server.loop]
    finally:
        server.stop()


def held_port() -> tuple[socket.socket, int]:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, holder.getsockname()[1]


def test_an_address_in_use_is_a_one_line_listen_error() -> None:
    holder, port = held_port()
    try:
        with pytest.raises(ListenError) as info:
            ExtenderServer(Extender(), port=port).start()
    finally:
        holder.close()
    assert str(info.value) == f"cannot listen for extender on 127.0.0.1:{port}: Address already in use"
    assert "--listen" in info.value.hint


def test_the_cli_on_an_address_in_use_exits_1_with_one_line() -> None:
    holder, port = held_port()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gpunode.cli", "extender", "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.close()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("HINT:")]
    assert errors == [f"gpunode: cannot listen for extender on 127.0.0.1:{port}: Address already in use"]


def test_batch_and_per_node_paths_agree_in_the_extender() -> None:
    """Nodes the batch form covers are scored in bulk; the rest one by one. Both give score_node's values."""
    from gpunode.cluster.extender.workload import WorkloadTracker
    from gpunode.placement import TargetPod, TargetWorkload, score_node

    workload = TargetWorkload(
        (
            TargetPod(cpu_milli=8000, gpu_milli=1000, gpus=1, gpu_models=None, weight=5),
            TargetPod(cpu_milli=2000, gpu_milli=250, gpus=1, gpu_models=None, weight=3),
            TargetPod(cpu_milli=1000, gpu_milli=0, gpus=0, gpu_models=None, weight=1),
        )
    )
    mixed = json.loads(gpu_state("mixed", [1000, 1000]))
    mixed["gpus"][1]["sharing"] = "whole"  # two modes on one node: per-node path
    nodes = [
        v1_node(f"n{i}", gpu_state(f"n{i}", shares))
        for i, shares in enumerate([[1000, 1000, 400, 0], [750, 250], [1000] * 8, [100, 900, 500]])
    ]
    nodes.append(v1_node("mixed", json.dumps(mixed)))
    pods = [
        v1_pod(
            "a", uid="a", limits={"gpunode.io/gpu-memory": "8"}, annotations={"gpunode.io/gpu-milli": "200"}
        ),
        v1_pod("b", uid="b", limits={"nvidia.com/gpu": "2"}),
        v1_pod("c", uid="c", limits={"gpunode.io/gpu-memory": "30"}),
    ]
    for policy in ("gpunode", "fgd", "bestfit", "packing"):
        extender = Extender(
            config=ExtenderConfig(policy=policy, provisional_reservations=False),
            workload=WorkloadTracker(seed=workload),
        )
        views = [extender.nodes.view(n) for n in nodes]
        for pod in pods:
            request = request_from_pod(pod)
            assert request is not None
            ctx = extender._context(pod["metadata"]["uid"])
            positions, fits_all, scores = extender._batch(views, request, ctx)
            assert positions == [0, 1, 2, 3]  # "mixed" is left to the per-node path
            for pos, fits, score in zip(positions, fits_all, scores, strict=True):
                choice = score_node(views[pos].state, request, policy=policy, workload=ctx.workload)  # type: ignore[arg-type]
                assert fits == (choice is not None)
                if choice is not None:
                    assert score == choice.score, (policy, pod["metadata"]["name"], pos)


def test_example_scheduler_configuration_wires_the_extender() -> None:
    from pathlib import Path

    import yaml

    import gpunode

    text = (Path(gpunode.__file__).parent / "examples" / "kube-scheduler-config.yaml").read_text()
    config = yaml.safe_load(text)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    extender, claims = config["extenders"]
    # the second entry: pods with DRA claims, prioritize only, every pod (no managedResources), ignorable
    assert claims["prioritizeVerb"] == "prioritize-claims" and claims["ignorable"] is True
    assert "managedResources" not in claims and "filterVerb" not in claims and "bindVerb" not in claims
    assert claims["urlPrefix"] == extender["urlPrefix"] and claims["tlsConfig"] == extender["tlsConfig"]
    assert (extender["filterVerb"], extender["prioritizeVerb"], extender["bindVerb"]) == (
        "filter",
        "prioritize",
        "bind",
    )
    managed = {r["name"] for r in extender["managedResources"]}
    assert {"nvidia.com/gpu", "gpunode.io/gpu-memory", "nvidia.com/mig-1g.10gb"} <= managed
    assert all(not r["ignoredByScheduler"] for r in extender["managedResources"])
    assert extender["nodeCacheCapable"] is True and 1 <= extender["weight"] <= 100
    # HTTPS, and kube-scheduler presents a client certificate (the extender binds only for such a client).
    assert extender["urlPrefix"].startswith("https://") and extender["enableHTTPS"] is True
    assert set(extender["tlsConfig"]) == {"certFile", "keyFile", "caFile"}


def test_extender_process_prints_its_bound_address_and_stops_on_sigterm() -> None:
    import re
    import signal
    import subprocess
    import sys
    import time

    gpunode_bin = os.path.join(os.path.dirname(sys.executable), "gpunode")
    proc = subprocess.Popen(
        [gpunode_bin, "extender", "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 20
        line = ""
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if "serving HTTP on" in line:
                break
        assert re.search(r"serving HTTP on 127\.0\.0\.1:(?!0\b)\d+", line), line
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
    assert rc == 0
