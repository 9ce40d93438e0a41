"""Pods held by the scheduling gate gpunode.io/admission, on the real control plane (docs/admission.md).

The cluster of tests.e2e.queue (the extender with its hold, kube-scheduler 1.36, two simulated nodes of
four GPUs), with the chart rendered with queue.gate.enabled: two `gpunode queue` replicas started with
the Deployment's arguments serve the webhook (gate-1 with a good certificate, gate-2 with an expired
one), and the chart's MutatingWebhookConfiguration, ValidatingAdmissionPolicy and binding are applied
to the real API server, which runs them; the webhook's Service is replaced by a URL (nothing here
routes Service addresses). A tenant holds the pod rights of the `edit` role in the pods' namespace.
Every attack is performed through the API server, as the tenant.
"""

from __future__ import annotations

import base64
import copy
import datetime
import json
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from gpunode.cluster.queuectl.jobs import admitted_text
from gpunode.cluster.queueing.model import PodPlacement
from gpunode.cluster.queuemark import load_mark_key
from gpunode.contract.names import (
    ADMISSION_GATE,
    ADMISSION_WEBHOOK_PATH,
    ASSIGNMENT_ANNOTATION,
    GPU_RESOURCE,
    NODE_STATE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_REASON_ANNOTATION,
)
from gpunode.contract.nodestate import decode
from tests.e2e import chart
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import ControlPlane
from tests.e2e.objects import get_pod, pod_body
from tests.e2e.pki import CertFiles
from tests.e2e.procs import Proc
from tests.e2e.queue import (
    CHART_VALUES,
    LEASE,
    NAMESPACE,
    NODES,
    WAIT_S,
    QueueCluster,
    build_queue_cluster,
    delete_all_pods,
    event_text,
    events,
    queued_pod,
    stop_queue_cluster,
    submit,
)
from tests.ports import free_port

ADMISSION = "/apis/admissionregistration.k8s.io/v1"
HOOKS = f"{ADMISSION}/mutatingwebhookconfigurations"
POLICIES = f"{ADMISSION}/validatingadmissionpolicies"
BINDINGS = f"{ADMISSION}/validatingadmissionpolicybindings"
HOOK_NAME = f"{LEASE}-webhook"
POLICY_NAME = f"{LEASE}-admission-gate"
PRIORITY_CLASS = "e2e-gate-high"
TENANT = "e2e-gate-tenant"
TENANT_ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "Role",
    "metadata": {"name": TENANT, "namespace": NAMESPACE},
    "rules": [  # the pod rights of the `edit` ClusterRole
        {
            "apiGroups": [""],
            "resources": ["pods"],
            "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
        }
    ],
}
TENANT_BINDING = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "RoleBinding",
    "metadata": {"name": TENANT, "namespace": NAMESPACE},
    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": TENANT},
    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": E2E_USERS["nobody"].name}],
}
GATE_REFUSED = "only the queue controller removes the scheduling gate gpunode.io/admission"
SELECTOR_REFUSED = "is the queue controller's to set"


