"""The chart's queue controller (queue: in values.yaml), rendered by a real helm and checked without a cluster.

The rendered arguments are taken by the controller's own CLI and the controller then runs, from the
rendered ConfigMap, against the API server stand-in: every call it makes is mapped to the RBAC rule
it needs, and the rendered roles must grant exactly those. The dashboard's queries may name only
the metrics the controller's metrics module exports.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpunode.cluster.queuectl.cli import build_controller, register_queue_cli
from gpunode.cluster.queuectl.core import QueueCore
from gpunode.cluster.queuectl.metrics import QueueMetrics
from gpunode.cluster.queueing.config import load_queue_config
from gpunode.contract.names import (
    NODE_STATE_ANNOTATION,
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
)
from tests.cluster.queuectl.helpers import CONFIG_YAML, node, node_annotation, pod
from tests.deploy.test_helm_chart import (
    CHART,
    DEFAULTS,
    FULLNAME,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    Rendered,
    dashboard_queries,
    merged,
    metric_names,
    needs_helm,
    render,
    run_helm,
)
from tests.fakes.apiserver import ApiServerStandIn

NAME = f"{FULLNAME}-queue"
EXAMPLE = CHART.parents[1] / "gpunode" / "examples" / "queues.yaml"
QUEUE_DASHBOARD = CHART / "dashboards" / "gpunode-queue.json"
ON, HA = VALUE_SETS["queue-on"], VALUE_SETS["queue-ha"]
WAIT_S = 60.0


def queue_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpunode")
    register_queue_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def container(out: Rendered) -> dict[str, Any]:
    (c,) = out.named("Deployment", NAME)["spec"]["template"]["spec"]["containers"]
    return dict(c)


def mounted_key(out: Rendered, deployment: str, tmp_path: Path) -> Path:
    """The file --admission-key-file names in `deployment`, checked to be the mounted Secret
    <fullname>-queue-admission-key (read-only) and written, from the rendered Secret, under tmp_path."""
    pod_spec = out.named("Deployment", deployment)["spec"]["template"]["spec"]
    (c,) = pod_spec["containers"]
    path = Path(c["args"][c["args"].index("--admission-key-file") + 1])
    (mount,) = [m for m in c["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    assert mount["readOnly"] is True and "subPath" not in mount
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    secret = out.named("Secret", f"{NAME}-admission-key")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    local = tmp_path / f"{deployment}-{path.name}"
    local.write_bytes(base64.b64decode(secret["data"][path.name]))
    return local


def queue_docs(out: Rendered) -> list[tuple[str, str]]:
    return [(d["kind"], d["metadata"]["name"]) for d in out.docs if "-queue" in d["metadata"]["name"]]


# -- rendering ----------------------------------------------------------------------------------


@needs_helm
def test_the_queue_controller_is_off_by_default() -> None:
    assert queue_docs(render({})) == []
    assert DEFAULTS["queue"]["enabled"] is False


@needs_helm
@pytest.mark.parametrize(("values", "replicas"), [(ON, 1), (HA, 2)], ids=["single", "ha"])
def test_deployment_runs_gpunode_queue_with_the_mounted_configuration(
    values: dict[str, Any], replicas: int, tmp_path: Path
) -> None:
    out = render(values)
    deployment = out.named("Deployment", NAME)
    spec = deployment["spec"]
    assert spec["replicas"] == replicas
    # Without leader election a rollout must not overlap two acting controllers.
    assert spec.get("strategy") == (None if replicas > 1 else {"type": "Recreate"})
    c = container(out)
    assert c["command"] == ["gpunode"] and c["args"][0] == "queue"
    parsed = queue_parser().parse_args(c["args"])  # the controller's own CLI takes every argument
    assert parsed.leader_elect is (replicas > 1)
    if parsed.leader_elect:
        assert (parsed.leader_elect_namespace, parsed.leader_elect_lease_name) == (NAMESPACE, NAME)
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
        assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    # The ConfigMap is mounted as a directory (a subPath mount never sees the kubelet's updates).
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "config"]
    assert "subPath" not in mount and mount["readOnly"] is True
    assert Path(mount["mountPath"]) == parsed.config.parent
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    cm_name = volumes[mount["name"]]["configMap"]["name"]
    data = out.named("ConfigMap", cm_name)["data"]
    assert set(data) == {parsed.config.name}
    (tmp_path / parsed.config.name).write_text(data[parsed.config.name])
    parsed.config = tmp_path / parsed.config.name
    parsed.kube_api = "https://127.0.0.1:1"
    parsed.admission_key_file = mounted_key(out, NAME, tmp_path)
    ctl = build_controller(parsed)  # the rendered configuration is one the controller accepts
    assert ctl.core.mark_key is not None  # its admission marks are signed
    assert ctl.core.config.leaves == ("team-a", "team-b", "team-c", "team-d")
    assert (ctl.reload_s, ctl.resync_s, ctl.core.memory_unit_bytes) == (10.0, 30.0, 2**30)
    # The fair-share usage is saved to the one ConfigMap its Role names, in the release namespace.
    assert ctl.usage is not None and ctl.usage.every_s == 30.0
    assert (ctl.usage.store.namespace, ctl.usage.store.name) == (NAMESPACE, f"{NAME}-usage")
    # Probes and the Service point at the metrics port, where /healthz answers.
    port = DEFAULTS["queue"]["metricsPort"]
    assert parsed.metrics_listen == f"0.0.0.0:{port}"
    assert c["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    service = out.named("Service", f"{NAME}-metrics")
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    # Hardened like the extender.
    assert c["securityContext"] == DEFAULTS["extender"]["securityContext"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["runAsNonRoot"]


@needs_helm
def test_network_policy_opens_the_metrics_port_only() -> None:
    single = render(ON).named("NetworkPolicy", NAME)["spec"]
    assert single["policyTypes"] == ["Ingress"]
    assert single["ingress"] == [{"ports": [{"port": 9403, "protocol": "TCP"}]}]
    peers = render(HA).named("NetworkPolicy", NAME)["spec"]["ingress"]
    assert peers[0]["from"] == HA["queue"]["networkPolicy"]["metricsFrom"]
    off = render(merged(ON, {"queue": {"networkPolicy": {"enabled": False}}}))
    assert ("NetworkPolicy", NAME) not in queue_docs(off)


@needs_helm
def test_service_monitor_only_with_the_charts_service_monitor() -> None:
    assert ("ServiceMonitor", NAME) not in queue_docs(render(ON))
    monitor = render(HA).named("ServiceMonitor", NAME)["spec"]
    assert monitor["endpoints"][0]["port"] == "metrics" and monitor["endpoints"][0]["path"] == "/metrics"
    pod_labels = render(HA).named("Deployment", NAME)["spec"]["template"]["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()


@needs_helm
def test_the_configmap_holds_the_example_by_default_and_any_given_configuration(tmp_path: Path) -> None:
    default = render(ON).named("ConfigMap", f"{NAME}-config")["data"]["queues.yaml"]
    assert default.strip() == EXAMPLE.read_text().strip()
    path = tmp_path / "queues.yaml"
    path.write_text(default)
    assert load_queue_config(path).leaves == load_queue_config(EXAMPLE).leaves
    custom = CONFIG_YAML + "namespaces: {research: team-b}\n"
    given = render(merged(ON, {"queue": {"config": custom}})).named("ConfigMap", f"{NAME}-config")
    path.write_text(given["data"]["queues.yaml"])
    cfg = load_queue_config(path)
    assert cfg.leaves == ("team-a", "team-b") and cfg.namespaces == {"research": "team-b"}


INVALID = {
    "replicas-as-string": ({"queue": {"replicas": "2"}}, "queue.replicas: Invalid type. Expected: integer"),
    "misspelt-key": ({"queue": {"enabeld": True}}, "Additional property enabeld is not allowed"),
    "config-as-mapping": ({"queue": {"config": {"queues": []}}}, "queue.config: Invalid type. Expected: string"),
    "empty-config": ({"queue": {"config": ""}}, "queue.config: String length must be greater than or equal to 1"),
    "zero-reload": ({"queue": {"configReload": "0s"}}, "queue.configReload: Does not match pattern"),
    "lease-as-number": ({"queue": {"ha": {"enabled": True, "leaseDuration": 15}}},
                        "queue.ha.leaseDuration: Invalid type. Expected: string"),
    "port-out-of-range": ({"queue": {"metricsPort": 70000}}, "queue.metricsPort: Must be less than or equal to 65535"),
    "network-peers-not-a-list": ({"queue": {"networkPolicy": {"metricsFrom": {"podSelector": {}}}}},
                                 "queue.networkPolicy.metricsFrom: Invalid type. Expected: array"),
    "unknown-hold": ({"extender": {"queueHold": "ignore"}}, "extender.queueHold: extender.queueHold must be one of"),
    "guard-namespace-not-a-name": ({"queue": {"priorityGuard": {"namespaces": ["Team_A"]}}},
                                   "queue.priorityGuard.namespaces.0: Does not match pattern"),
    "guard-class-not-a-name": ({"queue": {"priorityGuard": {"priorityClasses": ["high priority"]}}},
                               "queue.priorityGuard.priorityClasses.0: Does not match pattern"),
    "guard-classes-not-a-list": ({"queue": {"priorityGuard": {"priorityClasses": "high"}}},
                                 "queue.priorityGuard.priorityClasses: Invalid type. Expected: array"),
    "guard-namespace-twice": ({"queue": {"priorityGuard": {"namespaces": ["ml", "ml"]}}},
                              "queue.priorityGuard.namespaces: array items[0,1] must be unique"),
    "guard-misspelt-key": ({"queue": {"priorityGuard": {"namespace": ["ml"]}}},
                           "queue.priorityGuard: Additional property namespace is not allowed"),
}  # fmt: skip


@needs_helm
@pytest.mark.parametrize(("values", "message"), INVALID.values(), ids=INVALID.keys())
def test_the_schema_refuses_bad_queue_values(values: dict[str, Any], message: str) -> None:
    proc = run_helm("template", RELEASE, values=values)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


REFUSED = {
    "replicas-without-ha": ({"queue": {"enabled": True, "replicas": 2}},
                            "queue.replicas is 2 but queue.ha.enabled is false"),
    "config-not-yaml": ({"queue": {"enabled": True, "config": "queues: [\n"}}, "queue.config is not a queue configuration"),
    "config-without-queues": ({"queue": {"enabled": True, "config": "fairShare: {}\n"}},
                              "queue.config is not a queue configuration"),
    # kube-scheduler skips an ignorable extender's Error: every held pod would be scheduled past the queue
    "ignorable-hold-error": ({"queue": {"enabled": True}, "extender": {"enabled": True, "ignorable": True}},
                             "extender.ignorable is true with queue.enabled and extender.queueHold error"),
    # one list of the priority guard without the other would guard nothing
    "guard-without-classes": ({"queue": {"enabled": True, "priorityGuard": {"namespaces": ["ml"]}}},
                              "queue.priorityGuard.namespaces is set but queue.priorityGuard.priorityClasses is empty"),
    "guard-without-namespaces": ({"queue": {"enabled": True, "priorityGuard": {"priorityClasses": ["high"]}}},
                                 "queue.priorityGuard.priorityClasses is set but queue.priorityGuard.namespaces is empty"),
}  # fmt: skip


@needs_helm
@pytest.mark.parametrize(("values", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_contradicting_queue_values_fail_with_a_hint(values: dict[str, Any], message: str) -> None:
    proc = run_helm("template", RELEASE, values=values)
    assert proc.returncode != 0
    assert message in proc.stderr and "HINT:" in proc.stderr, proc.stderr


# -- the priority guard ------------------------------------------------------------------------------

GUARD = f"{FULLNAME}-queue-priority-guard"


def guard_quotas(
    namespaces: list[str], classes: list[str], *, enabled: bool = True
) -> dict[str, dict[str, Any]]:
    """The ResourceQuotas the chart renders for this guard, by namespace."""
    values = {
        "queue": {"enabled": enabled, "priorityGuard": {"namespaces": namespaces, "priorityClasses": classes}}
    }
    quotas = render(merged(ON, values)).kinds("ResourceQuota")
    return {q["metadata"]["namespace"]: q for q in quotas}


@needs_helm
def test_the_priority_guard_is_one_quota_per_namespace_refusing_every_pod_of_the_classes() -> None:
    assert DEFAULTS["queue"]["priorityGuard"] == {"namespaces": [], "priorityClasses": []}
    assert render(ON).kinds("ResourceQuota") == []  # both lists empty (the default): no guard
    quotas = guard_quotas(["ml", "team-b"], ["high", "system-cluster-critical"])
    assert set(quotas) == {"ml", "team-b"}
    deployment_labels = render(ON).named("Deployment", NAME)["metadata"]["labels"]
    for quota in quotas.values():
        assert quota["apiVersion"] == "v1" and quota["metadata"]["name"] == GUARD
        assert quota["metadata"]["labels"] == deployment_labels  # the chart's labels, as the controller's
        assert quota["spec"] == {
            "hard": {"pods": "0"},
            "scopeSelector": {
                "matchExpressions": [
                    {
                        "scopeName": "PriorityClass",
                        "operator": "In",
                        "values": ["high", "system-cluster-critical"],
                    }
                ]
            },
        }
    # without the queue controller there is no queue to guard
    assert guard_quotas(["ml"], ["high"], enabled=False) == {}


# -- RBAC: exactly the calls the controller makes ---------------------------------------------------------

CORE_PATHS = [
    (re.compile(r"^/api/v1/(pods|nodes)$"), None),
    (re.compile(r"^/api/v1/namespaces/[^/]+/pods/[^/]+$"), "pods"),
    (re.compile(r"^/api/v1/namespaces/[^/]+/pods/[^/]+/eviction$"), "pods/eviction"),
    (re.compile(r"^/api/v1/namespaces/[^/]+/events$"), "events"),
]
WORKLOAD_PATHS = [  # Jobs, JobSets (patched when governed ones exist) and PriorityClasses
    (re.compile(r"^/apis/(batch)/v1/(jobs)$"), False),
    (re.compile(r"^/apis/(jobset\.x-k8s\.io)/v1alpha2/(jobsets)$"), False),
    (re.compile(r"^/apis/(scheduling\.k8s\.io)/v1/(priorityclasses)$"), False),
    (re.compile(r"^/apis/(resource\.k8s\.io)/v1/(resourceclaims)$"), False),
    (re.compile(r"^/apis/(batch)/v1/namespaces/[^/]+/(jobs)/[^/]+$"), True),
    (re.compile(r"^/apis/(jobset\.x-k8s\.io)/v1alpha2/namespaces/[^/]+/(jobsets)/[^/]+$"), True),
]
# Granted for governed Jobs and JobSets, which the stand-in here does not serve (the controller lists them,
# is answered 404 and so never watches): the real API server enforces them with the chart's rules in
# tests/e2e/test_queue_jobs.py (watches, admission by resuming, suspension, the condition).
WORKLOAD_WRITES = {
    ("batch", "jobs", "watch"),
    ("batch", "jobs", "patch"),
    ("batch", "jobs/status", "patch"),
    ("jobset.x-k8s.io", "jobsets", "watch"),
    ("jobset.x-k8s.io", "jobsets", "patch"),
    ("scheduling.k8s.io", "priorityclasses", "watch"),
    ("resource.k8s.io", "resourceclaims", "watch"),
}
LEASES = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?$")
CONFIGMAPS = re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps(?:/([^/]+))?$")
VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def rbac_of(method: str, path: str, query: Mapping[str, str]) -> tuple[str, str, str, str | None]:
    """(group, resource, verb, lease name) that one request needs; AssertionError for one unforeseen."""
    read = "watch" if query.get("watch") == "true" else "list"
    for pattern, resource in CORE_PATHS:
        if m := pattern.match(path):
            if resource is None:
                return "", m.group(1), read if method == "GET" else VERBS[method], None
            return "", resource, "get" if method == "GET" else VERBS[method], None
    if m := LEASES.match(path):
        assert m.group(1) == NAMESPACE, path
        return "coordination.k8s.io", "leases", "get" if method == "GET" else VERBS[method], m.group(2)
    for pattern, one in WORKLOAD_PATHS:
        if m := pattern.match(path):
            return (
                m.group(1),
                m.group(2),
                ("get" if one else read) if method == "GET" else VERBS[method],
                None,
            )
    if m := CONFIGMAPS.match(path):
        assert m.group(1) == NAMESPACE, path
        return "", "configmaps", "get" if method == "GET" else VERBS[method], m.group(2)
    raise AssertionError(f"the controller made a call no rule here covers: {method} {path}")


def usage_rules(out: Rendered) -> set[tuple[str, str | None]]:
    """(verb, ConfigMap name or None for any) granted by the usage Role."""
    role = out.named("Role", f"{NAME}-usage")
    assert role["metadata"]["namespace"] == NAMESPACE
    rules = set()
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""] and rule["resources"] == ["configmaps"], rule
        for verb in rule["verbs"]:
            for name in rule.get("resourceNames") or [None]:
                rules.add((verb, name))
    return rules


def lease_rules(out: Rendered) -> set[tuple[str, str | None]]:
    """(verb, lease name or None for any) granted by the leader Role."""
    role = out.named("Role", f"{NAME}-leader")
    assert role["metadata"]["namespace"] == NAMESPACE
    rules = set()
    for rule in role["rules"]:
        assert rule["apiGroups"] == ["coordination.k8s.io"] and rule["resources"] == ["leases"], rule
        for verb in rule["verbs"]:
            for name in rule.get("resourceNames") or [None]:
                rules.add((verb, name))
    return rules


async def until(predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.05)
    assert predicate(), what


def annotation(api: ApiServerStandIn, name: str, key: str) -> str | None:
    with contextlib.suppress(KeyError):
        return (api.pod("ml", name)["metadata"].get("annotations") or {}).get(key)
    return None


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        yield server


@needs_helm
def test_rbac_grants_exactly_the_calls_the_controller_makes(api: ApiServerStandIn, tmp_path: Path) -> None:
    """Run the rendered controller through admission, reclaim with notice, eviction and leader
    election, then compare the rules its requests needed with the rendered roles, both ways."""
    out = render(merged(HA, {"queue": {"config": CONFIG_YAML}}))
    parsed = queue_parser().parse_args(container(out)["args"])
    (tmp_path / "queues.yaml").write_text(out.named("ConfigMap", f"{NAME}-config")["data"]["queues.yaml"])
    parsed.config, parsed.kube_api = tmp_path / "queues.yaml", api.url
    parsed.admission_key_file = mounted_key(out, NAME, tmp_path)  # a mounted Secret needs no API rights
    api.add_node("n1", annotations={NODE_STATE_ANNOTATION: node_annotation("n1", 8)})

    async def main() -> None:
        ctl = build_controller(parsed)
        ctl.settle_s = 0.05
        task = asyncio.create_task(ctl.run())
        try:
            api.put_pod(pod("a0", gpus=4, created="2026-01-01T00:00:00Z"))
            api.put_pod(pod("a1", gpus=4, created="2026-01-01T00:00:01Z"))  # borrowed
            await until(
                lambda: all(annotation(api, n, QUEUE_ADMITTED_ANNOTATION) for n in ("a0", "a1")), "admitted"
            )
            api.put_pod(pod("b0", queue="team-b", gpus=4))  # reclaims: a notice, then an eviction
            await until(
                lambda: any(annotation(api, n, PREEMPTION_NOTICE_ANNOTATION) for n in ("a0", "a1")), "notice"
            )
            await until(lambda: bool(api.evictions()), "eviction")
            await until(lambda: bool(annotation(api, "b0", QUEUE_ADMITTED_ANNOTATION)), "preemptor admitted")
            await until(lambda: bool(api.requests("PUT", r"/leases/")), "lease renewed")
        finally:
            task.cancel()  # as SIGTERM: the usage is saved once more (and, the first time, created)
            await asyncio.gather(task, return_exceptions=True)
            await ctl.client.close()

    asyncio.run(main())
    needed = {rbac_of(r.method, r.path, r.query) for r in api.requests()}
    in_namespace = {(verb, name) for group, res, verb, name in needed if res == "configmaps"}
    assert {verb for verb, _ in in_namespace} == {"get", "update", "create"}
    granted_usage = usage_rules(out)
    for verb, name in in_namespace:  # create names no object in its URL: a Role cannot restrict it by name
        assert (verb, None) in granted_usage or (verb, name) in granted_usage, (verb, name)
    assert granted_usage == {("create", None), ("get", f"{NAME}-usage"), ("update", f"{NAME}-usage")}
    usage_binding = out.named("RoleBinding", f"{NAME}-usage")
    assert usage_binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
    assert usage_binding["roleRef"]["name"] == f"{NAME}-usage"
    needed = {n for n in needed if n[1] != "configmaps"}
    cluster = {(group, res, verb) for group, res, verb, _ in needed if group != "coordination.k8s.io"}
    granted_cluster = granted_by_group(out, NAME)
    assert cluster <= granted_cluster, sorted(cluster - granted_cluster)
    assert granted_cluster - cluster == WORKLOAD_WRITES, sorted(granted_cluster - cluster)
    assert cluster == {("", "pods", "list"), ("", "pods", "watch"), ("", "pods", "patch"),
                       ("", "pods/eviction", "create"), ("", "events", "create"), ("", "nodes", "list"),
                       ("", "nodes", "watch"), ("batch", "jobs", "list"), ("jobset.x-k8s.io", "jobsets", "list"),
                       ("scheduling.k8s.io", "priorityclasses", "list"),
                       ("resource.k8s.io", "resourceclaims", "list")}  # fmt: skip
    leases = {(verb, name) for group, _, verb, name in needed if group == "coordination.k8s.io"}
    assert {verb for verb, _ in leases} == {"get", "create", "update"}
    granted_leases = lease_rules(out)
    for verb, name in leases:  # create names no object in its URL: a Role cannot restrict it by name
        assert (verb, None) in granted_leases or (verb, name) in granted_leases, (verb, name)
    assert granted_leases == {("create", None), ("get", NAME), ("update", NAME)}
    binding = out.named("RoleBinding", f"{NAME}-leader")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
    cluster_binding = out.named("ClusterRoleBinding", NAME)
    assert cluster_binding["roleRef"]["name"] == NAME and cluster_binding["subjects"][0]["name"] == NAME


def granted_by_group(out: Rendered, role: str) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) the ClusterRole grants; no wildcard."""
    (cluster_role,) = [r for r in out.kinds("ClusterRole") if r["metadata"]["name"] == role]
    result = set()
    for rule in cluster_role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], (
            rule
        )
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                result.update((group, res, verb) for verb in rule["verbs"])
    return result


