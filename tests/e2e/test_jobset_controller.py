"""The JobSet controller built from Go modules (`scripts/get-kube.sh --jobset`) on the real control plane: a
JobSet's Jobs and pods made through the real Job controller and placed by the real kube-scheduler on fake
nodes, suspension and resumption passed on to its Jobs, and its own admission webhooks answering (the
validating one refusing a JobSet, the mutating ones defaulting the JobSet and labelling its pods).

These are the controller's behaviours the queue controller's JobSet admission builds on
(tests/e2e/test_queue_jobset.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.controlplane import ControlPlane
from tests.e2e.jobset import (
    JOBSET_NAME_LABEL,
    PRIORITY_LABEL,
    REPLICATED_JOB_LABEL,
    JobSetController,
    delete_jobset,
    jobsets_path,
)
from tests.e2e.objects import create_fake_node, ensure_namespace
from tests.e2e.procs import Proc

NAMESPACE = "e2e-jobset"
NODES = ("e2e-jobset-n1", "e2e-jobset-n2")
POOL_LABEL = "e2e.gpunode.io/pool"  # the fake nodes carry it; the JobSets' pods select it
POOL = "jobset"
WAIT_S = 120.0  # generous: two shared cores


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, jobset_controller: JobSetController) -> Iterator[Api]:
    """The JobSet controller, a kube-scheduler and two fake nodes; yields the admin client."""
    admin = control_plane.api()
    ensure_namespace(admin, NAMESPACE)
    for node in NODES:
        create_fake_node(admin, node, labels={POOL_LABEL: POOL})
    scheduler: Proc = control_plane.start_scheduler(name="kube-scheduler-jobset")
    try:
        yield admin
    finally:
        for item in admin.get(jobsets_path(NAMESPACE))["items"]:
            delete_jobset(admin, NAMESPACE, item["metadata"]["name"])
        _reap(admin, until_gone=True)
        scheduler.stop()
        control_plane.procs.remove(scheduler)
        for node in NODES:
            admin.delete(f"/api/v1/nodes/{node}")


def _jobset(name: str, *, suspend: bool = False, **spec: Any) -> dict[str, Any]:
    """A JobSet of a leader (one pod) and workers (three pods), each one Job."""

    def replicated(rjob: str, pods: int) -> dict[str, Any]:
        return {
            "name": rjob,
            "replicas": 1,
            "template": {
                "spec": {
                    "parallelism": pods,
                    "completions": pods,
                    "backoffLimit": 0,
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "main",
                                    "image": "gpunode.local/pause-busybox:1",
                                    "imagePullPolicy": "Never",
                                    "command": ["/pause"],
                                }
                            ],
                            "nodeSelector": {POOL_LABEL: POOL},
                            "terminationGracePeriodSeconds": 1,
                            "automountServiceAccountToken": False,
                        }
                    },
                }
            },
        }

    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "suspend": suspend,
            "replicatedJobs": [replicated("leader", 1), replicated("workers", 3)],
            **spec,
        },
    }


def _jobs(api: Api, jobset: str) -> dict[str, dict[str, Any]]:
    selector = quote(f"{JOBSET_NAME_LABEL}={jobset}")
    items = api.get(f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs?labelSelector={selector}")["items"]
    return {j["metadata"]["name"]: j for j in items}


def _pods(api: Api, jobset: str) -> list[dict[str, Any]]:
    selector = quote(f"{JOBSET_NAME_LABEL}={jobset}")
    return list(api.get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}")["items"])


def _reap(api: Api, *, until_gone: bool = False) -> None:
    """The kubelet's part for pods on fake nodes: a terminating pod is deleted for good (without a kubelet it
    would stay terminating); with until_gone, wait until the namespace has no pod left."""

    def sweep() -> bool:
        pods = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        for pod in pods:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                try:
                    api.request(
                        "DELETE",
                        f"/api/v1/namespaces/{NAMESPACE}/pods/{meta['name']}",
                        {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
                    )
                except ApiError as exc:
                    if exc.status not in (404, 409):
                        raise
        return not pods

    if until_gone:
        eventually(sweep, timeout_s=WAIT_S, what=f"no pod left in {NAMESPACE}")
    else:
        sweep()


def _bound_pods(api: Api, jobset: str, want: dict[str, int]) -> list[dict[str, Any]] | None:
    """The JobSet's live pods once there are `want` per replicated job, all bound to the fake nodes."""
    live = [p for p in _pods(api, jobset) if not p["metadata"].get("deletionTimestamp")]
    counts: dict[str, int] = {}
    for pod in live:
        rjob = pod["metadata"]["labels"].get(REPLICATED_JOB_LABEL, "")
        counts[rjob] = counts.get(rjob, 0) + 1
    if counts != want or any(p["spec"].get("nodeName") not in NODES for p in live):
        return None
    return live


def _condition(obj: dict[str, Any], kind: str) -> str:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return str(cond.get("status"))
    return ""


