"""Eviction on an API server that serves only policy/v1beta1 (Kubernetes 1.20, 1.21): the client falls back
and remembers; the disruption-budget answer is the same in both versions. The real 1.20 API server is in
tests/e2e/test_realnode_deviceplugin.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeAlias

import pytest

from gpunode.errors import EvictionBlocked, KubeApiError, KubeNotFound
from gpunode.infra.kube import KubeClient
from tests.fakes.apiserver import ApiServerStandIn

Run: TypeAlias = Callable[[Awaitable[Any]], Any]


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        yield server


@pytest.fixture
def run() -> Iterator[Run]:
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture
def kube(api: ApiServerStandIn, run: Run) -> Iterator[KubeClient]:
    client = KubeClient.for_host(api.url, token="t", request_timeout_s=1.0)
    yield client
    run(client.close())


def _versions(api: ApiServerStandIn) -> list[str]:
    return [r.body["apiVersion"] for r in api.requests("POST", r"/eviction$")]


def test_policy_v1_is_used_where_served(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.add_pod("ns", "p")
    run(kube.evict_pod("ns", "p"))
    assert _versions(api) == ["policy/v1"] and api.pods() == []


def test_falls_back_to_v1beta1_once_and_remembers(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.serve_eviction_versions("policy/v1beta1")
    uid = api.add_pod("ns", "a")
    api.add_pod("ns", "b")
    run(kube.evict_pod("ns", "a", uid=uid, grace_period_s=5))
    assert _versions(api) == ["policy/v1", "policy/v1beta1"]
    body = api.requests("POST", r"/eviction$")[-1].body
    assert body["deleteOptions"] == {"preconditions": {"uid": uid}, "gracePeriodSeconds": 5}
    run(kube.evict_pod("ns", "b"))
    assert _versions(api) == ["policy/v1", "policy/v1beta1", "policy/v1beta1"], "the choice is kept"
    assert api.pods() == []


def test_back_to_v1_when_the_server_drops_v1beta1(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.serve_eviction_versions("policy/v1beta1")
    api.add_pod("ns", "a")
    api.add_pod("ns", "b")
    run(kube.evict_pod("ns", "a"))
    api.serve_eviction_versions("policy/v1")  # the API server was upgraded past 1.25 meanwhile
    run(kube.evict_pod("ns", "b"))
    assert _versions(api)[-2:] == ["policy/v1beta1", "policy/v1"] and api.pods() == []


def test_a_budget_blocks_a_v1beta1_eviction_the_same_way(
    api: ApiServerStandIn, kube: KubeClient, run: Run
) -> None:
    api.serve_eviction_versions("policy/v1beta1")
    api.add_pod("ns", "p")
    api.block_evictions("ns", "p", times=1)
    with pytest.raises(EvictionBlocked) as err:
        run(kube.evict_pod("ns", "p"))
    assert err.value.status == 429
    assert _versions(api) == ["policy/v1", "policy/v1beta1"]
    run(kube.evict_pod("ns", "p"))
    assert _versions(api)[-1] == "policy/v1beta1" and api.pods() == []


def test_other_refusals_are_not_retried_in_another_version(
    api: ApiServerStandIn, kube: KubeClient, run: Run
) -> None:
    with pytest.raises(KubeNotFound):
        run(kube.evict_pod("ns", "missing"))
    api.add_pod("ns", "p")
    api.fail("POST", r"/eviction$", 400, times=1)  # a bad request for another reason
    with pytest.raises(KubeApiError) as err:
        run(kube.evict_pod("ns", "p"))
    assert err.value.status == 400
    assert _versions(api) == ["policy/v1", "policy/v1"] and kube.eviction_version == "policy/v1"


def test_no_version_served_is_one_error(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.serve_eviction_versions()
    api.add_pod("ns", "p")
    with pytest.raises(KubeApiError) as err:
        run(kube.evict_pod("ns", "p"))
    assert err.value.status == 400 and "policy/v1beta1" in str(err.value) and "\n" not in str(err.value)
    assert _versions(api) == ["policy/v1", "policy/v1beta1"] and api.pods() == [("ns", "p")]
