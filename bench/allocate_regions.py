"""Allocate latency as memory-cap regions pile up, on the simulated dgx-h100 node, over the real sockets.

Every GPU of the node is fractional (1 GiB units); each Allocate asks for 1-8 units
at a new offset for a new container (a distinct region key), as the kubelet does on
a node with churn. The pod-resources socket does not exist, so no region is ever
collected by the kubelet's word (clean-up cannot run), the case where regions
grew without bound. At 10, 1,000 and 3,000 Allocates made so far the next
--samples calls are timed; each stage reports their p50/p99, the live regions,
the state directory's size and the agent's resident memory.

    .venv/bin/python bench/allocate_regions.py [--samples 100] [--stages 10,1000,3000]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn, short_socket_dir

MEM = "gpunode.io/gpu-memory"


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50_ms": round(q[49], 3), "p99_ms": round(q[98], 3), "max_ms": round(ms[-1], 3), "n": len(ms)}


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def request(units: dict[str, list[str]], gpus: list[str], i: int) -> list[str]:
    """The units of Allocate number i: GPU i % 8, 1-8 units at an offset no earlier call on it used."""
    gpu = gpus[i % len(gpus)]
    j = i // len(gpus)
    size = 1 + j % 8
    ids = units[gpu]
    offset = (j // 8) % (len(ids) - 8)
    return ids[offset : offset + size]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--stages", default="10,1000,3000")
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]

    root = short_socket_dir("gnr")
    doc = {
        "gpunode": {
            "fractional": {"devices": "all", "unit": "1Gi"},
            "podResourcesSocket": str(root / "absent" / "kubelet.sock"),
        }
    }
    cfg = make_config(root / "device-plugins", root / "state", doc)
    backend = SimBackend.from_profile("dgx-h100")
    kubelet = KubeletStandIn(root / "device-plugins").start()
    agent = RunningAgent(Agent(cfg, backend=backend)).start()
    try:
        kubelet.wait_for_resources([MEM])
        gpus = [g.uuid for g in backend.gpus()]
        every = kubelet.healthy(MEM)
        units = {
            g: sorted((u for u in every if u.startswith(g + "::")), key=lambda u: int(u.rsplit("mem", 1)[1]))
            for g in gpus
        }
        made = 0
        out_stages = []
        regions_root = root / "state" / "memcap"
        for stage in stages:
            while made < stage:
                kubelet.allocate(MEM, request(units, gpus, made))
                made += 1
            samples = []
            for _ in range(args.samples):
                ids = request(units, gpus, made)
                t = time.perf_counter()
                kubelet.allocate(MEM, ids)
                samples.append(time.perf_counter() - t)
                made += 1
            regions = sum(1 for p in regions_root.iterdir() if p.is_dir() and not p.name.startswith("."))
            out_stages.append(
                {
                    "allocates_before": stage,
                    "allocate": percentiles(samples),
                    "regions_after": regions,
                    "state_dir_mb": round(tree_bytes(root / "state") / 1e6, 2),
                    "rss_mib": rss_mib(),
                }
            )
        commit = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        print(
            json.dumps(
                {
                    "bench": "allocate_regions",
                    "commit": commit,
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "node": "sim dgx-h100, fractional on all 8 GPUs, 1 GiB units, pod-resources unreachable",
                    "samples_per_stage": args.samples,
                    "stages": out_stages,
                    "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                },
                indent=2,
            )
        )
    finally:
        agent.stop()
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
