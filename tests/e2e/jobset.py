"""The JobSet controller (sigs.k8s.io/jobset) on the session's control plane, as `scripts/get-kube.sh --jobset`
builds it from Go modules (linked at .tools/jobset, or $GPUNODE_JOBSET_DIR).

JobSetController.start() does what the upstream manifests (config/default) do in a cluster, with the files
the build copied from the module's own source:

- installs the CRD jobsets.jobset.x-k8s.io and waits until it is Established;
- gives the controller the identity of its ServiceAccount (jobset-system/jobset-controller-manager: a
  static token of the control plane, see JOBSET_USER) and the RBAC the manifests give it: the ClusterRole
  manager-role (as jobset-manager-role) and the leader-election Role in jobset-system, each bound to that
  ServiceAccount. The Role on Secrets is left out: it serves the controller's internal certificate
  rotator, which is off here;
- starts the controller as a process with a kubeconfig for that identity and a
  config.jobset.x-k8s.io/v1alpha1 Configuration: leader election on (a Lease in jobset-system), the
  internal certificate management off, the webhook server on 127.0.0.1 with a serving certificate from the
  control plane's CA (there is no Service to reach it by in this cluster), the health probes on a loopback
  port, metrics off;
- once the controller is ready (its /readyz: the webhook server started), registers its mutating and
  validating webhooks from the manifests, their objectSelector patches applied, with the Service reference
  replaced by the loopback URL and the CA as caBundle. failurePolicy stays Fail, as upstream.

Its log is <control plane logs>/jobset-controller.log, so a failing test's report shows its end with the
other components'. stop() removes the webhook configurations first (JobSet pods would be refused with the
controller gone), then stops the process.
"""

from __future__ import annotations

import base64
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.controlplane import ROOT, ControlPlane, User, service_account_user
from tests.e2e.objects import ensure_namespace
from tests.e2e.procs import Proc
from tests.ports import free_port

JOBSET_NAMESPACE = "jobset-system"
JOBSET_SERVICE_ACCOUNT = "jobset-controller-manager"  # the manifests' controller-manager, prefixed jobset-
JOBSET_USER: User = service_account_user(JOBSET_NAMESPACE, JOBSET_SERVICE_ACCOUNT)
JOBSET_USER_KEY = "jobset"  # the control plane's key for JOBSET_USER (tests/e2e/conftest.py)
GROUP, VERSION = "jobset.x-k8s.io", "v1alpha2"
CRD_NAME = f"jobsets.{GROUP}"
CRD_FILE = "jobset.x-k8s.io_jobsets.yaml"
NAME_PREFIX = "jobset-"  # config/default's namePrefix
START_TIMEOUT_S = 120.0
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
PRIORITY_LABEL = "jobset.sigs.k8s.io/priority"  # written on JobSet pods by the controller's pod webhook

_RBAC = "/apis/rbac.authorization.k8s.io/v1"
_ADMISSION = "/apis/admissionregistration.k8s.io/v1"
_CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
_WEBHOOK_KINDS = {
    "MutatingWebhookConfiguration": ("mutatingwebhookconfigurations", "webhook-mutating-patch.yaml"),
    "ValidatingWebhookConfiguration": ("validatingwebhookconfigurations", "webhook-validating-patch.yaml"),
}


def jobset_dir() -> Path:
    """Where `scripts/get-kube.sh --jobset` left the controller and its manifests ($GPUNODE_JOBSET_DIR overrides)."""
    named = os.environ.get("GPUNODE_JOBSET_DIR")
    return Path(named).resolve() if named else ROOT / ".tools" / "jobset"


def missing_reason() -> str | None:
    """Why the JobSet controller cannot run here, or None when it can."""
    d = jobset_dir()
    if not os.access(d / "jobset-controller", os.X_OK) or not (d / CRD_FILE).is_file():
        return f"no JobSet controller in {d}: run scripts/get-kube.sh --jobset (it builds it from Go modules)"
    return None


def jobsets_path(namespace: str) -> str:
    """The collection of JobSets in `namespace`."""
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/jobsets"


def _load_all(path: Path) -> list[dict[str, Any]]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [d for d in yaml.load_all(path.read_text(), Loader=loader) if d]


def _json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """Apply the kustomize patches the manifests carry (`replace` of a list item or a key)."""
    for op in ops:
        assert op["op"] == "replace", f"unexpected patch operation {op}"
        *parents, last = [p for p in str(op["path"]).split("/") if p]
        target: Any = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target[int(last)] = op["value"]
        else:
            target[last] = op["value"]


