"""Benchmark: the queue controller's admission throughput with 10,000 waiting pods on 5,000 nodes x 8 GPUs.

Two measurements of the same cluster (5,000 Nodes publishing 8 whole 80 GB GPUs each in
gpunode.io/gpu-state; 10,000 pending pods in four queues weighted 4:3:2:1 (the example queue
file), 1-8 GPUs each, about 3% of them in gangs of 4):

- end to end: `gpunode queue`'s QueueController against the API server stand-in the controller
  tests use (tests/fakes/apiserver.py), which runs in a child process so that the controller's
  memory is its own. The clock starts when the controller starts (list+watch of every pod and
  Node, then reconciles) and stops when every pod, read back through the controller's watch,
  carries the controller's decision: an admission or a waiting reason. Decisions per second =
  pods decided / that time. Every decision is a pod PATCH and an Event POST to the stand-in.
- the decision core alone: QueueCore.reconcile on the same pods and Nodes handed over in
  memory (no HTTP): the first reconcile (Scheduler built from the pods, one cycle that decides
  them all) and a second one (the admissions read back, nothing left to decide).

Also the controller process's resident memory (VmRSS and peak VmHWM, from /proc/self/status)
before and after. Prints one JSON document.

    .venv/bin/python bench/queue_admission.py [--nodes 5000] [--pods 10000] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.fakes: the stand-in the controller's tests use

from gpunode.cluster.queuectl.controller import QueueController  # noqa: E402
from gpunode.cluster.queuectl.core import QueueCore  # noqa: E402
from gpunode.cluster.queueing.config import load_queue_config  # noqa: E402
from gpunode.contract.names import QUEUE_ADMITTED_ANNOTATION, QUEUE_REASON_ANNOTATION  # noqa: E402
from gpunode.infra.kube import KubeClient  # noqa: E402

CONFIG = ROOT / "gpunode" / "examples" / "queues.yaml"
TEAMS = ("team-a", "team-b", "team-c", "team-d")


def cluster(nodes: int, pods: int, seed: int = 7) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Nodes, pending pods) as v1 JSON."""
    from tests.cluster.queuectl.helpers import node, pod

    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    i = 0
    while len(out) < pods:
        team = TEAMS[int(rng.choice(4, p=[0.4, 0.3, 0.2, 0.1]))]
        created = f"2026-01-01T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}Z"
        if rng.random() < 0.03 and len(out) + 4 <= pods:  # a gang of 4 x 4 GPUs
            out.extend(
                pod(f"g{i}-{k}", queue=team, gpus=4, gang=f"g{i}", size=4, created=created) for k in range(4)
            )
        else:
            gpus = int(rng.choice([1, 2, 4, 8], p=[0.55, 0.2, 0.15, 0.1]))
            out.append(pod(f"p{i}", queue=team, gpus=gpus, created=created))
        i += 1
    return [node(f"node-{n:05d}", 8) for n in range(nodes)], out


