"""The queue controller's decisions without I/O: pods into jobs, forged marks, capacity from Nodes, metrics."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpunode.cluster.queuectl.core import QueueCore
from gpunode.cluster.queuectl.jobs import queued_pod
from gpunode.cluster.queuectl.metrics import QueueMetrics
from gpunode.cluster.queuectl.nodes import cluster_view
from gpunode.contract.names import (
    GANG_SIZE_LABEL,
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_REASON_ANNOTATION,
    RUNTIME_ANNOTATION,
)
from tests.cluster.queuectl.helpers import CONFIG_YAML, config, node, pod


def with_uid(p: dict[str, Any], uid: str) -> dict[str, Any]:
    p["metadata"]["uid"] = uid
    return p


def apply(core: QueueCore, now: float) -> Any:
    """One reconcile, with its annotations written back onto the pods (as the API server would)."""
    actions = core.reconcile(now)
    for a in actions.annotate:
        meta = core.pods[a.pod.key]["metadata"]
        notes = meta.setdefault("annotations", {})  # type: ignore[index]
        for k, v in a.annotations.items():
            if v is None:
                notes.pop(k, None)
            else:
                notes[k] = v
    return actions


def test_a_forged_admission_does_not_skip_the_queue() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    forged = json.dumps(
        {"job": "ml/x", "uid": "guess", "node": "n1", "gpus": ["GPU-n1-0"], "at": "2026-01-01T00:00:00Z"}
    )
    for i in range(3):  # 6 GPUs in team-b, which may hold 4: over its quota
        p = with_uid(pod(f"x{i}", queue="team-b", gpus=2, gang="x", size=3), f"uid-{i}")
        p["metadata"]["annotations"] = {QUEUE_ADMITTED_ANNOTATION: forged}
        core.pod_changed(p)
    actions = apply(core, 1000.0)
    assert actions.admitted_jobs == [] and core.sched is not None and "ml/x" not in core.sched.running
    reason = core.pods["ml/x0"]["metadata"]["annotations"][QUEUE_REASON_ANNOTATION]
    assert "team-b is over its quota" in reason
    # the controller's own mark names the UID the pod really has
    core.pod_changed(with_uid(pod("ok", queue="team-a", gpus=1), "uid-ok"))
    apply(core, 1001.0)
    mark = json.loads(core.pods["ml/ok"]["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION])
    assert mark["uid"] == "uid-ok" and mark["job"] == "ml/ok"


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda p: p["metadata"]["labels"].update({GANG_SIZE_LABEL: "many"}), "gang-size: expected 1..1024"),
        (
            lambda p: p["metadata"]["labels"].update({GANG_SIZE_LABEL: "100000"}),
            "gang-size: expected 1..1024",
        ),
        (
            lambda p: p["metadata"]["labels"].update({"gpunode.io/queue": "nowhere"}),
            "'nowhere' is not a leaf",
        ),
        (lambda p: p["metadata"]["labels"].update({GANG_SIZE_LABEL: "0"}), "gang-size: expected 1..1024"),
        (lambda p: p["metadata"].update({"annotations": {RUNTIME_ANNOTATION: "soon"}}), "runtime-estimate"),
        (
            lambda p: p["spec"]["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": "1e40"}),
            "exponent",
        ),
    ],
)
def test_a_pod_that_cannot_be_queued_is_refused_once_with_the_reason(change: Any, problem: str) -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    p = with_uid(pod("bad", gang="g", size=1), "u")
    change(p)
    core.pod_changed(p)
    first, second = core.reconcile(1000.0), core.reconcile(1001.0)
    refused = [a for a in first.annotate if a.event and a.event[0] == "QueueRefused"]
    assert len(refused) == 1 and problem in refused[0].event[1]  # type: ignore[index]
    assert not [a for a in second.annotate if a.event and a.event[0] == "QueueRefused"]
    assert first.admitted_jobs == []


def test_namespace_mapping_and_pods_outside_any_queue() -> None:
    cfg, mapped_cfg = config(), config(CONFIG_YAML + "namespaces: {research: team-b}\n")
    mapped = pod("m", queue=None, namespace="research")
    assert queued_pod(mapped, mapped_cfg).queue == "team-b"  # type: ignore[union-attr]
    assert queued_pod(mapped, cfg) is None  # no label, no mapping: not queued
    labelled = pod("l", queue="team-a", namespace="research")
    assert queued_pod(labelled, mapped_cfg).queue == "team-a"  # type: ignore[union-attr]  # the label wins
    cpu_only = pod("c")
    cpu_only["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
    assert queued_pod(cpu_only, cfg) is None  # asks for no GPU: kube-scheduler alone


def test_gpus_of_pods_outside_the_queues_stay_taken() -> None:
    nodes = [node("n1", 2, held={0: "other/web", 1: "ml/a0"})]
    view = cluster_view(nodes, frozenset({"ml/a0"}))
    free = {g.uuid: g.milli_free for g in view.nodes[0].gpus}
    assert free == {"GPU-n1-0": 0, "GPU-n1-1": 1000}  # the queued pod's GPU comes back; the other stays
    broken = {"metadata": {"name": "n2", "annotations": {"gpunode.io/gpu-state": "{not json"}}}
    bare = {"metadata": {"name": "n3"}}
    view = cluster_view([*nodes, broken, bare], frozenset())
    assert [n.name for n in view.nodes] == ["n1"] and set(view.problems) == {"n2", "n3"}


def test_a_notice_runs_out_into_an_eviction_and_the_metrics_follow() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    core.pod_changed(with_uid(pod("a0", gpus=4), "u0"))
    core.pod_changed(with_uid(pod("a1", gpus=4, created="2026-01-01T00:00:01Z"), "u1"))
    apply(core, 1000.0)
    core.pod_changed(with_uid(pod("b0", queue="team-b", gpus=4), "ub"))
    noticed = apply(core, 1010.0)
    assert len(noticed.preempted_jobs) == 1 and noticed.evict == []
    victim = noticed.preempted_jobs[0][0].split("/")[1]
    notice = json.loads(core.pods[f"ml/{victim}"]["metadata"]["annotations"][PREEMPTION_NOTICE_ANNOTATION])
    assert notice["preemptor"] == "ml/b0"
    assert core.next_deadline() == pytest.approx(1012.0)  # notice: 2s
    later = apply(core, 1012.5)
    assert [r.name for r in later.evict] == [victim] and later.admitted_jobs == ["ml/b0"]
    # while the victim's pod is still there (a PodDisruptionBudget), it is evicted again, never re-admitted
    again = apply(core, 1013.0)
    assert [r.name for r in again.evict] == [victim] and again.admitted_jobs == []
    metrics = QueueMetrics(lambda: core, lambda: True).render().decode()
    assert 'gpunode_queue_admitted_jobs{queue="team-b"} 1.0' in metrics
    assert 'gpunode_queue_gpus_used{queue="team-b"} 4.0' in metrics
    assert 'gpunode_queue_gpus_guarantee{queue="team-a"} 4.0' in metrics
    assert "gpunode_queue_leader 1.0" in metrics


def test_more_pods_than_the_gang_size_are_refused_not_admitted_in_part() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    for i in range(3):
        core.pod_changed(with_uid(pod(f"g{i}", gang="g", size=2), f"u{i}"))
    actions = core.reconcile(1000.0)
    assert actions.admitted_jobs == []
    refused = {a.pod.name for a in actions.annotate if a.event and a.event[0] == "QueueRefused"}
    assert refused == {"g0", "g1", "g2"}


def test_the_clock_stepping_back_does_not_stop_the_controller() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    core.reconcile(1000.0)
    core.pod_changed(with_uid(pod("a0"), "u0"))
    assert core.reconcile(900.0).admitted_jobs == ["ml/a0"]


def test_a_preemptor_deleted_during_the_notice_lifts_it_and_nothing_is_evicted() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    core.pod_changed(with_uid(pod("a0", gpus=4), "u0"))
    core.pod_changed(with_uid(pod("a1", gpus=4, created="2026-01-01T00:00:01Z"), "u1"))
    apply(core, 1000.0)
    core.pod_changed(with_uid(pod("b0", queue="team-b", gpus=4), "ub"))
    victim = apply(core, 1010.0).preempted_jobs[0][0].split("/")[1]
    core.pod_changed(core.pods["ml/b0"], deleted=True)
    lifted = apply(core, 1011.0)
    assert [(a.pod.name, a.event[0]) for a in lifted.annotate if a.event] == [(victim, "PreemptionLifted")]  # type: ignore[index]
    assert PREEMPTION_NOTICE_ANNOTATION not in core.pods[f"ml/{victim}"]["metadata"]["annotations"]
    later = apply(core, 1020.0)  # past the old deadline
    assert later.evict == [] and core.sched is not None and f"ml/{victim}" in core.sched.running
    assert core.rebuilds == 1


def test_reclaim_between_sibling_queues_under_one_parent() -> None:
    nested = """
