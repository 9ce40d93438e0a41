"""`gpunode doctor` on the agent itself: is one running here (its metrics /health answers), are its
device-plugin sockets in the kubelet's directory and accepting connections, does the state directory
exist; and a backend that cannot be opened is reported once, not again by every check that needs it."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpunode import cli
from gpunode.node.agent import Agent
from gpunode.node.doctor import FAIL, OK, WARN, checks, render
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn
from tests.ports import free_port


def by_name(results: list) -> dict:
    return {c.name: c for c in results}


@contextmanager
def http_answering(status: int, body: str) -> Iterator[int]:
    """A stand-in for something on the metrics port that answers every GET with `status` and `body`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_running_agent_is_found_with_its_health_and_plugin_sockets(
    sockdir: Path, kubelet: KubeletStandIn
) -> None:
    port = free_port()
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", backend="sim", simProfile="t4",
                      metrics={"listen": f"127.0.0.1:{port}"})  # fmt: skip
    with RunningAgent(Agent(cfg)):
        kubelet.wait_for_resources(["nvidia.com/gpu"], timeout=60)
        # The first collection may still be under way: /health answers 503 until it is done.
        deadline = time.monotonic() + 60
        while (results := by_name(checks(cfg)))["agent"].status != OK and time.monotonic() < deadline:
            time.sleep(0.2)
        agent, plugins = results["agent"], results["device plugins"]
        assert agent.status == OK, agent
        assert agent.detail.startswith(f"running: http://127.0.0.1:{port}/health answers OK"), agent
        assert plugins.status == OK and "gpunode-nvidia.com_gpu.sock" in plugins.detail, plugins
        assert results["state directory"].status == OK
    # Stopped: nothing answers, and its sockets are gone.
    results = by_name(checks(cfg))
    assert results["agent"].status == WARN and "connection refused" in results["agent"].detail
    assert results["agent"].hint.startswith("start the agent")
    assert (
        results["device plugins"].status == WARN
        and "no agent plugin socket" in results["device plugins"].detail
    )


def test_a_plugin_socket_that_does_not_accept_connections_fails(sockdir: Path) -> None:
    plugins_dir = sockdir / "device-plugins"
    plugins_dir.mkdir()
    with socket.socket(
        socket.AF_UNIX, socket.SOCK_STREAM
    ) as s:  # bound, never listening: a dead agent's file
        s.bind(str(plugins_dir / "gpunode-nvidia.com_gpu.sock"))
    cfg = make_config(plugins_dir, sockdir / "state", backend="sim", simProfile="t4")
    check = by_name(checks(cfg))["device plugins"]
    assert check.status == FAIL and "gpunode-nvidia.com_gpu.sock does not accept connections" in check.detail
    assert check.hint


@pytest.mark.parametrize(
    ("status", "body", "expected", "fragment"),
    [
        pytest.param(
            503, "KO: no collection for 45s\n", FAIL, "answers 503: KO: no collection for 45s", id="503"
        ),
        pytest.param(401, "Unauthorized\n", WARN, "asks for credentials (401)", id="401"),
        pytest.param(404, "not found\n", WARN, "answers 404", id="something-else"),
    ],
)
def test_what_the_metrics_port_answers_decides_the_agent_check(
    sockdir: Path, status: int, body: str, expected: str, fragment: str
) -> None:
    with http_answering(status, body) as port:
        cfg = make_config(sockdir / "device-plugins", sockdir / "state", backend="sim",
                          metrics={"listen": f"127.0.0.1:{port}"})  # fmt: skip
        check = by_name(checks(cfg))["agent"]
    assert check.status == expected and fragment in check.detail and check.hint, check


def test_a_protected_metrics_endpoint_is_not_checked_without_credentials(sockdir: Path) -> None:
    with http_answering(503, "KO: would be wrong to read\n") as port:
        cfg = make_config(sockdir / "device-plugins", sockdir / "state", backend="sim",
                          metrics={"listen": f"127.0.0.1:{port}", "webConfigFile": "/etc/gpunode/web.yaml"})  # fmt: skip
        check = by_name(checks(cfg))["agent"]
    assert (
        check.status == WARN
        and check.detail.startswith("not checked: ")
        and "/etc/gpunode/web.yaml" in check.detail
    )
    assert "credentials" in check.detail and "curl" in check.hint


