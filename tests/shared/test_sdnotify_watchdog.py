"""The systemd watchdog notices a stuck event loop: its pings come from the loop, so a blocked loop stops them.

A NOTIFY_SOCKET datagram socket stands in for systemd; a thread counts the
WATCHDOG=1 datagrams. While a coroutine blocks the loop (as a blocking open()
of a FIFO did), no ping may arrive; once the loop runs again, they resume.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

from gpunode.infra import sdnotify

INTERVAL_S = 0.02
BLOCK_S = 1.0  # 50 intervals: a ping from anywhere but the loop would show up many times


class Systemd:
    """Counts the WATCHDOG=1 datagrams sent to its socket."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.pings = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._count, daemon=True)
        self._thread.start()

    def _count(self) -> None:
        while not self._done.is_set():
            try:
                data = self.sock.recv(256)
            except TimeoutError:
                continue
            if data == b"WATCHDOG=1":
                self.pings += 1

    def close(self) -> None:
        self._done.set()
        self._thread.join(10)
        self.sock.close()


def test_a_blocked_event_loop_stops_the_watchdog_pings(sockdir: Path) -> None:
    systemd = Systemd(sockdir / "notify")
    env = {"NOTIFY_SOCKET": str(sockdir / "notify"), "WATCHDOG_USEC": str(int(INTERVAL_S * 2e6))}
    assert sdnotify.watchdog_interval_s(env) == INTERVAL_S

    async def scenario() -> tuple[int, int, int]:
        watchdog = asyncio.create_task(sdnotify.run_watchdog(interval_s=INTERVAL_S, environ=env))
        try:
            while systemd.pings < 5:  # pinging while the loop runs
                await asyncio.sleep(INTERVAL_S)
            await asyncio.sleep(0.2)  # datagrams already sent have been counted
            before = systemd.pings
            time.sleep(BLOCK_S)  # the loop is stuck: nothing on it runs
            during = systemd.pings - before
            resumed = systemd.pings
            while systemd.pings < resumed + 5:  # the loop runs again: so do the pings
                await asyncio.sleep(INTERVAL_S)
            return before, during, systemd.pings - resumed
        finally:
            watchdog.cancel()

    try:
        before, during, after = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        systemd.close()
    assert before >= 5 and after >= 5
    assert during == 0, f"{during} pings arrived while the event loop was blocked"
