"""Extender state: pods' GPU requests, quantities, in-flight reservations, the workload's model pressure."""

from __future__ import annotations

import pytest

from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.pods import parse_quantity, request_from_pod
from gpunode.cluster.extender.reservations import Reservations
from gpunode.errors import InvalidRequest
from gpunode.placement import Request
from tests.cluster.test_extender import GIB, PodBook, gpu_state, node_list, v1_node, v1_pod

# ----- pod requests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("500m", "0.5"),
        ("2", "2"),
        ("1.5Gi", str(1.5 * GIB)),
        ("1e3", "1000"),
        ("16Mi", str(16 * 2**20)),
        ("1k", "1000"),
        (3, "3"),
    ],
)
def test_parse_quantity(value: object, expected: str) -> None:
    assert float(parse_quantity(value, where="x")) == float(expected)


@pytest.mark.parametrize("value", ["", "1.2.3", "5 apples", "-1", "1e3Gi", True, None])
def test_parse_quantity_rejects(value: object) -> None:
    with pytest.raises(InvalidRequest):
        parse_quantity(value, where="x")


@pytest.mark.parametrize(
    ("limits", "annotations", "expected"),
    [
        pytest.param(
            {"nvidia.com/gpu": "2"}, {}, Request(gpus=2, cpu_milli=8000, memory_bytes=32 * GIB), id="whole"
        ),
        pytest.param(
            {"gpunode.io/gpu-memory": "10"},
            {"gpunode.io/gpu-milli": "300"},
            Request(gpu_milli=300, gpu_memory_bytes=10 * GIB, cpu_milli=8000, memory_bytes=32 * GIB),
            id="fraction",
        ),
        pytest.param(
            {"nvidia.com/mig-1g.10gb": "1"},
            {},
            Request(mig_profile="1g.10gb", cpu_milli=8000, memory_bytes=32 * GIB),
            id="mig",
        ),
        pytest.param(
            {"nvidia.com/gpu": "1"},
            {"gpunode.io/gpu-model": "A100|H100"},
            Request(gpus=1, gpu_models=frozenset({"A100", "H100"}), cpu_milli=8000, memory_bytes=32 * GIB),
            id="model-annotation",
        ),
        pytest.param({"cpu": "2"}, {}, None, id="no-gpu"),
    ],
)
def test_request_from_pod(
    limits: dict[str, str], annotations: dict[str, str], expected: Request | None
) -> None:
    assert request_from_pod(v1_pod(limits=limits, annotations=annotations)) == expected


def test_request_sums_containers_and_takes_the_larger_init_container() -> None:
    pod = v1_pod(limits={"nvidia.com/gpu": "1"})
    pod["spec"]["containers"].append(
        {"name": "side", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}
    )
    pod["spec"]["initContainers"] = [
        {"name": "init", "resources": {"requests": {"cpu": "20", "memory": "1Gi"}}}
    ]
    pod["spec"]["nodeSelector"] = {"gpunode.io/gpu-model": "A100"}
    r = request_from_pod(pod)
    assert r == Request(gpus=1, cpu_milli=20_000, memory_bytes=33 * GIB, gpu_models=frozenset({"A100"}))


@pytest.mark.parametrize(
    ("limits", "annotations"),
    [
        pytest.param({"nvidia.com/gpu": "1", "gpunode.io/gpu-memory": "4"}, {}, id="two-kinds"),
        pytest.param({"nvidia.com/mig-1g.10gb": "2"}, {}, id="two-mig-instances"),
        pytest.param({"nvidia.com/gpu": "1"}, {"gpunode.io/gpu-milli": "1500"}, id="milli-out-of-range"),
        pytest.param({"nvidia.com/gpu": "lots"}, {}, id="bad-quantity"),
    ],
)
def test_impossible_requests(limits: dict[str, str], annotations: dict[str, str]) -> None:
    with pytest.raises(InvalidRequest):
        request_from_pod(v1_pod(limits=limits, annotations=annotations))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_two_pods_between_two_annotation_updates_never_share_a_gpu() -> None:
    clock = Clock()
    book = PodBook()
    extender = Extender(
        config=ExtenderConfig(policy="bestfit", provisional_reservations=True),
        reservations=Reservations(ttl_s=30, clock=clock),
        pod_reader=book.read,
    )
    nodes = [v1_node("n1", gpu_state("n1", [600])), v1_node("n2", gpu_state("n2", [600]))]
    pods = [
        v1_pod(
            f"p{i}",
            uid=f"uid-{i}",
            limits={"gpunode.io/gpu-memory": "1"},
            annotations={"gpunode.io/gpu-milli": "500"},
        )
        for i in range(3)
    ]
    book.add(*pods)
    chosen = []
    for pod in pods[:2]:
        extender.filter({"Pod": pod, "Nodes": node_list(*nodes)})
        priorities = extender.prioritize({"Pod": pod, "Nodes": node_list(*nodes)})
        best = max(priorities, key=lambda p: p["Score"])["Host"]
        chosen.append(best)
    assert sorted(chosen) == ["n1", "n2"]  # the second pod saw the first one's reservation
    third = extender.filter({"Pod": pods[2], "Nodes": node_list(*nodes)})
    assert third["Nodes"]["items"] == []
    # The agents publish: n1 lists p0 (its reservation ends), n2 does not yet (kept until the TTL).
    nodes = [
        v1_node("n1", gpu_state("n1", [100], generation=2, pods={0: [f"team-a/p{chosen.index('n1')}"]})),
        v1_node("n2", gpu_state("n2", [600], generation=1)),
    ]
    assert extender.filter({"Pod": pods[2], "Nodes": node_list(*nodes)})["Nodes"]["items"] == []
    assert len(extender.reservations) == 1
    clock.now += 31  # the reservation on n2 expires: the annotation is believed again
    assert [
        n["metadata"]["name"]
        for n in extender.filter({"Pod": pods[2], "Nodes": node_list(*nodes)})["Nodes"]["items"]
    ] == ["n2"]