def test_a_state_directory_that_does_not_exist_is_reported(sockdir: Path) -> None:
    cfg = make_config(sockdir / "device-plugins", sockdir / "no" / "state", backend="sim")
    check = by_name(checks(cfg))["state directory"]
    assert check.status == WARN and check.detail.startswith(f"{sockdir / 'no' / 'state'} does not exist")
    (sockdir / "file").write_text("")
    cfg = make_config(sockdir / "device-plugins", sockdir / "file", backend="sim")
    assert by_name(checks(cfg))["state directory"].status == FAIL


def test_a_backend_failure_is_printed_once(sockdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["doctor", "--backend", "sim", "--sim-profile", "dgx-h10", "--kubelet-dir", str(sockdir),
            "--state-dir", str(sockdir / "s")]  # fmt: skip
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert out.count("no bundled simulated-node profile named 'dgx-h10'") == 1, out
    assert "[FAIL] gpu backend: command line --sim-profile: no bundled" in out
    assert "[warn] advertised devices: not checked: the gpu backend failed (above)" in out
    results = by_name(checks(make_config(sockdir, sockdir / "s", backend="sim", simProfile="dgx-h10")))
    assert results["gpu backend"].detail.startswith("test-config.yaml: gpunode.simProfile: ")
    assert sum("dgx-h10" in c.detail for c in results.values()) == 1
    assert "dgx-h10" in render(list(results.values()))


def _no_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--backend auto` finds no GPU on this machine (as on one without NVIDIA's driver); sim still opens."""
    from gpunode.errors import BackendUnavailable
    from gpunode.node.devices import select

    real = select.detect_backend

    def detect(kind: str = "auto", sim_profile: object = None, **kw: object) -> object:
        if kind == "auto":
            raise BackendUnavailable("--backend auto found no GPU backend: libnvidia-ml.so.1 not found")
        return real(kind, sim_profile, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(select, "detect_backend", detect)


def test_doctor_with_backend_auto_checks_the_backend_of_the_agent_running_beside_it(
    sockdir: Path, kubelet: KubeletStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As after scripts/run-agent.sh on a machine without a GPU: the agent runs on the simulated node,
    doctor is run with its defaults (--backend auto) and reports the agent's backend, not a failure."""
    _no_gpu_here(monkeypatch)
    port = free_port()
    dirs = (sockdir / "device-plugins", sockdir / "state")
    listen = {"listen": f"127.0.0.1:{port}"}
    agent_cfg = make_config(*dirs, backend="sim", simProfile="t4", metrics=listen)
    doctor_cfg = make_config(*dirs, metrics=listen)  # backend auto, no profile
    assert doctor_cfg.backend == "auto"
    before = by_name(checks(doctor_cfg))["gpu backend"]
    assert before.status == FAIL and "--backend auto found no GPU backend" in before.detail, before
    with RunningAgent(Agent(agent_cfg)):
        kubelet.wait_for_resources(["nvidia.com/gpu"], timeout=60)
        results = by_name(checks(doctor_cfg))
        backend = results["gpu backend"]
        assert backend.status == OK, backend
        assert backend.detail.startswith(f"sim:t4 (the backend of the agent at http://127.0.0.1:{port}): "), (
            backend
        )
        assert "GPU(s) " in backend.detail
        # The checks that need the GPUs run against the agent's: its plugin sockets are the expected ones.
        assert results["advertised devices"].status == OK, results["advertised devices"]
        assert "nvidia.com/gpu" in results["advertised devices"].detail
        assert results["device plugins"].status == OK, results["device plugins"]
        assert not [c for c in results.values() if c.status == FAIL], render(list(results.values()))


def test_doctor_names_an_agent_backend_it_cannot_use_here(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An agent on NVML answering while doctor's own NVML finds nothing: still a failure, saying both."""
    _no_gpu_here(monkeypatch)
    with http_answering(200, '{"backend": "nvml"}') as port:
        cfg = make_config(tmp_path / "dp", tmp_path / "state", metrics={"listen": f"127.0.0.1:{port}"})
        backend = by_name(checks(cfg))["gpu backend"]
    assert backend.status == FAIL
    assert backend.detail.startswith(
        f"the agent at http://127.0.0.1:{port} uses nvml, but here --backend auto"
    )


def test_something_else_on_the_metrics_port_leaves_the_auto_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_gpu_here(monkeypatch)
    with http_answering(200, "<html>not an agent</html>") as port:
        cfg = make_config(tmp_path / "dp", tmp_path / "state", metrics={"listen": f"127.0.0.1:{port}"})
        backend = by_name(checks(cfg))["gpu backend"]
    assert backend.status == FAIL and "--backend auto found no GPU backend" in backend.detail
