"""Fault-to-action latency of the health path on the simulated dgx-h100 node, over the real sockets.

For each injected fault (XID 79 on one GPU, round-robin over the node's GPUs)
it measures, with monotonic clocks in the same process:
- fault -> the kubelet stand-in receives a ListAndWatch update showing the GPU's
  device Unhealthy (target p99 < 200 ms; the NVIDIA plugin waits on NVML events
  with a 5 s timeout);
- fault -> the API server stand-in receives the eviction request for the pod on
  that GPU (target < 1 s), through pod-resources List, GET pod and POST eviction.
After each fault the GPU is reset and the bench waits for it to be Healthy
again (probe interval 10 ms, recovery window 50 ms), so every fault is a
fresh transition.

    .venv/bin/python bench/health.py [--faults 200]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tests.node.test_health_matrix as matrix
from tests.fakes.kubelet import short_socket_dir
from tests.node.test_health_matrix import NODE, Node

GPU = "nvidia.com/gpu"


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50_ms": round(q[49], 3), "p99_ms": round(q[98], 3), "max_ms": round(ms[-1], 3), "n": len(ms)}


async def measure(node: Node, faults: int) -> tuple[list[float], list[float]]:
    to_unhealthy: list[float] = []
    to_eviction: list[float] = []
    view = node.kubelet.plugins[GPU]
    for n in range(faults):
        gpu = node.gpus[n % len(node.gpus)]
        pod = f"g{gpu.index}"
        node.api.add_pod("team", pod, node_name=NODE)  # a new pod (new UID) on that GPU each round
        evictions_before = len(node.api.requests("POST", r"/eviction$"))
        updates_before = view.updates
        t0 = time.monotonic()
        node.backend.inject_xid(gpu.uuid, 79)
        await asyncio.to_thread(
            node.kubelet.wait_for, lambda u=gpu.uuid: view.devices.get(u) == "Unhealthy", 10.0, "unhealthy"
        )
        # Nothing else changes meanwhile: the first update after the fault is the one that carries it.
        arrival = view.update_times[updates_before]
        to_unhealthy.append(arrival - t0)
        await asyncio.to_thread(
            node.api.wait_for,
            lambda n=evictions_before: len(node.api.requests("POST", r"/eviction$")) > n,
            10.0,
            "eviction",
        )
        to_eviction.append(node.api.requests("POST", r"/eviction$")[evictions_before].at - t0)
        node.backend.reset_gpu(gpu.uuid)
        await asyncio.to_thread(
            node.kubelet.wait_for, lambda u=gpu.uuid: view.devices.get(u) == "Healthy", 10.0, "healthy"
        )
    return to_unhealthy, to_eviction


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=200)
    args = ap.parse_args()
    logging.getLogger("gpunode").setLevel(logging.ERROR)  # one warning per fault otherwise

    matrix.HEALTH = {
        "probeInterval": "10ms",
        "probeTimeout": "500ms",
        "recoveryWindow": "50ms",
    }
    matrix.REMEDIATION = {
        "retryInitial": "20ms",
        "retryMax": "200ms",
        "requestTimeout": "2s",
        "maxEvictions": 1000000,
        "evictionInterval": "1s",
    }
    root = short_socket_dir("gnhb")
    try:

        async def run() -> tuple[list[float], list[float]]:
            node = Node("dgx-h100", {}, root)
            async with node.running():
                return await measure(node, args.faults)

        to_unhealthy, to_eviction = asyncio.run(run())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "bench": "health",
        "profile": "dgx-h100",
        "faults": args.faults,
        "fault_to_list_and_watch_unhealthy": percentiles(to_unhealthy) | {"target_p99_ms": 200},
        "fault_to_eviction_request": percentiles(to_eviction) | {"target_p99_ms": 1000},
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
