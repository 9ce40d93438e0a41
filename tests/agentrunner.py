"""Run a gpunode Agent in-process on a background thread, for end-to-end tests."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from gpunode.config.agent import Config, parse_config
from gpunode.node.agent import Agent


def make_config(kubelet_dir: Path, state_dir: Path, doc: dict[str, Any] | None = None, **own: Any) -> Config:
    """A validated Config from an NVIDIA-style document, with the test's directories."""
    data = dict(doc or {})
    section = dict(data.get("gpunode", {}))
    section.setdefault("metrics", {"listen": "127.0.0.1:0"})
    section.update({"kubeletDir": str(kubelet_dir), "stateDir": str(state_dir)}, **own)
    data["gpunode"] = section
    return parse_config(data, "test-config.yaml")


class RunningAgent:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="agent", daemon=True)

    def _main(self) -> None:
        async def run() -> None:
            ready = asyncio.Event()
            task = asyncio.create_task(self.agent.run(ready=ready))
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            self._ready.set()
            waiter.cancel()
            await task

        try:
            asyncio.run(run())
        except BaseException as exc:
            self.error = exc
            self._ready.set()

    def start(self, timeout: float = 20.0) -> RunningAgent:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("agent did not become ready")
        if self.error is not None:
            raise self.error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.agent.request_stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("agent did not stop")

    def __enter__(self) -> RunningAgent:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
