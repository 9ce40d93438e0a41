"""The extender's energy and load terms fed by a real Prometheus scraping two simulated agents.

Nodes "gpu-a" and "gpu-b" (four Tesla T4 each, idle, identical GPU state) serve
their metrics endpoints on loopback; a real Prometheus scrapes them every second;
two extenders share one feed of its figures: one weighs only the energy term, one
only the load term. A GPU's activity is set through its node's control socket
(POST /gpus/activity) and the preferred node follows the power and utilisation
series. With Prometheus stopped, prioritize keeps answering with the policy's
scores and the fallback counter on /metrics grows.
"""

from __future__ import annotations

import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.promfeed import PromFeed
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.config.metrics import MetricsConfig
from gpunode.contract.names import FB_FREE_SERIES, FB_USED_SERIES, GPU_UTIL_SERIES, POWER_USAGE_SERIES
from gpunode.errors import SimControlError
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.devices.simnode.cli import call_control
from gpunode.node.devices.simnode.control import ControlServer, serve_control
from gpunode.node.metrics import MetricsCollector
from gpunode.node.metrics.fields import FIELDS_BY_NAME
from tests.cluster.test_extender import Client, gpu_state, node_list, v1_node, v1_pod
from tests.shared.prometheus import PROMETHEUS, Prometheus, ServingThread, needs_prometheus, values

NAMES = ("gpu-a", "gpu-b")
NODES = node_list(*(v1_node(n, gpu_state(n, [1000] * 4)) for n in NAMES))


@dataclass
class SimNode:
    name: str
    backend: SimBackend
    collector: MetricsCollector
    socket: str
    control: ControlServer | None = None
    port: int = 0

    def activity(self, gpu: int, ratio: float | None) -> None:
        call_control(self.socket, "POST", "/gpus/activity", {"gpu": gpu, "ratio": ratio})


@dataclass
class Rig:
    nodes: dict[str, SimNode]
    prometheus: Prometheus
    feed: PromFeed
    energy: Client  # an extender weighing the energy term only
    load: Client  # one weighing the load term only
    metrics_port: int


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (apt-get install -y prometheus)")
    sock_dir = Path(tempfile.mkdtemp(prefix="gpn-feed-", dir="/tmp"))
    nodes = {}
    for name in NAMES:
        backend = SimBackend.from_profile("t4")
        collector = MetricsCollector(backend=backend, hostname=name, config=MetricsConfig(interval_s=1.0))
        nodes[name] = SimNode(name, backend, collector, str(sock_dir / f"{name}.sock"))
    stack: list[Callable[[], object]] = []
    try:
        for node in nodes.values():
            node.control = serve_control(node.backend, node.socket)
            stack.append(node.control.close)
        serving = ServingThread(list(nodes.values()))
        serving.start()
        stack.append(serving.stop)
        prometheus = Prometheus([n.port for n in nodes.values()], tmp_path_factory.mktemp("prometheus"))
        stack.append(prometheus.stop)
        prometheus.wait_until("both targets up", lambda: values(prometheus.query("sum(up)")) == [2.0])
        feed = PromFeed(f"http://127.0.0.1:{prometheus.port}", refresh_s=0.5, timeout_s=5.0, max_age_s=3.0)
        feed.start()
        stack.append(feed.stop)
        clients = []
        for energy_weight, load_weight in ((1.0, 0.0), (0.0, 1.0)):
            config = ExtenderConfig(
                energy_weight=energy_weight, load_weight=load_weight, provisional_reservations=False
            )
            server = ExtenderServer(Extender(config=config, load_feed=feed), port=0)
            server.start()
            stack.append(server.stop)
            clients.append(Client(server.port))
        yield Rig(nodes, prometheus, feed, clients[0], clients[1], clients[0].port)
    finally:
        for undo in reversed(stack):
            undo()
        for node in nodes.values():
            node.backend.close()


