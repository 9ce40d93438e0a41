"""The extender's energy and load terms live: a real Prometheus scraping two simulated agents, and the real
kube-scheduler placing GPU pods through `gpunode extender --prometheus-url`.

build_feed_cluster starts, on the session's real control plane:

- a real Prometheus (the `prometheus` binary, as tests/shared/prometheus.py runs it: scrape interval 1 s)
  whose targets are the metrics endpoints of the two agents below, started first so that it answers
  before the extender asks it anything;
- `gpunode extender` with the arguments of the chart's Deployment rendered with extender.prometheus set
  (url, a 1 s refresh, a 2 s timeout, a 4 s max age; the energy term weighted 4 and the load term 1,
  so together they outweigh the placement policy's score, whose weight is 1) and schedulerNames
  [e2e-promfeed]; HTTPS with client certificates and --bind, as the chart runs it;
- two SimNodes (four simulated T4s each, a real `gpunode agent --backend sim` publishing
  gpunode.io/gpu-state and serving DCGM-style metrics labelled with the Node's name, and its control
  socket, through which the test pins a GPU's activity: power and utilisation follow);
- kube-scheduler with the chart's scheduler configuration (kubescheduler.config.k8s.io/v1, the chart's
  default) as it is but for the extender's address and certificate paths: its extenders entry and its
  profile (the scheduler name e2e-promfeed, so that no pod of another test is placed here and no other
  scheduler places these pods).

FeedCluster reads the extender's own metrics from its health port, the figures Prometheus holds (asked
with the extender's own queries, by a PromFeed of the test's), and the extender's log.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from gpunode.cluster.extender.promfeed import NodeLoad, PromFeed, terms
from gpunode.contract.names import GPU_RESOURCE
from gpunode.node.devices.simnode.cli import call_control
from tests.e2e import chart
from tests.e2e.api import ApiError, eventually
from tests.e2e.controlplane import ControlPlane
from tests.e2e.objects import ensure_namespace, pod_body
from tests.e2e.procs import Proc
from tests.e2e.simnodes import SimNode, seeded_t4, state_published
from tests.ports import free_port
from tests.shared.prometheus import PROMETHEUS, Prometheus

NAMESPACE = "e2e-promfeed"
SCHEDULER_NAME = "e2e-promfeed"
NODES = ("e2e-promfeed-a", "e2e-promfeed-b")  # four T4s each
WAIT_S = 180.0  # generous: two shared cores
TIMEOUT_S, MAX_AGE_S = 2.0, 4.0
ENERGY_WEIGHT, LOAD_WEIGHT = 4.0, 1.0
POLICY_WEIGHT = 1.0  # the placement policy's score, scaled to 0..1 among the nodes, counts once
FALLBACK_WARNING = "prioritize scores without the energy and load terms"


def chart_values(prometheus_url: str) -> dict[str, Any]:
    """The chart's values: the extender with TLS, --bind, node names only, and the Prometheus feed."""
    return {
        "extender": {
            "enabled": True,
            "bind": True,
            "nodeCacheCapable": True,
            "nodeRefreshInterval": "1s",
            "schedulerNames": [SCHEDULER_NAME],
            "tls": {"enabled": True, "existingSecret": "gpunode-extender-tls"},
            "prometheus": {
                "url": prometheus_url,
                "refreshInterval": "1s",
                "timeout": f"{TIMEOUT_S:g}s",
                "maxAge": f"{MAX_AGE_S:g}s",
                "energyWeight": ENERGY_WEIGHT,
                "loadWeight": LOAD_WEIGHT,
            },
        }
    }


@dataclass
class FeedNode:
    """One simulated agent node, with the port Prometheus scrapes and its control socket."""

    sim: SimNode
    metrics_port: int
    control: Path

    def activity(self, gpu: int, ratio: float | None) -> None:
        """Pin GPU `gpu`'s activity to `ratio` (None: follow its processes again, i.e. idle here)."""
        call_control(str(self.control), "POST", "/gpus/activity", {"gpu": gpu, "ratio": ratio})


