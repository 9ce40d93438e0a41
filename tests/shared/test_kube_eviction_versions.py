"""Eviction is policy/v1 only (served from Kubernetes 1.22; gpunode supports 1.34 to 1.37): an API server
that refuses it gets no second request in another version, and its answer is one error. The real API
server (1.36) is in tests/e2e/test_realnode_deviceplugin.py."""

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


def test_policy_v1_is_used(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    uid = api.add_pod("ns", "p")
    run(kube.evict_pod("ns", "p", uid=uid, grace_period_s=5))
    assert _versions(api) == ["policy/v1"] and api.pods() == []
    body = api.requests("POST", r"/eviction$")[-1].body
    assert body["kind"] == "Eviction" and body["metadata"] == {"name": "p", "namespace": "ns"}
    assert body["deleteOptions"] == {"preconditions": {"uid": uid}, "gracePeriodSeconds": 5}


def test_a_budget_blocks_an_eviction_until_it_allows_it(
    api: ApiServerStandIn, kube: KubeClient, run: Run
) -> None:
    api.add_pod("ns", "p")
    api.block_evictions("ns", "p", times=1)
    with pytest.raises(EvictionBlocked) as err:
        run(kube.evict_pod("ns", "p"))
    assert err.value.status == 429
    run(kube.evict_pod("ns", "p"))
    assert _versions(api) == ["policy/v1", "policy/v1"] and api.pods() == []


def test_refusals_are_not_retried_in_another_version(
    api: ApiServerStandIn, kube: KubeClient, run: Run
) -> None:
    with pytest.raises(KubeNotFound):
        run(kube.evict_pod("ns", "missing"))
    api.add_pod("ns", "p")
    api.fail("POST", r"/eviction$", 400, times=1)  # a bad request for another reason
    with pytest.raises(KubeApiError) as err:
        run(kube.evict_pod("ns", "p"))
    assert err.value.status == 400
    assert _versions(api) == ["policy/v1", "policy/v1"]


def test_a_server_without_policy_v1_is_one_error(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    # An API server older than 1.22 (outside the supported range) refuses the body: one request, one line.
    api.serve_eviction_versions("policy/v1beta1")
    api.add_pod("ns", "p")
    with pytest.raises(KubeApiError) as err:
        run(kube.evict_pod("ns", "p"))
    assert err.value.status == 400 and "policy/v1" in str(err.value) and "\n" not in str(err.value)
    assert _versions(api) == ["policy/v1"] and api.pods() == [("ns", "p")]