def test_an_unforeseen_call_is_not_passed_over() -> None:
    with pytest.raises(AssertionError, match="no rule here covers: DELETE"):
        rbac_of("DELETE", "/api/v1/namespaces/ml/pods/a0/status", {})
    assert rbac_of("GET", "/api/v1/pods", {"watch": "true"}) == ("", "pods", "watch", None)


@needs_helm
def test_without_ha_there_is_no_lease_role_and_without_rbac_create_no_roles() -> None:
    single = render(ON)
    assert ("Role", f"{NAME}-leader") not in queue_docs(single)
    assert usage_rules(single) == usage_rules(render(HA))  # a restart needs the saved usage too
    assert {res for _, res, _ in granted_by_group(single, NAME)} == {
        "pods", "pods/eviction", "events", "nodes", "jobs", "jobs/status", "jobsets", "priorityclasses",
        "resourceclaims",
    }  # fmt: skip
    bare = render(merged(HA, {"rbac": {"create": False}}))
    assert [k for k, _ in queue_docs(bare) if k.endswith(("Role", "RoleBinding"))] == []
    assert ("ServiceAccount", NAME) in queue_docs(bare)


# -- the dashboard ---------------------------------------------------------------------------------


def exported_metrics() -> set[str]:
    """Every sample name the controller's metrics module exports, with each family populated."""
    core = QueueCore(load_queue_config(EXAMPLE))
    core.node_changed(node("n1", 8))
    core.reconcile(1000.0)  # a Scheduler: fair shares exist
    metrics = QueueMetrics(lambda: core, lambda: True)
    metrics.wait.labels("team-a").observe(3.0)
    metrics.preemptions.labels("team-a", "reclaim").inc()
    metrics.admissions.labels("team-a").inc()
    metrics.api_errors.labels("evict").inc()
    metrics.config_refused.inc()
    metrics.usage_saves.labels("saved").inc()
    metrics.usage_loads.labels("loaded").inc()
    names = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        assert family.samples, f"{family.name} exported no sample: populate it here"
        names |= {s.name for s in family.samples}
    return names


