"""Adversarial soak: a hostile tenant and a hostile network against a live agent and extender. Prints JSON.

    .venv/bin/python bench/soak.py [--duration 600] [--idle 1000] [--body-mb 50]

Starts, as an operator would, `gpunode agent` on the simulated node (two T4s
shared as 1 GiB memory units, memory-cap GC every 0.1 s, metrics collected
every second) and `gpunode extender`, with the kubelet and its pod-resources
API played by the test stand-ins in this process. One container is allocated
memory units (a real Allocate, so a real region) and listed by pod-resources.
Then, for `--duration` seconds, all at once:

- the tenant: a child process truncates that container's usage file and
  writes it back in a loop (os.ftruncate(fd, 0); os.pwrite(fd, saved, 0)),
  as a process inside the container can;
- the network: `--idle` idle TCP connections are held open to the metrics
  endpoint and as many to the extender (reopened as the servers close them,
  as fast as they close them), and every 30 s a `--body-mb` MB request body
  is sent to each, all from 127.0.0.2, while Prometheus and the probes below
  come from 127.0.0.1, as an attacker elsewhere on the node network would;
- Prometheus and the kubelet: every 2 s a scrape of /metrics and a /health
  probe on the agent, a /healthz probe and a /filter on the extender.

Reported: each process's RSS, open fds and threads at start, at the end
and 15 s after the attack stopped; the
status of every scrape and probe (counts, and each one that was not 200);
how many connections the servers closed; and whether each process was alive
at the end. A status of 0 means the request got no answer at all.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunode.node.kubelet.podresources import ContainerDevices
from tests.fakes.kubelet import KubeletStandIn, short_socket_dir
from tests.fakes.podresources import PodResourcesStandIn
from tests.ports import free_port

MEM = "gpunode.io/gpu-memory"
ATTACKER = "127.0.0.2"  # the network attacker's address; Prometheus and the probes come from 127.0.0.1
FILTER_BODY = json.dumps(
    {
        "Pod": {
            "metadata": {"name": "soak", "namespace": "default", "uid": "soak-uid"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        },
        "NodeNames": ["node-a"],
    }
).encode()


def proc_figures(pid: int) -> dict[str, Any]:
    """RSS (MB), open fds and threads of a live process."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
    }


def tenant_loop(usage_path: str, stop_at: float, counter: Any) -> None:
    """What a hostile process inside the container does to its own usage file."""
    fd = os.open(usage_path, os.O_RDWR)
    saved = os.pread(fd, 1 << 20, 0)
    n = 0
    while time.monotonic() < stop_at:
        os.ftruncate(fd, 0)
        os.pwrite(fd, saved, 0)
        n += 1
        if n % 1000 == 0:
            counter.value = n
    counter.value = n


