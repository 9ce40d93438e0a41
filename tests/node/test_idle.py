"""Idle GPUs: a pod whose GPUs stay below the threshold is flagged (metric, annotation, one Event).

The agent runs in-process on the simulated node, against the pod-resources and
API server stand-ins; GPU activity is pinned through the simulated backend.
Waits are generous and nothing is timed: "long enough" is read from the
agent's own gauge (seconds idle), never from the wall clock.
"""

from __future__ import annotations

import logging
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpunode.config.agent import parse_config
from gpunode.contract.names import GPU_IDLE_ANNOTATION
from gpunode.errors import ConfigError
from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.idle import EVENT_REASON, parse_rfc3339, rfc3339
from gpunode.node.kubelet.podresources import ContainerDevices
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.apiserver import ApiServerStandIn
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn
from tests.node.test_publish import kubeconfig

NODE = "gpu-node-1"
NS = "team-a"
WAIT_S = 60.0
FOR_S = 1.0
INTERVAL_S = 0.2


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.add_node(NODE)
        yield server


def agent_config(sockdir: Path, api: ApiServerStandIn, **idle: Any) -> Any:
    doc = {
        "gpunode": {
            "nodeName": NODE,
            "podResourcesSocket": str(sockdir / "pr.sock"),
            "nodeState": {"enabled": False},
            "remediation": {"mode": "off", "kubeconfig": str(kubeconfig(sockdir / "kubeconfig", api.url))},
            "idle": {
                "enabled": True,
                "utilisationBelow": 5,
                "for": f"{FOR_S:g}s",
                "interval": f"{INTERVAL_S * 1000:g}ms",
                **idle,
            },
        }
    }
    return make_config(sockdir / "device-plugins", sockdir / "state", doc)


def holds(pod: str, gpu_uuid: str) -> ContainerDevices:
    return ContainerDevices(NS, pod, "main", "nvidia.com/gpu", (gpu_uuid,))


def annotation_of(api: ApiServerStandIn, pod: str) -> str | None:
    value = api.pod(NS, pod)["metadata"].get("annotations", {}).get(GPU_IDLE_ANNOTATION)
    return None if value is None else str(value)


def idle_events(api: ApiServerStandIn, pod: str) -> list[dict[str, Any]]:
    return [e for e in api.events() if e.get("reason") == EVENT_REASON and e["involvedObject"]["name"] == pod]


