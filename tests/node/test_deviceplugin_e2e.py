"""End to end: the agent on a simulated node, driven by a kubelet stand-in over real Unix sockets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.kubelet.deviceplugin import socket_name
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn

GPU = "nvidia.com/gpu"


def start_agent(sockdir: Path, profile: str, doc: dict[str, Any] | None = None, **own: Any) -> RunningAgent:
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc, **own)
    backend = SimBackend.from_profile(profile)
    return RunningAgent(Agent(cfg, backend=backend)).start()


@pytest.fixture
def agent_factory(sockdir: Path) -> Iterator[Any]:
    started: list[RunningAgent] = []

    def factory(profile: str, doc: dict[str, Any] | None = None, **own: Any) -> RunningAgent:
        ra = start_agent(sockdir, profile, doc, **own)
        started.append(ra)
        return ra

    yield factory
    for ra in started:
        ra.stop()


def sim(ra: RunningAgent) -> SimBackend:
    backend = ra.agent.backend
    assert isinstance(backend, SimBackend)
    return backend


def test_whole_gpus_on_dgx_h100(kubelet: KubeletStandIn, agent_factory: Any) -> None:
    ra = agent_factory("dgx-h100")
    kubelet.wait_for_resources([GPU])
    gpus = sim(ra).gpus()
    assert kubelet.healthy(GPU) == sorted(g.uuid for g in gpus)
    view = kubelet.plugins[GPU]
    assert view.options.get_preferred_allocation_available
    assert view.endpoint == socket_name(GPU)
    assert {g.uuid: [g.numa_node] for g in gpus} == view.numa
    resp = kubelet.allocate(GPU, [gpus[0].uuid, gpus[5].uuid])
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == f"{gpus[0].uuid},{gpus[5].uuid}"


def test_mig_single_advertises_mig_devices_as_gpu(kubelet: KubeletStandIn, agent_factory: Any) -> None:
    ra = agent_factory("h100-mig", {"flags": {"migStrategy": "single"}})
    kubelet.wait_for_resources([GPU])
    migs = [m.uuid for g in sim(ra).gpus() for m in g.mig_devices]
    assert len(migs) == 56
    assert kubelet.healthy(GPU) == sorted(migs)
    resp = kubelet.allocate(GPU, [migs[3]])
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == migs[3]


def test_mig_mixed_advertises_one_resource_per_profile(kubelet: KubeletStandIn, agent_factory: Any) -> None:
    ra = agent_factory("a100-mig", {"flags": {"migStrategy": "mixed"}})
    gpus = sim(ra).gpus()
    expected: dict[str, list[str]] = {}
    for g in gpus:
        if g.mig_enabled:
            for m in g.mig_devices:
                expected.setdefault(f"nvidia.com/mig-{m.profile}", []).append(m.uuid)
        else:
            expected.setdefault(GPU, []).append(g.uuid)
    assert len(expected) >= 3 and GPU in expected, "the profile should mix MIG profiles and a whole GPU"
    kubelet.wait_for_resources(list(expected))
    for resource, ids in expected.items():
        assert kubelet.healthy(resource) == sorted(ids), resource


@pytest.mark.parametrize(
    ("sharing", "names"),
    [
        pytest.param({}, {GPU: 2 + 8}, id="replicas-share-nvidia.com/gpu"),
        pytest.param({"renameByDefault": True}, {GPU: 2, "nvidia.com/gpu.shared": 8}, id="renameByDefault"),
        pytest.param({"rename": "example.com/t4-slice"}, {GPU: 2, "example.com/t4-slice": 8}, id="rename"),
    ],
)
def test_time_slicing_with_device_selector(
    kubelet: KubeletStandIn, agent_factory: Any, sharing: dict[str, Any], names: dict[str, int]
) -> None:
    resource: dict[str, Any] = {"name": GPU, "replicas": 4, "devices": [0, 1]}
    top: dict[str, Any] = {}
    if "rename" in sharing:
        resource["rename"] = sharing["rename"]
    else:
        top = sharing
    ra = agent_factory("t4", {"sharing": {"timeSlicing": {**top, "resources": [resource]}}})
    kubelet.wait_for_resources(list(names))
    for name, count in names.items():
        assert len(kubelet.healthy(name)) == count, name
    gpus = sim(ra).gpus()
    shared_name = next(n for n in names if n != GPU) if len(names) > 1 else GPU
    replicas = sorted(i for i in kubelet.healthy(shared_name) if "::" in i)
    assert replicas == sorted(f"{g.uuid}::{n}" for g in gpus[:2] for n in range(4))
    whole = sorted(i for i in kubelet.healthy(GPU) if "::" not in i)
    assert whole == sorted(g.uuid for g in gpus[2:])
    resp = kubelet.allocate(shared_name, [f"{gpus[1].uuid}::2"])
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == gpus[1].uuid


def test_fail_requests_greater_than_one(kubelet: KubeletStandIn, agent_factory: Any) -> None:
    doc = {
        "sharing": {
            "timeSlicing": {
                "renameByDefault": True,
                "failRequestsGreaterThanOne": True,
                "resources": [{"name": GPU, "replicas": 2}],
            }
        }
    }
    ra = agent_factory("t4", doc)
    kubelet.wait_for_resources(["nvidia.com/gpu.shared"])
    uuid = sim(ra).gpus()[0].uuid
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate("nvidia.com/gpu.shared", [f"{uuid}::0", f"{uuid}::1"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "failRequestsGreaterThanOne" in (err.value.details() or "")
    assert kubelet.allocate("nvidia.com/gpu.shared", [f"{uuid}::1"]).envs["NVIDIA_VISIBLE_DEVICES"] == uuid


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        pytest.param(["GPU-00000000-0000-0000-0000-000000000000"], "unknown device ID", id="unknown-id"),
        pytest.param([], "names no device", id="empty"),
    ],
)
def test_allocate_bad_ids_is_invalid_argument_and_serving_goes_on(
    kubelet: KubeletStandIn, agent_factory: Any, bad: list[str], message: str
) -> None:
    ra = agent_factory("t4")
    kubelet.wait_for_resources([GPU])
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(GPU, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")
    for b in bad:
        assert b in (err.value.details() or "")
    good = sim(ra).gpus()[2].uuid
    assert kubelet.allocate(GPU, [good]).envs["NVIDIA_VISIBLE_DEVICES"] == good


def test_allocate_unhealthy_device_is_refused(kubelet: KubeletStandIn, agent_factory: Any) -> None:
    ra = agent_factory("t4")
    kubelet.wait_for_resources([GPU])
    gone = sim(ra).gpus()[3].uuid
    sim(ra).remove_gpu(gone)
    kubelet.wait_for(lambda: gone in kubelet.unhealthy(GPU), what="the removed GPU to turn unhealthy")
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(GPU, [gone])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert gone in (err.value.details() or "") and "unhealthy" in (err.value.details() or "")


def test_kubelet_restart_re_registers_every_plugin(kubelet: KubeletStandIn, agent_factory: Any) -> None:
    agent_factory(
        "t4",
        {
            "sharing": {
                "timeSlicing": {
                    "renameByDefault": True,
                    "resources": [{"name": GPU, "replicas": 2, "devices": [0]}],
                }
            }
        },
    )
    names = [GPU, "nvidia.com/gpu.shared"]
    kubelet.wait_for_resources(names)
    before = len(kubelet.registrations)
    kubelet.restart()
    kubelet.wait_for_resources(names)
    again = [r for _, r in kubelet.registrations[before:]]
    assert sorted(again) == sorted(names)
    for name in names:
        assert (kubelet.directory / socket_name(name)).is_socket()
    assert len(kubelet.healthy("nvidia.com/gpu.shared")) == 2


def test_agent_waits_for_the_kubelet(sockdir: Path, agent_factory: Any) -> None:
    ra = agent_factory("t4")
    assert ra.agent.plugins is not None and ra.agent.plugins.registrations == 0
    with KubeletStandIn(sockdir / "device-plugins") as late:
        late.wait_for_resources([GPU])
        assert len(late.healthy(GPU)) == 4


def test_hot_remove_and_hot_add(kubelet: KubeletStandIn, agent_factory: Any) -> None:
    ra = agent_factory("t4")
    kubelet.wait_for_resources([GPU])
    backend = sim(ra)
    gone = backend.gpus()[1].uuid
    backend.remove_gpu(gone)
    kubelet.wait_for(lambda: kubelet.unhealthy(GPU) == [gone], what="the removed GPU to turn unhealthy")
    assert len(kubelet.healthy(GPU)) == 3
    new = backend.add_gpu()
    kubelet.wait_for(lambda: new.uuid in kubelet.healthy(GPU), what="the added GPU to be advertised")
    assert kubelet.unhealthy(GPU) == [gone]


def test_sockets_removed_on_stop(sockdir: Path, kubelet: KubeletStandIn) -> None:
    ra = start_agent(sockdir, "t4")
    kubelet.wait_for_resources([GPU])
    sock = kubelet.directory / socket_name(GPU)
    assert sock.is_socket()
    ra.stop()
    assert not sock.exists()
    assert kubelet.socket.exists(), "the agent must not touch the kubelet's socket"


@pytest.mark.parametrize(
    ("profile", "available", "size", "must", "check"),
    [
        pytest.param(
            "t4", [0, 1, 2, 3], 2, [], lambda gs: gs[0].numa_node == gs[1].numa_node, id="t4-same-numa"
        ),
        pytest.param(
            "t4", [0, 1, 2, 3], 2, [2], lambda gs: {g.index for g in gs} == {2, 3}, id="t4-must-include"
        ),
        pytest.param("t4", [0, 2, 3], 2, [], lambda gs: {g.index for g in gs} == {2, 3}, id="t4-free-pair"),
        pytest.param(
            "dgx-h100",
            list(range(8)),
            4,
            [],
            lambda gs: len({g.numa_node for g in gs}) == 1,
            id="dgx-nvlink+numa",
        ),
        pytest.param(
            "dgx-h100", [0, 1, 4, 5, 6], 3, [0], lambda gs: 0 in {g.index for g in gs}, id="dgx-must-include"
        ),
    ],
)
def test_preferred_allocation_prefers_the_best_interconnect(
    kubelet: KubeletStandIn,
    agent_factory: Any,
    profile: str,
    available: list[int],
    size: int,
    must: list[int],
    check: Any,
) -> None:
    ra = agent_factory(profile)
    kubelet.wait_for_resources([GPU])
    gpus = sim(ra).gpus()
    by_uuid = {g.uuid: g for g in gpus}
    chosen = kubelet.preferred(GPU, [gpus[i].uuid for i in available], size, [gpus[i].uuid for i in must])
    assert len(chosen) == size and len(set(chosen)) == size
    assert set(chosen) <= {gpus[i].uuid for i in available}
    assert check([by_uuid[u] for u in chosen]), [by_uuid[u].index for u in chosen]
