"""The Helm chart (helm/gpunode), rendered by a real helm and checked without a cluster.

Every rendered document of the core kinds goes through the kubernetes client's typed models and
back, so a wrong type, a missing required field or a misspelt field fails; the agent's rendered
configuration goes through gpunode's own parse_config; the probe paths are fetched from the real
metrics endpoint and the real extender server; the dashboard's queries are checked against the
names a real collection exports (and parsed by promtool when it is installed).

helm comes from scripts/get-helm.sh (.tools/bin/helm) or $GPUNODE_HELM; without it the tests that
need it skip, saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubernetes.client import ApiClient

from gpunode.cli import parse_args
from gpunode.config.agent import parse_config
from gpunode.config.metrics import parse_listen
from gpunode.node import memcap
from gpunode.node.devices.base import DeviceEvent, EventKind
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import build_inventory, region_key
from gpunode.node.metrics import MetricsCollector, MetricsServer

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "gpunode"
DASHBOARD = CHART / "dashboards" / "gpunode.json"
RELEASE, NAMESPACE = "gn", "gpu-system"
FULLNAME = "gn-gpunode"


def _helm_binary() -> Path | None:
    named = os.environ.get("GPUNODE_HELM")
    path = Path(named) if named else ROOT / ".tools" / "bin" / "helm"
    return path if path.is_file() and os.access(path, os.X_OK) else None


HELM = _helm_binary()
needs_helm = pytest.mark.skipif(
    HELM is None,
    reason="helm is not installed: run scripts/get-helm.sh (it installs .tools/bin/helm) or set GPUNODE_HELM",
)

# -- running helm ------------------------------------------------------------------------------


def run_helm(
    *args: str, values: Mapping[str, Any] | None = None, chart: Path = CHART
) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(dict(values or {}), f)
        f.flush()
        cmd = [str(HELM), *args, str(chart), "-f", f.name]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@dataclass(frozen=True)
class Rendered:
    docs: tuple[dict[str, Any], ...]

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.kinds(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def agent_config_text(self) -> str:
        return str(self.named("ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"])

    def daemonset(self) -> dict[str, Any]:
        return self.named("DaemonSet", f"{FULLNAME}-agent")


_cache: dict[str, Rendered] = {}


def render(values: Mapping[str, Any] | None = None) -> Rendered:
    key = json.dumps(values or {}, sort_keys=True)
    if key not in _cache:
        proc = run_helm("template", RELEASE, "--namespace", NAMESPACE, values=values)
        assert proc.returncode == 0, proc.stderr
        _cache[key] = Rendered(tuple(d for d in yaml.safe_load_all(proc.stdout) if d))
    return _cache[key]


def example(name: str) -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "gpunode" / "examples" / f"config-{name}.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's merge of user values over the chart's defaults (maps merge, the rest is replaced)."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


DEFAULTS: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())

# Value sets rendered by every test that takes a table: the chart's ci/*-values.yaml (each says
# what it is for) and the agent's example configurations as they are in gpunode/examples.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    **{
        p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text())
        for p in sorted((CHART / "ci").glob("*-values.yaml"))
    },
    "fractional-config": {"config": example("fractional"), "extender": {"enabled": True}},
    "time-slicing-config": {"config": example("timeslicing")},
    "mig-mixed-config": {"config": example("mig-mixed")},
    "whole-config": {"config": example("whole")},
}

# -- the typed models ----------------------------------------------------------------------------

TYPED = {
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Secret"): "V1Secret",
    ("v1", "Service"): "V1Service",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration"): "V1MutatingWebhookConfiguration",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): "V1ValidatingAdmissionPolicy",
    (
        "admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicyBinding",
    ): "V1ValidatingAdmissionPolicyBinding",
    ("resource.k8s.io/v1", "DeviceClass"): "V1DeviceClass",
}
STRUCTURAL = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}


def through_typed_model(doc: Mapping[str, Any]) -> Any:
    """The document as the kubernetes client's model sees it, serialized back (validation on)."""
    api = ApiClient()
    assert api.configuration.client_side_validation
    model = api._ApiClient__deserialize(dict(doc), TYPED[(doc["apiVersion"], doc["kind"])])  # type: ignore[attr-defined]
    return api.sanitize_for_serialization(model)


def test_typed_models_refuse_a_document_missing_a_required_field() -> None:
    broken = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "x"},
        "spec": {"template": {}},
    }
    with pytest.raises(Exception, match="selector"):
        through_typed_model(broken)


def test_typed_round_trip_notices_a_misspelt_field() -> None:
    doc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"clusterIp": "None"}}
    assert through_typed_model(doc) != doc


@needs_helm
def test_helm_lint_passes_strict() -> None:
    proc = run_helm("lint", "--strict", values={})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@needs_helm
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_document_is_a_valid_object(values: dict[str, Any]) -> None:
    out = render(values)
    assert run_helm("lint", "--strict", values=values).returncode == 0
    for doc in out.docs:
        key = (doc["apiVersion"], doc["kind"])
        assert key in TYPED or key in STRUCTURAL, f"unexpected {key}"
        if key in TYPED:
            assert through_typed_model(doc) == doc, (
                f"{doc['kind']} {doc['metadata']['name']} changed in the model"
            )
        ns = doc["metadata"].get("namespace")
        assert ns in (None, NAMESPACE), doc["metadata"]
    names = [(d["kind"], d["metadata"]["name"]) for d in out.docs]
    assert len(names) == len(set(names)), names


# -- the agent's configuration ---------------------------------------------------------------------


