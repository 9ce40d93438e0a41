"""The control socket of a simulated node: JSON over HTTP on a Unix socket (gpunode.infra.http).

`serve_control(backend, socket_path)` lets a running agent on a SimBackend take
faults from outside (demos, end-to-end tests): XID and ECC errors, a lost GPU,
a reset, hot-remove and hot-add. The client side, the `gpunode sim ...`
commands, is simnode/cli.py.

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

Answers are JSON: 200 with the result, 400 {"error": ...} for bad input (a
body is read strictly by a SectionReader: wrong types and unknown fields are
refused), 404 for an unknown GPU, MIG device or path, 405 for a wrong method,
411 for a POST without Content-Length, 413 for a body over MAX_BODY_BYTES. The
server runs on an event loop of its own in a thread, so a slow backend call
never holds up the agent's loop. The socket is created with mode 0600: only
its owner may inject faults. This module only drives a SimBackend; it must
never touch a real GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import stat
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gpunode.contract.reader import SectionReader
from gpunode.errors import DeviceNotFound, GpunodeError, SimControlError, SimFaultError
from gpunode.infra.http import HttpServer, ServerThread, closing
from gpunode.node.devices.base import DeviceEvent, Gpu
from gpunode.node.devices.simnode.backend import SimBackend, SimGpuState

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- server ------------------------------------------------------------------------------------


class ControlServer:
    """A running control socket; close() stops it and removes the socket file."""

    def __init__(self, backend: SimBackend, socket_path: str) -> None:
        self.backend = backend
        self.socket_path = socket_path
        self._thread = ServerThread(
            HttpServer(
                self._handle,
                name="sim control",
                unix_path=socket_path,
                max_body_bytes=MAX_BODY_BYTES,
                log=log,
                error=SimControlError,
                hint="pick a writable directory and a path shorter than 108 bytes",
            )
        )
        self._closed = False

    def start(self) -> None:
        """Bind the socket and serve; SimControlError when the path cannot be bound."""
        self._thread.start()

    def close(self) -> None:
        """Stop the control server and remove its socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._thread.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        route = _ROUTES.get(request.path)
        try:
            if route is None:
                raise _BadRequest(404, f"no such endpoint {request.path_qs}")
            want, action = route
            if request.method != want:
                raise _BadRequest(405, f"{request.path} takes {want}, not {request.method}")
            data = await _read_body(request) if request.method == "POST" else {}
            body = SectionReader(data, request.path, error=SimFaultError, json_object=True)
            return _answer(200, action(self.backend, body))
        except _BadRequest as e:
            response = _answer(e.status, {"error": str(e)})
            return closing(response) if e.status in (411, 413) else response
        except DeviceNotFound as e:
            return _answer(404, {"error": str(e), "unknown_device": True})
        except GpunodeError as e:
            return _answer(400, {"error": str(e)})
        except Exception as e:  # an unexpected failure must not stop the server
            log.exception("sim control: %s %s failed", request.method, request.path)
            return _answer(500, {"error": f"internal error: {type(e).__name__}: {e}"})


def serve_control(backend: SimBackend, socket_path: str | os.PathLike[str]) -> ControlServer:
    """Serve the fault-injection API of `backend` on a Unix socket, on a loop of its own in a thread."""
    path = os.fspath(socket_path)
    _remove_stale_socket(path)
    server = ControlServer(backend, path)
    server.start()
    try:
        os.chmod(path, 0o600)
    except OSError as e:
        server.close()
        raise SimControlError(f"cannot make the control socket {path} private: {e.strerror or e}") from None
    return server


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


async def _read_body(request: web.Request) -> dict[str, Any]:
    """The JSON object a POST carries ({} for an empty body)."""
    if "Content-Length" not in request.headers:
        raise _BadRequest(411, "a POST needs a Content-Length header")
    length = request.content_length or 0
    if length > MAX_BODY_BYTES:
        raise _BadRequest(413, f"the body must be 0..{MAX_BODY_BYTES} bytes, got {length}")
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _BadRequest(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _BadRequest(400, f"the body must be a JSON object, got {type(data).__name__}")
    return data


def _answer(status: int, payload: object) -> web.Response:
    return web.Response(status=status, text=json.dumps(payload), content_type="application/json")


# -- actions -----------------------------------------------------------------------------------


def _gpu(backend: SimBackend, body: SectionReader) -> str:
    ref = body.raw("gpu")
    if isinstance(ref, bool) or not isinstance(ref, str | int):
        raise body.fail("gpu", f"expected a GPU UUID or index, got {ref!r}")
    return backend.resolve_gpu(ref)


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


def _list(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    body.finish()
    return {
        "backend": backend.name,
        "driver_version": backend.driver_version(),
        "gpus": [_state_json(s) for s in backend.gpu_states()],
    }


def _xid(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    code = body.integer("code")
    mig = body.get("mig", str, None)
    body.finish()
    return {"event": _event_json(backend.inject_xid(uuid, code, mig_uuid=mig))}


def _ecc(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    double = body.flag("double", False)
    count = body.integer("count", 1)
    body.finish()
    return {"event": _event_json(backend.inject_ecc(uuid, double, count))}


def _lost(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    body.finish()
    return {"event": _event_json(backend.lose_gpu(uuid))}


def _reset(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    body.finish()
    backend.reset_gpu(uuid)
    return {"reset": uuid}


def _row_remap(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    pending = body.flag("pending", None)
    failure = body.flag("failure", None)
    body.finish()
    backend.set_row_remap(uuid, pending=pending, failure=failure)
    return {"gpu": uuid, "pending": pending, "failure": failure}


def _probe_delay(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    seconds = body.number("seconds")
    body.finish()
    backend.set_probe_delay(uuid, seconds)
    return {"gpu": uuid, "seconds": seconds}


def _remove(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    body.finish()
    return {"event": _event_json(backend.remove_gpu(uuid))}


def _add(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    index = body.integer("index", None)
    model = body.get("model", str, None)
    body.finish()
    return {"gpu": _gpu_json(backend.add_gpu(index=index, model=model))}


_Action = Callable[[SimBackend, SectionReader], dict[str, Any]]
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
