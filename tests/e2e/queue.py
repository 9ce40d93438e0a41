"""The queue controller live: two `gpunode queue` replicas, the extender, kube-scheduler and simulated nodes.

build_queue_cluster starts, on the session's real control plane:

- the chart's RBAC for the extender, the agent and the queue controller (helm/gpunode rendered with
  queue.enabled and queue.ha.enabled: its ServiceAccount, ClusterRole and binding, and the Role and
  RoleBindings of its Lease and of its usage ConfigMap), each component acting as its chart's service
  account;
- `gpunode extender` as the chart runs it (HTTPS with client certificates, --bind) with --queue-config
  naming the controllers' file and --admission-key-file the key of the chart's Secret, which the
  controllers read too (QueueCluster.key_file);
- two SimNodes (four simulated T4s each, a real `gpunode agent --backend sim` publishing
  gpunode.io/gpu-state) and a Reaper doing the kubelet's part when a pod terminates;
- kube-scheduler configured from gpunode/examples/kube-scheduler-config.yaml (the extender's entry);
- two `gpunode queue` controllers started with the arguments of the chart's Deployment (leader
  election on the chart's Lease), both reading one configuration file (a ConfigMap volume's file).

The Reaper: with no kubelet, a pod evicted or deleted with a grace period would stay terminating for
ever and its GPUs held. It force-deletes terminating pods (remembering the last state it saw: the
preemption notice is on it) and takes the devices of pods gone from the pod-resources answers of the
SimNode, so its agent publishes them free, as a kubelet does once the containers stopped.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import sys
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from gpunode.contract.names import (
    GANG_LABEL,
    GANG_SIZE_LABEL,
    GPU_RESOURCE,
    NODE_STATE_ANNOTATION,
    QUEUE_LABEL,
)
from gpunode.contract.nodestate import decode
from tests.e2e import chart
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.controlplane import ROOT, ControlPlane
from tests.e2e.objects import create_pod, ensure_namespace, pod_body, pod_events
from tests.e2e.pki import CertFiles
from tests.e2e.procs import Poller, Proc
from tests.e2e.simnodes import SimNode, seeded_t4, state_published
from tests.ports import free_port

NAMESPACE = "e2e-queue"
NODES = ("e2e-queue-n1", "e2e-queue-n2")  # four T4s each
WAIT_S = 180.0  # generous: two shared cores
LEASE = f"{chart.RELEASE}-gpunode-queue"
USAGE = f"{LEASE}-usage"  # the ConfigMap the leader saves the fair-share usage to
NOTICE_S = 3
CHART_VALUES = {
    "extender": {
        "enabled": True,
        "bind": True,
        "nodeCacheCapable": True,
        "tls": {"enabled": True, "existingSecret": "gpunode-extender-tls"},
    },
    "queue": {
        "enabled": True,
        "replicas": 2,
        "configReload": "1s",
        "resync": "1s",
        "usageSave": "1s",
        "ha": {"enabled": True, "leaseDuration": "4s", "renewDeadline": "3s", "retryPeriod": "1s"},
    },
}
# team-a and team-b are guaranteed half the cluster each; team-c nothing, and may borrow 1 GPU at most.
QUEUE_CONFIG = f"""\
queues:
  - name: org
    children:
      - {{name: team-a, guarantee: {{gpu: 4}}}}
      - {{name: team-b, guarantee: {{gpu: 4}}}}
      - {{name: team-c, borrowLimit: {{gpu: 1}}}}
preemption: {{notice: {NOTICE_S}s, minRuntime: 0s, reclaim: true, priority: false}}
backfill: {{enabled: false}}
"""
# Refused (a weight must be positive); taken, it would also drop team-b and team-c.
BAD_QUEUE_CONFIG = """\
queues:
  - name: org
    children:
      - {name: team-a, weight: -1}
