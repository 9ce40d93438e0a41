"""Hostile requests against a running extender: poisonous quantities, huge bodies, half-sent connections,
and more work than its queue takes. Each test sends the bytes and asserts the extender's outcome."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.cluster.extender.core import Extender
from gpunode.cluster.extender.server import DEFAULT_MAX_BODY_BYTES, ExtenderServer
from tests.cluster.test_extender import Client, gpu_state, node_list, start, v1_node, v1_pod

NODES = node_list(v1_node("n1", gpu_state("n1", [1000, 1000])), v1_node("n2", gpu_state("n2", [500, 1000])))
MB = 10**6

# ----- quantities -----------------------------------------------------------------------------------------

POISON = [
    pytest.param({"cpu": "1e5000"}, "exponent beyond", id="cpu-1e5000"),
    pytest.param({"nvidia.com/gpu": "1e999999"}, "exponent beyond", id="gpu-1e999999"),
    pytest.param({"nvidia.com/gpu": "1e9999999"}, "exponent beyond", id="gpu-1e9999999"),
    pytest.param({"memory": "9Ei"}, "larger than Kubernetes allows", id="memory-9Ei"),
    pytest.param({"cpu": "1" * 40}, "larger than Kubernetes allows", id="cpu-40-digits"),
    pytest.param({"cpu": "5" * 100}, "not plausible", id="cpu-100-characters"),
    pytest.param({"nvidia.com/gpu": "2000"}, "more than any node has", id="gpu-2000"),
    pytest.param({"memory": "7Ei"}, "more than any node has", id="memory-7Ei"),
    pytest.param({"cpu": "NaN"}, "not a resource quantity", id="cpu-nan"),
    pytest.param({"cpu": "1e3Gi"}, "not a resource quantity", id="exponent-and-suffix"),
]


def gpu_pod(name: str, uid: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    pod = v1_pod(name, uid=uid, limits={"nvidia.com/gpu": "1"})
    pod["spec"]["containers"][0]["resources"]["limits"].update(extra or {})  # limits win over requests
    return pod


@pytest.fixture
def served() -> Iterator[tuple[Extender, Client]]:
    extender = Extender()
    server, client = start(extender)
    try:
        yield extender, client
    finally:
        server.stop()


@pytest.mark.parametrize(("requests", "message"), POISON)
def test_a_poisonous_quantity_fails_its_own_pod_and_nobody_elses(
    served: tuple[Extender, Client], requests: dict[str, str], message: str
) -> None:
    extender, client = served
    for i in range(3):
        status, result = client.post(
            "filter", {"Pod": gpu_pod(f"bad-{i}", f"bad-{i}", requests), "Nodes": NODES}
        )
        assert status == 200 and result["Nodes"]["items"] == []
        (field,) = requests
        for node in ("n1", "n2"):
            reason = result["FailedAndUnresolvableNodes"][node]
            assert field in reason and message in reason, reason
    assert extender.workload.workload() is None  # nothing was learned from the bad pods
    status, result = client.post("filter", {"Pod": gpu_pod("good", "good"), "Nodes": NODES})
    assert status == 200 and [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["n1", "n2"]
    status, scores = client.post("prioritize", {"Pod": gpu_pod("good", "good"), "Nodes": NODES})
    assert status == 200 and {s["Host"] for s in scores} == {"n1", "n2"}
    learned = extender.workload.workload()
    assert learned is not None and [(p.cpu_milli, p.gpus) for p in learned.pods] == [(8000, 1)]


def test_the_largest_plausible_request_is_learned_without_breaking_later_filters(
    served: tuple[Extender, Client],
) -> None:
    extender, client = served
    big = gpu_pod("big", "big", {"cpu": "1000000000", "memory": "1Pi"})  # at the ceilings, not beyond
    status, result = client.post("filter", {"Pod": big, "Nodes": NODES})
    assert status == 200 and result["Nodes"]["items"] == [] and set(result["FailedNodes"]) == {"n1", "n2"}
    for name in ("a", "b"):
        status, result = client.post("filter", {"Pod": gpu_pod(name, name), "Nodes": NODES})
        assert status == 200 and len(result["Nodes"]["items"]) == 2
        assert client.post("prioritize", {"Pod": gpu_pod(name, name), "Nodes": NODES})[0] == 200
    assert extender.workload.workload() is not None


def test_a_huge_exponent_does_not_hold_up_a_concurrent_request(served: tuple[Extender, Client]) -> None:
    _, client = served
    bodies = {
        "poison": {"Pod": gpu_pod("bad", "bad", {"nvidia.com/gpu": "1e999999"}), "Nodes": NODES},
        "normal": {"Pod": gpu_pod("good", "good"), "Nodes": NODES},
    }
    answers: dict[str, tuple[int, Any]] = {}
    barrier = threading.Barrier(2)

    def send(kind: str) -> None:
        barrier.wait(30)
        answers[kind] = client.post("filter", bodies[kind])

    threads = [threading.Thread(target=send, args=(k,)) for k in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers["poison"][0] == 200 and answers["poison"][1]["Nodes"]["items"] == []
    assert answers["normal"][0] == 200 and len(answers["normal"][1]["Nodes"]["items"]) == 2


# ----- the work queue -------------------------------------------------------------------------------------


def test_work_beyond_the_queue_is_answered_503_and_the_rest_completes() -> None:
    extender = Extender()
    entered, release = threading.Semaphore(0), threading.Event()
    real_filter = extender.filter

    def slow_filter(body: object) -> dict[str, Any]:
        entered.release()
        release.wait(30)
        return real_filter(body)

    extender.filter = slow_filter  # type: ignore[method-assign]
    server = ExtenderServer(extender, port=0, max_pending=2)
    server.start()
    client = Client(server.port)
    body = {"Pod": gpu_pod("p", "p"), "Nodes": NODES}
    answers: list[int] = []
    held = [threading.Thread(target=lambda: answers.append(client.post("filter", body)[0])) for _ in range(2)]
    try:
        for t in held:
            t.start()
        for _ in held:
            assert entered.acquire(timeout=30)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        conn.request("POST", "/filter", body=json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 503 and resp.getheader("Retry-After") == "1"
        assert "busy" in json.loads(resp.read())["Error"]
        conn.close()
        assert client.call("GET", "/healthz")[0] == 200
        release.set()
        for t in held:
            t.join(30)
        assert answers == [200, 200]
        assert client.post("filter", body)[0] == 200  # the queue is free again
    finally:
        release.set()
        server.stop()


def test_the_http_layers_refusals_reach_kube_scheduler_as_json() -> None:
    server = ExtenderServer(Extender(), port=0, max_body_bytes=1024)
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        conn.request("POST", "/filter", body=b"{" + b" " * 2047, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 413 and resp.getheader("Content-Type") == "application/json"
        assert json.loads(resp.read()) == {"Error": "the body must be at most 1024 bytes, got 2048"}
        conn.close()
        assert Client(server.port).call("GET", "/healthz")[0] == 200  # still serving
    finally:
        server.stop()


# ----- a real extender process: bodies and connections ----------------------------------------------------


class Process:
    """`gpunode extender` in a process of its own, with a health port; its RSS and thread count from /proc."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpunode.cli", "extender", "--listen", "127.0.0.1:0",
             "--health-listen", "127.0.0.1:0",
             "--node-state-max-age", "0s",  # NODES' annotations are fixed, published long ago
             *args],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stderr is not None
        ports: dict[str, int] = {}
        while len(ports) < 2:
            line = self.proc.stderr.readline()
            assert line, "the extender exited before serving"
            if m := re.search(r"(extender(?: health)?): serving HTTP on 127\.0\.0\.1:(\d+)", line):
                ports[m.group(1)] = int(m.group(2))
        self.port, self.health_port = ports["extender"], ports["extender health"]
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # keep the pipe drained

    def status(self, field: str) -> int:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        m = re.search(rf"^{field}:\s+(\d+)", text, re.M)
        assert m is not None
        return int(m.group(1))

    def peak_rss_mb(self) -> float:
        return self.status("VmHWM") / 1024  # the high-water mark: what it took at its worst

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def process() -> Iterator[Process]:
    p = Process()
    try:
        yield p
    finally:
        p.stop()


