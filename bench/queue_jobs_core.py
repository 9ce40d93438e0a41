"""Benchmark: the queue controller's decision core with 10,000 suspended Jobs on 5,000 nodes x 8 GPUs.

The cluster and the work of bench/queue_admission.py (5,000 Nodes publishing 8 whole 80 GB GPUs each;
four queues weighted 4:3:2:1, the example queue file), the work given as `batch/v1` Jobs instead of
pods: each pod of that mix becomes a suspended Job of one pod asking the same GPUs, each gang of 4 a
Job of parallelism 4 (4 GPUs per pod). QueueCore.reconcile decides them in memory (no HTTP): the first
reconcile (Scheduler built, one cycle deciding every Job: resumed with its mark, or its waiting
reason), the patches applied as the API server would, and a second reconcile (the admissions read
back). Decisions per second = Jobs decided / the first reconcile's time. Also this process's resident
memory (VmRSS, peak VmHWM) before and after. Prints one JSON document.

    .venv/bin/python bench/queue_jobs_core.py [--nodes 5000] [--jobs 10000]

Not measured here: the same end to end against an API server (the stand-in of the controller's tests
serves no Jobs).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.queue_admission import CONFIG, cluster, memory  # noqa: E402
from gpunode.cluster.queuectl.core import QueueCore  # noqa: E402
from gpunode.cluster.queuectl.workloads import JOB, JOBSET  # noqa: E402
from gpunode.cluster.queueing.config import load_queue_config  # noqa: E402
from gpunode.contract.names import GANG_LABEL, QUEUE_ADMITTED_ANNOTATION, QUEUE_LABEL  # noqa: E402


def jobs_of(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pod mix as suspended Jobs: one per pod, one per gang (parallelism 4)."""
    out: dict[str, dict[str, Any]] = {}
    for p in pods:
        meta = p["metadata"]
        gang = meta["labels"].get(GANG_LABEL)
        name = gang or meta["name"]
        if name in out:
            continue
        size = 4 if gang else 1
        out[name] = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": name,
                "namespace": meta["namespace"],
                "uid": f"uid-{name}",
                "labels": {QUEUE_LABEL: meta["labels"][QUEUE_LABEL]},
                "annotations": {},
                "creationTimestamp": meta["creationTimestamp"],
            },
            "spec": {
                "suspend": True,
                "parallelism": size,
                "completions": size,
                "template": {"metadata": {}, "spec": p["spec"]},
            },
            "status": {},
        }
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--jobs", type=int, default=10000, help="pods of the mix (gangs of 4 become one Job)")
    args = parser.parse_args(argv)
    node_objs, pod_objs = cluster(args.nodes, args.jobs)
    jobs = jobs_of(pod_objs)
    del pod_objs
    before = memory()
    core = QueueCore(load_queue_config(CONFIG))
    core.replace_all([], node_objs)
    core.replace_workloads(JOB, jobs)
    core.replace_workloads(JOBSET, [])
    gc.collect()
    start = time.perf_counter()
    actions = core.reconcile(1_800_000_000.0)
    first = time.perf_counter() - start
    resumed = {p.target.name for p in actions.patch if p.suspend is False}
    reasons = {p.target.name for p in actions.patch if p.suspend is None} - resumed
    for p in actions.patch:  # as the API server would store them
        obj = core.workload_objects[p.target.kind][p.target.uid]
        notes = obj["metadata"].setdefault("annotations", {})  # type: ignore[index]
        notes.update({k: v for k, v in p.annotations.items() if v is not None})
        if p.suspend is not None:
            obj["spec"]["suspend"] = p.suspend  # type: ignore[index]
    start = time.perf_counter()
    again = core.reconcile(1_800_000_001.0)
    second = time.perf_counter() - start
    out = {
        "python": platform.python_version(),
        "nodes": args.nodes,
        "jobs": len(jobs),
        "jobs_decided": len(resumed) + len(reasons),
        "jobs_admitted": len(resumed),
        "first_reconcile_s": round(first, 3),
        "decisions_per_s": round((len(resumed) + len(reasons)) / first, 1),
        "second_reconcile_s": round(second, 3),
        "second_reconcile_new_admissions": sum(
            1 for p in again.patch if QUEUE_ADMITTED_ANNOTATION in p.annotations and p.suspend is False
        ),
        "memory_mib": {"before": before, "after": memory()},
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
