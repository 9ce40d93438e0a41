"""The multi-node scenario: the real kube-scheduler places whole-GPU, MIG and fractional pods through
`gpunode extender`; four simulated-agent nodes (tests.e2e.simnodes) and one real kubelet with the agent
as its device plugin (tests.e2e.scenario_realnode, where root and containerd allow) carry them out.

Cluster (build_cluster): the chart's extender and agent RBAC; the extender as the chart runs it (HTTPS
with client certificates, --bind, node refresh; --log-level debug for its per-request access log),
started before any Node exists; four SimNodes and the real node; kube-scheduler configured from
gpunode/examples/kube-scheduler-config.yaml (apiVersion adapted to 1.20's v1beta1, files and address
replaced). Scenario (run_scenario), while a Sampler reads every node's gpu-state annotation and every
pod's assignment every SAMPLE_S:

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
import re
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
from gpunode.contract.nodestate import decode
from tests.e2e import chart
from tests.e2e.api import Api, eventually
from tests.e2e.controlplane import ROOT, ControlPlane
from tests.e2e.objects import create_pod, ensure_namespace, pod_body
from tests.e2e.pki import CertFiles
from tests.e2e.procs import Proc
from tests.e2e.scenario_realnode import (
    REAL_FRACTIONS,
    REAL_PODS,
    REAL_WHOLE,
    RealAgentNode,
    kubelet_error_lines,
    real_pod,
    start_real_node,
    visible_devices,
)
from tests.e2e.simnodes import SimNode
from tests.ports import free_port

GIB = 2**30
NAMESPACE = "e2e-scenario"
DIRECT = "e2e-direct"  # the schedulerName of the pods the test binds itself
WAIT_S = 180.0  # generous: two shared cores
SAMPLE_S = 0.1
CARRIED_OUT_WAIT_S = 20.0
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
    entries[0]["urlPrefix"] = f"https://127.0.0.1:{port}"
    entries[0]["tlsConfig"] = {
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


# -- sampling: nothing over capacity, ever ---------------------------------------------------------


def _pod_memory(pod: dict[str, Any]) -> int:
    limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
    return int(limits.get(GPU_MEMORY_RESOURCE, 0)) * GIB


class Sampler:
    """Every SAMPLE_S: each GPU's published assignment within capacity, and the assignments of the bound
    pods (the extender's decisions) never more than a GPU holds."""

    def __init__(self, api: Api, nodes: list[str]) -> None:
        """Sample these nodes and the scenario's pods through `api`."""
        self.api = api
        self.nodes = set(nodes)
        self.samples = 0
        self.violations: list[str] = []
        self.capacity: dict[
            tuple[str, str], int
        ] = {}  # (node, GPU UUID) -> bytes: sim UUIDs repeat across nodes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> Sampler:
        """Start sampling in a thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with contextlib.suppress(OSError):
                self.sample()

    def sample(self) -> None:
        """One sample of every node and pod."""
        for node in self.api.get("/api/v1/nodes")["items"]:
            name = node["metadata"]["name"]
            text = node["metadata"].get("annotations", {}).get(NODE_STATE_ANNOTATION)
            if name not in self.nodes or not text:
                continue
            for gpu in decode(text, node=name).gpus:
                self.capacity[(name, gpu.uuid)] = gpu.memory_total_bytes
                if (
                    gpu.memory_assigned_bytes > gpu.memory_total_bytes
                    or gpu.milli_assigned > gpu.milli_capacity
                ):
                    self.violations.append(
                        f"{name} {gpu.uuid}: published {gpu.memory_assigned_bytes} of {gpu.memory_total_bytes} "
                        f"bytes, {gpu.milli_assigned} of {gpu.milli_capacity} milli"
                    )
        held: dict[tuple[str, str], list[tuple[str, int]]] = {}
        for pod in self.api.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]:
            assigned = pod["metadata"].get("annotations", {}).get(ASSIGNMENT_ANNOTATION)
            if not assigned or not pod["spec"].get("nodeName"):
                continue
            gpus = assigned.split(",")
            memory = _pod_memory(pod)
            limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
            if any(r.startswith("nvidia.com/mig-") for r in limits):
                continue  # a MIG instance: the published state above counts what each instance holds
            for uuid in gpus:
                # A fraction holds its memory; a whole GPU or a MIG instance all of it.
                held.setdefault((pod["spec"]["nodeName"], uuid), []).append(
                    (pod["metadata"]["name"], memory or -1)
                )
        for uuid, holders in held.items():
            total = self.capacity.get(uuid)
            whole = [h for h in holders if h[1] < 0]
            used = sum(m for _, m in holders if m > 0)
            if (whole and len(holders) > 1) or (total is not None and used > total):
                self.violations.append(f"{uuid}: assigned to {holders} (capacity {total} bytes)")
        self.samples += 1


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
        status, answer = _post(conn, "filter", {"Pod": pod, "NodeNames": [RACE_NODE, RACE_OTHER]})
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
    # Whole GPUs first, so they are placed while every shared GPU is fully free. 5 of the 7 whole GPUs:
    # whatever nodes the 3 single GPUs take, 2 of the 4 left are on one node for the 2-GPU pod.
    for i in range(3):
        pods[f"whole-{i}"] = {GPU_RESOURCE: "1"}
    pods["whole-two"] = {GPU_RESOURCE: "2"}
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
    sampler = Sampler(cluster.cp.api(), cluster.node_names).start()
    started = time.monotonic()
    try:
        _race(cluster, admin, outcome)
        pinned = pod_body(MIXED_WHOLE, limits={GPU_RESOURCE: "1"})
        pinned["spec"]["nodeSelector"] = {"kubernetes.io/hostname": MIXED_NODE}
        create_pod(admin, NAMESPACE, pinned)
        eventually(partial(_assigned, admin, MIXED_WHOLE), timeout_s=WAIT_S, what=f"{MIXED_WHOLE} assigned")
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
        outcome.fit = [*outcome.race_bound, MIXED_WHOLE, *scheduled, *real]

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
            raise AssertionError(f"{exc}; still waiting: " + "; ".join(waiting)) from None
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


# -- figures ---------------------------------------------------------------------------------------

_ACCESS = re.compile(
    r"^(\S+ \S+) DEBUG\s+\S+: (\S+) \"POST /(filter|prioritize|bind)\" (\d+) \S+ ([\d.]+)ms$"
)


def access_log(log: Path) -> list[tuple[float, str, str, int, float]]:
    """(end time, client, verb, status, ms) per request in the extender's log."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = _ACCESS.match(line)
        if m:
            stamp = (
                time.mktime(time.strptime(m[1].split(",")[0], "%Y-%m-%d %H:%M:%S"))
                + int(m[1].split(",")[1]) / 1000
            )
            out.append((stamp, m[2], m[3], int(m[4]), float(m[5])))
    return out


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2)


