"""The simulated node's control socket: real HTTP over a real Unix socket, and the `gpunode sim` CLI."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode.errors import DeviceNotFound, SimControlError
from gpunode.node.devices.base import EventKind
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.devices.simnode.cli import call_control, register_cli, run_cli
from gpunode.node.devices.simnode.control import ControlServer, serve_control


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths must stay under 108 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="simctl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(short_dir: Path) -> Iterator[tuple[SimBackend, ControlServer]]:
    backend = SimBackend.from_profile("a100-mig")
    server = serve_control(backend, short_dir / "ctl.sock")
    yield backend, server
    server.close()


def raw_request(socket_path: str, data: bytes) -> tuple[int, dict[str, object]]:
    """Send bytes as they are and read one HTTP answer (for requests a client library would not send)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(socket_path)
        s.sendall(data)
        response = http.client.HTTPResponse(s)
        response.begin()
        return response.status, json.loads(response.read())


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpunode")
    register_cli(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


# -- HTTP API ------------------------------------------------------------------------------------


def test_list_reports_every_gpu_with_its_state(node: tuple[SimBackend, ControlServer]) -> None:
    backend, server = node
    answer = call_control(server.socket_path, "GET", "/gpus")
    assert answer["backend"] == "sim:a100-mig"
    assert answer["driver_version"] == backend.driver_version()
    gpus = answer["gpus"]
    assert isinstance(gpus, list)
    assert [g["gpu"]["uuid"] for g in gpus] == [g.uuid for g in backend.gpus()]
    assert gpus[0]["gpu"]["mig_devices"][0]["profile"] == "1g.10gb"
    assert {g["lost"] for g in gpus} == {False}


def test_faults_posted_over_the_socket_reach_the_backend(node: tuple[SimBackend, ControlServer]) -> None:
    backend, server = node
    sock = server.socket_path
    gpus = backend.gpus()
    mig = gpus[2].mig_devices[0].uuid

    answer = call_control(sock, "POST", "/faults/xid", {"gpu": 2, "code": 79, "mig": mig})
    event = backend.wait_event(1)
    assert event is not None and (event.kind, event.gpu_uuid, event.xid, event.mig_uuid) == (
        EventKind.XID,
        gpus[2].uuid,
        79,
        mig,
    )
    assert answer["event"] == {**answer["event"], "kind": "xid", "xid": 79, "gpu_uuid": gpus[2].uuid}

    call_control(sock, "POST", "/faults/ecc", {"gpu": gpus[1].uuid, "double": True, "count": 2})
    event = backend.wait_event(1)
    assert event is not None and (event.kind, event.count) == (EventKind.ECC_DBE, 2)
    assert backend.probe(gpus[1].uuid).ecc_dbe_volatile == 2

    call_control(sock, "POST", "/faults/lost", {"gpu": "3"})
    assert not backend.probe(gpus[3].uuid).reachable
    call_control(sock, "POST", "/faults/reset", {"gpu": 3})
    assert backend.probe(gpus[3].uuid).reachable

    call_control(sock, "POST", "/faults/row-remap", {"gpu": 0, "pending": True})
    assert backend.probe(gpus[0].uuid).row_remap_pending is True
    call_control(sock, "POST", "/faults/probe-delay", {"gpu": 0, "seconds": 0.01})
    assert backend.gpu_states()[0].probe_delay_s == 0.01

    call_control(sock, "POST", "/gpus/remove", {"gpu": 5})
    assert gpus[5].uuid not in [g.uuid for g in backend.gpus()]
    added = call_control(sock, "POST", "/gpus/add", {"index": 5})
    assert added["gpu"]["index"] == 5 and added["gpu"]["uuid"] != gpus[5].uuid
    assert added["gpu"]["pci_bus_id"] == gpus[5].pci_bus_id


BAD_REQUESTS = [
    ("unknown-endpoint", b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404, "no such endpoint /nope"),
    ("wrong-method", b"GET /faults/xid HTTP/1.1\r\nHost: x\r\n\r\n", 405, "takes POST, not GET"),
    ("no-content-length", b"POST /faults/xid HTTP/1.1\r\nHost: x\r\n\r\n", 411, "Content-Length"),
    (
        "not-json",
        b"POST /faults/lost HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{gpu:",
        400,
        "not valid JSON",
    ),
    (
        "json-array",
        b"POST /faults/lost HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n[0]",
        400,
        "must be a JSON object",
    ),
    (
        "too-large",
        b"POST /faults/lost HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\n",
        413,
        "body must be",
    ),
]


def _post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data


BAD_BODIES = [
    ("missing-gpu", _post("/faults/lost", {}), 400, "/faults/lost.gpu: required key is missing"),
    (
        "code-not-int",
        _post("/faults/xid", {"gpu": 0, "code": "79"}),
        400,
        "code: expected an integer, got '79'",
    ),
    ("code-bool", _post("/faults/xid", {"gpu": 0, "code": True}), 400, "code: expected an integer, got True"),
    ("code-zero", _post("/faults/xid", {"gpu": 0, "code": 0}), 400, "positive integer"),
    (
        "unknown-field",
        _post("/faults/lost", {"gpu": 0, "force": True}),
        400,
        "/faults/lost: unknown key force",
    ),
    ("gpu-as-float", _post("/faults/lost", {"gpu": 1.5}), 400, "gpu: expected a GPU UUID or index, got 1.5"),
    ("unknown-gpu-index", _post("/faults/lost", {"gpu": 42}), 404, "no GPU with index 42"),
    ("unknown-gpu-uuid", _post("/faults/reset", {"gpu": "GPU-nope"}), 404, "GPU-nope"),
    ("unknown-mig", _post("/faults/xid", {"gpu": 0, "code": 31, "mig": "MIG-nope"}), 404, "MIG-nope"),
    ("add-taken-index", _post("/gpus/add", {"index": 0}), 400, "index 0 is taken"),
    ("negative-delay", _post("/faults/probe-delay", {"gpu": 0, "seconds": -1}), 400, "cannot be negative"),
]


@pytest.mark.parametrize(
    ("request_bytes", "status", "message"),
    [pytest.param(r, s, m, id=i) for i, r, s, m in BAD_REQUESTS + BAD_BODIES],
)
def test_bad_requests_get_a_json_error_and_change_nothing(
    node: tuple[SimBackend, ControlServer], request_bytes: bytes, status: int, message: str
) -> None:
    backend, server = node
    before = backend.gpu_states()
    got_status, answer = raw_request(server.socket_path, request_bytes)
    assert (got_status, message in str(answer.get("error"))) == (status, True), answer
    assert backend.gpu_states() == before
    assert backend.wait_event(0) is None
    # The server keeps serving after a bad request.
    assert call_control(server.socket_path, "GET", "/gpus")["backend"] == "sim:a100-mig"


# -- socket life cycle ---------------------------------------------------------------------------


def test_the_socket_is_private_and_removed_on_close(short_dir: Path) -> None:
    path = short_dir / "ctl.sock"
    server = serve_control(SimBackend.from_profile("t4"), path)
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    server.close()
    assert not path.exists()
    server.close()  # closing twice is harmless


def test_a_stale_socket_is_replaced(short_dir: Path) -> None:
    path = short_dir / "ctl.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens
    with serve_control(SimBackend.from_profile("t4"), path) as server:
        assert call_control(server.socket_path, "GET", "/gpus")["backend"] == "sim:t4"


@pytest.mark.parametrize("occupant", ["live-server", "regular-file"])
def test_an_occupied_path_is_refused(short_dir: Path, occupant: str) -> None:
    path = short_dir / "ctl.sock"
    first = None
    if occupant == "live-server":
        first = serve_control(SimBackend.from_profile("t4"), path)
    else:
        path.write_text("precious")
    try:
        with pytest.raises(SimControlError) as err:
            serve_control(SimBackend.from_profile("t4"), path)
        assert str(path) in str(err.value)
        if occupant == "regular-file":
            assert path.read_text() == "precious"
        else:
            assert call_control(str(path), "GET", "/gpus")["backend"] == "sim:t4"
    finally:
        if first is not None:
            first.close()


# -- CLI -----------------------------------------------------------------------------------------


def test_cli_list_prints_a_table(
    node: tuple[SimBackend, ControlServer], capsys: pytest.CaptureFixture[str]
) -> None:
    backend, server = node
    backend.lose_gpu(backend.gpus()[6].uuid)
    assert run_cli(cli("sim", "list", "--socket", server.socket_path)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"sim:a100-mig (driver {backend.driver_version()})"
    assert lines[1].split()[:3] == ["INDEX", "UUID", "MODEL"]
    rows = lines[2:]
    assert len(rows) == 8
    assert " lost " in rows[6] and " ok " in rows[5]
    assert rows[7].rstrip().endswith("-")  # MIG disabled
    assert "3g.40gb,3g.40gb" in rows[4]


def test_cli_list_json_is_the_api_answer(
    node: tuple[SimBackend, ControlServer], capsys: pytest.CaptureFixture[str]
) -> None:
    _, server = node
    run_cli(cli("sim", "list", "--socket", server.socket_path, "--json"))
    assert json.loads(capsys.readouterr().out) == call_control(server.socket_path, "GET", "/gpus")


@pytest.mark.parametrize(
    ("argv", "printed", "check"),
    [
        (["xid", "--gpu", "0", "--code", "79"], "XID 79: GPU-", lambda b, g: b.wait_event(1).xid == 79),
        (
            ["ecc", "--gpu", "1", "--double", "--count", "3"],
            "3 double-bit ECC error(s)",
            lambda b, g: b.probe(g[1].uuid).ecc_dbe_volatile == 3,
        ),
        (
            ["ecc", "--gpu", "1"],
            "1 single-bit ECC error(s)",
            lambda b, g: b.probe(g[1].uuid).ecc_sbe_volatile == 1,
        ),
        (["lose", "--gpu", "2"], "GPU lost", lambda b, g: not b.probe(g[2].uuid).reachable),
        (["reset", "--gpu", "2"], "GPU reset", lambda b, g: b.probe(g[2].uuid).reachable),
        (["remove", "--gpu", "7"], "GPU removed", lambda b, g: len(b.gpus()) == 7),
        (["add"], "GPU added: index 8", lambda b, g: len(b.gpus()) == 9),
        (
            ["row-remap", "--gpu", "0", "--pending", "--no-failure"],
            "pending=True failure=False",
            lambda b, g: b.probe(g[0].uuid).row_remap_pending,
        ),
        (
            ["probe-delay", "--gpu", "0", "--seconds", "0.5"],
            "now take 0.5 s",
            lambda b, g: b.gpu_states()[0].probe_delay_s == 0.5,
        ),
    ],
    ids=["xid", "ecc-double", "ecc-single", "lose", "reset", "remove", "add", "row-remap", "probe-delay"],
)
def test_cli_commands_act_on_the_node(
    node: tuple[SimBackend, ControlServer],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    printed: str,
    check: object,
) -> None:
    backend, server = node
    gpus = backend.gpus()
    assert run_cli(cli("sim", argv[0], "--socket", server.socket_path, *argv[1:])) == 0
    assert printed in capsys.readouterr().out
    assert check(backend, gpus)  # type: ignore[operator]


def test_cli_accepts_a_uuid_and_names_the_mig_device(
    node: tuple[SimBackend, ControlServer], capsys: pytest.CaptureFixture[str]
) -> None:
    backend, server = node
    gpu = backend.gpus()[3]
    mig = gpu.mig_devices[1].uuid
    run_cli(
        cli("sim", "xid", "--socket", server.socket_path, "--gpu", gpu.uuid, "--code", "43", "--mig", mig)
    )
    assert capsys.readouterr().out.strip() == f"XID 43: {gpu.uuid} ({mig})"


def test_cli_errors_are_gpunode_errors(node: tuple[SimBackend, ControlServer], short_dir: Path) -> None:
    _, server = node
    with pytest.raises(DeviceNotFound) as unknown:
        run_cli(cli("sim", "lose", "--socket", server.socket_path, "--gpu", "17"))
    assert "index 17" in str(unknown.value)
    with pytest.raises(SimControlError) as refused:
        run_cli(cli("sim", "xid", "--socket", server.socket_path, "--gpu", "0", "--code", "-4"))
    assert "HTTP 400" in str(refused.value) and "positive integer" in str(refused.value)
    missing = str(short_dir / "absent.sock")
    with pytest.raises(SimControlError) as nobody:
        run_cli(cli("sim", "list", "--socket", missing))
    assert f"no simulated node listens on {missing}" in str(nobody.value)
    assert nobody.value.hint


def test_cli_parser_dispatches_to_run_cli() -> None:
    args = cli("sim", "lose", "--socket", "/run/x.sock", "--gpu", "GPU-abc")
    assert args.func is run_cli
    assert (args.command, args.sim_command, args.gpu, args.socket) == (
        "sim",
        "lose",
        "GPU-abc",
        "/run/x.sock",
    )


def test_cli_requires_a_socket_and_an_action() -> None:
    with pytest.raises(SystemExit):
        cli("sim", "list")
    with pytest.raises(SystemExit):
        cli("sim")
    with pytest.raises(SystemExit):
        cli("sim", "xid", "--socket", "/x", "--gpu", "0")  # no --code