class Gates:
    """The queue cluster with the gate's webhook, policy and tenant (see the module docstring)."""

    def __init__(self, qc: QueueCluster, docs: list[dict[str, Any]]) -> None:
        self.qc, self.docs = qc, docs
        self.webhook_ports: dict[str, int] = {}
        self.certs: dict[str, CertFiles] = {}
        self.probes = 0

    def doc(self, kind: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(
            next(d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name)
        )

    def start_controller(self, identity: str) -> Proc:
        """One `gpunode queue` with the gate-enabled Deployment's arguments, its webhook on 127.0.0.1."""
        qc = self.qc
        dep = self.doc("Deployment", LEASE)
        args = [str(a) for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]]
        port = qc.metrics_ports.get(identity) or free_port()
        hook_port = self.webhook_ports.get(identity) or free_port()
        cert = self.certs[identity]
        for flag, value in (
            ("--config", str(qc.config)),
            ("--metrics-listen", f"127.0.0.1:{port}"),
            ("--admission-key-file", str(qc.key_file)),
            ("--webhook-listen", f"127.0.0.1:{hook_port}"),
            ("--webhook-tls-cert-file", str(cert.cert)),
            ("--webhook-tls-key-file", str(cert.key)),
        ):
            args[args.index(flag) + 1] = value
        args += [
            "--leader-elect-identity", identity,
            "--kube-api", qc.cp.server,
            "--kube-token-file", str(qc.cp.token_file("queue")),
            "--kube-ca-file", str(qc.cp.ca_file),
        ]  # fmt: skip
        proc = Proc(f"gpunode-queue-{identity}", [sys.executable, "-m", "gpunode.cli", *args], qc.cp.logs)
        proc.start()
        qc.cp.procs.append(proc)
        qc.controllers[identity] = proc
        qc.metrics_ports[identity] = port
        self.webhook_ports[identity] = hook_port
        proc.wait_until(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200,
            timeout_s=WAIT_S,
            what="its /healthz",
        )
        proc.wait_until(
            lambda: socket.create_connection(("127.0.0.1", hook_port), timeout=5).close() is None,
            timeout_s=WAIT_S,
            what="its webhook port",
        )
        return proc

    def point_webhook(self, port: int) -> None:
        """Apply the chart's MutatingWebhookConfiguration, calling https://127.0.0.1:<port> instead of the
        Service (the caBundle: the control plane's CA, which signed both webhook certificates)."""
        hook = self.doc("MutatingWebhookConfiguration", HOOK_NAME)
        ca = base64.b64encode(self.qc.cp.ca_file.read_bytes()).decode()
        for entry in hook["webhooks"]:
            assert entry["clientConfig"]["service"]["path"] == ADMISSION_WEBHOOK_PATH
            entry["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{ADMISSION_WEBHOOK_PATH}",
                "caBundle": ca,
            }
        self.qc.cp.api().apply(HOOKS, hook)

    def probe(self, *, keep: bool = False) -> dict[str, Any]:
        """Create a governed pod (it asks for more GPUs than a node has: never admitted) and return it as
        created; deleted at once unless `keep`."""
        self.probes += 1
        name = f"probe-{self.probes}"
        admin = self.qc.cp.api()
        created: dict[str, Any] = admin.create(
            f"/api/v1/namespaces/{NAMESPACE}/pods", queued_pod(name, "team-a", 8)
        )
        if not keep:
            admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}?gracePeriodSeconds=0")
        return created

    def webhook_in_force(self) -> None:
        eventually(lambda: gate_of(self.probe()), timeout_s=WAIT_S, what="the webhook gating a new pod")

    def policy_in_force(self, tenant: Api) -> None:
        pod = self.probe(keep=True)
        assert gate_of(pod), pod["spec"]
        eventually(
            lambda: (
                GATE_REFUSED
                in refusal(tenant, pod["metadata"]["name"], {"schedulingGates": None}, dry_run=True)
            ),
            timeout_s=WAIT_S,
            what="the policy refusing the tenant's removal of the gate",
        )

    def policy_absent(self) -> None:
        admin = self.qc.cp.api()
        admin.delete(f"{BINDINGS}/{POLICY_NAME}")


def gate_of(pod: dict[str, Any]) -> bool:
    return any(g.get("name") == ADMISSION_GATE for g in pod["spec"].get("schedulingGates") or ())


def refusal(api: Api, name: str, spec: dict[str, Any], *, dry_run: bool = False) -> str:
    """The API server's answer to a spec patch: the refusal's message, or "" when it was taken (with
    `dry_run`, admission runs and nothing is changed)."""
    query = "?dryRun=All" if dry_run else ""
    try:
        api.patch(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}{query}", {"spec": spec})
    except ApiError as exc:
        return f"{exc.status} {exc.body}"
    return ""


def mark_of(pod: dict[str, Any]) -> dict[str, Any] | None:
    text = pod["metadata"].get("annotations", {}).get(QUEUE_ADMITTED_ANNOTATION)
    return json.loads(text) if text else None