def unknown_metrics(dashboard: Mapping[str, Any], exported: set[str]) -> list[str]:
    """One line per query naming a metric the controller does not export (or naming none)."""
    problems = []
    for where, expr in dashboard_queries(dashboard):
        names = metric_names(expr)
        if not names or names - exported:
            problems.append(f"{where}: {sorted(names - exported) or 'no metric'}")
    return problems


def test_the_queue_dashboard_queries_only_metrics_the_controller_exports() -> None:
    exported = exported_metrics()
    assert {
        "gpunode_queue_pending_jobs",
        "gpunode_queue_wait_seconds_bucket",
        "gpunode_queue_preemptions_total",
    } <= exported
    dashboard = json.loads(QUEUE_DASHBOARD.read_text())
    assert unknown_metrics(dashboard, exported) == []
    used = set().union(*(metric_names(e) for _, e in dashboard_queries(dashboard)))
    assert {"gpunode_queue_pending_jobs", "gpunode_queue_admitted_jobs", "gpunode_queue_gpus_used",
            "gpunode_queue_gpus_guarantee", "gpunode_queue_gpus_fair_share", "gpunode_queue_wait_seconds_bucket",
            "gpunode_queue_preemptions_total"} <= used  # fmt: skip
    quantiles = [e for _, e in dashboard_queries(dashboard) if "histogram_quantile" in e]
    assert len(quantiles) >= 3 and all("gpunode_queue_wait_seconds_bucket" in e for e in quantiles)
    preemptions = [e for _, e in dashboard_queries(dashboard) if "gpunode_queue_preemptions_total" in e]
    assert preemptions and all("reason" in e for e in preemptions)


