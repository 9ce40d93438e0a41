"""The node carries out the cluster's decision, against a real kube-apiserver and kube-scheduler.

Five nodes, each a real `gpunode agent --backend sim` publishing to the real API server with the
chart's agent RBAC: four with a kubelet stand-in that admits the pods bound to it as the kubelet's
device manager does (tests.e2e.simnodes), one a real kubelet + containerd whose device plugin the agent
is (tests.e2e.scenario_realnode: its pods run, whole GPUs and fractions); the extender as the chart runs it; kube-scheduler from the
project's example configuration. The scenario and its figures are tests.e2e.scenario's; the figures
are written to <tmp>/scenario-figures.json (bench/e2e_scenario.py prints the same).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import scenario, scenario_figures
from tests.e2e.api import eventually
from tests.e2e.controlplane import ControlPlane
from tests.e2e.objects import pod_events


@pytest.fixture(scope="module")
def ran(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The cluster built, the scenario run, the figures written."""
    tmp = tmp_path_factory.mktemp("scenario")
    cluster = scenario.build_cluster(control_plane, tmp)
    try:
        outcome = scenario.run_scenario(cluster)
        figures = scenario_figures.figures(cluster, outcome)
        (tmp / "scenario-figures.json").write_text(json.dumps(figures, indent=2))
        print(json.dumps(figures))
        yield {"cluster": cluster, "outcome": outcome, "figures": figures, "tmp": tmp}
    finally:
        scenario.stop_cluster(cluster)


def test_every_pod_that_fits_is_bound_and_gets_the_assigned_gpu(ran: dict[str, Any]) -> None:
    outcome, cluster = ran["outcome"], ran["cluster"]
    for name in outcome.fit:
        pod = outcome.pods[name]
        assert pod["spec"].get("nodeName") in cluster.node_names, (name, pod["spec"].get("nodeName"))
    if cluster.real is not None:  # the real kubelet ran its pods, with the devices its plugin allocated
        for name in scenario.REAL_PODS:
            assert outcome.pods[name]["spec"]["nodeName"] == cluster.real.name, name
            assert outcome.pods[name]["status"]["phase"] == "Running", name
    agree, compared, differ = scenario_figures.agreement(cluster, outcome)
    assert compared == len(outcome.fit) > 35
    assert agree == compared, "\n".join(differ)


def test_whole_gpu_pods_get_only_gpus_their_node_offers_whole(ran: dict[str, Any]) -> None:
    """On nodes that share some GPUs in memory units (published servesWhole false), a whole-GPU pod placed
    while those GPUs were fully free got one of the GPUs the node advertises as nvidia.com/gpu."""
    cluster, outcome = ran["cluster"], ran["outcome"]
    on_mixed, wrong = scenario_figures.whole_offered(cluster, outcome)
    assert wrong == []
    pinned = outcome.pods[scenario.MIXED_WHOLE]
    assert pinned["spec"]["nodeName"] == scenario.MIXED_NODE
    assert on_mixed >= 1 + (len(scenario.REAL_WHOLE) if cluster.real is not None else 0)


def test_concurrent_binds_take_exactly_the_room_there_is(ran: dict[str, Any]) -> None:
    outcome = ran["outcome"]
    # 4 x 15 GiB GPUs, 4 GiB pods: 3 per GPU. The other binds are refused with the extender's reason.
    assert len(outcome.race_bound) == 12 and len(outcome.race_refused) == 4, outcome.race_refused
    assert all("no longer fits" in e for e in outcome.race_refused.values()), outcome.race_refused
    for name in outcome.race_refused:
        assert not outcome.pods[name]["spec"].get("nodeName")


def test_no_gpu_is_ever_over_committed(ran: dict[str, Any]) -> None:
    outcome = ran["outcome"]
    assert outcome.samples > 10
    assert outcome.violations == []


def test_unfittable_pods_stay_pending_with_the_extenders_reason(
    ran: dict[str, Any], control_plane: ControlPlane
) -> None:
    admin = control_plane.api()
    for name, text in ran["outcome"].unfit.items():

        def reason(name: str = name, text: str = text) -> str | None:
            for event in pod_events(admin, scenario.NAMESPACE, name):
                message = str(event.get("message") or event.get("note") or "")
                if event.get("reason") == "FailedScheduling" and text in message:
                    return message
            return None

        eventually(reason, timeout_s=scenario.WAIT_S, what=f"{name}'s FailedScheduling event naming {text!r}")
    for name in ran["outcome"].unfit:
        pod = admin.get(f"/api/v1/namespaces/{scenario.NAMESPACE}/pods/{name}")
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    # The invalid request: the extender's answer names it for the one node kube-scheduler let through.
    pod = admin.get(f"/api/v1/namespaces/{scenario.NAMESPACE}/pods/invalid")
    answer = scenario.filter_once(ran["cluster"], pod, ["e2e-a100-mig"])
    assert "one MIG instance of one profile" in answer["FailedAndUnresolvableNodes"]["e2e-a100-mig"]


def test_32_simultaneous_connections_are_all_answered(ran: dict[str, Any]) -> None:
    assert ran["outcome"].connections == [200] * 32


def test_no_component_logged_an_error(ran: dict[str, Any]) -> None:
    assert scenario_figures.error_lines(ran["cluster"]) == []


def test_the_figures_are_written(ran: dict[str, Any]) -> None:
    written = json.loads(Path(ran["tmp"], "scenario-figures.json").read_text())
    assert written["agreement_rate"] == 1.0 and written["overcommit_samples"] == 0
    assert written["whole_pods_on_gpus_not_offered_whole"] == 0 and written["whole_pods_on_mixed_nodes"] >= 1
    assert written["filter_count"] > 0 and written["bind_count"] > 0