@dataclass
class FeedCluster:
    """What build_feed_cluster started."""

    cp: ControlPlane
    nodes: dict[str, FeedNode]
    prometheus: Prometheus
    extender: Proc
    health_port: int
    scheduler: Proc | None = None

    def extender_metrics(self) -> dict[str, float]:
        """The extender's own metrics (its /metrics on the health port), by sample name."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def prometheus_figures(self) -> dict[str, NodeLoad]:
        """The per-node figures Prometheus answers the extender's queries with right now."""
        feed = PromFeed(f"http://127.0.0.1:{self.prometheus.port}", timeout_s=10.0)
        try:
            feed.refresh_once()
            return dict(feed.figures() or {})
        finally:
            feed.stop()

    def warnings(self) -> list[str]:
        """The extender's log lines saying that it scores without the terms."""
        return [
            ln for ln in self.extender.log.read_text(errors="replace").splitlines() if FALLBACK_WARNING in ln
        ]

    def wait_for_figures(
        self, check: Callable[[dict[str, NodeLoad]], bool], what: str
    ) -> dict[str, NodeLoad]:
        """Wait until Prometheus's figures pass `check`, then until the extender has refreshed its own since.

        The extender's figures are newer than that moment once their age (its gauge) is below the time
        passed since, less the longest a refresh can take (three queries of at most TIMEOUT_S each).
        """

        def passing() -> dict[str, NodeLoad] | None:
            figures = self.prometheus_figures()
            return figures if check(figures) else None

        figures = eventually(passing, timeout_s=WAIT_S, what=what)
        seen = time.monotonic()

        def refreshed() -> bool:
            now = time.monotonic()
            age = self.extender_metrics()["gpunode_extender_prometheus_figures_age_seconds"]
            return 0 <= age < now - seen - 3 * TIMEOUT_S

        eventually(refreshed, timeout_s=WAIT_S, what=f"the extender's figures refreshed after {what}")
        return figures


def preferred_by_terms(figures: Mapping[str, NodeLoad]) -> tuple[str, float]:
    """The node the weighted energy and load terms prefer, and its lead over the other node."""
    energy, load = terms(NODES, figures)
    total = ENERGY_WEIGHT * energy + LOAD_WEIGHT * load
    best = int(total.argmax())
    return NODES[best], float(total[best] - total[1 - best])


def gpu_pod(name: str) -> dict[str, Any]:
    """A one-GPU pod for this test's scheduler, allowed on this test's nodes only."""
    body = pod_body(name, limits={GPU_RESOURCE: "1"}, scheduler_name=SCHEDULER_NAME)
    term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": list(NODES)}]}
    body["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    }
    return body


def _start_extender(cp: ControlPlane, docs: list[dict[str, Any]]) -> tuple[Proc, int, int, Any]:
    """`gpunode extender` with the chart Deployment's arguments, its addresses and files replaced."""
    dep = next(
        d
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{chart.RELEASE}-gpunode-extender"
    )
    args = [str(a) for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]]
    serving = cp.issue("promfeed-extender", common_name="gpunode-extender", server=True, hosts=("127.0.0.1",))
    client = cp.issue("promfeed-scheduler", common_name="kube-scheduler", client=True)
    port, health = free_port(), free_port()
    replaced = {
        "--listen": f"127.0.0.1:{port}",
        "--health-listen": f"127.0.0.1:{health}",
        "--kube-api": cp.server,
        "--tls-cert-file": str(serving.cert),
        "--tls-key-file": str(serving.key),
        "--client-ca-file": str(cp.ca_file),
    }
    for flag, value in replaced.items():
        args[args.index(flag) + 1] = value
    args += ["--kube-token-file", str(cp.token_file("extender")), "--kube-ca-file", str(cp.ca_file)]
    extender = Proc(
        "gpunode-extender-promfeed", [sys.executable, "-m", "gpunode.cli", *args], cp.logs
    ).start()
    cp.procs.append(extender)
    extender.wait_until(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=5).status == 200,
        timeout_s=WAIT_S,
        what="ready extender",
    )
    return extender, port, health, client


