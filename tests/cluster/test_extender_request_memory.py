"""The extender's memory for request bodies is bounded: decoded size counted before decoding.

The attack: four request bodies just under the 32 MiB limit at once took the extender to 666 MiB
(the chart's limit is 512Mi), as decoded JSON takes 10-40 times its text. Now a body takes its
decoded size from --request-memory before it is decoded: never fitting is 413, not fitting now waits
then 503. Peak memory figures come from bench/extender_memory.py.
"""

from __future__ import annotations

import http.client
import threading
import time
import tracemalloc
from typing import Any

import orjson
import pytest

from gpunode.cluster.extender.core import Extender
from gpunode.cluster.extender.server import ExtenderServer, decoded_size
from tests.cluster.test_extender import gpu_state, v1_node, v1_pod

MIB = 2**20
POD = v1_pod("p", limits={"nvidia.com/gpu": "1"}, uid="uid-p")


def post(port: int, verb: str, body: bytes) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", f"/{verb}", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, orjson.loads(response.read())
    finally:
        conn.close()


def node_list(count: int) -> bytes:
    nodes = [v1_node(f"n{i}", gpu_state(f"n{i}", [1000] * 8)) for i in range(count)]
    return orjson.dumps({"Pod": POD, "Nodes": {"items": nodes}})


@pytest.mark.parametrize(
    "unit",
    [b"{},", b"[],", b"0,", b"1.5,", b'"a",', b"123456,", b"[[]],", b'{"a":1.5},', b'{"a":{}},', b"null,"],
)
def test_decoded_size_bounds_what_decoding_takes(unit: bytes) -> None:
    """The estimate is an upper bound for the densest shapes and for real NodeLists."""
    for raw in (b'{"Nodes":{"items":[' + unit * (MIB // len(unit)) + b"0]}}", node_list(50)):
        tracemalloc.start()
        decoded = orjson.loads(raw)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del decoded
        assert peak <= decoded_size(raw) <= 2 * peak + MIB


def test_a_body_too_large_to_decode_within_the_budget_is_413_with_the_flag() -> None:
    """A 2 MiB body of empty objects (~110 MiB decoded) against 16Mi of request memory: 413 with what
    to do, the extender keeps serving, and a body that fits is answered."""
    server = ExtenderServer(Extender(), port=0, max_body_bytes=4 * MIB, request_memory_bytes=16 * MIB)
    server.start()
    try:
        dense = b'{"Pod":{},"Nodes":{"items":[' + b"{}," * (2 * MIB // 3) + b"{}]}}"
        status, answer = post(server.port, "filter", dense)
        assert status == 413
        assert "MiB decoded" in answer["Error"] and "--request-memory" in answer["Error"]
        assert "nodeCacheCapable" in answer["Error"]
        status, answer = post(server.port, "filter", node_list(3))
        assert status == 200 and len(answer["Nodes"]["items"]) == 3
        assert server.decode_budget.used == 0
    finally:
        server.stop()


def test_bodies_beyond_the_budget_wait_for_room_then_get_503(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four bodies at once that fit the budget only one at a time: they are decoded one after the other
    (never two at once), and one that waits longer than the bound gets 503 with Retry-After."""
    extender = Extender()
    inside, most = [0], [0]
    lock = threading.Lock()
    original = extender.filter

    def slow_filter(body: object) -> dict[str, Any]:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.3)
        with lock:
            inside[0] -= 1
        return original(body)

    extender.filter = slow_filter  # type: ignore[method-assign]
    body = node_list(100)  # ~420 KiB, ~8 MiB decoded: one at a time in 12 MiB of decode budget
    server = ExtenderServer(Extender(), port=0, max_body_bytes=4 * MIB, request_memory_bytes=16 * MIB)
    server.extender = extender
    server.start()
    try:
        assert decoded_size(body) > server.decode_budget.limit // 2

        def four_at_once() -> list[int]:
            results: list[int] = []
            threads = [
                threading.Thread(target=lambda: results.append(post(server.port, "filter", body)[0]))
                for _ in range(4)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return results

        assert sorted(four_at_once()) == [200, 200, 200, 200] and most[0] == 1
        monkeypatch.setattr("gpunode.cluster.extender.server.BUDGET_WAIT_S", 0.05)
        results = four_at_once()
        assert 200 in results and 503 in results and most[0] == 1
        assert server.decode_budget.used == 0
    finally:
        server.stop()
