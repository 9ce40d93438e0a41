"""Energy- and load-aware placement through the real kube-scheduler, fed by a real Prometheus.

One cluster for the module (tests.e2e.promfeed_cluster): two simulated-agent nodes scraped by a real
Prometheus, `gpunode extender --prometheus-url` as the chart runs it, and kube-scheduler with the chart's
configuration. A GPU's activity is pinned through its node's control socket; once Prometheus has
scraped it and the extender has refreshed its figures, a new GPU pod is bound by kube-scheduler to the
node the weighted energy and load terms prefer (read back as spec.nodeName from the API server), and
the preference moves with the series. With Prometheus stopped (SIGTERM), pods are still bound, the
extender counts its fallback and logs one warning, not one per request or refresh.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from tests.e2e.api import Api, eventually
from tests.e2e.controlplane import ControlPlane
from tests.e2e.objects import create_pod, get_pod
from tests.e2e.promfeed_cluster import (
    MAX_AGE_S,
    NAMESPACE,
    NODES,
    POLICY_WEIGHT,
    WAIT_S,
    FeedCluster,
    build_feed_cluster,
    gpu_pod,
    preferred_by_terms,
    stop_feed_cluster,
)
from tests.shared.prometheus import PROMETHEUS

BUSY = 0.9  # the activity pinned on every GPU of the busy node


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FeedCluster]:
    """The module's cluster (see tests.e2e.promfeed_cluster)."""
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (apt-get install -y prometheus)")
    built = build_feed_cluster(control_plane, tmp_path_factory.mktemp("promfeed"))
    try:
        yield built
    finally:
        stop_feed_cluster(built)


def _running_on(api: Api, name: str) -> dict[str, Any] | None:
    """The pod once bound and admitted by its node's kubelet stand-in (phase Running), else None."""
    pod = get_pod(api, NAMESPACE, name)
    return pod if pod["spec"].get("nodeName") and pod["status"].get("phase") == "Running" else None


def _place(cluster: FeedCluster, name: str) -> str:
    """Create a one-GPU pod, wait until kube-scheduler bound it and it runs; the node it was bound to."""
    admin = cluster.cp.api()
    create_pod(admin, NAMESPACE, gpu_pod(name))
    pod = eventually(partial(_running_on, admin, name), timeout_s=WAIT_S, what=f"{name} bound and running")
    return str(pod["spec"]["nodeName"])


def _make_busy(cluster: FeedCluster, busy: str) -> None:
    """Pin every GPU of node `busy` to BUSY and let the others follow their processes (none: idle)."""
    for name, node in cluster.nodes.items():
        for gpu in range(4):
            node.activity(gpu, BUSY if name == busy else None)


def _busy_and_idle(busy: str, figures: dict[str, Any]) -> bool:
    """Whether Prometheus's figures show node `busy` at BUSY utilisation and the other node idle."""
    if set(figures) != set(NODES):
        return False
    return all(
        figures[n].util == pytest.approx(BUSY if n == busy else 0.0) and figures[n].power_w is not None
        for n in NODES
    )


def test_the_agents_series_name_the_kubernetes_nodes(cluster: FeedCluster) -> None:
    figures = cluster.prometheus_figures()
    assert set(figures) == set(NODES), figures
    for load in figures.values():
        assert load.power_w is not None and load.util is not None and load.memory is not None, figures
    assert cluster.extender_metrics()["gpunode_extender_prometheus_nodes"] == len(NODES)


def test_kube_scheduler_binds_to_the_node_the_energy_and_load_terms_prefer(cluster: FeedCluster) -> None:
    first, second = NODES
    placed: list[tuple[str, str]] = []
    # first, first, second: a policy that spreads pods would take the second pod to the other node, one
    # that packs them would keep the third on the first node; only the terms give this sequence.
    for step, busy in enumerate((first, first, second)):
        _make_busy(cluster, busy)
        figures = cluster.wait_for_figures(partial(_busy_and_idle, busy), f"{busy} busy, the other idle")
        assert figures[busy].power_w > figures[next(n for n in NODES if n != busy)].power_w, figures  # type: ignore[operator]
        preferred, lead = preferred_by_terms(figures)
        # The energy term (fill the node drawing power) outweighs the load term here, and together
        # they lead by more than the policy's score can make up: the terms alone decide.
        assert preferred == busy and lead > POLICY_WEIGHT, (preferred, lead, figures)
        placed.append((busy, _place(cluster, f"follow-{step}")))
    assert [node for _, node in placed] == [busy for busy, _ in placed], placed
    for node in cluster.nodes.values():
        assert not node.sim.admitter or not node.sim.admitter.errors, node.sim.admitter.errors


def test_with_prometheus_stopped_pods_are_still_bound(cluster: FeedCluster) -> None:
    before = cluster.extender_metrics()
    warned = len(cluster.warnings())
    cluster.prometheus.stop()  # SIGTERM
    assert cluster.prometheus.proc.poll() is not None

    # The extender keeps its last figures for MAX_AGE_S; wait until they are stale and several refreshes
    # have failed, so that the warning had every chance to repeat.
    def stale() -> bool:
        now = cluster.extender_metrics()
        failed = now["gpunode_extender_prometheus_refresh_failures_total"]
        return failed >= before["gpunode_extender_prometheus_refresh_failures_total"] + 3 and (
            now["gpunode_extender_prometheus_figures_age_seconds"] > MAX_AGE_S
        )

    eventually(stale, timeout_s=WAIT_S, what="the extender's figures stale after failed refreshes")
    names = [f"blind-{i}" for i in range(3)]
    admin = cluster.cp.api()
    for name in names:
        create_pod(admin, NAMESPACE, gpu_pod(name))
    for name in names:
        pod = eventually(
            partial(_running_on, admin, name), timeout_s=WAIT_S, what=f"{name} bound and running"
        )
        assert pod["spec"]["nodeName"] in NODES, pod["spec"]
    after = cluster.extender_metrics()
    assert after["gpunode_extender_load_fallback_total"] > before["gpunode_extender_load_fallback_total"], (
        after
    )
    failures = after["gpunode_extender_prometheus_refresh_failures_total"]
    assert failures >= before["gpunode_extender_prometheus_refresh_failures_total"] + 3, after
    lines = cluster.warnings()
    assert len(lines) == warned + 1, lines  # one line for all those failed refreshes and answers
    assert "Prometheus" in lines[-1] and f"{MAX_AGE_S:g}s old" in lines[-1], lines[-1]
    for node in cluster.nodes.values():
        assert not node.sim.admitter or not node.sim.admitter.errors, node.sim.admitter.errors