"""
REFUSED_LINE = "queue configuration refused, the running one stays"
ROLE_PATHS = {
    "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{chart.NAMESPACE}/roles",
    "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{chart.NAMESPACE}/rolebindings",
}
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback")


class Reaper(Poller):
    """The kubelet's part at pod termination on the SimNodes (see the module docstring)."""

    def __init__(self, api: Api, nodes: Mapping[str, SimNode]) -> None:
        """Watch NAMESPACE's pods through `api`, releasing devices on `nodes`."""
        super().__init__("reaper")
        self.api = api
        self.nodes = nodes
        self.terminated: dict[str, dict[str, Any]] = {}  # namespace/name -> the pod last seen terminating
        self.errors: list[str] = []

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.reap_once()
            except (ApiError, OSError) as exc:
                self.errors.append(str(exc))

    def reap_once(self) -> None:
        """Force-delete terminating pods; release the devices of pods that are gone."""
        # The devices held before the list: each was admitted from a list that showed its pod, so a pod
        # missing from the list below is gone (names are never reused here).
        held = {n: list(node.admitter._held) for n, node in self.nodes.items() if node.admitter}
        pods = self.api.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        live = set()
        for pod in pods:
            meta = pod["metadata"]
            key = f"{meta['namespace']}/{meta['name']}"
            if meta.get("deletionTimestamp"):
                self.terminated[key] = pod
                with contextlib.suppress(ApiError):  # gone meanwhile, or a new pod of that name
                    self.api.request(
                        "DELETE",
                        f"/api/v1/namespaces/{NAMESPACE}/pods/{meta['name']}",
                        {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
                    )
            else:
                live.add(key)
        for name, entries in held.items():
            node = self.nodes[name]
            assert node.admitter is not None
            gone = [h for h in entries if h.namespace == NAMESPACE and f"{h.namespace}/{h.pod}" not in live]
            for h in gone:
                node.admitter._held.remove(h)
            if gone:
                node.podres.set_pods(list(node.admitter._held))


@dataclass
class QueueCluster:
    """What build_queue_cluster started."""

    cp: ControlPlane
    tmp: Path
    docs: list[dict[str, Any]]
    config: Path
    nodes: dict[str, SimNode]
    extender: Proc
    scheduler: Proc
    reaper: Reaper
    key_file: Path  # the chart's admission key Secret, as both the controllers and the extender read it
    controllers: dict[str, Proc] = field(default_factory=dict)  # identity -> process
    metrics_ports: dict[str, int] = field(default_factory=dict)  # identity -> its /metrics port

    def start_controller(self, identity: str) -> Proc:
        """Start one `gpunode queue` with the chart Deployment's arguments; wait until it serves /healthz."""
        dep = next(d for d in self.docs if d["kind"] == "Deployment" and d["metadata"]["name"] == LEASE)
        args = [str(a) for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]]
        port = free_port()
        args[args.index("--config") + 1] = str(self.config)
        args[args.index("--metrics-listen") + 1] = f"127.0.0.1:{port}"
        args[args.index("--admission-key-file") + 1] = str(self.key_file)
        assert args[args.index("--leader-elect-lease-name") + 1] == LEASE, args
        args += [
            "--leader-elect-identity", identity,
            "--kube-api", self.cp.server,
            "--kube-token-file", str(self.cp.token_file("queue")),
            "--kube-ca-file", str(self.cp.ca_file),
        ]  # fmt: skip
        proc = Proc(f"gpunode-queue-{identity}", [sys.executable, "-m", "gpunode.cli", *args], self.cp.logs)
        proc.start()
        self.cp.procs.append(proc)
        self.controllers[identity] = proc
        self.metrics_ports[identity] = port
        proc.wait_until(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200,
            timeout_s=WAIT_S,
            what="its /healthz",
        )
        return proc

    def saved_usage(self) -> dict[str, Any] | None:
        """The fair-share usage the leader last saved (usage.json of the ConfigMap), or None."""
        try:
            cm = self.cp.api().get(f"/api/v1/namespaces/{chart.NAMESPACE}/configmaps/{USAGE}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return dict(json.loads(cm["data"]["usage.json"]))

    def metric(self, identity: str, name: str, queue: str) -> float:
        """One queue's value of a gauge of the controller `identity` (its /metrics)."""
        url = f"http://127.0.0.1:{self.metrics_ports[identity]}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        prefix = f'{name}{{queue="{queue}"}} '
        return float(next(ln[len(prefix) :] for ln in text.splitlines() if ln.startswith(prefix)))

    def leader(self) -> str:
        """The identity holding the controllers' Lease ("" when none)."""
        lease = self.cp.api().get(f"/apis/coordination.k8s.io/v1/namespaces/{chart.NAMESPACE}/leases/{LEASE}")
        return str(lease["spec"].get("holderIdentity") or "")

    def error_lines(self) -> dict[str, list[str]]:
        """ERROR/CRITICAL/Traceback lines of every gpunode process's log, by log name."""
        procs = [
            *self.controllers.values(),
            self.extender,
            *(n.agent for n in self.nodes.values() if n.agent),
        ]
        out: dict[str, list[str]] = {}
        for p in procs:
            lines = [ln for ln in p.log.read_text(errors="replace").splitlines() if ERROR_LINE.search(ln)]
            if lines:
                out[p.log.name] = lines
        return out


def _apply_chart_rbac(cp: ControlPlane, docs: list[dict[str, Any]]) -> None:
    admin = cp.api()
    ensure_namespace(admin, chart.NAMESPACE)
    ensure_namespace(admin, NAMESPACE)
    for part in ("extender", "agent", "queue"):
        chart.apply_rbac(admin, docs, part)
    names = (f"{LEASE}-leader", USAGE)  # the Lease's and the usage ConfigMap's
    roles = [d for d in docs if d["kind"] in ROLE_PATHS and d["metadata"]["name"] in names]
    assert sorted(d["kind"] for d in roles) == ["Role", "Role", "RoleBinding", "RoleBinding"], roles
    for doc in roles:
        admin.apply(ROLE_PATHS[doc["kind"]], doc)


def _admission_key(docs: list[dict[str, Any]], tmp: Path) -> Path:
    """The key of the chart's Secret <fullname>-queue-admission-key, written where both sides read it."""
    (secret,) = [
        d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{LEASE}-admission-key"
    ]
    path = tmp / "admission-key"
    path.write_bytes(base64.b64decode(secret["data"]["key"]))
    return path


def _start_extender(cp: ControlPlane, config: Path, hold: str, key_file: Path) -> tuple[Proc, int, CertFiles]:
    serving = cp.issue("queue-extender", common_name="gpunode-extender", server=True, hosts=("127.0.0.1",))
    client = cp.issue("queue-scheduler", common_name="kube-scheduler", client=True)
    port, health = free_port(), free_port()
    extender = Proc(
        "gpunode-extender-queue",
        [
            sys.executable, "-m", "gpunode.cli", "extender",
            "--listen", f"127.0.0.1:{port}", "--health-listen", f"127.0.0.1:{health}",
            "--kube-api", cp.server, "--kube-token-file", str(cp.token_file("extender")),
            "--kube-ca-file", str(cp.ca_file), "--node-refresh", "1s", "--bind",
            "--queue-config", str(config), "--queue-hold", hold, "--admission-key-file", str(key_file),
            "--tls-cert-file", str(serving.cert), "--tls-key-file", str(serving.key),
            "--client-ca-file", str(cp.ca_file), "--allowed-client-names", "kube-scheduler",
        ],
        cp.logs,
    ).start()  # fmt: skip
    cp.procs.append(extender)
    extender.wait_until(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=5).status == 200,
        timeout_s=WAIT_S,
        what="ready extender",
    )
    return extender, port, client


