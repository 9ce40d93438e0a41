"""`gpunode agent` with one part made to fail: a test-only launcher, not part of the package.

    python -m tests.failing_agent PART WHEN TRIGGER -- agent ARGS...

runs `gpunode.cli.main(["agent", ARGS...])` exactly as the console script does,
except that the part named PART (as the agent's supervisor names it) is wrapped:

- WHEN=start: the part raises OSError(EIO) instead of starting;
- WHEN=run: the real part runs until the file TRIGGER exists, then raises RuntimeError;
- WHEN=stuck: the real part runs, and once cancelled it ignores cancellation for good and leaves a
  non-daemon thread blocked forever (a driver call that never returns).

Users cannot reach this: it lives in the test tree and patches the supervisor in this process only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any

from gpunode import cli
from gpunode.node import supervise

POLL_S = 0.05


def wrap(coro: Coroutine[Any, Any, Any], when: str, trigger: str) -> Coroutine[Any, Any, Any]:
    async def start() -> None:
        coro.close()
        raise OSError(errno.EIO, "injected failure at start")

    async def run() -> None:
        task = asyncio.ensure_future(coro)
        try:
            while not os.path.exists(trigger):
                if task.done():
                    await task
                await asyncio.sleep(POLL_S)
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task  # the real part cleans up (removes its sockets) before the failure is reported
        raise RuntimeError("injected failure while running")

    async def stuck() -> None:
        task = asyncio.ensure_future(coro)
        try:
            await task
        finally:
            threading.Thread(target=threading.Event().wait, name="stuck-driver-call").start()
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    continue

    return {"start": start, "run": run, "stuck": stuck}[when]()


def main() -> int:
    part, when, trigger, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: python -m tests.failing_agent PART WHEN TRIGGER -- agent ARGS..."
    real_start = supervise.Supervisor.start

    def start(self: supervise.Supervisor, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return real_start(self, name, wrap(coro, when, trigger) if name == part else coro)

    supervise.Supervisor.start = start  # type: ignore[method-assign]
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