def bound(api: Api, name: str) -> dict[str, Any] | None:
    pod = get_pod(api, NAMESPACE, name)
    if pod["spec"].get("nodeName") and pod["metadata"].get("annotations", {}).get(ASSIGNMENT_ANNOTATION):
        return pod
    return None


def pinned_nodes(pod: dict[str, Any]) -> list[str]:
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    return [
        v
        for t in terms
        for f in t.get("matchFields") or ()
        if f["key"] == "metadata.name"
        for v in f["values"]
    ]


def check_released_as_planned(pod: dict[str, Any]) -> dict[str, Any]:
    """Bound to the node of its mark, on exactly its GPUs, pinned there, the gate gone; returns the mark."""
    mark = mark_of(pod)
    assert mark is not None and mark["uid"] == pod["metadata"]["uid"], pod["metadata"]
    assert not gate_of(pod), pod["spec"]
    assert pinned_nodes(pod) == [mark["node"]] == [pod["spec"]["nodeName"]], pod["spec"]
    assigned = [g for g in pod["metadata"]["annotations"][ASSIGNMENT_ANNOTATION].split(",") if g]
    assert sorted(assigned) == sorted(mark["gpus"]), (assigned, mark)
    return mark


def scheduling_gated(api: Api, name: str) -> bool:
    """kube-scheduler saw the pod and left it: PodScheduled False, reason SchedulingGated."""
    conds = get_pod(api, NAMESPACE, name).get("status", {}).get("conditions") or []
    return any(c.get("type") == "PodScheduled" and c.get("reason") == "SchedulingGated" for c in conds)


def held_by_extender(api: Api, name: str, text: str) -> dict[str, Any] | None:
    """kube-scheduler's FailedScheduling event about the pod carrying the queue's reason `text`."""
    return next((e for e in events(api, name, "FailedScheduling") if text in event_text(e)), None)


