"""The preempt verb: kube-scheduler's own preemption gets no candidates for a pod a queue governs.

The bodies are ExtenderPreemptionArgs as kube-scheduler 1.20 writes them (Go's encoding/json of
k8s.io/kube-scheduler/extender/v1: untagged field names, a nil map or slice as null): with
nodeCacheCapable the victims by UID (NodeNameToMetaVictims), without it whole pods (NodeNameToVictims).
The attack: a tenant gives a pod the queue holds a high priority, so that kube-scheduler would evict
other tenants' pods for it; the extender answers no candidates, whatever the priority.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.contract.names import QUEUE_REASON_ANNOTATION
from tests.cluster.extender.test_queue_marks import NODES, REASON, admit, queued
from tests.cluster.test_extender import Client, start, v1_pod

VICTIMS = {  # node -> (victim UIDs, PDB violations) kube-scheduler's dry run found
    "n1": (["uid-low-1", "uid-low-2"], 0),
    "n2": (["uid-low-3"], 1),
    "n3": ([], 0),  # fits once nominated pods are accounted for: no victim at all
}


def victim_pod(uid: str, node: str) -> dict[str, Any]:
    """A running lower-priority pod of another tenant, as kube-scheduler's cache holds it."""
    pod = v1_pod(f"low-{uid}", uid=uid)
    pod["metadata"]["namespace"] = "team-b"
    pod["spec"]["nodeName"] = node
    pod["spec"]["priority"] = 0
    pod["status"] = {"phase": "Running", "qosClass": "Burstable"}
    return pod


def meta_args(pod: dict[str, Any]) -> dict[str, Any]:
    """ExtenderPreemptionArgs with nodeCacheCapable: victims by UID; the other map is nil (null)."""
    return {
        "Pod": pod,
        "NodeNameToVictims": None,
        "NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb}
            for node, (uids, pdb) in VICTIMS.items()
        },
    }


def full_args(pod: dict[str, Any]) -> dict[str, Any]:
    """ExtenderPreemptionArgs without nodeCacheCapable: whole victim pods (an empty list is Go's null)."""
    return {
        "Pod": pod,
        "NodeNameToVictims": {
            node: {"Pods": [victim_pod(u, node) for u in uids] or None, "NumPDBViolations": pdb}
            for node, (uids, pdb) in VICTIMS.items()
        },
        "NodeNameToMetaVictims": None,
    }


SENT = {
    node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb}
    for node, (uids, pdb) in VICTIMS.items()
}
NONE: dict[str, Any] = {"NodeNameToMetaVictims": {}}
FORMS = [pytest.param(meta_args, id="meta-victims"), pytest.param(full_args, id="full-victims")]


def high_priority(pod: dict[str, Any]) -> dict[str, Any]:
    """The tenant's move: the pod in a PriorityClass above everyone else's."""
    pod["spec"]["priorityClassName"] = "jump-the-queue"
    pod["spec"]["priority"] = 1_000_000_000
    pod["spec"]["preemptionPolicy"] = "PreemptLowerPriority"
    return pod


@pytest.fixture
def served() -> Iterator[tuple[Extender, Client]]:
    extender = Extender(config=ExtenderConfig(policy="bestfit"), queue_namespaces=lambda: {"ml": "team-c"})
    extender.refresh_nodes(NODES["items"])
    server, client = start(extender)
    yield extender, client
    server.stop()


def preempt(client: Client, body: object) -> Any:
    status, answer = client.post("preempt", body)
    assert status == 200, answer
    return answer


# ----- pods a queue governs: no candidates ------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_a_held_queued_pod_with_a_high_priority_gets_no_candidates(
    served: tuple[Extender, Client], form: Any
) -> None:
    _, client = served
    pod = high_priority(queued("jumper", "uid-jumper", **{QUEUE_REASON_ANNOTATION: REASON}))
    assert preempt(client, form(pod)) == NONE
    # held by its namespace's queue rather than a label: the same
    by_namespace = high_priority(queued("jumper-2", "uid-jumper-2", queue=None))
    by_namespace["metadata"]["namespace"] = "ml"
    assert preempt(client, form(by_namespace)) == NONE


@pytest.mark.parametrize("form", FORMS)
def test_an_admitted_queued_pod_gets_no_candidates(served: tuple[Extender, Client], form: Any) -> None:
    _, client = served
    pod = high_priority(admit(queued("admitted", "uid-admitted"), "n1", ("GPU-n1-0",)))
    assert preempt(client, form(pod)) == NONE


def test_a_forged_admission_gets_no_candidates_either(served: tuple[Extender, Client]) -> None:
    _, client = served
    forged = high_priority(admit(queued("forged", "uid-forged"), "n1", ("GPU-n1-0",)))
    forged["metadata"]["uid"] = "uid-after-create"  # the mark names another UID: not admitted, still held
    assert preempt(client, meta_args(forged)) == NONE


