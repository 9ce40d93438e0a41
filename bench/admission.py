"""Benchmark: one admission decision over 10,000 pending jobs on 5,000 nodes x 8 GPUs.

The cluster (40,000 A100s, placement policy "gpunode" with the energy term off)
is first filled to about 95% with running jobs of 1, 2, 4 and 8 GPUs and some
multi-pod gangs, in four queues weighted 4:3:2:1 whose guarantees add up to the
cluster; then 10,000 more jobs of the same mix (with varied CPU and memory
requests, so many distinct shapes) wait. Each round one running job finishes
(Scheduler.finished) and one scheduling cycle runs (Scheduler.cycle): the cycle
is the admission decision that is timed, from the call to its return, including
fair shares, queue order, quota checks, placement trials, preemption and
backfill. Setup (filling the cluster) is not timed.

Prints one JSON document: p50/p99/max/mean milliseconds per cycle (wall clock, and
the process's CPU time: on a shared machine the wall clock also counts waiting for
a core), jobs admitted per cycle, and the pending count, per policy.

    .venv/bin/python bench/admission.py [--nodes 5000] [--pending 10000] [--rounds 200] [--policies gpunode,kai]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.config import BackfillSettings, parse_queue_config
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import Job
from gpunode.cluster.queueing.presets import PRESETS, preset
from gpunode.contract.names import GIB
from gpunode.placement import TargetPod, TargetWorkload
from gpunode.placement.model import GpuState, NodeState, Request

TEAMS = (("team-a", 4), ("team-b", 3), ("team-c", 2), ("team-d", 1))
WORKLOAD = TargetWorkload(
    (
        TargetPod(cpu_milli=4000, gpu_milli=1000, gpus=1, gpu_models=None, weight=6),
        TargetPod(cpu_milli=8000, gpu_milli=1000, gpus=2, gpu_models=None, weight=2),
        TargetPod(cpu_milli=16000, gpu_milli=1000, gpus=4, gpu_models=None, weight=1),
        TargetPod(cpu_milli=32000, gpu_milli=1000, gpus=8, gpu_models=None, weight=1),
    )
)


def node(i: int) -> NodeState:
    """An empty 8 x A100 40 GB node."""
    name = f"node-{i:05d}"
    return NodeState(
        name=name,
        gpus=tuple(
            GpuState(
                uuid=f"{name}-gpu{j}",
                index=j,
                model="A100",
                milli_free=1000,
                memory_total_bytes=40 * GIB,
                memory_free_bytes=40 * GIB,
                numa_node=j // 4,
            )
            for j in range(8)
        ),
        cpu_milli_free=256000,
        memory_free_bytes=2048 * GIB,
    )


def make_job(i: int, rng: np.random.Generator, t: float) -> Job:
    """A job of the mix: mostly one pod of 1-8 GPUs, some gangs of 2-4 pods."""
    team = TEAMS[int(rng.choice(4, p=[0.4, 0.3, 0.2, 0.1]))][0]
    pods = int(rng.choice([1, 2, 4], p=[0.9, 0.07, 0.03]))
    gpus = int(rng.choice([1, 2, 4, 8], p=[0.55, 0.2, 0.15, 0.1])) if pods == 1 else int(rng.choice([4, 8]))
    cpu = int(rng.choice([1, 2, 4, 8])) * 1000 * gpus
    request = Request(gpus=gpus, cpu_milli=cpu, memory_bytes=int(rng.choice([8, 16, 32])) * GIB * gpus)
    return Job(
        name=f"job-{i:06d}",
        queue=team,
        pods=(request,) * pods,
        arrival=t,
        priority=int(rng.choice([0, 0, 0, 1])),
        runtime_estimate=float(rng.choice([600, 3600, 4 * 3600, 24 * 3600])),
    )


def run(
    policy: str,
    nodes: int,
    pending: int,
    rounds: int,
    seed: int,
    profile: Any = None,
    *,
    freeze: bool = True,
    reservations: int = BackfillSettings.reservations,
    share_reclaim: dict[str, Any] | bool | None = None,
    overdue_remaining: float = BackfillSettings.overdue_remaining,
) -> dict[str, Any]:
    """Fill, queue, then time `rounds` finish+cycle rounds (freeze: gc.freeze() the setup's objects first)."""
    rng = np.random.default_rng(seed)
    total = nodes * 8
    config = parse_queue_config(
        {
            "queues": [{"name": n, "weight": w, "guarantee": {"gpu": total * w // 10}} for n, w in TEAMS],
            "preemption": {
                "notice": "5m",
                "minRuntime": "10m",
                **({} if share_reclaim is None else {"shareReclaim": share_reclaim}),
            },
            "backfill": {"reservations": reservations, "overdueRemaining": overdue_remaining},
        },
        "bench",
    )
    cap = ClusterCapacity([node(i) for i in range(nodes)], workload=WORKLOAD, policy="gpunode", seed=seed)
    sched = Scheduler(config, cap, preset(policy))
    started = time.perf_counter()
    i = 0
    while cap.free()["gpu"] > total * 50:  # fill to about 95%
        batch = [make_job(i + k, rng, 0.0) for k in range(2000)]
        i += len(batch)
        for job in batch:
            sched.submit(job, 0.0)
        sched.cycle(0.0)
    for _ in range(pending - sched.pending_count):
        sched.submit(make_job(i, rng, 1.0), 1.0)
        i += 1
    sched.cycle(1.0)
    setup_s = time.perf_counter() - started
    gc.collect()
    if freeze:  # the long-lived setup objects leave the collector's generations (as a server would do)
        gc.freeze()
    collections = [s["collections"] for s in gc.get_stats()]
    times: list[float] = []
    cpu: list[float] = []  # CPU time of the process per cycle: what a busy shared machine does not inflate
    admitted: list[int] = []
    now = 3600.0
    for _ in range(rounds):
        now += 10.0
        running = sorted(sched.running)
        sched.finished(running[int(rng.integers(len(running)))], now)
        while sched.pending_count < pending:  # keep the queue at its size
            sched.submit(make_job(i, rng, now), now)
            i += 1
        if profile is not None:
            profile.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        d = sched.cycle(now)
        times.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
        if profile is not None:
            profile.disable()
        admitted.append(len(d.admit))
    ms = np.array(times)
    result = {
        "policy": policy,
        "nodes": nodes,
        "gpus": total,
        "pending": sched.pending_count,
        "running": len(sched.running),
        "allocated_pct": round(100 * (1 - cap.free()["gpu"] / (total * 1000)), 2),
        "rounds": rounds,
        "cycle_ms": {
            "p50": round(float(np.percentile(ms, 50)), 2),
            "p99": round(float(np.percentile(ms, 99)), 2),
            "max": round(float(ms.max()), 2),
            "mean": round(float(ms.mean()), 2),
        },
        "cycle_cpu_ms": {
            "p50": round(float(np.percentile(cpu, 50)), 2),
            "p99": round(float(np.percentile(cpu, 99)), 2),
            "max": round(float(np.max(cpu)), 2),
        },
        "admitted_per_cycle_mean": round(float(np.mean(admitted)), 2),
        "gc_freeze": freeze,
        "gc_collections_by_generation": [
            s["collections"] - c for s, c in zip(gc.get_stats(), collections, strict=True)
        ],
        "setup_s": round(setup_s, 1),
    }
    gc.unfreeze()
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--pending", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--policies", default="gpunode")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--no-freeze", action="store_true", help="leave the setup's objects to the garbage collector"
    )
    ap.add_argument(
        "--reservations",
        type=int,
        default=BackfillSettings.reservations,
        help=f"backfill.reservations of the queue configuration (default {BackfillSettings.reservations}, "
        "the configuration's default)",
    )
    ap.add_argument(
        "--share-reclaim",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="preemption.shareReclaim of the queue configuration, e.g. '{\"keepReservations\": false}' or "
        "false (default: the configuration's defaults)",
    )
    ap.add_argument(
        "--overdue-remaining",
        type=float,
        default=BackfillSettings.overdue_remaining,
        help="backfill.overdueRemaining of the queue configuration (default "
        f"{BackfillSettings.overdue_remaining}, the configuration's default)",
    )
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in PRESETS:
            ap.error(f"unknown policy {p!r}; known: {', '.join(PRESETS)}")
    results = [
        run(
            p,
            args.nodes,
            args.pending,
            args.rounds,
            args.seed,
            freeze=not args.no_freeze,
            reservations=args.reservations,
            share_reclaim=args.share_reclaim,
            overdue_remaining=args.overdue_remaining,
        )
        for p in policies
    ]
    doc = {
        "benchmark": "admission",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "target": "p99 cycle < 100 ms at 10,000 pending, 5,000 nodes x 8 GPUs",
        "share_reclaim": args.share_reclaim,
        "overdue_remaining": args.overdue_remaining,
        "results": results,
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
