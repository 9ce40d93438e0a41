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
    POST /gpus/activity        {"gpu": 0, "ratio": 0.9}  (0..1; null: follow the processes again)

Ranges: a GPU index 0..255 (a UUID up to 128 characters), an XID code
1..2**32-1, an ECC count 1..1,000,000, a probe delay 0..86400 s (finite: NaN and
Infinity are refused), a body nested at most MAX_JSON_DEPTH deep. The field
checks (gpu_field, xid_field, count_field, seconds_field, name_field, ...) and
decode_body are functions of their own, for new routes to reuse.

Answers are JSON: 200 with the result, 400 {"error": ...} for bad input (a
body is read strictly by a SectionReader: wrong types, unknown fields, NaN and
Infinity, values out of range and JSON nested deeper than MAX_JSON_DEPTH are
refused, naming the field; the ranges are below), 404 for an unknown GPU, MIG device or path, 405 for a wrong method,
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
import re
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
MAX_JSON_DEPTH = 8  # bodies are flat objects; deeper nesting is refused before it is parsed
# Ranges of the fields (a request outside them is a 400 naming the field).
MAX_GPU_INDEX = 255
MAX_NAME_CHARS = 128  # a GPU or MIG UUID, a model name
MAX_XID = 2**32 - 1  # NVML reports an XID as an unsigned 32-bit value
MAX_ECC_COUNT = 1_000_000  # ECC errors reported by one request
MAX_PROBE_DELAY_S = 86400.0  # one day


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
                error_response=lambda status, message: _answer(status, {"error": message}),
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
        except Exception as e:  # an unexpected failure must not stop the server (one line, no traceback)
            log.error("sim control: %s %s failed: %s: %s", request.method, request.path, type(e).__name__, e)
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
    try:
        return decode_body(raw)
    except SimFaultError as e:
        raise _BadRequest(400, str(e)) from None


class _NonFinite:
    """NaN, Infinity or -Infinity in a body: kept as this marker so the field's check names the field."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in JSON text (a scan, no recursion; strings are skipped)."""
    depth = deepest = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', raw)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def decode_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object ({} when empty); SimFaultError when it is not one.

    Nesting deeper than MAX_JSON_DEPTH is refused before parsing; NaN and Infinity decode to a
    marker that every number check refuses by field name.
    """
    if not raw.strip():
        return {}
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise SimFaultError(f"the body nests arrays or objects more than {MAX_JSON_DEPTH} deep")
    try:
        data = json.loads(raw, parse_constant=_NonFinite)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, an integer of 4300+ digits
        raise SimFaultError(f"the body is not valid JSON: {str(e).split(';')[0]:.200}") from None
    if not isinstance(data, dict):
        raise SimFaultError(f"the body must be a JSON object, got {type(data).__name__}")
    return data


def _answer(status: int, payload: object) -> web.Response:
    return web.Response(status=status, text=json.dumps(payload), content_type="application/json")


# -- actions -----------------------------------------------------------------------------------


# Field checks, one per kind of field; each refusal names the field (SimFaultError, a 400).


def gpu_field(backend: SimBackend, body: SectionReader, key: str = "gpu") -> str:
    """The UUID of the GPU a field names by index (0..MAX_GPU_INDEX, a number or digits) or by UUID."""
    ref = body.raw(key)
    if isinstance(ref, str) and ref.strip().isdigit() and len(ref) <= MAX_NAME_CHARS:
        ref = int(ref)
    if isinstance(ref, int) and not isinstance(ref, bool):
        if not 0 <= ref <= MAX_GPU_INDEX:
            raise body.fail(key, f"a GPU index is 0..{MAX_GPU_INDEX}, got {ref}")
    elif not isinstance(ref, str) or not 0 < len(ref) <= MAX_NAME_CHARS:
        raise body.fail(
            key, f"expected a GPU UUID or index, got {ref!r:.60} (a UUID has 1..{MAX_NAME_CHARS} characters)"
        )
    return backend.resolve_gpu(ref)


def index_field(body: SectionReader, key: str, default: int | None = None) -> int | None:
    """A GPU index, 0..MAX_GPU_INDEX."""
    return body.integer(key, default, minimum=0, maximum=MAX_GPU_INDEX)


def xid_field(body: SectionReader, key: str = "code") -> int:
    """An XID code, 1..MAX_XID."""
    code = body.integer(key)
    if not 1 <= code <= MAX_XID:
        raise body.fail(key, f"an XID is a positive integer (1..{MAX_XID}), got {code}")
    return code


def count_field(body: SectionReader, key: str, default: int, maximum: int) -> int:
    """A count of events, 1..maximum."""
    return body.integer(key, default, minimum=1, maximum=maximum)


def seconds_field(body: SectionReader, key: str, maximum: float) -> float:
    """A finite, non-negative number of seconds, at most maximum."""
    seconds = body.number(key)
    if not 0 <= seconds <= maximum:
        what = "a delay cannot be negative" if seconds < 0 else "a delay is at most one day"
        raise body.fail(key, f"{what} (0..{maximum:g} seconds), got {seconds:g}")
    return seconds


def name_field(body: SectionReader, key: str, *, prefix: str = "") -> str | None:
    """An optional name (a UUID, a model) of 1..MAX_NAME_CHARS characters, starting with prefix."""
    value = body.get(key, str, None)
    if value is not None and (not 0 < len(value) <= MAX_NAME_CHARS or not value.startswith(prefix)):
        what = f"a {prefix}... name" if prefix else "a name"
        raise body.fail(key, f"expected {what} of 1..{MAX_NAME_CHARS} characters, got {value!r:.60}")
    return value


def _gpu(backend: SimBackend, body: SectionReader) -> str:
    return gpu_field(backend, body)


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
    code = xid_field(body)
    mig = name_field(body, "mig", prefix="MIG-")
    body.finish()
    return {"event": _event_json(backend.inject_xid(uuid, code, mig_uuid=mig))}


def _ecc(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    double = body.flag("double", False)
    count = count_field(body, "count", 1, MAX_ECC_COUNT)
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
    seconds = seconds_field(body, "seconds", MAX_PROBE_DELAY_S)
    body.finish()
    backend.set_probe_delay(uuid, seconds)
    return {"gpu": uuid, "seconds": seconds}


def _remove(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    body.finish()
    return {"event": _event_json(backend.remove_gpu(uuid))}


def _activity(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    uuid = _gpu(backend, body)
    ratio = body.number("ratio", None, minimum=0.0, maximum=1.0)
    body.finish()
    backend.set_activity(uuid, ratio)
    return {"gpu": uuid, "ratio": ratio}


def _add(backend: SimBackend, body: SectionReader) -> dict[str, Any]:
    index = index_field(body, "index")
    model = name_field(body, "model")
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
    "/gpus/activity": ("POST", _activity),
}
