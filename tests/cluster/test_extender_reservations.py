"""How long the extender holds GPUs for a pod, and which node annotations it still believes.

- filter with one node passing reserves it provisionally (kube-scheduler then skips prioritize);
- a bound pod's reservation lasts until its node's annotation lists the pod, or the pod is gone,
  not a short TTL (only a long safety bound, which logs when it fires);
- a node whose annotation was published too long ago is failed as stale, with the age and the bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from gpunode.cluster.extender.cli import build_extender
from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.kubeapi import KubeApi, check_reservations
from gpunode.cluster.extender.nodes import NodeCache
from gpunode.cluster.extender.reservations import (
    DEFAULT_PROVISIONAL_PER_NAMESPACE,
    PendingPods,
    Reservations,
    apply_reservations,
)
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.contract.nodestate import GpuRecord, NodeGpuState, encode
from gpunode.errors import ConfigError, KubeError
from tests.cluster.test_extender import Client, PodBook, gpu_state, node_list, parser, v1_node, v1_pod
from tests.fakes.apiserver import ApiServerStandIn

GIB = 2**30
NOW = 1_800_000_000.0  # unix seconds of the wall clock the stale-node tests run at


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def gpu_pod(name: str, uid: str, gpus: str = "1") -> dict[str, Any]:
    return v1_pod(name, uid=uid, limits={"nvidia.com/gpu": gpus, "cpu": "1", "memory": "1Gi"})


def filter_names(extender: Extender, pod: dict[str, Any], *nodes: dict[str, Any]) -> tuple[list[str], Any]:
    result = extender.filter({"Pod": pod, "Nodes": node_list(*nodes)})
    return [n["metadata"]["name"] for n in result["Nodes"]["items"]], result["FailedNodes"]


def bind_body(pod: dict[str, Any], node: str) -> dict[str, str]:
    meta = pod["metadata"]
    return {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}


# ----- filter with one node passing ------------------------------------------------------------------------


def test_filter_with_one_node_passing_reserves_it_so_that_the_bind_still_fits() -> None:
    clock = Clock()
    a, b = gpu_pod("a", "uid-a"), gpu_pod("b", "uid-b")
    extender = Extender(reservations=Reservations(ttl_s=30, clock=clock), pod_reader=PodBook(a, b).read)
    nodes = (v1_node("n1", gpu_state("n1", [1000, 0])), v1_node("full", gpu_state("full", [0, 0])))
    assert filter_names(extender, a, *nodes)[0] == ["n1"]  # one node: kube-scheduler will not prioritize
    held = extender.reservations.get("uid-a")
    assert held is not None and (held.node, held.gpu_uuids, held.final) == ("n1", ("GPU-n1-0",), False)
    # b, filtered before a binds, no longer gets a's GPU: a's bind will not find it taken.
    passed, failed = filter_names(extender, b, *nodes)
    assert passed == [] and "insufficient whole GPUs" in failed["n1"]
    # The provisional reservation ends by its TTL, as prioritize's does.
    clock.now += 31
    assert filter_names(extender, b, *nodes)[0] == ["n1"]


def test_filter_with_several_nodes_passing_leaves_reserving_to_prioritize() -> None:
    extender = Extender()
    nodes = (v1_node("n1", gpu_state("n1", [1000])), v1_node("n2", gpu_state("n2", [1000])))
    assert filter_names(extender, gpu_pod("a", "uid-a"), *nodes)[0] == ["n1", "n2"]
    assert extender.reservations.get("uid-a") is None


def test_no_provisional_means_no_reservation_at_filter_either() -> None:
    extender = Extender(config=ExtenderConfig(provisional_reservations=False))
    nodes = (v1_node("n1", gpu_state("n1", [1000, 0])), v1_node("full", gpu_state("full", [0, 0])))
    assert filter_names(extender, gpu_pod("a", "uid-a"), *nodes)[0] == ["n1"]
    assert len(extender.reservations) == 0
    assert filter_names(extender, gpu_pod("b", "uid-b"), *nodes)[0] == ["n1"]


# ----- provisional reservations: only for pods that exist and wait, bounded per namespace -----------------------

EIGHT = [1000] * 8


def eight_gpu_nodes() -> list[dict[str, Any]]:
    return [v1_node("n1", gpu_state("n1", EIGHT)), v1_node("n2", gpu_state("n2", EIGHT))]


def free_gpus_seen(extender: Extender, pod: dict[str, Any]) -> int:
    """Whole GPUs free for `pod` on the extender's nodes, its reservations counted (the pod's own not)."""
    uid = pod["metadata"]["uid"]
    views = extender.nodes.get_many(["n1", "n2"])
    states = [apply_reservations(v, extender.reservations, skip_pod=uid) for v in views]
    return sum(1 for state in states if state is not None for g in state.gpus if g.milli_free == 1000)


def attack(extender: Extender, pods: list[dict[str, Any]], port: int) -> None:
    """filter then prioritize for each pod, over HTTP, as anyone who reaches the extender's port can."""
    client = Client(port)
    for pod in pods:
        body = {"Pod": pod, "NodeNames": ["n1", "n2"]}
        assert client.post("filter", body)[0] == 200
        assert client.post("prioritize", body)[0] == 200


