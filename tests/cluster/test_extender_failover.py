"""Failover of the extender's HA mode: two real `gpunode extender --leader-elect` processes, one API server.

The leader answers and labels its pod; the standby answers 503 and closes the connection. The leader
is killed with SIGKILL (no release, no goodbye); the standby takes the Lease over once it has seen no
renewal for the lease duration, rebuilds the reservations the dead leader made from the API server,
and then answers: a GPU the dead leader handed out is not handed out again, and a bind for a pod only
the dead leader filtered is refused (kube-scheduler retries such a pod).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpunode.contract.names import ASSIGNMENT_ANNOTATION, EXTENDER_ROLE_LABEL, NODE_STATE_ANNOTATION
from tests.cluster.test_extender import gpu_state
from tests.cluster.test_extender_bind import bind_args, pending
from tests.fakes.apiserver import ApiServerStandIn

NS = "gpu-system"
LEASE = "gpunode-extender"
_SERVING = re.compile(r"(extender(?: health)?): serving HTTP on 127\.0\.0\.1:(\d+)")


class Replica:
    """One `gpunode extender --leader-elect` process and the ports it printed."""

    def __init__(self, api: ApiServerStandIn, name: str) -> None:
        self.name = name
        gpunode_bin = os.path.join(os.path.dirname(sys.executable), "gpunode")
        self.proc = subprocess.Popen(
            [
                gpunode_bin, "extender", "--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0",
                "--kube-api", api.url, "--bind", "--insecure-bind-without-tls", "--node-refresh", "1s",
                "--leader-elect", "--leader-elect-namespace", NS, "--leader-elect-identity", name,
                "--leader-elect-pod", name, "--leader-elect-lease-duration", "3s",
                "--leader-elect-renew-deadline", "2s", "--leader-elect-retry-period", "0.5s",
                "--node-state-max-age", "0s",  # its nodes' annotations are fixed, published long ago
            ],
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.ports: dict[str, int] = {}
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        with self._seen:
            if not self._seen.wait_for(lambda: len(self.ports) == 2 or self.proc.poll() is not None, 60):
                raise AssertionError(f"{name} did not start: {self.lines}")
        assert len(self.ports) == 2, self.lines

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._seen:
                self.lines.append(line)
                if m := _SERVING.search(line):
                    self.ports[m.group(1)] = int(m.group(2))
                self._seen.notify_all()

    def call(
        self, method: str, path: str, body: object = None, *, health: bool = False
    ) -> tuple[int, Any, str]:
        port = self.ports["extender health" if health else "extender"]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read()), resp.getheader("Connection") or ""
        finally:
            conn.close()

    def post(self, verb: str, body: object) -> tuple[int, Any]:
        status, answer, _ = self.call("POST", f"/{verb}", body)
        return status, answer

    def role(self) -> str:
        status, answer, _ = self.call("GET", "/readyz", health=True)
        assert status == 200  # a standby is ready too: the Service picks the leader by label
        return str(answer["role"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.1)


def gpu_pod(name: str, uid: str) -> dict[str, Any]:
    """A pending pod asking for one whole GPU and nothing else (the stand-in's nodes list no CPU)."""
    pod = pending(name, uid=uid)
    pod["spec"]["containers"][0]["resources"]["requests"] = {"nvidia.com/gpu": "1"}
    return pod


def filter_args(pod: dict[str, Any], *nodes: str) -> dict[str, Any]:
    return {"Pod": pod, "NodeNames": list(nodes)}


def role_label(api: ApiServerStandIn, pod: str) -> str | None:
    return (api.pod(NS, pod)["metadata"].get("labels") or {}).get(EXTENDER_ROLE_LABEL)


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        for node in ("n1", "n2"):  # one free GPU each, as their agents published it
            server.add_node(node, annotations={NODE_STATE_ANNOTATION: gpu_state(node, [1000])})
        for replica in ("ext-a", "ext-b"):  # the replicas' own pods, which the leader labels
            server.add_pod(NS, replica, node_name="cp-1")
        yield server


def test_the_standby_takes_over_after_a_kill_and_does_not_grant_a_reserved_gpu_again(
    api: ApiServerStandIn,
) -> None:
    a = Replica(api, "ext-a")
    b: Replica | None = None
    try:
        wait_until("ext-a leads", lambda: a.role() == "leader")
        b = Replica(api, "ext-b")
        standby = b
        wait_until(
            "ext-b has seen the leader",
            lambda: standby.call("GET", "/readyz", health=True)[1]["leader"] == "ext-a",
        )
        assert (
            b.role() == "standby"
            and role_label(api, "ext-a") == "leader"
            and role_label(api, "ext-b") is None
        )

        p1, p2 = gpu_pod("train-1", "u-1"), gpu_pod("train-2", "u-2")
        api.put_pod(p1)
        api.put_pod(p2)
        # The standby answers no verb: 503, Retry-After, and the connection closed.
        status, answer, connection = b.call("POST", "/filter", filter_args(p1, "n1", "n2"))
        assert status == 503 and "is a standby; the leader is ext-a" in answer["Error"]
        assert connection.lower() == "close"

        # The leader places train-1 on n1's only GPU and binds it; n1's annotation does not list it yet.
        wait_until(
            "ext-a knows both nodes",
            lambda: a.post("filter", filter_args(p1, "n1", "n2"))[1]["NodeNames"] == ["n1", "n2"],
        )
        assert a.post("bind", bind_args(p1, "n1")) == (200, {"Error": ""})
        assert api.pod("team-a", "train-1")["spec"]["nodeName"] == "n1"
        assert api.pod("team-a", "train-1")["metadata"]["annotations"][ASSIGNMENT_ANNOTATION] == "GPU-n1-0"
        _, before = a.post("filter", filter_args(p2, "n1", "n2"))
        assert before["NodeNames"] == ["n2"] and "n1" in before["FailedNodes"]  # the reservation holds

        lease = api.lease(NS, LEASE)
        assert lease is not None and lease["spec"]["holderIdentity"] == "ext-a"
        transitions = lease["spec"]["leaseTransitions"]
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(30)

        wait_until("ext-b leads", lambda: standby.role() == "leader")
        lease = api.lease(NS, LEASE)
        assert lease is not None
        assert (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"]) == (
            "ext-b",
            transitions + 1,
        )
        assert role_label(api, "ext-b") == "leader" and role_label(api, "ext-a") is None

        # train-2 was filtered by the dead leader only: its bind is refused, kube-scheduler retries it.
        _, refused = b.post("bind", bind_args(p2, "n2"))
        assert (
            "bind refused: pod team-a/train-2 was not filtered by this extender recently" in refused["Error"]
        )
        # Filtered again, by the new leader: n1's GPU went to train-1 before the failover and stays taken.
        _, after = b.post("filter", filter_args(p2, "n1", "n2"))
        assert after["NodeNames"] == ["n2"] and "n1" in after["FailedNodes"]
        assert b.post("bind", bind_args(p2, "n2")) == (200, {"Error": ""})
        assert api.pod("team-a", "train-2")["spec"]["nodeName"] == "n2"
        assert api.pod("team-a", "train-2")["metadata"]["annotations"][ASSIGNMENT_ANNOTATION] == "GPU-n2-0"
    finally:
        a.stop()
        if b is not None:
            b.stop()
    assert b.proc.returncode == 0, b.lines
    lease = api.lease(NS, LEASE)
    assert lease is not None and lease["spec"]["holderIdentity"] == ""  # SIGTERM: released
    assert role_label(api, "ext-b") is None