def test_jobset_makes_its_jobs_and_pods_through_the_job_controller(cluster: Api) -> None:
    api = cluster
    api.create(jobsets_path(NAMESPACE), _jobset("train"))
    js = api.get(f"{jobsets_path(NAMESPACE)}/train")
    # The mutating webhook defaulted what the CRD leaves empty.
    assert js["spec"]["startupPolicy"] == {"startupPolicyOrder": "AnyOrder"}, js["spec"]
    assert js["spec"]["successPolicy"]["operator"] == "All", js["spec"]

    jobs = eventually(
        lambda: j if len(j := _jobs(api, "train")) == 2 else None, timeout_s=WAIT_S, what="2 Jobs"
    )
    assert set(jobs) == {"train-leader-0", "train-workers-0"}, sorted(jobs)
    for job in jobs.values():
        (owner,) = job["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("JobSet", "train", js["metadata"]["uid"])
        assert owner.get("controller") is True
        assert job["spec"]["completionMode"] == "Indexed"  # the webhook's default
    assert jobs["train-leader-0"]["spec"]["parallelism"] == 1
    assert jobs["train-workers-0"]["spec"]["parallelism"] == 3

    pods = eventually(
        lambda: _bound_pods(api, "train", {"leader": 1, "workers": 3}),
        timeout_s=WAIT_S,
        what="1 leader and 3 worker pods bound to the fake nodes",
    )
    for pod in pods:
        meta = pod["metadata"]
        (owner,) = meta["ownerReferences"]
        # Made by the Job controller for the Job of its replicated job.
        assert owner["kind"] == "Job" and owner["name"] == f"train-{meta['labels'][REPLICATED_JOB_LABEL]}-0"
        assert owner["uid"] == jobs[owner["name"]]["metadata"]["uid"]
        # The controller's pod webhook ran on its creation.
        assert meta["labels"].get(PRIORITY_LABEL) == "0", meta["labels"]
        assert pod["spec"]["restartPolicy"] == "OnFailure"  # the JobSet webhook's default for the template
    indexes = sorted(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] for p in pods)
    assert indexes == ["0", "0", "1", "2"], indexes


def test_suspending_a_jobset_suspends_its_jobs_and_resuming_resumes_them(cluster: Api) -> None:
    api = cluster
    api.create(jobsets_path(NAMESPACE), _jobset("pause"))
    eventually(
        lambda: _bound_pods(api, "pause", {"leader": 1, "workers": 3}), timeout_s=WAIT_S, what="4 pods bound"
    )
    first = {p["metadata"]["uid"] for p in _pods(api, "pause")}

    api.patch(f"{jobsets_path(NAMESPACE)}/pause", {"spec": {"suspend": True}})

    def suspended() -> bool:
        jobs = _jobs(api, "pause")
        _reap(api)
        return (
            len(jobs) == 2
            and all(j["spec"].get("suspend") is True for j in jobs.values())
            and all(_condition(j, "Suspended") == "True" for j in jobs.values())
            and not _pods(api, "pause")
        )

    eventually(suspended, timeout_s=WAIT_S, what="both Jobs suspended and their pods gone")
    eventually(
        lambda: _condition(api.get(f"{jobsets_path(NAMESPACE)}/pause"), "Suspended") == "True",
        timeout_s=WAIT_S,
        what="the JobSet's Suspended condition",
    )

    api.patch(f"{jobsets_path(NAMESPACE)}/pause", {"spec": {"suspend": False}})
    pods = eventually(
        lambda: _bound_pods(api, "pause", {"leader": 1, "workers": 3}),
        timeout_s=WAIT_S,
        what="4 new pods bound after the resumption",
    )
    assert not first & {p["metadata"]["uid"] for p in pods}, "the pods after resuming are new ones"
    jobs = _jobs(api, "pause")
    assert len(jobs) == 2 and all(not j["spec"].get("suspend") for j in jobs.values()), jobs


def test_its_validating_webhook_refuses_an_invalid_jobset(cluster: Api) -> None:
    api = cluster
    # The CRD's schema takes this (any string); only the controller's validating webhook knows the names.
    body = _jobset("bad", successPolicy={"operator": "All", "targetReplicatedJobs": ["no-such-job"]})
    with pytest.raises(ApiError) as refused:
        api.create(jobsets_path(NAMESPACE), body)
    assert refused.value.status in (400, 403, 422), refused.value
    message = json.loads(refused.value.body)["message"]
    assert message.startswith('admission webhook "vjobset.kb.io" denied the request'), message
    assert "'no-such-job' does not appear in .spec.ReplicatedJobs" in message, message
    with pytest.raises(ApiError) as missing:
        api.get(f"{jobsets_path(NAMESPACE)}/bad")
    assert missing.value.status == 404
    # The same JobSet with a name it has is taken: what was refused was the name.
    api.create(
        jobsets_path(NAMESPACE),
        _jobset("good", successPolicy={"operator": "All", "targetReplicatedJobs": ["workers"]}),
    )
