"""A real Kubernetes control plane for the end-to-end tests: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler, as scripts/get-kube.sh builds them (Kubernetes 1.36, etcd 3.6).

The binaries come from .tools/kube/bin (or $GPUNODE_KUBE_DIR/bin). ControlPlane runs them from a
temporary directory on free loopback ports:

- etcd, plain HTTP on 127.0.0.1;
- kube-apiserver on its secure port, with a serving certificate from a throw-away CA, static bearer
  tokens (--token-auth-file: one per User given), the Node and RBAC authorizers, the NodeRestriction
  admission plugin on top of the default ones (ServiceAccount included), service-account tokens signed
  with a generated key pair, and the DRA features of FEATURE_GATES (resource.k8s.io/v1 is served by
  default; DeviceTaintRules through resource.k8s.io/v1beta2);
- kube-controller-manager with its default controllers (node lifecycle and taint eviction, garbage
  collector, Job, ResourceClaim, device-taint eviction, service accounts and their tokens, root-ca
  publisher, ...), each controller with its own service-account credentials, as kubeadm runs it;
- kube-scheduler (started per test or module with start_scheduler, since its extenders are part of its
  configuration) from a kubescheduler.config.k8s.io/v1 KubeSchedulerConfiguration: the chart's own one
  given whole, or one built from an extenders list.

Every component logs to <workdir>/logs/<name>.log; a start failure raises StartError carrying the end of
that log. stop() ends everything (SIGTERM, then SIGKILL), and tests.e2e.procs stops anything left at exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import ssl
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.api import Api
from tests.e2e.pki import CertFiles, CertificateAuthority, service_account_keys
from tests.e2e.procs import Proc, StartError
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
# The Kubernetes minor version the tests run against: 36, which scripts/get-kube.sh builds by default, or
# the one GPUNODE_KUBE_VERSION names (1.34, 1.37: `GPUNODE_KUBE_VERSION=1.34 scripts/get-kube.sh` builds it
# and links it at .tools/kube-1.34).
DEFAULT_KUBE_MINOR = 36
_KUBE_VERSION_ENV = re.fullmatch(r"1\.(\d+)", os.environ.get("GPUNODE_KUBE_VERSION", "").strip())
KUBE_MINOR = int(_KUBE_VERSION_ENV.group(1)) if _KUBE_VERSION_ENV else DEFAULT_KUBE_MINOR
CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
START_TIMEOUT_S = 120.0  # generous: two shared cores, and the API server's first start builds its caches
SCHEDULER_API = "kubescheduler.config.k8s.io/v1"
# The DRA features this cluster runs with, on every component that reads them. In 1.36 all but
# DRADeviceTaintRules are beta and on by default (set anyway, so that the list says what is on);
# DRADeviceTaintRules is beta and off by default, and its API (resource.k8s.io/v1beta2 DeviceTaintRule)
# too: RUNTIME_CONFIG serves it.
FEATURE_GATES = {
    "DRAConsumableCapacity": True,
    "DRAPartitionableDevices": True,
    "DRADeviceTaints": True,
    "DRADeviceTaintRules": True,
    "DRAExtendedResource": True,
    "ResourceHealthStatus": True,
}
RUNTIME_CONFIG = "resource.k8s.io/v1beta2/devicetaintrules=true"
# GPUNODE_KUBE_VERSION=1.34: these gates are alpha there, and DeviceTaintRule is served from v1alpha3 only.
if KUBE_MINOR == 34:
    del FEATURE_GATES["DRADeviceTaintRules"]  # 1.35 split it from DRADeviceTaints
    RUNTIME_CONFIG = "resource.k8s.io/v1alpha3=true"
# The API server's audit log keeps pod evictions (who, which pod, the answer's code, the Eviction sent),
# nothing else.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Request", "resources": [{"group": "", "resources": ["pods/eviction"]}]},
        {"level": "None"},
    ],
}


def feature_gates_flag() -> str:
    """--feature-gates for every component (FEATURE_GATES)."""
    return "--feature-gates=" + ",".join(f"{k}={str(v).lower()}" for k, v in sorted(FEATURE_GATES.items()))


def kube_dir() -> Path:
    """Where scripts/get-kube.sh left the binaries and the image ($GPUNODE_KUBE_DIR overrides)."""
    named = os.environ.get("GPUNODE_KUBE_DIR")
    if named:
        return Path(named).resolve()
    return ROOT / ".tools" / ("kube" if KUBE_MINOR == DEFAULT_KUBE_MINOR else f"kube-1.{KUBE_MINOR}")


def kube_version() -> str:
    """The Kubernetes version get-kube.sh built (its VERSIONS file), e.g. "v1.36.3"; "" when unknown."""
    try:
        lines = (kube_dir() / "VERSIONS").read_text().splitlines()
    except OSError:
        return ""
    versions = dict(line.split(" ", 1) for line in lines if " " in line)
    return versions.get("kubernetes", "")


def missing_reason(binaries: Sequence[str] = CONTROL_PLANE_BINARIES) -> str | None:
    """Why the control plane cannot run here, or None when it can."""
    bindir = kube_dir() / "bin"
    missing = [b for b in binaries if not os.access(bindir / b, os.X_OK)]
    if missing:
        return (
            f"no Kubernetes 1.{KUBE_MINOR} binaries ({', '.join(missing)}) in {bindir}: "
            f"run {_get_kube_command()} (it builds them from Go modules) or set GPUNODE_KUBE_DIR"
        )
    version = kube_version()
    if not version.startswith(f"v1.{KUBE_MINOR}."):
        return (
            f"{kube_dir()} holds Kubernetes {version or '(no VERSIONS file)'}, not 1.{KUBE_MINOR}: "
            f"run {_get_kube_command()} again (it links {kube_dir()} to what it builds)"
        )
    return None


def _get_kube_command() -> str:
    if KUBE_MINOR == DEFAULT_KUBE_MINOR:
        return "scripts/get-kube.sh"
    return f"GPUNODE_KUBE_VERSION=1.{KUBE_MINOR} scripts/get-kube.sh"


@dataclass(frozen=True)
class User:
    """A user the API server knows by a static bearer token."""

    name: str
    groups: tuple[str, ...] = ()


ADMIN = User("e2e-admin", ("system:masters",))
SCHEDULER = User("system:kube-scheduler")
CONTROLLER_MANAGER = User("system:kube-controller-manager")


def service_account_user(namespace: str, name: str) -> User:
    """How the API server names a service account (what the chart's RBAC bindings grant rights to)."""
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}"),
    )


