"""The extender's KubeApi against the API server stand-in: sync binds from worker threads onto the
client's event loop, the async list, the node refresher, token rotation, and a bind through the server."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.cluster.extender.core import Extender
from gpunode.cluster.extender.kubeapi import KubeApi, refresh_nodes_periodically
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.contract.names import ASSIGNMENT_ANNOTATION
from gpunode.errors import KubeConflict, KubeUnreachable
from tests.fakes.apiserver import ApiServerStandIn

GPUS = ("GPU-0", "GPU-1")


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.add_node("n1")
        server.add_pod("team", "train-0", node_name="")
        yield server


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own, as the extender's server loop is to its workers."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def closed(kube: KubeApi, loop: asyncio.AbstractEventLoop) -> None:
    asyncio.run_coroutine_threadsafe(kube.close(), loop).result(5)


def test_bind_from_a_thread_annotates_and_binds_on_the_clients_loop(
    api: ApiServerStandIn, loop: asyncio.AbstractEventLoop
) -> None:
    kube = KubeApi(api.url, loop=loop)
    uid = api.pod("team", "train-0")["metadata"]["uid"]
    kube.bind(namespace="team", name="train-0", uid=uid, node="n1", gpu_uuids=GPUS)
    pod = api.pod("team", "train-0")
    assert pod["spec"]["nodeName"] == "n1"
    assert pod["metadata"]["annotations"] == {ASSIGNMENT_ANNOTATION: "GPU-0,GPU-1"}
    patch, binding = api.requests("PATCH")[-1], api.requests("POST", r"/binding$")[-1]
    assert patch.at <= binding.at and patch.content_type == "application/merge-patch+json"
    assert binding.body["metadata"] == {"name": "train-0", "namespace": "team", "uid": uid}
    assert binding.body["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
    closed(kube, loop)


def test_bind_of_a_bound_or_replaced_pod_is_a_conflict(
    api: ApiServerStandIn, loop: asyncio.AbstractEventLoop
) -> None:
    kube = KubeApi(api.url, loop=loop)
    with pytest.raises(KubeConflict) as err:
        kube.bind(namespace="team", name="train-0", uid="uid-of-an-older-pod", node="n1", gpu_uuids=())
    assert "HTTP 409" in str(err.value) and "UID" in str(err.value)
    kube.bind(namespace="team", name="train-0", uid="team/train-0", node="n1", gpu_uuids=())  # no uid known
    with pytest.raises(KubeConflict) as err:
        kube.bind(namespace="team", name="train-0", uid="team/train-0", node="n2", gpu_uuids=())
    assert "already assigned" in str(err.value)
    assert api.requests("PATCH") == []  # no GPUs, no annotation
    closed(kube, loop)


def test_a_bind_the_api_server_does_not_answer_times_out(
    api: ApiServerStandIn, loop: asyncio.AbstractEventLoop
) -> None:
    kube = KubeApi(api.url, loop=loop, timeout_s=0.3)
    api.hang(r"/binding$", 2.0)
    with pytest.raises(KubeUnreachable) as err:
        kube.bind(namespace="team", name="train-0", uid="u", node="n1", gpu_uuids=())
    assert "did not answer" in str(err.value)
    closed(kube, loop)


def test_sync_calls_need_a_loop_in_another_thread(api: ApiServerStandIn) -> None:
    kube = KubeApi(api.url)
    with pytest.raises(RuntimeError, match="attach"):
        kube.list_nodes()  # no loop yet

    async def on_the_loop() -> None:
        assert [n["metadata"]["name"] for n in await kube.list_nodes_async()] == ["n1"]
        assert kube.loop is asyncio.get_running_loop()  # bound by the first async call
        with pytest.raises(RuntimeError, match="another thread"):
            kube.list_nodes()  # would wait for itself
        await kube.close()

    asyncio.run(on_the_loop())
    with pytest.raises(RuntimeError, match="another event loop"):
        kube.attach(asyncio.new_event_loop())


def test_refresher_feeds_the_node_cache(api: ApiServerStandIn) -> None:
    extender = Extender()

    async def scenario() -> None:
        kube = KubeApi(api.url)
        kube.attach(asyncio.get_running_loop())
        ready = asyncio.Event()
        task = asyncio.create_task(
            refresh_nodes_periodically(api=kube, extender=extender, interval_s=60, ready=ready)
        )
        await asyncio.wait_for(ready.wait(), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.close()

    asyncio.run(scenario())
    assert len(extender.nodes) == 1 and "unknown" not in extender.nodes.get("n1").reason
    (listed,) = api.requests("GET", r"^/api/v1/nodes$")
    assert listed.query["limit"] == "500"


def test_a_rotated_token_is_read_again(api: ApiServerStandIn, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")

    async def scenario() -> None:
        kube = KubeApi(api.url, token_file=token)
        await kube.list_nodes_async()
        token.write_text("second\n")  # the kubelet rotated it
        api.fail("GET", r"^/api/v1/nodes$", 401, times=1)  # the old one is refused once
        await kube.list_nodes_async()
        await kube.close()

    asyncio.run(scenario())
    assert [r.authorization for r in api.requests("GET")] == ["Bearer first", "Bearer first", "Bearer second"]


def test_bind_through_the_extender_server(api: ApiServerStandIn) -> None:
    kube = KubeApi(api.url)
    extender = Extender(binder=kube)
    node = api.node("n1")
    node["metadata"]["annotations"] = {}  # no GPU state: the pod asks for none, so any node fits
    extender.refresh_nodes([node])
    server = ExtenderServer(extender, port=0)
    server.start()
    kube.attach(server.loop)
    try:
        uid = api.pod("team", "train-0")["metadata"]["uid"]
        # kube-scheduler filters before it binds; the extender binds only what its filter passed.
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request(
            "POST", "/filter", body=json.dumps({"Pod": api.pod("team", "train-0"), "NodeNames": ["n1"]})
        )
        assert json.loads(conn.getresponse().read())["NodeNames"] == ["n1"]
        conn.close()
        body = {"PodName": "train-0", "PodNamespace": "team", "PodUID": uid, "Node": "n1"}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("POST", "/bind", body=json.dumps(body), headers={"Content-Type": "application/json"})
        answer: Any = json.loads(conn.getresponse().read())
        conn.close()
        assert answer == {"Error": ""}
        assert api.pod("team", "train-0")["spec"]["nodeName"] == "n1"
    finally:
        asyncio.run_coroutine_threadsafe(kube.close(), server.loop).result(5)
        server.stop()
