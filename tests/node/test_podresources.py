"""The pod-resources client against the stand-in kubelet over a real Unix socket."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpunode.errors import KubeError
from gpunode.node.kubelet.podresources import (
    AttributionSnapshot,
    ContainerDevices,
    PodAttribution,
    PodRef,
    list_container_devices,
)
from tests.fakes.podresources import Container, Pod, PodResourcesStandIn

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


@pytest.fixture
def sock_path() -> Iterator[str]:
    # Unix socket paths are limited to ~108 bytes; pytest's tmp_path can be longer.
    short = tempfile.mkdtemp(prefix="gpn-pr-", dir="/tmp")
    yield os.path.join(short, "kubelet.sock")
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def kubelet(sock_path: str) -> Iterator[PodResourcesStandIn]:
    with PodResourcesStandIn(sock_path) as standin:
        yield standin


def test_list_flattens_pods_containers_and_resources(kubelet: PodResourcesStandIn) -> None:
    kubelet.set_pods(
        [
            Pod(
                "team-a",
                "trainer-0",
                (
                    Container("main", {"nvidia.com/gpu": [GPU0], "gpunode.io/gpu-memory": [f"{GPU1}::mem0"]}),
                    Container("sidecar", {}),
                ),
            ),
            Pod("team-b", "idle", (Container("app", {}),)),
        ]
    )
    got = asyncio.run(list_container_devices(kubelet.socket_path))
    assert got == (
        ContainerDevices("team-a", "trainer-0", "main", "nvidia.com/gpu", (GPU0,)),
        ContainerDevices("team-a", "trainer-0", "main", "gpunode.io/gpu-memory", (f"{GPU1}::mem0",)),
    )


def test_flat_records_round_trip_through_the_stand_in(kubelet: PodResourcesStandIn) -> None:
    records = [
        ContainerDevices("ns", "p", "c1", "nvidia.com/gpu.shared", (f"{GPU0}::0", f"{GPU0}::3")),
        ContainerDevices("ns", "p", "c2", "nvidia.com/gpu.shared", (f"{GPU0}::1",)),
        ContainerDevices("other", "q", "c", "nvidia.com/gpu", (GPU1,)),
    ]
    kubelet.set_pods(records)
    assert asyncio.run(list_container_devices(kubelet.socket_path)) == tuple(records)


def test_very_large_answer_is_accepted(kubelet: PodResourcesStandIn) -> None:
    from gpunode.node.kubelet._proto import podresources_v1_pb2 as pb
    from tests.fakes.podresources import _pod_message

    ids = [f"{GPU0}::{n:07d}-{'x' * 40}" for n in range(20000)]
    pods = [Pod("bulk", f"pod-{i}", (Container("c", {"nvidia.com/gpu.shared": ids}),)) for i in range(3)]
    wire_bytes = pb.ListPodResourcesResponse(pod_resources=[_pod_message(p) for p in pods]).ByteSize()
    assert wire_bytes > 4 * 1024 * 1024, "must exceed gRPC's default 4 MiB receive limit"
    kubelet.set_pods(pods)
    got = asyncio.run(list_container_devices(kubelet.socket_path))
    assert [c.pod for c in got] == ["pod-0", "pod-1", "pod-2"]
    assert all(c.device_ids == tuple(ids) for c in got)


def test_missing_socket_is_a_clear_kube_error(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.sock")
    with pytest.raises(KubeError) as info:
        asyncio.run(list_container_devices(path))
    assert "does not exist" in str(info.value) and path in str(info.value)
    assert "hostPath" in info.value.hint


def test_a_plain_file_is_not_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "kubelet.sock"
    path.write_text("")
    with pytest.raises(KubeError, match="not a Unix socket"):
        asyncio.run(list_container_devices(str(path)))


def test_stale_socket_without_a_kubelet_is_unavailable(sock_path: str) -> None:
    # A socket file left behind by a stopped kubelet: bound, never listening.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock_path)
    try:
        with pytest.raises(KubeError, match="does not answer") as info:
            asyncio.run(list_container_devices(sock_path, timeout_s=2.0))
        assert "kubelet is running" in info.value.hint
    finally:
        s.close()
        os.unlink(sock_path)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        pytest.param(grpc.StatusCode.UNIMPLEMENTED, "does not serve pod-resources v1", id="unimplemented"),
        pytest.param(grpc.StatusCode.PERMISSION_DENIED, "failed (PERMISSION_DENIED)", id="permission-denied"),
        pytest.param(grpc.StatusCode.INTERNAL, "failed (INTERNAL)", id="internal"),
    ],
)
def test_grpc_status_becomes_kube_error(
    kubelet: PodResourcesStandIn, code: grpc.StatusCode, expected: str
) -> None:
    kubelet.fail_with(code, "boom")
    with pytest.raises(KubeError, match=expected.replace("(", r"\(").replace(")", r"\)")) as info:
        asyncio.run(list_container_devices(kubelet.socket_path))
    assert info.value.hint


def test_slow_kubelet_hits_the_deadline(kubelet: PodResourcesStandIn) -> None:
    kubelet.delay(1.0)
    with pytest.raises(KubeError, match=r"did not answer .* within 0.2 s"):
        asyncio.run(list_container_devices(kubelet.socket_path, timeout_s=0.2))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_attribution_caches_for_its_ttl(kubelet: PodResourcesStandIn) -> None:
    kubelet.set_pods([ContainerDevices("ns", "a", "c", "nvidia.com/gpu", (GPU0,))])
    clock = FakeClock()
    attribution = PodAttribution(kubelet.socket_path, ttl_s=5.0, monotonic=clock)

    async def scenario() -> None:
        assert await attribution.owner_of(GPU0) == PodRef("ns", "a", "c")
        kubelet.set_pods([ContainerDevices("ns", "b", "c", "nvidia.com/gpu", (GPU0,))])
        clock.now += 4.9
        assert await attribution.owner_of(GPU0) == PodRef("ns", "a", "c"), "served from the cache"
        assert kubelet.call_count("List") == 1
        clock.now += 0.2
        assert await attribution.owner_of(GPU0) == PodRef("ns", "b", "c"), "refreshed after the TTL"
        assert await attribution.owner_of(GPU1) is None
        assert kubelet.call_count("List") == 2

    asyncio.run(scenario())


def test_concurrent_callers_share_one_request(kubelet: PodResourcesStandIn) -> None:
    kubelet.set_pods([ContainerDevices("ns", "a", "c", "nvidia.com/gpu", (GPU0,))])
    kubelet.delay(0.2)
    attribution = PodAttribution(kubelet.socket_path, ttl_s=60.0)

    async def scenario() -> list[AttributionSnapshot]:
        return await asyncio.gather(*(attribution.snapshot() for _ in range(8)))

    snaps = asyncio.run(scenario())
    assert all(s is snaps[0] for s in snaps)
    assert kubelet.call_count("List") == 1


def test_failed_refresh_keeps_the_last_answer(kubelet: PodResourcesStandIn) -> None:
    kubelet.set_pods([ContainerDevices("ns", "a", "c", "nvidia.com/gpu", (GPU0,))])
    clock = FakeClock()
    attribution = PodAttribution(kubelet.socket_path, ttl_s=1.0, monotonic=clock)

    async def scenario() -> None:
        first = await attribution.snapshot()
        kubelet.fail_with(grpc.StatusCode.UNAVAILABLE)
        clock.now += 2.0
        with pytest.raises(KubeError):
            await attribution.snapshot()
        assert attribution.last is first
        assert attribution.last_error is not None
        kubelet.fail_with(None)
        await attribution.snapshot()
        assert attribution.last_error is None

    asyncio.run(scenario())


def test_a_device_listed_twice_keeps_its_first_holder() -> None:
    snap = AttributionSnapshot.from_containers(
        [
            ContainerDevices("ns", "a", "c", "nvidia.com/gpu", (GPU0,)),
            ContainerDevices("ns", "b", "c", "nvidia.com/gpu", (GPU0, GPU1)),
        ],
        fetched_at_s=0.0,
    )
    assert snap.owner_of(GPU0) == PodRef("ns", "a", "c")
    assert snap.owner_of(GPU1) == PodRef("ns", "b", "c")


def test_stand_in_serves_get_and_allocatable(kubelet: PodResourcesStandIn) -> None:
    from gpunode.node.kubelet._proto import podresources_v1_pb2 as pb
    from gpunode.node.kubelet._proto import podresources_v1_pb2_grpc as pb_grpc

    kubelet.set_pods([Pod("ns", "a", (Container("c", {"nvidia.com/gpu": [GPU0]}),))])
    kubelet.set_allocatable({"nvidia.com/gpu": [GPU0, GPU1]})
    with grpc.insecure_channel(f"unix:{kubelet.socket_path}") as channel:
        stub = pb_grpc.PodResourcesListerStub(channel)
        got = stub.Get(pb.GetPodResourcesRequest(pod_name="a", pod_namespace="ns"), timeout=5)
        assert got.pod_resources.containers[0].devices[0].device_ids == [GPU0]
        alloc = stub.GetAllocatableResources(pb.AllocatableResourcesRequest(), timeout=5)
        assert list(alloc.devices[0].device_ids) == [GPU0, GPU1]
        with pytest.raises(grpc.RpcError) as info:
            stub.Get(pb.GetPodResourcesRequest(pod_name="zz", pod_namespace="ns"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_containers_devices_listed_one_per_entry_are_one_record() -> None:
    # The kubelet (1.21 and later) lists each device ID of a resource as its own entry, and a device with
    # a topology once per NUMA node: the client merges them into one record per (container, resource).
    from gpunode.node.kubelet._proto import podresources_v1_pb2 as pb
    from gpunode.node.kubelet.podresources import flatten_list_response

    numa = pb.TopologyInfo(nodes=[pb.NUMANode(ID=0)])
    answer = pb.ListPodResourcesResponse(
        pod_resources=[
            pb.PodResources(
                name="p",
                namespace="ns",
                containers=[
                    pb.ContainerResources(
                        name="c",
                        devices=[
                            pb.ContainerDevices(
                                resource_name="gpunode.io/gpu-memory", device_ids=[f"{GPU0}::mem1"]
                            ),
                            pb.ContainerDevices(
                                resource_name="nvidia.com/gpu", device_ids=[GPU1], topology=numa
                            ),
                            pb.ContainerDevices(
                                resource_name="gpunode.io/gpu-memory", device_ids=[f"{GPU0}::mem0"]
                            ),
                            pb.ContainerDevices(
                                resource_name="nvidia.com/gpu", device_ids=[GPU1], topology=numa
                            ),
                        ],
                    )
                ],
            )
        ]
    )
    assert flatten_list_response(answer) == (
        ContainerDevices("ns", "p", "c", "gpunode.io/gpu-memory", (f"{GPU0}::mem1", f"{GPU0}::mem0")),
        ContainerDevices("ns", "p", "c", "nvidia.com/gpu", (GPU1,)),
    )
