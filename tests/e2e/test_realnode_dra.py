"""`gpunode agent --backend sim` as the DRA driver of a real kubelet 1.36 (containerd 2.2 with CDI), beside
its device plugin: GPUs 0 and 1 of the simulated T4 node through DRA, 2 and 3 as nvidia.com/gpu.

What is real: the agent (a process, `gpunode agent`, as the chart's agent service account with the
chart's DRA RBAC) publishes the node's ResourceSlices and registers its DRA plugin with the real
kubelet's plugin watcher; kube-scheduler allocates a ResourceClaimTemplate's claim (4 GiB of a shared
GPU, the chart's DeviceClass); the kubelet calls NodePrepareResources; containerd injects the CDI spec
the agent wrote; the container runs tests/e2e/capprobe.c under the interposer and the tests' fake
libcuda (the image of test_realnode_deviceplugin) and its allocations stop at 4 GiB; the agent's metrics
charge the 4 GiB to the pod and its claim (the kubelet's pod-resources API lists the claim's devices);
the kubelet shows the device's health, from the agent's DRAResourceHealth stream, in the pod's status. Deleting the pod
makes the kubelet unprepare the claim: the spec and the region go. An invalid opaque configuration is
reported on the pod by the kubelet with the agent's reason; an agent restart and a kubelet restart
between prepares leave nothing behind and prepare nothing twice.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpunode.contract import dra as names
from gpunode.contract.names import GPU_RESOURCE, NODE_STATE_ANNOTATION
from gpunode.contract.nodestate import decode
from tests.e2e import chart
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.capped import (
    CAPPED_IMAGE,
    PROBE_IN_IMAGE,
    ProbeReport,
    build_capped_image,
    container_memory,
    probe_report,
    toolchain_missing_reason,
)
from tests.e2e.conftest import E2E_USERS, REAL_NODE
from tests.e2e.controlplane import KUBE_MINOR, ControlPlane
from tests.e2e.node import RealNode, node_missing_reason
from tests.e2e.objects import create_pod, ensure_namespace, get_pod, pod_body, pod_events
from tests.e2e.procs import Proc
from tests.ports import free_port

# DRA mode needs Kubernetes 1.36+ (see tests/e2e/test_dra_slices.py).
pytestmark = pytest.mark.skipif(
    KUBE_MINOR < 36, reason=f"DRA mode needs Kubernetes 1.36+ (this is 1.{KUBE_MINOR})"
)
NAMESPACE = "e2e-realdra"
RESOURCE = "/apis/resource.k8s.io/v1"
DRIVER = names.DEFAULT_DRIVER
WAIT_S = 180.0  # generous: two shared cores
GIB = 2**30
T4_BYTES = 15360 * 2**20
CUDA_OUT_OF_MEMORY = 2


@dataclass
class DraNode:
    """The real node, the agent's process and how to start it again, and the paths it writes."""

    node: RealNode
    agent: Proc
    argv: list[str]
    cp: ControlPlane
    state: Path
    image: str
    metrics_url: str
    config: dict[str, Any]
    config_path: Path

    @property
    def specs(self) -> list[str]:
        return sorted(p.name for p in self.node.cdi_dir.glob(f"{DRIVER}-*.json"))

    @property
    def regions(self) -> list[str]:
        root = self.state / "dra" / "memcap"
        return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []

    @property
    def records(self) -> list[str]:
        root = self.state / "dra" / "claims"
        return sorted(p.name for p in root.iterdir()) if root.exists() else []

    def restart_agent_as(
        self, profile: str, devices: list[int], sharing: dict[str, Any] | None = None
    ) -> None:
        """Restart the agent on another simulated node (profile), DRA serving the GPUs `devices`, with the
        NVIDIA-style `sharing` section given (none by default)."""
        self.config["gpunode"]["simProfile"] = profile
        self.config["gpunode"]["dra"]["devices"] = devices
        self.config.pop("sharing", None)
        if sharing is not None:
            self.config["sharing"] = sharing
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.restart_agent()

    def restart_agent(self) -> None:
        self.agent.stop()
        self.cp.procs.remove(self.agent)
        self.agent = Proc("gpunode-agent", self.argv, self.cp.logs).start()
        self.cp.procs.append(self.agent)