def test_the_dashboard_check_finds_a_metric_the_controller_does_not_export() -> None:
    exported = exported_metrics()
    text = QUEUE_DASHBOARD.read_text().replace(
        "gpunode_queue_pending_jobs", "gpunode_queue_pending_jobs_total"
    )
    problems = unknown_metrics(json.loads(text), exported)
    assert problems and all("gpunode_queue_pending_jobs_total" in p for p in problems)


def test_the_queue_dashboard_layout_and_variables() -> None:
    dashboard = json.loads(QUEUE_DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["targets"] and all(t["datasource"] == p["datasource"] for t in p["targets"])
    defined = {v["name"] for v in dashboard["templating"]["list"]} | {"__range", "__rate_interval"}
    referenced = set(re.findall(r"\$\{?(\w+)", QUEUE_DASHBOARD.read_text()))
    assert referenced <= defined, referenced - defined
    assert dashboard["uid"] != json.loads((CHART / "dashboards" / "gpunode.json").read_text())["uid"]


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool is missing (Debian package prometheus)"
)
def test_the_queue_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    rules = []
    for i, (_, expr) in enumerate(dashboard_queries(json.loads(QUEUE_DASHBOARD.read_text()))):
        if expr.startswith("label_values("):
            continue
        for var, value in (("$__rate_interval", "1m"), ("$__range", "6h"), ("$queue", ".*")):
            expr = expr.replace(var, value)
        rules.append({"record": f"gpunode:queue_dashboard:{i}", "expr": expr})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_helm
