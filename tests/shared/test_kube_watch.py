"""KubeClient.watch and the typed lists against the API server stand-in's list+watch, over loopback HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod

from gpunode.errors import KubeApiError
from gpunode.infra.kube import ADDED, DELETED, MODIFIED, SYNC, KubeClient, WatchEvent
from gpunode.infra.kube import client as kube_client
from tests.fakes.apiserver import ApiServerStandIn

T = TypeVar("T")
STEP_S = 5.0  # the longest a single event may take to arrive


async def next_event(events: AsyncIterator[WatchEvent[T]]) -> WatchEvent[T]:
    return await asyncio.wait_for(anext(events), STEP_S)


def meta(obj: Node | Pod | None) -> ObjectMeta:
    assert obj is not None and obj.metadata is not None
    return obj.metadata


def names(event: WatchEvent[Any]) -> list[str]:
    return sorted(meta(item).name or "" for item in event.items)


def run(api: ApiServerStandIn, scenario: Callable[[KubeClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with KubeClient.for_host(api.url, request_timeout_s=1.0) as kube:
            await scenario(kube)

    asyncio.run(main())


@pytest.fixture
def api() -> Any:
    with ApiServerStandIn() as server:
        server.add_node("node-a")
        yield server


def test_lists_then_delivers_each_change_in_order(api: ApiServerStandIn) -> None:
    async def scenario(kube: KubeClient) -> None:
        async with contextlib.aclosing(kube.watch(Node)) as events:
            synced = await next_event(events)
            assert synced.type == SYNC and names(synced) == ["node-a"]
            assert isinstance(synced.items[0], Node)  # typed
            api.add_node("node-b")
            await kube.patch_node_annotations("node-a", {"gpunode.io/x": "1"})
            api.delete_node("node-b")
            added, modified, deleted = [await next_event(events) for _ in range(3)]
        assert (added.type, meta(added.object).name) == (ADDED, "node-b")
        assert modified.type == MODIFIED
        assert meta(modified.object).annotations == {"gpunode.io/x": "1"}
        assert (deleted.type, meta(deleted.object).name) == (DELETED, "node-b")
        versions = [int(e.resource_version) for e in (synced, added, modified, deleted)]
        assert versions == sorted(versions) and len(set(versions)) == 4
        assert len(api.requests("GET", r"^/api/v1/nodes$")) - len(api.watches()) == 1  # one list
        (watch,) = api.watches()
        assert watch.query["resourceVersion"] == synced.resource_version
        assert watch.query["allowWatchBookmarks"] == "true"

    run(api, scenario)


def test_a_version_expired_in_the_stream_means_a_new_list(api: ApiServerStandIn) -> None:
    async def scenario(kube: KubeClient) -> None:
        async with contextlib.aclosing(kube.watch(Node, retry_initial_s=0.01)) as events:
            first = await next_event(events)
            api.add_node("node-b")
            api.compact()  # the change to node-b is no longer in the history
            second = await next_event(events)
        assert (first.type, names(first)) == (SYNC, ["node-a"])
        assert (second.type, names(second)) == (SYNC, ["node-a", "node-b"])
        assert int(second.resource_version) > int(first.resource_version)
        assert [w.query["resourceVersion"] for w in api.watches()] == [first.resource_version]

    run(api, scenario)


def test_a_410_status_on_the_watch_request_means_a_new_list(api: ApiServerStandIn) -> None:
    async def scenario(kube: KubeClient) -> None:
        async with contextlib.aclosing(kube.watch(Node, retry_initial_s=0.01)) as events:
            assert (await next_event(events)).type == SYNC
            api.fail("GET", r"^/api/v1/nodes$", 410, times=1)  # the next GET is the watch
            api.add_node("node-b")
            relisted = await next_event(events)
            api.add_node("node-c")
            added = await next_event(events)
        assert (relisted.type, names(relisted)) == (SYNC, ["node-a", "node-b"])
        assert added.type == ADDED and meta(added.object).name == "node-c"

    run(api, scenario)


def test_a_watch_the_server_ends_is_resumed_without_a_new_list(api: ApiServerStandIn) -> None:
    async def scenario(kube: KubeClient) -> None:
        async with contextlib.aclosing(kube.watch(Node, server_timeout_s=1)) as events:
            synced = await next_event(events)
            pending = asyncio.ensure_future(next_event(events))  # watching meanwhile
            await asyncio.sleep(1.5)  # the first watch has ended by now
            version = api.bookmark("nodes")
            await asyncio.sleep(1.2)  # and the second, after its bookmark
            api.add_node("node-b")
            added = await pending
        assert added.type == ADDED and meta(added.object).name == "node-b"
        watches = api.watches()
        assert len(watches) >= 3
        assert watches[0].query["resourceVersion"] == synced.resource_version
        assert watches[-1].query["resourceVersion"] == version  # the bookmark moved the version on
        assert len(api.requests("GET", r"^/api/v1/nodes$")) - len(watches) == 1  # still one list

    run(api, scenario)


def test_an_api_server_restart_is_ridden_out(api: ApiServerStandIn) -> None:
    async def scenario(kube: KubeClient) -> None:
        async with contextlib.aclosing(kube.watch(Node, retry_initial_s=0.05, retry_max_s=0.2)) as events:
            synced = await next_event(events)
            api.stop()
            pending = asyncio.ensure_future(next_event(events))
            await asyncio.sleep(0.5)  # the watch is retried against a closed port meanwhile
            assert not pending.done()
            api.start()
            api.add_node("node-b")
            added = await pending
        assert added.type == ADDED and meta(added.object).name == "node-b"
        assert api.watches()[-1].query["resourceVersion"] == synced.resource_version

    run(api, scenario)


def test_a_forbidden_watch_ends_the_iteration_with_the_error(api: ApiServerStandIn) -> None:
    async def scenario(kube: KubeClient) -> None:
        api.fail("GET", r"^/api/v1/nodes$", 403, times=None)
        with pytest.raises(KubeApiError) as err:
            async with contextlib.aclosing(kube.watch(Node)) as events:
                await next_event(events)
        assert err.value.status == 403 and "RBAC" in err.value.hint

    run(api, scenario)


def test_pods_of_one_namespace_and_their_eviction(api: ApiServerStandIn) -> None:
    uid = api.add_pod("team", "trainer", node_name="node-a")
    api.add_pod("other", "web", node_name="node-a")

    async def scenario(kube: KubeClient) -> None:
        async with contextlib.aclosing(kube.watch(Pod, namespace="team")) as events:
            synced = await next_event(events)
            api.add_pod("other", "db")  # another namespace: not seen
            await kube.evict_pod("team", "trainer", uid=uid)
            deleted = await next_event(events)
        assert [(meta(p).namespace, meta(p).name) for p in synced.items] == [("team", "trainer")]
        assert deleted.type == DELETED and meta(deleted.object).uid == uid
        assert api.watches()[0].path == "/api/v1/namespaces/team/pods"

    run(api, scenario)


def test_lists_follow_pages(api: ApiServerStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_client, "LIST_CHUNK", 2)
    for name in ("node-b", "node-c", "node-d", "node-e"):
        api.add_node(name)

    async def scenario(kube: KubeClient) -> None:
        nodes, version = await kube.list_objects(Node)
        assert [meta(n).name for n in nodes] == [
            "node-a",
            "node-b",
            "node-c",
            "node-d",
            "node-e",
        ]
        assert version and [r.query.get("continue") for r in api.requests("GET")] == [None, "2", "4"]
        as_json = await kube.list_nodes()
        assert [n["metadata"]["name"] for n in as_json][:2] == ["node-a", "node-b"] and len(as_json) == 5

    run(api, scenario)
