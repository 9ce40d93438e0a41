"""The control interface of a simulated node: JSON over HTTP on a Unix socket, and its CLI.

`serve_control(backend, socket_path)` lets a running agent on a SimBackend take
faults from outside (demos, end-to-end tests): XID and ECC errors, a lost GPU,
a reset, hot-remove and hot-add. `register_cli`/`run_cli` are the client side,
the `gpunode sim ...` commands.

Endpoints (a GPU is named by its UUID or its index; bodies are JSON objects):

    GET  /gpus                 every GPU with its fault state
    POST /faults/xid           {"gpu": 0, "code": 79, "mig": "MIG-..."?}
    POST /faults/ecc           {"gpu": 0, "double": false, "count": 1}
    POST /faults/lost          {"gpu": 0}
    POST /faults/reset         {"gpu": 0}
    POST /faults/row-remap     {"gpu": 0, "pending": true?, "failure": false?}
    POST /faults/probe-delay   {"gpu": 0, "seconds": 30}
    POST /gpus/remove          {"gpu": 0}
    POST /gpus/add             {"index": 3?, "model": "h100"?}

Answers are JSON: 200 with the result, 400 {"error": ...} for bad input, 404 for
an unknown GPU, MIG device or path, 405 for a wrong method. The socket is
created with mode 0600: only its owner may inject faults. This module only
drives a SimBackend; it must never touch a real GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import logging
import os
import socket
import socketserver
import stat
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from gpunode.errors import DeviceNotFound, GpunodeError
from gpunode.node.devices.base import DeviceEvent, Gpu
from gpunode.node.devices.simnode.backend import SimBackend, SimGpuState

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024


class SimControlError(GpunodeError):
    """The control socket of a simulated node cannot be served or reached, or refused a request."""

    default_hint = (
        "start the agent with --backend sim and pass the control socket it reports to --socket; "
        "`gpunode sim list --socket PATH` shows the GPUs"
    )


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- server ------------------------------------------------------------------------------------


class ControlServer:
    """A running control socket; close() stops it and removes the socket file."""

    def __init__(self, server: _UnixHTTPServer, thread: threading.Thread, socket_path: str) -> None:
        self._server = server
        self._thread = thread
        self.socket_path = socket_path
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = True

    def __init__(self, socket_path: str, backend: SimBackend) -> None:
        self.backend = backend
        super().__init__(socket_path, _Handler)


def serve_control(backend: SimBackend, socket_path: str | os.PathLike[str]) -> ControlServer:
    """Serve the fault-injection API of `backend` on a Unix socket, in a background thread."""
    path = os.fspath(socket_path)
    _remove_stale_socket(path)
    try:
        server = _UnixHTTPServer(path, backend)
        os.chmod(path, 0o600)
    except OSError as e:
        raise SimControlError(
            f"cannot listen on the control socket {path}: {e.strerror or e}",
            hint="pick a writable directory and a path shorter than 108 bytes",
        ) from None
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="sim-control", daemon=True
    )
    thread.start()
    log.info("simulated-node control socket listening on %s", path)
    return ControlServer(server, thread, path)


def _remove_stale_socket(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SimControlError(
            f"{path} exists and is not a socket; refusing to replace it",
            hint="choose another control socket path",
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # left behind by a process that is gone
        return
    except OSError as e:
        raise SimControlError(f"cannot check the existing socket {path}: {e.strerror or e}") from None
    finally:
        probe.close()
    raise SimControlError(
        f"another process already serves the control socket {path}",
        hint="stop the other simulated agent, or choose another control socket path",
    )


class _Handler(BaseHTTPRequestHandler):
    server: _UnixHTTPServer
    protocol_version = "HTTP/1.1"

    def address_string(self) -> str:
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("sim control: " + format, *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        route = _ROUTES.get(self.path.split("?", 1)[0])
        try:
            if route is None:
                raise _BadRequest(404, f"no such endpoint {self.path}")
            want, action = route
            if method != want:
                raise _BadRequest(405, f"{self.path} takes {want}, not {method}")
            body = self._read_body() if method == "POST" else _Body({}, self.path)
            self._answer(200, action(self.server.backend, body))
        except _BadRequest as e:
            self._answer(e.status, {"error": str(e)})
        except DeviceNotFound as e:
            self._answer(404, {"error": e.message, "unknown_device": True})
        except GpunodeError as e:
            self._answer(400, {"error": e.message})
        except Exception as e:  # an unexpected failure must not kill the control thread
            log.exception("sim control: %s %s failed", method, self.path)
            self._answer(500, {"error": f"internal error: {type(e).__name__}: {e}"})

    def _read_body(self) -> _Body:
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise _BadRequest(411, "a POST needs a Content-Length header")
        try:
            length = int(length_text)
        except ValueError:
            raise _BadRequest(400, f"bad Content-Length {length_text!r}") from None
        if length < 0 or length > MAX_BODY_BYTES:
            raise _BadRequest(413, f"the body must be 0..{MAX_BODY_BYTES} bytes, got {length}")
        raw = self.rfile.read(length)
        if not raw.strip():
            return _Body({}, self.path)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _BadRequest(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise _BadRequest(400, f"the body must be a JSON object, got {type(data).__name__}")
        return _Body(data, self.path)

    def _answer(self, status: int, payload: object) -> None:
        data = json.dumps(payload, indent=None).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Body:
    """Strict access to a request's JSON fields: wrong types and unknown fields are refused."""

    def __init__(self, data: dict[str, Any], path: str) -> None:
        self._data = data
        self._path = path
        self._seen: set[str] = set()

    def get(self, key: str, kinds: tuple[type, ...], *, required: bool = False) -> Any:
        self._seen.add(key)
        value = self._data.get(key)
        if value is None:
            if required:
                raise _BadRequest(400, f"{self._path}: field {key!r} is required")
            return None
        if isinstance(value, bool) and bool not in kinds:
            value = object()  # a JSON true/false is not a number here
        if not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise _BadRequest(400, f"{self._path}: field {key!r} must be {names}, got {self._data[key]!r}")
        return value

    def gpu(self, backend: SimBackend) -> str:
        return backend.resolve_gpu(self.get("gpu", (str, int), required=True))

    def finish(self) -> None:
        """Refuse unknown fields; every action calls this after reading its fields and before acting."""
        unknown = sorted(set(self._data) - self._seen)
        if unknown:
            raise _BadRequest(400, f"{self._path}: unknown field(s) {', '.join(unknown)}")


