"""A governed JobSet with the real JobSet controller (built from Go modules, tests/e2e/jobset.py) and the
real Job controller: admitted whole or not at all (docs/queueing.md, "Jobs and JobSets").

The cluster of tests/e2e/test_queue_jobs.py (its `jobs` fixture: the extender with its hold,
kube-scheduler, two simulated nodes of four GPUs, two `gpunode queue` replicas serving the chart's
webhook for pods, Jobs and JobSets, the chart's ValidatingAdmissionPolicies), with the JobSet CRD,
controller and webhooks installed before the queue controllers start, so that they watch JobSets from
the first list. The JobSet is one leader pod and three worker pods of one GPU each, in team-a (guaranteed
four GPUs).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from gpunode.contract.names import (
    GPU_RESOURCE,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_LABEL,
    QUEUE_REASON_ANNOTATION,
)
from tests.e2e.api import Api, eventually
from tests.e2e.jobset import (
    JOBSET_NAME_LABEL,
    REPLICATED_JOB_LABEL,
    JobSetController,
    delete_jobset,
    jobsets_path,
)
from tests.e2e.objects import pod_body
from tests.e2e.queue import NAMESPACE, WAIT_S, delete_all_pods, held_gpus, submit
from tests.e2e.test_queue_gates import Gates, bound, check_released_as_planned
from tests.e2e.test_queue_jobs import _clean, jobs  # noqa: F401  (the queue cluster with its webhook)

JOBSETS = jobsets_path(NAMESPACE)
HOLD_S = 8.0  # how long a JobSet that does not fit is watched holding nothing


@pytest.fixture(scope="module", autouse=True)
def _jobset_first(jobset_controller: JobSetController) -> JobSetController:
    """The JobSet controller (session-wide) before the queue cluster: its CRD served when they list."""
    return jobset_controller


@pytest.fixture
def cluster(_jobset_first: JobSetController, jobs: Gates) -> Iterator[Api]:  # noqa: F811
    admin = jobs.qc.cp.api()
    try:
        yield admin
    finally:
        for item in admin.get(JOBSETS)["items"]:
            delete_jobset(admin, NAMESPACE, item["metadata"]["name"])
        eventually(lambda: not admin.get(JOBSETS)["items"], timeout_s=WAIT_S, what="every JobSet deleted")
        delete_all_pods(jobs.qc)


def jobset_body(name: str, queue: str) -> dict[str, Any]:
    """A leader Job of one pod and a workers Job of three, each pod one GPU, labelled with `queue` (on the
    JobSet only: the webhook labels the pod templates and suspends it)."""

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
                            "restartPolicy": "Never",
                            "terminationGracePeriodSeconds": 1,
                            "containers": [
                                {
                                    "name": "main",
                                    "image": "registry.invalid/train:1",
                                    "resources": {"limits": {GPU_RESOURCE: "1"}},
                                }
                            ],
                        }
                    },
                }
            },
        }

    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: queue}},
        "spec": {"replicatedJobs": [replicated("leader", 1), replicated("workers", 3)]},
    }


def _mark(obj: dict[str, Any]) -> dict[str, Any] | None:
    text = (obj["metadata"].get("annotations") or {}).get(QUEUE_ADMITTED_ANNOTATION)
    return json.loads(text) if text else None


def _pods(api: Api, jobset: str) -> list[dict[str, Any]]:
    selector = quote(f"{JOBSET_NAME_LABEL}={jobset}")
    items = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _jobs(api: Api, jobset: str) -> list[dict[str, Any]]:
    selector = quote(f"{JOBSET_NAME_LABEL}={jobset}")
    return list(api.get(f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs?labelSelector={selector}")["items"])


def _all_bound(api: Api, jobset: str) -> list[dict[str, Any]] | None:
    pods = _pods(api, jobset)
    if len(pods) != 4:
        return None
    done = [bound(api, p["metadata"]["name"]) for p in pods]
    return [p for p in done if p] if all(done) else None


def _admitted_whole(api: Api, name: str) -> None:
    """The JobSet resumed with one mark, its four pods bound exactly on the mark's slots, group by group."""
    js = eventually(
        lambda: (
            j if (j := api.get(f"{JOBSETS}/{name}"))["spec"].get("suspend") is False and _mark(j) else None
        ),
        timeout_s=WAIT_S,
        what=f"JobSet {name} resumed with its mark",
    )
    mark = _mark(js)
    assert mark is not None and mark["job"] == f"{NAMESPACE}/JobSet/{name}", mark
    assert mark["uid"] == js["metadata"]["uid"]
    slots = [json.loads(s) for s in mark["gpus"]]
    assert Counter(group for group, _, _ in slots) == {"leader": 1, "workers": 3}, slots
    pods = eventually(lambda: _all_bound(api, name), timeout_s=WAIT_S, what=f"{name}'s 4 pods bound")
    placed = Counter()
    for pod in pods:
        pod_mark = check_released_as_planned(pod)  # on its mark's node and GPUs, gate gone, pinned
        group = pod["metadata"]["labels"][REPLICATED_JOB_LABEL]
        placed[(group, pod_mark["node"], tuple(pod_mark["gpus"]))] += 1
    # Each pod on a slot of its own replicated job, together exactly the plan.
    assert placed == Counter((g, node, tuple(gpus)) for g, node, gpus in slots), (placed, slots)
    assert len({gpu for _, _, gpus in slots for gpu in gpus}) == 4
    assert all(not j["spec"].get("suspend") for j in _jobs(api, name))


