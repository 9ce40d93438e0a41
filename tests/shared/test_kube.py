"""gpunode.infra.kube against the API server stand-in over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import pytest

from gpunode.errors import (
    EvictionBlocked,
    KubeApiError,
    KubeConflict,
    KubeError,
    KubeNotFound,
    KubeUnreachable,
)
from gpunode.infra.kube import KubeClient, NodeCondition, ObjectRef, Taint
from tests.fakes.apiserver import ApiServerStandIn

Run: TypeAlias = Callable[[Awaitable[Any]], Any]


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.add_node("node-a", labels={"kubernetes.io/hostname": "node-a"})
        yield server


@pytest.fixture
def run() -> Iterator[Run]:
    """Runs one coroutine to completion; every call of a test runs on the same event loop."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture
def kube(api: ApiServerStandIn, run: Run) -> Iterator[KubeClient]:
    client = KubeClient.for_host(api.url, token="secret-token", request_timeout_s=1.0)
    yield client
    run(client.close())


def test_get_pod_reads_uid_node_and_phase(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    uid = api.add_pod("team-a", "trainer-0", node_name="node-a")
    pod = run(kube.get_pod("team-a", "trainer-0"))
    assert (pod.namespace, pod.name, pod.uid, pod.node_name, pod.phase, pod.deleting) == (
        "team-a",
        "trainer-0",
        uid,
        "node-a",
        "Running",
        False,
    )
    request = api.requests("GET")[-1]
    assert request.path == "/api/v1/namespaces/team-a/pods/trainer-0"


def test_bearer_token_is_sent(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.add_pod("ns", "p")
    run(kube.get_pod("ns", "p"))
    assert api.requests("GET")[-1].authorization == "Bearer secret-token"


def test_eviction_is_a_policy_v1_eviction_with_uid_precondition(
    api: ApiServerStandIn, kube: KubeClient, run: Run
) -> None:
    uid = api.add_pod("ns", "p")
    run(kube.evict_pod("ns", "p", uid=uid, grace_period_s=30))
    body = api.requests("POST", r"/eviction$")[-1].body
    assert body == {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "p", "namespace": "ns"},
        "deleteOptions": {"preconditions": {"uid": uid}, "gracePeriodSeconds": 30},
    }
    assert api.pods() == []


def test_eviction_blocked_by_a_pdb_raises_eviction_blocked(
    api: ApiServerStandIn, kube: KubeClient, run: Run
) -> None:
    api.add_pod("ns", "p")
    api.block_evictions("ns", "p", times=1)
    with pytest.raises(EvictionBlocked) as err:
        run(kube.evict_pod("ns", "p"))
    assert err.value.status == 429 and "disruption budget" in str(err.value)
    run(kube.evict_pod("ns", "p"))  # the budget allows it now
    assert api.pods() == []


def test_retry_after_header_is_read(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.add_pod("ns", "p")
    api.fail("POST", r"/eviction$", 429, times=1, retry_after_s=7)
    with pytest.raises(EvictionBlocked) as err:
        run(kube.evict_pod("ns", "p"))
    assert err.value.retry_after_s == 7.0


def test_dry_run_eviction_leaves_the_pod(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.add_pod("ns", "p")
    run(kube.evict_pod("ns", "p", dry_run=True))
    assert api.pods() == [("ns", "p")]


def test_eviction_of_a_replaced_pod_is_a_conflict(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.add_pod("ns", "p", uid="new-uid")
    with pytest.raises(KubeConflict):
        run(kube.evict_pod("ns", "p", uid="old-uid"))
    assert api.pods() == [("ns", "p")]


def test_delete_pod_with_precondition(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    uid = api.add_pod("ns", "p")
    with pytest.raises(KubeConflict):
        run(kube.delete_pod("ns", "p", uid="someone-else"))
    run(kube.delete_pod("ns", "p", uid=uid, grace_period_s=0))
    assert api.pods() == []
    assert api.requests("DELETE")[-1].body == {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "preconditions": {"uid": uid},
        "gracePeriodSeconds": 0,
    }


@pytest.mark.parametrize(
    ("status", "error", "reason"),
    [
        pytest.param(404, KubeNotFound, "NotFound", id="404-not-found"),
        pytest.param(403, KubeApiError, "Forbidden", id="403-forbidden-names-rbac"),
        pytest.param(500, KubeApiError, "InternalError", id="500-internal"),
        pytest.param(503, KubeApiError, "ServiceUnavailable", id="503-unavailable"),
    ],
)
def test_error_statuses_are_translated(
    api: ApiServerStandIn, kube: KubeClient, run: Run, status: int, error: type[KubeError], reason: str
) -> None:
    api.add_pod("ns", "p")
    api.fail("GET", r"/pods/p$", status)
    with pytest.raises(error) as err:
        run(kube.get_pod("ns", "p"))
    assert isinstance(err.value, KubeApiError) and err.value.status == status
    assert err.value.reason == reason and f"HTTP {status}" in str(err.value)
    if status == 403:
        assert "RBAC" in err.value.hint


def test_a_hanging_api_server_times_out(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.add_pod("ns", "p")
    api.hang(r"/pods/p$", 3.0)
    with pytest.raises(KubeUnreachable) as err:
        run(kube.get_pod("ns", "p"))
    assert "did not answer" in str(err.value)


def test_an_api_server_that_is_down_is_unreachable(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    api.stop()
    with pytest.raises(KubeUnreachable) as err:
        run(kube.get_pod("ns", "p"))
    assert "Connection refused" in str(err.value) or "refused" in str(err.value).lower()
    api.start()  # back on the same port: the same client works again
    api.add_pod("ns", "p")
    assert run(kube.get_pod("ns", "p")).name == "p"


def test_events_on_pod_and_node(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    uid = api.add_pod("ns", "p")
    run(
        kube.post_event(
            ObjectRef("Pod", "p", "ns", uid), reason="GpuFaultEviction", message="m1", host="node-a"
        )
    )
    run(kube.post_event(ObjectRef("Node", "node-a"), reason="GpuUnhealthy", message="m2", host="node-a"))
    pod_event, node_event = api.events()
    assert pod_event["metadata"]["namespace"] == "ns"
    assert pod_event["involvedObject"] == {
        "kind": "Pod",
        "name": "p",
        "namespace": "ns",
        "uid": uid,
        "apiVersion": "v1",
    }
    assert (pod_event["reason"], pod_event["message"], pod_event["type"]) == (
        "GpuFaultEviction",
        "m1",
        "Warning",
    )
    assert pod_event["source"] == {"component": "gpunode", "host": "node-a"}
    assert node_event["metadata"]["namespace"] == "default"
    assert node_event["involvedObject"] == {"kind": "Node", "name": "node-a", "apiVersion": "v1"}
    assert pod_event["metadata"]["name"] != node_event["metadata"]["name"]


def test_node_annotations_set_and_removed(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    run(kube.patch_node_annotations("node-a", {"gpunode.io/unhealthy-gpus": '{"GPU-1": "XID 79"}'}))
    assert api.node("node-a")["metadata"]["annotations"] == {
        "gpunode.io/unhealthy-gpus": '{"GPU-1": "XID 79"}'
    }
    assert api.requests("PATCH")[-1].content_type == "application/merge-patch+json"
    run(kube.patch_node_annotations("node-a", {"gpunode.io/unhealthy-gpus": None}))
    assert api.node("node-a")["metadata"]["annotations"] == {}


def test_node_labels_keep_other_labels(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    run(kube.patch_node_labels("node-a", {"gpunode.io/unhealthy-gpus": "1"}))
    assert api.node("node-a")["metadata"]["labels"] == {
        "kubernetes.io/hostname": "node-a",
        "gpunode.io/unhealthy-gpus": "1",
    }


def test_taint_added_replaced_and_removed(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    run(
        kube.set_node_taint(
            "node-a", "gpunode.io/gpu-fault", Taint("gpunode.io/gpu-fault", "1", "NoSchedule")
        )
    )
    run(kube.set_node_taint("node-a", "other", Taint("other", "x", "NoExecute")))
    run(
        kube.set_node_taint(
            "node-a", "gpunode.io/gpu-fault", Taint("gpunode.io/gpu-fault", "2", "NoSchedule")
        )
    )
    assert api.node("node-a")["spec"]["taints"] == [
        {"key": "other", "value": "x", "effect": "NoExecute"},
        {"key": "gpunode.io/gpu-fault", "value": "2", "effect": "NoSchedule"},
    ]
    run(kube.set_node_taint("node-a", "gpunode.io/gpu-fault", None))
    assert api.node("node-a")["spec"]["taints"] == [{"key": "other", "value": "x", "effect": "NoExecute"}]


def test_taint_retries_when_the_node_changed_in_between(
    api: ApiServerStandIn, kube: KubeClient, run: Run
) -> None:
    api.fail("PATCH", r"/nodes/node-a$", 409, times=1)
    run(kube.set_node_taint("node-a", "k", Taint("k", "v", "NoSchedule")))
    assert api.node("node-a")["spec"]["taints"] == [{"key": "k", "value": "v", "effect": "NoSchedule"}]
    patches = api.requests("PATCH")
    assert len(patches) == 2 and patches[0].body[0]["op"] == "test"


def test_node_condition_merged_by_type(api: ApiServerStandIn, kube: KubeClient, run: Run) -> None:
    run(kube.set_node_condition("node-a", NodeCondition("GpuUnhealthy", "True", "XidFatal", "GPU-1: XID 79")))
    run(kube.set_node_condition("node-a", NodeCondition("Other", "False", "Fine", "")))
    run(kube.set_node_condition("node-a", NodeCondition("GpuUnhealthy", "False", "AllHealthy", "")))
    conditions = {c["type"]: c for c in api.node("node-a")["status"]["conditions"]}
    assert set(conditions) == {"GpuUnhealthy", "Other"}
    assert (conditions["GpuUnhealthy"]["status"], conditions["GpuUnhealthy"]["reason"]) == (
        "False",
        "AllHealthy",
    )
    assert api.requests("PATCH")[-1].path == "/api/v1/nodes/node-a/status"


def test_kubeconfig_file_is_used(api: ApiServerStandIn, tmp_path: Path, run: Run) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": api.url}}],
                "users": [{"name": "u", "user": {"token": "kubeconfig-token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    client = KubeClient.from_environment(kubeconfig=str(kubeconfig), request_timeout_s=1.0)
    api.add_pod("ns", "p")
    assert run(client.get_pod("ns", "p")).name == "p"
    assert api.requests("GET")[-1].authorization == "Bearer kubeconfig-token"
    run(client.close())


def test_missing_credentials_name_both_sources(tmp_path: Path) -> None:
    with pytest.raises(KubeError) as err:
        KubeClient.from_environment(kubeconfig=str(tmp_path / "absent"))
    assert str(tmp_path / "absent") in str(err.value)
    assert "remediation" in err.value.hint


def self_signed(directory: Path) -> tuple[str, str]:
    cert, key = directory / "ca.crt", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_in_cluster_service_account_over_tls(tmp_path: Path, run: Run) -> None:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    cert, key = self_signed(sa)
    (sa / "token").write_text("projected-token")
    with ApiServerStandIn(tls=(cert, key)) as api:
        api.add_pod("ns", "p")
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
        client = KubeClient.from_environment(service_account_dir=sa, environ=env, request_timeout_s=2.0)
        assert client.host == f"https://127.0.0.1:{api.port}"
        assert (
            run(client.get_pod("ns", "p")).name == "p"
        )  # the CA from the service account verifies the server
        assert api.requests("GET")[-1].authorization.lower() == "bearer projected-token"
        run(client.close())


def test_in_cluster_without_a_token_falls_back_to_kubeconfig_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever kubeconfig the machine running the tests has, this test must not find it.
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    with pytest.raises(KubeError) as err:
        KubeClient.from_environment(service_account_dir=tmp_path, environ=env, kubeconfig=None)
    assert "in-cluster service account" in str(err.value) and "token" in str(err.value).lower()