def _event_json(event: DeviceEvent) -> dict[str, Any]:
    out = dataclasses.asdict(event)
    out["kind"] = event.kind.value
    return out


def _gpu_json(gpu: Gpu) -> dict[str, Any]:
    return dataclasses.asdict(gpu)


def _state_json(state: SimGpuState) -> dict[str, Any]:
    out = dataclasses.asdict(state)
    out["gpu"] = _gpu_json(state.gpu)
    return out


def _list(backend: SimBackend, body: _Body) -> dict[str, Any]:
    body.finish()
    return {
        "backend": backend.name,
        "driver_version": backend.driver_version(),
        "gpus": [_state_json(s) for s in backend.gpu_states()],
    }


def _xid(backend: SimBackend, body: _Body) -> dict[str, Any]:
    uuid = body.gpu(backend)
    code = body.get("code", (int,), required=True)
    mig = body.get("mig", (str,))
    body.finish()
    return {"event": _event_json(backend.inject_xid(uuid, code, mig_uuid=mig))}


def _ecc(backend: SimBackend, body: _Body) -> dict[str, Any]:
    uuid = body.gpu(backend)
    double = body.get("double", (bool,)) or False
    count = body.get("count", (int,))
    body.finish()
    return {"event": _event_json(backend.inject_ecc(uuid, double, 1 if count is None else count))}


def _lost(backend: SimBackend, body: _Body) -> dict[str, Any]:
    uuid = body.gpu(backend)
    body.finish()
    return {"event": _event_json(backend.lose_gpu(uuid))}


def _reset(backend: SimBackend, body: _Body) -> dict[str, Any]:
    uuid = body.gpu(backend)
    body.finish()
    backend.reset_gpu(uuid)
    return {"reset": uuid}


def _row_remap(backend: SimBackend, body: _Body) -> dict[str, Any]:
    uuid = body.gpu(backend)
    pending = body.get("pending", (bool,))
    failure = body.get("failure", (bool,))
    body.finish()
    backend.set_row_remap(uuid, pending=pending, failure=failure)
    return {"gpu": uuid, "pending": pending, "failure": failure}


def _probe_delay(backend: SimBackend, body: _Body) -> dict[str, Any]:
    uuid = body.gpu(backend)
    seconds = body.get("seconds", (int, float), required=True)
    body.finish()
    backend.set_probe_delay(uuid, float(seconds))
    return {"gpu": uuid, "seconds": float(seconds)}