def test_the_workload_gets_model_pressure_from_the_nodes_known() -> None:
    from gpunode.cluster.extender.workload import WorkloadTracker
    from gpunode.placement import TargetPod, TargetWorkload

    workload = TargetWorkload(
        (
            TargetPod(cpu_milli=1000, gpu_milli=1000, gpus=1, gpu_models=frozenset({"T4"}), weight=3),
            TargetPod(cpu_milli=1000, gpu_milli=500, gpus=1, gpu_models=None, weight=3),
        )
    )
    extender = Extender(workload=WorkloadTracker(seed=workload))
    extender.refresh_nodes(
        [
            v1_node("a", gpu_state("a", [1000, 1000], model="Tesla T4")),
            v1_node("b", gpu_state("b", [1000] * 4, model="NVIDIA A100-SXM4-80GB")),
        ]
    )
    ctx = extender._context("uid")
    assert ctx.workload is not None
    assert set(ctx.workload.model_pressure) == {"Tesla T4"} and ctx.workload.model_pressure["Tesla T4"] > 0
    extender.refresh_nodes([v1_node("c", gpu_state("c", [1000, 1000], model="Tesla T4"))])
    assert extender._context("uid").version != ctx.version  # more T4 supply: new pressure, new cache key


def test_the_workload_gets_node_pressure_from_the_pods_and_nodes_seen() -> None:
    """Learned shapes (all of them, not only the typical ones) press the kinds of node that fit them."""
    from gpunode.cluster.extender.workload import WorkloadTracker

    big = v1_node("big", gpu_state("big", [1000] * 8))
    big["status"]["allocatable"]["cpu"] = "128"
    small = v1_node("small", gpu_state("small", [1000] * 8))  # 95.5 cores allocatable
    tracker = WorkloadTracker(popularity=0.5)
    extender = Extender(workload=tracker)
    extender.refresh_nodes([big, small])
    one = v1_pod("one", uid="one", limits={"nvidia.com/gpu": "1", "cpu": "8"})
    large = v1_pod("large", uid="large", limits={"nvidia.com/gpu": "8", "cpu": "120"})
    for _ in range(9):
        tracker.observe(request_from_pod(one))  # type: ignore[arg-type]
    tracker.observe(request_from_pod(large))  # type: ignore[arg-type]
    ctx = extender._context("uid")
    assert ctx.workload is not None
    assert [p.gpus for p in ctx.workload.pods] == [1]  # the 8-GPU shape is not typical...
    pressure = ctx.workload.node_pressure
    assert pressure["big"] > pressure["small"] > 0  # ...but its demand still presses the only node it fits
    assert sum(pressure.values()) * 8 == pytest.approx(16)  # the demand fills the 16 GPUs at full load
    # the 1-GPU pod is steered to the node the 120-core pods do not need
    filtered = extender.prioritize({"Pod": one, "Nodes": node_list(big, small)})
    scores = {s["Host"]: s["Score"] for s in filtered}
    assert scores["small"] > scores["big"]
    # a node gone from the cache takes its pressure with it, under a new cache key
    extender.nodes.forget(["big"])
    after = extender._context("uid")
    assert after.version != ctx.version and after.workload is not None
    assert set(after.workload.node_pressure) == {"small"}
