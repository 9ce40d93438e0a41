"""Whole-agent resident memory on a simulated node, started as an operator starts it. Prints JSON.

    .venv/bin/python bench/agent_memory.py [--profile dgx-h100] [--runs 3] [--settle 20]

Each run starts `gpunode agent --backend sim --sim-profile PROFILE` in a child
process with its metrics endpoint on a free port, a kubelet stand-in in this
process (so the device plugins register and ListAndWatch streams stay open, as
with a real kubelet) and fractional GPUs on half of the GPUs (so the memory-cap
machinery is loaded too). Once the agent answers /ready, it is scraped 100
times, left alone for `--settle` seconds, and its VmRSS, VmHWM, threads and
open fds are read from /proc. Reported per run and as the median over runs;
the target is a whole agent under 80 MB resident (dcgm-exporter alone is
commonly reported at 200-500 MB).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.kubelet import KubeletStandIn, short_socket_dir
from tests.ports import free_port

TARGET_MB = 80.0


def get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return 0
    finally:
        conn.close()


def figures(pid: int) -> dict[str, Any]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return {
        "rss_mb": round(int(fields["VmRSS"].split()[0]) / 1000, 1),
        "rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
        "peak_rss_mb": round(int(fields["VmHWM"].split()[0]) / 1000, 1),
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def one_run(profile: str, settle_s: float) -> dict[str, Any]:
    work = short_socket_dir("gnmem")
    kubelet_dir = work / "device-plugins"
    kubelet_dir.mkdir()
    port = free_port()
    config = work / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "gpunode": {
                    "fractional": {"devices": [0, 1, 2, 3], "unit": "1Gi"},
                    "metrics": {"listen": f"127.0.0.1:{port}"},
                },
            }
        )
    )
    kubelet = KubeletStandIn(kubelet_dir).start()
    log = open(work / "agent.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        [sys.executable, "-m", "gpunode.cli", "agent", "--backend", "sim", "--sim-profile", profile,
         "--kubelet-dir", str(kubelet_dir), "--state-dir", str(work / "state"), "--config", str(config)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while get(port, "/ready") != 200:
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"agent_memory: the agent did not become ready; see {work}/agent.log")
            time.sleep(0.2)
        kubelet.wait_for_resources(["nvidia.com/gpu", "gpunode.io/gpu-memory"], timeout=60)
        statuses = [get(port, "/metrics") for _ in range(100)]
        time.sleep(settle_s)
        out = figures(agent.pid)
        out["scrapes_ok"] = statuses.count(200)
        return out
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
        kubelet.stop()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="dgx-h100", help="simulated node profile (default dgx-h100)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--settle", type=float, default=20.0, help="seconds to wait after the scrapes")
    args = ap.parse_args()
    runs = [one_run(args.profile, args.settle) for _ in range(args.runs)]
    median_mb = statistics.median(r["rss_mb"] for r in runs)
    print(
        json.dumps(
            {
                "bench": "agent_memory",
                "profile": args.profile,
                "python": platform.python_version(),
                "runs": runs,
                "median_rss_mb": median_mb,
                "median_rss_mib": statistics.median(r["rss_mib"] for r in runs),
                "target_mb": TARGET_MB,
                "met": median_mb < TARGET_MB,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