def test_the_queue_dashboard_configmap_beside_the_gpu_one() -> None:
    out = render(HA)
    cm = out.named("ConfigMap", f"{FULLNAME}-queue-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["gpunode-queue.json"]) == json.loads(QUEUE_DASHBOARD.read_text())
    assert out.named("ConfigMap", f"{FULLNAME}-dashboard")  # the GPU one, beside it
    # Only with both the dashboard and the controller on.
    assert ("ConfigMap", f"{FULLNAME}-queue-dashboard") not in queue_docs(render(VALUE_SETS["dashboard-on"]))
    assert ("ConfigMap", f"{FULLNAME}-queue-dashboard") not in queue_docs(render(ON))


@needs_helm
def test_the_extender_reads_the_queue_file_to_hold_the_namespaces_it_maps(tmp_path: Path) -> None:
    from gpunode.cluster.extender.cli import build_extender
    from tests.deploy.test_helm_chart import extender_parser

    out = render(
        merged(
            HA,
            {
                "extender": {"enabled": True},
                "queue": {"config": CONFIG_YAML + "namespaces: {research: team-b}\n"},
            },
        )
    )
    (ext,) = out.named("Deployment", f"{FULLNAME}-extender")["spec"]["template"]["spec"]["containers"]
    queue_args = queue_parser().parse_args(container(out)["args"])
    args = ext["args"]
    assert (
        Path(args[args.index("--queue-config") + 1]) == queue_args.config
    )  # the same file as the controller
    (mount,) = [m for m in ext["volumeMounts"] if m["name"] == "queue-config"]
    assert Path(mount["mountPath"]) == queue_args.config.parent and "subPath" not in mount
    volumes = out.named("Deployment", f"{FULLNAME}-extender")["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == "queue-config"]
    data = out.named("ConfigMap", volume["configMap"]["name"])["data"]
    (tmp_path / "queues.yaml").write_text(data["queues.yaml"])
    parsed = extender_parser().parse_args(args)
    parsed.queue_config = tmp_path / "queues.yaml"
    parsed.admission_key_file = mounted_key(out, f"{FULLNAME}-extender", tmp_path)
    extender, _ = build_extender(parsed)
    # the extender checks marks with the key the controller signs them with: the same Secret
    assert extender.mark_key is not None
    assert parsed.admission_key_file.read_bytes() == mounted_key(out, NAME, tmp_path).read_bytes()
    assert extender.config.queue_hold == "error"  # the chart's default: no preemption on any version
    research = pod("r0", queue=None, namespace="research")
    assert extender.queue_namespaces() == {"research": "team-b"}
    assert pod("x", queue=None)["metadata"]["namespace"] not in extender.queue_namespaces()
    assert research["metadata"]["namespace"] in extender.queue_namespaces()
    # Without the queue controller the extender is started as before.
    alone = render({"extender": {"enabled": True}})
    (plain,) = alone.named("Deployment", f"{FULLNAME}-extender")["spec"]["template"]["spec"]["containers"]
    mounts = [m["name"] for m in plain.get("volumeMounts", [])]
    assert "--queue-config" not in plain["args"] and mounts == ["tls"]  # the extender's own TLS only
    assert "--admission-key-file" not in plain["args"]
    assert not [s for s in alone.kinds("Secret") if "admission" in s["metadata"]["name"]]
    assert "--queue-hold" not in plain["args"]


@needs_helm
def test_the_admission_key_is_one_secret_mounted_in_the_controller_and_the_extender(tmp_path: Path) -> None:
    from gpunode.cluster.extender.cli import build_extender
    from gpunode.cluster.queuemark import MIN_KEY_BYTES
    from tests.deploy.test_helm_chart import extender_parser

    out = render(merged(ON, {"extender": {"enabled": True}}))
    secret = out.named("Secret", f"{NAME}-admission-key")
    assert secret["type"] == "Opaque" and set(secret["data"]) == {"key"}
    key = base64.b64decode(secret["data"]["key"])
    assert len(key) == 64 >= MIN_KEY_BYTES and key.isalnum()  # randAlphaNum 64: about 380 bits
    # no cluster to look the Secret up in: each render makes a fresh key (an upgrade keeps the existing one)
    assert base64.b64decode(render(ON).named("Secret", f"{NAME}-admission-key")["data"]["key"]) != key
    controller_file = mounted_key(out, NAME, tmp_path)
    extender_file = mounted_key(out, f"{FULLNAME}-extender", tmp_path)
    assert controller_file.read_bytes() == extender_file.read_bytes() == key
    # what the controller signs with its file, the extender accepts with its own
    parsed = queue_parser().parse_args(container(out)["args"])
    parsed.config, parsed.kube_api = tmp_path / "queues.yaml", "https://127.0.0.1:1"
    parsed.config.write_text(CONFIG_YAML)
    parsed.admission_key_file = controller_file
    signer = build_controller(parsed).core.mark_key
    (ext,) = out.named("Deployment", f"{FULLNAME}-extender")["spec"]["template"]["spec"]["containers"]
    ext_args = extender_parser().parse_args(ext["args"])
    ext_args.queue_config, ext_args.admission_key_file = None, extender_file
    checker = build_extender(ext_args)[0].mark_key
    assert signer is not None and checker is not None
    fields = {"job": "ml/a", "uid": "u", "node": "n1", "gpus": [], "at": "2026-01-01T00:00:00Z"}
    assert checker.verify({**fields, "sig": signer.sign(fields)})
    # the queue off: no Secret, no flag
    assert not [d for d in render({"extender": {"enabled": True}}).kinds("Secret") if "admission" in str(d)]


@needs_helm
def test_the_hold_mode_reaches_the_extender_and_unschedulable_may_be_ignorable(tmp_path: Path) -> None:
    from gpunode.cluster.extender.cli import build_extender
    from tests.deploy.test_helm_chart import extender_parser

    values = {"extender": {"enabled": True, "ignorable": True, "queueHold": "unschedulable"}}
    out = render(merged(ON, values))
    (ext,) = out.named("Deployment", f"{FULLNAME}-extender")["spec"]["template"]["spec"]["containers"]
    args = ext["args"]
    assert args[args.index("--queue-hold") + 1] == "unschedulable"
    parsed = extender_parser().parse_args(args)
    parsed.queue_config = None  # the mounted file is not here; the flag is what is checked
    parsed.admission_key_file = mounted_key(out, f"{FULLNAME}-extender", tmp_path)
    assert build_extender(parsed)[0].config.queue_hold == "unschedulable"
