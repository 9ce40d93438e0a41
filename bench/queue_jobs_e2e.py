"""A governed Job of 8 on the real control plane: admission -> all bound, suspension -> pods gone, resume ->
all bound again. Prints JSON.

    .venv/bin/python bench/queue_jobs_e2e.py [--rounds N] [--workdir DIR]

The cluster of tests/e2e/test_queue_jobs.py (real etcd, kube-apiserver, kube-controller-manager with its
Job controller, kube-scheduler; the extender with --queue-hold error; two simulated nodes of four GPUs;
one `gpunode queue` leading, serving the chart's webhook, with the chart's policies in force). Each
round:

1. a Job `run` of 8 one-GPU pods in team-a (guaranteed nothing: it borrows the whole cluster, which
   team-b is guaranteed; BENCH_QUEUES) is created; measured: its
   creation -> all 8 pods bound (the webhook suspends it, the controller resumes it, the Job controller
   makes the pods, gated, the controller marks and releases them, kube-scheduler and the extender bind);
2. a Job `claim` of 4 in team-b reclaims: `run` gets its notice (3 s) and is suspended; measured: the
   Job seen suspended -> none of its pods left (the Job controller deletes them; the Reaper stands in
   for the kubelet, which would stop their containers);
3. `claim` is deleted: `run` is admitted again; measured: the Job seen resumed -> all 8 pods bound.

Times are seen through polling every 50 ms (the resolution of the figures).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e import chart
from tests.e2e.api import Api, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import ControlPlane, missing_reason
from tests.e2e.queue import CHART_VALUES, WAIT_S, build_queue_cluster, delete_all_pods, stop_queue_cluster
from tests.e2e.test_queue_gates import BINDINGS, HOOK_NAME, POLICIES, POLICY_NAME, Gates
from tests.e2e.test_queue_jobs import (
    JOBS,
    SUSPENSION,
    _delete_jobs,
    all_bound,
    get_job,
    job_body,
    pods_of,
)

POLL_S = 0.05
BENCH_QUEUES = """\
queues:
  - name: org
    children:
      - {name: team-a}
      - {name: team-b, guarantee: {gpu: 8}}
preemption: {notice: 3s, minRuntime: 0s, reclaim: true, priority: false}
backfill: {enabled: false}
"""


def _until(check: Any, what: str) -> float:
    """Poll `check` every POLL_S until it is true; the monotonic time it was first seen true."""
    eventually(check, timeout_s=WAIT_S, what=what, interval_s=POLL_S)
    return time.monotonic()


def one_round(admin: Api) -> dict[str, float]:
    created = time.monotonic()
    admin.create(JOBS, job_body("run", "team-a", 8, 8))
    bound = _until(lambda: all_bound(admin, "run", 8), "run's 8 pods bound")
    admin.create(JOBS, job_body("claim", "team-b", 4, 4))
    suspended = _until(lambda: get_job(admin, "run")["spec"].get("suspend") is True, "run suspended")
    gone = _until(lambda: not pods_of(admin, "run"), "run's pods gone")
    admin.delete(f"{JOBS}/claim?propagationPolicy=Background")
    resumed = _until(lambda: get_job(admin, "run")["spec"].get("suspend") is False, "run resumed")
    again = _until(lambda: all_bound(admin, "run", 8), "run's 8 pods bound again")
    return {
        "created_to_all_bound_ms": round((bound - created) * 1000, 1),
        "suspended_to_pods_gone_ms": round((gone - suspended) * 1000, 1),
        "resumed_to_all_bound_ms": round((again - resumed) * 1000, 1),
    }


def main() -> int:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds")
    parser.add_argument("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    args = parser.parse_args()
    reason = missing_reason()
    if reason is not None:
        print(json.dumps({"skipped": reason}))
        return 1
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpunode-jobs-"))
    cp = ControlPlane(workdir / "kube", users=E2E_USERS).start()
    rounds: list[dict[str, float]] = []
    try:
        version = cp.api().get("/version")["gitVersion"]
        (workdir / "queue").mkdir()
        qc = build_queue_cluster(cp, workdir / "queue")
        admin = cp.api()
        try:
            values = copy.deepcopy(CHART_VALUES)
            values["queue"]["gate"] = {"enabled": True}
            (workdir / "gate").mkdir()
            g = Gates(qc, chart.render(values, workdir / "gate"))
            host = f"{HOOK_NAME}.{chart.NAMESPACE}.svc"
            g.certs["queue-1"] = cp.issue("queue-1", common_name=host, server=True, hosts=("127.0.0.1",))
            qc.config.write_text(BENCH_QUEUES)  # before the controller starts; the extender re-reads it
            g.start_controller("queue-1")
            for name in (POLICY_NAME, SUSPENSION):
                admin.apply(POLICIES, g.doc("ValidatingAdmissionPolicy", name))
                admin.apply(BINDINGS, g.doc("ValidatingAdmissionPolicyBinding", name))
            g.point_webhook(g.webhook_ports["queue-1"])
            g.webhook_in_force()
            delete_all_pods(qc)
            for _ in range(args.rounds):
                rounds.append(one_round(admin))
                _delete_jobs(admin)
                delete_all_pods(qc)
        finally:
            stop_queue_cluster(qc)
    finally:
        cp.stop()
    summary = {
        key: {
            "p50": round(statistics.median(r[key] for r in rounds), 1),
            "min": min(r[key] for r in rounds),
            "max": max(r[key] for r in rounds),
        }
        for key in rounds[0]
    }
    print(
        json.dumps(
            {
                "kubernetes": version,
                "job_pods": 8,
                "rounds": args.rounds,
                "summary": summary,
                "per_round": rounds,
                "logs": str(cp.logs),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
