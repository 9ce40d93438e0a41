"""The node carries out the extender's GPU assignment: GetPreferredAllocation and Allocate follow the
gpu-assigned annotation of the pod being admitted, mark it carried out, and the node republishes its state.

The agent runs in-process with the kubelet and API server stand-ins; the pods are stored in the API
server as the extender leaves them (annotated, bound, Pending).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from gpunode.contract.names import ALLOCATED_ANNOTATION, ASSIGNMENT_ANNOTATION, GIB
from gpunode.contract.nodestate import ANNOTATION_KEY, decode
from gpunode.node.agent import Agent
from gpunode.node.allocation.preferred import preferred_allocation
from gpunode.node.devices.simnode.backend import SimBackend
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.apiserver import ApiServerStandIn
from tests.fakes.kubelet import KubeletStandIn
from tests.node.test_publish import kubeconfig

NODE = "gpu-node-7"
MEM = "gpunode.io/gpu-memory"
WAIT_S = 30.0  # generous: a loaded 2-core machine


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.add_node(NODE)
        yield server


def agent_config(sockdir: Path, api: ApiServerStandIn) -> Any:
    doc = {
        "gpunode": {
            "nodeName": NODE,
            "fractional": {"devices": [0, 1, 2, 3], "unit": "1Gi"},
            "podResourcesSocket": str(sockdir / "pr.sock"),  # none: the holders come from Allocate
            "nodeState": {"interval": "1h"},  # only changes publish during a test
            "remediation": {"mode": "off", "kubeconfig": str(kubeconfig(sockdir / "kubeconfig", api.url))},
        }
    }
    return make_config(sockdir / "device-plugins", sockdir / "state", doc)


def put_pending(api: ApiServerStandIn, name: str, units: int, *, assigned: str | None, scheduled: str) -> str:
    """A pod as the extender leaves it: annotated with its GPU (or not), bound here, Pending."""
    annotations = {ASSIGNMENT_ANNOTATION: assigned} if assigned else {}
    return api.put_pod(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "team-a",
                "annotations": annotations,
                "creationTimestamp": "2030-01-01T00:00:00Z",
            },
            "spec": {
                "nodeName": NODE,
                "containers": [{"name": "main", "resources": {"limits": {MEM: str(units)}}}],
            },
            "status": {
                "phase": "Pending",
                "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled}],
            },
        }
    )


def gpu_of(device_ids: list[str]) -> set[str]:
    return {d.split("::")[0] for d in device_ids}


def own_choice(ra: RunningAgent, kubelet: KubeletStandIn, units: int) -> set[str]:
    """The GPU the node's own policy picks for `units` out of everything offered now."""
    assert ra.agent.state is not None
    snap = ra.agent.state.snapshot()
    return gpu_of(preferred_allocation(snap, MEM, kubelet.healthy(MEM), [], units))


def wait_synced(ra: RunningAgent, api: ApiServerStandIn, uids: list[str]) -> None:
    book = ra.agent.assignments
    assert book is not None, "with API access the agent keeps the book of assignments"
    api.wait_for(lambda: all(u in book.pending for u in uids), timeout=WAIT_S, what="the pods in the book")


def node_state(api: ApiServerStandIn) -> Any:
    text = api.node(NODE)["metadata"].get("annotations", {}).get(ANNOTATION_KEY)
    return None if text is None else decode(text, node=NODE)


