"""The agent as an operator runs it, when a part fails: one line, a non-zero status, and an end.

Every test starts `python -m gpunode.cli agent ...` in a subprocess and asserts
its exit status, the one error line (with its HINT line), that no traceback was
printed and that the process ended. Real causes are used where the node offers
them (a port in use, a directory that is a file, read-only or gone, a socket
path too long); tests/failing_agent.py makes any named part fail at start, in
the middle of running, or hang, for the parts that have no such cause.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fakes.kubelet import KubeletStandIn

WAIT_S = 60.0  # generous: the machine may be loaded; the outcome is asserted, not the time
MEM = "gpunode.io/gpu-memory"


class AgentProcess:
    """`gpunode agent` in a subprocess, its output collected by two reader threads."""

    def __init__(
        self, args: list[str], *, launcher: list[str] | None = None, env: dict[str, str] | None = None
    ):
        cmd = [sys.executable, "-m", *(launcher or ["gpunode.cli"]), "agent", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or dict(os.environ)
        )
        self.keep: object = None
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for r in self._readers:
            r.start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, text: str, *, stream: str = "out", timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in (self.stdout if stream == "out" else self.stderr):
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the readers take the rest
                if text in (self.stdout if stream == "out" else self.stderr):
                    return
                raise AssertionError(
                    f"the agent ended ({self.proc.returncode}) before {text!r}: {self.stderr}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} from the agent: {self.stderr}")
            time.sleep(0.05)

    def wait_ready(self) -> None:
        self.wait_for("gpunode agent ready")
        self.wait_for("DCGM-compatible")

    def end(self, timeout: float = WAIT_S) -> int:
        """Wait for the process to end by itself; fail (and kill it) when it does not."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the agent did not end by itself: {self.stderr}") from None
        for r in self._readers:
            r.join(10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def processes() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for p in started:
        p.kill()


def args_for(sockdir: Path, config: Path, *extra: str) -> list[str]:
    return [
        "--backend", "sim", "--sim-profile", "t4",
        "--kubelet-dir", str(sockdir / "device-plugins"),
        "--state-dir", str(sockdir / "state"),
        "--config", str(config),
        *extra,
    ]  # fmt: skip


def write_config(sockdir: Path, **section: Any) -> Path:
    own = {"metrics": {"listen": "127.0.0.1:0"}, "podResourcesSocket": str(sockdir / "pr.sock"), **section}
    path = sockdir / "config.yaml"
    path.write_text(yaml.safe_dump({"version": "v1", "gpunode": own}))
    return path


def assert_error(p: AgentProcess, rc: int, code: int, text: str) -> None:
    """Exit status `code`, exactly one `gpunode:` line containing `text` followed by its HINT, no traceback."""
    err = p.stderr
    assert rc == code, err
    lines = err.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("gpunode: ")]
    assert len(errors) == 1, err
    assert text in lines[errors[0]], err
    assert lines[errors[0] + 1].startswith("HINT: ") and len(lines[errors[0] + 1]) > len("HINT: "), err
    assert "Traceback" not in err and "ExceptionGroup" not in err, err


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """Make directory `path` read-only for this process's user: a read-only bind mount as root."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if shutil.which("mount") is None:
        pytest.skip("root without mount(8): cannot make a directory read-only")
    bind = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip(f"cannot bind-mount as root here: {bind.stderr!r}")
    try:
        ro = subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True)
        if ro.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {ro.stderr!r}")
        yield
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


# -- at start: real causes ------------------------------------------------------------------------


def test_sim_control_socket_in_a_missing_directory(sockdir: Path, processes: list[AgentProcess]) -> None:
    p = AgentProcess(
        args_for(sockdir, write_config(sockdir), "--sim-control-socket", "/nonexistent/dir/sim.sock")
    )
    processes.append(p)
    assert_error(p, p.end(), 1, "cannot listen for sim control on /nonexistent/dir/sim.sock")
    assert "ready" not in p.stdout
    assert not list((sockdir / "device-plugins").glob("gpunode-*.sock"))


def test_metrics_port_in_use_no_banner_one_line(sockdir: Path, processes: list[AgentProcess]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(sockdir, metrics={"listen": f"127.0.0.1:{port}"})
        p = AgentProcess(args_for(sockdir, config))
        processes.append(p)
        rc = p.end()
    assert_error(p, rc, 1, f"cannot listen for metrics on 127.0.0.1:{port}: Address already in use")
    assert p.stdout == "", "the ready banner comes only when everything listens"


def test_banner_names_the_bound_metrics_port(
    sockdir: Path, kubelet: KubeletStandIn, processes: list[AgentProcess]
) -> None:
    p = AgentProcess(args_for(sockdir, write_config(sockdir)))
    processes.append(p)
    p.wait_ready()
    line = next(x for x in p.stdout.splitlines() if "metrics:" in x)
    url = line.split()[1]
    assert url.startswith("http://127.0.0.1:") and not url.startswith("http://127.0.0.1:0/"), line
    with urllib.request.urlopen(url, timeout=20) as r:
        assert b"gpunode_kubelet_socket_present 1.0" in r.read()
    p.proc.send_signal(signal.SIGTERM)
    assert p.end() == 0, p.stderr


@pytest.mark.parametrize(
    ("make", "text"),
    [
        pytest.param(lambda d: (d.write_text("x"), d)[1], "is not a directory", id="a-file"),
        pytest.param(lambda d: Path("/proc/gpunode-kubelet"), "cannot be created", id="on-proc"),
        pytest.param(
            lambda d: d / ("x" * (108 - len(str(d)))),
            "a Unix socket path may have at most 107",
            id="too-long",
        ),
    ],
)
def test_kubelet_dir_unusable(sockdir: Path, processes: list[AgentProcess], make: Any, text: str) -> None:
    kdir = make(sockdir / "device-plugins")
    args = args_for(sockdir, write_config(sockdir))
    args[args.index("--kubelet-dir") + 1] = str(kdir)
    p = AgentProcess(args)
    processes.append(p)
    assert_error(p, p.end(), 2, text)
    assert str(kdir) in p.stderr.splitlines()[-2]


def test_kubelet_dir_read_only(sockdir: Path, processes: list[AgentProcess]) -> None:
    kdir = sockdir / "device-plugins"
    kdir.mkdir()
    with read_only(kdir):
        p = AgentProcess(args_for(sockdir, write_config(sockdir)))
        processes.append(p)
        assert_error(p, p.end(), 2, f"the kubelet directory {kdir} is not writable")


def test_state_dir_is_a_file(sockdir: Path, processes: list[AgentProcess]) -> None:
    (sockdir / "state").write_text("not a directory")
    p = AgentProcess(args_for(sockdir, write_config(sockdir)))
    processes.append(p)
    assert_error(p, p.end(), 2, f"the state directory {sockdir / 'state'} is not a directory")
    assert not (sockdir / "device-plugins").exists(), "nothing may be created before the checks pass"


def test_state_dir_read_only_refuses_to_start(sockdir: Path, processes: list[AgentProcess]) -> None:
    state = sockdir / "state"
    state.mkdir()
    with read_only(state):
        p = AgentProcess(args_for(sockdir, write_config(sockdir, fractional={"devices": [0], "unit": "1Gi"})))
        processes.append(p)
        assert_error(p, p.end(), 2, f"the state directory {state} is not writable")


def test_missing_kubelet_is_said_plainly(sockdir: Path, processes: list[AgentProcess]) -> None:
    p = AgentProcess(args_for(sockdir, write_config(sockdir)))
    processes.append(p)
    p.wait_ready()
    kdir = sockdir / "device-plugins"
    p.wait_for(f"the kubelet directory {kdir} did not exist", stream="err")
    p.wait_for(f"no kubelet at {kdir / 'kubelet.sock'}", stream="err")
    assert "waiting for the kubelet" in p.stdout
    url = next(x for x in p.stdout.splitlines() if "metrics:" in x).split()[1]
    with urllib.request.urlopen(url, timeout=20) as r:
        assert b"gpunode_kubelet_socket_present 0.0" in r.read()
    p.proc.send_signal(signal.SIGINT)
    assert p.end() == 0, p.stderr
    assert "Traceback" not in p.stderr


def test_sighup_applies_a_changed_log_level(
    sockdir: Path, kubelet: KubeletStandIn, processes: list[AgentProcess]
) -> None:
    config = write_config(sockdir, logLevel="info")
    p = AgentProcess(args_for(sockdir, config))
    processes.append(p)
    p.wait_ready()
    config = write_config(sockdir, logLevel="debug")
    p.proc.send_signal(signal.SIGHUP)
    p.wait_for("SIGHUP: log level is now debug", stream="err")
    url = next(x for x in p.stdout.splitlines() if "metrics:" in x).split()[1]
    urllib.request.urlopen(url, timeout=20).close()  # the endpoint logs each request at debug
    p.wait_for(" DEBUG ", stream="err")
    p.proc.send_signal(signal.SIGTERM)
    assert p.end() == 0, p.stderr
    before, after = p.stderr.split("SIGHUP: log level is now debug", 1)
    assert " DEBUG " not in before and " DEBUG " in after
    assert "Traceback" not in p.stderr


# -- while running: real causes ---------------------------------------------------------------------


def test_kubelet_dir_removed_while_running(sockdir: Path, processes: list[AgentProcess]) -> None:
    p = AgentProcess(args_for(sockdir, write_config(sockdir)))
    processes.append(p)
    p.wait_ready()
    shutil.rmtree(sockdir / "device-plugins")
    assert_error(p, p.end(), 2, f"the kubelet directory {sockdir / 'device-plugins'} is gone")


def test_state_dir_read_only_while_running_marks_capped_devices_unhealthy(
    sockdir: Path, kubelet: KubeletStandIn, processes: list[AgentProcess]
) -> None:
    from gpunode.config.agent import load
    from gpunode.node import doctor

    config = write_config(sockdir, fractional={"devices": [0], "unit": "1Gi"})
    p = AgentProcess(args_for(sockdir, config))
    processes.append(p)
    p.wait_ready()
    kubelet.wait_for_resources([MEM])
    kubelet.wait_for(lambda: len(kubelet.healthy(MEM)) > 0, what="healthy memory units")
    url = next(x for x in p.stdout.splitlines() if "metrics:" in x).split()[1].replace("/metrics", "/health")
    state = sockdir / "state"
    with read_only(state):
        kubelet.wait_for(lambda: not kubelet.healthy(MEM), what="memory units advertised Unhealthy")
        assert kubelet.healthy("nvidia.com/gpu"), "whole GPUs do not need the state directory"
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                urllib.request.urlopen(url, timeout=20).close()
            except urllib.error.HTTPError as e:
                body = e.read().decode()
                assert e.code == 503 and str(state) in body and "not writable" in body, body
                break
            assert time.monotonic() < deadline, "/health kept answering 200"
            time.sleep(0.2)
        cfg = load(
            config_path=config, overrides={"state_dir": state, "kubelet_dir": sockdir / "device-plugins"}
        )
        check = next(c for c in doctor.checks(cfg) if c.name == "state directory")
        assert check.status == doctor.FAIL, check
    kubelet.wait_for(lambda: len(kubelet.healthy(MEM)) > 0, what="memory units Healthy again")
    p.proc.send_signal(signal.SIGTERM)
    assert p.end() == 0, p.stderr
    assert "Traceback" not in p.stderr


# -- every part: at start, while running, stuck ------------------------------------------------------

PARTS = [
    "device plugins",
    "event pump",
    "topology watch",
    "reloader",
    "sharing drain",
    "rediscovery",
    "sim control",
    "kubelet watch",
    "state directory watch",
    "health monitor",
    "remediation",
    "metrics collector",
    "metrics endpoint",
    "node-state publisher",
    "memcap regions",
    "watchdog",
]


def every_part(sockdir: Path, part: str, when: str) -> AgentProcess:
    """An agent with every part in use (caps, node name, sim control, watchdog), `part` made to fail."""
    config = write_config(sockdir, fractional={"devices": [0], "unit": "1Gi"})
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sockdir / "notify.sock"))
    env = dict(os.environ, NOTIFY_SOCKET=str(sockdir / "notify.sock"), WATCHDOG_USEC="2000000")
    env.pop("WATCHDOG_PID", None)
    args = args_for(
        sockdir, config, "--node-name", "node-1", "--sim-control-socket", str(sockdir / "sim.sock")
    )
    launcher = ["tests.failing_agent", part, when, str(sockdir / "trigger"), "--"]
    p = AgentProcess(args, launcher=launcher, env=env)
    p.keep = notify  # systemd's end of NOTIFY_SOCKET stays open while the agent runs
    return p


@pytest.mark.parametrize("part", PARTS)
def test_every_part_failing_at_start(sockdir: Path, processes: list[AgentProcess], part: str) -> None:
    p = every_part(sockdir, part, "start")
    processes.append(p)
    assert_error(
        p, p.end(), 1, f"the agent's {part} part failed: OSError: [Errno 5] injected failure at start"
    )
    assert "gpunode agent ready" not in p.stdout
    assert not list((sockdir / "device-plugins").glob("gpunode-*.sock")), "sockets are removed"


@pytest.mark.parametrize("part", PARTS)
def test_every_part_failing_while_running(sockdir: Path, processes: list[AgentProcess], part: str) -> None:
    p = every_part(sockdir, part, "run")
    processes.append(p)
    p.wait_ready()
    (sockdir / "trigger").touch()
    assert_error(
        p, p.end(), 1, f"the agent's {part} part failed: RuntimeError: injected failure while running"
    )
    assert not list((sockdir / "device-plugins").glob("gpunode-*.sock")), "sockets are removed"


def test_a_stuck_part_does_not_keep_the_process_alive(sockdir: Path, processes: list[AgentProcess]) -> None:
    p = every_part(sockdir, "metrics collector", "stuck")
    processes.append(p)
    p.wait_ready()
    p.proc.send_signal(signal.SIGTERM)
    rc = p.end()
    assert rc == 0, p.stderr
    assert "did not stop within" in p.stderr and "exiting anyway" in p.stderr
    assert "Traceback" not in p.stderr
    assert not list((sockdir / "device-plugins").glob("gpunode-*.sock")), "sockets are removed at exit"


def test_a_stuck_part_after_a_failure_still_ends_with_the_error(
    sockdir: Path, processes: list[AgentProcess]
) -> None:
    config_section = {"fractional": {"devices": [0], "unit": "1Gi"}}
    config = write_config(sockdir, **config_section)
    args = args_for(sockdir, config, "--sim-control-socket", "/nonexistent/dir/sim.sock")
    launcher = ["tests.failing_agent", "metrics collector", "stuck", str(sockdir / "trigger"), "--"]
    p = AgentProcess(args, launcher=launcher)
    processes.append(p)
    assert_error(p, p.end(), 1, "cannot listen for sim control on /nonexistent/dir/sim.sock")
    assert "did not stop within" in p.stderr
