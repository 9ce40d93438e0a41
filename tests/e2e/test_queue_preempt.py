"""A tenant cannot jump the queue with a PriorityClass: kube-scheduler's own preemption never acts for it.

The attack, on the real control plane of tests.e2e.queue (kube-scheduler 1.36 with the extender's entry
of gpunode/examples/kube-scheduler-config.yaml, preempt verb included, the extender with its default
--queue-hold error, a queue controller, two simulated nodes of four GPUs): other workloads hold GPUs at
the default priority; the tenant creates a pod in team-c (which may borrow one GPU at most) asking for two
GPUs, in a PriorityClass far above everyone's. The queue never admits it.

- Two GPUs free on one node: kube-scheduler's own filters pass there and it asks the extender, which
  answers the held pod's filter with an Error (the queue's reason). That is a scheduling error to
  kube-scheduler, not a fit failure: no preemption runs, no node is nominated (which would keep the free
  GPUs from lower-priority pods), and the pod's event and PodScheduled condition (reason SchedulerError)
  show the queue's reason as it is. kube-scheduler tries the pod again after its backoff, on its own.
- Every GPU taken: kube-scheduler's own filters fail everywhere, so it never asks the extender's filter;
  its DefaultPreemption asks the extender's preempt verb before evicting anyone, and the extender answers
  no candidates: "preemption: no candidate node for preemption", nobody evicted, nothing nominated. When
  another pod is deleted the jumper fits by kube-scheduler's filters and gets the queue's Error.
- The chart's queue.priorityGuard, a ResourceQuota allowing no pod of the PriorityClass in the namespace,
  goes further: the API server refuses to create the attacking pod (403, exceeded quota) once
  kube-controller-manager's quota controller has filled in the quota's status.

kube-scheduler's tries are counted in its log: "Unable to schedule pod; no fit; waiting" for a fit
failure, "Error scheduling pod; retrying" for the extender's Error.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from gpunode.cluster.extender.queued import WAITING_REASON
from gpunode.contract.names import ASSIGNMENT_ANNOTATION, GPU_RESOURCE, QUEUE_REASON_ANNOTATION
from tests.deploy.test_helm_chart import needs_helm, render
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.controlplane import ControlPlane
from tests.e2e.objects import get_pod, pod_body, pod_events
from tests.e2e.queue import (
    NAMESPACE,
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

CONTROLLER = "queue-1"
PRIORITY_CLASS = "e2e-jump-the-queue"
PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"
JUMPER = "jumper"
OTHERS = [f"other-{i}" for i in range(4)]  # two GPUs each: every GPU of both nodes
TRIES = 3  # kube-scheduler's tries of the jumper watched in the error case
NO_FIT = re.compile(
    rf'"Unable to schedule pod; no fit; waiting" pod="{NAMESPACE}/{JUMPER}" err="(.*)"$', re.M
)
# kube-scheduler reports a scheduling error through utilruntime.HandleErrorWithContext (structured, with
# logger="UnhandledError" between the error and the pod)
ERROR = re.compile(
    rf'"Error scheduling pod; retrying" err="(.*)" logger="UnhandledError" pod="{NAMESPACE}/{JUMPER}"$', re.M
)


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QueueCluster]:
    """The cluster of tests.e2e.queue with one controller leading, and the tenant's PriorityClass."""
    qc = build_queue_cluster(control_plane, tmp_path_factory.mktemp("queue-preempt"))
    admin = control_plane.api()
    try:
        qc.start_controller(CONTROLLER)
        eventually(lambda: qc.leader() == CONTROLLER, timeout_s=WAIT_S, what="the controller leading")
        admin.apply(
            PRIORITY_CLASSES,
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": PRIORITY_CLASS},
                "value": 1_000_000_000,
                "preemptionPolicy": "PreemptLowerPriority",
                "description": "a tenant's attempt to jump the queue",
            },
        )
        yield qc
    finally:
        with contextlib.suppress(ApiError, AssertionError, OSError):
            delete_all_pods(qc)
        stop_queue_cluster(qc)
        with contextlib.suppress(ApiError, OSError):
            admin.delete(f"{PRIORITY_CLASSES}/{PRIORITY_CLASS}")


def _bound(api: Api, name: str) -> dict[str, Any] | None:
    pod = get_pod(api, NAMESPACE, name)
    if pod["spec"].get("nodeName") and pod["metadata"].get("annotations", {}).get(ASSIGNMENT_ANNOTATION):
        return pod
    return None


def _tries(cluster: QueueCluster) -> list[tuple[str, str]]:
    """kube-scheduler's failed tries to place the jumper so far, in order: ("no fit" or "error", message)."""
    log = cluster.scheduler.log.read_text(errors="replace")
    found = [(m.start(), "no fit", m.group(1)) for m in NO_FIT.finditer(log)]
    found += [(m.start(), "error", m.group(1)) for m in ERROR.finditer(log)]
    return [(kind, text) for _, kind, text in sorted(found)]


