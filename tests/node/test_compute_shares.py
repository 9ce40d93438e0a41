"""A pod's compute share (gpunode.io/gpu-milli) reaches its container's region, and the node state.

The agent maps pods to regions through the kubelet's pod-resources List and the pods' annotations from
its watch; the shares of one GPU never add up to more than the GPU, and a share the container rewrote in
its usage file is written back within a tick.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.cluster.extender.pods import request_from_pod
from gpunode.contract.names import GIB, GPU_MILLI_ANNOTATION, MILLI_PER_GPU
from gpunode.contract.nodestate import ANNOTATION_KEY, decode
from gpunode.contract.share import parse_compute_share
from gpunode.errors import InvalidComputeShare, InvalidRequest
from gpunode.node.agent import Agent
from gpunode.node.allocation.shares import plan_shares
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import region_key
from gpunode.node.kubelet.podresources import ContainerDevices
from gpunode.node.memcap.checkpoint import CapRecord
from gpunode.node.memcap.compute import ComputeMode, read_compute, set_compute_share
from gpunode.placement import Request
from gpunode.placement.fit import fits_fraction
from gpunode.placement.published import node_state
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.apiserver import ApiServerStandIn
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn
from tests.node.test_publish import kubeconfig

NODE = "gpu-node-3"
MEM = "gpunode.io/gpu-memory"
WAIT_S = 30.0  # generous: a loaded 2-core machine


def record(key: str, gpu: str, limit_gib: int, created: float, total_gib: int = 16) -> CapRecord:
    return CapRecord(key, MEM, (f"{key}-dev",), gpu, limit_gib * GIB, total_gib * GIB, False, created)


# -- the plan (pure) ------------------------------------------------------------------------------


def test_a_pod_that_asks_gets_its_share_the_others_their_memory_share() -> None:
    recs = [record("a", "G0", 4, 1.0), record("b", "G0", 4, 2.0)]
    planned, refused = plan_shares(recs, {"a": "ns/a", "b": "ns/b"}, {"ns/a": 600}, {}, now=3.0)
    assert {p.key: (p.share_milli, p.explicit) for p in planned} == {"a": (600, True), "b": (250, False)}
    assert refused == []


def test_asks_beyond_the_gpu_are_refused_first_allocated_first_served() -> None:
    recs = [record("a", "G0", 4, 1.0), record("b", "G0", 4, 2.0), record("c", "G1", 4, 3.0)]
    owners = {"a": "ns/a", "b": "ns/b", "c": "ns/c"}
    current = {"a": 250, "b": 250, "c": 250}
    planned, refused = plan_shares(recs, owners, {"ns/a": 700, "ns/b": 700, "ns/c": 1000}, current, now=4.0)
    got = {p.key: p.share_milli for p in planned}
    assert got == {"a": 700, "b": 250, "c": 1000}  # b's ask would take G0 to 1400: it keeps 250
    assert [(r.pod, r.asked_milli, r.kept_milli, r.free_milli) for r in refused] == [("ns/b", 700, 250, 300)]
    assert "ns/b" in refused[0].line() and "keeps 250" in refused[0].line()
    # A decrease frees room for an increase on the same pass, whatever the allocation order.
    planned, refused = plan_shares(recs, owners, {"ns/a": 200, "ns/b": 800}, got, now=4.0)
    assert {p.key: p.share_milli for p in planned if p.gpu_uuid == "G0"} == {"a": 200, "b": 800}
    assert refused == []


def test_a_pods_share_is_split_among_its_containers_and_ended_containers_do_not_count() -> None:
    recs = [record("a1", "G0", 2, 1.0), record("a2", "G0", 2, 1.0), record("old", "G0", 8, 0.0)]
    owners = {"a1": "ns/a", "a2": "ns/a"}
    planned, _ = plan_shares(recs, owners, {"ns/a": 900}, {"old": 500}, now=100.0, fresh_s=30.0)
    assert {p.key: p.share_milli for p in planned} == {"a1": 450, "a2": 450}
    # Just allocated, not listed yet: it counts with its default and holds room on its GPU.
    planned, refused = plan_shares(recs, owners, {"ns/a": 900}, {"old": 500}, now=10.0, fresh_s=30.0)
    assert {p.key: p.share_milli for p in planned}["old"] == 500
    assert sum(p.share_milli for p in planned) <= MILLI_PER_GPU and refused


# -- one parser, the extender's and the node's -----------------------------------------------------


@pytest.mark.parametrize("text", ["300", " 300 ", "3e2", "300.0", "999", "1"])
def test_the_extender_and_the_node_read_a_share_alike(text: str) -> None:
    pod = {"metadata": {"name": "p", "annotations": {GPU_MILLI_ANNOTATION: text}}, "spec": {"containers": []}}
    request = request_from_pod(pod)
    assert request is not None and request.gpu_milli == parse_compute_share(text)


@pytest.mark.parametrize("text", ["0", "-5", "0.5", "abc", "nan", "inf", "1001", "1e9", "", "9" * 40])
def test_the_extender_and_the_node_refuse_a_share_alike(text: str) -> None:
    pod = {"metadata": {"name": "p", "annotations": {GPU_MILLI_ANNOTATION: text}}, "spec": {"containers": []}}
    with pytest.raises(InvalidRequest) as ext:
        request_from_pod(pod)
    with pytest.raises(InvalidComputeShare) as node:
        parse_compute_share(text)
    assert "\n" not in str(ext.value) and "\n" not in str(node.value)
    assert str(node.value) in str(ext.value)


# -- end to end through the agent -----------------------------------------------------------------


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.add_node(NODE)
        yield server


def put_pod(api: ApiServerStandIn, name: str, milli: str | None) -> None:
    annotations = {GPU_MILLI_ANNOTATION: milli} if milli is not None else {}
    api.put_pod(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "team", "annotations": annotations},
            "spec": {"nodeName": NODE, "containers": [{"name": "main"}]},
            "status": {"phase": "Running"},
        }
    )


def wait(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def extender_filter(api: ApiServerStandIn, milli: int, *, units: int) -> dict[str, Any]:
    """The scheduler extender's filter of a pod asking `milli` and `units` GiB against the published node."""
    from gpunode.cluster.extender.core import Extender, ExtenderConfig

    node = api.node(NODE)
    pod = {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": "new",
            "namespace": "team",
            "uid": "u-new",
            "annotations": {GPU_MILLI_ANNOTATION: str(milli)},
        },
        "spec": {"containers": [{"name": "main", "resources": {"limits": {MEM: str(units)}}}]},
    }
    extender = Extender(config=ExtenderConfig(policy="gpunode", provisional_reservations=False))
    result = extender.filter({"Pod": pod, "Nodes": {"kind": "NodeList", "apiVersion": "v1", "items": [node]}})
    return {n["metadata"]["name"]: n for n in (result.get("Nodes") or {}).get("items") or []}