@needs_helm
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rendered_config_is_what_was_asked_and_the_agent_accepts_it(values: dict[str, Any]) -> None:
    out = render(values)
    text = out.agent_config_text()
    cfg = parse_config(yaml.safe_load(text), "config.yaml")
    chart = merged(DEFAULTS, values)
    paths, port = chart["agent"]["hostPaths"], chart["agent"]["metricsPort"]
    expected = merged(
        chart["config"],
        {
            "gpunode": {
                "kubeletDir": paths["devicePlugins"],
                "stateDir": paths["state"],
                "podResourcesSocket": f"{paths['podResources']}/kubelet.sock",
                "metrics": {"listen": f":{port}"},
            }
        },
    )
    if chart["agent"]["driverRoot"]:
        expected["flags"]["nvidiaDriverRoot"] = chart["agent"]["driverRoot"]
    assert yaml.safe_load(text) == expected  # nothing lost, nothing invented
    # What the agent will use matches what the DaemonSet mounts and exposes.
    container = out.daemonset()["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert str(cfg.kubelet_dir) == mounts["device-plugins"]["mountPath"]
    assert str(cfg.state_dir) == mounts["state"]["mountPath"]
    assert str(cfg.pod_resources_socket.parent) == mounts["pod-resources"]["mountPath"]
    assert parse_listen(cfg.metrics.listen, "listen").port == container["ports"][0]["containerPort"]


@needs_helm
def test_checksum_annotation_follows_the_config_and_only_the_config() -> None:
    def checksum(values: dict[str, Any]) -> str:
        out = render(values)
        value = out.daemonset()["spec"]["template"]["metadata"]["annotations"]["gpunode.io/config-checksum"]
        assert value == hashlib.sha256(out.agent_config_text().rstrip("\n").encode()).hexdigest()
        return str(value)

    base = checksum({})
    assert checksum({"config": {"flags": {"migStrategy": "mixed"}}}) != base
    assert checksum({"agent": {"metricsPort": 9500}}) != base  # the rendered listen address changes
    assert checksum({"agent": {"resources": {"limits": {"memory": "1Gi"}}}}) == base


# -- the DaemonSet ------------------------------------------------------------------------------------


@needs_helm
def test_daemonset_contract() -> None:
    out = render({})
    ds = out.daemonset()
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["hostPID"] is False
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["terminationGracePeriodSeconds"] == 30
    assert container["securityContext"]["privileged"] is True
    assert container["command"] + container["args"] == [
        "gpunode",
        "agent",
        "--config",
        "/etc/gpunode/config.yaml",
    ]
    parse_args(container["args"])  # the CLI takes these arguments
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["GPUNODE_CONFIG"]["value"] == "/etc/gpunode/config.yaml"
    assert container["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    probes = {p: container[p]["httpGet"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {"startupProbe": {"path": "/ready", "port": "metrics", "scheme": "HTTP"},
                      "livenessProbe": {"path": "/health", "port": "metrics", "scheme": "HTTP"},
                      "readinessProbe": {"path": "/ready", "port": "metrics", "scheme": "HTTP"}}  # fmt: skip
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    for name, host, read_only in (
        ("device-plugins", "/var/lib/kubelet/device-plugins", False),
        ("pod-resources", "/var/lib/kubelet/pod-resources", True),
        ("state", "/var/lib/gpunode", False),
        ("dev", "/dev", False),
    ):
        assert volumes[name]["hostPath"]["path"] == host
        assert mounts[name]["mountPath"] == host  # host paths handed to the kubelet are valid inside too
        assert mounts[name].get("readOnly", False) is read_only, name
    assert volumes["config"]["configMap"]["name"] == f"{FULLNAME}-config"
    assert mounts["config"] == {"name": "config", "mountPath": "/etc/gpunode", "readOnly": True}
    assert "driver-root" not in volumes and "hostNetwork" not in pod
    assert pod["serviceAccountName"] == f"{FULLNAME}-agent"
    assert out.named("ServiceAccount", f"{FULLNAME}-agent")


@needs_helm
@pytest.mark.parametrize(
    ("values", "check"),
    [
        pytest.param(VALUE_SETS["custom-node-selector"], lambda pod, c: pod["nodeSelector"] == {"example.com/gpu": "h100"}
                     and "tolerations" not in pod and pod["affinity"]["nodeAffinity"], id="custom-node-selector"),
        pytest.param(VALUE_SETS["privileged-off"], lambda pod, c: c["securityContext"] == {
            "privileged": False, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True} and pod["runtimeClassName"] == "nvidia"
            and "dev" not in {v["name"] for v in pod["volumes"]}, id="privileged-off"),
        pytest.param(VALUE_SETS["driver-container"], lambda pod, c: {"name": "driver-root", "hostPath": {
            "path": "/run/nvidia/driver", "type": "Directory"}} in pod["volumes"] and {
            "name": "driver-root", "mountPath": "/driver-root", "readOnly": True} in c["volumeMounts"]
            and any(e["name"] == "LD_LIBRARY_PATH" and "/driver-root/usr/lib" in e["value"] for e in c["env"]),
            id="driver-container"),
        pytest.param(VALUE_SETS["bare-metal-remediation"], lambda pod, c: pod["hostPID"] is True, id="bare-metal-hostpid"),
        pytest.param(VALUE_SETS["host-network"], lambda pod, c: pod["hostNetwork"] is True
                     and pod["dnsPolicy"] == "ClusterFirstWithHostNet", id="host-network"),
    ],
)  # fmt: skip
def test_daemonset_follows_its_values(values: dict[str, Any], check: Any) -> None:
    pod = render(values).daemonset()["spec"]["template"]["spec"]
    assert check(pod, pod["containers"][0])


@needs_helm
def test_metrics_service_selects_the_agents_and_carries_the_scrape_annotations() -> None:
    out = render({})
    svc = out.named("Service", f"{FULLNAME}-metrics")
    pod_labels = out.daemonset()["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 9400, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert svc["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9400",
        "prometheus.io/path": "/metrics",
    }


SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {"spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
        "properties": {
            "selector": {"type": "object", "required": ["matchLabels"], "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
            "namespaceSelector": {"type": "object", "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {"type": "object", "additionalProperties": False,
                "required": ["port"], "properties": {
                    "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                    "scheme": {"enum": ["http", "https"]}, "honorLabels": {"type": "boolean"},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "relabelings": {"type": "array", "items": {"type": "object", "properties": {
                        "action": {"enum": ["replace", "keep", "drop", "labeldrop", "labelkeep", "labelmap", "hashmod"]},
                        "regex": {"type": "string"}}}},
                    "metricRelabelings": {"type": "array"},
                    "tlsConfig": {"type": "object", "additionalProperties": False, "properties": {
                        "ca": {"type": "object"}, "cert": {"type": "object"}, "keySecret": {"type": "object"},
                        "serverName": {"type": "string"}, "insecureSkipVerify": {"type": "boolean"}}},
                    "basicAuth": {"type": "object", "additionalProperties": False, "properties": {
                        "username": {"type": "object", "required": ["name", "key"]},
                        "password": {"type": "object", "required": ["name", "key"]}}}}}}}}},
}  # fmt: skip


