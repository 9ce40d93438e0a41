"""The chart's scheduling-gate parts (queue.gate: queue-gate.yaml), rendered by a real helm, checked without a
cluster: the webhook configuration's selectors and policy, its TLS (a real handshake with the rendered
certificate, served by the controller's own webhook from the rendered arguments), and the policy's subject.
The real API server runs them in tests/e2e/test_queue_gates.py."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import ssl
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpunode.cluster.queuectl import cli as queue_cli
from gpunode.contract.names import ADMISSION_GATE, ADMISSION_WEBHOOK_PATH, QUEUE_LABEL
from gpunode.errors import ConfigError
from tests.cluster.queuectl.helpers import pod
from tests.deploy.test_helm_chart import FULLNAME, NAMESPACE, RELEASE, needs_helm, render, run_helm

pytestmark = needs_helm
NAME = f"{FULLNAME}-queue"
HOOK = f"{NAME}-webhook"
ON = {"queue": {"enabled": True, "gate": {"enabled": True}}}


def with_gate(**gate: Any) -> dict[str, Any]:
    return {"queue": {"enabled": True, "gate": {"enabled": True, **gate}}}


def args_of(docs: Any) -> list[str]:
    dep = docs.named("Deployment", NAME)
    return [str(a) for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]]


def test_off_by_default_nothing_is_rendered() -> None:
    docs = render({"queue": {"enabled": True}})
    assert not docs.kinds("MutatingWebhookConfiguration") and not docs.kinds("ValidatingAdmissionPolicy")
    assert "--webhook-listen" not in args_of(docs)


def test_the_webhook_is_called_for_governed_pod_creations_only_and_fails_open() -> None:
    docs = render(with_gate(namespaces=["team-a"]))
    (labelled, mapped) = docs.named("MutatingWebhookConfiguration", HOOK)["webhooks"]
    for entry in (labelled, mapped):
        assert entry["failurePolicy"] == "Ignore" and entry["sideEffects"] == "None"
        assert entry["rules"] == [
            {
                "apiGroups": [group],
                "apiVersions": [version],
                "operations": ["CREATE"],
                "resources": [resource],
                "scope": "Namespaced",
            }
            for group, version, resource in (
                ("", "v1", "pods"),
                ("batch", "v1", "jobs"),
                ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
            )
        ]
        svc = entry["clientConfig"]["service"]
        assert (svc["name"], svc["namespace"], svc["path"], svc["port"]) == (
            HOOK,
            NAMESPACE,
            ADMISSION_WEBHOOK_PATH,
            443,
        )
    assert labelled["objectSelector"] == {"matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]}
    assert "namespaceSelector" not in labelled
    assert mapped["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a"]}
    ]
    assert len(render(ON).named("MutatingWebhookConfiguration", HOOK)["webhooks"]) == 1
    config = "queues:\n  - name: org\n    children: [{name: a}]\nnamespaces:\n  ml: a\n  team-a: a\n"
    both = render(
        {"queue": {"enabled": True, "config": config, "gate": {"enabled": True, "namespaces": ["x"]}}}
    )
    (_, mapped) = both.named("MutatingWebhookConfiguration", HOOK)["webhooks"]
    assert mapped["namespaceSelector"]["matchExpressions"][0]["values"] == ["ml", "team-a", "x"]
    fail = render(with_gate(failurePolicy="Fail")).named("MutatingWebhookConfiguration", HOOK)
    assert fail["webhooks"][0]["failurePolicy"] == "Fail"


def test_the_policy_exempts_the_controllers_service_account_alone() -> None:
    docs = render(ON)
    policy = docs.named("ValidatingAdmissionPolicy", f"{NAME}-admission-gate")
    sa = docs.named("ServiceAccount", NAME)
    assert (
        docs.named("Deployment", NAME)["spec"]["template"]["spec"]["serviceAccountName"]
        == sa["metadata"]["name"]
    )
    user = f"system:serviceaccount:{NAMESPACE}:{NAME}"
    conditions = {c["name"]: c["expression"] for c in policy["spec"]["matchConditions"]}
    assert conditions["not-the-queue-controller"] == f"request.userInfo.username != '{user}'"
    assert f"'{ADMISSION_GATE}'" in conditions["gated-by-the-queue"]
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["UPDATE"]
    binding = docs.named("ValidatingAdmissionPolicyBinding", f"{NAME}-admission-gate")
    assert binding["spec"] == {"policyName": f"{NAME}-admission-gate", "validationActions": ["Deny"]}
    assert not render(with_gate(policy=False)).kinds("ValidatingAdmissionPolicy")


def test_the_suspension_policy_exempts_the_controller_and_a_jobsets_jobs_and_kueue_labels_are_opt_in() -> (
    None
):
    docs = render(ON)
    name = f"{NAME}-suspension"
    policy = docs.named("ValidatingAdmissionPolicy", name)
    conditions = {c["name"]: c["expression"] for c in policy["spec"]["matchConditions"]}
    user = f"system:serviceaccount:{NAMESPACE}:{NAME}"
    assert conditions["not-the-queue-controller"] == f"request.userInfo.username != '{user}'"
    assert "JobSet" in conditions["not-a-jobsets-job"]
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert [(r["apiGroups"], r["resources"], r["operations"]) for r in rules] == [
        (["batch"], ["jobs"], ["UPDATE"]),
        (["jobset.x-k8s.io"], ["jobsets"], ["UPDATE"]),
    ]
    assert docs.named("ValidatingAdmissionPolicyBinding", name)["spec"]["validationActions"] == ["Deny"]
    labels = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}["queueLabels"]
    assert "kueue" not in labels
    assert len(docs.named("MutatingWebhookConfiguration", HOOK)["webhooks"]) == 1
    config = "queues:\n  - name: a\nkueue: {queueNameLabel: true}\n"
    kueue = render({"queue": {"enabled": True, "config": config, "gate": {"enabled": True}}})
    (_, aliased) = kueue.named("MutatingWebhookConfiguration", HOOK)["webhooks"]
    assert aliased["objectSelector"]["matchExpressions"] == [
        {"key": QUEUE_LABEL, "operator": "DoesNotExist"},
        {"key": "kueue.x-k8s.io/queue-name", "operator": "Exists"},
    ]
    policy = kueue.named("ValidatingAdmissionPolicy", name)
    assert (
        "kueue.x-k8s.io/queue-name"
        in {v["name"]: v["expression"] for v in policy["spec"]["variables"]}["queueLabels"]
    )


def test_the_network_policy_opens_the_webhook_port() -> None:
    netpol = render(ON).named("NetworkPolicy", NAME)
    ports = [p["port"] for rule in netpol["spec"]["ingress"] for p in rule["ports"]]
    assert ports == [9403, 9443]
    svc = render(ON).named("Service", HOOK)
    assert svc["spec"]["ports"][0]["targetPort"] == "webhook"


def test_tls_values_that_do_not_go_together_are_refused_in_one_line() -> None:
    both = with_gate(tls={"existingSecret": "mine", "certManager": {"enabled": True}})
    proc = run_helm("template", RELEASE, "--namespace", NAMESPACE, values=both)
    assert proc.returncode != 0 and "not both" in proc.stderr
    proc = run_helm(
        "template", RELEASE, "--namespace", NAMESPACE, values=with_gate(tls={"existingSecret": "mine"})
    )
    assert proc.returncode != 0 and "queue.gate.tls.caBundle is empty" in proc.stderr
    own = render(with_gate(tls={"existingSecret": "mine", "caBundle": "Q0E="}))
    assert (
        own.named("MutatingWebhookConfiguration", HOOK)["webhooks"][0]["clientConfig"]["caBundle"] == "Q0E="
    )
    assert not [s for s in own.kinds("Secret") if s["metadata"]["name"] == f"{HOOK}-tls"]
    vols = own.named("Deployment", NAME)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "webhook-tls", "secret": {"secretName": "mine"}} in vols


def test_cert_manager_issues_the_certificate_and_injects_its_ca() -> None:
    docs = render(with_gate(tls={"certManager": {"enabled": True}}))
    cert = docs.named("Certificate", f"{HOOK}-tls")
    assert f"{HOOK}.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    hook = docs.named("MutatingWebhookConfiguration", HOOK)
    assert hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/{HOOK}-tls"
    assert "caBundle" not in hook["webhooks"][0]["clientConfig"]


def test_the_rendered_certificate_serves_the_rendered_webhook(tmp_path: Path) -> None:
    """The controller started from the rendered arguments, with the rendered Secret's files, answers a review
    over TLS verified as the API server verifies it: the caBundle, and the Service's DNS name."""
    docs = render(ON)
    secret = docs.named("Secret", f"{HOOK}-tls")["data"]
    ca_bundle = docs.named("MutatingWebhookConfiguration", HOOK)["webhooks"][0]["clientConfig"]["caBundle"]
    assert ca_bundle == secret["ca.crt"]
    for key in ("tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(secret[key]))
    (tmp_path / "ca.crt").write_bytes(base64.b64decode(ca_bundle))
    (tmp_path / "queues.yaml").write_text("queues:\n  - name: team-a\n")
    args = args_of(docs)
    for flag, value in (
        ("--config", str(tmp_path / "queues.yaml")),
        ("--webhook-listen", "127.0.0.1:0"),
        ("--webhook-tls-cert-file", str(tmp_path / "tls.crt")),
        ("--webhook-tls-key-file", str(tmp_path / "tls.key")),
    ):
        args[args.index(flag) + 1] = value
    parser = argparse.ArgumentParser()
    queue_cli.register_queue_cli(parser.add_subparsers())
    parsed = parser.parse_args(args)

    class _Ctl:
        class core:
            class config:
                namespaces: dict[str, str] = {}

    hook = queue_cli.build_webhook(parsed, _Ctl())  # type: ignore[arg-type]
    assert hook is not None
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "namespace": "ml",
            "object": pod("p"),
        },
    }

    def call(port: int) -> dict[str, Any]:
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        ctx.check_hostname = True
        conn_url = f"https://{HOOK}.{NAMESPACE}.svc:{port}{ADMISSION_WEBHOOK_PATH}"
        req = urllib.request.Request(
            conn_url, data=json.dumps(review).encode(), headers={"Content-Type": "application/json"}
        )
        opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=ctx))
        real = socket.getaddrinfo

        def resolve(host: str, *a: Any, **kw: Any) -> Any:
            return real("127.0.0.1" if host == f"{HOOK}.{NAMESPACE}.svc" else host, *a, **kw)

        socket.getaddrinfo = resolve  # type: ignore[assignment]
        try:
            with opener.open(req, timeout=10) as resp:
                return dict(json.loads(resp.read()))
        finally:
            socket.getaddrinfo = real  # type: ignore[assignment]

    async def main() -> dict[str, Any]:
        await hook.start()
        try:
            return await asyncio.to_thread(call, hook.server.port)
        finally:
            await hook.stop()

    answer = asyncio.run(main())
    patch = json.loads(base64.b64decode(answer["response"]["patch"]))
    assert patch == [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": ADMISSION_GATE}]}]


@pytest.mark.parametrize("flags", [["--webhook-listen", ":9443"], ["--webhook-tls-cert-file", "x"]])
def test_webhook_flags_that_do_not_go_together_are_one_line(flags: list[str]) -> None:
    parser = argparse.ArgumentParser()
    queue_cli.register_queue_cli(parser.add_subparsers())
    parsed = parser.parse_args(["queue", "--config", "q.yaml", *flags])
    with pytest.raises(ConfigError) as info:
        queue_cli.build_webhook(parsed, None)  # type: ignore[arg-type]
    assert "\n" not in str(info.value) and info.value.hint
