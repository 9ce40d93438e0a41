"""Benchmark of the metrics endpoint: scrape latency, agent memory and CPU per scrape. Prints JSON.

    .venv/bin/python bench/scrape.py [--scrapes 5000] [--scenario dgx-h100|h100-mig-64pods|all]

For each scenario a child process runs what the agent runs for metrics (a
simulated node, the background collector at a 1 s interval, the HTTP endpoint,
pod attribution through the kubelet's pod-resources API) and nothing else. The
pod-resources stand-in runs in this parent process, so the child's memory is
the collector's and the server's own. This process scrapes over one keep-alive
loopback connection, as Prometheus does, and reports:

  scrape_latency_ms   p50/p90/p99/max wall time of GET /metrics, request sent to body read
  cpu_ms_per_scrape   the child's user+system CPU during the scrape loop, less the CPU its
                      background collections used meanwhile, divided by the number of scrapes
  cpu_ms_per_collection  the child's CPU per background collection, measured with no scrapes
  rss_mb / peak_rss_mb   the child's resident memory (VmRSS / VmHWM) after the scrape loop
  body_bytes, series  the size of one scrape

Scenarios: dgx-h100 (8 whole H100s, 8 pods each holding one) and h100-mig-64pods
(8 H100s in 7x 1g.10gb MIG = 56 instances, time-sliced in 2 replicas each,
64 pods each holding one replica). When gpunode.node.memcap is built, every pod
also has a memory-cap region with memory held in it by a live process, so
per-pod memory series are collected and served too.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TICKS_PER_S = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(ROOT))

SCENARIOS: dict[str, dict[str, Any]] = {
    "dgx-h100": {"profile": "dgx-h100", "config": {}, "pods": 8},
    "h100-mig-64pods": {
        "profile": "h100-mig",
        "config": {
            "flags": {"migStrategy": "mixed"},
            "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/mig-1g.10gb", "replicas": 2}]}},
        },
        "pods": 64,
    },
}


def _cpu_s(pid: int) -> float:
    """User + system CPU of the whole process, threads that have ended included (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def _rss_mb(pid: int) -> tuple[float, float]:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def _get(conn: http.client.HTTPConnection, path: str) -> bytes:
    conn.request("GET", path)
    r = conn.getresponse()
    body = r.read()
    if r.status != 200:
        raise SystemExit(f"GET {path}: HTTP {r.status}")
    return body


def _metric(body: bytes, name: str) -> float:
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- the child: what the agent runs for metrics ---------------------------------------------------


def serve(scenario: str, socket_path: str, regions_root: str | None, port_file: str) -> None:
    from gpunode.config.agent import parse_config
    from gpunode.node.devices.simnode.backend import SimBackend
    from gpunode.node.inventory import build_inventory
    from gpunode.node.kubelet.podresources import PodAttribution
    from gpunode.node.metrics import MetricsCollector, MetricsConfig, MetricsServer

    spec = SCENARIOS[scenario]
    backend = SimBackend.from_profile(spec["profile"])
    inventory = build_inventory(backend.gpus(), parse_config({"version": "v1", **spec["config"]}, "bench"))

    async def main() -> None:
        collector = MetricsCollector(
            backend=backend,
            hostname="bench-node",
            config=MetricsConfig(interval_s=1.0),
            inventory=lambda: inventory,
            health=dict,
            attribution=PodAttribution(socket_path, ttl_s=5.0),
            regions_root=Path(regions_root) if regions_root else None,
        )
        server = MetricsServer(collector, "127.0.0.1:0")
        await server.start()
        ready = asyncio.Event()
        task = asyncio.create_task(collector.run(ready=ready))
        await ready.wait()
        Path(port_file).write_text(str(server.port))
        await task

    asyncio.run(main())


# -- the parent -----------------------------------------------------------------------------------


def _pods_for(scenario: str) -> tuple[list[Any], Any]:
    from gpunode.config.agent import parse_config
    from gpunode.node.devices.simnode.backend import SimBackend
    from gpunode.node.inventory import build_inventory
    from gpunode.node.kubelet.podresources import ContainerDevices

    spec = SCENARIOS[scenario]
    backend = SimBackend.from_profile(spec["profile"])
    inventory = build_inventory(backend.gpus(), parse_config({"version": "v1", **spec["config"]}, "bench"))
    devices = inventory.devices[: spec["pods"]]
    pods = [
        ContainerDevices(f"ns-{i % 8}", f"pod-{i}", "main", d.resource, (d.id,))
        for i, d in enumerate(devices)
    ]
    return pods, inventory


def _make_regions(root: Path, pods: list[Any], inventory: Any) -> Any:
    """One memory-cap region per pod, and one process holding memory in all of them; None without memcap."""
    import importlib

    try:
        memcap: Any = importlib.import_module("gpunode.node.memcap")
        importlib.import_module("gpunode._memcap")
    except ImportError:
        return None
    from gpunode.node.inventory import region_key
    from tests.fakes import CappedProcess

    holdings = []
    for i, pod in enumerate(pods):
        d = inventory.by_id(pod.device_ids[0])
        region = memcap.create_region(
            root,
            region_key(pod.device_ids),
            gpu_uuid=d.mig_uuid or d.gpu_uuid,
            limit_bytes=4 << 30,
            device_total_bytes=10 << 30,
        )
        holdings.append((region.path, {0: (i + 1) << 24}))
    return CappedProcess(holdings[0][0], holdings[0][1], also=holdings[1:]).start()


def run_scenario(scenario: str, scrapes: int) -> dict[str, Any]:
    from tests.fakes.podresources import PodResourcesStandIn

    pods, inventory = _pods_for(scenario)
    with tempfile.TemporaryDirectory(prefix="gpn-bench-", dir="/tmp") as tmp:
        regions = Path(tmp) / "regions"
        regions.mkdir()
        holder = _make_regions(regions, pods, inventory)
        have_regions = holder is not None
        port_file = Path(tmp) / "port"
        with PodResourcesStandIn(os.path.join(tmp, "kubelet.sock")) as kubelet:
            kubelet.set_pods(pods)
            child = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--serve",
                    scenario,
                    "--socket",
                    kubelet.socket_path,
                    "--port-file",
                    str(port_file),
                    *(["--regions", str(regions)] if have_regions else []),
                ],
                cwd=ROOT,
            )
            try:
                deadline = time.monotonic() + 60
                while not port_file.exists() or not port_file.read_text():
                    if child.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("the metrics child did not start")
                    time.sleep(0.05)
                port = int(port_file.read_text())
                return _measure(child.pid, port, scrapes) | {
                    "pods": len(pods),
                    "memcap_regions": have_regions,
                }
            finally:
                child.terminate()
                child.wait(30)
                if holder is not None:
                    holder.stop()