def _remove(backend: SimBackend, body: _Body) -> dict[str, Any]:
    uuid = body.gpu(backend)
    body.finish()
    return {"event": _event_json(backend.remove_gpu(uuid))}


def _add(backend: SimBackend, body: _Body) -> dict[str, Any]:
    index = body.get("index", (int,))
    model = body.get("model", (str,))
    body.finish()
    return {"gpu": _gpu_json(backend.add_gpu(index=index, model=model))}


_Action = Callable[[SimBackend, _Body], dict[str, Any]]
_ROUTES: dict[str, tuple[str, _Action]] = {
    "/gpus": ("GET", _list),
    "/faults/xid": ("POST", _xid),
    "/faults/ecc": ("POST", _ecc),
    "/faults/lost": ("POST", _lost),
    "/faults/reset": ("POST", _reset),
    "/faults/row-remap": ("POST", _row_remap),
    "/faults/probe-delay": ("POST", _probe_delay),
    "/gpus/remove": ("POST", _remove),
    "/gpus/add": ("POST", _add),
}


# -- client ------------------------------------------------------------------------------------


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def call_control(
    socket_path: str, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Send one request to a simulated node's control socket; return the JSON answer or raise SimControlError."""
    conn = _UnixHTTPConnection(socket_path, timeout_s)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        status = response.status
    except (FileNotFoundError, ConnectionRefusedError):
        raise SimControlError(f"no simulated node listens on {socket_path}") from None
    except OSError as e:
        raise SimControlError(f"cannot talk to the control socket {socket_path}: {e.strerror or e}") from None
    except http.client.HTTPException as e:
        raise SimControlError(f"the control socket {socket_path} answered badly: {e!r}") from None
    finally:
        conn.close()
    try:
        answer = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SimControlError(
            f"the control socket {socket_path} answered HTTP {status} without JSON"
        ) from None
    if status != 200:
        error = answer.get("error", answer) if isinstance(answer, dict) else answer
        if status == 404 and isinstance(answer, dict) and answer.get("unknown_device"):
            raise DeviceNotFound(f"simulated node: {error}", hint="list the GPUs with `gpunode sim list`")
        raise SimControlError(f"the simulated node refused the request (HTTP {status}): {error}")
    if not isinstance(answer, dict):
        raise SimControlError(f"the control socket {socket_path} answered with {type(answer).__name__}")
    return answer


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the `sim` command group (fault injection into a running simulated node) to a CLI.

    The parsed arguments carry func=run_cli and sim_command (the action).
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--socket", required=True, metavar="PATH", help="control socket of the simulated node"
    )
    common.add_argument("--json", action="store_true", help="print the raw JSON answer")
    gpu = argparse.ArgumentParser(add_help=False)
    gpu.add_argument("--gpu", required=True, metavar="UUID|INDEX", help="the GPU, by UUID or index")

    sim = subparsers.add_parser(
        "sim",
        help="inject faults into a running simulated node",
        description="Drive the fault injection of an agent running with --backend sim, over its control socket.",
    )
    sim.set_defaults(func=run_cli)
    actions = sim.add_subparsers(dest="sim_command", required=True, metavar="ACTION")
    actions.add_parser("list", parents=[common], help="list the GPUs and their fault state")
    p = actions.add_parser("xid", parents=[common, gpu], help="report an XID error")
    p.add_argument("--code", required=True, type=int, help="the XID, e.g. 79 (fell off the bus) or 48 (DBE)")
    p.add_argument("--mig", metavar="MIG-UUID", help="the MIG device the error concerns")
    p = actions.add_parser("ecc", parents=[common, gpu], help="report ECC errors")
    p.add_argument("--double", action="store_true", help="double-bit (uncorrected) instead of single-bit")
    p.add_argument("--count", type=int, default=1, help="number of errors (default 1)")
    actions.add_parser("lose", parents=[common, gpu], help="the GPU falls off the bus")
    actions.add_parser(
        "reset", parents=[common, gpu], help="reset the GPU (clears lost state and volatile ECC)"
    )
    actions.add_parser("remove", parents=[common, gpu], help="hot-unplug the GPU")
    p = actions.add_parser("add", parents=[common], help="hot-plug a new GPU")
    p.add_argument("--index", type=int, help="the index (slot) to fill; default the first free one")
    p.add_argument("--model", help="a model key or name of the profile; default the slot's model")
    p = actions.add_parser("row-remap", parents=[common, gpu], help="set the row-remapper state")
    p.add_argument("--pending", action=argparse.BooleanOptionalAction, default=None, help="remap pending")
    p.add_argument("--failure", action=argparse.BooleanOptionalAction, default=None, help="remap failure")
    p = actions.add_parser("probe-delay", parents=[common, gpu], help="make health probes of the GPU hang")
    p.add_argument("--seconds", type=float, required=True, help="how long each probe takes (0 to stop)")
    return sim


