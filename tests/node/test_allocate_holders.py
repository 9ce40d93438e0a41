"""An Allocate for devices another container holds is refused: the agent is the last line.

The attack: a client that is not the kubelet (or a kubelet that repeats itself) sends
Allocates whose memory units overlap, concurrently and one after another. Only
allocations that share no unit with a live holder (an Allocate in flight, a container
the kubelet's pod-resources List names) may succeed, and no two live regions may share
a unit; units whose holder has ended still get a fresh region.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpunode.node import memcap
from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import region_key
from gpunode.node.kubelet.podresources import ContainerDevices
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn

MEM = "gpunode.io/gpu-memory"


class Kubelet:
    """The kubelet's bookkeeping around Allocate: a container's devices are listed once it got them."""

    def __init__(self, plugins: KubeletStandIn, pr: PodResourcesStandIn) -> None:
        self.plugins = plugins
        self.pr = pr
        self.lock = threading.Lock()
        self.holders: list[ContainerDevices] = []

    def allocate(self, name: str, ids: list[str]) -> None:
        self.plugins.allocate(MEM, ids)
        with self.lock:
            self.holders.append(ContainerDevices("team", name, "main", MEM, tuple(ids)))
            self.pr.set_pods(self.holders)

    def end_all(self) -> None:
        with self.lock:
            self.holders = []
            self.pr.set_pods([])


@pytest.fixture
def node(sockdir: Path, kubelet: KubeletStandIn) -> Iterator[tuple[RunningAgent, Kubelet, list[str]]]:
    doc = {
        "gpunode": {
            "fractional": {"devices": "all", "unit": "1Gi"},
            "podResourcesSocket": str(sockdir / "pr.sock"),
        }
    }
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    backend = SimBackend.from_profile("dgx-h100")
    with (
        PodResourcesStandIn(str(sockdir / "pr.sock")) as pr,
        RunningAgent(Agent(cfg, backend=backend)) as ra,
    ):
        kubelet.wait_for_resources([MEM])
        gpu = backend.gpus()[3].uuid
        units = sorted(
            (u for u in kubelet.healthy(MEM) if u.startswith(gpu + "::")),
            key=lambda u: int(u.rsplit("mem", 1)[1]),
        )
        yield ra, Kubelet(kubelet, pr), units


def live_regions(ra: RunningAgent) -> dict[str, tuple[str, ...]]:
    return {k: r.device_ids for k, r in ra.agent.checkpoint.records().items()}


def test_concurrent_overlapping_allocates_only_disjoint_ones_succeed(
    node: tuple[RunningAgent, Kubelet, list[str]],
) -> None:
    ra, kubelet, units = node
    assert len(units) == 79
    windows = [
        units[3 * i : 3 * i + 20] for i in range(20)
    ]  # 20 units each, every one overlaps its neighbours
    start = threading.Barrier(len(windows))
    ok: list[list[str]] = []
    refused: list[str] = []

    def client(i: int) -> None:
        start.wait()
        try:
            kubelet.allocate(f"pod-{i}", windows[i])
            with kubelet.lock:
                ok.append(windows[i])
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            refused.append(err.details() or "")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(windows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(ok) + len(refused) == 20 and ok and refused
    for i, a in enumerate(ok):
        for b in ok[i + 1 :]:
            assert not set(a) & set(b), "two overlapping Allocates both succeeded"
    assert all(("held by" in r or "allocated to another" in r) and "\n" not in r for r in refused), refused
    regions = list(live_regions(ra).values())
    for i, r1 in enumerate(regions):
        for r2 in regions[i + 1 :]:
            assert not set(r1) & set(r2), "two live regions share a unit"


def test_units_of_a_running_container_are_refused_and_freed_ones_get_a_fresh_region(
    sockdir: Path, node: tuple[RunningAgent, Kubelet, list[str]]
) -> None:
    ra, kubelet, units = node
    assert ra.agent.plugins is not None
    ra.agent.plugins.holds.record_grace_s = 0.2
    kubelet.allocate("first", units[0:10])
    time.sleep(0.3)  # past the grace: only the kubelet's word counts now
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate("second", units[5:15])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{units[5]} is still held by the running container team/first/main" in (err.value.details() or "")
    assert set(live_regions(ra)) == {region_key(units[0:10])}

    old = memcap.load_region(sockdir / "state" / "memcap" / region_key(units[0:10]))
    kubelet.end_all()  # the first container ends: the kubelet lists it no more
    kubelet.allocate("second", units[5:15])
    fresh = memcap.load_region(sockdir / "state" / "memcap" / region_key(units[5:15]))
    assert fresh.generation != old.generation
    usage = memcap.read_usage(fresh)
    assert all(d.used_bytes == 0 for d in usage.devices)
    kubelet.allocate("third", units[0:5])  # the rest of the first one's units, free as well


def test_reallocating_the_same_container_is_let_through(
    node: tuple[RunningAgent, Kubelet, list[str]],
) -> None:
    """A restarted kubelet allocates a running container's devices again: the same set, the same holder."""
    ra, kubelet, units = node
    assert ra.agent.plugins is not None
    ra.agent.plugins.holds.record_grace_s = 0.0
    kubelet.allocate("one", units[20:24])
    kubelet.plugins.allocate(MEM, units[20:24])


