"""Admission-to-bind latency of a queued gang on the real control plane. Prints JSON.

    .venv/bin/python bench/queue_gang_e2e.py [--rounds N] [--size N] [--workdir DIR]

Starts the cluster of tests.e2e.queue (etcd, kube-apiserver, kube-controller-manager and kube-scheduler
as scripts/get-kube.sh builds them, the extender with --queue-config and its default --queue-hold error,
two simulated-agent nodes of four GPUs, one `gpunode queue` controller leading). Each round creates a gang
of `size` one-GPU pods in team-a at once and watches the namespace's pods: the latency is from the first
admission mark written (the first watch event carrying a member's queue-admitted annotation) to the last
member bound (the first event carrying its spec.nodeName), then the pods are deleted and every GPU waits
to be published free. The members wait in kube-scheduler's queue before the mark (the extender answers
their filter with the queue's Error), so the figure includes how soon kube-scheduler tries a pod again
after the controller's annotation write.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpunode.contract.names import QUEUE_ADMITTED_ANNOTATION
from tests.e2e.api import Api, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import ControlPlane, missing_reason
from tests.e2e.queue import (
    NAMESPACE,
    WAIT_S,
    build_queue_cluster,
    delete_all_pods,
    queued_pod,
    stop_queue_cluster,
    submit,
)


class PodWatch:
    """A watch on the namespace's pods: when each pod was first seen marked and first seen bound."""

    def __init__(self, api: Api, ca_file: Path) -> None:
        host, port = api.server.removeprefix("https://").split(":")
        self._conn = http.client.HTTPSConnection(
            host, int(port), context=ssl.create_default_context(cafile=str(ca_file)), timeout=600
        )
        self._token = api.token
        self.marked: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stopped = threading.Event()

    def start(self, resource_version: str) -> PodWatch:
        path = f"/api/v1/namespaces/{NAMESPACE}/pods?watch=1&resourceVersion={resource_version}"
        self._conn.request("GET", path, headers={"Authorization": f"Bearer {self._token}"})
        self._resp = self._conn.getresponse()
        assert self._resp.status == 200, self._resp.status
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._read()
        except (OSError, ValueError, AttributeError):  # the connection closed by stop()
            if not self._stopped.is_set():
                raise

    def _read(self) -> None:
        while line := self._resp.readline():
            now = time.monotonic()
            event = json.loads(line)
            pod = event["object"]
            if event["type"] not in ("ADDED", "MODIFIED") or pod.get("kind") != "Pod":
                continue
            name = pod["metadata"]["name"]
            with self._lock:
                if QUEUE_ADMITTED_ANNOTATION in (pod["metadata"].get("annotations") or {}):
                    self.marked.setdefault(name, now)
                if pod["spec"].get("nodeName"):
                    self.bound.setdefault(name, now)

    def seen(self) -> tuple[dict[str, float], dict[str, float]]:
        with self._lock:
            return dict(self.marked), dict(self.bound)

    def stop(self) -> None:
        self._stopped.set()
        self._conn.close()


def one_round(api: Api, ca_file: Path, n: int, size: int) -> dict[str, Any]:
    """Create one gang, wait until every member is bound; its timings in ms."""
    members = [f"gang{n}-{i}" for i in range(size)]
    rv = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["metadata"]["resourceVersion"]
    watch = PodWatch(api, ca_file).start(rv)
    try:
        created = time.monotonic()
        submit(api, *(queued_pod(m, "team-a", 1, gang=f"gang{n}", size=size) for m in members))

        def done() -> tuple[dict[str, float], dict[str, float]] | None:
            marked, bound = watch.seen()
            return (marked, bound) if all(m in bound and m in marked for m in members) else None

        marked, bound = eventually(done, timeout_s=WAIT_S, what=f"gang {n} bound", interval_s=0.05)
    finally:
        watch.stop()
    first_mark = min(marked[m] for m in members)
    return {
        "created_to_first_mark_ms": round((first_mark - created) * 1000, 1),
        "marks_spread_ms": round((max(marked[m] for m in members) - first_mark) * 1000, 1),
        "mark_to_all_bound_ms": round((max(bound[m] for m in members) - first_mark) * 1000, 1),
        "mark_to_bound_each_ms": sorted(round((bound[m] - marked[m]) * 1000, 1) for m in members),
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--size", type=int, default=4, help="members per gang, one GPU each (at most 8)")
    parser.add_argument("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    args = parser.parse_args()
    reason = missing_reason()
    if reason is not None:
        print(json.dumps({"skipped": reason}))
        return 1
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpunode-gang-"))
    cp = ControlPlane(workdir / "kube", users=E2E_USERS).start()
    try:
        version = cp.api().get("/version")["gitVersion"]
        (workdir / "queue").mkdir()
        cluster = build_queue_cluster(cp, workdir / "queue")
        try:
            cluster.start_controller("queue-1")
            eventually(lambda: cluster.leader() == "queue-1", timeout_s=WAIT_S, what="the controller leading")
            admin = cp.api()
            rounds = []
            for n in range(args.rounds):
                rounds.append(one_round(admin, cp.ca_file, n, args.size))
                delete_all_pods(cluster)
        finally:
            stop_queue_cluster(cluster)
    finally:
        cp.stop()
    latencies = [r["mark_to_all_bound_ms"] for r in rounds]
    print(
        json.dumps(
            {
                "kubernetes": version,
                "gang_size": args.size,
                "rounds": len(rounds),
                "mark_to_all_bound_ms": {
                    "p50": round(statistics.median(latencies), 1),
                    "p99": _quantile(latencies, 0.99),
                    "max": max(latencies),
                    "min": min(latencies),
                },
                "per_round": rounds,
                "logs": str(cp.logs),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