def test_a_gpu_pod_with_an_invalid_request_gets_no_candidates(served: tuple[Extender, Client]) -> None:
    _, client = served
    pod = high_priority(v1_pod("broken", uid="uid-broken", limits={"nvidia.com/gpu": "1e999"}))
    assert preempt(client, meta_args(pod)) == NONE  # it fails every node whatever is evicted


# ----- any other pod: kube-scheduler's own candidates -------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_a_gpu_pod_outside_any_queue_keeps_every_candidate(
    served: tuple[Extender, Client], form: Any
) -> None:
    _, client = served
    pod = high_priority(v1_pod("plain", uid="uid-plain", limits={"nvidia.com/gpu": "2"}))
    answer = preempt(client, form(pod))
    assert answer == {"NodeNameToMetaVictims": SENT}


def test_a_pod_without_gpus_keeps_every_candidate_even_in_a_queue(served: tuple[Extender, Client]) -> None:
    _, client = served
    pod = high_priority(queued("cpu-only", "uid-cpu", queue="team-a"))
    pod["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "2"}, "requests": {"cpu": "2"}}
    assert preempt(client, meta_args(pod)) == {"NodeNameToMetaVictims": SENT}


def test_keys_in_any_case_are_read_as_go_reads_them(served: tuple[Extender, Client]) -> None:
    _, client = served
    pod = v1_pod("plain", uid="uid-plain")
    body = {
        "pod": pod,
        "nodenametometavictims": {"n1": {"pods": [{"uid": "uid-low-1"}], "numPDBViolations": 2}},
    }
    assert preempt(client, body) == {
        "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "uid-low-1"}], "NumPDBViolations": 2}}
    }
    queued_body = {**body, "pod": queued("held", "uid-held")}
    assert preempt(client, queued_body) == NONE


# ----- malformed bodies: 400 with one line -----------------------------------------------------------------

GOOD_POD = v1_pod("plain", uid="uid-plain")
HELD_POD = queued("held", "uid-held")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(b"", "malformed JSON", id="empty"),
        pytest.param(b"[1, 2]", "must be a JSON object", id="a-list"),
        pytest.param(json.dumps({"NodeNameToMetaVictims": {}}).encode(), "Pod is missing", id="no-pod"),
        pytest.param(json.dumps({"Pod": GOOD_POD}).encode(), "needs NodeNameToMetaVictims", id="no-victims"),
        pytest.param(
            json.dumps({"Pod": HELD_POD, "NodeNameToMetaVictims": None, "NodeNameToVictims": None}).encode(),
            "needs NodeNameToMetaVictims",
            id="both-null-for-a-held-pod",
        ),
        pytest.param(
            json.dumps({"Pod": GOOD_POD, "NodeNameToMetaVictims": ["n1"]}).encode(),
            "must be an object of node names",
            id="victims-a-list",
        ),
        pytest.param(
            json.dumps({"Pod": GOOD_POD, "NodeNameToMetaVictims": {"n1": 5}}).encode(),
            "must be an object with Pods",
            id="node-entry-a-number",
        ),
        pytest.param(
            json.dumps({"Pod": GOOD_POD, "NodeNameToMetaVictims": {"n1": {"Pods": {"UID": "u"}}}}).encode(),
            "Pods must be a list",
            id="pods-not-a-list",
        ),
        pytest.param(
            json.dumps({"Pod": HELD_POD, "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": ""}]}}}).encode(),
            "without a UID",
            id="meta-pod-without-uid",
        ),
        pytest.param(
            json.dumps({"Pod": GOOD_POD, "NodeNameToVictims": {"n1": {"Pods": [{"metadata": {}}]}}}).encode(),
            "without metadata.uid",
            id="victim-without-uid",
        ),
        pytest.param(
            json.dumps(
                {"Pod": GOOD_POD, "NodeNameToMetaVictims": {"n1": {"Pods": [], "NumPDBViolations": -1}}}
            ).encode(),
            "NumPDBViolations must be a count",
            id="negative-pdb-count",
        ),
        pytest.param(
            json.dumps({"Pod": {"metadata": {}}, "NodeNameToMetaVictims": {}}).encode(),
            "metadata.name",
            id="pod-without-name",
        ),
    ],
)
def test_malformed_preemption_args_get_400_with_one_line(
    served: tuple[Extender, Client], raw: bytes, message: str
) -> None:
    _, client = served
    status, body = client.call("POST", "/preempt", raw=raw)
    assert status == 400 and message in body["Error"], body
    assert "\n" not in body["Error"]
    assert client.call("GET", "/healthz")[0] == 200  # still serving


def test_preempt_takes_post_and_a_standby_refuses_it() -> None:
    class Standby:
        def refusal(self) -> str | None:
            return "not the leader"

        def status(self) -> dict[str, str]:
            return {"role": "standby"}

    server = ExtenderServer(Extender(), port=0, gate=Standby())
    server.start()
    try:
        client = Client(server.port)
        assert client.call("GET", "/preempt")[0] == 405
        status, body = client.post("preempt", meta_args(GOOD_POD))
        assert status == 503 and body["Error"] == "not the leader"
    finally:
        server.stop()