@pytest.fixture
def served_book() -> Iterator[tuple[Extender, PodBook, int]]:
    book = PodBook()
    extender = Extender(config=ExtenderConfig(policy="bestfit"), pod_reader=book.read)
    extender.refresh_nodes(eight_gpu_nodes())
    server = ExtenderServer(extender, port=0)
    server.start()
    try:
        yield extender, book, server.port
    finally:
        server.stop()


def test_made_up_pods_reserve_nothing_and_a_real_pod_sees_every_free_gpu(
    served_book: tuple[Extender, PodBook, int],
) -> None:
    extender, book, port = served_book
    real = gpu_pod("real", "uid-real", gpus="8")
    book.add(real)
    ghosts = [gpu_pod(f"ghost-{i}", f"uid-ghost-{i}") for i in range(64)]  # no such pods
    attack(extender, ghosts, port)
    assert len(extender.reservations) == 0
    assert free_gpus_seen(extender, real) == 16
    passed = Client(port).post("filter", {"Pod": real, "NodeNames": ["n1", "n2"]})[1]["NodeNames"]
    assert passed == ["n1", "n2"]  # the 8-GPU pod fits either node
    assert book.reads <= 64 + 1  # one read per pod: prioritize took filter's


def test_a_body_that_does_not_match_the_real_pod_reserves_nothing(
    served_book: tuple[Extender, PodBook, int],
) -> None:
    extender, book, port = served_book
    real = gpu_pod("real", "uid-real", gpus="1")
    bound_pod = gpu_pod("running", "uid-running")
    bound_pod["spec"]["nodeName"], bound_pod["status"]["phase"] = "n1", "Running"
    finished = gpu_pod("done", "uid-done")
    finished["status"]["phase"] = "Succeeded"
    book.add(real, bound_pod, finished)
    attack(
        extender,
        [
            gpu_pod("real", "uid-other", gpus="1"),  # the real pod's name, another UID
            gpu_pod("real", "uid-real", gpus="8"),  # its UID, a larger request
            gpu_pod("running", "uid-running"),  # bound already
            gpu_pod("done", "uid-done"),  # finished
        ],
        port,
    )
    assert len(extender.reservations) == 0 and free_gpus_seen(extender, real) == 16
    attack(extender, [real], port)  # the pod as it is: reserved until its bind
    held = extender.reservations.get("uid-real")
    assert held is not None and not held.final and len(held.gpu_uuids) == 1


def test_a_namespaces_real_waiting_pods_hold_at_most_its_bound(
    served_book: tuple[Extender, PodBook, int],
) -> None:
    extender, book, port = served_book
    tenants = [gpu_pod(f"wait-{i}", f"uid-wait-{i}") for i in range(64)]  # team-a: real, pending pods
    other = gpu_pod("other", "uid-other", gpus="8")
    other["metadata"]["namespace"] = "team-b"
    book.add(*tenants, other)
    attack(extender, tenants, port)
    assert extender.reservations.provisional_in("team-a") == DEFAULT_PROVISIONAL_PER_NAMESPACE == 8
    assert len(extender.reservations) == 8
    assert free_gpus_seen(extender, other) == 16 - 8
    assert [f"uid-wait-{i}" for i in range(56, 64)] == sorted(
        (r.pod_uid for n in ("n1", "n2") for r in extender.reservations.on_node(n)),
        key=lambda u: int(u.rsplit("-", 1)[1]),
    )  # the newest 8: an older one ended when its namespace went over