def scrape(agent: Agent) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> (sorted labels -> value), for the idle series."""
    assert agent.metrics_endpoint is not None
    with urllib.request.urlopen(agent.metrics_endpoint.url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(("gpunode_pod_gpu_idle", "gpunode_idle_")):
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def series(agent: Agent, name: str, pod: str) -> float | None:
    return scrape(agent).get(name, {}).get((("namespace", NS), ("pod", pod)))


def wait_until(api: ApiServerStandIn, predicate: Any, what: str) -> None:
    api.wait_for(predicate, timeout=WAIT_S, what=what)


def idle_for_at_least(agent: Agent, pod: str, seconds: float) -> bool:
    value = series(agent, "gpunode_pod_gpu_idle_seconds", pod)
    return value is not None and value >= seconds


def test_idle_pod_is_flagged_once_and_busy_pod_is_not(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn
) -> None:
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    backend.set_activity(gpus[0].uuid, 0.0)
    backend.set_activity(gpus[1].uuid, 0.8)
    for pod in ("idle-0", "busy-0"):
        api.add_pod(NS, pod, node_name=NODE)
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        pr.set_pods([holds("idle-0", gpus[0].uuid), holds("busy-0", gpus[1].uuid)])
        with RunningAgent(Agent(agent_config(sockdir, api), backend=backend)) as ra:
            wait_until(api, lambda: annotation_of(api, "idle-0") is not None, "the idle annotation")
            # Many more samples after the flag: still one Event for this idle period.
            wait_until(
                api,
                lambda: idle_for_at_least(ra.agent, "idle-0", FOR_S + 10 * INTERVAL_S),
                "ten more rounds",
            )
            events = idle_events(api, "idle-0")
            assert len(events) == 1
            message = events[0]["message"]
            assert gpus[0].uuid in message and "below 5%" in message and "for 1s" in message
            assert events[0]["involvedObject"]["kind"] == "Pod" and events[0]["involvedObject"]["uid"]
            since = parse_rfc3339(annotation_of(api, "idle-0") or "")
            assert since is not None and since <= time.time()
            assert series(ra.agent, "gpunode_pod_gpu_idle", "idle-0") == 1.0

            assert annotation_of(api, "busy-0") is None
            assert idle_events(api, "busy-0") == []
            assert series(ra.agent, "gpunode_pod_gpu_idle", "busy-0") == 0.0
            assert series(ra.agent, "gpunode_pod_gpu_idle_seconds", "busy-0") == 0.0
            assert ra.agent.supervisor is not None and not ra.agent.supervisor.stopping


def test_busy_again_loses_the_flag_and_a_new_idle_period_gets_its_own_event(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn
) -> None:
    backend = SimBackend.from_profile("t4")
    gpu = backend.gpus()[0]
    backend.set_activity(gpu.uuid, 0.0)
    api.add_pod(NS, "train-0", node_name=NODE)
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        pr.set_pods([holds("train-0", gpu.uuid)])
        with RunningAgent(Agent(agent_config(sockdir, api), backend=backend)) as ra:
            wait_until(api, lambda: annotation_of(api, "train-0") is not None, "the idle annotation")
            first = annotation_of(api, "train-0")

            backend.set_activity(gpu.uuid, 0.9)
            wait_until(api, lambda: annotation_of(api, "train-0") is None, "the annotation removed")
            wait_until(
                api,
                lambda: series(ra.agent, "gpunode_pod_gpu_idle", "train-0") == 0.0,
                "the gauge back to 0",
            )
            assert series(ra.agent, "gpunode_pod_gpu_idle_seconds", "train-0") == 0.0
            assert len(idle_events(api, "train-0")) == 1

            backend.set_activity(gpu.uuid, 0.01)  # 1%: below the 5% threshold
            wait_until(api, lambda: annotation_of(api, "train-0") is not None, "flagged again")
            wait_until(api, lambda: len(idle_events(api, "train-0")) == 2, "the second period's Event")
            second = annotation_of(api, "train-0")
            assert first is not None and second is not None
            assert (parse_rfc3339(second) or 0) >= (parse_rfc3339(first) or 0)


def test_a_failing_api_server_does_not_stop_the_agent(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpunode.node.idle")
    backend = SimBackend.from_profile("t4")
    gpu = backend.gpus()[0]
    backend.set_activity(gpu.uuid, 0.0)
    api.add_pod(NS, "idle-0", node_name=NODE)
    api.fail("GET", f"/namespaces/{NS}/pods/idle-0$", 500, times=None)
    api.fail("PATCH", f"/namespaces/{NS}/pods/idle-0$", 500, times=None)
    api.fail("POST", f"/namespaces/{NS}/events$", 503, times=None)
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        pr.set_pods([holds("idle-0", gpu.uuid)])
        with RunningAgent(Agent(agent_config(sockdir, api), backend=backend)) as ra:
            wait_until(
                api,
                lambda: (scrape(ra.agent).get("gpunode_idle_api_errors_total", {}).get((), 0.0)) >= 5,
                "several failed rounds",
            )
            wait_until(  # the gauge does not depend on the API server
                api,
                lambda: series(ra.agent, "gpunode_pod_gpu_idle", "idle-0") == 1.0,
                "flagged while the API server fails",
            )
            assert ra.agent.supervisor is not None and not ra.agent.supervisor.stopping
            assert annotation_of(api, "idle-0") is None and idle_events(api, "idle-0") == []
            said = [r for r in caplog.records if "trying again every" in r.getMessage()]
            assert len(said) == 1, "an API error streak is logged once"

            api.clear_faults()
            wait_until(api, lambda: annotation_of(api, "idle-0") is not None, "the annotation after recovery")
            wait_until(api, lambda: len(idle_events(api, "idle-0")) == 1, "the Event after recovery")
            assert any("answers the idle-GPU watch again" in r.getMessage() for r in caplog.records)
            assert not ra.agent.supervisor.stopping


def test_restart_resumes_the_idle_period_and_clears_stale_flags(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn
) -> None:
    """An annotation from before a restart: an idle pod keeps it without a second Event; a busy one loses it."""
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    backend.set_activity(gpus[0].uuid, 0.0)
    backend.set_activity(gpus[1].uuid, 0.7)
    earlier = rfc3339(time.time() - 3600)
    for pod in ("idle-0", "busy-0"):
        api.put_pod(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod, "namespace": NS, "annotations": {GPU_IDLE_ANNOTATION: earlier}},
                "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "x"}]},
                "status": {"phase": "Running"},
            }
        )
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        pr.set_pods([holds("idle-0", gpus[0].uuid), holds("busy-0", gpus[1].uuid)])
        with RunningAgent(Agent(agent_config(sockdir, api), backend=backend)) as ra:
            wait_until(api, lambda: annotation_of(api, "busy-0") is None, "the stale flag removed")
            wait_until(
                api, lambda: series(ra.agent, "gpunode_pod_gpu_idle", "idle-0") == 1.0, "idle-0 flagged"
            )
            assert (series(ra.agent, "gpunode_pod_gpu_idle_seconds", "idle-0") or 0) >= 3000
            assert annotation_of(api, "idle-0") == earlier
            assert idle_events(api, "idle-0") == []  # posted by the agent before the restart


def test_vanished_pods_are_forgotten(sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn) -> None:
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    api.add_pod(NS, "a-0", node_name=NODE)
    api.add_pod(NS, "b-0", node_name=NODE)
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        pr.set_pods([holds("a-0", gpus[0].uuid), holds("b-0", gpus[1].uuid)])
        with RunningAgent(Agent(agent_config(sockdir, api), backend=backend)) as ra:
            wait_until(
                api, lambda: series(ra.agent, "gpunode_pod_gpu_idle", "a-0") is not None, "a-0 followed"
            )
            pr.set_pods([holds("b-0", gpus[1].uuid)])
            wait_until(api, lambda: series(ra.agent, "gpunode_pod_gpu_idle", "a-0") is None, "a-0 forgotten")
            assert series(ra.agent, "gpunode_pod_gpu_idle", "b-0") is not None


# -- configuration -------------------------------------------------------------------------------


def test_idle_section_defaults_and_values() -> None:
    cfg = parse_config({"version": "v1"}, "c.yaml")
    assert not cfg.idle.enabled and cfg.idle.below_percent == 5 and cfg.idle.for_s == 1800
    cfg = parse_config(
        {"gpunode": {"idle": {"enabled": True, "utilisationBelow": 2.5, "for": "2h", "interval": "1m"}}}, "c"
    )
    assert cfg.idle.enabled and cfg.idle.below_ratio == 0.025
    assert cfg.idle.for_s == 7200 and cfg.idle.interval_s == 60


@pytest.mark.parametrize(
    ("idle", "words"),
    [
        ({"utilisationBelow": 0}, "c.yaml: gpunode.idle.utilisationBelow: expected a percentage above 0"),
        ({"utilisationBelow": 101}, "gpunode.idle.utilisationBelow: expected a 0..100 number"),
        ({"utilisationBelow": True}, "gpunode.idle.utilisationBelow"),
        ({"for": "0s"}, "gpunode.idle.for: expected 1s..7d"),
        ({"interval": "2h"}, "gpunode.idle.interval: expected"),
        ({"enabled": "yes"}, "gpunode.idle.enabled: expected true or false"),
        ({"utilisationBelw": 5}, "utilisationBelw"),
    ],
)
def test_idle_section_refuses_bad_values(idle: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"gpunode": {"idle": idle}}, "c.yaml")
    assert words in str(info.value)
    assert "\n" not in str(info.value)