def filter_works(port: int) -> bool:
    status, result = Client(port).post("filter", {"Pod": gpu_pod("p", "p"), "Nodes": NODES})
    return status == 200 and len(result["Nodes"]["items"]) == 2


def test_a_50_mb_body_is_refused_without_being_held(process: Process) -> None:
    assert filter_works(process.port)
    before = process.peak_rss_mb()
    # Announced with Content-Length: answered 413 before the body is read.
    with socket.create_connection(("127.0.0.1", process.port), timeout=30) as sock:
        sock.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (50 * MB))
        sock.sendall(b"{" + b" " * MB)
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:100]
    assert process.peak_rss_mb() - before < 8  # nothing of the body was kept
    # Chunked, so the size shows only as it arrives: refused once over the limit, whatever was sent.
    sent = 0
    with socket.create_connection(("127.0.0.1", process.port), timeout=30) as sock:
        sock.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (MB, b" " * MB)
        try:
            while sent < 50 * MB:
                sock.sendall(chunk)
                sent += MB
            sock.sendall(b"0\r\n\r\n")
            head = sock.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            head = b""
    assert head.startswith(b"HTTP/1.1 413") or sent < 50 * MB, head[:100]
    grown = process.peak_rss_mb() - before  # at most the accepted size was ever held
    assert grown < DEFAULT_MAX_BODY_BYTES / 2**20 + 16, f"peak RSS grew by {grown:.0f} MiB"
    assert filter_works(process.port)


def test_3000_half_sent_connections_add_no_threads_and_are_closed(process: Process) -> None:
    assert filter_works(process.port)
    threads = process.threads()
    socks: list[socket.socket] = []
    try:
        for i in range(3000):
            s = socket.create_connection(("127.0.0.1", process.port), timeout=60)
            s.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Le" if i % 2 else b"POST /filt")
            socks.append(s)
        assert process.threads() <= threads + 1  # one event loop serves every connection
        assert Client(process.health_port).call("GET", "/healthz")[0] == 200
        assert filter_works(process.port)  # a fresh client is still served
        assert process.threads() <= threads + 2
        # Every half-sent connection is closed by the server (connection limit or head timeout).
        for s in socks:
            s.settimeout(60)  # a connection left open would time out here and fail the test
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
    finally:
        for s in socks:
            s.close()
    assert filter_works(process.port)