queues:
  - name: org
    children:
      - name: team-a
        guarantee: {gpu: 4}
        borrowLimit: {gpu: 4}
      - name: team-b
        guarantee: {gpu: 4}
        borrowLimit: {gpu: 0}
preemption: {notice: 2s, minRuntime: 0s}
"""
    core = QueueCore(config(nested))
    core.node_changed(node("n1", 8))
    core.pod_changed(with_uid(pod("a0", gpus=4), "u0"))
    core.pod_changed(with_uid(pod("a1", gpus=4, created="2026-01-01T00:00:01Z"), "u1"))
    assert apply(core, 1000.0).admitted_jobs == ["ml/a0", "ml/a1"]
    core.pod_changed(with_uid(pod("b0", queue="team-b", gpus=4), "ub"))
    preempted = apply(core, 1010.0).preempted_jobs
    assert len(preempted) == 1 and preempted[0][1] == "reclaim"


def test_a_rebuild_keeps_the_fair_share_usage_of_the_last_window() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    core.pod_changed(with_uid(pod("a0", gpus=4), "u0"))
    assert apply(core, 1000.0).admitted_jobs == ["ml/a0"]
    apply(core, 4600.0)  # a0's queue has held 4 GPUs for an hour
    before = core.sched
    assert before is not None and before._ledger is not None
    used = before._ledger.usage(4600.0)
    (queue,) = [q for q, amounts in used.items() if amounts.get("gpu", 0) > 0]
    rebuilds = core.rebuilds
    core.node_changed(node("n2", 8))  # the cluster changed: the Scheduler is rebuilt
    apply(core, 4601.0)
    assert core.rebuilds == rebuilds + 1 and core.sched is not before
    assert core.sched is not None and core.sched._ledger is not None
    assert core.sched._ledger.usage(4601.0)[queue]["gpu"] >= used[queue]["gpu"] * 0.99
