"""The agent as a process: systemd notification, SIGHUP reload, SIGTERM clean stop, bad input at start-up."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.fakes.kubelet import KubeletStandIn

GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"


class NotifyListener:
    """What systemd does with NOTIFY_SOCKET: receive datagrams from the service."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[str] = []

    def wait_for(self, text: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.messages:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {text!r} from the agent; got {self.messages}")
            self.sock.settimeout(left)
            try:
                self.messages.extend(self.sock.recv(4096).decode().split("\n"))
            except TimeoutError:
                continue

    def close(self) -> None:
        self.sock.close()


def agent_command(sockdir: Path, config: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "gpunode.cli", "agent",
        "--backend", "sim", "--sim-profile", "t4",
        "--kubelet-dir", str(sockdir / "device-plugins"),
        "--state-dir", str(sockdir / "state"),
        "--config", str(config),
        *extra,
    ]  # fmt: skip


def write_config(path: Path, replicas_on: list[int]) -> Path:
    doc = {
        "version": "v1",
        "sharing": {
            "timeSlicing": {
                "renameByDefault": True,
                "resources": [{"name": GPU, "replicas": 2, "devices": replicas_on}],
            }
        },
        "gpunode": {"metrics": {"listen": "127.0.0.1:0"}},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def notify(sockdir: Path) -> Iterator[NotifyListener]:
    listener = NotifyListener(sockdir / "notify.sock")
    yield listener
    listener.close()


def test_notify_reload_and_clean_stop(sockdir: Path, kubelet: KubeletStandIn, notify: NotifyListener) -> None:
    config = write_config(sockdir / "config.yaml", [0])
    env = dict(os.environ, NOTIFY_SOCKET=str(notify.path), WATCHDOG_USEC="400000")
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        agent_command(sockdir, config), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        notify.wait_for("READY=1")
        kubelet.wait_for_resources([GPU, SHARED])
        assert len(kubelet.healthy(SHARED)) == 2
        notify.wait_for("WATCHDOG=1")
        notify.messages.clear()

        write_config(config, [0, 1, 2])
        proc.send_signal(signal.SIGHUP)
        notify.wait_for("RELOADING=1")
        notify.wait_for("READY=1")
        # Each resource has its own ListAndWatch stream: wait until both carry the new configuration.
        kubelet.wait_for(
            lambda: len(kubelet.healthy(SHARED)) == 6 and len(kubelet.healthy(GPU)) == 1,
            what="the reloaded configuration on both resources",
        )

        config.write_text(
            "version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 1}]}}\n"
        )
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None, "a bad configuration on reload must not stop the agent"
        assert len(kubelet.healthy(SHARED)) == 6, "the running configuration stays after a refused reload"

        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    notify.wait_for("STOPPING=1", timeout=5)
    assert "reload refused" in err and "replicas" in err
    assert "gpunode agent ready" in out and "nvidia.com/gpu.shared" in out
    assert not list((sockdir / "device-plugins").glob("gpunode-*.sock")), "sockets must be removed on SIGTERM"
    assert kubelet.socket.exists()


@pytest.mark.parametrize(
    ("config_text", "exit_code", "expected"),
    [
        pytest.param(
            "version: v1\nflags: {migStrategy: sideways}\n", 2, "flags.migStrategy", id="bad-mig-strategy"
        ),
        pytest.param(
            "version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4, devices: [9]}]}}\n",
            2,
            "index 9",
            id="selector-no-such-gpu",
        ),
        pytest.param("version: v1\nflags: [\n", 2, "not valid YAML", id="broken-yaml"),
        pytest.param(
            "version: v1\ngpunode: {simProfile: nowhere-like-this}\n",
            2,
            "nowhere-like-this",
            id="unknown-profile",
        ),
    ],
)
def test_bad_input_stops_start_up_before_anything_is_served(
    sockdir: Path, config_text: str, exit_code: int, expected: str
) -> None:
    config = sockdir / "config.yaml"
    config.write_text(config_text)
    cmd = agent_command(sockdir, config)
    if "simProfile" in config_text:
        i = cmd.index("--sim-profile")
        del cmd[i : i + 2]
    (sockdir / "device-plugins").mkdir()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == exit_code, proc.stderr
    assert expected in proc.stderr
    assert "HINT:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((sockdir / "device-plugins").iterdir()), "nothing may be half-started"


def test_systemd_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (scripts/test.sh installs the systemd package)")
    gpunode = shutil.which("gpunode") or str(Path(sys.executable).parent / "gpunode")
    if not Path(gpunode).exists():
        pytest.skip("the gpunode console script is not installed")
    root = Path(__file__).resolve().parents[2] / "systemd"
    for unit in sorted(root.glob("*.service")):
        text = unit.read_text().replace("/usr/local/bin/gpunode", gpunode)
        copy = tmp_path / unit.name
        copy.write_text(text)
        proc = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
        problems = [line for line in proc.stderr.splitlines() if unit.name in line]
        assert proc.returncode == 0 and not problems, f"{unit.name}: {proc.stderr}"
        assert "Type=notify" in text or "extender" in unit.name
