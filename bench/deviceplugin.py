"""Device-plugin latency on the simulated dgx-h100 node, over the real Unix sockets.

Measures, with the kubelet stand-in as the client:
- Allocate and GetPreferredAllocation latency, p50/p99 (target p99 < 5 ms);
- kubelet restart (kubelet.sock re-created, sockets wiped) to re-registration of
  every plugin (target < 1 s).

    .venv/bin/python bench/deviceplugin.py [--calls 2000] [--restarts 20]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn, short_socket_dir

GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50_ms": round(q[49], 3), "p99_ms": round(q[98], 3), "max_ms": round(ms[-1], 3), "n": len(ms)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--restarts", type=int, default=20)
    args = ap.parse_args()

    root = short_socket_dir("gnb")
    doc = {
        "sharing": {
            "timeSlicing": {
                "renameByDefault": True,
                "resources": [{"name": GPU, "replicas": 4, "devices": [6, 7]}],
            }
        }
    }
    cfg = make_config(root / "device-plugins", root / "state", doc)
    backend = SimBackend.from_profile("dgx-h100")
    kubelet = KubeletStandIn(root / "device-plugins").start()
    agent = RunningAgent(Agent(cfg, backend=backend)).start()
    try:
        kubelet.wait_for_resources([GPU, SHARED])
        gpus = [g.uuid for g in backend.gpus()[:6]]
        replicas = kubelet.healthy(SHARED)
        for _ in range(50):  # warm-up
            kubelet.allocate(GPU, gpus[:2])
            kubelet.preferred(GPU, gpus, 4)
        alloc, pref, pref_rep = [], [], []
        for i in range(args.calls):
            t = time.perf_counter()
            kubelet.allocate(GPU, [gpus[i % 6], gpus[(i + 3) % 6]])
            alloc.append(time.perf_counter() - t)
            t = time.perf_counter()
            kubelet.preferred(GPU, gpus, 4)
            pref.append(time.perf_counter() - t)
            t = time.perf_counter()
            kubelet.preferred(SHARED, replicas, 2)
            pref_rep.append(time.perf_counter() - t)
        reregister = []
        for _ in range(args.restarts):
            before = len(kubelet.registrations)
            t0 = kubelet.restart()
            kubelet.wait_for(
                lambda b=before: len(kubelet.registrations) >= b + 2, timeout=10, what="re-registration"
            )
            reregister.append(kubelet.registrations[-1][0] - t0)
        result = {
            "benchmark": "deviceplugin",
            "node": "sim:dgx-h100 (6 whole GPUs + 2 GPUs x 4 replicas)",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "allocate_2_gpus": percentiles(alloc),
            "preferred_4_of_6_gpus": percentiles(pref),
            "preferred_2_replicas": percentiles(pref_rep),
            "kubelet_restart_to_reregistered": percentiles(reregister),
            "targets": {"allocate_p99_ms": 5, "preferred_p99_ms": 5, "reregister_ms": 1000},
        }
        print(json.dumps(result, indent=2))
    finally:
        agent.stop()
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