def test_reads_are_remembered_and_an_unreachable_api_costs_one_read() -> None:
    clock = Clock()
    calls: list[str] = []
    down = False

    def read(namespace: str, name: str) -> dict[str, Any] | None:
        calls.append(name)
        if down:
            raise KubeError("read pod: no answer within 2 s")
        return None

    pending = PendingPods(read, cache_s=5, clock=clock)
    for _ in range(10):
        assert pending.get("team-a/x") is None
    assert calls == ["x"]
    clock.now += 6
    down = True
    for name in ("y", "z", "x"):
        why = pending.get(f"team-a/{name}")
        assert isinstance(why, str) and "cannot read pods through the API" in why
    assert calls == ["x", "y"]  # after a failed read no pod is read until cache_s has passed
    clock.now += 6
    down = False
    assert pending.get("team-a/z") is None and calls == ["x", "y", "z"]


def test_the_provisional_bound_flag() -> None:
    def built(*flags: str) -> Extender:
        return build_extender(parser().parse_args(["extender", *flags]))[0]

    assert built().reservations.max_provisional_per_namespace == 8
    assert built().pending is None  # no API access: nothing is reserved before bind
    api = built("--kube-api", "http://127.0.0.1:1", "--provisional-per-namespace", "3")
    assert api.reservations.max_provisional_per_namespace == 3 and api.pending is not None
    with pytest.raises(ConfigError, match="per namespace must be 1 or more"):
        built("--provisional-per-namespace", "0")


# ----- bound pods: held until the annotation lists them, or they are gone --------------------------------------


@dataclass
class Bound:
    api: ApiServerStandIn
    kube: KubeApi
    extender: Extender
    server: ExtenderServer
    clock: Clock

    def bind(self, pod: dict[str, Any], *nodes: dict[str, Any]) -> None:
        self.api.put_pod(pod)
        assert filter_names(self.extender, pod, *nodes)[0] == [nodes[0]["metadata"]["name"]]
        assert self.extender.bind(bind_body(pod, nodes[0]["metadata"]["name"])) == {"Error": ""}

    def check(self) -> int:
        coro = check_reservations(api=self.kube, extender=self.extender)
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result(30)


@pytest.fixture
def bound() -> Iterator[Bound]:
    clock = Clock()
    with ApiServerStandIn() as api:
        kube = KubeApi(api.url)
        extender = Extender(binder=kube, reservations=Reservations(ttl_s=60, bound_ttl_s=900, clock=clock))
        server = ExtenderServer(extender, port=0)
        server.start()
        kube.attach(server.loop)
        try:
            yield Bound(api, kube, extender, server, clock)
        finally:
            server.stop()


def test_a_bound_pods_gpu_is_held_past_the_ttl_until_the_annotation_lists_it(bound: Bound) -> None:
    n1 = v1_node("n1", gpu_state("n1", [1000]))
    a, b = gpu_pod("a", "uid-a"), gpu_pod("b", "uid-b")
    bound.bind(a, n1)
    bound.clock.now += 61  # past the provisional TTL (the only bound there used to be)
    passed, failed = filter_names(bound.extender, b, n1)
    assert passed == [] and "insufficient whole GPUs" in failed["n1"]
    held = bound.extender.reservations.get("uid-a")
    assert held is not None and held.final
    # The agent republishes: the GPU assigned, the pod listed. The annotation counts it now.
    listed = v1_node("n1", gpu_state("n1", [0], generation=2, pods={0: ["team-a/a"]}))
    passed, failed = filter_names(bound.extender, b, listed)
    assert passed == [] and "insufficient whole GPUs" in failed["n1"]
    assert bound.extender.reservations.get("uid-a") is None


def test_a_name_the_annotation_already_listed_does_not_end_the_new_pods_reservation(bound: Bound) -> None:
    # team-a/a ran on GPU 0 before; the annotation still lists it there when a new pod a (new UID) binds.
    n1 = v1_node("n1", gpu_state("n1", [0, 1000], pods={0: ["team-a/a"]}))
    bound.bind(gpu_pod("a", "uid-a2"), n1)
    passed, _ = filter_names(bound.extender, gpu_pod("b", "uid-b"), n1)
    assert passed == [] and bound.extender.reservations.get("uid-a2") is not None
    # A newer annotation that lists it (on GPU 1 now) ends the reservation.
    newer = v1_node("n1", gpu_state("n1", [0, 0], generation=2, pods={0: ["x/y"], 1: ["team-a/a"]}))
    filter_names(bound.extender, gpu_pod("b", "uid-b"), newer)
    assert bound.extender.reservations.get("uid-a2") is None


