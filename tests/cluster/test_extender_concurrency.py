"""Binds racing for the same GPUs: the extender decides and reserves in one step, so none is over-committed.

Each round offers one node of 8 GPUs to more pods than fit and binds them all at once, from many
threads (through Extender.bind, and through the HTTP server with 16 concurrent clients), with the
interpreter switching threads every 0.1 ms so that any gap between deciding and reserving is hit.
Every round must bind exactly the pods that fit and never hand out more of a GPU than it has.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.pods import request_from_pod
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.errors import InvalidState, KubeError
from gpunode.placement import apply_request
from tests.cluster.test_extender import Client, gpu_state, node_list, v1_node, v1_pod

ROUNDS = 200
GPUS = 8
CLIENTS = 16


@pytest.fixture(autouse=True)
def fast_switching() -> Iterator[None]:
    """Switch threads every 0.1 ms (the default is 5 ms): a gap between decide and reserve shows up."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(before)


class RecordingBinder:
    """The Binder protocol in memory: pods to read, and every Binding made (pod, node, GPUs)."""

    def __init__(self, pods: list[dict[str, Any]], *, fail: frozenset[str] = frozenset()) -> None:
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        self.fail = fail
        self.lock = threading.Lock()
        self.bound: list[tuple[str, str, tuple[str, ...]]] = []

    def read_pod(self, *, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.pods.get((namespace, name))

    def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
        if name in self.fail:
            raise KubeError(f"bind pod {namespace}/{name}: HTTP 500 (injected)")
        with self.lock:
            self.bound.append((name, node, gpu_uuids))


@dataclass(frozen=True)
class Shape:
    pods: int
    limits: dict[str, str]
    annotations: dict[str, str]
    fitting: int


SMALL = {"cpu": "1", "memory": "4Gi"}  # 48 of these fit the node's CPU and memory: GPUs are what runs out
SHAPES = {
    "whole": Shape(24, {"nvidia.com/gpu": "1", **SMALL}, {}, 8),
    "half": Shape(24, {"gpunode.io/gpu-memory": "8", **SMALL}, {"gpunode.io/gpu-milli": "500"}, 16),
    "two-gpus": Shape(12, {"nvidia.com/gpu": "2", **SMALL}, {}, 4),
    "fifth": Shape(48, {"gpunode.io/gpu-memory": "4", **SMALL}, {"gpunode.io/gpu-milli": "200"}, 40),
}


def make_round(shape: Shape, rnd: int) -> tuple[Extender, RecordingBinder, list[dict[str, Any]]]:
    pods = [
        v1_pod(f"p{rnd}-{i}", uid=f"uid-{rnd}-{i}", limits=shape.limits, annotations=shape.annotations)
        for i in range(shape.pods)
    ]
    binder = RecordingBinder(pods)
    # Provisional reservations off: every pod passes filter, so all of them race at bind.
    extender = Extender(config=ExtenderConfig(provisional_reservations=False), binder=binder)
    nodes = node_list(v1_node("n1", gpu_state("n1", [1000] * GPUS)))
    for pod in pods:
        assert extender.filter({"Pod": pod, "Nodes": nodes})["Nodes"]["items"]
    return extender, binder, pods


def bind_body(pod: dict[str, Any]) -> dict[str, str]:
    meta = pod["metadata"]
    return {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": "n1"}


def over_committed(extender: Extender, binder: RecordingBinder, pods: list[dict[str, Any]]) -> bool:
    """Whether the Bindings made, or the reservations held, hand out more of a GPU than the node has."""
    requests = {p["metadata"]["name"]: request_from_pod(p) for p in pods}
    view = extender.nodes.get("n1")
    assert view.state is not None
    state = view.state
    try:
        for name, _, gpus in binder.bound:
            request = requests[name]
            assert request is not None
            state = apply_request(state, request, gpus)
    except InvalidState:
        return True
    state = view.state
    try:
        for r in extender.reservations.on_node("n1"):
            state = apply_request(state, r.request, r.gpu_uuids)
    except InvalidState:
        return True
    return False


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_concurrent_binds_never_over_commit_a_node(shape: str) -> None:
    spec = SHAPES[shape]
    over = wrong_count = 0
    with ThreadPoolExecutor(max_workers=spec.pods) as pool:
        for rnd in range(ROUNDS):
            extender, binder, pods = make_round(spec, rnd)
            start = threading.Barrier(spec.pods)

            def one(
                pod: dict[str, Any], extender: Extender = extender, start: threading.Barrier = start
            ) -> str:
                start.wait(30)
                return extender.bind(bind_body(pod))["Error"]

            errors = list(pool.map(one, pods))
            over += over_committed(extender, binder, pods)
            wrong_count += len(binder.bound) != spec.fitting
            assert sum(1 for e in errors if not e) == len(binder.bound)
            assert all("no longer fits" in e for e in errors if e), [e for e in errors if e][:3]
    assert (over, wrong_count) == (0, 0), (
        f"{over} of {ROUNDS} rounds over-committed n1, {wrong_count} bound other than {spec.fitting} pods"
    )


def test_concurrent_binds_over_http_from_16_clients_never_over_commit() -> None:
    spec = SHAPES["whole"]
    over = wrong_count = 0
    server = ExtenderServer(Extender(), port=0)
    server.start()
    client = Client(server.port)
    try:
        with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
            for rnd in range(ROUNDS):
                extender, binder, pods = make_round(spec, rnd)
                server.extender = extender  # read per request: this round's node, filter answers, binder
                start = threading.Barrier(CLIENTS)

                def client_binds(
                    mine: list[dict[str, Any]], start: threading.Barrier = start
                ) -> list[tuple[int, Any]]:
                    start.wait(30)
                    return [client.post("bind", bind_body(pod)) for pod in mine]

                shares = [pods[i::CLIENTS] for i in range(CLIENTS)]
                answers = [a for answered in pool.map(client_binds, shares) for a in answered]
                assert all(status == 200 for status, _ in answers), answers[:3]
                over += over_committed(extender, binder, pods)
                wrong_count += len(binder.bound) != spec.fitting
    finally:
        server.stop()
    assert (over, wrong_count) == (0, 0), (
        f"{over} of {ROUNDS} rounds over-committed n1, {wrong_count} bound other than {spec.fitting} pods"
    )


def test_a_failed_binding_gives_its_gpus_back_to_the_pods_racing_for_them() -> None:
    spec = SHAPES["whole"]
    pods = [v1_pod(f"p{i}", uid=f"uid-{i}", limits=spec.limits) for i in range(spec.pods)]
    binder = RecordingBinder(pods, fail=frozenset(f"p{i}" for i in range(0, spec.pods, 3)))
    extender = Extender(config=ExtenderConfig(provisional_reservations=False), binder=binder)
    nodes = node_list(v1_node("n1", gpu_state("n1", [1000] * GPUS)))
    for pod in pods:
        extender.filter({"Pod": pod, "Nodes": nodes})
    start = threading.Barrier(len(pods))

    def one(pod: dict[str, Any]) -> str:
        start.wait(30)
        return extender.bind(bind_body(pod))["Error"]

    with ThreadPoolExecutor(max_workers=len(pods)) as pool:
        errors = list(pool.map(one, pods))
    assert not over_committed(extender, binder, pods)
    # Every GPU a failed Binding held went back: the 16 pods that can bind fill the 8 GPUs.
    assert len(binder.bound) == GPUS and sum(1 for e in errors if not e) == GPUS
    assert {r.pod_uid for r in extender.reservations.on_node("n1")} == {
        f"uid-{name[1:]}" for name, _, _ in binder.bound
    }