def _wait_for_tries(cluster: QueueCluster, count: int) -> list[tuple[str, str]]:
    """Wait until kube-scheduler has made `count` failed tries to place the jumper; all its tries so far."""
    return eventually(
        lambda: tries if len(tries := _tries(cluster)) >= count else None,
        timeout_s=WAIT_S,
        what=f"kube-scheduler's try {count}",
    )


def _fill(cluster: QueueCluster, others: list[str]) -> dict[str, str]:
    """Start from an empty namespace and place `others` (two GPUs each); their UIDs."""
    admin = cluster.cp.api()
    delete_all_pods(cluster)
    for name in others:  # an earlier test's pods of these names
        cluster.reaper.terminated.pop(f"{NAMESPACE}/{name}", None)
    submit(admin, *(pod_body(name, limits={GPU_RESOURCE: "2"}) for name in others))
    placed = {n: eventually(partial(_bound, admin, n), timeout_s=WAIT_S, what=f"{n} bound") for n in others}
    return {n: p["metadata"]["uid"] for n, p in placed.items()}


def _jumper() -> dict[str, Any]:
    """The attacking pod: two GPUs in team-c (which may borrow one GPU at most: never admitted), in the
    tenant's PriorityClass."""
    jumper = queued_pod(JUMPER, "team-c", 2)
    jumper["spec"]["priorityClassName"] = PRIORITY_CLASS
    return jumper


def _fill_and_jump(cluster: QueueCluster, others: list[str]) -> dict[str, str]:
    """Start from an empty namespace, place `others` (two GPUs each), submit the jumper; the others' UIDs."""
    admin = cluster.cp.api()
    placed = _fill(cluster, others)
    submit(admin, _jumper())
    assert get_pod(admin, NAMESPACE, JUMPER)["spec"]["priority"] == 1_000_000_000
    return placed


def _check_no_preemption(cluster: QueueCluster, others: dict[str, str]) -> None:
    """Every other pod is there as it was (not deleted, not terminating, no Preempted event); the jumper is
    neither nominated nor bound."""
    admin = cluster.cp.api()
    for name, uid in others.items():
        gone = cluster.reaper.terminated.get(f"{NAMESPACE}/{name}")
        said = [
            (e.get("reason"), event_text(e), e.get("reportingController"))
            for e in pod_events(admin, NAMESPACE, name)
        ]
        assert gone is None, f"{name} was deleted for the jumper: {gone['metadata']}, events {said}"
        pod = get_pod(admin, NAMESPACE, name)
        assert pod["metadata"]["uid"] == uid and not pod["metadata"].get("deletionTimestamp"), pod["metadata"]
        assert not events(admin, name, "Preempted"), events(admin, name, "Preempted")
    jumper = get_pod(admin, NAMESPACE, JUMPER)
    assert not jumper["status"].get("nominatedNodeName"), jumper["status"]
    assert not jumper["spec"].get("nodeName") and jumper["status"]["phase"] == "Pending"


def test_a_held_high_priority_pod_is_refused_by_error_and_neither_nominated_nor_preempts(
    cluster: QueueCluster,
) -> None:
    admin = cluster.cp.api()
    # Three pods of two GPUs on two nodes of four: one node full, two GPUs free on the other, where the
    # jumper fits by kube-scheduler's own filters; it asks the extender there.
    others = _fill_and_jump(cluster, OTHERS[:3])

    def written_reason() -> str | None:
        return (
            get_pod(admin, NAMESPACE, JUMPER)["metadata"].get("annotations", {}).get(QUEUE_REASON_ANNOTATION)
        )

    reason = eventually(written_reason, timeout_s=WAIT_S, what="the controller's reason on the jumper")
    # kube-scheduler puts a pod whose scheduling failed with an error in its backoff queue and tries it
    # again once the backoff (1 s, doubling up to 10 s) is over: no update of the pod is needed.
    start = len(_tries(cluster))
    tries = _wait_for_tries(cluster, start + TRIES)
    _check_no_preemption(cluster, others)
    assert reason.startswith("queued in team-c, position 1: team-c is over its quota"), reason
    # a scheduling error each time, not a fit failure: the queue's reason (or, before the controller wrote
    # one, the extender's own)
    assert {kind for kind, _ in tries} == {"error"} and tries[-1][1] == reason, tries
    assert {text for _, text in tries} <= {reason, WAITING_REASON}, tries

    # The pod's event and condition carry the queue's reason as it is, nothing added.
    shown = eventually(
        lambda: next(
            (t for e in events(admin, JUMPER, "FailedScheduling") if (t := event_text(e)) == reason), None
        ),
        timeout_s=WAIT_S,
        what="the queue's reason as the pod's FailedScheduling event",
    )
    assert shown == reason

    def condition() -> dict[str, Any] | None:
        conditions = get_pod(admin, NAMESPACE, JUMPER)["status"].get("conditions") or []
        return next((c for c in conditions if c["type"] == "PodScheduled" and c["message"] == reason), None)

    scheduled = eventually(condition, timeout_s=WAIT_S, what="the queue's reason as the pod's condition")
    # a scheduling error, not a fit failure: reason SchedulerError (Unschedulable is for no fit)
    assert scheduled["status"] == "False" and scheduled["reason"] == "SchedulerError", scheduled
    _check_no_preemption(cluster, others)  # still


