"""The scenario's figures: agreement between the extender's assignments and what the nodes allocated,
whole-GPU pods on mixed nodes, the extender's latencies from its access log, and the components' error
lines (tests/e2e/scenario.py runs the scenario; test_scenario.py and bench/e2e_scenario.py read these).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from gpunode.contract.names import (
    ALLOCATED_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    GPU_RESOURCE,
    NODE_STATE_ANNOTATION,
)
from gpunode.contract.nodestate import decode
from tests.e2e.scenario import NAMESPACE, TEST_SOURCE, Cluster, Outcome
from tests.e2e.scenario_realnode import REAL_PODS, kubelet_error_lines, visible_devices

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
    agree, compared, differ = agreement(cluster, outcome)
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
        "disagreeing_pods": differ,
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
