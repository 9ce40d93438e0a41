"""The multi-node scenario: the real kube-scheduler places whole-GPU, MIG and fractional pods through
`gpunode extender`; four simulated-agent nodes (tests.e2e.simnodes) and one real kubelet with the agent
as its device plugin (tests.e2e.scenario_realnode, where root and containerd allow) carry them out.

Cluster (build_cluster): the chart's extender and agent RBAC; the extender as the chart runs it (HTTPS
with client certificates, --bind, node refresh; --log-level debug for its per-request access log),
started before any Node exists; four SimNodes and the real node; kube-scheduler configured from
gpunode/examples/kube-scheduler-config.yaml (apiVersion adapted to 1.20's v1beta1, files and address
replaced). Scenario (run_scenario), while a Sampler reads every node's gpu-state annotation and every
pod's assignment every 0.1 s (tests.e2e.overcommit):

1. 16 concurrent binds: 16 fractional pods of 4 GiB for a 4 x 15 GiB node, scheduled by the test
   itself (schedulerName e2e-direct: filter naming two nodes, then all binds at once to that node over
   16 connections with the scheduler's certificate). 12 fit; the other 4 binds must be refused.
2. Through kube-scheduler, all at once: whole GPUs, MIG instances, a burst of 20 fractional pods
   created together, one pod that fits no GPU and one with an invalid request (two MIG profiles), and
   whole-GPU and fractional pods for the real node, which run in its containerd. Two nodes (the H100
   node and the real one) have both whole GPUs and GPUs shared in memory units; a whole-GPU pod pinned
   to each is placed while its shared GPUs are all fully free (before the fractions exist), and must
   get a GPU the node offers whole (whole_offered).
3. 32 simultaneous TLS connections to the extender, each sending a filter: all answered 200.

Figures (Figures): agreement rate (pods whose allocated GPUs equal the assigned ones), over-commit
samples, wall time, max concurrent binds, and filter/prioritize/bind p99 from the extender's access log
of the requests kube-scheduler made (the test's own requests come from 127.0.0.2 and are left out).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import ssl
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from gpunode.contract.names import (
    ALLOCATED_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    GPU_MEMORY_RESOURCE,
    GPU_RESOURCE,
    NODE_STATE_ANNOTATION,
)
from tests.e2e import chart
from tests.e2e.api import Api, eventually
from tests.e2e.controlplane import ROOT, ControlPlane
from tests.e2e.objects import create_pod, ensure_namespace, pod_body
from tests.e2e.overcommit import Sampler
from tests.e2e.pki import CertFiles
from tests.e2e.procs import Proc
from tests.e2e.scenario_realnode import (
    REAL_FRACTIONS,
    REAL_PODS,
    REAL_WHOLE,
    RealAgentNode,
    real_pod,
    start_real_node,
    visible_devices,
)
from tests.e2e.simnodes import SimNode
from tests.ports import free_port

NAMESPACE = "e2e-scenario"
DIRECT = "e2e-direct"  # the schedulerName of the pods the test binds itself
WAIT_S = 180.0  # generous: two shared cores
CARRIED_OUT_WAIT_S = 60.0  # the agent patches gpu-allocated in the background: a slow API server delays it
TEST_SOURCE = "127.0.0.2"  # the test's own connections to the extender come from here
CHART_VALUES = {
    "extender": {
        "enabled": True,
        "bind": True,
        "nodeCacheCapable": True,
        "tls": {"enabled": True, "existingSecret": "gpunode-extender-tls"},
    }
}
FRACTIONAL = {"fractional": {"devices": "all", "unit": "1Gi"}}
# Whole GPUs: 4 T4s, the A100 without MIG, and GPUs 6 and 7 of the H100 node, whose GPUs 0-5 are shared
# in memory units (advertised only as gpunode.io/gpu-memory, published with servesWhole false).
NODES: dict[str, dict[str, Any]] = {
    "e2e-t4-whole": {"profile": "t4"},
    "e2e-a100-mig": {"profile": "a100-mig", "flags": {"migStrategy": "mixed"}},
    "e2e-t4-frac": {"profile": "t4", "agent": FRACTIONAL},
    "e2e-h100-mixed": {
        "profile": "dgx-h100",
        "agent": {"fractional": {"devices": [0, 1, 2, 3, 4, 5], "unit": "1Gi"}},
    },
}
RACE_NODE, RACE_OTHER, RACE_PODS, RACE_GIB = "e2e-t4-frac", "e2e-h100-mixed", 16, 4
MIXED_NODE, MIXED_WHOLE = "e2e-h100-mixed", "whole-h100"  # a whole-GPU pod pinned there, placed first
WHOLE_TWO = "whole-two"  # a 2-GPU pod, placed next (only the T4 node has two whole GPUs free then)
MIG_1G, MIG_2G, MIG_3G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb", "nvidia.com/mig-3g.40gb"


@dataclass
class Cluster:
    """What build_cluster started."""

    cp: ControlPlane
    nodes: dict[str, SimNode]
    extender: Proc
    scheduler: Proc
    port: int
    client: CertFiles
    real: RealAgentNode | None = None

    @property
    def node_names(self) -> list[str]:
        """Every node of the cluster, the real one included."""
        return [*self.nodes, *([self.real.name] if self.real else [])]


def _chart_rbac(cp: ControlPlane, tmp: Path) -> None:
    docs = chart.render(CHART_VALUES, tmp)
    admin = cp.api()
    ensure_namespace(admin, chart.NAMESPACE)
    ensure_namespace(admin, NAMESPACE)
    chart.apply_rbac(admin, docs, "extender")
    chart.apply_rbac(admin, docs, "agent")


def build_cluster(cp: ControlPlane, tmp: Path) -> Cluster:
    """Start the extender, the nodes and kube-scheduler (see the module docstring); stop_cluster ends them."""
    _chart_rbac(cp, tmp)
    serving = cp.issue("scenario-extender", common_name="gpunode-extender", server=True, hosts=("127.0.0.1",))
    client = cp.issue("scenario-scheduler", common_name="kube-scheduler", client=True)
    port, health = free_port(), free_port()
    extender = Proc(
        "gpunode-extender-scenario",
        [
            sys.executable, "-m", "gpunode.cli", "extender",
            "--listen", f"127.0.0.1:{port}", "--health-listen", f"127.0.0.1:{health}",
            "--kube-api", cp.server, "--kube-token-file", str(cp.token_file("extender")),
            "--kube-ca-file", str(cp.ca_file), "--node-refresh", "10s", "--bind",
            "--scheduler-name", "default-scheduler", "--scheduler-name", DIRECT,
            "--tls-cert-file", str(serving.cert), "--tls-key-file", str(serving.key),
            "--client-ca-file", str(cp.ca_file), "--allowed-client-names", "kube-scheduler",
            "--log-level", "debug",
        ],
        cp.logs,
    ).start()  # fmt: skip
    cp.procs.append(extender)
    extender.wait_until(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=5).status == 200,
        timeout_s=WAIT_S,
        what="ready extender",
    )
    # The nodes come after the extender: it must learn of them without waiting for its 10 s refresh.
    nodes = {name: SimNode(cp, name, tmp / name, **spec) for name, spec in NODES.items()}
    with concurrent.futures.ThreadPoolExecutor(len(nodes) + 1) as pool:
        real_started = pool.submit(start_real_node, cp, tmp)
        for started in [pool.submit(n.start) for n in nodes.values()]:
            started.result()
        real = real_started.result()
    admin = cp.api()
    for name in nodes:
        eventually(
            lambda name=name: (
                NODE_STATE_ANNOTATION in admin.get(f"/api/v1/nodes/{name}")["metadata"].get("annotations", {})
            ),
            timeout_s=WAIT_S,
            what=f"{name}'s published GPU state",
        )
    example = yaml.safe_load((ROOT / "gpunode/examples/kube-scheduler-config.yaml").read_text())
    entries = example["extenders"]
    for entry in entries:  # the device-plugin entry and the one for pods with DRA claims
        entry["urlPrefix"] = f"https://127.0.0.1:{port}"
        entry["tlsConfig"] = {
            "certFile": str(client.cert),
            "keyFile": str(client.key),
            "caFile": str(cp.ca_file),
        }
    scheduler = cp.start_scheduler(entries, name="kube-scheduler-scenario")
    return Cluster(cp, nodes, extender, scheduler, port, client, real)


def stop_cluster(cluster: Cluster) -> None:
    """Stop kube-scheduler, the extender and the nodes; remove the scenario's pods."""
    admin = cluster.cp.api()
    for proc in (cluster.scheduler, cluster.extender):
        proc.stop()
    for node in cluster.nodes.values():
        node.stop()
    if cluster.real is not None:
        cluster.real.stop()
    with contextlib.suppress(Exception):
        for pod in admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]:
            admin.delete(
                f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}?gracePeriodSeconds=0"
            )


