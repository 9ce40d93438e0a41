"""Names-only mode (nodeCacheCapable): a node the extender's cache has not seen yet, or first saw before
its agent published, is listed at once.

kube-scheduler 1.20 parks a pod that every node failed for a minute or more, so a node created since
the last periodic refresh must not fail as unknown: the extender lists the nodes when a filter names an
unknown one (at most once a second), and `gpunode extender` lists them once before it serves at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

from gpunode.cluster.extender.core import Extender
from gpunode.contract.names import GPU_RESOURCE, NODE_STATE_ANNOTATION
from gpunode.contract.nodestate import GpuRecord, NodeGpuState, encode
from gpunode.errors import KubeUnreachable
from tests.fakes.apiserver import ApiServerStandIn

GIB = 2**30
WAIT_S = 60.0  # generous: a loaded 2-core machine


def state(node: str) -> str:
    gpu = GpuRecord(uuid=f"GPU-{node}-0", index=0, model="Tesla T4", memory_total_bytes=16 * GIB)
    return encode(NodeGpuState(node=node, updated=time.time(), generation=1, gpus=(gpu,)))


def node(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": {NODE_STATE_ANNOTATION: state(name)}}}


def args(*names: str) -> dict[str, Any]:
    pod = {
        "metadata": {"name": "p", "namespace": "t", "uid": "u-1"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {GPU_RESOURCE: "1"}}}]},
    }
    return {"Pod": pod, "NodeNames": list(names)}


class Lister:
    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self.calls = 0
        self.fail = False

    def __call__(self) -> list[dict[str, Any]]:
        self.calls += 1
        if self.fail:
            raise KubeUnreachable("list nodes: connection refused")
        return list(self.nodes)


def test_a_filter_naming_an_unknown_node_lists_the_nodes_once_a_second_at_most() -> None:
    lister, now = Lister(), [100.0]
    extender = Extender(node_lister=lister)
    assert extender.on_demand is not None
    extender.on_demand._clock = lambda: now[0]
    extender.refresh_nodes([node("old")])

    assert extender.filter(args("old"))["NodeNames"] == ["old"]
    assert lister.calls == 0  # every node known: no list

    lister.nodes = [node("old"), node("new")]  # created after the last periodic refresh
    assert extender.filter(args("old", "new"))["NodeNames"] == ["old", "new"]
    assert lister.calls == 1

    lister.nodes.append(node("newer"))
    now[0] += 0.5  # within the second: no second list, the node fails as unknown for now
    answer = extender.filter(args("newer"))
    assert answer["NodeNames"] == [] and "unknown" in answer["FailedNodes"]["newer"]
    assert lister.calls == 1
    now[0] += 1.0
    assert extender.filter(args("newer"))["NodeNames"] == ["newer"]
    assert lister.calls == 2


def test_a_new_node_whose_agent_publishes_late_is_listed_again_but_a_cpu_node_only_while_young() -> None:
    lister, now = Lister(), [time.time()]  # the cache's clock is wall time (annotations carry `updated`)
    extender = Extender(node_lister=lister)
    assert extender.on_demand is not None
    extender.on_demand._clock = lambda: now[0]
    extender.nodes._clock = lambda: now[0]
    # The node joined before its agent published: the periodic refresh saw it without an annotation.
    extender.refresh_nodes([{"metadata": {"name": "gpu"}}, {"metadata": {"name": "cpu"}}])
    lister.nodes = [node("gpu"), {"metadata": {"name": "cpu"}}]  # the agent has published since
    assert extender.filter(args("gpu"))["NodeNames"] == ["gpu"]  # listed again, not failed for 10 s
    assert lister.calls == 1

    now[0] += 0.5  # the CPU node: at most one list a second while it is young ...
    assert "no " in extender.filter(args("cpu"))["FailedNodes"]["cpu"]
    assert lister.calls == 1
    now[0] += 1.0
    extender.filter(args("cpu"))
    assert lister.calls == 2
    now[0] += 200.0  # ... and none once it has been without an agent for longer than young_s
    answer = extender.filter(args("cpu"))
    assert answer["NodeNames"] == [] and "annotation" in answer["FailedNodes"]["cpu"]
    assert lister.calls == 2


def test_a_failing_list_leaves_the_node_unknown_and_the_filter_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lister = Lister()
    lister.fail = True
    extender = Extender(node_lister=lister)
    answer = extender.filter(args("ghost"))
    assert answer["NodeNames"] == [] and "unknown" in answer["FailedNodes"]["ghost"]
    assert any("connection refused" in r.getMessage() for r in caplog.records)


def _post(port: int, path: str, body: object) -> Any:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_the_extender_knows_the_nodes_before_it_serves(tmp_path: Any) -> None:
    from tests.ports import free_port

    with ApiServerStandIn() as api:
        api.add_node("n1", annotations={NODE_STATE_ANNOTATION: state("n1")})
        port = free_port()
        argv = [
            sys.executable, "-m", "gpunode.cli", "extender", "--listen", f"127.0.0.1:{port}",
            "--kube-api", api.url, "--kube-token-file", str(tmp_path / "none"),
            "--node-refresh", "1h",  # the periodic refresh would come far too late
        ]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                        ready = json.loads(resp.read())
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the extender never answered /readyz"
                    time.sleep(0.2)
            assert ready["nodes"] == 1  # listed before it answered anything
            assert _post(port, "/filter", args("n1"))["NodeNames"] == ["n1"]
            api.add_node("n2", annotations={NODE_STATE_ANNOTATION: state("n2")})
            assert _post(port, "/filter", args("n1", "n2"))["NodeNames"] == ["n1", "n2"]
        finally:
            proc.terminate()
            proc.wait(15)