@pytest.fixture(scope="module")
def gates(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gates]:
    tmp = tmp_path_factory.mktemp("queue-gates")
    qc = build_queue_cluster(control_plane, tmp)
    admin = control_plane.api()
    try:
        values = copy.deepcopy(CHART_VALUES)
        values["queue"]["gate"] = {"enabled": True}
        (tmp / "gate").mkdir()
        g = Gates(qc, chart.render(values, tmp / "gate"))
        now = datetime.datetime.now(datetime.UTC)
        host = f"{HOOK_NAME}.{chart.NAMESPACE}.svc"
        g.certs["gate-1"] = control_plane.issue("gate-1", common_name=host, server=True, hosts=("127.0.0.1",))
        g.certs["gate-2"] = control_plane.issue(
            "gate-2",
            common_name=host,
            server=True,
            hosts=("127.0.0.1",),
            valid=(now - datetime.timedelta(days=2), now - datetime.timedelta(days=1)),
        )
        for identity in ("gate-1", "gate-2"):
            g.start_controller(identity)
        admin.apply(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles", TENANT_ROLE)
        admin.apply(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/rolebindings", TENANT_BINDING)
        admin.apply(POLICIES, g.doc("ValidatingAdmissionPolicy", POLICY_NAME))
        admin.apply(BINDINGS, g.doc("ValidatingAdmissionPolicyBinding", POLICY_NAME))
        g.point_webhook(g.webhook_ports["gate-1"])
        g.webhook_in_force()
        g.policy_in_force(control_plane.api("nobody"))
        delete_all_pods(qc)
        yield g
    finally:
        for path in (f"{HOOKS}/{HOOK_NAME}", f"{BINDINGS}/{POLICY_NAME}", f"{POLICIES}/{POLICY_NAME}"):
            admin.delete(path)
        admin.delete(f"/apis/scheduling.k8s.io/v1/priorityclasses/{PRIORITY_CLASS}")
        admin.delete(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/rolebindings/{TENANT}")
        admin.delete(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles/{TENANT}")
        stop_queue_cluster(qc)


@pytest.fixture(autouse=True)
def _clean(gates: Gates) -> Iterator[None]:
    yield
    delete_all_pods(gates.qc)


def test_a_gated_gang_of_four_is_admitted_at_once_and_bound_to_its_plan(gates: Gates) -> None:
    admin = gates.qc.cp.api()
    members = [f"gang-{i}" for i in range(4)]
    for name in members:  # created without the gate: the webhook adds it
        body = queued_pod(name, "team-a", 1, gang="train", size=4)
        assert "schedulingGates" not in body["spec"]
        created = admin.create(f"/api/v1/namespaces/{NAMESPACE}/pods", body)
        assert gate_of(created), created["spec"]
    pods = [eventually(partial(bound, admin, n), timeout_s=WAIT_S, what=f"{n} bound") for n in members]
    marks = [check_released_as_planned(p) for p in pods]
    assert {m["job"] for m in marks} == {f"{NAMESPACE}/train"} and len({m["at"] for m in marks}) == 1, marks
    gpus = [g for m in marks for g in m["gpus"]]
    assert len(gpus) == len(set(gpus)) == 4, gpus
    for name in members:
        assert len(events(admin, name, "QueueAdmitted")) == 1
        # gated until admitted, then pinned to a node with room: kube-scheduler never retried it
        assert events(admin, name, "FailedScheduling") == [], events(admin, name, "FailedScheduling")


def test_over_quota_stays_gated_with_the_reason_and_its_owner_cannot_release_or_steer_it(
    gates: Gates,
) -> None:
    admin, tenant = gates.qc.cp.api(), gates.qc.cp.api("nobody")
    submit(tenant, queued_pod("c-1", "team-c", 1))
    check_released_as_planned(eventually(partial(bound, admin, "c-1"), timeout_s=WAIT_S, what="c-1 bound"))
    submit(tenant, queued_pod("c-2", "team-c", 1))  # team-c may hold 1 GPU at most, and holds it

    def waiting_with_reason() -> str | None:
        pod = get_pod(admin, NAMESPACE, "c-2")
        reason = pod["metadata"].get("annotations", {}).get(QUEUE_REASON_ANNOTATION)
        return reason if reason and gate_of(pod) else None

    reason = eventually(waiting_with_reason, timeout_s=WAIT_S, what="c-2 gated with the queue's reason")
    assert reason.startswith("queued in team-c, position 1: team-c is over its quota"), reason
    assert any(reason == event_text(e) for e in events(admin, "c-2", "Queued")), "the controller's Event"
    eventually(partial(scheduling_gated, admin, "c-2"), timeout_s=WAIT_S, what="kube-scheduler leaving c-2")

    # The owner (pod rights of `edit`) removes the gate, or steers the pod: the policy refuses each.
    assert GATE_REFUSED in refusal(tenant, "c-2", {"schedulingGates": None})
    assert GATE_REFUSED in refusal(tenant, "c-2", {"schedulingGates": []})
    assert SELECTOR_REFUSED in refusal(tenant, "c-2", {"nodeSelector": {"kubernetes.io/hostname": NODES[1]}})
    steer = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODES[1]]}]}
                ]
            }
        }
    }
    assert SELECTOR_REFUSED in refusal(tenant, "c-2", {"affinity": steer})
    pod = get_pod(admin, NAMESPACE, "c-2")
    assert gate_of(pod) and not pod["spec"].get("nodeSelector") and not pod["spec"].get("affinity")

    # Without the policy the owner can remove the gate: the extender's hold is the second line.
    gates.policy_absent()
    try:
        eventually(
            lambda: refusal(tenant, "c-2", {"schedulingGates": None}, dry_run=True) == "",
            timeout_s=WAIT_S,
            what="the removal taken with the policy's binding gone",
        )
        assert refusal(tenant, "c-2", {"schedulingGates": None}) == ""
        event = eventually(
            partial(held_by_extender, admin, "c-2", "team-c is over its quota"),
            timeout_s=WAIT_S,
            what="the extender holding the ungated pod with the queue's reason",
        )
        assert (
            event_text(event)
            == get_pod(admin, NAMESPACE, "c-2")["metadata"]["annotations"][QUEUE_REASON_ANNOTATION]
        )
        pod = get_pod(admin, NAMESPACE, "c-2")
        assert not pod["spec"].get("nodeName") and mark_of(pod) is None
    finally:
        admin.apply(BINDINGS, gates.doc("ValidatingAdmissionPolicyBinding", POLICY_NAME))
        gates.policy_in_force(tenant)


