"""The queue controller at scale with governed Jobs on the real API server. Prints JSON.

    .venv/bin/python bench/queue_jobs_scale.py [--jobs 10000] [--nodes 250] [--quick]

A real control plane (etcd, kube-apiserver, kube-controller-manager with the Job controller; no
kube-scheduler, so admitted pods stay pending) as tests/e2e starts it, with:

- `--nodes` Nodes publishing 8 whole 80 GB GPUs each in gpunode.io/gpu-state (their status written
  once; nothing renews their Leases, which the queue controller does not read);
- `--jobs` governed `batch/v1` Jobs, created suspended in four queues weighted 4:3:2:1 (the example
  queue file), each with the label gpunode.io/queue: 90% of one pod of 1 GPU, 10% of 4 pods of 1 GPU
  (parallelism = completions = 4: gangs of 4). With the defaults the cluster has 2,000 GPUs for about
  13,000 asked: about 1,500 are admitted, the rest wait;
- one `gpunode queue` process (the admin's credentials, a signing key, no leader election, no usage
  ConfigMap), started once every Job exists.

Figures:

- admissions per second end to end: from the controller's start to the last admission seen through a
  watch of this script's (a Job's signed mark gpunode.io/queue-admitted, written together with
  `spec.suspend: false`), the cluster being full once no admission came for `--settle` seconds;
  Jobs admitted / that time. Every admission is a Job PATCH and an Event; the Job controller then
  makes the admitted Jobs' pods, which the controller marks in turn (not gated here: no webhook), all
  on the same two cores. Also counted: the Jobs seen with a waiting reason (gpunode.io/queue-reason);
- start-up: from the controller's start to the first admission seen (its list and watch of pods,
  Nodes, Jobs, JobSets and PriorityClasses, and its first reconcile); beside it, one plain LIST of all
  the Jobs by this script, for scale;
- the controller's resident memory at the end and its peak (VmRSS, VmHWM of its process).

(Suspension -> pods gone and resumption -> bound for a Job of 8 is bench/queue_jobs_e2e.py.)

`--quick`: 500 Jobs on 13 nodes. Results: bench/results/queue_jobs_scale.json (`--out`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import os
import platform
import secrets
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpunode.contract.names import (  # noqa: E402
    GPU_RESOURCE,
    NODE_STATE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_LABEL,
    QUEUE_REASON_ANNOTATION,
)
from tests.cluster.queuectl.helpers import node_annotation  # noqa: E402
from tests.e2e.api import Api  # noqa: E402
from tests.e2e.controlplane import ControlPlane, missing_reason  # noqa: E402
from tests.e2e.objects import ensure_namespace, write_ready_status  # noqa: E402
from tests.e2e.procs import Proc  # noqa: E402
from tests.ports import free_port  # noqa: E402

CONFIG = ROOT / "gpunode" / "examples" / "queues.yaml"
TEAMS = ("team-a", "team-b", "team-c", "team-d")
WEIGHTS = (0.4, 0.3, 0.2, 0.1)
NAMESPACE = "bench-jobs"
GPUS_PER_NODE = 8
JOBS_PATH = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"


def job_body(name: str, team: str, pods: int, *, suspend: bool = True) -> dict[str, Any]:
    """A governed Job of `pods` pods of one GPU each, created suspended."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: team}},
        "spec": {
            "suspend": suspend,
            "parallelism": pods,
            "completions": pods,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "automountServiceAccountToken": False,
                    "containers": [
                        {
                            "name": "main",
                            "image": "gpunode.local/pause-busybox:1",
                            "imagePullPolicy": "Never",
                            "resources": {"limits": {GPU_RESOURCE: "1"}},
                        }
                    ],
                }
            },
        },
    }


class JobWatch:
    """A watch on the namespace's Jobs: when each was first seen with the controller's decision."""

    def __init__(self, api: Api, ca_file: Path) -> None:
        host, port = api.server.removeprefix("https://").split(":")
        self._conn = http.client.HTTPSConnection(
            host, int(port), context=ssl.create_default_context(cafile=str(ca_file)), timeout=3600
        )
        self._token = api.token
        self.admitted: dict[str, float] = {}  # Job -> when first seen with the admission mark
        self.reasons: set[str] = set()  # Jobs seen with a waiting reason
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, resource_version: str) -> JobWatch:
        path = f"{JOBS_PATH}?watch=1&resourceVersion={resource_version}&allowWatchBookmarks=false"
        self._conn.request("GET", path, headers={"Authorization": f"Bearer {self._token}"})
        self._resp = self._conn.getresponse()
        assert self._resp.status == 200, self._resp.status
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while line := self._resp.readline():
                now = time.monotonic()
                event = json.loads(line)
                job = event["object"]
                if event["type"] not in ("ADDED", "MODIFIED") or job.get("kind") != "Job":
                    continue
                notes = job["metadata"].get("annotations") or {}
                name = job["metadata"]["name"]
                with self._lock:
                    if QUEUE_ADMITTED_ANNOTATION in notes:
                        self.admitted.setdefault(name, now)
                    if QUEUE_REASON_ANNOTATION in notes:
                        self.reasons.add(name)
        except (OSError, ValueError, AttributeError):  # the connection closed by stop()
            if not self._stopped.is_set():
                raise

    def counts(self) -> tuple[int, int, float | None, float | None]:
        """(Jobs admitted, Jobs with a waiting reason, first admission seen, last admission seen)."""
        with self._lock:
            times = self.admitted.values()
            return len(self.admitted), len(self.reasons), min(times, default=None), max(times, default=None)

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):  # wakes the reading thread (a close alone may wait for it)
            if self._conn.sock is not None:
                self._conn.sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()