def build_feed_cluster(cp: ControlPlane, tmp: Path) -> FeedCluster:
    """Start everything (see the module docstring); stop_feed_cluster ends it all."""
    assert PROMETHEUS is not None, "the caller skips without the prometheus binary"
    ports = {name: free_port() for name in NODES}
    (tmp / "prometheus").mkdir()
    prometheus = Prometheus(list(ports.values()), tmp / "prometheus")
    sockets = Path(tempfile.mkdtemp(prefix="gnpf", dir="/tmp"))  # short: a Unix socket path
    nodes: dict[str, FeedNode] = {}
    cluster: FeedCluster | None = None
    try:
        prometheus.wait_until("Prometheus to answer", lambda: prometheus.query("up") is not None, WAIT_S)
        docs = chart.render(chart_values(f"http://127.0.0.1:{prometheus.port}"), tmp)
        admin = cp.api()
        ensure_namespace(admin, chart.NAMESPACE)
        ensure_namespace(admin, NAMESPACE)
        chart.apply_rbac(admin, docs, "extender")
        chart.apply_rbac(admin, docs, "agent")
        extender, port, health, client = _start_extender(cp, docs)
        cluster = FeedCluster(cp, nodes, prometheus, extender, health)
        for name in NODES:
            control = sockets / f"{name[-1]}.sock"
            agent = {
                "metrics": {"listen": f"127.0.0.1:{ports[name]}", "interval": "1s"},
                "simControlSocket": str(control),
            }
            sim = SimNode(cp, name, tmp / name, profile=str(seeded_t4(tmp, name)), agent=agent)
            nodes[name] = FeedNode(sim, ports[name], control)
            sim.start()
        for name in NODES:
            eventually(
                partial(state_published, admin, name), timeout_s=WAIT_S, what=f"{name}'s published GPU state"
            )
        eventually(
            lambda: cluster.extender_metrics().get("gpunode_extender_prometheus_nodes") == len(NODES),
            timeout_s=WAIT_S,
            what="the extender holding figures for both nodes from Prometheus",
        )
        config_map = next(
            d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("scheduler-config")
        )
        config = yaml.safe_load(config_map["data"]["scheduler-config.yaml"])
        assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1", config["apiVersion"]
        entries, profiles = config["extenders"], config["profiles"]
        assert profiles == [{"schedulerName": SCHEDULER_NAME}], profiles
        entries[0]["urlPrefix"] = f"https://127.0.0.1:{port}"
        entries[0]["tlsConfig"] = {
            "certFile": str(client.cert),
            "keyFile": str(client.key),
            "caFile": str(cp.ca_file),
        }
        # the chart's configuration as it is, but for the extender's address and certificate paths
        cluster.scheduler = cp.start_scheduler(name="kube-scheduler-promfeed", config=config)
    except BaseException:
        if cluster is not None:
            stop_feed_cluster(cluster)
        else:
            prometheus.stop()
        shutil.rmtree(sockets, ignore_errors=True)
        raise
    return cluster


def stop_feed_cluster(cluster: FeedCluster) -> None:
    """Stop kube-scheduler, the extender, Prometheus and the nodes; delete the pods."""
    if cluster.scheduler is not None:
        cluster.scheduler.stop()
    cluster.extender.stop()
    cluster.prometheus.stop()
    for node in cluster.nodes.values():
        node.sim.stop()
        shutil.rmtree(node.control.parent, ignore_errors=True)
    with contextlib.suppress(ApiError, OSError):
        admin = cluster.cp.api()
        for pod in admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]:
            admin.delete(
                f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}?gracePeriodSeconds=0"
            )