class IdleHolder(threading.Thread):
    """Keeps `count` idle connections open to (host, port), reopening the ones the server closes."""

    def __init__(self, port: int, count: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.count, self.stop = port, count, stop
        self.opened = 0
        self.closed_by_server = 0

    def run(self) -> None:
        conns: list[socket.socket] = []
        while not self.stop.is_set():
            alive = []
            for c in conns:
                try:
                    c.setblocking(False)
                    if c.recv(1, socket.MSG_PEEK) == b"":
                        raise ConnectionResetError
                    alive.append(c)
                except BlockingIOError:
                    alive.append(c)
                except OSError:
                    self.closed_by_server += 1
                    c.close()
            conns = alive
            while len(conns) < self.count and not self.stop.is_set():
                try:
                    conns.append(
                        socket.create_connection(
                            ("127.0.0.1", self.port), timeout=5, source_address=(ATTACKER, 0)
                        )
                    )
                    self.opened += 1
                except OSError:
                    break
            self.stop.wait(1.0)
        for c in conns:
            c.close()


def request(
    port: int, method: str, path: str, body: bytes | None = None, timeout: float = 10.0, source: str = ""
) -> int:
    """The status of one request on a fresh connection (from `source`); 0 when no answer came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return 0
    finally:
        conn.close()


def big_body(port: int, path: str, size: int) -> int:
    """Send a `size`-byte body; the status, or 0 when the server closed the connection first."""
    return request(port, "POST", path, body=b"{" + b" " * (size - 2) + b"}", timeout=60, source=ATTACKER)


def wait_http(port: int, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while request(port, "GET", path, timeout=2) != 200:
        if time.monotonic() > deadline:
            raise SystemExit(f"soak: nothing answered on 127.0.0.1:{port}{path} within {timeout:.0f}s")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of attack (default 600)")
    ap.add_argument("--idle", type=int, default=1000, help="idle connections held to each server")
    ap.add_argument("--body-mb", type=float, default=50.0, help="size of the oversized request bodies")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes and probes")
    args = ap.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    work = short_socket_dir("gnsoak")
    kubelet_dir = work / "device-plugins"
    kubelet_dir.mkdir()
    pr_socket = work / "pr.sock"
    metrics_port, extender_port = free_port(), free_port()
    config = work / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "gpunode": {
                    "fractional": {"devices": [0, 1], "unit": "1Gi", "gcInterval": "0.1s"},
                    "podResourcesSocket": str(pr_socket),
                    "metrics": {"listen": f"127.0.0.1:{metrics_port}", "interval": "1s"},
                }
            }
        )
    )
    logs = {name: open(work / f"{name}.log", "wb") for name in ("agent", "extender")}  # noqa: SIM115
    kubelet = KubeletStandIn(kubelet_dir).start()
    pods = PodResourcesStandIn(str(pr_socket)).start()
    agent = subprocess.Popen(
        [sys.executable, "-m", "gpunode.cli", "agent", "--backend", "sim", "--sim-profile", "t4",
         "--kubelet-dir", str(kubelet_dir), "--state-dir", str(work / "state"), "--config", str(config)],
        stdout=logs["agent"], stderr=subprocess.STDOUT,
    )  # fmt: skip
    extender = subprocess.Popen(
        [sys.executable, "-m", "gpunode.cli", "extender", "--listen", f"127.0.0.1:{extender_port}"],
        stdout=logs["extender"], stderr=subprocess.STDOUT,
    )  # fmt: skip
    stop = threading.Event()
    result: dict[str, Any] = {"bench": "soak", "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        kubelet.wait_for_resources([MEM], timeout=60)
        wait_http(metrics_port, "/health")
        wait_http(extender_port, "/healthz")
        ids = sorted(kubelet.healthy(MEM))[:2]
        resp = kubelet.allocate(MEM, ids)
        usage = next(m.host_path for m in resp.mounts if m.container_path.endswith("/usage"))
        pods.set_pods([ContainerDevices("default", "tenant", "main", MEM, tuple(ids))])
        time.sleep(3)  # a collection and a GC pass see the region as it should be
        result["start"] = {"agent": proc_figures(agent.pid), "extender": proc_figures(extender.pid)}

        stop_at = time.monotonic() + args.duration
        rounds = multiprocessing.get_context("spawn").Value("q", 0)
        tenant = multiprocessing.get_context("spawn").Process(
            target=tenant_loop, args=(usage, stop_at, rounds), daemon=True
        )
        tenant.start()
        holders = [IdleHolder(p, args.idle, stop) for p in (metrics_port, extender_port)]
        for h in holders:
            h.start()
        statuses: dict[str, list[tuple[float, int]]] = {
            "agent_metrics": [], "agent_health": [], "extender_healthz": [], "extender_filter": [],
            "agent_big_body": [], "extender_big_body": [],
        }  # fmt: skip
        t0 = time.monotonic()
        next_body = t0
        size = int(args.body_mb * 1e6)
        while time.monotonic() < stop_at:
            t = round(time.monotonic() - t0, 1)
            statuses["agent_metrics"].append((t, request(metrics_port, "GET", "/metrics")))
            statuses["agent_health"].append((t, request(metrics_port, "GET", "/health")))
            statuses["extender_healthz"].append((t, request(extender_port, "GET", "/healthz")))
            statuses["extender_filter"].append((t, request(extender_port, "POST", "/filter", FILTER_BODY)))
            if time.monotonic() >= next_body:
                statuses["agent_big_body"].append((t, big_body(metrics_port, "/metrics", size)))
                statuses["extender_big_body"].append((t, big_body(extender_port, "/filter", size)))
                next_body += 30.0
            time.sleep(args.interval)
        stop.set()
        tenant.join(timeout=30)
        for h in holders:
            h.join(timeout=30)

        def figures_now() -> dict[str, Any]:
            return {
                name: (proc_figures(p.pid) if p.poll() is None else {"exited": p.returncode})
                for name, p in (("agent", agent), ("extender", extender))
            }

        result["end"] = figures_now()
        time.sleep(15)  # the servers notice the attacker's closed connections
        result["end_after_15s"] = figures_now()
        result["attack"] = {
            "duration_s": args.duration,
            "truncate_rounds": rounds.value,
            "idle_connections_each": args.idle,
            "body_mb": args.body_mb,
            "connections_opened": {n: h.opened for n, h in zip(("agent", "extender"), holders, strict=True)},
            "closed_by_server": {
                n: h.closed_by_server for n, h in zip(("agent", "extender"), holders, strict=True)
            },
        }
        result["statuses"] = {
            name: {
                "counts": {str(k): v for k, v in sorted(Counter(s for _, s in seq).items())},
                "not_200": [[t, s] for t, s in seq if s != 200],
            }
            for name, seq in statuses.items()
        }
        result["alive_at_end"] = {"agent": agent.poll() is None, "extender": extender.poll() is None}
    finally:
        stop.set()
        for p in (agent, extender):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        pods.stop()
        kubelet.stop()
        for f in logs.values():
            f.close()
        if os.environ.get("GPUNODE_SOAK_KEEP"):
            print(f"soak: logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