@needs_helm
def test_service_monitor_scrapes_the_metrics_service() -> None:
    out = render(VALUE_SETS["service-monitor-on"])
    (sm,) = out.kinds("ServiceMonitor")
    jsonschema.validate(sm, SERVICE_MONITOR_SCHEMA)
    svc = out.named("Service", f"{FULLNAME}-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "30s")
    assert sm["metadata"]["labels"]["release"] == "kps"
    assert {"action": "labeldrop", "regex": "(pod|namespace|container)"} in endpoint["relabelings"]
    assert not render({}).kinds("ServiceMonitor")


WEB_CONFIG_ON = {
    "agent": {"webConfig": {"secretName": "gpunode-web", "tls": True}},
    "serviceMonitor": {
        "enabled": True,
        "tlsConfig": {"ca": {"secret": {"name": "gpunode-web", "key": "ca.crt"}}, "serverName": "gpunode"},
        "basicAuth": {
            "username": {"name": "prom", "key": "user"},
            "password": {"name": "prom", "key": "pass"},
        },
    },
}


@needs_helm
@pytest.mark.parametrize("on", [False, True], ids=["web-config-off", "web-config-on"])
def test_web_config_mounts_the_secret_and_switches_probes_and_scrapes_to_https(on: bool) -> None:
    values = WEB_CONFIG_ON if on else {"serviceMonitor": {"enabled": True}}
    out = render(values)
    pod = out.daemonset()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse_args(container["args"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    schemes = {container[p]["httpGet"]["scheme"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    (sm,) = out.kinds("ServiceMonitor")
    jsonschema.validate(sm, SERVICE_MONITOR_SCHEMA)
    (endpoint,) = sm["spec"]["endpoints"]
    annotations = out.named("Service", f"{FULLNAME}-metrics")["metadata"]["annotations"]
    if not on:
        assert args.web_config_file is None and "web-config" not in volumes and "web-config" not in mounts
        assert schemes == {"HTTP"} and endpoint["scheme"] == "http"
        assert "tlsConfig" not in endpoint and "basicAuth" not in endpoint
        assert "prometheus.io/scheme" not in annotations
        return
    assert str(args.web_config_file) == "/etc/gpunode-web/web-config.yml"
    assert volumes["web-config"]["secret"] == {"secretName": "gpunode-web", "defaultMode": 0o400}
    assert mounts["web-config"] == {"name": "web-config", "mountPath": "/etc/gpunode-web", "readOnly": True}
    assert schemes == {"HTTPS"} and endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == WEB_CONFIG_ON["serviceMonitor"]["tlsConfig"]
    assert endpoint["basicAuth"] == WEB_CONFIG_ON["serviceMonitor"]["basicAuth"]
    assert annotations["prometheus.io/scheme"] == "https"


def test_the_probes_pass_on_an_endpoint_with_tls_auth_and_excluded_probe_paths(tmp_path: Path) -> None:
    """The configuration values.yaml recommends: the kubelet's HTTPS probes (no client certificate,
    no password, no server verification) reach /health and /ready; /metrics needs credentials."""
    import ssl

    import bcrypt

    from gpunode.config.webconfig import load_web_config
    from tests.shared.tls_files import make_tls_files

    tls = make_tls_files(tmp_path)
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()
    (tmp_path / "web-config.yml").write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"},
        "basic_auth_users": {"prometheus": hashed}, "auth_excluded_paths": ["/health", "/ready"]}))  # fmt: skip
    kubelet = ssl.create_default_context()
    kubelet.check_hostname, kubelet.verify_mode = False, ssl.CERT_NONE  # as kubelet HTTPS probes do

    def status(port: int, path: str) -> int:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", timeout=10, context=kubelet) as r:
                return int(r.status)
        except urllib.error.HTTPError as err:
            return err.code

    async def main() -> dict[str, int]:
        collector = MetricsCollector(backend=SimBackend.from_profile("t4"), hostname="n")
        await collector.collect_once()
        server = MetricsServer(
            collector, "127.0.0.1:0", web_config=load_web_config(tmp_path / "web-config.yml")
        )
        await server.start()
        try:
            return {
                p: await asyncio.to_thread(status, server.port, p) for p in ("/health", "/ready", "/metrics")
            }
        finally:
            await server.stop()

    assert asyncio.run(main()) == {"/health": 200, "/ready": 200, "/metrics": 401}
    assert tls.ca.exists()


# -- RBAC ------------------------------------------------------------------------------------------


def documented_agent_rules() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(always, only with deleteAfterDeadline) resource -> verbs, from the RBAC block of docs/health.md."""
    text = (ROOT / "docs" / "health.md").read_text()
    block = re.search(r"### RBAC.*?```yaml\n(.*?)```", text, re.S)
    assert block, "docs/health.md has no RBAC yaml block"
    head, marker, conditional = re.split(
        r"^(\s*# Only with deleteAfterDeadline.*)$", block.group(1), maxsplit=1, flags=re.M
    )
    assert marker

    def rules(part: str) -> dict[str, set[str]]:
        doc = yaml.safe_load(part if "rules:" in part else "rules:\n" + part)
        out: dict[str, set[str]] = {}
        for rule in doc["rules"] or []:
            assert rule["apiGroups"] == [""]
            for res in rule["resources"]:
                out.setdefault(res, set()).update(rule["verbs"])
        return out

    return rules(head), rules(conditional)


def granted(out: Rendered, role: str) -> dict[str, set[str]] | None:
    roles = [r for r in out.kinds("ClusterRole") if r["metadata"]["name"] == role]
    if not roles:
        return None
    result: dict[str, set[str]] = {}
    for rule in roles[0]["rules"]:
        # Core group only (gpunode/infra/kube/client.py posts Events to /api/v1, not events.k8s.io), but for
        # the DRA claims the extender watches (named "resourceclaims.resource.k8s.io" here).
        assert rule["apiGroups"] == [""] or rule == DRA_CLAIMS_RULE, rule
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        group = "." + rule["apiGroups"][0] if rule["apiGroups"] != [""] else ""
        for res in rule["resources"]:
            result.setdefault(res + group, set()).update(rule["verbs"])
    return result


DRA_CLAIMS_RULE = {
    "apiGroups": ["resource.k8s.io"],
    "resources": ["resourceclaims"],
    "verbs": ["list", "watch"],
}
CLAIMS = {"resourceclaims.resource.k8s.io": {"list", "watch"}}  # what DRA claims hold (extender/claims.py)


ALWAYS, WITH_DELETE = documented_agent_rules()
EVICT = {"pods": {"get"}, "pods/eviction": {"create"}, "events": {"create"}}
ASSIGNMENTS = {"list", "watch", "patch"}  # this node's pods, to carry out the extender's assignments

RBAC_CASES = {
    "documented-default": ({}, ALWAYS),
    "delete-after-deadline": ({"remediation": {"deleteAfterDeadline": True}},
                              merged(ALWAYS, {"pods": ALWAYS["pods"] | WITH_DELETE["pods"]})),
    "dry-run": ({"remediation": {"dryRun": True, "deleteAfterDeadline": True}},
                {"pods": {"get"} | ASSIGNMENTS, "events": {"create"}, "nodes": {"patch"}}),
    "no-events-no-annotation-no-publishing": ({"remediation": {"postEvents": False, "markNode": False},
                                               "nodeState": {"enabled": False}},
                                              {"pods": {"get"}, "pods/eviction": {"create"}}),
    "remediation-off": ({"remediation": {"mode": "off"}}, {"nodes": {"patch"}, "pods": ASSIGNMENTS}),
    "nothing-to-ask": ({"remediation": {"mode": "off"}, "nodeState": {"enabled": False}}, None),
    "idle-only": ({"remediation": {"mode": "off"}, "nodeState": {"enabled": False}, "idle": {"enabled": True}},
                  {"pods": {"get", "patch"}, "events": {"create"}}),
    "idle-off-asks-nothing": ({"remediation": {"mode": "off"}, "nodeState": {"enabled": False},
                               "idle": {"enabled": False, "for": "1h"}}, None),
}  # fmt: skip


@needs_helm
@pytest.mark.parametrize(("own", "expected"), RBAC_CASES.values(), ids=RBAC_CASES.keys())
def test_agent_cluster_role_grants_exactly_what_the_configuration_needs(
    own: dict[str, Any], expected: dict[str, set[str]] | None
) -> None:
    assert all(verbs <= ALWAYS.get(res, set()) for res, verbs in EVICT.items())  # the page says what we think
    assert ALWAYS["pods"] == {"get"} | ASSIGNMENTS
    assert WITH_DELETE["pods"] == {"delete"} and len(WITH_DELETE) == 1
    out = render({"config": {"gpunode": own}})
    assert granted(out, f"{FULLNAME}-agent") == expected
    bindings = [b for b in out.kinds("ClusterRoleBinding") if b["metadata"]["name"] == f"{FULLNAME}-agent"]
    token = out.daemonset()["spec"]["template"]["spec"]["automountServiceAccountToken"]
    assert token is (expected is not None)
    if expected is None:
        assert not bindings
        return
    (binding,) = bindings
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": f"{FULLNAME}-agent"}  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{FULLNAME}-agent", "namespace": NAMESPACE}
    ]


# -- the extender ----------------------------------------------------------------------------------


def extender_parser() -> argparse.ArgumentParser:
    from gpunode.cluster.extender.cli import register_extender_cli

    parser = argparse.ArgumentParser(prog="gpunode")
    register_extender_cli(parser.add_subparsers(dest="command", required=True))
    return parser


@needs_helm
@pytest.mark.parametrize(
    ("values", "api_rules"),
    [
        pytest.param(VALUE_SETS["extender-plain-http"], {"nodes": {"list"}, **CLAIMS}, id="plain-http-list-nodes"),
        pytest.param(VALUE_SETS["extender-on"], {"pods": {"get"}, **CLAIMS}, id="read-pods"),
        pytest.param(VALUE_SETS["extender-defaults"], {"nodes": {"list"}, "pods": {"get"}, **CLAIMS}, id="defaults"),
        pytest.param(VALUE_SETS["extender-bind-node-cache"],
                     {"pods": {"get", "patch"}, "pods/binding": {"create"}, "nodes": {"list"}, **CLAIMS},
                     id="bind-and-node-cache"),
        pytest.param(VALUE_SETS["extender-cert-manager"],
                     {"pods": {"get", "patch"}, "pods/binding": {"create"}, "nodes": {"list"}, **CLAIMS},
                     id="cert-manager"),
    ],
)  # fmt: skip
def test_extender_deployment_service_and_scheduler_configuration(
    values: dict[str, Any], api_rules: dict[str, set[str]] | None
) -> None:
    from gpunode.cluster.extender.cli import build_extender
    from gpunode.cluster.extender.server import ExtenderServer

    ext = merged(DEFAULTS, values)["extender"]
    out = render(values)
    name = f"{FULLNAME}-extender"
    pod = out.named("Deployment", name)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[:5] == ["extender", "--listen", "0.0.0.0:8888", "--policy", ext["policy"]]
    parsed = extender_parser().parse_args(args)  # the extender's own CLI takes every argument
    extender, api = build_extender(parsed)
    assert (api is not None) == (api_rules is not None) == pod["automountServiceAccountToken"]
    assert granted(out, name) == api_rules
    tls = ext["tls"]["enabled"]
    scheme = "https" if tls else "http"
    assert (extender.binder is not None) == ext["bind"]
    svc = out.named("Service", name)
    assert svc["spec"]["ports"] == [{"name": scheme, "port": 8888, "targetPort": scheme, "protocol": "TCP"}]
    assert container["ports"][0]["name"] == scheme
    assert (
        svc["spec"]["selector"].items()
        <= out.named("Deployment", name)["spec"]["template"]["metadata"]["labels"].items()
    )
    # The probes answer on the real extender server's plain-HTTP health port.
    assert container["ports"][1] == {"name": "health", "containerPort": 8889, "protocol": "TCP"}
    assert args[args.index("--health-listen") + 1] == "0.0.0.0:8889"
    server = ExtenderServer(extender, host="127.0.0.1", port=0, health_host="127.0.0.1", health_port=0)
    server.start()
    try:
        for probe in ("livenessProbe", "readinessProbe"):
            path = container[probe]["httpGet"]["path"]
            assert container[probe]["httpGet"]["port"] == "health"
            with urllib.request.urlopen(f"http://127.0.0.1:{server.health_port}{path}", timeout=10) as resp:
                assert resp.status == 200, probe
    finally:
        server.stop()
    sched = yaml.safe_load(
        out.named("ConfigMap", f"{FULLNAME}-scheduler-config")["data"]["scheduler-config.yaml"]
    )
    assert (sched["apiVersion"], sched["kind"]) == (
        "kubescheduler.config.k8s.io/v1",
        "KubeSchedulerConfiguration",
    )
    (entry,) = sched["extenders"]
    assert entry["urlPrefix"] == f"{scheme}://{name}.{NAMESPACE}.svc:8888"
    assert entry["enableHTTPS"] is tls
    assert sched["profiles"] == [{"schedulerName": n} for n in ext["schedulerNames"]]
    if tls:  # kube-scheduler presents the client certificate the extender asks for
        d = ext["tls"]["schedulerCertDir"]
        assert entry["tlsConfig"] == {
            "certFile": f"{d}/tls.crt",
            "keyFile": f"{d}/tls.key",
            "caFile": f"{d}/ca.crt",
        }
        assert parsed.client_ca_file is not None and parsed.tls_cert_file is not None
    else:
        assert "tlsConfig" not in entry and parsed.tls_cert_file is None
    assert (entry["filterVerb"], entry["prioritizeVerb"], entry["weight"]) == ("filter", "prioritize", 10)
    assert entry.get("bindVerb") == ("bind" if ext["bind"] else None)
    assert entry["preemptVerb"] == "preempt"  # kube-scheduler's own preemption asks: none for queued pods
    assert entry["nodeCacheCapable"] is ext["nodeCacheCapable"] and entry["ignorable"] is False
    assert entry["managedResources"] == [
        {"name": r, "ignoredByScheduler": False}
        for r in ["nvidia.com/gpu", "gpunode.io/gpu-memory", *ext["extraManagedResources"]]
    ]


@needs_helm
@pytest.mark.parametrize(
    "values",
    [
        VALUE_SETS["extender-plain-http"],
        VALUE_SETS["extender-defaults"],
        VALUE_SETS["extender-bind-node-cache"],
        VALUE_SETS["extender-cert-manager"],
    ],
    ids=["plain-http", "tls-generated", "tls-own-secret", "tls-cert-manager"],
)
def test_extender_network_policy_and_tls_certificates(values: dict[str, Any]) -> None:
    ext = merged(DEFAULTS, values)["extender"]
    out = render(values)
    name = f"{FULLNAME}-extender"
    deployment = out.named("Deployment", name)
    policy = out.named("NetworkPolicy", name)["spec"]
    assert (
        policy["podSelector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert policy["policyTypes"] == ["Ingress"]
    scheduler_rule, health_rule = policy["ingress"]
    np = ext["networkPolicy"]
    assert scheduler_rule["ports"] == [{"port": 8888, "protocol": "TCP"}]
    assert scheduler_rule["from"][0] == {
        "namespaceSelector": np["schedulerNamespaceSelector"],
        "podSelector": np["schedulerPodSelector"],
    }
    assert [f["ipBlock"]["cidr"] for f in scheduler_rule["from"][1:]] == np["schedulerIPBlocks"]
    assert health_rule == {"ports": [{"port": 8889, "protocol": "TCP"}]}  # probes: the health port only
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    certificates = {c["metadata"]["name"]: c["spec"] for c in out.kinds("Certificate")}
    if not ext["tls"]["enabled"]:
        assert "volumes" not in pod and "--tls-cert-file" not in args and not certificates
        return
    (volume,) = pod["volumes"]
    secret = ext["tls"]["existingSecret"] or f"{FULLNAME}-extender-tls"
    assert volume["secret"]["secretName"] == secret
    (mount,) = pod["containers"][0]["volumeMounts"]
    for flag, key in (
        ("--tls-cert-file", "tls.crt"),
        ("--tls-key-file", "tls.key"),
        ("--client-ca-file", "ca.crt"),
    ):
        assert args[args.index(flag) + 1] == f"{mount['mountPath']}/{key}"
    assert args[args.index("--allowed-client-names") + 1] == ",".join(ext["tls"]["clientNames"])
    generated = {s["metadata"]["name"]: s for s in out.kinds("Secret") if "tls.crt" in s.get("data", {})}
    if ext["tls"]["existingSecret"] or ext["tls"]["certManager"]["enabled"]:
        assert not generated
    if not ext["tls"]["certManager"]["enabled"]:
        assert not certificates
        return
    server, client = certificates[secret], certificates[f"{FULLNAME}-scheduler-client-tls"]
    assert server["secretName"] == secret and f"{name}.{NAMESPACE}.svc" in server["dnsNames"]
    assert "server auth" in server["usages"] and "client auth" in client["usages"]
    assert client["commonName"] in ext["tls"]["clientNames"]
    # One CA signs both, so the ca.crt the extender trusts is the one that signed the scheduler's certificate.
    assert server["issuerRef"] == client["issuerRef"] == {"name": f"{FULLNAME}-extender-ca", "kind": "Issuer"}
    ca_issuer = out.named("Issuer", f"{FULLNAME}-extender-ca")["spec"]
    assert ca_issuer["ca"]["secretName"] == certificates[f"{FULLNAME}-extender-ca"]["secretName"]
    assert certificates[f"{FULLNAME}-extender-ca"]["isCA"] is True


@needs_helm
def test_the_default_extender_tls_certificates_are_made_at_install_and_pass_a_real_handshake(
    tmp_path: Path,
) -> None:
    import base64
    import http.client
    import ssl

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from gpunode.cluster.extender.core import Extender
    from gpunode.cluster.extender.server import ExtenderServer
    from gpunode.infra.http import server_tls_context

    out = render({"extender": {"enabled": True}})
    secrets = {s["metadata"]["name"]: s for s in out.kinds("Secret")}
    server = secrets[f"{FULLNAME}-extender-tls"]
    client = secrets[f"{FULLNAME}-scheduler-client-tls"]
    assert server["type"] == client["type"] == "kubernetes.io/tls"
    files = {}
    for who, secret in (("server", server), ("client", client)):
        for key in ("tls.crt", "tls.key", "ca.crt"):
            files[who, key] = tmp_path / f"{who}-{key}"
            files[who, key].write_bytes(base64.b64decode(secret["data"][key]))
    assert files["server", "ca.crt"].read_bytes() == files["client", "ca.crt"].read_bytes()  # one CA
    ca = x509.load_pem_x509_certificate(files["server", "ca.crt"].read_bytes())
    cert = x509.load_pem_x509_certificate(files["server", "tls.crt"].read_bytes())
    sched = x509.load_pem_x509_certificate(files["client", "tls.crt"].read_bytes())
    cert.verify_directly_issued_by(ca)
    sched.verify_directly_issued_by(ca)
    name = f"{FULLNAME}-extender"
    assert f"{name}.{NAMESPACE}.svc" in cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)
    cns = sched.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert [c.value for c in cns] == ["kube-scheduler"]  # one CN, the extender's allowed name
    # The extender as the chart starts it (its TLS flags) takes the scheduler's certificate.
    deployment = out.named("Deployment", name)["spec"]["template"]["spec"]
    args = deployment["containers"][0]["args"]
    assert args[args.index("--allowed-client-names") + 1] == "kube-scheduler"
    tls = server_tls_context(
        str(files["server", "tls.crt"]), str(files["server", "tls.key"]), str(files["server", "ca.crt"])
    )
    ext = ExtenderServer(Extender(), port=0, ssl_context=tls, allowed_client_names=["kube-scheduler"])
    ext.start()
    try:
        ctx = ssl.create_default_context(cafile=str(files["client", "ca.crt"]))
        ctx.check_hostname = False  # the certificate names the Service; the test dials 127.0.0.1
        ctx.load_cert_chain(str(files["client", "tls.crt"]), str(files["client", "tls.key"]))
        conn = http.client.HTTPSConnection("127.0.0.1", ext.port, timeout=20, context=ctx)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        ext.stop()
    # kube-scheduler's configuration uses https with that client certificate
    sched_config = yaml.safe_load(
        out.named("ConfigMap", f"{FULLNAME}-scheduler-config")["data"]["scheduler-config.yaml"]
    )
    assert sched_config["extenders"][0]["enableHTTPS"] is True
    assert sched_config["extenders"][0]["urlPrefix"].startswith("https://")


@needs_helm
@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain-http"])
def test_with_dra_the_scheduler_configuration_sends_claim_pods_to_prioritize_claims(tls: bool) -> None:
    """A second extenders entry: prioritize-claims only, every pod (no managedResources), ignorable; the
    extender's own server answers that verb (a pod without claims: nothing); off without DRA or by switch."""
    from gpunode.cluster.extender.core import Extender
    from gpunode.cluster.extender.server import ExtenderServer

    dra = {"config": {"gpunode": {"dra": {"enabled": True}}}}
    values = merged(dra, {"extender": {"enabled": True, "tls": {"enabled": tls}, "draClaims": {"weight": 7}}})

    def entries(v: dict[str, Any]) -> list[dict[str, Any]]:
        cm = render(v).named("ConfigMap", f"{FULLNAME}-scheduler-config")
        return list(yaml.safe_load(cm["data"]["scheduler-config.yaml"])["extenders"])

    main, claims = entries(values)
    assert main["filterVerb"] == "filter" and main["managedResources"]  # the device-plugin entry unchanged
    assert claims == {
        "urlPrefix": main["urlPrefix"],
        "prioritizeVerb": "prioritize-claims",
        "weight": 7,
        "enableHTTPS": tls,
        **({"tlsConfig": main["tlsConfig"]} if tls else {}),
        "httpTimeout": main["httpTimeout"],
        "nodeCacheCapable": main["nodeCacheCapable"],
        "ignorable": True,
    }
    assert len(entries(merged(values, {"extender": {"draClaims": {"enabled": False}}}))) == 1
    assert len(entries({"extender": {"enabled": True}})) == 1  # DRA off: no claims to steer
    no_api = {"nodeCacheCapable": False, "provisionalReservations": False}  # nothing to watch the claims with
    assert len(entries(merged(values, {"extender": no_api}))) == 1
    server = ExtenderServer(Extender(), port=0)
    server.start()
    try:
        pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}}
        body = json.dumps({"Pod": pod, "NodeNames": ["n"]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/{claims['prioritizeVerb']}", body)
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert (resp.status, json.loads(resp.read())) == (200, [])
    finally:
        server.stop()


@needs_helm
def test_extender_without_network_policy_and_with_an_insecure_bind() -> None:
    values = {"extender": {"enabled": True, "bind": True, "insecureBindWithoutTLS": True,
                           "tls": {"enabled": False}, "networkPolicy": {"enabled": False}}}  # fmt: skip
    out = render(values)
    assert out.kinds("NetworkPolicy") == []
    args = out.named("Deployment", f"{FULLNAME}-extender")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--bind" in args and "--insecure-bind-without-tls" in args
    from gpunode.cluster.extender.cli import build_extender

    assert build_extender(extender_parser().parse_args(args))[0].binder is not None


@needs_helm
def test_extender_ha_renders_a_leader_service_a_budget_and_the_rights_to_elect(tmp_path: Path) -> None:
    from gpunode.cluster.extender.cli import build_extender, build_ha
    from gpunode.cluster.extender.server import ExtenderServer
    from gpunode.contract.names import EXTENDER_ROLE_LABEL

    values = VALUE_SETS["extender-ha"]
    out = render(values)
    name = f"{FULLNAME}-extender"
    deployment = out.named("Deployment", name)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] == 2
    # The Service selects the replica that labels itself leader; the budget counts all replicas.
    selector = out.named("Service", name)["spec"]["selector"]
    assert selector[EXTENDER_ROLE_LABEL] == "leader" and EXTENDER_ROLE_LABEL not in pod_labels
    assert {k: v for k, v in selector.items() if k != EXTENDER_ROLE_LABEL}.items() <= pod_labels.items()
    pdb = out.named("PodDisruptionBudget", name)["spec"]
    assert pdb["minAvailable"] == 1 and "maxUnavailable" not in pdb
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    # Rights: the Lease (get/update only that one), pod labels in the namespace, pods and nodes to rebuild from.
    role = out.named("Role", f"{name}-leader")
    assert role["metadata"]["namespace"] == NAMESPACE
    lease_rules = [r for r in role["rules"] if r["apiGroups"] == ["coordination.k8s.io"]]
    assert {v for r in lease_rules for v in r["verbs"]} == {"create", "get", "update"}
    assert all(r.get("resourceNames") == [name] for r in lease_rules if set(r["verbs"]) & {"get", "update"})
    assert [r for r in role["rules"] if r["apiGroups"] == [""]] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}
    ]
    binding = out.named("RoleBinding", f"{name}-leader")
    assert binding["roleRef"]["name"] == f"{name}-leader" and binding["subjects"][0]["name"] == name
    assert granted(out, name) == {
        "pods": {"get", "list", "patch"},
        "pods/binding": {"create"},
        "nodes": {"list"},
        **CLAIMS,
    }
    # The extender's own CLI takes the arguments, with the pod's name and namespace from the environment.
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    args = container["args"]
    assert args[args.index("--leader-elect-lease-name") + 1] == name
    os.environ["POD_NAME"] = "gn-gpunode-extender-abc"
    try:
        parsed = extender_parser().parse_args(args)
    finally:
        del os.environ["POD_NAME"]
    extender, api = build_extender(parsed)
    ha = build_ha(parsed, extender, api)
    assert ha is not None and ha.pod_name == "gn-gpunode-extender-abc"
    assert (ha.config.namespace, ha.config.lease_duration_s, ha.config.renew_deadline_s) == (
        NAMESPACE,
        15,
        10,
    )
    # Readiness is /readyz on the health port, and a standby answers it with 200: it counts as available.
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/readyz", "health")
    server = ExtenderServer(
        extender, host="127.0.0.1", port=0, health_host="127.0.0.1", health_port=0, gate=ha.leadership
    )
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.health_port}/readyz", timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read())["role"] == "standby"
    finally:
        server.stop()
    # One replica with HA: no budget (it could only block drains).
    single = render(merged(values, {"extender": {"replicas": 1}}))
    assert single.kinds("PodDisruptionBudget") == []