def test_a_node_refresh_listing_the_pod_ends_its_reservation_before_any_request(bound: Bound) -> None:
    # Bound, then listed by the agent's next annotation that only the node refresh sees, then deleted:
    # the annotation without it must leave the GPU free at once, not held again by the reservation.
    n1 = v1_node("n1", gpu_state("n1", [1000]))
    bound.bind(gpu_pod("a", "uid-a"), n1)
    bound.extender.refresh_nodes([v1_node("n1", gpu_state("n1", [0], generation=2, pods={0: ["team-a/a"]}))])
    assert bound.extender.reservations.get("uid-a") is None
    bound.extender.refresh_nodes([v1_node("n1", gpu_state("n1", [1000], generation=3))])
    assert filter_names(
        bound.extender, gpu_pod("b", "uid-b"), v1_node("n1", gpu_state("n1", [1000], generation=3))
    )[0] == ["n1"]


def test_a_deleted_pods_reservation_is_released_by_the_check(bound: Bound) -> None:
    n1 = v1_node("n1", gpu_state("n1", [1000, 1000]))
    a, c = gpu_pod("a", "uid-a"), gpu_pod("c", "uid-c")
    bound.bind(a, n1)
    bound.bind(c, n1)
    assert bound.check() == 0  # both exist, bound to n1, running: held
    request = urllib.request.Request(f"{bound.api.url}/api/v1/namespaces/team-a/pods/a", method="DELETE")
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200
    assert bound.check() == 1
    assert bound.extender.reservations.get("uid-a") is None
    assert bound.extender.reservations.get("uid-c") is not None
    assert filter_names(bound.extender, gpu_pod("b", "uid-b"), n1)[0] == ["n1"]  # a's GPU is free again


def test_a_finished_or_recreated_pods_reservation_is_released_by_the_check(bound: Bound) -> None:
    n1 = v1_node("n1", gpu_state("n1", [1000, 1000]))
    a, c = gpu_pod("a", "uid-a"), gpu_pod("c", "uid-c")
    bound.bind(a, n1)
    bound.bind(c, n1)
    done = bound.api.pod("team-a", "a")
    done["status"]["phase"] = "Failed"  # the kubelet refused it, say
    bound.api.put_pod(done)
    again = gpu_pod("c", "uid-c-new")  # c deleted and created again, pending
    bound.api.put_pod(again)
    assert bound.check() == 2
    assert len(bound.extender.reservations) == 0


def test_the_safety_bound_ends_a_reservation_the_annotation_never_shows_and_says_so(
    bound: Bound, caplog: pytest.LogCaptureFixture
) -> None:
    n1 = v1_node("n1", gpu_state("n1", [1000]))
    bound.bind(gpu_pod("a", "uid-a"), n1)
    bound.clock.now += 899
    assert filter_names(bound.extender, gpu_pod("b", "uid-b"), n1)[0] == []
    bound.clock.now += 2
    with caplog.at_level(logging.WARNING, logger="gpunode.cluster.extender.reservations"):
        assert filter_names(bound.extender, gpu_pod("b", "uid-b"), n1)[0] == ["n1"]
    (record,) = [r for r in caplog.records if "team-a/a" in r.getMessage()]
    assert "dropped after 901 s" in record.getMessage() and "never listed the pod" in record.getMessage()


