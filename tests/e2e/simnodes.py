"""Nodes with a real `gpunode agent --backend sim` and a kubelet stand-in, on the real API server.

SimNode is one Node without a real kubelet: the Node object is created and kept Ready by the test, and
its GPUs are served by a real agent subprocess (the sim backend, the chart's agent RBAC, publishing to
the real API server). The kubelet's part is played by tests.fakes.kubelet.KubeletStandIn over the
device-plugin sockets, and by NodeKubelet here, which does for the pods bound to the node what the
kubelet's device manager does on admission, one pod at a time:

- it polls the pods bound to the node (fieldSelector spec.nodeName) through the API server, and takes
  the new ones in the order they were bound (their resourceVersion: a pod not yet admitted was last
  written by its binding), as the kubelet admits in the order its watch delivers the bindings;
- for each new Pending pod, per container (init containers first) and per resource the agent serves,
  it offers the healthy device IDs not yet allocated to GetPreferredAllocation, checks the answer, and
  calls Allocate with it;
- it serves what it allocated over pod-resources (tests.fakes.podresources), which the agent reads;
- and it marks the pod Running (a status patch), as the kubelet does once the containers start.

The Node's capacity and allocatable are written from the plugins' device lists, as the kubelet does,
so kube-scheduler counts the extended resources. Each admission is recorded (Admission) for the test.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpunode.contract.names import NODE_STATE_ANNOTATION
from gpunode.node.kubelet.podresources import ContainerDevices
from tests.e2e.api import STRATEGIC, Api, ApiError
from tests.e2e.controlplane import ROOT, ControlPlane
from tests.e2e.objects import BASE_CAPACITY, create_fake_node, write_ready_status
from tests.e2e.procs import Poller, Proc
from tests.fakes.kubelet import KubeletStandIn, short_socket_dir
from tests.fakes.podresources import PodResourcesStandIn
from tests.ports import free_port

POLL_S = 0.2
WAIT_S = 120.0  # generous: two shared cores
T4_PROFILE = ROOT / "gpunode/node/devices/simnode/profiles/t4.yaml"


def seeded_t4(tmp: Path, node: str) -> Path:
    """The bundled T4 profile with the node's name as its seed: GPU UUIDs unique across the nodes."""
    profile = yaml.safe_load(T4_PROFILE.read_text())
    profile["seed"] = node
    path = tmp / f"{node}-t4.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def state_published(api: Api, node: str) -> bool:
    """Whether the node's agent has published its gpunode.io/gpu-state annotation."""
    return NODE_STATE_ANNOTATION in api.get(f"/api/v1/nodes/{node}")["metadata"].get("annotations", {})


@dataclass
class Admission:
    """What the kubelet stand-in did for one pod."""

    pod: str  # namespace/name
    node: str
    devices: dict[str, list[str]] = field(default_factory=dict)  # resource -> device IDs allocated
    visible: list[str] = field(default_factory=list)  # NVIDIA_VISIBLE_DEVICES of the Allocate answers
    error: str = ""  # why it could not be admitted ("" when it was)
    at: float = 0.0  # monotonic time of the admission


class NodeKubelet(Poller):
    """The kubelet's admission of bound pods for one SimNode (see the module docstring)."""

    def __init__(self, api: Api, node: str, kubelet: KubeletStandIn, podres: PodResourcesStandIn) -> None:
        """Admit the pods bound to `node` through these stand-ins, reading and patching pods with `api`."""
        super().__init__(f"kubelet {node}")
        self.api = api
        self.node = node
        self.kubelet = kubelet
        self.podres = podres
        self.admissions: dict[str, Admission] = {}  # by pod UID
        self.errors: list[str] = []
        self._held: list[ContainerDevices] = []

    def _run(self) -> None:
        selector = f"spec.nodeName={self.node}"
        while not self._stop.wait(POLL_S):
            try:
                pods = self.api.get(f"/api/v1/pods?fieldSelector={selector}")["items"]
            except (ApiError, OSError) as exc:
                self.errors.append(f"list pods: {exc}")
                continue
            for pod in sorted(pods, key=lambda p: int(p["metadata"]["resourceVersion"])):
                uid = pod["metadata"]["uid"]
                if uid in self.admissions or pod.get("status", {}).get("phase") not in (None, "Pending"):
                    continue
                self.admissions[uid] = self._admit(pod)

    def _admit(self, pod: Mapping[str, Any]) -> Admission:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        record = Admission(key, self.node, at=time.monotonic())
        spec = pod["spec"]
        try:
            for c in [*(spec.get("initContainers") or ()), *spec["containers"]]:
                limits = (c.get("resources") or {}).get("limits") or {}
                for resource, quantity in sorted(limits.items()):
                    if resource not in self.kubelet.plugins:
                        continue
                    ids = self._allocate(resource, int(quantity), record)
                    self._held.append(
                        ContainerDevices(meta["namespace"], meta["name"], c["name"], resource, tuple(ids))
                    )
            self.podres.set_pods(self._held)
            self.api.patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
                content_type=STRATEGIC,
            )
        except Exception as exc:  # recorded for the test's assertions, never silently dropped
            record.error = f"{type(exc).__name__}: {exc}"
            self.errors.append(f"{key}: {record.error}")
        return record

    def _allocate(self, resource: str, count: int, record: Admission) -> list[str]:
        taken = {d for h in self._held if h.resource_name == resource for d in h.device_ids}
        available = [d for d in self.kubelet.healthy(resource) if d not in taken]
        if len(available) < count:
            raise RuntimeError(
                f"{count} x {resource} asked, {len(available)} free (UnexpectedAdmissionError)"
            )
        chosen = available[:count]
        if self.kubelet.plugins[resource].options.get_preferred_allocation_available:
            preferred = self.kubelet.preferred(resource, available, count)
            if len(preferred) == count and set(preferred) <= set(available):
                chosen = preferred  # the kubelet uses a valid preference, else its own choice
        answer = self.kubelet.allocate(resource, chosen)
        record.devices.setdefault(resource, []).extend(chosen)
        visible = answer.envs.get("NVIDIA_VISIBLE_DEVICES", "")
        record.visible += [v for v in visible.split(",") if v and v not in record.visible]
        return chosen