def test_webhook_down_or_expired_governed_pods_are_held_by_the_extender_others_schedule(gates: Gates) -> None:
    admin = gates.qc.cp.api()
    submit(admin, queued_pod("c-1", "team-c", 1))
    eventually(partial(bound, admin, "c-1"), timeout_s=WAIT_S, what="c-1 bound")
    nothing = free_port()  # the webhook's Service with no endpoint
    try:
        for case, port, error in (
            ("down", nothing, "connection refused"),
            ("expired", gates.webhook_ports["gate-2"], "certificate has expired"),
        ):
            gates.point_webhook(port)
            # a governed pod is created without the gate (failurePolicy Ignore) once the change is in force
            eventually(
                lambda: not gate_of(gates.probe()), timeout_s=WAIT_S, what=f"the webhook {case} ignored"
            )
            log = (gates.qc.cp.logs / "kube-apiserver.log").read_text(errors="replace")
            assert error in log, f"the API server's log names no {error!r}"
            held = admin.create(f"/api/v1/namespaces/{NAMESPACE}/pods", queued_pod(f"{case}-c", "team-c", 1))
            assert not gate_of(held), held["spec"]
            event = eventually(
                partial(held_by_extender, admin, f"{case}-c", "team-c is over its quota"),
                timeout_s=WAIT_S,
                what=f"{case}-c held by the extender with the queue's reason",
            )
            assert "queued in team-c" in event_text(event)
            # a governed pod within its quota is admitted by its mark alone; other pods never call the webhook
            submit(admin, queued_pod(f"{case}-a", "team-a", 1))
            plain = pod_body(f"{case}-plain", limits={GPU_RESOURCE: "1"})
            submit(admin, plain)
            cpu = pod_body(f"{case}-cpu", limits={"cpu": "100m"})
            submit(admin, cpu)
            for name in (f"{case}-a", f"{case}-plain"):
                eventually(partial(bound, admin, name), timeout_s=WAIT_S, what=f"{name} bound")
            eventually(
                partial(lambda name: get_pod(admin, NAMESPACE, name)["spec"].get("nodeName"), f"{case}-cpu"),
                timeout_s=WAIT_S,
                what=f"{case}-cpu scheduled",
            )
            assert mark_of(get_pod(admin, NAMESPACE, f"{case}-plain")) is None
            for name in (f"{case}-c", f"{case}-a", f"{case}-plain", f"{case}-cpu", "c-1"):
                admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}?gracePeriodSeconds=0")
            delete_all_pods(gates.qc)
            submit(admin, queued_pod(f"c-1-{case}", "team-c", 1))
            eventually(partial(bound, admin, f"c-1-{case}"), timeout_s=WAIT_S, what="team-c's one GPU taken")
    finally:
        gates.point_webhook(gates.webhook_ports["gate-1"])
        gates.webhook_in_force()