def test_the_assigned_gpu_is_used_marked_counted_and_published(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn
) -> None:
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    with RunningAgent(Agent(agent_config(sockdir, api), backend=backend)) as ra:
        kubelet.wait_for_resources([MEM])
        assert own_choice(ra, kubelet, 4) != {gpus[3].uuid}, "the node alone would pick another GPU"
        uid = put_pending(api, "p", 4, assigned=gpus[3].uuid, scheduled="2030-01-01T00:00:05Z")
        wait_synced(ra, api, [uid])
        api.wait_for(lambda: node_state(api) is not None, timeout=WAIT_S, what="the first node state")

        chosen = kubelet.preferred(MEM, kubelet.healthy(MEM), 4)
        assert len(chosen) == 4 and gpu_of(chosen) == {gpus[3].uuid}
        allocated_at = time.monotonic()
        resp = kubelet.allocate(MEM, chosen)
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == gpus[3].uuid

        api.wait_for(
            lambda: (
                api.pod("team-a", "p")["metadata"]["annotations"].get(ALLOCATED_ANNOTATION) == gpus[3].uuid
            ),
            timeout=WAIT_S,
            what="the carried-out annotation",
        )
        book = ra.agent.assignments
        assert book.outcomes == {"followed": 1, "no_assignment": 0, "not_possible": 0}
        assert uid not in book.pending and book.carried_out[uid] == [gpus[3].uuid]
        exposition = generate_latest(ra.agent.metrics.registry).decode()
        assert 'gpunode_assignments_total{outcome="followed"} 1.0' in exposition

        # The node's view reaches the cluster soon after Allocate, though pod-resources does not list it.
        def published() -> bool:
            state = node_state(api)
            return state is not None and state.gpus[3].memory_assigned_bytes == 4 * GIB

        api.wait_for(published, timeout=WAIT_S, what="the node state after Allocate")
        assert node_state(api).gpus[3].pods == ("team-a/p",)
        patches = [r for r in api.requests("PATCH", f"/api/v1/nodes/{NODE}$") if r.at >= allocated_at]
        delay = min(r.at for r in patches) - allocated_at
        print(f"republish delay after Allocate: {delay * 1000:.0f} ms")


def test_the_first_binding_among_equal_requests_goes_first(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn
) -> None:
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    with RunningAgent(Agent(agent_config(sockdir, api), backend=backend)) as ra:
        kubelet.wait_for_resources([MEM])
        # Bound in this order within one second: the API server's write order tells them apart, as it
        # does for the kubelet's watch; neither the PodScheduled time nor the name does.
        older = put_pending(api, "older", 2, assigned=gpus[3].uuid, scheduled="2030-01-01T00:00:01Z")
        newer = put_pending(api, "newer", 2, assigned=gpus[2].uuid, scheduled="2030-01-01T00:00:01Z")
        wait_synced(ra, api, [newer, older])

        first = kubelet.preferred(MEM, kubelet.healthy(MEM), 2)
        assert gpu_of(first) == {gpus[3].uuid}
        kubelet.allocate(MEM, first)
        rest = [u for u in kubelet.healthy(MEM) if u not in first]
        second = kubelet.preferred(MEM, rest, 2)
        assert gpu_of(second) == {gpus[2].uuid}
        kubelet.allocate(MEM, second)
        assert ra.agent.assignments.outcomes["followed"] == 2
        for name, gpu in (("older", gpus[3]), ("newer", gpus[2])):
            wait_marked(api, name, gpu.uuid)


def wait_marked(api: ApiServerStandIn, name: str, value: str) -> None:
    """Until pod team-a/<name> carries the carried-out annotation with `value`."""
    api.wait_for(
        lambda: api.pod("team-a", name)["metadata"]["annotations"].get(ALLOCATED_ANNOTATION) == value,
        timeout=WAIT_S,
        what=f"pod {name} marked {value}",
    )