class SimNode:
    """A Node served by `gpunode agent --backend sim` and the kubelet stand-ins (see the module docstring)."""

    def __init__(
        self,
        cp: ControlPlane,
        name: str,
        workdir: Path,
        *,
        profile: str,
        agent: Mapping[str, Any] | None = None,
        flags: Mapping[str, Any] | None = None,
    ) -> None:
        """Plan the node: sim `profile`, extra `agent` settings (gpunode section) and NVIDIA `flags`."""
        self.cp = cp
        self.name = name
        self.workdir = workdir
        self.profile = profile
        self.agent_settings = dict(agent or {})
        self.flags = dict(flags or {})
        self.sockets = short_socket_dir("gne2e")
        self.kubelet = KubeletStandIn(self.sockets)
        self.podres = PodResourcesStandIn(str(self.sockets / "pr.sock"))
        self.agent: Proc | None = None
        self.admitter: NodeKubelet | None = None
        self.capacity: dict[str, str] = {}

    def start(self) -> SimNode:
        """Create the Node, start the stand-ins and the agent, write the capacity it advertises."""
        admin = self.cp.api()
        create_fake_node(admin, self.name)
        self.kubelet.start()
        self.podres.start()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "version": "v1",
            "flags": {"migStrategy": "none", "failOnInitError": True, **self.flags},
            "gpunode": {
                "backend": "sim",
                "simProfile": self.profile,
                "kubeletDir": str(self.sockets),
                "stateDir": str(self.workdir / "state"),
                "podResourcesSocket": str(self.podres.socket_path),
                "nodeName": self.name,
                "metrics": {"listen": f"127.0.0.1:{free_port()}"},
                "remediation": {"mode": "off", "kubeconfig": str(self.cp.kubeconfig("agent"))},
                **self.agent_settings,
            },
        }
        path = self.workdir / "agent.yaml"
        path.write_text(yaml.safe_dump(config))
        self.agent = Proc(
            f"gpunode-agent-{self.name}",
            [sys.executable, "-m", "gpunode.cli", "agent", "--config", str(path)],
            self.cp.logs,
        ).start()
        self.cp.procs.append(self.agent)

        def registered() -> bool:
            plugins = dict(self.kubelet.plugins)
            return bool(plugins) and all(p.updates > 0 for p in plugins.values())

        self.agent.wait_until(registered, timeout_s=WAIT_S, what="its device plugins registered")
        time.sleep(1.0)  # every resource of the node registers within a moment of the first
        self.capacity = {r: str(len(self.kubelet.healthy(r))) for r in sorted(self.kubelet.plugins)}
        write_ready_status(admin, self.name, {**BASE_CAPACITY, **self.capacity})
        self.admitter = NodeKubelet(admin, self.name, self.kubelet, self.podres).start()
        return self

    def stop(self) -> None:
        """Stop the kubelet's part, the agent and the stand-ins; delete the Node."""
        if self.admitter is not None:
            self.admitter.stop()
        if self.agent is not None:
            self.agent.stop()
        self.kubelet.stop()
        self.podres.stop()
        with contextlib.suppress(ApiError, OSError):
            self.cp.api().delete(f"/api/v1/nodes/{self.name}")