def test_a_gated_pod_of_a_high_priority_class_preempts_nobody(gates: Gates) -> None:
    admin, tenant = gates.qc.cp.api(), gates.qc.cp.api("nobody")
    admin.apply(
        "/apis/scheduling.k8s.io/v1/priorityclasses",
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": PRIORITY_CLASS},
            "value": 1_000_000,
        },
    )
    submit(admin, queued_pod("a-4", "team-a", 4), queued_pod("b-4", "team-b", 4))
    before = {
        n: eventually(partial(bound, admin, n), timeout_s=WAIT_S, what=f"{n} bound") for n in ("a-4", "b-4")
    }
    evictions = len(
        [e for e in gates.qc.cp.audit_events() if e.get("objectRef", {}).get("subresource") == "eviction"]
    )
    body = queued_pod("high", "team-c", 1)
    body["spec"]["priorityClassName"] = PRIORITY_CLASS  # no ResourceQuota guards the class here
    high = tenant.create(f"/api/v1/namespaces/{NAMESPACE}/pods", body)
    assert gate_of(high) and high["spec"]["priority"] == 1_000_000, high["spec"]
    eventually(lambda: events(admin, "high", "Queued"), timeout_s=WAIT_S, what="the controller queueing it")
    eventually(partial(scheduling_gated, admin, "high"), timeout_s=WAIT_S, what="kube-scheduler leaving it")
    for name, was in before.items():
        now = get_pod(admin, NAMESPACE, name)
        assert now["metadata"]["uid"] == was["metadata"]["uid"] and not now["metadata"].get(
            "deletionTimestamp"
        )
    pod = get_pod(admin, NAMESPACE, "high")
    assert not pod.get("status", {}).get("nominatedNodeName") and not pod["spec"].get("nodeName"), pod[
        "status"
    ]
    after = [e for e in gates.qc.cp.audit_events() if e.get("objectRef", {}).get("subresource") == "eviction"]
    assert len(after) == evictions, after[evictions:]


def _published_gpus(api: Api, node: str) -> list[str]:
    text = api.get(f"/api/v1/nodes/{node}")["metadata"]["annotations"][NODE_STATE_ANNOTATION]
    return [g.uuid for g in decode(text, node=node).gpus]


def test_a_new_leader_finishes_a_marked_gang_and_undoes_a_part_marked_one(gates: Gates) -> None:
    """Both controllers SIGKILLed; the state a leader killed between its writes leaves (gang `whole`: every
    member marked, none released; gang `part`: two of four marked) is written with the admission key;
    a controller started then releases `whole` where marked and admits `part` whole, afresh."""
    qc = gates.qc
    admin = qc.cp.api()
    for identity in ("gate-1", "gate-2"):
        popen = qc.controllers[identity].popen
        assert popen is not None
        os.killpg(popen.pid, signal.SIGKILL)
        popen.wait(30)
    key = load_mark_key(qc.key_file)
    pods: dict[str, dict[str, Any]] = {}
    for gang, queue in (("whole", "team-a"), ("part", "team-b")):
        for i in range(4):
            body = queued_pod(f"{gang}-{i}", queue, 1, gang=gang, size=4)
            body["spec"]["schedulingGates"] = [{"name": ADMISSION_GATE}]  # written by the user (webhook down)
            pods[f"{gang}-{i}"] = admin.create(f"/api/v1/namespaces/{NAMESPACE}/pods", body)
    at = datetime.datetime.now(datetime.UTC).timestamp()
    planted: dict[str, dict[str, Any]] = {}
    for gang, node, count in (("whole", NODES[0], 4), ("part", NODES[1], 2)):
        gpus = _published_gpus(admin, node)
        for i in range(count):
            name = f"{gang}-{i}"
            text = admitted_text(
                f"{NAMESPACE}/{gang}",
                PodPlacement(node, (gpus[i],)),
                at,
                pods[name]["metadata"]["uid"],
                key=key,
            )
            admin.patch(
                f"/api/v1/namespaces/{NAMESPACE}/pods/{name}",
                {"metadata": {"annotations": {QUEUE_ADMITTED_ANNOTATION: text}}},
            )
            planted[name] = json.loads(text)
    for name in pods:
        assert gate_of(get_pod(admin, NAMESPACE, name))
    gates.start_controller("gate-1")
    whole = [
        eventually(partial(bound, admin, f"whole-{i}"), timeout_s=WAIT_S, what="whole bound")
        for i in range(4)
    ]
    for pod in whole:
        mark = check_released_as_planned(pod)
        assert mark == planted[pod["metadata"]["name"]], (mark, planted)  # finished, not admitted again
    part = [
        eventually(partial(bound, admin, f"part-{i}"), timeout_s=WAIT_S, what="part bound") for i in range(4)
    ]
    marks = [check_released_as_planned(p) for p in part]
    assert len({m["at"] for m in marks}) == 1 and marks[0]["at"] != planted["part-0"]["at"], marks
    for i in range(2):  # the planted marks were removed and the gang admitted whole, afresh
        assert marks[i]["gen"] > planted[f"part-{i}"]["gen"]
    gates.start_controller("gate-2")


