"""A container given two capped claims (or a capped claim and the device plugin's memory units) would get
one cap, silently: each region is mounted at the same path in the container. Prepare refuses such a claim
in one line naming the container, the pod and the other claim; claims in separate containers of one pod,
a capped claim beside a whole GPU, and one claim used by two containers are prepared."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gpunode.errors import ClaimRefused, KubeError, KubeNotFound
from gpunode.node.dra.claims import ClaimRef
from gpunode.node.dra.slices import gpu_device_name, shared_device_name
from tests.node.dra_world import claim as claim_body
from tests.node.dra_world import new_uid
from tests.node.test_metrics_collector import needs_memcap
from tests.node.test_metrics_dra import HOST, Node

NS = "team-a"


class PodNode(Node):
    """The simulated node, with pods the preparer reads to check a container's caps."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.pods: dict[str, dict[str, Any]] = {}
        self.pod_reads = 0

        async def fetch_pod(namespace: str, name: str) -> dict[str, Any]:
            self.pod_reads += 1
            if (namespace, name) == (NS, "unreadable"):
                raise KubeError("pods is forbidden", hint="grant get pods")
            try:
                return self.pods[name]
            except KeyError:
                raise KubeNotFound(f"pod {namespace}/{name} not found") from None

        self.preparer.fetch_pod = fetch_pod

    def claim(self, name: str, device: str, memory: str | None, pod: str) -> ClaimRef:
        body = claim_body(
            name, namespace=NS, device=device, memory=memory, pool=HOST, share=new_uid() if memory else None
        )
        body["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": new_uid()}]
        self.claims[(NS, name)] = body
        return ClaimRef(NS, body["metadata"]["uid"], name)

    def pod(
        self, name: str, containers: dict[str, list[str]], claims: dict[str, str], **resources: Any
    ) -> None:
        """A pod whose containers use pod claims (pod claim name -> ResourceClaim name)."""
        self.pods[name] = {
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "resourceClaims": [{"name": k, "resourceClaimName": v} for k, v in claims.items()],
                "containers": [
                    {"name": c, "resources": {"claims": [{"name": r} for r in refs], **resources.get(c, {})}}
                    for c, refs in containers.items()
                ],
            },
        }

    def made(self) -> list[str]:
        root = self.config.state_dir / "dra" / "memcap"
        return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def _prepare_all(node: PodNode, *refs: ClaimRef) -> list[Any]:
    async def run() -> list[Any]:
        return list(await asyncio.gather(*(node.preparer.prepare(r) for r in refs), return_exceptions=True))

    return asyncio.run(run())


@needs_memcap
def test_two_capped_claims_in_one_container_are_both_refused_in_one_line(tmp_path: Path) -> None:
    node = PodNode(tmp_path)
    a = node.claim("share-a", shared_device_name(node.gpus[0].uuid), "4Gi", "p")
    b = node.claim("share-b", shared_device_name(node.gpus[1].uuid), "4Gi", "p")
    node.pod("p", {"main": ["a", "b"]}, {"a": "share-a", "b": "share-b"})
    outcomes = _prepare_all(node, a, b)  # as the kubelet asks: the pod's claims in one call
    assert all(isinstance(o, ClaimRefused) for o in outcomes), outcomes
    first = str(outcomes[0])
    assert "\n" not in first
    assert "container main of pod team-a/p also uses claim team-a/share-b, a share of a GPU too" in first
    assert "one claim" in outcomes[0].hint
    assert node.made() == []  # nothing made for either


@needs_memcap
def test_a_capped_claim_and_the_device_plugins_memory_units_in_one_container_are_refused(
    tmp_path: Path,
) -> None:
    node = PodNode(tmp_path)
    a = node.claim("share-a", shared_device_name(node.gpus[0].uuid), "4Gi", "p")
    resource = node.config.fractional.resource_name
    node.pod("p", {"main": ["a"]}, {"a": "share-a"}, main={"limits": {resource: "2"}})
    with pytest.raises(ClaimRefused, match=f"also asks {resource} of the device plugin"):
        asyncio.run(node.preparer.prepare(a))


@needs_memcap
@pytest.mark.parametrize(
    ("containers", "second"),
    [
        ({"one": ["a"], "two": ["b"]}, "shared"),  # each claim in its own container
        ({"main": ["a", "b"]}, "whole"),  # a share beside a whole GPU: one cap
        ({"one": ["a"], "two": ["a"]}, "shared"),  # one claim in two containers
    ],
)
def test_containers_with_one_cap_each_are_prepared(
    tmp_path: Path, containers: dict[str, list[str]], second: str
) -> None:
    node = PodNode(tmp_path)
    a = node.claim("share-a", shared_device_name(node.gpus[0].uuid), "4Gi", "p")
    if second == "whole":
        b = node.claim("whole-b", gpu_device_name(node.gpus[1].uuid), None, "p")
    else:
        b = node.claim("share-b", shared_device_name(node.gpus[1].uuid), "4Gi", "p")
    node.pod("p", containers, {"a": "share-a", "b": b.name})
    outcomes = _prepare_all(node, a, b)
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes


@needs_memcap
def test_a_pod_that_cannot_be_read_is_not_checked_and_the_claim_is_prepared(tmp_path: Path) -> None:
    node = PodNode(tmp_path)
    a = node.claim("share-a", shared_device_name(node.gpus[0].uuid), "4Gi", "unreadable")
    asyncio.run(node.preparer.prepare(a))
    assert node.pod_reads == 1 and len(node.made()) == 1


@needs_memcap
def test_a_whole_gpu_claim_reads_no_pod(tmp_path: Path) -> None:
    node = PodNode(tmp_path)
    w = node.claim("whole", gpu_device_name(node.gpus[0].uuid), None, "p")
    asyncio.run(node.preparer.prepare(w))
    assert node.pod_reads == 0  # nothing capped: no second cap to look for, no extra API call


@needs_memcap
def test_through_the_plugins_socket_the_pod_is_read_from_the_api_server() -> None:
    """The agent's own path: the kubelet stub calls NodePrepareResources, the plugin reads the claims and
    the pod over HTTP; the pod's one container uses both claims: both get the line, the regions are not made."""
    from tests.node.dra_world import claim as world_claim
    from tests.node.dra_world import world

    async def scenario() -> None:
        async with world() as w:
            a = w.api.add_with_pod(world_claim("a", device="gpu-0-shared", share="s1"), "p")
            b = w.api.add(world_claim("b", device="gpu-1-shared", share="s2"))
            w.api.claims[(b.namespace, b.name)]["status"]["reservedFor"] = w.api.claims[
                (a.namespace, a.name)
            ]["status"]["reservedFor"]
            pod = w.api.pods[(a.namespace, "p")]
            pod["spec"]["resourceClaims"].append({"name": "second", "resourceClaimName": "b"})
            pod["spec"]["containers"][0]["resources"]["claims"].append({"name": "second"})
            resp = await w.prepare(a, b)
            for r in (a, b):
                assert "a container gets one memory cap" in resp.claims[r.uid].error
            assert not [p for p in w.regions.iterdir() if not p.name.startswith(".")]
            pod["spec"]["containers"].append({"name": "other", "resources": {"claims": [{"name": "second"}]}})
            pod["spec"]["containers"][0]["resources"]["claims"].pop()  # now one claim per container
            resp = await w.prepare(a, b)
            assert [resp.claims[r.uid].error for r in (a, b)] == ["", ""]

    asyncio.run(asyncio.wait_for(scenario(), 30))
