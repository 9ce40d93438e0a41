"""systemd service notification: READY=1, STOPPING=1, RELOADING=1 and the watchdog ping.

Uses systemd-python's `systemd.daemon.notify` when it is installed (the
`systemd` extra), and otherwise writes the same datagram to $NOTIFY_SOCKET
itself, so the unit's Type=notify works either way. Outside systemd (no
NOTIFY_SOCKET) every call is a no-op. This module never raises: a failed
notification is logged, it does not stop the agent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def _send_raw(state: str, environ: Mapping[str, str]) -> bool:
    address = environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def notify(state: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send one notification such as "READY=1"; False when not running under systemd."""
    env = os.environ if environ is None else environ
    if not env.get("NOTIFY_SOCKET"):
        return False
    try:
        if environ is None:
            try:
                from systemd import daemon  # type: ignore[attr-defined,unused-ignore]

                return bool(daemon.notify(state))
            except ImportError:
                pass
        return _send_raw(state, env)
    except OSError as exc:
        log.warning("systemd notification %r failed: %s", state, exc)
        return False


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """Half of WatchdogSec when systemd asks this process for pings, else None."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


async def run_watchdog(*, interval_s: float, environ: Mapping[str, str] | None = None) -> None:
    """Ping the watchdog from the event loop: a stuck loop stops the pings and systemd restarts us."""
    while True:
        notify("WATCHDOG=1", environ=environ)
        await asyncio.sleep(interval_s)
