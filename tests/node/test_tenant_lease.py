"""A tenant takes a file lease on its usage file: the agent's reads fail at once, it never stalls.

A process that owns its usage file (or is root in its container) may take a
write lease on it (fcntl F_SETLEASE, F_WRLCK); every blocking open() of the file
by anyone else then waits the kernel's lease-break time (45 s) and the tenant
takes the lease again at once. The agent opens tenant-writable files with
O_NONBLOCK, so a leased open fails at once (EWOULDBLOCK): the region is skipped
as damaged (reason "leased", logged once) and /health stays 200 throughout.
The lease is held here by a child process (tests run as root, which may lease
any file).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpunode.errors import RegionDamaged
from gpunode.node import memcap
from tests.node.test_tenant_attacks import WAIT_S, LiveAgent, live_agent, skipped_lines

__all__ = ["live_agent"]  # the fixture, shared with the other tenant attacks

# Holds a write lease on the file for argv[2] seconds, taking it again whenever the kernel breaks it.
LEASER = """
import fcntl, os, signal, sys, time
signal.signal(signal.SIGIO, signal.SIG_IGN)  # the kernel's lease-break notice
fd = os.open(sys.argv[1], os.O_RDONLY)
end = time.monotonic() + float(sys.argv[2])
taken = 0
announced = False
while time.monotonic() < end:
    if fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_WRLCK:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            taken += 1
        except OSError:  # the agent has the file open right now: try again
            pass
    if taken and not announced:
        print("leased", flush=True)
        announced = True
    time.sleep(0.01)
print(taken, flush=True)
"""
LEASE_S = 25.0  # over the agent's staleness bound for /health, and several collections


def _health(agent: LiveAgent) -> int:
    url = agent.metrics_url.replace("/metrics", "/health")
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def _read_at_once(region: Path) -> BaseException | None:
    """What memcap.read_usage(region) raised (None if it returned), run in a thread bounded by WAIT_S."""
    out: list[BaseException | None] = []

    def read() -> None:
        try:
            memcap.read_usage(region)
            out.append(None)
        except BaseException as err:
            out.append(err)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(WAIT_S)
    assert out, "read_usage blocked on the leased usage file"
    return out[0]


@pytest.mark.timeout(LEASE_S + 300)
def test_a_leased_usage_file_never_stalls_the_agent(live_agent: LiveAgent) -> None:
    region = live_agent.allocate(live_agent.units(0)[:2], "leaser")
    usage = region / memcap.USAGE_FILE
    leaser = subprocess.Popen(
        [sys.executable, "-c", LEASER, str(usage), str(LEASE_S)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert leaser.stdout is not None and leaser.stdout.readline().strip() == "leased"
        # The agent's own read path, in this process: fails at once with the reason, never waits 45 s.
        err = _read_at_once(region)
        assert isinstance(err, RegionDamaged) and err.reason == "leased", err
        assert "file lease" in str(err)
        statuses = []
        seen_leased = False
        while leaser.poll() is None:
            live_agent.assert_alive()
            statuses.append(_health(live_agent))
            seen_leased |= live_agent.bad_regions().get(region.name) == "leased"
            if len(statuses) % 10 == 0:  # another container still gets its region meanwhile
                other = live_agent.allocate(
                    live_agent.units(1)[len(statuses) // 10 - 1 : len(statuses) // 10], f"o{len(statuses)}"
                )
                assert memcap.read_usage(other).used_bytes == 0
            threading.Event().wait(0.5)
    finally:
        if leaser.poll() is None:
            leaser.kill()
        out, _ = leaser.communicate(timeout=WAIT_S)
    assert int(out.strip()) >= 1, "the lease must really have been held"
    assert len(statuses) >= 20 and set(statuses) == {200}, statuses
    assert seen_leased, "the leased region must show up in gpunode_memcap_bad_regions"
    lines = skipped_lines(live_agent, region.name)
    assert 1 <= len(lines) <= 3, lines
    assert "Traceback" not in live_agent.log()