# -- the extender as the test's own client ---------------------------------------------------------


def _connection(cluster: Cluster) -> http.client.HTTPSConnection:
    ctx = ssl.create_default_context(cafile=str(cluster.cp.ca_file))
    ctx.load_cert_chain(str(cluster.client.cert), str(cluster.client.key))
    return http.client.HTTPSConnection(
        "127.0.0.1", cluster.port, context=ctx, timeout=60, source_address=(TEST_SOURCE, 0)
    )


def _post(conn: http.client.HTTPSConnection, verb: str, body: object) -> tuple[int, Any]:
    conn.request("POST", f"/{verb}", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def filter_once(cluster: Cluster, pod: dict[str, Any], nodes: list[str]) -> Any:
    """The extender's filter answer for `pod` and these node names (as the test's client)."""
    conn = _connection(cluster)
    try:
        status, answer = _post(conn, "filter", {"Pod": pod, "NodeNames": nodes})
    finally:
        conn.close()
    assert status == 200, answer
    return answer


# -- the scenario ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What run_scenario observed."""

    wall_s: float = 0.0
    fit: list[str] = field(default_factory=list)  # pods that must be bound and carried out
    unfit: dict[str, str] = field(default_factory=dict)  # pod -> the text its events must show
    race_bound: list[str] = field(default_factory=list)
    race_refused: dict[str, str] = field(default_factory=dict)  # pod -> the bind's Error
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> the pod at the end
    connections: list[int] = field(default_factory=list)  # statuses of the 32 simultaneous filters
    samples: int = 0
    violations: list[str] = field(default_factory=list)


def _filter_once_seen(
    conn: http.client.HTTPSConnection, pod: dict[str, Any], nodes: list[str]
) -> tuple[int, dict[str, Any]]:
    """The extender's filter answer for pod once it has seen every node's published state.

    The extender lists nodes every 10 s (--node-refresh); a list that came between a node's creation and
    its agent's first publication leaves the node cached without state ("no gpunode.io/gpu-state
    annotation") until the next list. build_cluster waits for the annotation in the API server only, so
    this asks again while that is the answer (any other reason is the answer)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        status, answer = _post(conn, "filter", {"Pod": pod, "NodeNames": nodes})
        unseen = [
            n
            for n, why in (answer.get("FailedNodes") or {}).items()
            if str(why).startswith(f"no {NODE_STATE_ANNOTATION} annotation")
        ]
        if status != 200 or not unseen or time.monotonic() > deadline:
            return status, answer
        time.sleep(0.5)


def _race(cluster: Cluster, admin: Api, outcome: Outcome) -> None:
    """16 binds at once for one node with room for 12 (see the module docstring)."""
    names = [f"race-{i:02d}" for i in range(RACE_PODS)]
    pods = [
        create_pod(
            admin, NAMESPACE, pod_body(n, limits={GPU_MEMORY_RESOURCE: str(RACE_GIB)}, scheduler_name=DIRECT)
        )
        for n in names
    ]
    conns = [_connection(cluster) for _ in pods]
    for conn, pod in zip(conns, pods, strict=True):
        status, answer = _filter_once_seen(conn, pod, [RACE_NODE, RACE_OTHER])
        assert status == 200 and RACE_NODE in (answer.get("NodeNames") or []), answer
    barrier = threading.Barrier(len(pods))

    def bind(conn: http.client.HTTPSConnection, pod: dict[str, Any]) -> str:
        meta = pod["metadata"]
        body = {"PodName": meta["name"], "PodNamespace": NAMESPACE, "PodUID": meta["uid"], "Node": RACE_NODE}
        barrier.wait(60)
        status, answer = _post(conn, "bind", body)
        assert status == 200, answer
        return str(answer.get("Error") or "")

    with concurrent.futures.ThreadPoolExecutor(len(pods)) as pool:
        errors = list(pool.map(bind, conns, pods))
    for conn in conns:
        conn.close()
    for name, error in zip(names, errors, strict=True):
        if error:
            outcome.race_refused[name] = error
        else:
            outcome.race_bound.append(name)


def _simultaneous_filters(cluster: Cluster, count: int = 32) -> list[int]:
    """`count` TLS connections opened first, then one filter on each at the same moment; the statuses."""
    conns = [_connection(cluster) for _ in range(count)]
    for conn in conns:
        conn.connect()
    probe = pod_body("probe", limits={GPU_MEMORY_RESOURCE: "1"})
    probe["metadata"].update(namespace=NAMESPACE, uid="probe-uid")
    barrier = threading.Barrier(count)

    def one(conn: http.client.HTTPSConnection) -> int:
        barrier.wait(60)
        status, _ = _post(conn, "filter", {"Pod": probe, "NodeNames": list(NODES)})
        conn.close()
        return status

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, conns))


def _scheduled_pods() -> dict[str, dict[str, str]]:
    """The pods kube-scheduler places: name -> limits."""
    pods: dict[str, dict[str, str]] = {}
    # Whole GPUs first, so they are placed while every shared GPU is fully free: 3 of the 4 whole GPUs
    # left once the pinned pod and the 2-GPU pod (WHOLE_TWO, placed before the burst) have theirs.
    for i in range(3):
        pods[f"whole-{i}"] = {GPU_RESOURCE: "1"}
    for i in range(4):
        pods[f"mig-1g-{i}"] = {MIG_1G: "1"}
    for i in range(2):
        pods[f"mig-2g-{i}"] = {MIG_2G: "1"}
        pods[f"mig-3g-{i}"] = {MIG_3G: "1"}
    for i in range(20):
        pods[f"burst-{i:02d}"] = {GPU_MEMORY_RESOURCE: str(2 + i % 5)}
    return pods


UNFIT = {
    "too-big": (
        {GPU_MEMORY_RESOURCE: "100"},
        "bytes of GPU memory free",
    ),  # no GPU has 100 GiB; the nodes' totals do
    "invalid": ({MIG_1G: "1", MIG_2G: "1"}, "one MIG instance of one profile"),
}


def _assigned(admin: Api, pod: str) -> bool:
    """Whether the extender has written its GPU assignment on the pod."""
    got = admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
    return ASSIGNMENT_ANNOTATION in got["metadata"].get("annotations", {})


def _real_pods(
    cluster: Cluster, admin: Api, pods: dict[str, dict[str, str]], after: dict[str, Any] | None = None
) -> None:
    """Create pods for the real node once the extender knows its state and the pods `after` are assigned
    (by the extender: they were placed before these exist)."""
    assert cluster.real is not None
    probe = real_pod("probe", {GPU_MEMORY_RESOURCE: "1"})
    probe["metadata"].update(namespace=NAMESPACE, uid="probe-uid")
    name = cluster.real.name
    answers: list[dict[str, Any]] = [{}]

    def passes() -> bool:
        answers[0] = filter_once(cluster, probe, [name])
        return name in (answers[0].get("NodeNames") or [])

    try:
        eventually(passes, timeout_s=WAIT_S, what=f"the extender's filter passing {name}")
    except AssertionError as exc:  # the extender's last answer says why
        raise AssertionError(f"{exc}; its last answer: {answers[0]}") from None

    for earlier in after or {}:
        eventually(partial(_assigned, admin, earlier), timeout_s=WAIT_S, what=f"{earlier} assigned")
    for pod, limits in pods.items():
        create_pod(admin, NAMESPACE, real_pod(pod, limits))


def run_scenario(cluster: Cluster) -> Outcome:
    """Run the scenario (see the module docstring) and wait until every pod that fits is carried out."""
    admin = cluster.cp.api()
    outcome = Outcome()
    sampler = Sampler(cluster.cp.api(), cluster.node_names, NAMESPACE).start()
    started = time.monotonic()
    try:
        _race(cluster, admin, outcome)
        pinned = pod_body(MIXED_WHOLE, limits={GPU_RESOURCE: "1"})
        pinned["spec"]["nodeSelector"] = {"kubernetes.io/hostname": MIXED_NODE}
        create_pod(admin, NAMESPACE, pinned)
        eventually(partial(_assigned, admin, MIXED_WHOLE), timeout_s=WAIT_S, what=f"{MIXED_WHOLE} assigned")
        # The 2-GPU pod before the burst: with the pinned pod placed, only the T4 node has two whole GPUs
        # free, and three single-GPU pods placed first may take three of its four (two runs in sixty did),
        # after which the 2-GPU pod fits nowhere. Placed first, every later pod fits wherever it goes.
        create_pod(admin, NAMESPACE, pod_body(WHOLE_TWO, limits={GPU_RESOURCE: "2"}))
        eventually(partial(_assigned, admin, WHOLE_TWO), timeout_s=WAIT_S, what=f"{WHOLE_TWO} assigned")
        scheduled = _scheduled_pods()
        with concurrent.futures.ThreadPoolExecutor(20) as pool:  # the burst: created together
            list(
                pool.map(
                    lambda kv: create_pod(admin, NAMESPACE, pod_body(kv[0], limits=kv[1])), scheduled.items()
                )
            )
        real = REAL_PODS if cluster.real is not None else {}
        if cluster.real is not None:
            _real_pods(cluster, admin, REAL_WHOLE)
        for name, (limits, text) in UNFIT.items():
            create_pod(admin, NAMESPACE, pod_body(name, limits=limits))
            outcome.unfit[name] = text
        outcome.connections = _simultaneous_filters(cluster)
        if cluster.real is not None:
            _real_pods(cluster, admin, REAL_FRACTIONS, after=REAL_WHOLE)
        outcome.fit = [*outcome.race_bound, MIXED_WHOLE, WHOLE_TWO, *scheduled, *real]

        waiting: list[str] = []

        def done(annotated: bool) -> bool:
            pods = {
                p["metadata"]["name"]: p for p in admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
            }
            outcome.pods = pods
            waiting[:] = [
                _not_yet(pods.get(n), n)
                for n in outcome.fit
                if pods.get(n, {}).get("status", {}).get("phase") != "Running"
                or (annotated and ALLOCATED_ANNOTATION not in pods[n]["metadata"].get("annotations", {}))
            ]
            waiting.extend(
                f"{n}: no NVIDIA_VISIBLE_DEVICES printed yet"
                for n in real
                if cluster.real is not None and not visible_devices(cluster.real, NAMESPACE, n)
            )
            return not waiting

        try:
            eventually(lambda: done(False), timeout_s=WAIT_S, what="every pod that fits bound and admitted")
        except AssertionError as exc:  # which pods, and where they stand, for the report
            placed = sorted(  # where the whole-GPU pods went, to explain a pod that fits nowhere
                f"{n}->{p['spec'].get('nodeName') or '-'}"
                for n, p in outcome.pods.items()
                if GPU_RESOURCE in p["spec"]["containers"][0].get("resources", {}).get("limits", {})
            )
            raise AssertionError(
                f"{exc}; still waiting: " + "; ".join(waiting) + "; whole-GPU pods: " + ", ".join(placed)
            ) from None
        # The agent marks what it carried out; a pod it could not match stays unmarked (the agreement
        # figure counts it), so this wait is bounded and not an assertion.
        with contextlib.suppress(AssertionError):
            eventually(lambda: done(True), timeout_s=CARRIED_OUT_WAIT_S, what="every pod marked carried out")
        outcome.wall_s = time.monotonic() - started
    finally:
        sampler.stop()
    sampler.sample()  # and once more at the end
    outcome.samples, outcome.violations = sampler.samples, sampler.violations
    return outcome


def _not_yet(pod: dict[str, Any] | None, name: str) -> str:
    """One line on where a pod that is not yet carried out stands."""
    if pod is None:
        return f"{name}: gone"
    status = pod.get("status", {})
    conditions = ", ".join(
        f"{c.get('type')}={c.get('status')} {c.get('reason') or ''} {c.get('message') or ''}".strip()
        for c in status.get("conditions", [])
    )
    waits = [
        f"{s.get('name')}: {next(iter(s.get('state', {})), '?')} {s.get('state', {}).get('waiting', {})}"
        for s in status.get("containerStatuses", [])
    ]
    return (
        f"{name}: phase {status.get('phase')} on {pod['spec'].get('nodeName') or 'no node'}"
        f" [{conditions}] {waits or ''} annotated={ALLOCATED_ANNOTATION in pod['metadata'].get('annotations', {})}"
    )
