"""A real Prometheus on loopback scraping the metrics endpoints of simulated agents, for the tests.

ServingThread runs the collectors and endpoints of several simulated nodes on one
event loop in a thread, as the agent does; Prometheus starts the real server
(scrape interval 1 s) on a free port with a temporary data directory and queries
its HTTP API; needs_prometheus skips a test where the binary is not installed.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest

from gpunode.node.metrics import MetricsCollector, MetricsServer
from tests.ports import free_port

PROMETHEUS = shutil.which("prometheus")

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is not installed (apt-get install -y prometheus)"
)


class Served(Protocol):
    """A simulated node whose metrics endpoint ServingThread serves: its collector, then its port."""

    collector: MetricsCollector
    port: int


class ServingThread:
    """Runs the collectors and endpoints of several nodes on one event loop in a thread, as the agent does."""

    def __init__(self, nodes: Sequence[Served]) -> None:
        self.nodes = nodes
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="metrics-under-test", daemon=True)
        self.servers: list[MetricsServer] = []
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()

    def call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    async def _start(self) -> None:
        for node in self.nodes:
            server = MetricsServer(node.collector, "127.0.0.1:0")
            await server.start()
            node.port = server.port
            self.servers.append(server)
            ready = asyncio.Event()
            self.tasks.append(asyncio.create_task(node.collector.run(ready=ready)))
            await ready.wait()

    async def _stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for server in self.servers:
            await server.stop()


class Prometheus:
    """A real Prometheus server on loopback with a temporary data directory."""

    def __init__(self, targets: list[int], workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: gpunode\n    static_configs:\n"
            f"      - targets: [{', '.join(repr(f'127.0.0.1:{p}') for p in targets)}]\n"
        )
        self.log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        assert PROMETHEUS is not None
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        """Stop Prometheus (again: nothing happens)."""
        if self.log.closed:
            return
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.load(r)
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def wait_until(self, what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}"
                )
            try:
                if check():
                    return
            except (OSError, AssertionError):
                pass
            time.sleep(0.2)
        raise AssertionError(
            f"timed out waiting for {what}; log: {(self.workdir / 'prometheus.log').read_text()[-2000:]}"
        )


def values(result: list[dict[str, Any]]) -> list[float]:
    return [float(r["value"][1]) for r in result]