def test_a_held_high_priority_pod_preempts_nobody_when_every_gpu_is_taken(cluster: QueueCluster) -> None:
    # kube-scheduler's own filters fail on every node, so it never asks the extender's filter; its
    # DefaultPreemption (PostFilter) then finds both nodes worth preempting on and, before evicting
    # anyone, asks the extender's preempt verb, which answers no candidates for a pod a queue holds.
    admin = cluster.cp.api()
    others = _fill(cluster, OTHERS)
    start = len(_tries(cluster))  # an earlier test's jumper's
    submit(admin, _jumper())
    (kind, message), *_ = _wait_for_tries(cluster, start + 1)[start:]
    assert kind == "no fit", (kind, message)
    # (1.36 puts DRA's "no new claims to deallocate, " between the two)
    assert message.startswith("0/2 nodes are available: 2 Insufficient nvidia.com/gpu. "), message
    assert message.endswith("preemption: no candidate node for preemption"), message
    # The extender was asked, and said why it allowed nothing.
    log = cluster.extender.log.read_text(errors="replace")
    said = f"no preemption for pod {NAMESPACE}/{JUMPER} on 2 candidate node(s): it waits in queue team-c"
    assert said in log and "only the queue controller preempts for queues" in log, log[-2000:]
    shown = eventually(
        lambda: next(
            (e for e in events(admin, JUMPER, "FailedScheduling") if event_text(e) == message), None
        ),
        timeout_s=WAIT_S,
        what="kube-scheduler's FailedScheduling event",
    )
    assert shown["type"] == "Warning", shown
    _check_no_preemption(cluster, others)
    # The pod waits in kube-scheduler's unschedulable queue until something frees resources (the queueing
    # hints of NodeResourcesFit, the plugin that failed it); an update of its annotations does not bring
    # it back.
    tried = len(_tries(cluster))
    # Deleting another tenant's pod frees two GPUs: kube-scheduler tries again, now the jumper fits by its
    # own filters, asks the extender's filter and gets the queue's Error. Still nobody preempted.
    victim, *kept = OTHERS
    admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{victim}?gracePeriodSeconds=0")
    after = _wait_for_tries(cluster, tried + 1)[tried:]
    # the queue's reason, or the extender's own before it has seen the controller's
    assert after[0][0] == "error", after
    assert after[0][1].startswith("queued in team-c") or after[0][1] == WAITING_REASON, after
    _check_no_preemption(cluster, {n: others[n] for n in kept})


QUOTAS = f"/api/v1/namespaces/{NAMESPACE}/resourcequotas"


@needs_helm
def test_the_charts_priority_guard_refuses_the_attacking_pod_when_every_gpu_is_taken(
    cluster: QueueCluster,
) -> None:
    # The guard (docs/queueing.md): the chart's queue.priorityGuard, rendered by helm for the harness's
    # namespace and the attack's PriorityClass, applied to the API server. Its ResourceQuota admission
    # plugin then refuses to create the pod at all, so kube-scheduler never sees it.
    admin = cluster.cp.api()
    values = {
        "queue": {
            "enabled": True,
            "priorityGuard": {"namespaces": [NAMESPACE], "priorityClasses": [PRIORITY_CLASS]},
        }
    }
    (quota,) = render(values).kinds("ResourceQuota")
    name = quota["metadata"]["name"]
    others = _fill(cluster, OTHERS)  # every GPU taken
    try:
        admin.apply(QUOTAS, quota)

        # Quota admission checks a pod against the quota's status.hard, so until it is filled in a
        # matching pod would get through. kube-controller-manager's quota controller fills it in (the hard
        # limit and the usage counted), not the test.
        def filled_in() -> dict[str, Any] | None:
            status: dict[str, Any] = admin.get(f"{QUOTAS}/{name}").get("status") or {}
            return status if status.get("hard") else None

        status = eventually(
            filled_in,
            timeout_s=WAIT_S,
            what="kube-controller-manager filling in the quota's status",
        )
        assert status == {"hard": {"pods": "0"}, "used": {"pods": "0"}}, status
        with pytest.raises(ApiError) as refused:
            submit(admin, _jumper())
        assert refused.value.status == 403, refused.value
        assert f"exceeded quota: {name}" in refused.value.body, refused.value.body
        with pytest.raises(ApiError) as gone:
            get_pod(admin, NAMESPACE, JUMPER)
        assert gone.value.status == 404
        # the other tenants' pods (default priority: outside the quota's scope) are there as they were
        for pod_name, uid in others.items():
            assert cluster.reaper.terminated.get(f"{NAMESPACE}/{pod_name}") is None, pod_name
            pod = get_pod(admin, NAMESPACE, pod_name)
            assert pod["metadata"]["uid"] == uid and not pod["metadata"].get("deletionTimestamp")
            preempted = [  # this pod's: the pod of that name an earlier test had evicted had its own
                e
                for e in events(admin, pod_name, "Preempted")
                if (e.get("involvedObject") or e.get("regarding") or {}).get("uid") == uid
            ]
            assert not preempted, preempted
    finally:
        admin.delete(f"{QUOTAS}/{name}")