def proc_memory(pid: int) -> dict[str, float]:
    """A process's resident memory now and at its peak, MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def create_all(api: Api, bodies: list[dict[str, Any]], path: str, threads: int = 8) -> float:
    """POST every body (a few at once); the seconds it took."""
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(api.create, path, b) for b in bodies]:
            f.result()
    return time.monotonic() - start


def make_jobs(n: int, seed: int) -> list[dict[str, Any]]:
    import random

    rng = random.Random(seed)
    return [
        job_body(f"j{i:05d}", rng.choices(TEAMS, WEIGHTS)[0], 4 if rng.random() < 0.1 else 1)
        for i in range(n)
    ]


def start_controller(cp: ControlPlane, workdir: Path) -> tuple[Proc, int]:
    key = workdir / "admission.key"
    key.write_text(secrets.token_urlsafe(48))
    key.chmod(0o600)
    port = free_port()
    argv = [
        sys.executable, "-m", "gpunode.cli", "queue",
        "--config", str(CONFIG),
        "--kube-api", cp.server,
        "--kube-token-file", str(cp.token_file("admin")),
        "--kube-ca-file", str(cp.ca_file),
        "--metrics-listen", f"127.0.0.1:{port}",
        "--resync", "5s",
        "--usage-configmap", "",
        "--admission-key-file", str(key),
    ]  # fmt: skip
    proc = Proc("gpunode-queue", argv, cp.logs).start()
    cp.procs.append(proc)
    return proc, port


def scale(
    cp: ControlPlane, workdir: Path, jobs: int, nodes: int, timeout_s: float, settle_s: float
) -> dict[str, Any]:
    admin = cp.api()
    ensure_namespace(admin, NAMESPACE)
    node_bodies = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": f"bench-node-{i:04d}",
                "labels": {"kubernetes.io/hostname": f"bench-node-{i:04d}"},
                "annotations": {NODE_STATE_ANNOTATION: node_annotation(f"bench-node-{i:04d}", GPUS_PER_NODE)},
            },
        }
        for i in range(nodes)
    ]
    create_all(admin, node_bodies, "/api/v1/nodes")
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU_RESOURCE: str(GPUS_PER_NODE)}
    for body in node_bodies:
        write_ready_status(admin, body["metadata"]["name"], capacity)
    bodies = make_jobs(jobs, seed=7)
    create_s = create_all(admin, bodies, JOBS_PATH)
    start = time.monotonic()
    listed = admin.get(JOBS_PATH)
    list_s = time.monotonic() - start
    assert len(listed["items"]) == jobs, len(listed["items"])

    watch = JobWatch(admin, cp.ca_file).start(listed["metadata"]["resourceVersion"])
    proc, _port = start_controller(cp, workdir)
    started = time.monotonic()
    try:
        next_note = started + 10
        while True:
            admitted, reasons, first, last = watch.counts()
            now = time.monotonic()
            if not proc.running():
                raise SystemExit(f"queue_jobs_scale: the controller exited; its log: {proc.log}")
            if last is not None and now - last >= settle_s:
                break  # the cluster is full: no admission for settle_s
            if now - started > timeout_s:
                raise SystemExit(
                    f"queue_jobs_scale: still admitting after {timeout_s:.0f}s ({admitted} Jobs admitted); "
                    f"the controller's log: {proc.log}"
                )
            if now >= next_note:
                print(f"{now - started:.0f}s: {admitted} Jobs admitted", file=sys.stderr)
                next_note += 10
            time.sleep(0.2)
        memory = proc_memory(proc.popen.pid if proc.popen else 0)
        pods = len(admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"])
    finally:
        watch.stop()
    assert first is not None and last is not None
    busy = last - started
    gpus_admitted = sum(b["spec"]["parallelism"] for b in bodies if b["metadata"]["name"] in watch.admitted)
    return {
        "jobs": jobs,
        "gangs_of_4": sum(1 for b in bodies if b["spec"]["parallelism"] == 4),
        "gpus_asked": sum(b["spec"]["parallelism"] for b in bodies),
        "nodes": nodes,
        "gpus": nodes * GPUS_PER_NODE,
        "create_jobs_s": round(create_s, 1),
        "list_all_jobs_once_s": round(list_s, 2),
        "start_to_first_admission_s": round(first - started, 2),
        "start_to_last_admission_s": round(busy, 2),
        "admitted_jobs": admitted,
        "admitted_gpus": gpus_admitted,
        "admissions_per_s": round(admitted / busy, 1),
        "admissions_per_s_after_the_first": round((admitted - 1) / (last - first), 1)
        if last > first
        else None,
        "jobs_with_a_waiting_reason": reasons,
        "pods_made_by_the_job_controller": pods,
        "controller_rss_mib": memory.get("VmRSS"),
        "controller_peak_rss_mib": memory.get("VmHWM"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=250)
    parser.add_argument("--quick", action="store_true", help="500 Jobs on 13 nodes")
    parser.add_argument(
        "--suspend-resume", type=int, default=0, metavar="N", help="also time a Job of N pods"
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument(
        "--settle", type=float, default=20.0, help="no admission for this long: the cluster is full"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.nodes = 500, 13
    reason = missing_reason()
    if reason is not None:
        print(f"queue_jobs_scale: {reason}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="queue-jobs-scale-"))
    cp = ControlPlane(workdir / "kube")
    result: dict[str, Any] = {
        "bench": "queue_jobs_scale",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join(sys.argv[1:]),
    }
    try:
        cp.start()
        result["scale"] = scale(cp, workdir, args.jobs, args.nodes, args.timeout, args.settle)
    finally:
        cp.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
