"""Ports for the processes the tests and benchmarks start.

A port the kernel hands out for `bind(0)` comes from the ephemeral range, the same range it draws
the local ports of outgoing connections from. Between choosing such a port and the child binding
it, any outgoing connection on the machine (the kubelet's to the API server, containerd's, a
test's) may take it, and the child then fails with "address already in use"; a real kubelet only
logs that for its healthz server and never becomes healthy. So the ports here come from below the
ephemeral range, which the kernel never hands out by itself, drawn at random and checked free, and
none is handed out twice by one process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_LOW = 20000  # above the well-known and most registered service ports
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_given: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, outside the ephemeral range, not given before."""
    high = _ephemeral_low() - 1
    if high - _LOW < 1000:  # an unusual range that leaves no room below it: the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    with _lock:
        for _ in range(1000):
            port = _rng.randint(_LOW, high)
            if port in _given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _given.add(port)
            return port
    raise RuntimeError(f"no free TCP port between {_LOW} and {high} on 127.0.0.1")