class ControlPlane:
    """etcd + kube-apiserver (+ kube-scheduler on demand) in `workdir` (see the module docstring)."""

    def __init__(self, workdir: Path, users: Mapping[str, User] | None = None) -> None:
        """Plan a control plane; `users` maps a key (used with api(), token_file()) to a User."""
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.bin = kube_dir() / "bin"
        self.users: dict[str, User] = {
            "admin": ADMIN,
            "scheduler": SCHEDULER,
            "controller-manager": CONTROLLER_MANAGER,
            **(users or {}),
        }
        self.tokens = {key: secrets.token_hex(16) for key in self.users}
        self.procs: list[Proc] = []
        self.ca: CertificateAuthority | None = None
        self.sa_keys: CertFiles | None = None
        self.controller_manager: Proc | None = None
        self.api_port = 0
        self.etcd_port = 0

    # -- start and stop --------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        """Start etcd, kube-apiserver and kube-controller-manager; wait until the API server is ready and
        the controller manager healthy; StartError if not."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ca = CertificateAuthority(self.workdir / "pki")
        try:
            self._start_etcd()
            self._start_apiserver()
            self._start_controller_manager()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self) -> None:
        self.etcd_port, peer = free_port(), free_port()
        client, peer_url = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer}"
        etcd = self._proc(
            "etcd",
            [
                self.bin / "etcd",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--log-level=warn",
            ],
        )
        etcd.wait_until(lambda: _http_ok(f"{client}/health"), timeout_s=START_TIMEOUT_S, what="healthy etcd")

    def _start_apiserver(self) -> None:
        assert self.ca is not None
        self.api_port = free_port()
        serving = self.ca.issue(
            "apiserver",
            common_name="kube-apiserver",
            server=True,
            hosts=("127.0.0.1", "localhost", "10.0.0.1"),
        )
        sa = self.sa_keys = service_account_keys(self.workdir / "pki")
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(
            "".join(
                f'{self.tokens[k]},{u.name},{u.name},"{",".join(u.groups)}"\n' for k, u in self.users.items()
            )
        )
        tokens.chmod(0o600)
        audit_policy = self.workdir / "audit-policy.yaml"
        audit_policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        apiserver = self._proc(
            "kube-apiserver",
            [
                self.bin / "kube-apiserver",
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # 1.36 refuses a loopback address in the kubernetes Service's endpoints: do not keep them
                # (nothing here reaches the API server through that Service).
                "--endpoint-reconciler-type=none",
                f"--secure-port={self.api_port}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={self.ca.cert}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--enable-admission-plugins=NodeRestriction",
                feature_gates_flag(),
                f"--runtime-config={RUNTIME_CONFIG}",
                "--allow-privileged=true",
                "--profiling=false",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--audit-policy-file={audit_policy}",
                f"--audit-log-path={self.audit_log}",
                "--v=1",
            ],
        )
        admin = self.api()
        apiserver.wait_until(lambda: admin.ok("/readyz"), timeout_s=START_TIMEOUT_S, what="ready API server")

    def _start_controller_manager(self) -> None:
        assert self.ca is not None and self.sa_keys is not None
        port = free_port()
        kubeconfig = self.kubeconfig("controller-manager")
        manager = self._proc(
            "kube-controller-manager",
            [
                self.bin / "kube-controller-manager",
                f"--kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'controller-manager-certs'}",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.sa_keys.key}",
                f"--root-ca-file={self.ca.cert}",
                f"--cluster-signing-cert-file={self.ca.cert}",
                f"--cluster-signing-key-file={self.workdir / 'pki' / 'ca.key'}",
                "--leader-elect=false",
                feature_gates_flag(),
                "--profiling=false",
                "--v=1",
            ],
        )
        manager.wait_until(
            lambda: _https_ok(f"https://127.0.0.1:{port}/healthz"),
            timeout_s=START_TIMEOUT_S,
            what="healthy kube-controller-manager",
        )
        self.controller_manager = manager

    def start_scheduler(
        self,
        extenders: Sequence[Mapping[str, Any]] = (),
        *,
        name: str = "kube-scheduler",
        profiles: Sequence[Mapping[str, Any]] = ({"schedulerName": "default-scheduler"},),
        config: Mapping[str, Any] | None = None,
    ) -> Proc:
        """Start a kube-scheduler and wait until healthy. Its configuration is `config` when given (a whole
        KubeSchedulerConfiguration, such as the chart's: used as it is, with only what the chart leaves to
        the cluster added: clientConnection and leaderElection), else one with these `extenders` entries
        and `profiles`. Either way kubescheduler.config.k8s.io/v1."""
        if config is None:
            config = {
                "apiVersion": SCHEDULER_API,
                "kind": "KubeSchedulerConfiguration",
                "profiles": [dict(p) for p in profiles],
                "extenders": [dict(e) for e in extenders],
            }
        written = {
            **config,
            "clientConnection": {"kubeconfig": str(self.kubeconfig("scheduler"))},
            "leaderElection": {"leaderElect": False},
        }
        for key in ("clientConnection", "leaderElection"):
            assert key not in config, f"the configuration given sets {key}: the harness sets it"
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(written, sort_keys=False))
        port = free_port()
        scheduler = self._proc(
            name,
            [
                self.bin / "kube-scheduler",
                f"--config={path}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / (name + '-certs')}",
                feature_gates_flag(),
                "--v=2",
            ],
        )
        scheduler.wait_until(
            lambda: _https_ok(f"https://127.0.0.1:{port}/healthz"),
            timeout_s=START_TIMEOUT_S,
            what="healthy kube-scheduler",
        )
        return scheduler

    def stop(self) -> None:
        """Stop every component, newest first (SIGTERM, then SIGKILL)."""
        while self.procs:
            self.procs.pop().stop()

    def _proc(self, name: str, argv: Sequence[str | Path]) -> Proc:
        proc = Proc(name, [str(a) for a in argv], self.logs).start()
        self.procs.append(proc)
        return proc

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines; pod evictions only, see AUDIT_POLICY)."""
        return self.logs / "audit.jsonl"

    def audit_events(self) -> list[dict[str, Any]]:
        """The audit events logged so far (a line still being written is left for the next read)."""
        try:
            lines = self.audit_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        events = []
        for line in lines:
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
        return events

    # -- credentials -----------------------------------------------------------------------------

    @property
    def server(self) -> str:
        """The API server's URL."""
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def ca_file(self) -> Path:
        """The CA bundle that verifies the API server (and every certificate issued by issue())."""
        assert self.ca is not None, "start() first"
        return self.ca.cert

    def issue(self, name: str, **kwargs: Any) -> CertFiles:
        """A certificate from the control plane's CA (see CertificateAuthority.issue)."""
        assert self.ca is not None, "start() first"
        return self.ca.issue(name, **kwargs)

    def api(self, user: str = "admin") -> Api:
        """A JSON client acting as `user` (a key of the users given)."""
        return Api(self.server, self.tokens[user], self.workdir / "pki" / "ca.crt")

    def token_file(self, user: str) -> Path:
        """A file holding `user`'s bearer token (gpunode's --kube-token-file)."""
        path = self.workdir / "tokens" / user
        path.parent.mkdir(exist_ok=True)
        path.write_text(self.tokens[user])
        path.chmod(0o600)
        return path

    def kubeconfig(self, user: str) -> Path:
        """A kubeconfig for `user` (kube-scheduler's, the kubelet's, or gpunode's --kubeconfig)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
            "current-context": "e2e",
        }
        path = self.workdir / "kubeconfigs" / f"{user}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def logs_tail(self, lines: int = 30) -> str:
        """The end of every component's log, for a failing test's report."""
        parts = []
        for log in sorted(self.logs.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"----- {log.name} -----\n" + "\n".join(text))
        return "\n".join(parts)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return int(resp.status) == 200


def _https_ok(url: str) -> bool:
    """A component's /healthz on its secure port (a self-signed certificate: not verified; the path is
    one the components serve to anyone)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
        return int(resp.status) == 200


__all__ = [
    "ADMIN",
    "CONTROLLER_MANAGER",
    "FEATURE_GATES",
    "SCHEDULER",
    "ControlPlane",
    "StartError",
    "User",
    "kube_dir",
    "kube_version",
    "missing_reason",
    "service_account_user",
]