def build_queue_cluster(cp: ControlPlane, tmp: Path, *, hold: str = "error") -> QueueCluster:
    """Start everything (see the module docstring) but the controllers; stop_queue_cluster ends it all.
    `hold`: the extender's --queue-hold (the chart's default, error, unless a test compares the modes)."""
    docs = chart.render(CHART_VALUES, tmp)
    _apply_chart_rbac(cp, docs)
    config = tmp / "queues.yaml"
    config.write_text(QUEUE_CONFIG)
    key_file = _admission_key(docs, tmp)
    extender, port, client = _start_extender(cp, config, hold, key_file)
    nodes = {name: SimNode(cp, name, tmp / name, profile=str(seeded_t4(tmp, name))) for name in NODES}
    try:
        for node in nodes.values():
            node.start()
        admin = cp.api()
        for name in nodes:
            eventually(
                partial(state_published, admin, name),
                timeout_s=WAIT_S,
                what=f"{name}'s published GPU state",
            )
        entries = yaml.safe_load((ROOT / "gpunode/examples/kube-scheduler-config.yaml").read_text())[
            "extenders"
        ]
        for entry in entries:  # the device-plugin entry and the one for pods with DRA claims
            entry["urlPrefix"] = f"https://127.0.0.1:{port}"
            entry["tlsConfig"] = {
                "certFile": str(client.cert),
                "keyFile": str(client.key),
                "caFile": str(cp.ca_file),
            }
        scheduler = cp.start_scheduler(entries, name="kube-scheduler-queue")
    except BaseException:
        for node in nodes.values():
            node.stop()
        extender.stop()
        raise
    reaper = Reaper(cp.api(), nodes).start()
    return QueueCluster(cp, tmp, docs, config, nodes, extender, scheduler, reaper, key_file)