def published(api: ApiServerStandIn) -> Any:
    text = api.node(NODE)["metadata"].get("annotations", {}).get(ANNOTATION_KEY)
    return None if text is None else decode(text, node=NODE)


def test_a_pods_share_reaches_its_region_and_the_node_state(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    doc = {
        "gpunode": {
            "nodeName": NODE,
            "fractional": {"devices": [0], "unit": "1Gi"},
            "podResourcesSocket": str(sockdir / "pr.sock"),
            "nodeState": {"interval": "1h"},
            "remediation": {"mode": "off", "kubeconfig": str(kubeconfig(sockdir / "kubeconfig", api.url))},
        }
    }
    put_pod(api, "a", "600")
    put_pod(api, "b", None)
    backend = SimBackend.from_profile("t4")
    gpu = backend.gpus()[0]
    total = gpu.memory_total_bytes
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
        with RunningAgent(Agent(cfg, backend=backend)):
            kubelet.wait_for_resources([MEM])
            units = sorted(
                (i for i in kubelet.healthy(MEM) if i.startswith(gpu.uuid)),
                key=lambda i: int(i.rsplit("mem", 1)[1]),
            )
            ids_a, ids_b = units[:4], units[4:8]
            kubelet.allocate(MEM, ids_a)
            kubelet.allocate(MEM, ids_b)
            root = sockdir / "state" / "memcap"
            region_a, region_b = root / region_key(ids_a), root / region_key(ids_b)
            default = 4 * GIB * MILLI_PER_GPU // total
            assert read_compute(region_a).share_milli == default  # Allocate cannot know the pod yet
            pr.set_pods(
                [
                    ContainerDevices("team", "a", "main", MEM, tuple(ids_a)),
                    ContainerDevices("team", "b", "main", MEM, tuple(ids_b)),
                ]
            )

            def share(region: Path) -> tuple[int, int]:
                report = read_compute(region)
                return report.share_milli, report.mode

            wc = ComputeMode.WORK_CONSERVING
            wait(lambda: share(region_a) == (600, wc), "pod a's share of 600 in its region")
            assert share(region_b) == (default, wc), "a pod that asks nothing keeps its memory share"

            def milli_assigned() -> int | None:
                state = published(api)
                return None if state is None else state.gpus[0].milli_assigned

            wait(lambda: milli_assigned() == 600 + default, "the node state with both shares")
            view = node_state(published(api), cpu_milli_free=0, memory_free_bytes=0)
            assert view.gpus[0].milli_free == MILLI_PER_GPU - 600 - default
            assert view.gpus[0].memory_free_bytes == total - 8 * GIB  # memory is the other dimension
            # The extender refuses a share that would take the GPU over: both dimensions count.
            assert not fits_fraction(view.gpus[0], Request(gpu_milli=MILLI_PER_GPU - 600 - default + 1))
            assert fits_fraction(view.gpus[0], Request(gpu_milli=MILLI_PER_GPU - 600 - default))
            free = MILLI_PER_GPU - 600 - default
            assert extender_filter(api, free + 1, units=1) == {}, "only GPU 0 is fractional: no room for more"
            assert list(extender_filter(api, free, units=1)) == [NODE]
            assert extender_filter(api, 1, units=16) == {}, "compute free, memory not: refused too"

            put_pod(api, "a", "700")  # a change applies within a tick
            wait(lambda: share(region_a) == (700, wc), "pod a's new share of 700")

            caplog.clear()
            put_pod(api, "a", "800")  # 800 + b's share is more than the GPU: refused, a keeps 700
            wait(lambda: "asks gpunode.io/gpu-milli=800" in caplog.text, "the refusal's warning")
            assert share(region_a) == (700, wc)
            assert sum(1 for r in caplog.records if "gpu-milli=800" in r.getMessage()) == 1

            # The container rewrites its own share (its usage file is writable): written back within a tick.
            set_compute_share(region_a, 1000, ComputeMode.OFF)
            assert share(region_a) == (1000, ComputeMode.OFF)
            wait(lambda: share(region_a) == (700, wc), "pod a's share written back")

            put_pod(api, "a", "0.5")  # not a share: one line, and the pod is back on its memory share
            wait(lambda: share(region_a) == (default, wc), "pod a back on its memory share")
            assert "finer than the unit" in caplog.text
            wait(
                lambda: milli_assigned() == 8 * GIB * MILLI_PER_GPU // total, "the node state without a's ask"
            )


def test_the_book_keeps_the_asks_of_running_pods_only(tmp_path: Path) -> None:
    from lightkube.resources.core_v1 import Pod

    from gpunode.infra.kube import ADDED, DELETED, MODIFIED, SYNC, WatchEvent
    from gpunode.node.assignments import AssignmentBook

    def pod(name: str, milli: str | None, phase: str = "Running") -> Pod:
        ann = {GPU_MILLI_ANNOTATION: milli} if milli is not None else {}
        return Pod.from_dict(
            {
                "metadata": {"name": name, "namespace": "ns", "uid": name, "annotations": ann},
                "spec": {"nodeName": NODE, "containers": [{"name": "c"}]},
                "status": {"phase": phase},
            }
        )

    book = AssignmentBook(
        node_name=NODE,
        state_dir=tmp_path,
        client_factory=lambda: None,
        served=lambda: (),  # type: ignore[arg-type,return-value]
    )
    pokes: list[int] = []
    book.on_compute_ask = lambda: pokes.append(1)
    book.apply(WatchEvent(SYNC, items=(pod("a", "300"), pod("b", None), pod("done", "500", "Succeeded"))))
    assert book.compute_asks == {"ns/a": "300"} and len(pokes) == 1
    book.apply(WatchEvent(MODIFIED, pod("a", "400")))
    book.apply(WatchEvent(ADDED, pod("b", "100")))
    assert book.compute_asks == {"ns/a": "400", "ns/b": "100"} and len(pokes) == 3
    book.apply(WatchEvent(MODIFIED, pod("b", "100")))
    assert len(pokes) == 3, "no change, no poke"
    book.apply(WatchEvent(DELETED, pod("a", "400")))
    book.apply(WatchEvent(MODIFIED, pod("b", None)))
    assert book.compute_asks == {}


def test_a_container_that_garbles_its_share_does_not_make_room_for_its_neighbour(tmp_path: Path) -> None:
    """The shares of a GPU are planned on what the agent gave each region, not on what a region says now."""
    import asyncio
    import mmap
    import struct

    from gpunode.node import memcap
    from gpunode.node.allocation.shares import ComputeShares
    from gpunode.node.memcap.checkpoint import Checkpoint

    checkpoint = Checkpoint(tmp_path)
    total = 16 * GIB
    containers, keys = [], {}
    for n, pod in enumerate(("a", "b")):
        ids = (f"GPU-0::mem{n}",)
        keys[pod] = region_key(ids)
        memcap.create_region(
            tmp_path / "memcap", keys[pod], gpu_uuid="GPU-0", limit_bytes=4 * GIB, device_total_bytes=total
        )
        checkpoint.replace(CapRecord(keys[pod], MEM, ids, "GPU-0", 4 * GIB, total, False, 1.0 + n))
        containers.append(ContainerDevices("ns", pod, "c", MEM, ids))
    asks = {"ns/a": "600"}

    async def listed() -> list[ContainerDevices]:
        return containers

    shares = ComputeShares(
        checkpoint=checkpoint, regions_root=tmp_path / "memcap", list_containers=listed, asks=lambda: asks
    )
    asyncio.run(shares.tick())
    assert read_compute(tmp_path / "memcap" / keys["a"]).share_milli == 600
    with (tmp_path / "memcap" / keys["a"] / "usage").open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        struct.pack_into("<Q", m, 64 + 64 + 128 * 256, 0xDEADBEEF)  # the control word, garbled
    asks["ns/b"] = "500"  # 600 + 500 is more than the GPU: refused, whatever a's region says now
    asyncio.run(shares.tick())
    assert read_compute(tmp_path / "memcap" / keys["b"]).share_milli == 250
    assert read_compute(tmp_path / "memcap" / keys["a"]).share_milli == 600  # and a's is written back
