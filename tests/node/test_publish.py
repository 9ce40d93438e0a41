"""The agent publishes its GPU state on its Node: assignments from pod-resources, health, topology."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.contract.nodestate import ANNOTATION_KEY, decode
from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.kubelet.podresources import ContainerDevices
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.apiserver import ApiServerStandIn
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn

NODE = "gpu-node-1"


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.add_node(NODE)
        yield server


def kubeconfig(path: Path, url: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def annotation(api: ApiServerStandIn) -> dict[str, Any] | None:
    text = api.node(NODE)["metadata"].get("annotations", {}).get(ANNOTATION_KEY)
    return None if text is None else json.loads(text)


def test_annotation_follows_assignment_and_health(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn
) -> None:
    doc = {
        "sharing": {
            "timeSlicing": {
                "renameByDefault": True,
                "resources": [{"name": "nvidia.com/gpu", "replicas": 4, "devices": [1]}],
            }
        },
        "gpunode": {
            "nodeName": NODE,
            "podResourcesSocket": str(sockdir / "pr.sock"),
            "nodeState": {"interval": "1s"},
            "remediation": {"mode": "off", "kubeconfig": str(kubeconfig(sockdir / "kubeconfig", api.url))},
            "health": {"recoveryWindow": "60s"},
        },
    }
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        pr.set_pods(
            [
                ContainerDevices("team-a", "train-0", "main", "nvidia.com/gpu", (gpus[0].uuid,)),
                ContainerDevices(
                    "team-b", "infer-1", "srv", "nvidia.com/gpu.shared", (f"{gpus[1].uuid}::0",)
                ),
            ]
        )
        cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
        with RunningAgent(Agent(cfg, backend=backend)):
            api.wait_for(lambda: annotation(api) is not None, what="the first annotation")
            state = decode(api.node(NODE)["metadata"]["annotations"][ANNOTATION_KEY], node=NODE)
            by_index = {g.index: g for g in state.gpus}
            assert by_index[0].milli_assigned == 1000 and by_index[0].pods == ("team-a/train-0",)
            assert by_index[1].sharing == "time-sliced" and by_index[1].milli_assigned == 250
            assert by_index[1].pods == ("team-b/infer-1",)
            assert by_index[2].milli_assigned == 0 and by_index[2].healthy
            assert by_index[0].numa_node == 0 and by_index[3].numa_node == 1
            first_generation = state.generation

            backend.inject_xid(gpus[2].uuid, 79)
            api.wait_for(
                lambda: not decode(json.dumps(annotation(api))).gpus[2].healthy, what="GPU 2 unhealthy"
            )
            after = decode(json.dumps(annotation(api)))
            assert after.generation > first_generation
            assert [g.healthy for g in after.gpus] == [True, True, False, True]

            patches = api.requests("PATCH", f"/api/v1/nodes/{NODE}$")
            assert patches, "the annotation is written with a PATCH of the Node"


def test_api_server_errors_are_retried(sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn) -> None:
    api.fail("PATCH", f"/api/v1/nodes/{NODE}$", 500, times=2)
    doc = {
        "gpunode": {
            "nodeName": NODE,
            "podResourcesSocket": str(sockdir / "missing.sock"),
            "remediation": {"mode": "off", "kubeconfig": str(kubeconfig(sockdir / "kubeconfig", api.url))},
        }
    }
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    ra = RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4")))
    with ra:
        kubelet.wait_for_resources(["nvidia.com/gpu"])
        publisher = ra.agent.publisher
        publisher.retry_initial_s = 0.05
        api.wait_for(
            lambda: annotation(api) is not None, timeout=15, what="the annotation after two failures"
        )
        assert publisher.failures >= 1
        state = decode(json.dumps(annotation(api)), node=NODE)
        assert len(state.gpus) == 4 and all(g.milli_assigned == 0 for g in state.gpus)
