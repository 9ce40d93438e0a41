"""The simulated node's control socket against hostile or absurd bodies: 400 with a JSON error naming the
field, never a 500 or a traceback, and the node keeps working.

The reported cases: a 5,000-deep JSON body gave a 500 and a RecursionError traceback; an XID code of
2**70 and a probe delay of 1e308 s were accepted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode.node.devices.base import EventKind
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.devices.simnode.cli import call_control
from gpunode.node.devices.simnode.control import MAX_JSON_DEPTH, ControlServer, json_depth, serve_control
from tests.node.test_simctl import raw_request


@pytest.fixture
def node(sockdir: Path) -> Iterator[tuple[SimBackend, ControlServer]]:
    backend = SimBackend.from_profile("a100-mig")
    server = serve_control(backend, sockdir / "ctl.sock")
    yield backend, server
    server.close()


def post(path: str, body: str | bytes) -> bytes:
    data = body.encode() if isinstance(body, str) else body
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data


DEEP = 5000
HOSTILE = [
    ("deep-array", post("/faults/xid", "[" * DEEP + "]" * DEEP), "nests arrays or objects more than 8 deep"),
    ("deep-in-field", post("/faults/xid", '{"gpu": ' + "[" * DEEP + "]" * DEEP + "}"), "more than 8 deep"),
    ("deep-objects", post("/faults/lost", '{"a":' * DEEP + "1" + "}" * DEEP), "more than 8 deep"),
    (
        "xid-2^70",
        post("/faults/xid", f'{{"gpu": 0, "code": {2**70}}}'),
        "/faults/xid.code: an XID is a positive",
    ),
    ("xid-negative", post("/faults/xid", '{"gpu": 0, "code": -79}'), "code: an XID is a positive integer"),
    ("xid-nan", post("/faults/xid", '{"gpu": 0, "code": NaN}'), "code: expected an integer, got NaN"),
    ("xid-float", post("/faults/xid", '{"gpu": 0, "code": 79.5}'), "code: expected an integer"),
    ("xid-string", post("/faults/xid", '{"gpu": 0, "code": "79"}'), "code: expected an integer"),
    (
        "delay-1e308",
        post("/faults/probe-delay", '{"gpu": 0, "seconds": 1e308}'),
        "seconds: a delay is at most",
    ),
    (
        "delay-1e400",
        post("/faults/probe-delay", '{"gpu": 0, "seconds": 1e400}'),
        "probe-delay.seconds: expected",
    ),
    (
        "delay-nan",
        post("/faults/probe-delay", '{"gpu": 0, "seconds": NaN}'),
        "seconds: expected a number, got NaN",
    ),
    (
        "delay-inf",
        post("/faults/probe-delay", '{"gpu": 0, "seconds": Infinity}'),
        "seconds: expected a number",
    ),
    (
        "delay--inf",
        post("/faults/probe-delay", '{"gpu": 0, "seconds": -Infinity}'),
        "seconds: expected a number",
    ),
    (
        "delay-string",
        post("/faults/probe-delay", '{"gpu": 0, "seconds": "30s"}'),
        "seconds: expected a number",
    ),
    ("delay-bool", post("/faults/probe-delay", '{"gpu": 0, "seconds": true}'), "seconds: expected a number"),
    ("ecc-count", post("/faults/ecc", '{"gpu": 0, "count": 10000000}'), "count: expected 1..1000000"),
    ("ecc-count-zero", post("/faults/ecc", '{"gpu": 0, "count": 0}'), "count: expected 1..1000000"),
    ("ecc-double-word", post("/faults/ecc", '{"gpu": 0, "double": "yes"}'), "double: expected true or false"),
    ("gpu-2^70", post("/faults/lost", f'{{"gpu": {2**70}}}'), "gpu: a GPU index is 0..255"),
    ("gpu-negative", post("/faults/lost", '{"gpu": -1}'), "gpu: a GPU index is 0..255, got -1"),
    ("gpu-digits-2^70", post("/faults/lost", f'{{"gpu": "{2**70}"}}'), "gpu: a GPU index is 0..255"),
    ("gpu-list", post("/faults/lost", '{"gpu": [0]}'), "gpu: expected a GPU UUID or index"),
    ("gpu-nan", post("/faults/lost", '{"gpu": NaN}'), "gpu: expected a GPU UUID or index, got NaN"),
    ("gpu-long-uuid", post("/faults/reset", '{"gpu": "GPU-' + "a" * 5000 + '"}'), "gpu: expected a GPU UUID"),
    ("mig-int", post("/faults/xid", '{"gpu": 0, "code": 79, "mig": 3}'), "mig: expected str"),
    (
        "mig-not-mig",
        post("/faults/xid", '{"gpu": 0, "code": 79, "mig": "GPU-x"}'),
        "mig: expected a MIG-... name",
    ),
    ("add-index", post("/gpus/add", '{"index": 256}'), "/gpus/add.index: expected 0..255, got 256"),
    (
        "add-model-long",
        post("/gpus/add", '{"model": "' + "h" * 500 + '"}'),
        "model: expected a name of 1..128",
    ),
    (
        "remap-number",
        post("/faults/row-remap", '{"gpu": 0, "pending": 1}'),
        "pending: expected true or false",
    ),
    ("huge-int", post("/faults/xid", '{"gpu": 0, "code": ' + "9" * 5000 + "}"), "not valid JSON"),
]


@pytest.mark.parametrize(("request_bytes", "message"), [pytest.param(r, m, id=i) for i, r, m in HOSTILE])
def test_hostile_bodies_get_400_naming_the_field(
    node: tuple[SimBackend, ControlServer],
    caplog: pytest.LogCaptureFixture,
    request_bytes: bytes,
    message: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    backend, server = node
    before = backend.gpu_states()
    status, answer = raw_request(server.socket_path, request_bytes)
    assert status == 400, answer
    assert message in str(answer["error"]), answer
    assert "\n" not in str(answer["error"]) and len(str(answer["error"])) < 300
    assert backend.gpu_states() == before and backend.wait_event(0) is None
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.exc_info]
    # The node keeps working: a well-formed fault still reaches it.
    call_control(server.socket_path, "POST", "/faults/xid", {"gpu": 0, "code": 79})
    event = backend.wait_event(5)
    assert event is not None and (event.kind, event.xid) == (EventKind.XID, 79)


def test_the_edges_of_each_range_are_accepted(node: tuple[SimBackend, ControlServer]) -> None:
    backend, server = node
    sock = server.socket_path
    call_control(sock, "POST", "/faults/xid", {"gpu": 0, "code": 2**32 - 1})
    assert backend.wait_event(5).xid == 2**32 - 1  # type: ignore[union-attr]
    call_control(sock, "POST", "/faults/probe-delay", {"gpu": 1, "seconds": 86400})
    assert backend.gpu_states()[1].probe_delay_s == 86400
    call_control(sock, "POST", "/faults/probe-delay", {"gpu": 1, "seconds": 0})
    call_control(sock, "POST", "/faults/ecc", {"gpu": 1, "count": 1_000_000})
    assert backend.probe(backend.gpus()[1].uuid).ecc_sbe_volatile == 1_000_000
    nested = '{"gpu": 0, "x": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}"
    status, answer = raw_request(sock, post("/faults/lost", nested))
    assert (status, "unknown key x" in str(answer["error"])) == (400, True), (
        "depth 8 is parsed, then refused by key"
    )


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        pytest.param(b"{}", 1, id="flat"),
        pytest.param(b'{"a": [1, {"b": []}]}', 4, id="nested"),
        pytest.param(b'{"a": "[[[[{{{{", "b": "\\"[["}', 1, id="brackets-in-strings"),
        pytest.param(b"[" * 100_000, 100_000, id="unclosed"),
    ],
)
def test_json_depth_scans_without_recursion(text: bytes, depth: int) -> None:
    assert json_depth(text) == depth
