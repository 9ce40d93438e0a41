"""Admission -> all members bound for a gang: pods held by the scheduling gate vs the extender's hold. Prints JSON.

    .venv/bin/python bench/queue_gate_e2e.py [--rounds N] [--sizes 4,16] [--workdir DIR]

The cluster of tests.e2e.queue (real etcd, kube-apiserver, kube-controller-manager and kube-scheduler,
the extender with --queue-hold error, one `gpunode queue` leading) with two more simulated nodes, so
that a gang of 16 one-GPU members fits (four nodes of four GPUs). For each gang size the two ways of
holding alternate round by round on the same cluster:

- hold: the members are created without a gate; kube-scheduler tries them, the extender answers their
  filter with the queue's Error, and after the controller's mark they wait for kube-scheduler to try
  them again;
- gate: the members are created with the scheduling gate gpunode.io/admission (as the webhook would
  add it); kube-scheduler leaves them alone until the controller marks them, pins them to the plan's
  node and removes the gate.

Latency, as in bench/queue_gang_e2e.py: from the first admission mark seen on a member (a watch on the
namespace's pods) to the last member seen bound; also from the creation of the gang to the last bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.queue_gang_e2e import PodWatch
from gpunode.contract.names import ADMISSION_GATE, NODE_STATE_ANNOTATION
from gpunode.contract.nodestate import decode
from tests.e2e.api import Api, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import ControlPlane, missing_reason
from tests.e2e.queue import (
    NAMESPACE,
    WAIT_S,
    QueueCluster,
    build_queue_cluster,
    queued_pod,
    stop_queue_cluster,
    submit,
)
from tests.e2e.simnodes import SimNode, seeded_t4, state_published

EXTRA_NODES = ("e2e-queue-n3", "e2e-queue-n4")
MODES = ("hold", "gate")


def one_round(api: Api, ca_file: Path, tag: str, size: int, mode: str) -> dict[str, Any]:
    """Create one gang, wait until every member is bound; its timings in ms."""
    members = [f"{tag}-{i}" for i in range(size)]
    bodies = [queued_pod(m, "team-a", 1, gang=tag, size=size) for m in members]
    if mode == "gate":
        for body in bodies:
            body["spec"]["schedulingGates"] = [{"name": ADMISSION_GATE}]
    rv = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["metadata"]["resourceVersion"]
    watch = PodWatch(api, ca_file).start(rv)
    try:
        created = time.monotonic()
        submit(api, *bodies)

        def done() -> tuple[dict[str, float], dict[str, float]] | None:
            marked, bound = watch.seen()
            return (marked, bound) if all(m in bound and m in marked for m in members) else None

        marked, bound = eventually(done, timeout_s=WAIT_S, what=f"gang {tag} bound", interval_s=0.05)
    finally:
        watch.stop()
    first_mark = min(marked[m] for m in members)
    last_bound = max(bound[m] for m in members)
    return {
        "mark_to_all_bound_ms": round((last_bound - first_mark) * 1000, 1),
        "created_to_all_bound_ms": round((last_bound - created) * 1000, 1),
    }


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(values), 1),
        "min": min(values),
        "max": max(values),
    }


def _held(api: Api, nodes: list[str]) -> dict[str, tuple[str, ...]]:
    """GPU UUID -> the pods holding it, as the nodes publish them (held GPUs only)."""
    out: dict[str, tuple[str, ...]] = {}
    for name in nodes:
        text = api.get(f"/api/v1/nodes/{name}")["metadata"].get("annotations", {}).get(NODE_STATE_ANNOTATION)
        if text:
            out |= {g.uuid: tuple(g.pods) for g in decode(text, node=name).gpus if g.pods}
    return out


def _all_free(cluster: QueueCluster) -> None:
    """tests.e2e.queue.delete_all_pods over every node of the cluster (the extra ones too): every bound pod
    published first (a pod deleted before its node lists it keeps its GPU held), then deleted, then every
    GPU published free."""
    admin = cluster.cp.api()
    nodes = list(cluster.nodes)
    pods_path = f"/api/v1/namespaces/{NAMESPACE}/pods"

    def bound_published() -> bool:
        pods = admin.get(pods_path)["items"]
        bound = {f"{NAMESPACE}/{p['metadata']['name']}" for p in pods if p["spec"].get("nodeName")}
        return bound <= {pod for holders in _held(admin, nodes).values() for pod in holders}

    eventually(bound_published, timeout_s=WAIT_S, what="every bound pod published")
    for pod in admin.get(pods_path)["items"]:
        admin.delete(f"{pods_path}/{pod['metadata']['name']}?gracePeriodSeconds=0")
    eventually(lambda: not admin.get(pods_path)["items"], timeout_s=WAIT_S, what="every pod deleted")
    eventually(lambda: not _held(admin, nodes), timeout_s=WAIT_S, what="every GPU published free")


def main() -> int:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per size and way of holding")
    parser.add_argument("--sizes", default="4,16", help="gang sizes, one GPU per member (at most 16)")
    parser.add_argument("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    reason = missing_reason()
    if reason is not None:
        print(json.dumps({"skipped": reason}))
        return 1
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpunode-gate-"))
    cp = ControlPlane(workdir / "kube", users=E2E_USERS).start()
    results: dict[str, Any] = {}
    try:
        version = cp.api().get("/version")["gitVersion"]
        (workdir / "queue").mkdir()
        cluster = build_queue_cluster(cp, workdir / "queue")
        try:
            admin = cp.api()
            for name in EXTRA_NODES:
                node = SimNode(
                    cp, name, workdir / "queue" / name, profile=str(seeded_t4(workdir / "queue", name))
                )
                cluster.nodes[name] = node.start()  # the Reaper releases its devices too
                eventually(
                    partial(state_published, admin, name), timeout_s=WAIT_S, what=f"{name}'s GPU state"
                )
            cluster.start_controller("queue-1")
            eventually(lambda: cluster.leader() == "queue-1", timeout_s=WAIT_S, what="the controller leading")
            for size in sizes:
                rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
                for n in range(args.rounds):
                    for mode in MODES:
                        rounds[mode].append(one_round(admin, cp.ca_file, f"{mode}{size}-{n}", size, mode))
                        _all_free(cluster)
                results[f"gang_{size}"] = {
                    mode: {
                        "mark_to_all_bound_ms": _summary([r["mark_to_all_bound_ms"] for r in rs]),
                        "created_to_all_bound_ms": _summary([r["created_to_all_bound_ms"] for r in rs]),
                        "per_round": rs,
                    }
                    for mode, rs in rounds.items()
                }
        finally:
            stop_queue_cluster(cluster)
    finally:
        cp.stop()
    print(
        json.dumps(
            {"kubernetes": version, "rounds": args.rounds, "results": results, "logs": str(cp.logs)}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