@pytest.fixture(scope="module")
def dra_node(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DraNode]:
    """A real kubelet + containerd node, the chart's DeviceClasses and agent RBAC, the agent, kube-scheduler."""
    reason = node_missing_reason() or toolchain_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("realdra")
    docs = chart.render({"config": {"gpunode": {"dra": {"enabled": True}}}}, tmp)
    admin = control_plane.api()
    ensure_namespace(admin, chart.NAMESPACE)
    ensure_namespace(admin, NAMESPACE)
    assert chart.apply_rbac(admin, docs, "agent") == E2E_USERS["agent"].name
    assert chart.apply_rbac(admin, docs, "agent-dra") == E2E_USERS["agent"].name
    for doc in docs:
        if doc["kind"] == "DeviceClass":
            admin.apply(f"{RESOURCE}/deviceclasses", doc)
    node = RealNode(control_plane, REAL_NODE, tmp / "n")
    scheduler = None
    agent = None
    try:
        node.start()
        node.import_image(build_capped_image(tmp / "image"))
        metrics_port = free_port()
        config = {
            "version": "v1",
            "gpunode": {
                "backend": "sim",
                "simProfile": "t4",
                "kubeletDir": str(node.device_plugins),
                "stateDir": str(tmp / "agent-state"),
                "podResourcesSocket": str(node.pod_resources_socket),
                "nodeName": REAL_NODE,
                "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
                "remediation": {"kubeconfig": str(control_plane.kubeconfig("agent"))},
                "dra": {
                    "enabled": True,
                    "devices": [0, 1],
                    "cdiDir": str(node.cdi_dir),
                    "kubeletRoot": str(node.root_dir),
                },
            },
        }
        (tmp / "agent.yaml").write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "gpunode.cli", "agent", "--config", str(tmp / "agent.yaml")]
        agent = Proc("gpunode-agent", argv, control_plane.logs).start()
        control_plane.procs.append(agent)
        scheduler = control_plane.start_scheduler(name="kube-scheduler-realdra")
        dn = DraNode(
            node,
            agent,
            argv,
            control_plane,
            tmp / "agent-state",
            CAPPED_IMAGE,
            f"http://127.0.0.1:{metrics_port}/metrics",
            config,
            tmp / "agent.yaml",
        )
        yield dn
        agent = dn.agent
    finally:
        if scheduler is not None:
            scheduler.stop()
        if agent is not None:
            agent.stop()
        node.stop()  # deletes the Node (its slices go with it)
        # The whole-GPU class maps nvidia.com/gpu: left behind, it would change how later tiers' pods that
        # ask for nvidia.com/gpu are scheduled.
        admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods")
        admin.delete(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims")
        admin.delete(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaimtemplates")
        for doc in docs:
            if doc["kind"] == "DeviceClass":
                admin.delete(f"{RESOURCE}/deviceclasses/{doc['metadata']['name']}")


def _template(api: Api, name: str, memory: str, parameters: Any = None) -> None:
    exactly: dict[str, Any] = {
        "deviceClassName": names.CLASS_SHARED,
        "capacity": {"requests": {"memory": memory}},
    }
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    if parameters is not None:
        spec["devices"]["config"] = [{"opaque": {"driver": DRIVER, "parameters": parameters}}]
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": spec},
    }
    api.apply(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaimtemplates", body)


def _claim_pod(api: Api, name: str, template: str, *, probe_bytes: int = 256 * 2**20) -> None:
    body = pod_body(
        name,
        host_network=True,
        image=CAPPED_IMAGE,
        command=[PROBE_IN_IMAGE, str(probe_bytes), name],
        env={"FAKE_CUDA_TOTAL_BYTES": str(T4_BYTES), "GPUNODE_MEMCAP_LOG_LEVEL": "info"},
    )
    body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": REAL_NODE}
    body["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    body["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    create_pod(api, NAMESPACE, body)


def _report(dn: DraNode, pod: str) -> ProbeReport:
    return eventually(
        lambda: probe_report(dn.node.container_log(NAMESPACE, pod, "main")),
        timeout_s=WAIT_S,
        what=f"{pod}'s report",
    )


def _delete_and_wait(api: Api, dn: DraNode, pod: str) -> None:
    api.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")

    def gone() -> bool:
        try:
            get_pod(api, NAMESPACE, pod)
        except ApiError as exc:
            return exc.status == 404
        return False

    eventually(gone, timeout_s=WAIT_S, what=f"{pod} deleted")


def _series_labels(metrics_url: str, name: str, pod: str, *, value: bool = False) -> Any:
    """The labels (or, with value, the value) of the one sample of `name` charged to `pod`."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    [sample] = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.labels.get("pod") == pod
    ]
    return sample.value if value else dict(sample.labels)


def _clean(dn: DraNode) -> bool:
    return dn.specs == [] and dn.regions == [] and dn.records == []


def _slice_devices(api: Api) -> list[dict[str, Any]]:
    listed = api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={REAL_NODE}")
    return [d for s in listed.get("items") or [] for d in s["spec"].get("devices") or []]


def test_the_kubelet_registers_the_driver_beside_the_device_plugin(dra_node: DraNode) -> None:
    admin = dra_node.cp.api()
    log = dra_node.cp.logs / "kubelet.log"
    eventually(
        lambda: DRIVER in log.read_text(errors="replace") and "DRA" in log.read_text(errors="replace"),
        timeout_s=WAIT_S,
        what="the kubelet's log of the DRA plugin's registration",
    )
    eventually(
        lambda: (
            admin.get(f"/api/v1/nodes/{REAL_NODE}")["status"].get("capacity", {}).get(GPU_RESOURCE) == "2"
        ),
        timeout_s=WAIT_S,
        what="the device plugin's two GPUs on the Node",
    )
    devices = eventually(lambda: _slice_devices(admin) or None, timeout_s=WAIT_S, what="the node's slices")
    uuids = {d["attributes"][names.ATTR_UUID]["string"] for d in devices}
    assert len(uuids) == 2  # GPUs 0 and 1 only: each GPU is served by one of the two

    def node_state() -> str | None:
        annotations = admin.get(f"/api/v1/nodes/{REAL_NODE}")["metadata"].get("annotations") or {}
        return annotations.get(NODE_STATE_ANNOTATION)

    # The node state the scheduler extender reads says which GPUs DRA serves.
    state = decode(eventually(node_state, timeout_s=WAIT_S, what="the node-state annotation"), node=REAL_NODE)
    modes = {g.uuid: str(g.sharing) for g in state.gpus}
    assert {u for u, m in modes.items() if m == "dra"} == uuids
    assert sorted(m for m in modes.values() if m != "dra") == ["whole", "whole"]


def test_a_claim_template_for_4gib_of_a_shared_gpu_runs_under_its_cap(dra_node: DraNode) -> None:
    admin = dra_node.cp.api()
    _template(admin, "gpu-4gi", "4Gi")
    _claim_pod(admin, "dra-capped", "gpu-4gi")
    report = _report(dra_node, "dra-capped")
    log = dra_node.node.container_log(NAMESPACE, "dra-capped", "main")
    # The GPU has 15 GiB: only the interposer, mounted from the CDI spec, stops the container at 4 GiB.
    assert report.uuid.startswith("GPU-"), log
    assert (report.allocated, report.refused_with) == (4 * GIB, CUDA_OUT_OF_MEMORY), log
    assert report.total == 4 * GIB
    [spec_name] = dra_node.specs
    spec = json.loads((dra_node.node.cdi_dir / spec_name).read_text())
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == report.uuid
    assert len(dra_node.regions) == 1 and len(dra_node.records) == 1
    # The agent reads the claim's region and the kubelet's list of the pod's claims: the pod is charged.
    charged = eventually(
        lambda: m if (m := container_memory(dra_node.metrics_url, "dra-capped")) and m[0] > 0 else None,
        timeout_s=WAIT_S,
        what="the claim's memory charged to the pod in the agent's metrics",
    )
    assert charged == (4 * GIB, 4 * GIB)
    labels = _series_labels(dra_node.metrics_url, "gpunode_container_memory_used_bytes", "dra-capped")
    claim = get_pod(admin, NAMESPACE, "dra-capped")["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    assert {k: v for k, v in labels.items() if k.startswith("dra_")} == {
        "dra_claim_name": claim,
        "dra_claim_namespace": NAMESPACE,
        "dra_driver_name": DRIVER,
        "dra_pool_name": REAL_NODE,
        "dra_device_name": f"{report.uuid.lower()}-shared",
    }
    assert (labels["namespace"], labels["container"], labels["UUID"]) == (NAMESPACE, "main", report.uuid)
    # The claim asked no compute: its region holds a share proportional to its memory, 4 GiB of 15 GiB.
    share = _series_labels(dra_node.metrics_url, "gpunode_container_compute_share", "dra-capped", value=True)
    assert share == pytest.approx((4 * GIB * 1000 // T4_BYTES) / 1000)

    def device_health() -> list[dict[str, Any]] | None:
        statuses = get_pod(admin, NAMESPACE, "dra-capped")["status"].get("containerStatuses") or []
        found = [
            r
            for c in statuses
            for a in c.get("allocatedResourcesStatus") or []
            if str(a.get("name", "")).startswith("claim:")
            for r in a.get("resources") or []
            if r.get("health") == "Healthy"
        ]
        return found or None

    # The kubelet shows the device's health from the agent's DRAResourceHealth stream on the pod.
    healthy = eventually(device_health, timeout_s=WAIT_S, what="the claim's device health on the pod")
    # (the kubelet names the device by the CDI ID it was given; "Healthy", not its default "Unknown")
    assert healthy[0]["resourceID"].startswith(f"{DRIVER}/claim="), healthy
    _delete_and_wait(admin, dra_node, "dra-capped")
    eventually(
        lambda: _clean(dra_node), timeout_s=WAIT_S, what="the claim unprepared: spec, region, record gone"
    )


def test_an_invalid_opaque_configuration_is_reported_on_the_pod(dra_node: DraNode) -> None:
    admin = dra_node.cp.api()
    _template(
        admin, "gpu-bad-config", "1Gi", {"apiVersion": "gpunode.io/v1alpha1", "kind": "GpuConfig", "cap": 1}
    )
    _claim_pod(admin, "dra-bad-config", "gpu-bad-config")

    def reported() -> str | None:
        for e in pod_events(admin, NAMESPACE, "dra-bad-config"):
            if "unknown field" in (e.get("message") or ""):
                return str(e["message"])
        return None

    message = eventually(reported, timeout_s=WAIT_S, what="the kubelet's event with the agent's reason")
    assert "opaque.parameters.cap: unknown field" in message
    assert dra_node.specs == [] and dra_node.regions == []  # nothing made for it
    _delete_and_wait(admin, dra_node, "dra-bad-config")


def test_agent_and_kubelet_restarts_between_prepares_leave_nothing_behind(dra_node: DraNode) -> None:
    admin = dra_node.cp.api()
    _template(admin, "gpu-2gi", "2Gi")
    _claim_pod(admin, "dra-first", "gpu-2gi")
    assert _report(dra_node, "dra-first").allocated == 2 * GIB
    before = (dra_node.specs, dra_node.regions)
    dra_node.restart_agent()  # the prepared claim is kept: the running container keeps its cap
    dra_node.node.restart_kubelet()  # the kubelet asks again for what it prepared: answered from the record
    _claim_pod(admin, "dra-second", "gpu-2gi")
    assert _report(dra_node, "dra-second").allocated == 2 * GIB
    assert len(dra_node.specs) == 2 and set(before[0]) <= set(dra_node.specs)
    assert len(dra_node.regions) == 2 and set(before[1]) <= set(dra_node.regions)  # none made twice
    for pod in ("dra-first", "dra-second"):
        _delete_and_wait(admin, dra_node, pod)
    eventually(lambda: _clean(dra_node), timeout_s=WAIT_S, what="both claims unprepared")


def test_a_claim_for_more_memory_than_a_gpu_has_says_why_and_nothing_is_prepared(dra_node: DraNode) -> None:
    admin = dra_node.cp.api()
    _template(admin, "gpu-100gi", "100Gi")
    _claim_pod(admin, "dra-too-big", "gpu-100gi")

    def unschedulable() -> str | None:
        for e in pod_events(admin, NAMESPACE, "dra-too-big"):
            if e.get("reason") == "FailedScheduling":
                return str(e.get("message"))
        return None

    message = eventually(unschedulable, timeout_s=WAIT_S, what="kube-scheduler's reason on the pod")
    assert "claim" in message, message  # the DRA allocator cannot satisfy the claim on any node
    assert get_pod(admin, NAMESPACE, "dra-too-big")["status"].get("phase") == "Pending"
    assert dra_node.specs == [] and dra_node.regions == []  # never allocated, never prepared
    # the node still prepares a claim that fits
    _template(admin, "gpu-4gi", "4Gi")  # (an apply: the same template as the cap test's)
    _claim_pod(admin, "dra-fits", "gpu-4gi")
    assert _report(dra_node, "dra-fits").allocated == 4 * GIB
    for pod in ("dra-too-big", "dra-fits"):
        _delete_and_wait(admin, dra_node, pod)
    eventually(lambda: _clean(dra_node), timeout_s=WAIT_S, what="the claim unprepared")


def test_two_capped_claims_in_one_container_are_refused_on_the_pod(dra_node: DraNode) -> None:
    """Each capped claim brings its region to the same path in the container: only one cap would hold. The
    agent refuses both claims at prepare; the kubelet shows its line on the pod and nothing is made."""
    admin = dra_node.cp.api()
    _template(admin, "gpu-1gi", "1Gi")
    body = pod_body(
        "dra-two-caps",
        host_network=True,
        image=CAPPED_IMAGE,
        command=[PROBE_IN_IMAGE, str(256 * 2**20), "dra-two-caps"],
        env={"FAKE_CUDA_TOTAL_BYTES": str(T4_BYTES)},
    )
    body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": REAL_NODE}
    body["spec"]["resourceClaims"] = [
        {"name": "a", "resourceClaimTemplateName": "gpu-1gi"},
        {"name": "b", "resourceClaimTemplateName": "gpu-1gi"},
    ]
    body["spec"]["containers"][0]["resources"] = {"claims": [{"name": "a"}, {"name": "b"}]}
    create_pod(admin, NAMESPACE, body)

    def refused() -> str | None:
        for e in pod_events(admin, NAMESPACE, "dra-two-caps"):
            if "a container gets one memory cap" in (e.get("message") or ""):
                return str(e["message"])
        return None

    message = eventually(refused, timeout_s=WAIT_S, what="the agent's reason on the pod")
    assert "container main of pod e2e-realdra/dra-two-caps also uses claim" in message
    assert dra_node.specs == [] and dra_node.regions == []
    _delete_and_wait(admin, dra_node, "dra-two-caps")
    eventually(lambda: _clean(dra_node), timeout_s=WAIT_S, what="nothing left of the refused claims")


def test_a_time_sliced_gpu_runs_as_many_claims_as_replicas_uncapped(dra_node: DraNode) -> None:
    """sharing.timeSlicing lists GPU 0, which DRA serves, with 2 replicas: two pods' claims of the
    time-sliced class run on it without a cap (the fake driver's whole memory), a third stays Pending."""
    from gpunode.node.devices.simnode.backend import SimBackend

    admin = dra_node.cp.api()
    gpu0 = SimBackend.from_profile("t4").gpus()[0]
    sharing = {"timeSlicing": {"resources": [{"name": GPU_RESOURCE, "replicas": 2, "devices": [0]}]}}
    try:
        dra_node.restart_agent_as("t4", [0, 1], sharing)
        eventually(
            lambda: any(d["name"].endswith("-timesliced") for d in _slice_devices(admin)),
            timeout_s=WAIT_S,
            what="GPU 0's time-sliced device in the node's slice",
        )
        exactly = {"deviceClassName": names.CLASS_TIME_SLICED}
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "gpu-sliced"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
        }
        admin.apply(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaimtemplates", body)
        for pod in ("dra-sliced-1", "dra-sliced-2"):
            _claim_pod(admin, pod, "gpu-sliced")
        for pod in ("dra-sliced-1", "dra-sliced-2"):
            report = _report(dra_node, pod)
            assert report.allocated == T4_BYTES  # no interposer: only the GPU's memory stops it
        assert len(dra_node.specs) == 2 and dra_node.regions == []
        for name in dra_node.specs:
            spec = json.loads((dra_node.node.cdi_dir / name).read_text())
            assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={gpu0.uuid}"]
        _claim_pod(admin, "dra-sliced-3", "gpu-sliced")

        def unschedulable() -> str | None:
            for e in pod_events(admin, NAMESPACE, "dra-sliced-3"):
                if e.get("reason") == "FailedScheduling":
                    return str(e.get("message"))
            return None

        assert "claim" in eventually(unschedulable, timeout_s=WAIT_S, what="the third claim Pending")
        for pod in ("dra-sliced-1", "dra-sliced-2", "dra-sliced-3"):
            _delete_and_wait(admin, dra_node, pod)
        eventually(lambda: _clean(dra_node), timeout_s=WAIT_S, what="the time-sliced claims unprepared")
    finally:
        dra_node.restart_agent_as("t4", [0, 1])


def _environ_of(marker: str) -> dict[str, str] | None:
    """The environment of the node's process whose argv holds `marker` (the probe's pod name)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    pairs = (entry / "environ").read_bytes().split(b"\0")
                    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
            except OSError:
                continue
    return None


def _mig_template(api: Api, name: str, cel: str) -> None:
    exactly = {"deviceClassName": names.CLASS_MIG, "selectors": [{"cel": {"expression": cel}}]}
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": spec},
    }
    api.apply(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaimtemplates", body)


def _unschedulable(api: Api, pod: str) -> str | None:
    for e in pod_events(api, NAMESPACE, pod):
        if e.get("reason") == "FailedScheduling":
            return str(e.get("message"))
    return None


def _mig_placements(api: Api, gpu_uuid: str) -> set[tuple[str, int]] | None:
    """(profile, first memory slice) of the GPU's MIG placements in the node's slices; None if none."""
    found = set()
    for d in _slice_devices(api):
        if d["name"].startswith(f"{gpu_uuid.lower()}-mig-"):
            a = d["attributes"]
            found.add((a["profile"]["string"], a["memorySliceStart"]["int"]))
    return found or None


MIG_ATTRS = f'device.attributes["{DRIVER}"]'


def test_a_mig_profile_claim_on_an_a100_mig_node_gets_the_mig_device(dra_node: DraNode) -> None:
    """The agent restarted on the simulated a100-mig node, DRA serving GPU 4 (two 3g.40gb instances, at
    memory slices 0 and 4, made by the operator): only their two placements are offered (every other one
    overlaps them); a claim for 3g.40gb at slice 4 runs with that MIG device, a claim for 4g.40gb stays
    Pending with the scheduler's reason, and the operator's instance outlives the claim. It ends by
    restarting the agent as the T4 node it was."""
    from gpunode.node.devices.simnode.backend import SimBackend

    admin = dra_node.cp.api()
    gpu = SimBackend.from_profile("a100-mig").gpus()[4]
    [at4] = [m for m in gpu.mig_devices if m.gi_id == 2]  # gi 2: the 3g.40gb instance at memory slice 4
    try:
        dra_node.restart_agent_as("a100-mig", [4])
        layout = {("3g.40gb", 0), ("3g.40gb", 4)}  # every other placement overlaps the operator's instances
        eventually(
            lambda: _mig_placements(admin, gpu.uuid) == layout or None,
            timeout_s=WAIT_S,
            what="GPU 4's MIG placements: those of its two instances only",
        )

        _mig_template(
            admin, "mig-3g-4", f'{MIG_ATTRS}.profile == "3g.40gb" && {MIG_ATTRS}.memorySliceStart == 4'
        )
        _claim_pod(admin, "dra-mig", "mig-3g-4")
        report = _report(dra_node, "dra-mig")
        assert report.allocated > 0  # the container ran with the claim's CDI device
        [spec_name] = dra_node.specs
        spec = json.loads((dra_node.node.cdi_dir / spec_name).read_text())
        assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={at4.uuid}"]
        assert dra_node.regions == []  # a MIG device is not capped: its memory is its own
        environ = eventually(lambda: _environ_of("dra-mig"), timeout_s=WAIT_S, what="the probe's process")
        assert environ.get("NVIDIA_VISIBLE_DEVICES") == at4.uuid

        # 4g.40gb at slice 0 is a placement of the GPU's model, but the operator's instances take its slices.
        _mig_template(admin, "mig-4g", f'{MIG_ATTRS}.profile == "4g.40gb"')
        _claim_pod(admin, "dra-mig-absent", "mig-4g")
        message = eventually(
            lambda: _unschedulable(admin, "dra-mig-absent"),
            timeout_s=WAIT_S,
            what="the 4g.40gb claim Pending",
        )
        assert "claim" in message
        for pod in ("dra-mig", "dra-mig-absent"):
            _delete_and_wait(admin, dra_node, pod)
        eventually(lambda: _clean(dra_node), timeout_s=WAIT_S, what="the MIG claim unprepared")
        # The operator's instance was not destroyed: its placement is still offered, and only it.
        assert _mig_placements(admin, gpu.uuid) == {("3g.40gb", 0), ("3g.40gb", 4)}
    finally:
        dra_node.restart_agent_as("t4", [0, 1])


def test_dynamic_mig_creates_the_instance_for_the_claim_and_destroys_it_after(
    dra_node: DraNode, tmp_path: Path
) -> None:
    """The a100-mig node with GPU 4 half partitioned by its operator (one 3g.40gb instance, at memory
    slice 0): the placements on slices 4-7 are offered. A claim for 3g.40gb at slice 4 runs with the
    MIG device the agent created for it (the container sees MIG-<uuid>, an instance of no layout); while
    it runs a 1g.10gb claim on that GPU fits nowhere and stays Pending with the scheduler's reason;
    deleting the pod destroys the instance, so the 1g.10gb claim is then scheduled onto those slices and
    runs with an instance created for it in turn. It ends by restarting the agent as the T4 node."""
    from gpunode.node.devices import simnode
    from gpunode.node.devices.simnode.backend import SimBackend

    admin = dra_node.cp.api()
    # The same node (its name, hence its GPUs' UUIDs, kept), GPU 4 partitioned otherwise.
    layout = yaml.safe_load((Path(simnode.__file__).parent / "profiles" / "a100-mig.yaml").read_text())
    layout["gpus"][4]["mig"] = ["3g.40gb"]  # the operator's layout: half the GPU
    profile = tmp_path / "a100-mig-half.yaml"
    profile.write_text(yaml.safe_dump(layout))
    gpu = SimBackend.from_profile(profile).gpus()[4]
    [operators] = gpu.mig_devices
    try:
        dra_node.restart_agent_as(str(profile), [4])
        free_half = {
            ("3g.40gb", 0),
            ("3g.40gb", 4),
            ("2g.20gb", 4),
            ("1g.20gb", 4),
            ("1g.20gb", 6),
            ("1g.10gb", 4),
            ("1g.10gb", 5),
            ("1g.10gb", 6),
        }
        eventually(
            lambda: _mig_placements(admin, gpu.uuid) == free_half or None,
            timeout_s=WAIT_S,
            what="GPU 4's MIG placements: its instance's and every one on memory slices 4-7",
        )

        _mig_template(
            admin, "mig-3g-4", f'{MIG_ATTRS}.profile == "3g.40gb" && {MIG_ATTRS}.memorySliceStart == 4'
        )
        _claim_pod(admin, "dra-mig-new", "mig-3g-4")
        assert _report(dra_node, "dra-mig-new").allocated > 0
        [spec_name] = dra_node.specs
        [env] = json.loads((dra_node.node.cdi_dir / spec_name).read_text())["containerEdits"]["env"]
        created = env.removeprefix("NVIDIA_VISIBLE_DEVICES=")
        assert created.startswith("MIG-") and created != operators.uuid
        environ = eventually(lambda: _environ_of("dra-mig-new"), timeout_s=WAIT_S, what="the probe's process")
        assert environ.get("NVIDIA_VISIBLE_DEVICES") == created
        [record] = dra_node.records
        plan = json.loads((dra_node.state / "dra" / "claims" / record).read_text())["plan"]
        assert [(d["mig"], d["migCreated"]) for d in plan["devices"]] == [(created, True)]

        # While it runs, nothing on GPU 4 fits a 1g.10gb: the operator's instance and the claim hold it all.
        _mig_template(
            admin, "mig-1g", f'{MIG_ATTRS}.profile == "1g.10gb" && {MIG_ATTRS}.uuid == "{gpu.uuid}"'
        )
        _claim_pod(admin, "dra-mig-small", "mig-1g")
        message = eventually(
            lambda: _unschedulable(admin, "dra-mig-small"), timeout_s=WAIT_S, what="the 1g.10gb claim Pending"
        )
        assert "claim" in message

        # Deleting the pod destroys the instance: the 1g.10gb claim gets those slices, and an instance.
        _delete_and_wait(admin, dra_node, "dra-mig-new")
        assert _report(dra_node, "dra-mig-small").allocated > 0
        [spec_name] = dra_node.specs
        [env] = json.loads((dra_node.node.cdi_dir / spec_name).read_text())["containerEdits"]["env"]
        second = env.removeprefix("NVIDIA_VISIBLE_DEVICES=")
        assert second.startswith("MIG-") and second not in (created, operators.uuid)
        _delete_and_wait(admin, dra_node, "dra-mig-small")
        eventually(lambda: _clean(dra_node), timeout_s=WAIT_S, what="the MIG claims unprepared")
    finally:
        dra_node.restart_agent_as("t4", [0, 1])


def _complete_pool(api: Api) -> list[str] | None:
    """The device names of this node's pool of our driver once it is complete (every slice of one
    generation, as many slices as each says the pool has: what kube-scheduler itself waits for); None
    while an agent is still replacing an older pool."""
    listed = api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={REAL_NODE}")
    ours = [s for s in listed.get("items") or [] if s["spec"].get("driver") == DRIVER]
    pools = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in ours}
    if len(pools) != 1 or next(iter(pools))[1] != len(ours):
        return None
    return sorted(d["name"] for s in ours for d in s["spec"].get("devices") or [])


def _slices_of_driver(api: Api) -> dict[str, list[str]]:
    """This node's ResourceSlices of our driver: name -> its devices' names."""
    listed = api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={REAL_NODE}")
    return {
        s["metadata"]["name"]: sorted(d["name"] for d in s["spec"].get("devices") or [])
        for s in listed.get("items") or []
        if s["spec"].get("driver") == DRIVER
    }


def test_an_uninstalled_agent_leaves_no_slices_and_a_reinstalled_one_publishes_the_same_devices(
    dra_node: DraNode,
) -> None:
    """Uninstalled: the agent stops and its sockets go, as when the DaemonSet's pod is deleted. The kubelet
    unregisters the driver and, when it has not come back within its wiping delay (30 s in 1.36), deletes
    the node's slices of that driver, so the scheduler stops offering devices nobody serves. Installed again:
    the same device names, so claims allocated before stay valid."""
    admin = dra_node.cp.api()
    # The kubelet wipes the slices only of a driver it had registered: start an agent and wait for the
    # kubelet's word on it (the agent logs it), then uninstall it.
    registered = "the kubelet registered driver"
    seen = dra_node.agent.log.read_text(errors="replace").count(registered)
    dra_node.restart_agent()
    eventually(
        lambda: dra_node.agent.log.read_text(errors="replace").count(registered) > seen,
        timeout_s=WAIT_S,
        what="the kubelet registering the restarted agent's driver",
    )

    def t4_pool() -> list[str] | None:
        """The t4 agent's pool (an earlier test ran the node as a100-mig: its pool may still be listed)."""
        pool = _complete_pool(admin)
        return pool if pool and not any("-mig-" in d for d in pool) else None

    before = eventually(t4_pool, timeout_s=WAIT_S, what="the t4 agent's whole pool")
    dra_node.agent.stop()
    dra_node.cp.procs.remove(dra_node.agent)
    try:
        eventually(
            lambda: _slices_of_driver(admin) == {}, timeout_s=WAIT_S, what="the kubelet removing the slices"
        )
    finally:
        dra_node.agent = Proc("gpunode-agent", dra_node.argv, dra_node.cp.logs).start()
        dra_node.cp.procs.append(dra_node.agent)
    after = eventually(lambda: _complete_pool(admin), timeout_s=WAIT_S, what="the whole pool again")
    assert after == before