def test_a_jobset_that_fits_is_admitted_whole_and_bound_on_its_plan(cluster: Api) -> None:
    api = cluster
    created = api.create(JOBSETS, jobset_body("fits", "team-a"))
    assert created["spec"]["suspend"] is True  # the queue's webhook
    for rjob in created["spec"]["replicatedJobs"]:
        assert rjob["template"]["spec"]["template"]["metadata"]["labels"][QUEUE_LABEL] == "team-a"
    _admitted_whole(api, "fits")


def test_a_jobset_with_only_three_gpus_free_holds_none_until_four_are(cluster: Api) -> None:
    api = cluster
    # Five GPUs taken by pods no queue governs (kube-scheduler and the extender place them): 3 left.
    blockers = [f"other-{i}" for i in range(5)]
    submit(api, *(pod_body(b, limits={GPU_RESOURCE: "1"}) for b in blockers))
    eventually(lambda: len(held_gpus(api)) == 5 or None, timeout_s=WAIT_S, what="5 GPUs held by other pods")

    api.create(JOBSETS, jobset_body("waits", "team-a"))
    waiting = eventually(
        lambda: (
            j
            if (
                QUEUE_REASON_ANNOTATION
                in ((j := api.get(f"{JOBSETS}/waits"))["metadata"].get("annotations") or {})
            )
            else None
        ),
        timeout_s=WAIT_S,
        what="the JobSet's waiting reason",
    )
    assert waiting["metadata"]["annotations"][QUEUE_REASON_ANNOTATION].startswith("queued in team-a"), waiting
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:  # not one member starts: no pod, no GPU, the JobSet suspended
        js = api.get(f"{JOBSETS}/waits")
        assert js["spec"]["suspend"] is True and _mark(js) is None, js["metadata"]
        assert all(j["spec"].get("suspend") is True for j in _jobs(api, "waits"))
        assert not _pods(api, "waits")
        held = held_gpus(api)
        assert len(held) == 5 and not any("waits" in p for pods in held.values() for p in pods), held
        time.sleep(0.5)
    assert _jobs(api, "waits"), "the JobSet controller made its Jobs, suspended"

    api.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{blockers[0]}?gracePeriodSeconds=0")
    _admitted_whole(api, "waits")  # four free now: all four at once