# Each command: the HTTP method, the endpoint and the argparse fields that make up its body.
_COMMANDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "list": ("GET", "/gpus", ()),
    "xid": ("POST", "/faults/xid", ("gpu", "code", "mig")),
    "ecc": ("POST", "/faults/ecc", ("gpu", "double", "count")),
    "lose": ("POST", "/faults/lost", ("gpu",)),
    "reset": ("POST", "/faults/reset", ("gpu",)),
    "remove": ("POST", "/gpus/remove", ("gpu",)),
    "add": ("POST", "/gpus/add", ("index", "model")),
    "row-remap": ("POST", "/faults/row-remap", ("gpu", "pending", "failure")),
    "probe-delay": ("POST", "/faults/probe-delay", ("gpu", "seconds")),
}


def run_cli(args: argparse.Namespace) -> int:
    """Run one `gpunode sim` command; raises SimControlError/DeviceNotFound when it fails."""
    command = args.sim_command
    if command not in _COMMANDS:
        raise SimControlError(f"unknown sim command {command!r}", hint="see `gpunode sim --help`")
    method, path, fields = _COMMANDS[command]
    values = vars(args)
    body: dict[str, Any] | None = None
    if method == "POST":
        body = {f: values[f] for f in fields if values.get(f) is not None}
        if isinstance(body.get("gpu"), str) and body["gpu"].isdigit():
            body["gpu"] = int(body["gpu"])
    answer = call_control(args.socket, method, path, body)
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(_describe(command, answer))
    sys.stdout.flush()
    return 0


def _describe(command: str, answer: dict[str, Any]) -> str:
    if command == "list":
        return _format_table(answer)
    if "event" in answer:
        e = answer["event"]
        what = {
            "xid": f"XID {e['xid']}",
            "ecc_sbe": f"{e['count']} single-bit ECC error(s)",
            "ecc_dbe": f"{e['count']} double-bit ECC error(s)",
            "gpu_lost": "GPU lost",
            "gpu_removed": "GPU removed",
        }.get(e["kind"], e["kind"])
        where = e["gpu_uuid"] + (f" ({e['mig_uuid']})" if e.get("mig_uuid") else "")
        return f"{what}: {where}"
    if command == "add":
        g = answer["gpu"]
        return f"GPU added: index {g['index']} {g['uuid']} {g['model']} at {g['pci_bus_id']}"
    if command == "reset":
        return f"GPU reset: {answer['reset']}"
    if command == "row-remap":
        return f"row remap of {answer['gpu']}: pending={answer['pending']} failure={answer['failure']}"
    return f"probes of {answer['gpu']} now take {answer['seconds']:g} s"


def _format_table(answer: dict[str, Any]) -> str:
    header = ("INDEX", "UUID", "MODEL", "PCI BUS ID", "NUMA", "STATE", "ECC SBE/DBE", "MIG")
    rows = [header]
    for state in answer["gpus"]:
        g = state["gpu"]
        mig = ",".join(m["profile"] for m in g["mig_devices"]) if g["mig_enabled"] else "-"
        flags = ["lost" if state["lost"] else "ok"]
        if state["row_remap_pending"]:
            flags.append("remap-pending")
        if state["row_remap_failure"]:
            flags.append("remap-failure")
        if state["retired_pages_pending"]:
            flags.append("pages-pending")
        if state["probe_delay_s"]:
            flags.append(f"probe-delay={state['probe_delay_s']:g}s")
        rows.append(
            (
                str(g["index"]),
                g["uuid"],
                g["model"],
                g["pci_bus_id"],
                "-" if g["numa_node"] is None else str(g["numa_node"]),
                ",".join(flags),
                f"{state['ecc_sbe_volatile']}/{state['ecc_dbe_volatile']}",
                mig or "(none)",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"{answer['backend']} (driver {answer['driver_version']})"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)