def delete_all_pods(cluster: QueueCluster) -> None:
    """Delete the namespace's pods at once and wait until the nodes publish every GPU free."""
    admin = cluster.cp.api()
    # First every bound pod published as holding its GPUs: the agent counts a GPU it just allocated held
    # until pod-resources lists its pod (for up to 30 s), so a pod deleted before that keeps it held.
    eventually(partial(bound_published, admin), timeout_s=WAIT_S, what="every bound pod published")
    for pod in admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]:
        admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}?gracePeriodSeconds=0")
    eventually(
        lambda: not admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"],
        timeout_s=WAIT_S,
        what="every pod deleted",
    )
    eventually(lambda: not held_gpus(admin), timeout_s=WAIT_S, what="every GPU published free")


def bound_published(api: Api) -> bool:
    """Whether every bound pod of NAMESPACE is listed in its node's published GPU state."""
    pods = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
    bound = {
        f"{NAMESPACE}/{p['metadata']['name']}"
        for p in pods
        if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
    }
    listed = {pod for holders in held_gpus(api).values() for pod in holders}
    return bound <= listed


def stop_queue_cluster(cluster: QueueCluster) -> None:
    """Stop the controllers, kube-scheduler, the extender, the reaper and the nodes; delete the pods."""
    for proc in cluster.controllers.values():
        proc.stop()
    cluster.scheduler.stop()
    cluster.extender.stop()
    cluster.reaper.stop()
    for node in cluster.nodes.values():
        node.stop()
    with contextlib.suppress(ApiError, OSError):
        admin = cluster.cp.api()
        for pod in admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]:
            admin.delete(
                f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}?gracePeriodSeconds=0"
            )
    # What the controllers leave in the namespace, so that the next tier on this control plane (the same
    # namespace, the same pod names) starts as on a fresh cluster: the pods' Events, the saved fair-share
    # usage and the Lease.
    for path in (
        f"/api/v1/namespaces/{NAMESPACE}/events",
        f"/api/v1/namespaces/{chart.NAMESPACE}/configmaps/{USAGE}",
        f"/apis/coordination.k8s.io/v1/namespaces/{chart.NAMESPACE}/leases/{LEASE}",
    ):
        with contextlib.suppress(ApiError, OSError):
            cluster.cp.api().delete(path)


# ----- pods and what the API server says about them ----------------------------------------------------


def queued_pod(name: str, queue: str, gpus: int, *, gang: str = "", size: int = 0) -> dict[str, Any]:
    """A pod of `gpus` whole GPUs waiting in `queue` (a member of `gang` of `size` when given)."""
    body = pod_body(name, limits={GPU_RESOURCE: str(gpus)})
    labels = {QUEUE_LABEL: queue}
    if gang:
        labels |= {GANG_LABEL: gang, GANG_SIZE_LABEL: str(size)}
    body["metadata"]["labels"] = labels
    return body


def submit(api: Api, *bodies: dict[str, Any]) -> None:
    """Create the pods."""
    for body in bodies:
        create_pod(api, NAMESPACE, body)


def held_gpus(api: Api) -> dict[str, tuple[str, ...]]:
    """GPU UUID -> the pods the nodes' published state says hold it (held GPUs only)."""
    out: dict[str, tuple[str, ...]] = {}
    for name in NODES:
        text = api.get(f"/api/v1/nodes/{name}")["metadata"].get("annotations", {}).get(NODE_STATE_ANNOTATION)
        if text:
            out |= {g.uuid: tuple(g.pods) for g in decode(text, node=name).gpus if g.pods}
    return out


def events(api: Api, pod: str, reason: str) -> list[dict[str, Any]]:
    """The Events of one reason about a pod."""
    return [e for e in pod_events(api, NAMESPACE, pod) if e.get("reason") == reason]


def event_text(event: Mapping[str, Any]) -> str:
    """An Event's message (core/v1 `message`, events.k8s.io `note`)."""
    return str(event.get("message") or event.get("note") or "")


def event_source(event: Mapping[str, Any]) -> str:
    """Who wrote an Event (the controller puts its identity in source.host / reportingInstance)."""
    return str((event.get("source") or {}).get("host") or event.get("reportingInstance") or "")