def agreement(cluster: Cluster, outcome: Outcome) -> tuple[int, int, list[str]]:
    """(pods whose allocated GPUs equal the assigned ones, pods compared, the disagreements)."""
    admitted = {
        a.pod.split("/", 1)[1]: a
        for n in cluster.nodes.values()
        if n.admitter
        for a in n.admitter.admissions.values()
    }
    parent: dict[str, str] = {}  # MIG device UUID -> its GPU's (the extender assigns the GPU)
    for node in cluster.cp.api().get("/api/v1/nodes")["items"]:
        text = node["metadata"].get("annotations", {}).get(NODE_STATE_ANNOTATION)
        if node["metadata"]["name"] in cluster.node_names and text:
            parent.update({m.uuid: g.uuid for g in decode(text).gpus for m in g.mig})
    agree, differ = 0, []
    for name in outcome.fit:
        annotations = outcome.pods[name]["metadata"].get("annotations", {})
        assigned = set(annotations.get(ASSIGNMENT_ANNOTATION, "").split(","))
        allocated = {parent.get(u, u) for u in annotations.get(ALLOCATED_ANNOTATION, "").split(",")}
        if name in REAL_PODS and cluster.real is not None:  # what the real kubelet's Allocate call gave
            shown = visible_devices(cluster.real, NAMESPACE, name) or []
        else:
            shown = admitted[name].visible if name in admitted else []
        visible = {parent.get(u, u) for u in shown}
        if assigned == allocated == visible:
            agree += 1
        else:
            differ.append(
                f"{name}: assigned {sorted(assigned)}, allocated {sorted(allocated)}, Allocate gave {sorted(visible)}"
            )
    return agree, len(outcome.fit), differ


