"""Benchmark: the extender's peak memory under 4 concurrent maximal bodies, and after 50,000 node names.

Runs `gpunode extender` as its own process (as the chart does, default flags but
--node-state-max-age 0s: the annotations are fixed) from a source tree (--source;
the checkout by default), and reads its memory from /proc: VmHWM (peak resident)
and VmRSS (resident now).

- bodies: 4 requests at once of a v1.NodeList of real-looking Nodes (each with an
  8-GPU gpunode.io/gpu-state) just under 32 MiB (the default --max-request-bytes),
  then 4 at once of ~8 MiB; the answers' statuses and the peak after each round.
- churn: a fresh process; filter requests of 1,000 new nodes each (distinct
  names, as autoscaling churns nodes) until 50,000 names were sent; resident
  memory and the node count of /healthz after.

To compare two commits, check the older one out into a worktree and run this
script against it: git worktree add /tmp/old <commit>; python bench/extender_memory.py
--source /tmp/old; git worktree remove /tmp/old.

    .venv/bin/python bench/extender_memory.py [--source DIR] [--label NAME]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.test_extender import gpu_state, v1_node, v1_pod  # noqa: E402

MIB = 2**20
POD = v1_pod("p", limits={"nvidia.com/gpu": "1"}, uid="uid-p")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memory(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = round(int(value.split()[0]) / 1024, 1)  # MiB
    return out


class Extender:
    """`gpunode extender` from `source` in a process of its own."""

    def __init__(self, source: Path) -> None:
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(source)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from gpunode.cli import main; sys.exit(main())", "extender",
             "--listen", f"127.0.0.1:{self.port}", "--node-state-max-age", "0s"],
            env=env, cwd=str(source), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.get("/healthz")
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("the extender did not start")

    def get(self, path: str) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        conn.request("GET", path)
        body = orjson.loads(conn.getresponse().read())
        conn.close()
        return dict(body)

    def post(self, verb: str, body: bytes) -> int:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
            conn.request("POST", f"/{verb}", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            conn.close()
            return response.status
        except OSError:
            return -1  # the connection was closed (a refusal before the body was read) or the process died

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def node_list(prefix: str, start: int, count: int) -> bytes:
    nodes = [
        v1_node(f"{prefix}{i}", gpu_state(f"{prefix}{i}", [1000] * 8)) for i in range(start, start + count)
    ]
    return orjson.dumps({"Pod": POD, "Nodes": {"items": nodes}})


def body_of(size: int) -> bytes:
    per_node = len(node_list("node-", 0, 1)) - len(node_list("node-", 0, 0))
    count = size // per_node
    while len(body := node_list("node-", 0, count)) > size:
        count -= 10
    return body


def bodies(source: Path) -> dict[str, Any]:
    ext = Extender(source)
    out: dict[str, Any] = {"idle": memory(ext.proc.pid)}
    try:
        for label, size in (("32MiB", 32 * MIB - 4096), ("8MiB", 8 * MIB)):
            body = body_of(size)
            statuses: list[int] = []

            def send(body: bytes = body, statuses: list[int] = statuses) -> None:
                statuses.append(ext.post("filter", body))

            threads = [threading.Thread(target=send) for _ in range(4)]
            started = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            alive = ext.proc.poll() is None
            out[label] = {
                "body_bytes": len(body),
                "statuses": sorted(statuses),
                "seconds": round(time.monotonic() - started, 1),
                "alive": alive,
                **(memory(ext.proc.pid) if alive else {}),
            }
    finally:
        ext.stop()
    return out


def churn(source: Path, names: int = 50_000, per_request: int = 1000) -> dict[str, Any]:
    ext = Extender(source)
    out: dict[str, Any] = {"idle": memory(ext.proc.pid)}
    try:
        statuses = []
        for start in range(0, names, per_request):
            statuses.append(ext.post("filter", node_list("churn-", start, per_request)))
        out["after"] = {**memory(ext.proc.pid), "nodes_cached": ext.get("/healthz")["nodes"]}
        out["statuses"] = sorted(set(statuses))
        out["requests"] = len(statuses)
    finally:
        ext.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT, help="the source tree to run gpunode from")
    parser.add_argument("--label", default="", help="a name for this run in the output (e.g. the commit)")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "-C", str(args.source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "bench": "extender_memory",
        "label": args.label,
        "commit": commit,
        "python": platform.python_version(),
        "units": "MiB (VmHWM: peak resident; VmRSS: resident now)",
        "four_concurrent_bodies": bodies(args.source),
        "distinct_node_names_50000": churn(args.source),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