class SlowBinder:
    """An in-memory Binder whose Binding writes wait until released (an API server taking its time)."""

    def __init__(self, pod: dict[str, Any], *, fail: bool) -> None:
        self.pod, self.fail = pod, fail
        self.writing, self.release = threading.Event(), threading.Event()
        self.writes = 0

    def read_pod(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pod

    def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
        self.writes += 1
        self.writing.set()
        assert self.release.wait(30)
        if self.fail:
            raise KubeError(f"bind pod {namespace}/{name}: HTTP 500 (injected)")


@pytest.mark.parametrize("first_fails", [False, True], ids=["first-lands", "first-fails"])
def test_a_second_bind_of_a_pod_while_the_first_is_written_is_refused(first_fails: bool) -> None:
    pod = gpu_pod("a", "uid-a")
    binder = SlowBinder(pod, fail=first_fails)
    extender = Extender(binder=binder)
    n1 = v1_node("n1", gpu_state("n1", [1000, 1000]))
    filter_names(extender, pod, n1)
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(extender.bind, bind_body(pod, "n1"))
        assert binder.writing.wait(30)
        second = extender.bind(bind_body(pod, "n1"))["Error"]
        assert "already being bound" in second and binder.writes == 1
        binder.release.set()
        error = first.result(30)["Error"]
    held = extender.reservations.get("uid-a")
    if first_fails:
        assert "HTTP 500" in error and held is None  # its GPU goes back
    else:
        assert error == "" and held is not None and held.final  # the refused replay released nothing


# ----- stale node annotations --------------------------------------------------------------------------------


def published(node: str, updated: float, free: int = 1000) -> str:
    return encode(
        NodeGpuState(
            node=node,
            updated=updated,
            generation=1,
            gpus=(GpuRecord(f"GPU-{node}-0", 0, "NVIDIA H100", 80 * GIB, milli_assigned=1000 - free),),
        )
    )


def test_a_node_whose_annotation_is_older_than_the_bound_fails_with_its_age() -> None:
    clock = Clock(NOW)
    extender = Extender(nodes=NodeCache(max_age_s=180, clock=clock))
    quiet = v1_node("quiet", published("quiet", NOW - 200))
    fresh = v1_node("fresh", published("fresh", NOW - 10))
    passed, failed = filter_names(extender, gpu_pod("a", "uid-a"), quiet, fresh)
    assert passed == ["fresh"]
    assert "published 200 s ago" in failed["quiet"] and "180 s allowed" in failed["quiet"]
    assert "--node-state-max-age" in failed["quiet"] and "agent on quiet" in failed["quiet"]
    # The same through node names (the cache a refresher fills) and through prioritize.
    names = extender.filter({"Pod": gpu_pod("a", "uid-a"), "NodeNames": ["quiet", "fresh"]})
    assert names["NodeNames"] == ["fresh"] and "200 s ago" in names["FailedNodes"]["quiet"]
    scores = extender.prioritize({"Pod": gpu_pod("a", "uid-a"), "NodeNames": ["quiet", "fresh"]})
    assert {s["Host"]: s["Score"] for s in scores}["quiet"] == 0
    # Time passes without a republish: the fresh node goes stale too; a republish brings it back.
    clock.now += 171
    assert filter_names(extender, gpu_pod("a", "uid-a"), quiet, fresh)[0] == []
    again = v1_node("fresh", published("fresh", clock.now - 1))
    assert filter_names(extender, gpu_pod("a", "uid-a"), quiet, again)[0] == ["fresh"]


def test_bind_to_a_node_gone_stale_since_filter_is_refused() -> None:
    clock = Clock(NOW)
    with ApiServerStandIn() as api:
        kube = KubeApi(api.url)
        extender = Extender(binder=kube, nodes=NodeCache(max_age_s=180, clock=clock))
        server = ExtenderServer(extender, port=0)
        server.start()
        kube.attach(server.loop)
        try:
            pod = gpu_pod("a", "uid-a")
            api.put_pod(pod)
            extender.refresh_nodes([v1_node("n1", published("n1", NOW - 100))])
            assert extender.filter({"Pod": pod, "NodeNames": ["n1"]})["NodeNames"] == ["n1"]
            clock.now += 100
            error = extender.bind(bind_body(pod, "n1"))["Error"]
            assert "node n1:" in error and "published 200 s ago" in error
            assert not api.requests("POST", r"/binding$")
        finally:
            server.stop()


def test_the_max_age_flag() -> None:
    def built(*flags: str) -> Extender:
        return build_extender(parser().parse_args(["extender", *flags]))[0]

    assert built().nodes.max_age_s == 180  # 3 x the agent's default republish interval (60 s)
    assert built("--node-state-max-age", "5m").nodes.max_age_s == 300
    assert built("--node-state-max-age", "0s").nodes.max_age_s is None
    assert built("--bound-reservation-max-age", "1h").reservations.bound_ttl_s == 3600
    assert built().reservations.bound_ttl_s == 900
    with pytest.raises(ConfigError, match="--node-state-max-age"):
        built("--node-state-max-age", "soon")
    with pytest.raises(ConfigError, match="bound reservation max age"):
        built("--bound-reservation-max-age", "0s")