def whole_offered(cluster: Cluster, outcome: Outcome) -> tuple[int, list[str]]:
    """(whole-GPU pods placed on nodes that also share GPUs in memory units, the whole-GPU pods assigned a
    GPU whose node does not offer it whole), from the nodes' published servesWhole."""
    offered: dict[tuple[str, str], bool] = {}
    mixed: set[str] = set()
    for node in cluster.cp.api().get("/api/v1/nodes")["items"]:
        name = node["metadata"]["name"]
        text = node["metadata"].get("annotations", {}).get(NODE_STATE_ANNOTATION)
        if name in cluster.node_names and text:
            for g in decode(text, node=name).gpus:
                offered[(name, g.uuid)] = g.serves_whole
                if g.sharing == "fractional" and not g.serves_whole:
                    mixed.add(name)
    on_mixed, wrong = 0, []
    for name in outcome.fit:
        pod = outcome.pods[name]
        if GPU_RESOURCE not in pod["spec"]["containers"][0]["resources"].get("limits", {}):
            continue
        node = pod["spec"].get("nodeName", "")
        assigned = pod["metadata"].get("annotations", {}).get(ASSIGNMENT_ANNOTATION, "").split(",")
        on_mixed += node in mixed
        wrong += [
            f"{name}: {node} {uuid} is not offered whole"
            for uuid in assigned
            if not offered.get((node, uuid))
        ]
    return on_mixed, wrong


def figures(cluster: Cluster, outcome: Outcome) -> dict[str, Any]:
    """The scenario's figures, for the JSON report."""
    agree, compared, _ = agreement(cluster, outcome)
    requests = access_log(cluster.extender.log)
    by_scheduler = [r for r in requests if r[1] != TEST_SOURCE]
    binds = sorted((end - ms / 1000, end) for end, client, verb, _, ms in by_scheduler if verb == "bind")
    concurrent_binds = max((sum(1 for s, e in binds if s <= start < e) for start, _ in binds), default=0)
    return {
        "nodes": len(cluster.node_names),
        "real_kubelet_pods": sum(1 for n in outcome.fit if n in REAL_PODS),
        "pods_fit": len(outcome.fit),
        "agreement_rate": round(agree / compared, 4) if compared else None,
        "agreement": f"{agree}/{compared}",
        "overcommit_samples": len(outcome.violations),
        "samples": outcome.samples,
        "whole_pods_on_mixed_nodes": whole_offered(cluster, outcome)[0],
        "whole_pods_on_gpus_not_offered_whole": len(whole_offered(cluster, outcome)[1]),
        "wall_s": round(outcome.wall_s, 1),
        "race_bound": len(outcome.race_bound),
        "race_refused": len(outcome.race_refused),
        "simultaneous_connections_answered": sum(1 for s in outcome.connections if s == 200),
        "max_concurrent_binds_from_scheduler": concurrent_binds,
        "latency_source": "extender access log (--log-level debug), requests from kube-scheduler only",
        **{
            f"{verb}_p99_ms": _p99([ms for _, _, v, _, ms in by_scheduler if v == verb])
            for verb in ("filter", "prioritize", "bind")
        },
        **{
            f"{verb}_count": sum(1 for r in by_scheduler if r[2] == verb)
            for verb in ("filter", "prioritize", "bind")
        },
    }


_ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback")
_KLOG_ERROR = re.compile(r"^E\d{4} ")


def error_lines(cluster: Cluster) -> list[str]:
    """ERROR lines and tracebacks of the agents and the extender, kube-scheduler's E-lines about the
    extender or the scenario's pods, and the real kubelet's E-lines about device plugins/allocation."""
    found = []
    agents = [n.agent for n in cluster.nodes.values() if n.agent]
    agents += [cluster.real.agent] if cluster.real is not None else []
    for proc in [cluster.extender, *agents]:
        for line in proc.log.read_text(errors="replace").splitlines():
            if _ERROR_LINE.search(line):
                found.append(f"{proc.name}: {line}")
    for line in cluster.scheduler.log.read_text(errors="replace").splitlines():
        if _KLOG_ERROR.match(line) and (
            "extender" in line.lower() or NAMESPACE in line or str(cluster.port) in line
        ):
            found.append(f"{cluster.scheduler.name}: {line}")
    for node in cluster.nodes.values():
        if node.admitter:
            found += [f"kubelet stand-in {node.name}: {e}" for e in node.admitter.errors]
    if cluster.real is not None:
        found += kubelet_error_lines(cluster.real)
    return found