def memory() -> dict[str, float]:
    """This process's resident memory now and at its peak, MiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)
    return fields


def child_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a child process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the stand-in, in a child process ----------------------------------------------------------------


def serve(nodes: int, pods: int) -> None:
    """Child: fill a stand-in, print its URL, serve until stdin closes, then print its request count."""
    from tests.fakes.apiserver import ApiServerStandIn

    node_objs, pod_objs = cluster(nodes, pods)
    with ApiServerStandIn() as api:
        for n in node_objs:
            api.add_node(n["metadata"]["name"], annotations=n["metadata"]["annotations"])
        for p in pod_objs:
            api.put_pod(p)
        print(api.url, flush=True)
        sys.stdin.read()
        print(json.dumps({"requests": len(api.requests())}), flush=True)


def end_to_end(nodes: int, pods: int, timeout_s: float, in_flight: int) -> dict[str, Any]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--nodes", str(nodes), "--pods", str(pods)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert child.stdin is not None and child.stdout is not None
    url = child.stdout.readline().strip()
    before = memory()
    cpu_before = (time.process_time(), child_cpu_s(child.pid))
    result: dict[str, Any] = {}

    async def main() -> None:
        ctl = QueueController(
            KubeClient.for_host(url),
            QueueCore(load_queue_config(CONFIG)),
            resync_s=30.0,
            settle_s=0.2,
            max_in_flight=in_flight,
        )
        applied: list[float] = []  # when each reconcile's writes (annotations, Events, evictions) were done
        apply = ctl._apply

        async def timed_apply(actions: Any) -> None:
            await apply(actions)
            applied.append(time.perf_counter() - start)

        ctl._apply = timed_apply  # type: ignore[method-assign]
        start = time.perf_counter()
        task = asyncio.create_task(ctl.run())
        first_reconcile = listed = None
        try:
            while time.perf_counter() - start < timeout_s:
                await asyncio.sleep(0.25)
                if listed is None and len(ctl.core.pods) >= pods and len(ctl.core.nodes) >= nodes:
                    listed = time.perf_counter() - start
                if first_reconcile is None and ctl.reconciles:
                    first_reconcile = time.perf_counter() - start
                decided = admitted = 0
                for p in ctl.core.pods.values():
                    notes = p["metadata"].get("annotations") or {}
                    admitted += QUEUE_ADMITTED_ANNOTATION in notes
                    decided += QUEUE_ADMITTED_ANNOTATION in notes or QUEUE_REASON_ANNOTATION in notes
                if decided >= pods:
                    break
            elapsed = time.perf_counter() - start
            while not applied and time.perf_counter() - start < timeout_s:  # the Events that follow the marks
                await asyncio.sleep(0.05)
            cpu = (time.process_time() - cpu_before[0], child_cpu_s(child.pid) - cpu_before[1])
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await ctl.client.close()
        result.update(
            pods_decided=decided,
            pods_admitted=admitted,
            seconds=round(elapsed, 2),
            decisions_per_s=round(decided / elapsed, 1),
            listed_at_s=listed and round(listed, 2),
            first_reconcile_done_at_s=first_reconcile and round(first_reconcile, 2),
            writes_per_s=round(decided / (elapsed - first_reconcile), 1) if first_reconcile else None,
            all_writes_done_at_s=round(applied[0], 2) if applied else None,
            max_in_flight=in_flight,
            scheduler_rebuilds=ctl.core.rebuilds,
            reconciles=ctl.reconciles,
            controller_memory_mib={"before": before, "after": memory()},
            cpu_s={"controller": round(cpu[0], 1), "stand_in": round(cpu[1], 1)},
        )

    try:
        asyncio.run(main())
    finally:
        child.stdin.close()
        tail = child.stdout.read().strip().splitlines()
        child.wait(timeout=120)
    if tail:
        result["api_requests"] = json.loads(tail[-1])["requests"]
    return result


# -- the decision core alone -----------------------------------------------------------------------


def core_alone(nodes: int, pods: int) -> dict[str, Any]:
    node_objs, pod_objs = cluster(nodes, pods)
    before = memory()
    core = QueueCore(load_queue_config(CONFIG))
    core.replace_all(pod_objs, node_objs)
    gc.collect()
    start = time.perf_counter()
    actions = core.reconcile(1_800_000_000.0)
    first = time.perf_counter() - start
    admitted = {a.pod.key for a in actions.annotate if QUEUE_ADMITTED_ANNOTATION in a.annotations}
    held = {a.pod.key for a in actions.annotate if QUEUE_REASON_ANNOTATION in a.annotations} - admitted
    for a in actions.annotate:  # as the API server would store them
        notes = core.pods[a.pod.key]["metadata"].setdefault("annotations", {})
        notes.update({k: v for k, v in a.annotations.items() if v is not None})
    start = time.perf_counter()
    again = core.reconcile(1_800_000_001.0)
    second = time.perf_counter() - start
    return {
        "pods_decided": len(admitted) + len(held),
        "pods_admitted": len(admitted),
        "first_reconcile_s": round(first, 3),
        "decisions_per_s": round((len(admitted) + len(held)) / first, 1),
        "second_reconcile_s": round(second, 3),
        "second_reconcile_new_admissions": sum(
            1 for a in again.annotate if QUEUE_ADMITTED_ANNOTATION in a.annotations
        ),
        "memory_mib": {"before": before, "after": memory()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--pods", type=int, default=10000)
    p.add_argument("--timeout", type=float, default=1200.0, help="give up on the end-to-end run after this")
    p.add_argument("--in-flight", type=int, default=16, help="the controller's writes in flight at once")
    p.add_argument("--skip-e2e", action="store_true", help="only the decision core")
    p.add_argument("--skip-core", action="store_true", help="only the end-to-end run")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.nodes, args.pods)
        return 0
    out: dict[str, Any] = {
        "nodes": args.nodes,
        "gpus": args.nodes * 8,
        "pods": args.pods,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    if not args.skip_e2e:  # first: the controller's memory is measured in a fresh process
        out["end_to_end"] = end_to_end(args.nodes, args.pods, args.timeout, args.in_flight)
    if not args.skip_core:
        out["core_alone"] = core_alone(args.nodes, args.pods)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