def test_without_an_assignment_the_node_decides(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    backend = SimBackend.from_profile("t4")
    with RunningAgent(Agent(agent_config(sockdir, api), backend=backend)) as ra:
        kubelet.wait_for_resources([MEM])
        uid = put_pending(api, "plain", 3, assigned=None, scheduled="2030-01-01T00:00:01Z")
        book = ra.agent.assignments
        api.wait_for(book.synced.is_set, timeout=WAIT_S, what="the first list of pods")
        expected = own_choice(ra, kubelet, 3)
        with caplog.at_level(logging.INFO, logger="gpunode.node.assignments"):
            chosen = kubelet.preferred(MEM, kubelet.healthy(MEM), 3)
            assert gpu_of(chosen) == expected
            kubelet.allocate(MEM, chosen)  # not failed for lack of an annotation
        assert book.outcomes == {"followed": 0, "no_assignment": 1, "not_possible": 0}
        assert uid not in book.pending
        assert any("the node decided" in r.getMessage() for r in caplog.records)
        assert ALLOCATED_ANNOTATION not in api.pod("team-a", "plain")["metadata"]["annotations"]


def test_an_unhealthy_assigned_gpu_leaves_the_decision_to_the_node(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    with RunningAgent(Agent(agent_config(sockdir, api), backend=backend)) as ra:
        kubelet.wait_for_resources([MEM])
        uid = put_pending(api, "p", 4, assigned=gpus[3].uuid, scheduled="2030-01-01T00:00:01Z")
        wait_synced(ra, api, [uid])
        backend.inject_xid(gpus[3].uuid, 79)  # fallen off the bus: the GPU is unhealthy from now on
        kubelet.wait_for(
            lambda: any(u.startswith(gpus[3].uuid) for u in kubelet.unhealthy(MEM)),
            timeout=WAIT_S,
            what="GPU 3's units unhealthy",
        )
        with caplog.at_level(logging.INFO, logger="gpunode.node.assignments"):
            chosen = kubelet.preferred(MEM, kubelet.healthy(MEM), 4)
            assert len(chosen) == 4 and gpus[3].uuid not in gpu_of(chosen)
            kubelet.allocate(MEM, chosen)
        book = ra.agent.assignments
        assert book.outcomes == {"followed": 0, "no_assignment": 0, "not_possible": 1}
        lines = [r.getMessage() for r in caplog.records if "was not carried out" in r.getMessage()]
        assert len(lines) == 1 and f"GPU {gpus[3].uuid} is unhealthy" in lines[0]
        # Used up all the same: the pod is marked with what it got, and never matched again.
        api.wait_for(
            lambda: (
                api.pod("team-a", "p")["metadata"]["annotations"].get(ALLOCATED_ANNOTATION)
                == ",".join(gpu_of(chosen))
            ),
            timeout=WAIT_S,
            what="the pod marked with the node's choice",
        )
        assert uid not in book.pending


def test_a_carried_out_assignment_is_not_used_again_after_a_restart(
    sockdir: Path, kubelet: KubeletStandIn, api: ApiServerStandIn
) -> None:
    backend = SimBackend.from_profile("t4")
    gpus = backend.gpus()
    cfg = agent_config(sockdir, api)
    api.fail("PATCH", r"/pods/p$", 500, times=None)  # the pod can never be annotated: only the node's record
    with RunningAgent(Agent(cfg, backend=backend)) as ra:
        kubelet.wait_for_resources([MEM])
        uid = put_pending(api, "p", 4, assigned=gpus[3].uuid, scheduled="2030-01-01T00:00:01Z")
        wait_synced(ra, api, [uid])
        chosen = kubelet.preferred(MEM, kubelet.healthy(MEM), 4)
        assert gpu_of(chosen) == {gpus[3].uuid}
        kubelet.allocate(MEM, chosen)
    saved = json.loads((sockdir / "state" / "assignments.json").read_text())
    assert saved["pods"] == {uid: [gpus[3].uuid]}
    assert ALLOCATED_ANNOTATION not in api.pod("team-a", "p")["metadata"]["annotations"]

    with RunningAgent(Agent(cfg, backend=backend)) as ra:  # the pod is still Pending, still assigned
        kubelet.wait_for_resources([MEM])
        book = ra.agent.assignments
        api.wait_for(book.synced.is_set, timeout=WAIT_S, what="the first list of pods")
        assert uid not in book.pending and uid in book.carried_out
        rest = [u for u in kubelet.healthy(MEM) if u not in chosen]
        again = kubelet.preferred(MEM, rest, 4)
        assert own_choice_of(ra, rest, 4) == gpu_of(again)
        kubelet.allocate(MEM, again)
        assert book.outcomes == {"followed": 0, "no_assignment": 1, "not_possible": 0}


def own_choice_of(ra: RunningAgent, offered: list[str], units: int) -> set[str]:
    assert ra.agent.state is not None
    return gpu_of(preferred_allocation(ra.agent.state.snapshot(), MEM, offered, [], units))