def test_an_init_containers_units_reused_by_its_pod_are_let_through(
    node: tuple[RunningAgent, Kubelet, list[str]],
) -> None:
    """The kubelet gives an app container the devices of its pod's init container right after it; pod-resources
    does not list (non-sidecar) init containers."""
    _, kubelet, units = node
    kubelet.plugins.allocate(MEM, units[30:36])  # the init container, never listed
    kubelet.plugins.allocate(MEM, units[30:34])  # its pod's app container, at once
    kubelet.plugins.allocate(MEM, units[30:38])  # or one that needs more than the init container had


def test_without_the_kubelets_list_the_kubelets_word_stands(sockdir: Path, kubelet: KubeletStandIn) -> None:
    """No pod-resources socket: units reused after an answer are let through at once (said in the log)."""
    doc = {
        "gpunode": {
            "fractional": {"devices": [0], "unit": "1Gi"},
            "podResourcesSocket": str(sockdir / "absent.sock"),
        }
    }
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    backend = SimBackend.from_profile("t4")
    with RunningAgent(Agent(cfg, backend=backend)) as ra:
        kubelet.wait_for_resources([MEM])
        assert ra.agent.plugins is not None
        units = sorted(kubelet.healthy(MEM), key=lambda u: int(u.rsplit("mem", 1)[1]))
        kubelet.allocate(MEM, units[0:4])
        started = time.monotonic()
        kubelet.allocate(MEM, units[2:6])
        assert time.monotonic() - started < 0.4, "nothing to wait for without the kubelet's List"
        assert ra.agent.plugins.holds.unchecked >= 1
        assert (
            ra.agent.plugins.holds.problem is not None and "does not exist" in ra.agent.plugins.holds.problem
        )


def test_a_holder_the_kubelet_never_recorded_is_waited_for_then_let_through(
    node: tuple[RunningAgent, Kubelet, list[str]],
) -> None:
    """A pod rejected after its Allocate never shows in the List: its units go to the next pod after the grace."""
    ra, kubelet, units = node
    assert ra.agent.plugins is not None
    kubelet.plugins.allocate(MEM, units[40:44])  # answered, never recorded by the kubelet
    started = time.monotonic()
    kubelet.allocate("next", units[42:46])
    waited = time.monotonic() - started
    assert 0.2 < waited < 3.0 and ra.agent.plugins.holds.waited > 0


def test_replicas_held_before_the_agent_started_are_refused(sockdir: Path, kubelet: KubeletStandIn) -> None:
    """After an agent restart it has not seen the Allocates of running containers: the kubelet's List tells it."""
    shared = "nvidia.com/gpu.shared"
    doc = {
        "sharing": {
            "timeSlicing": {"renameByDefault": True, "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}
        },
        "gpunode": {"podResourcesSocket": str(sockdir / "pr.sock")},
    }
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    backend = SimBackend.from_profile("t4")
    g0 = backend.gpus()[0].uuid
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        pr.set_pods([ContainerDevices("team", "old", "main", shared, (f"{g0}::1",))])
        with RunningAgent(Agent(cfg, backend=backend)):
            kubelet.wait_for_resources([shared])
            with pytest.raises(grpc.RpcError) as err:
                kubelet.allocate(shared, [f"{g0}::1", f"{g0}::2"])
            assert "still held by the running container team/old/main" in (err.value.details() or "")
            kubelet.allocate(shared, [f"{g0}::2"])
            kubelet.allocate(shared, [f"{g0}::1"])  # the same set as its holder's: the holder allocated again