def _measure(pid: int, port: int, scrapes: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = _get(conn, "/metrics")
    for _ in range(20):  # warm-up
        body = _get(conn, "/metrics")

    # Collection cost alone: an idle window of several collections, no scrapes.
    c0, n0 = _cpu_s(pid), _metric(body, "gpunode_metrics_collections_total")
    time.sleep(10.0)
    body = _get(conn, "/metrics")
    c1, n1 = _cpu_s(pid), _metric(body, "gpunode_metrics_collections_total")
    per_collection_s = (c1 - c0) / max(n1 - n0, 1)
    collection_wall = _metric(body, "gpunode_metrics_collection_duration_seconds_sum") / max(
        _metric(body, "gpunode_metrics_collection_duration_seconds_count"), 1
    )

    # The scrape loop.
    latencies_ms: list[float] = []
    c2, n2 = _cpu_s(pid), _metric(body, "gpunode_metrics_collections_total")
    for _ in range(scrapes):
        t = time.perf_counter()
        body = _get(conn, "/metrics")
        latencies_ms.append((time.perf_counter() - t) * 1e3)
    c3, n3 = _cpu_s(pid), _metric(body, "gpunode_metrics_collections_total")
    conn.close()
    scrape_cpu_s = max(0.0, (c3 - c2) - (n3 - n2) * per_collection_s)
    rss, peak = _rss_mb(pid)
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    return {
        "scrapes": scrapes,
        "scrape_latency_ms": {
            "p50": round(statistics.median(latencies_ms), 3),
            "p90": round(_percentile(latencies_ms, 0.90), 3),
            "p99": round(_percentile(latencies_ms, 0.99), 3),
            "max": round(max(latencies_ms), 3),
        },
        "cpu_ms_per_scrape": round(scrape_cpu_s / scrapes * 1e3, 3),
        "cpu_ms_per_collection": round(per_collection_s * 1e3, 3),
        "collection_wall_ms": round(collection_wall * 1e3, 3),
        "collections_during_scrapes": int(n3 - n2),
        "rss_mb": round(rss, 1),
        "peak_rss_mb": round(peak, 1),
        "body_bytes": len(body),
        "series": series,
        "targets": {"scrape_p99_ms": 20, "rss_mb": 80},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--scrapes", type=int, default=5000)
    ap.add_argument("--serve", choices=list(SCENARIOS), help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--regions", help=argparse.SUPPRESS)
    ap.add_argument("--port-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.socket, args.regions, args.port_file)
        return
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    results = {name: run_scenario(name, args.scrapes) for name in names}
    print(
        json.dumps(
            {
                "benchmark": "metrics scrape",
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