def scores(client: Client) -> dict[str, int]:
    status, result = client.post("prioritize", {"Pod": v1_pod(), "Nodes": NODES})
    assert status == 200, result
    return {r["Host"]: r["Score"] for r in result}


def preferred(client: Client) -> str | None:
    """The node scored 10 when the other is scored 0; None while they tie or are closer."""
    got = scores(client)
    best = [n for n, s in got.items() if s == 10]
    return best[0] if len(best) == 1 and sorted(got.values()) == [0, 10] else None


def fallback_count(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("gpunode_extender_load_fallback_total "):
                return float(line.split()[1])
    raise AssertionError("no gpunode_extender_load_fallback_total on /metrics")


def test_the_series_the_extender_reads_are_the_ones_the_agent_exports() -> None:
    for name in (POWER_USAGE_SERIES, GPU_UTIL_SERIES, FB_USED_SERIES, FB_FREE_SERIES):
        assert name in FIELDS_BY_NAME


@needs_prometheus
def test_the_preferred_node_follows_power_and_utilisation(rig: Rig) -> None:
    a, b = rig.nodes["gpu-a"], rig.nodes["gpu-b"]
    wait_until("figures of both nodes", lambda: set(rig.feed.figures() or {}) == set(NAMES))
    wait_until(
        "idle nodes to tie", lambda: scores(rig.energy) == scores(rig.load) == {"gpu-a": 10, "gpu-b": 10}
    )

    a.activity(0, 0.9)
    wait_until("energy to prefer busy gpu-a", lambda: preferred(rig.energy) == "gpu-a")
    wait_until("load to prefer idle gpu-b", lambda: preferred(rig.load) == "gpu-b")
    figures = rig.feed.figures() or {}
    assert figures["gpu-a"].util == pytest.approx(0.9 / 4) and figures["gpu-b"].util == 0.0
    assert (figures["gpu-a"].power_w or 0) > (figures["gpu-b"].power_w or 0)

    a.activity(0, None)  # back to its processes: none, idle
    b.activity(2, 0.6)
    wait_until("energy to move to gpu-b", lambda: preferred(rig.energy) == "gpu-b")
    wait_until("load to move to gpu-a", lambda: preferred(rig.load) == "gpu-a")


@needs_prometheus
def test_the_control_socket_refuses_a_bad_activity(rig: Rig) -> None:
    node = rig.nodes["gpu-a"]
    for body in (
        {"gpu": 0, "ratio": 1.5},
        {"gpu": 0, "ratio": -0.1},
        {"gpu": 0, "ratio": "high"},
        {"ratio": 0.5},
    ):
        with pytest.raises(SimControlError, match="HTTP 400"):
            call_control(node.socket, "POST", "/gpus/activity", body)
    with pytest.raises(SimControlError, match="HTTP 400"):  # NaN is no JSON number: refused unparsed
        call_control(node.socket, "POST", "/gpus/activity", {"gpu": 0, "ratio": float("nan")})


@needs_prometheus
def test_with_prometheus_stopped_pods_still_get_the_policys_scores(rig: Rig) -> None:
    wait_until("figures of both nodes", lambda: set(rig.feed.figures() or {}) == set(NAMES))
    before = fallback_count(rig.metrics_port)
    rig.prometheus.stop()
    # Until the figures are over max-age old the last good set is used; then the policy alone decides.

    def counted() -> bool:
        scores(rig.energy)  # every answer is 200 with scores, before and after the figures go stale
        return fallback_count(rig.metrics_port) > before

    wait_until("the fallback to be counted", counted)
    assert scores(rig.energy) == scores(rig.load) == {"gpu-a": 10, "gpu-b": 10}
    assert rig.feed.figures() is None
    status, result = rig.energy.post("filter", {"Pod": v1_pod(), "Nodes": NODES})
    assert status == 200 and result["Error"] == "" and len(result["Nodes"]["items"]) == 2