@needs_helm
def test_scheduler_configuration_agrees_with_the_example_and_selects_its_api_version() -> None:
    example_config = yaml.safe_load(
        (ROOT / "gpunode" / "examples" / "kube-scheduler-config.yaml").read_text()
    )
    want, want_claims = example_config["extenders"]

    def entry(values: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        text = render(values).named("ConfigMap", f"{FULLNAME}-scheduler-config")["data"][
            "scheduler-config.yaml"
        ]
        config = yaml.safe_load(text)
        (got,) = config["extenders"]
        return config["apiVersion"], got

    # the entry for pods with DRA claims, rendered with DRA on, is the example's second one
    dra = merged(VALUE_SETS["extender-bind-node-cache"], {"config": {"gpunode": {"dra": {"enabled": True}}}})
    text = render(dra).named("ConfigMap", f"{FULLNAME}-scheduler-config")["data"]["scheduler-config.yaml"]
    _, got_claims = yaml.safe_load(text)["extenders"]
    assert {k: v for k, v in got_claims.items() if k not in ("urlPrefix", "tlsConfig")} == {
        k: v for k, v in want_claims.items() if k not in ("urlPrefix", "tlsConfig")
    }

    version, got = entry(VALUE_SETS["extender-bind-node-cache"])
    assert version == example_config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    for key in (
        "weight",
        "httpTimeout",
        "nodeCacheCapable",
        "ignorable",
        "filterVerb",
        "prioritizeVerb",
        "bindVerb",
        "preemptVerb",
    ):
        assert got[key] == want[key], key
    for older in ("v1beta3", "v1beta2"):  # removed from kube-scheduler before 1.34: refused at render
        values = merged(
            VALUE_SETS["extender-bind-node-cache"], {"extender": {"schedulerConfig": {"apiVersion": older}}}
        )
        proc = run_helm("template", values=values)
        assert proc.returncode != 0 and "apiVersion" in proc.stderr, proc.stderr


# -- values that must be refused -------------------------------------------------------------------

INVALID = {
    "replicas-as-string": ({"extender": {"replicas": "2"}}, "extender.replicas: Invalid type. Expected: integer, given: string"),
    "unknown-policy": ({"extender": {"policy": "first-fit"}}, "extender.policy must be one of the following"),
    "unknown-mig-strategy": ({"config": {"flags": {"migStrategy": "both"}}}, "config.flags.migStrategy must be one of the following"),
    "one-replica": ({"config": {"sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 1}]}}}},
                    "replicas: Must be greater than or equal to 2"),
    "unknown-config-key": ({"config": {"gpunode": {"fractionl": {}}}}, "Additional property fractionl is not allowed"),
    "misspelt-value": ({"agnet": {}}, "Additional property agnet is not allowed"),
    "port-as-string": ({"agent": {"metricsPort": "9400"}}, "agent.metricsPort: Invalid type. Expected: integer"),
    "relative-host-path": ({"agent": {"hostPaths": {"state": "var/lib/gpunode"}}}, "agent.hostPaths.state: Does not match pattern"),
    "gds-enabled": ({"config": {"flags": {"gdsEnabled": True}}}, "config.flags.gdsEnabled"),
    "ip-block-without-prefix": ({"extender": {"networkPolicy": {"schedulerIPBlocks": ["10.0.0.1"]}}},
                                "extender.networkPolicy.schedulerIPBlocks.0: Does not match pattern"),
    "unknown-issuer-kind": ({"extender": {"tls": {"certManager": {"issuerRef": {"name": "x", "kind": "Vault"}}}}},
                            "extender.tls.certManager.issuerRef.kind must be one of the following"),
    "ha-lease-as-number": ({"extender": {"ha": {"enabled": True, "leaseDuration": 15}}},
                           "extender.ha.leaseDuration: Invalid type. Expected: string"),
    "unknown-scheduler-config-version": ({"extender": {"schedulerConfig": {"apiVersion": "v1beta1"}}},
                                         "extender.schedulerConfig.apiVersion must be one of the following"),
}  # fmt: skip

REFUSED_BY_TEMPLATE = {
    "state-dir-elsewhere": ({"config": {"gpunode": {"stateDir": "/srv/gpu"}}}, "config.gpunode.stateDir is /srv/gpu"),
    "node-name-set": ({"config": {"gpunode": {"nodeName": "n1"}}}, "config.gpunode.nodeName is set"),
    "metrics-off": ({"config": {"gpunode": {"metrics": {"enabled": False}}}}, "config.gpunode.metrics.enabled is false"),
    "metrics-on-loopback": ({"config": {"gpunode": {"metrics": {"listen": "127.0.0.1:9400"}}}}, "not on 127.0.0.1"),
    "metrics-port-differs": ({"config": {"gpunode": {"metrics": {"listen": ":9500"}}}}, "but agent.metricsPort is 9400"),
    "driver-root-unmounted": ({"config": {"flags": {"nvidiaDriverRoot": "/run/nvidia/driver"}}}, "set agent.driverRoot"),
    "baremetal-without-hostpid": ({"config": {"gpunode": {"remediation": {"mode": "baremetal"}}}}, "agent.hostPID is false"),
    "extender-with-renamed-fraction": ({"extender": {"enabled": True}, "config": {"gpunode": {"fractional": {
        "resourceName": "example.com/vram"}}}}, "places fractional requests of gpunode.io/gpu-memory only"),
    "extender-bind-without-tls": ({"extender": {"enabled": True, "bind": True, "tls": {"enabled": False}}},
                                  "extender.tls.enabled is false"),
    "extender-two-certificate-sources": ({"extender": {"enabled": True, "tls": {
        "enabled": True, "existingSecret": "s", "certManager": {"enabled": True}}}}, "not both"),
    "extender-replicas-without-ha": ({"extender": {"enabled": True, "replicas": 2}},
                                     "extender.replicas is 2 but extender.ha.enabled is false"),
    "extender-pdb-both-limits": ({"extender": {"enabled": True, "replicas": 2, "ha": {"enabled": True},
                                  "podDisruptionBudget": {"maxUnavailable": 1}}}, "both minAvailable and maxUnavailable"),
}  # fmt: skip


@needs_helm
@pytest.mark.parametrize(("values", "message"), INVALID.values(), ids=INVALID.keys())
def test_invalid_values_fail_the_schema(values: dict[str, Any], message: str) -> None:
    proc = run_helm("template", RELEASE, values=values)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


@needs_helm
@pytest.mark.parametrize(("values", "message"), REFUSED_BY_TEMPLATE.values(), ids=REFUSED_BY_TEMPLATE.keys())
def test_contradicting_values_fail_with_a_hint(values: dict[str, Any], message: str) -> None:
    proc = run_helm("template", RELEASE, values=values)
    assert proc.returncode != 0
    assert message in proc.stderr and "HINT:" in proc.stderr, proc.stderr


def config_from_schema_examples(node: Mapping[str, Any], defs: Mapping[str, Any]) -> Any:
    """A value for every key the schema describes, from its examples, enums and types."""
    if "$ref" in node:
        return config_from_schema_examples(
            {**defs[node["$ref"].rsplit("/", 1)[1]], **{k: v for k, v in node.items() if k != "$ref"}}, defs
        )
    if "examples" in node:
        return node["examples"][0]
    if "const" in node:
        return node["const"]
    if "enum" in node:
        return node["enum"][0]
    kind = node.get("type")
    if kind == "object":
        return {
            k: config_from_schema_examples(v, defs)
            for k, v in node.get("properties", {}).items()
            if k not in ("nodeName", "kubeletDir", "stateDir", "podResourcesSocket", "nvidiaDriverRoot")
        }
    if kind == "array":
        return [config_from_schema_examples(node["items"], defs)] if node.get("maxItems", 1) else []
    if kind == "boolean":
        return True
    if "description" in node and not kind:
        return None  # accepted-and-ignored NVIDIA keys
    raise AssertionError(f"no example for {node}")


def test_every_config_key_the_schema_describes_is_accepted_by_the_agent() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    config_schema = schema["properties"]["config"]
    doc = config_from_schema_examples(config_schema, schema["definitions"])
    doc["gpunode"]["fractional"]["devices"] = [4, 5]  # one sharing mode per GPU: not the time-sliced ones
    mps = doc["sharing"].pop("mps")  # one sharing strategy: timeSlicing or mps, each tried
    jsonschema.validate(doc, {**config_schema, "definitions": schema["definitions"]})
    cfg = parse_config(doc, "every-key.yaml")
    assert cfg.remediation.baremetal.hook == ("/usr/local/bin/drain-gpu", "--reason", "gpu-fault")
    assert cfg.time_slicing.resources[0].replicas == 4
    with_mps = {**doc, "sharing": {"mps": mps}, "gpunode": {**doc["gpunode"], "replicaMemoryCap": "equal"}}
    jsonschema.validate(with_mps, {**config_schema, "definitions": schema["definitions"]})
    assert parse_config(with_mps, "every-key.yaml").time_slicing.mps
    with pytest.raises(jsonschema.ValidationError):  # both at once: refused by the chart as by the agent
        jsonschema.validate(
            {**doc, "sharing": {**doc["sharing"], "mps": mps}},
            {**config_schema, "definitions": schema["definitions"]},
        )


# -- the real endpoints behind the probes, and the dashboard -----------------------------------------


def fetch_from_agent_endpoint(
    paths: list[str], state_dir: Path, metrics_section: Any = None
) -> dict[str, tuple[int, str]]:
    """Run the agent's real collector and metrics server on a simulated DGX H100 (a fractional
    GPU with a memory-cap region, an unhealthy device, an XID) and GET each path over loopback."""
    backend = SimBackend.from_profile("dgx-h100")
    gpus = backend.gpus()
    inventory = build_inventory(
        gpus, parse_config({"version": "v1", "gpunode": {"fractional": {"devices": [0]}}}, "t")
    )
    units = [d for d in inventory.devices if d.resource == "gpunode.io/gpu-memory"][:2]
    memcap.create_region(state_dir / "memcap", region_key([d.id for d in units]), gpu_uuid=gpus[0].uuid,
                         limit_bytes=2 * 2**30, device_total_bytes=gpus[0].memory_total_bytes, fail_open=False)  # fmt: skip
    collector = MetricsCollector(backend=backend, hostname="gpu-node-1", config=metrics_section,
                                 inventory=lambda: inventory, health=lambda: {units[0].id: "XID 79"},
                                 regions_root=state_dir / "memcap")  # fmt: skip
    collector.record_event(DeviceEvent(kind=EventKind.XID, gpu_uuid=gpus[1].uuid, xid=79))

    def get(url: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    async def main() -> dict[str, tuple[int, str]]:
        await collector.collect_once()
        server = MetricsServer(collector, "127.0.0.1:0")
        await server.start()
        try:
            return {p: await asyncio.to_thread(get, f"http://127.0.0.1:{server.port}{p}") for p in paths}
        finally:
            await server.stop()

    return asyncio.run(main())


@needs_helm
def test_agent_probes_answer_on_the_real_metrics_endpoint(tmp_path: Path) -> None:
    out = render({})
    container = out.daemonset()["spec"]["template"]["spec"]["containers"][0]
    paths = [container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    section = parse_config(yaml.safe_load(out.agent_config_text()), "config.yaml").metrics
    answers = fetch_from_agent_endpoint(paths, tmp_path, section)
    assert {p: status for p, (status, _) in answers.items()} == dict.fromkeys(paths, 200)


PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana label_values() query) selects."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,[^)]*\)", r" \1 ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if not e[m.end() :].lstrip().startswith("(") and m.group(0) not in PROMQL_WORDS:
            names.add(m.group(0))
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        pytest.param('sum by (a, b) (rate(foo_total{x="y", z=~"$node"}[$__rate_interval]))', {"foo_total"}, id="aggregation"),
        pytest.param("a_bytes / ignoring (c) b_bytes", {"a_bytes", "b_bytes"}, id="binary-ignoring"),
        pytest.param("histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m])))", {"h_bucket"}, id="quantile"),
        pytest.param("count(x == 0) or vector(0)", {"x"}, id="or-vector"),
        pytest.param('label_values(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$node"}, gpu)', {"DCGM_FI_DEV_GPU_TEMP"}, id="label-values"),
        pytest.param("p_bytes and on (instance) q_seconds", {"p_bytes", "q_seconds"}, id="and-on"),
    ],
)  # fmt: skip
def test_metric_names_are_found_in_queries(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def dashboard_queries(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            yield f"variable {var['name']}", var["query"]["query"]


def test_dashboard_queries_only_metrics_the_agent_exports(tmp_path: Path) -> None:
    body = fetch_from_agent_endpoint(["/metrics"], tmp_path)["/metrics"][1]
    exported = {
        line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and not line.startswith("#")
    }
    assert {
        "gpunode_container_memory_used_bytes",
        "gpunode_xid_errors_total",
        "DCGM_FI_DEV_GPU_UTIL",
    } <= exported
    dashboard = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for where, expr in dashboard_queries(dashboard):
        names = metric_names(expr)
        assert names, f"{where} queries no metric: {expr}"
        assert names <= exported, (
            f"{where} queries {sorted(names - exported)}, which the agent does not export"
        )
        used |= names
    # What the dashboard is for: per-pod memory on shared GPUs, device health, XIDs by code.
    assert {"gpunode_container_memory_used_bytes", "gpunode_container_memory_limit_bytes",
            "gpunode_device_healthy", "gpunode_xid_errors_total"} <= used  # fmt: skip
    assert any(n.startswith("DCGM_FI_") for n in used)


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool is missing (Debian package prometheus)"
)
def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rules = []
    for i, (_, expr) in enumerate(dashboard_queries(dashboard)):
        if expr.startswith("label_values("):
            continue
        for var, value in (("$__rate_interval", "1m"), ("$__range", "6h"), ("$node", ".*"), ("$gpu", ".*")):
            expr = expr.replace(var, value)
        rules.append({"record": f"gpunode:dashboard_query:{i}", "expr": expr})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_layout_and_variables() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
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
    referenced = set(re.findall(r"\$\{?(\w+)", DASHBOARD.read_text()))
    assert referenced <= defined, referenced - defined


@needs_helm
@pytest.mark.parametrize(("values", "label"), [
    pytest.param(VALUE_SETS["dashboard-on"], "Hostname", id="default-label"),
    pytest.param(VALUE_SETS["hostname-label"], "hostname", id="hostname-label"),
])  # fmt: skip
def test_dashboard_configmap(values: dict[str, Any], label: str) -> None:
    out = render(values)
    cm = out.named("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    rendered = json.loads(cm["data"]["gpunode.json"])
    expected = json.loads(re.sub(r"\bHostname\b", label, DASHBOARD.read_text()))
    assert rendered == expected
    assert ("Hostname" in cm["data"]["gpunode.json"]) == (label == "Hostname")
    assert f"{FULLNAME}-dashboard" not in {c["metadata"]["name"] for c in render({}).kinds("ConfigMap")}


# -- NOTES.txt and the helm installer --------------------------------------------------------------


@needs_helm
def test_notes_render_and_say_how_to_check(tmp_path: Path) -> None:
    """NOTES.txt is only rendered by `helm install`; render it through tpl in a copy of the chart."""
    chart = tmp_path / "gpunode"
    shutil.copytree(CHART, chart)
    (chart / "notes.txt").write_text((CHART / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: rendered-notes\ndata:\n"
        '  notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n'
    )
    for values, extra in (({}, None), (VALUE_SETS["extender-on"], f"{FULLNAME}-scheduler-config")):
        proc = run_helm("template", RELEASE, "--namespace", NAMESPACE, values=values, chart=chart)
        assert proc.returncode == 0, proc.stderr
        notes = next(
            d for d in yaml.safe_load_all(proc.stdout) if d and d["metadata"]["name"] == "rendered-notes"
        )
        text = notes["data"]["notes"]
        assert f"daemonset/{FULLNAME}-agent" in text
        assert 'annotations["gpunode.io/gpu-state"]' in text and "gpunode doctor" in text
        assert (extra in text) if extra else "scheduler-config" not in text


def test_get_helm_is_idempotent_with_the_pinned_binary() -> None:
    script = ROOT / "scripts" / "get-helm.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    pinned = re.search(r'^HELM_SHA256="([0-9a-f]{64})"$', script.read_text(), re.M)
    assert pinned
    installed = ROOT / ".tools" / "bin" / "helm"
    if not installed.is_file():
        pytest.skip("helm is not installed: run scripts/get-helm.sh")
    assert hashlib.sha256(installed.read_bytes()).hexdigest() == pinned.group(1)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "already installed" in proc.stdout, proc.stdout + proc.stderr