class JobSetController:
    """The JobSet controller on `cp` (see the module docstring)."""

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        """Plan it; start() installs and runs it. `cp` must know JOBSET_USER under JOBSET_USER_KEY."""
        assert cp.users.get(JOBSET_USER_KEY) == JOBSET_USER, "the control plane must know the JobSet user"
        self.cp = cp
        self.dir = jobset_dir()
        self.workdir = workdir
        self.proc: Proc | None = None
        self.webhook_port = 0
        self.health_port = 0
        self.webhooks: list[tuple[str, str]] = []  # (collection, name) registered

    # -- start and stop --------------------------------------------------------------------------

    def start(self) -> JobSetController:
        """Install the CRD and RBAC, start the controller, register its webhooks; StartError if it does not
        come up."""
        admin = self.cp.api()
        self._install_crd(admin)
        self._install_rbac(admin)
        self._run()
        self._register_webhooks(admin)
        return self

    def stop(self) -> None:
        """Remove the webhook configurations, then stop the controller."""
        admin = self.cp.api()
        while self.webhooks:
            collection, name = self.webhooks.pop()
            admin.delete(f"{_ADMISSION}/{collection}/{name}")
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def _install_crd(self, admin: Api) -> None:
        (crd,) = _load_all(self.dir / CRD_FILE)
        assert crd["metadata"]["name"] == CRD_NAME, crd["metadata"]["name"]
        admin.apply(_CRDS, crd)

        def established() -> bool:
            conds = admin.get(f"{_CRDS}/{CRD_NAME}").get("status", {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

        eventually(established, timeout_s=START_TIMEOUT_S, what=f"the CRD {CRD_NAME} Established")

    def _install_rbac(self, admin: Api) -> None:
        ensure_namespace(admin, JOBSET_NAMESPACE)
        admin.apply(
            f"/api/v1/namespaces/{JOBSET_NAMESPACE}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": JOBSET_SERVICE_ACCOUNT}},
        )
        subject = {"kind": "ServiceAccount", "name": JOBSET_SERVICE_ACCOUNT, "namespace": JOBSET_NAMESPACE}
        (role,) = _load_all(self.dir / "rbac-role.yaml")
        assert role["kind"] == "ClusterRole", role["kind"]
        name = NAME_PREFIX + role["metadata"]["name"]
        admin.apply(f"{_RBAC}/clusterroles", {**role, "metadata": {"name": name}})
        admin.apply(
            f"{_RBAC}/clusterrolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": [subject],
            },
        )
        (election,) = _load_all(self.dir / "rbac-leader-election-role.yaml")
        assert election["kind"] == "Role", election["kind"]
        name = NAME_PREFIX + election["metadata"]["name"]
        roles = f"{_RBAC}/namespaces/{JOBSET_NAMESPACE}"
        admin.apply(f"{roles}/roles", {**election, "metadata": {"name": name, "namespace": JOBSET_NAMESPACE}})
        admin.apply(
            f"{roles}/rolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": name, "namespace": JOBSET_NAMESPACE},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [subject],
            },
        )

    def _run(self) -> None:
        certs = self.workdir / "webhook-certs"
        certs.mkdir(parents=True, exist_ok=True)
        issued = self.cp.issue(
            "jobset-webhook", common_name="jobset-webhook", server=True, hosts=("127.0.0.1",)
        )
        (certs / "tls.crt").write_bytes(issued.cert.read_bytes())
        (certs / "tls.key").write_bytes(issued.key.read_bytes())
        (certs / "tls.key").chmod(0o600)
        self.webhook_port, self.health_port = free_port(), free_port()
        config = {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": True, "resourceNamespace": JOBSET_NAMESPACE},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
        }
        path = self.workdir / "jobset-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        proc = Proc(
            "jobset-controller",
            [
                str(self.dir / "jobset-controller"),
                f"--config={path}",
                f"--kubeconfig={self.cp.kubeconfig(JOBSET_USER_KEY)}",
                "--zap-devel=false",
                "--zap-log-level=info",
            ],
            self.cp.logs,
        )
        proc.start()
        self.cp.procs.append(proc)  # stopped with the control plane too, should stop() not run
        self.proc = proc
        ready = f"http://127.0.0.1:{self.health_port}/readyz"
        proc.wait_until(
            lambda: int(urllib.request.urlopen(ready, timeout=5).status) == 200,
            timeout_s=START_TIMEOUT_S,
            what="a ready JobSet controller (/readyz: webhook server started)",
        )

    def webhook_configurations(self) -> list[dict[str, Any]]:
        """The manifests' webhook configurations, patched as config/components/webhook does, pointed at the
        controller's loopback port and trusting the control plane's CA."""
        ca = base64.b64encode(self.cp.ca_file.read_bytes()).decode()
        out = []
        for doc in _load_all(self.dir / "webhook-manifests.yaml"):
            _collection, patch_file = _WEBHOOK_KINDS[doc["kind"]]
            _json_patch(doc, yaml.safe_load((self.dir / patch_file).read_text()))
            doc["metadata"] = {"name": NAME_PREFIX + doc["metadata"]["name"]}
            for hook in doc["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{self.webhook_port}{path}", "caBundle": ca}
            out.append(doc)
        return out

    def _register_webhooks(self, admin: Api) -> None:
        for doc in self.webhook_configurations():
            collection, _patch = _WEBHOOK_KINDS[doc["kind"]]
            admin.apply(f"{_ADMISSION}/{collection}", doc)
            self.webhooks.append((collection, doc["metadata"]["name"]))


def jobset_controller_for(cp: ControlPlane, workdir: Path) -> Iterator[JobSetController]:
    """Start the controller on `cp` for as long as the generator is held (the session fixture's body)."""
    controller = JobSetController(cp, workdir)
    try:
        controller.start()
        yield controller
    finally:
        controller.stop()


def delete_jobset(api: Api, namespace: str, name: str) -> None:
    """Delete a JobSet with its Jobs and pods (foreground: the garbage collector removes the dependents)."""
    try:
        api.request("DELETE", f"{jobsets_path(namespace)}/{name}", {"propagationPolicy": "Foreground"})
    except ApiError as exc:
        if exc.status != 404:
            raise


__all__ = [
    "CRD_NAME",
    "JOBSET_NAME_LABEL",
    "JOBSET_USER",
    "JOBSET_USER_KEY",
    "PRIORITY_LABEL",
    "REPLICATED_JOB_LABEL",
    "JobSetController",
    "delete_jobset",
    "jobset_controller_for",
    "jobsets_path",
    "missing_reason",
]
