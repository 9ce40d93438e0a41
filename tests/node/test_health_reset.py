"""XID 79 on the simulated node, end to end through HealthMonitor: held past the recovery window, released by
`gpunode sim reset` (through the control socket), by `gpunode health clear`, kept across an agent restart
and released by a reboot; a counted XID still recovers by window.

The monitor runs on an explicit clock that the test moves on, so "several recovery windows" are asserted on
state, not on timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpunode import cli
from gpunode.config.agent import parse_config
from gpunode.config.health import HealthConfig, XidPolicy
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.devices.simnode.control import serve_control
from gpunode.node.health.holds import HoldStore
from gpunode.node.health.monitor import HealthMonitor
from gpunode.node.inventory import build_inventory
from gpunode.node.state import DeviceState

WINDOW = 0.05
CONFIG = HealthConfig(
    probe_interval_s=0.01, probe_timeout_s=5.0, recovery_window_s=WINDOW, xid=XidPolicy(count_threshold=3)
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Node:
    """One agent process: a monitor over a (shared) simulated node, with its own DeviceState."""

    def __init__(self, backend: SimBackend, health_dir: Path, *, boot_id: str = "boot-1") -> None:
        self.backend = backend
        self.clock = Clock()
        self.notes: list[tuple[str, str, str]] = []
        self.state = DeviceState(build_inventory(backend.gpus(), parse_config({}, "t")))
        self.monitor = HealthMonitor(
            backend=backend,
            state=self.state,
            config=CONFIG,
            remediator=self,
            clock=self.clock,
            store=HoldStore(health_dir, boot_id=boot_id),
        )

    # the remediator side
    def notify(self, unhealthy: Mapping[str, str], faults: Any) -> None:
        pass

    def note_recovery(self, uuid: str, reason: str, message: str) -> None:
        self.notes.append((uuid, reason, message))

    def unhealthy(self) -> set[str]:
        return set(self.state.snapshot().unhealthy)

    def probe_windows(self, windows: int) -> None:
        """Probe ten times per recovery window, moving the clock on, for `windows` windows."""
        for _ in range(windows * 10):
            self.clock.now += WINDOW / 10
            asyncio.run(self.monitor.probe_once())


@pytest.fixture
def backend() -> SimBackend:
    return SimBackend.from_profile("dgx-h100")


def test_xid_79_is_held_until_sim_reset(backend: SimBackend, tmp_path: Path, sockdir: Path) -> None:
    node = Node(backend, tmp_path / "health")
    gpu = backend.gpus()[1].uuid
    node.probe_windows(1)
    backend.inject_xid(gpu, 79)
    node.monitor.handle_event(backend.wait_event(1.0))  # type: ignore[arg-type]
    node.probe_windows(20)  # twenty recovery windows of passing probes
    assert node.unhealthy() == {gpu}
    assert "XID 79" in node.state.snapshot().unhealthy[gpu]

    with serve_control(backend, sockdir / "sim.sock"):
        assert cli.main(["sim", "reset", "--socket", str(sockdir / "sim.sock"), "--gpu", "1"]) == 0
    node.probe_windows(2)  # the probe sees the reset; the window then passes
    assert node.unhealthy() == set()
    ((uuid, reason, message),) = node.notes
    assert (uuid, reason) == (gpu, "GpuHealthy") and "reset" in message and "energy_j" in message


def test_xid_79_is_cleared_by_the_operator(
    backend: SimBackend, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "state"
    node = Node(backend, state_dir / "health")
    gpu = backend.gpus()[2].uuid
    backend.inject_xid(gpu, 79)
    node.monitor.handle_event(backend.wait_event(1.0))  # type: ignore[arg-type]
    node.probe_windows(5)
    assert node.unhealthy() == {gpu}

    status: list[int] = []
    argv = [
        "health",
        "clear",
        "--gpu",
        gpu,
        "--state-dir",
        str(state_dir),
        "--by",
        "alice",
        "--reason",
        "reseated",
    ]
    command = threading.Thread(target=lambda: status.append(cli.main(argv)))
    command.start()
    request = state_dir / "health" / "clear" / f"{gpu}.json"
    for _ in range(1000):  # the command waits until the agent has taken its request
        if request.exists() or status:
            break
        command.join(0.01)
    node.probe_windows(1)
    command.join(30)
    assert status == [0]
    assert "cleared" in capsys.readouterr().out
    assert node.unhealthy() == set()
    assert node.notes == [(gpu, "GpuHealthCleared", "cleared by alice: reseated")]


def test_clear_without_an_agent_says_so(
    backend: SimBackend, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "health",
        "clear",
        "--gpu",
        "GPU-1234",
        "--state-dir",
        str(tmp_path),
        "--reason",
        "x",
        "--timeout",
        "0.2",
    ]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("gpunode: the agent did not take the clear request") and err[1].startswith(
        "HINT: "
    )
    assert (tmp_path / "health" / "clear" / "GPU-1234.json").exists()  # applied when the agent next probes


def test_the_hold_survives_an_agent_restart(backend: SimBackend, tmp_path: Path) -> None:
    first = Node(backend, tmp_path / "health")
    gpu = backend.gpus()[3].uuid
    first.probe_windows(1)
    backend.inject_xid(gpu, 79)
    first.monitor.handle_event(backend.wait_event(1.0))  # type: ignore[arg-type]
    first.probe_windows(1)
    assert first.unhealthy() == {gpu}

    second = Node(backend, tmp_path / "health")  # the agent restarted, in the same boot
    assert second.unhealthy() == {gpu}  # before its first probe
    second.probe_windows(10)
    assert second.unhealthy() == {gpu}
    backend.reset_gpu(gpu)
    second.probe_windows(2)
    assert second.unhealthy() == set()
    third = Node(backend, tmp_path / "health")  # the release was saved too
    assert third.unhealthy() == set()


def test_a_reboot_releases_the_hold(backend: SimBackend, tmp_path: Path) -> None:
    first = Node(backend, tmp_path / "health", boot_id="boot-1")
    gpu = backend.gpus()[4].uuid
    backend.inject_xid(gpu, 79)
    first.monitor.handle_event(backend.wait_event(1.0))  # type: ignore[arg-type]
    assert first.unhealthy() == {gpu}
    after_reboot = Node(backend, tmp_path / "health", boot_id="boot-2")
    assert after_reboot.unhealthy() == set()


def test_a_counted_xid_still_recovers_by_window(backend: SimBackend, tmp_path: Path) -> None:
    node = Node(backend, tmp_path / "health")
    gpu = backend.gpus()[5].uuid
    for _ in range(3):
        backend.inject_xid(gpu, 150)
        node.monitor.handle_event(backend.wait_event(1.0))  # type: ignore[arg-type]
    assert node.unhealthy() == {gpu}
    node.clock.now += CONFIG.xid.count_window_s  # the counted XIDs leave their window
    node.probe_windows(2)
    assert node.unhealthy() == set()
    assert not (tmp_path / "health" / "holds.json").exists()  # nothing was ever held