BLOCK = "e2e-block-release"
BLOCK_MESSAGE = "e2e: releases are held back"


def hold_back_releases(admin: Api, name: str) -> None:
    """Apply a ValidatingAdmissionPolicy (and its binding) named `name` that refuses every removal of the
    admission gate, the controller's too: the window between marking and releasing, held open."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["UPDATE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "matchConditions": [
                {
                    "name": "gated",
                    "expression": "has(oldObject.spec.schedulingGates) && "
                    f"oldObject.spec.schedulingGates.exists(g, g.name == '{ADMISSION_GATE}')",
                }
            ],
            "validations": [
                {
                    "expression": "has(object.spec.schedulingGates) && "
                    f"object.spec.schedulingGates.exists(g, g.name == '{ADMISSION_GATE}')",
                    "message": BLOCK_MESSAGE,
                }
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }
    admin.apply(POLICIES, policy)
    admin.apply(BINDINGS, binding)


def test_a_leader_killed_after_marking_a_gated_gang_and_before_releasing_it_is_finished_by_the_next(
    gates: Gates,
) -> None:
    """The window between the marks and the releases, held open: a policy of the test's own refuses every
    removal of the gate (the controller's too), so the leader marks the gang and its releases are refused;
    both controllers are then SIGKILLed, the policy deleted, and a controller started: it releases the gang
    where the killed leader marked it, without admitting it again."""
    qc = gates.qc
    admin = qc.cp.api()
    hold_back_releases(admin, BLOCK)
    try:
        probe = gates.probe(keep=True)
        controller = qc.cp.api("queue")  # the chart's policy lets it release: the test's refuses it
        eventually(
            lambda: (
                BLOCK_MESSAGE
                in refusal(controller, probe["metadata"]["name"], {"schedulingGates": None}, dry_run=True)
            ),
            timeout_s=WAIT_S,
            what="the test's policy refusing releases",
        )
        admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{probe['metadata']['name']}?gracePeriodSeconds=0")
        members = [f"k-{i}" for i in range(4)]
        submit(admin, *(queued_pod(n, "team-a", 1, gang="k", size=4) for n in members))

        def marked_and_gated() -> list[dict[str, Any]] | None:
            pods = [get_pod(admin, NAMESPACE, n) for n in members]
            return pods if all(mark_of(p) and gate_of(p) for p in pods) else None

        marked = eventually(marked_and_gated, timeout_s=WAIT_S, what="the gang marked, its releases refused")
        leader = qc.leader()
        log = qc.controllers[leader].log
        eventually(
            lambda: BLOCK_MESSAGE in log.read_text(errors="replace"),
            timeout_s=WAIT_S,
            what="the leader's release refused",
        )
        for identity in ("gate-1", "gate-2"):
            popen = qc.controllers[identity].popen
            assert popen is not None
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(30)
    finally:
        admin.delete(f"{BINDINGS}/{BLOCK}")
        admin.delete(f"{POLICIES}/{BLOCK}")
    planted = {p["metadata"]["name"]: mark_of(p) for p in marked}
    for name in members:  # nothing moved while no controller ran
        pod = get_pod(admin, NAMESPACE, name)
        assert gate_of(pod) and mark_of(pod) == planted[name] and not pod["spec"].get("nodeName")
    gates.start_controller("gate-1")
    gates.start_controller("gate-2")
    bound_pods = [eventually(partial(bound, admin, n), timeout_s=WAIT_S, what=f"{n} bound") for n in members]
    for pod in bound_pods:
        assert check_released_as_planned(pod) == planted[pod["metadata"]["name"]]
        assert len(events(admin, pod["metadata"]["name"], "QueueAdmitted")) == 1  # not admitted again
