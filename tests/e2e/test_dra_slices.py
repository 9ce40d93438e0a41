"""gpunode's ResourceSlices and DeviceClasses on a real Kubernetes 1.36 control plane, scheduled by the real
kube-scheduler and evicted by the real device-taint eviction controller.

What is real: kube-apiserver validates the slices (written by gpunode's SlicePublisher through gpunode's
KubeClient, as the chart's agent service account with the chart's DRA RBAC) and the chart's DeviceClasses;
kube-scheduler's DRA allocator picks devices for claims and binds the pods; kube-controller-manager's
device-taint eviction controller evicts the pod of a device gpunode tainted NoExecute after a simulated XID
went through gpunode's HealthMonitor. The Nodes are fake (tests/e2e/objects.py), so pods are scheduled
and bound but never run: the kubelet plugin's part (preparing claims) is not exercised here.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpunode.config.health import HealthConfig
from gpunode.contract import dra as names
from gpunode.contract.names import GIB
from gpunode.contract.quantity import parse_quantity
from gpunode.infra.kube import KubeClient
from gpunode.node.agent import Agent as NodeAgent
from gpunode.node.devices.base import DeviceEvent, EventKind, Gpu
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.slices import Pool, SlicePublisher, build_pool, gpu_device_name, mig_device_name
from gpunode.node.dra.taints import device_taints
from gpunode.node.health import HealthMonitor
from gpunode.node.inventory import Inventory
from gpunode.node.state import DeviceState
from tests.agentrunner import RunningAgent, make_config
from tests.e2e import chart
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import KUBE_MINOR, ControlPlane
from tests.e2e.objects import create_fake_node, ensure_namespace
from tests.fakes.kubelet import short_socket_dir

DRIVER = names.DEFAULT_DRIVER
# The driver uses what is beta from 1.36 (consumable capacity for shared GPUs, partitionable devices for
# MIG, device taints, extended-resource mapping); 1.34 has them as alpha, with other API semantics (its
# allocator refused these slices' claims). DRA mode needs 1.36 or newer (README); 1.34 runs the rest.
pytestmark = pytest.mark.skipif(
    KUBE_MINOR < 36, reason=f"DRA mode needs Kubernetes 1.36+ (this is 1.{KUBE_MINOR})"
)
NAMESPACE = "e2e-dra"
RESOURCE = "/apis/resource.k8s.io/v1"
WAIT_S = 120.0  # generous: two shared cores
EXEMPT = "e2e-dra-ops"  # listed in dra.tolerationExemptNamespaces
NODES = {
    "shared": "e2e-dra-t4-shared",
    "whole": "e2e-dra-t4-whole",
    "mig": "e2e-dra-a100",
    "xid": "e2e-dra-t4-xid",
    "compute": "e2e-dra-t4-compute",
    "timesliced": "e2e-dra-t4-timesliced",
}


def claim_body(
    name: str,
    device_class: str,
    *,
    memory: str | None = None,
    cel: str | None = None,
    compute: str | None = None,
) -> dict[str, Any]:
    """A ResourceClaim with one request of one device of `device_class`."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if memory is not None:
        exactly["capacity"] = {"requests": {names.CAPACITY_MEMORY: memory}}
    if compute is not None:
        exactly.setdefault("capacity", {"requests": {}})["requests"][names.CAPACITY_COMPUTE] = compute
    if cel is not None:
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def pod_with_claim(
    name: str, node: str, claim: str | None, *, limits: dict[str, str] | None = None
) -> dict[str, Any]:
    """A pod for one node (by its hostname label) using one claim, or asking for extended resources."""
    container: dict[str, Any] = {"name": "main", "image": "gpunode.local/none:1", "imagePullPolicy": "Never"}
    spec: dict[str, Any] = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [container],
        "terminationGracePeriodSeconds": 1,
        "automountServiceAccountToken": False,
    }
    if claim is not None:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    if limits:
        container["resources"] = {"limits": limits, "requests": limits}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


class Agent:
    """The DRA side of one node's agent: a SlicePublisher (as the chart's agent service account) running in a
    thread of its own, publishing `pool()` on every change of `state` and on poke()."""

    def __init__(
        self, plane: ControlPlane, node: str, pool: Callable[[], Pool], state: DeviceState | None
    ) -> None:
        token = plane.token_file("agent")

        def client() -> KubeClient:
            return KubeClient.for_host(plane.server, token_file=token, ca_file=plane.ca_file)

        async def changed(version: int) -> int:
            assert state is not None
            return (await state.wait_for_change(version)).version

        self.publisher = SlicePublisher(
            client_factory=client,
            node_name=node,
            driver=DRIVER,
            pool=pool,
            changed=changed if state is not None else None,
            interval_s=3600.0,
        )
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"slices-{node}", daemon=True)
        self._thread.start()
        assert self._ready.wait(WAIT_S), "the publisher did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        ready = asyncio.Event()

        async def main() -> None:
            self._task = asyncio.ensure_future(self.publisher.run(ready=ready))
            await ready.wait()
            self._ready.set()
            await asyncio.gather(self._task, return_exceptions=True)

        self._loop.run_until_complete(main())

    def poke(self) -> None:
        self.publisher.poke()

    def stop(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(30)


def slices_of(api: Api, node: str) -> list[dict[str, Any]]:
    listed = api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={node}")
    return list(listed.get("items") or [])


def wait_scheduled(api: Api, pod: str) -> dict[str, Any]:
    def bound() -> dict[str, Any] | None:
        p: dict[str, Any] = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
        return p if p["spec"].get("nodeName") else None

    return eventually(bound, timeout_s=WAIT_S, what=f"pod {pod} bound by kube-scheduler")


def wait_unschedulable(api: Api, pod: str) -> str:
    """The scheduler's message for a pod it cannot place."""

    def message() -> str | None:
        p = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
        assert not p["spec"].get("nodeName"), f"pod {pod} was bound to {p['spec'].get('nodeName')}"
        for cond in p.get("status", {}).get("conditions") or []:
            if cond["type"] == "PodScheduled" and cond["status"] == "False" and cond.get("message"):
                return str(cond["message"])
        return None

    return eventually(message, timeout_s=WAIT_S, what=f"pod {pod} found unschedulable")


def allocation(api: Api, claim: str) -> dict[str, Any]:
    def allocated() -> dict[str, Any] | None:
        c = api.get(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/{claim}")
        result: dict[str, Any] | None = (c.get("status") or {}).get("allocation")
        return result

    return eventually(allocated, timeout_s=WAIT_S, what=f"claim {claim} allocated")


def constant(pool: Pool) -> Callable[[], Pool]:
    """A pool that never changes."""
    return lambda: pool


@pytest.fixture(scope="module")
def dra(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The chart's DeviceClasses and DRA RBAC applied, four fake nodes with their slices, kube-scheduler."""
    tmp = tmp_path_factory.mktemp("dra")
    docs = chart.render(
        {"config": {"gpunode": {"dra": {"enabled": True}}}, "dra": {"tolerationExemptNamespaces": [EXEMPT]}},
        tmp,
    )
    admin = control_plane.api()
    ensure_namespace(admin, chart.NAMESPACE)
    ensure_namespace(admin, NAMESPACE)
    assert chart.apply_rbac(admin, docs, "agent-dra") == E2E_USERS["agent"].name
    classes = [d for d in docs if d["kind"] == "DeviceClass"]
    assert sorted(c["metadata"]["name"] for c in classes) == sorted(
        [names.CLASS_WHOLE, names.CLASS_SHARED, names.CLASS_MIG, names.CLASS_TIME_SLICED]
    )
    for c in classes:
        admin.apply(f"{RESOURCE}/deviceclasses", c)  # the API server validates them (CEL included)
    for kind, plural in (
        ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
        ("ValidatingAdmissionPolicyBinding", "validatingadmissionpolicybindings"),
    ):
        (doc,) = [d for d in docs if d["kind"] == kind]
        admin.apply(f"/apis/admissionregistration.k8s.io/v1/{plural}", doc)
    ensure_namespace(admin, EXEMPT)
    for ns in (NAMESPACE, EXEMPT):  # the tenant may create claims and claim templates, nothing more
        admin.apply(
            f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "tenant-claims", "namespace": ns},
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "resources": ["resourceclaims", "resourceclaimtemplates"],
                        "verbs": ["create", "update", "get", "delete"],
                    }
                ],
            },
        )
        admin.apply(
            f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "tenant-claims", "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant-claims"},
                "subjects": [
                    {
                        "kind": "User",
                        "name": E2E_USERS["nobody"].name,
                        "apiGroup": "rbac.authorization.k8s.io",
                    }
                ],
            },
        )
    t4 = SimBackend.from_profile("t4")
    a100 = SimBackend.from_profile("a100-mig")
    gpus = {
        "shared": t4.gpus()[0],
        "whole": t4.gpus()[1],
        "mig": replace(a100.gpus()[0], mig_devices=()),  # MIG mode, no instance yet: every placement offered
        "compute": t4.gpus()[2],
        "timesliced": t4.gpus()[3],
    }
    agents: list[Agent] = []
    for key, gpu in gpus.items():
        create_fake_node(admin, NODES[key])
        version = t4.driver_version() if key != "mig" else a100.driver_version()
        sliced = {gpu.uuid: 2} if key == "timesliced" else None  # sharing.timeSlicing lists it, 2 replicas
        pool = build_pool([gpu], unit_bytes=GIB, driver_version=version, time_sliced=sliced)
        agents.append(Agent(control_plane, NODES[key], constant(pool), None))
    scheduler = control_plane.start_scheduler(name="kube-scheduler-dra")
    try:
        yield {"admin": admin, "gpus": gpus, "t4": t4, "plane": control_plane, "agents": agents}
    finally:
        scheduler.stop()
        for agent in agents:
            agent.stop()
        # Leave nothing for later tiers on this control plane: the whole-GPU class maps nvidia.com/gpu,
        # so a pod of another tier could otherwise be given a device of these fake nodes, and their
        # schedulers would count the nodes.
        for ns in (NAMESPACE, EXEMPT):
            admin.delete(f"/api/v1/namespaces/{ns}/pods")
            admin.delete(f"{RESOURCE}/namespaces/{ns}/resourceclaims")
            admin.delete(f"{RESOURCE}/namespaces/{ns}/resourceclaimtemplates")
        for node in (*NODES.values(), "e2e-dra-agent"):
            admin.delete(f"/api/v1/nodes/{node}")  # their slices go with them (owner references)
        admin.delete(f"{RESOURCE}/resourceslices/e2e-dra-too-many")
        for c in classes:
            admin.delete(f"{RESOURCE}/deviceclasses/{c['metadata']['name']}")
        for kind, plural in (
            ("ValidatingAdmissionPolicyBinding", "validatingadmissionpolicybindings"),
            ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
        ):
            (doc,) = [d for d in docs if d["kind"] == kind]
            admin.delete(f"/apis/admissionregistration.k8s.io/v1/{plural}/{doc['metadata']['name']}")


def test_the_api_server_accepts_the_slices_and_classes(dra: dict[str, Any]) -> None:
    """Every node's pool is on the API server, complete, with the devices build_pool made; the classes are
    there with the whole-GPU class mapped from nvidia.com/gpu."""
    api: Api = dra["admin"]
    mig_slices = slices_of(api, NODES["mig"])
    assert len(mig_slices) == 2  # one slice of counter sets, one of devices
    counters = [s for s in mig_slices if s["spec"].get("sharedCounters")]
    devices = [d for s in mig_slices for d in s["spec"].get("devices") or []]
    assert len(counters) == 1 and len(devices) == 18  # every placement of the six A100 80GB profiles
    for s in mig_slices:
        assert s["spec"]["pool"] == {"name": NODES["mig"], "generation": 1, "resourceSliceCount": 2}
        assert s["metadata"]["ownerReferences"][0]["kind"] == "Node"
    shared = [d for s in slices_of(api, NODES["shared"]) for d in s["spec"].get("devices") or []]
    assert [d["name"] for d in shared] == [
        gpu_device_name(dra["gpus"]["shared"].uuid),
        gpu_device_name(dra["gpus"]["shared"].uuid) + "-shared",
    ]
    assert shared[1]["allowMultipleAllocations"] is True
    # The compute share capacity as the API server stored it (it validated the policy).
    compute = shared[1]["capacity"][names.CAPACITY_COMPUTE]
    assert parse_quantity(compute["value"], where="compute") == 1000  # the server writes "1k"
    assert compute["requestPolicy"]["validRange"]["min"] == "0"
    whole = api.get(f"{RESOURCE}/deviceclasses/{names.CLASS_WHOLE}")
    assert whole["spec"]["extendedResourceName"] == "nvidia.com/gpu"


def test_the_api_server_refuses_a_slice_over_its_limits(dra: dict[str, Any]) -> None:
    """The limits build_pool keeps to are the API server's: 65 devices with counters in one slice fail."""
    api: Api = dra["admin"]
    a100 = SimBackend.from_profile("a100-mig").gpus()
    pool = build_pool([replace(a100[i], mig_devices=()) for i in range(4)], unit_bytes=GIB)  # every placement
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "e2e-dra-too-many"},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODES["mig"],
            "pool": {"name": "e2e-dra-too-many", "generation": 1, "resourceSliceCount": 1},
            "devices": list(pool.devices[:65]),
        },
    }
    with pytest.raises(ApiError) as refused:
        api.create(f"{RESOURCE}/resourceslices", body)
    assert refused.value.status == 422 and "64" in refused.value.body


def test_two_claims_share_one_gpu_and_a_third_that_would_exceed_it_waits(dra: dict[str, Any]) -> None:
    """8Gi and 6Gi of a 15Gi T4 go to the one shared device; 2Gi more does not fit and stays Pending with
    kube-scheduler's reason, and so does a claim for the whole GPU while shares of it are taken."""
    api: Api = dra["admin"]
    node = NODES["shared"]
    shared = gpu_device_name(dra["gpus"]["shared"].uuid) + "-shared"
    claims = {"share-a": "8Gi", "share-b": "6Gi", "share-c": "2Gi"}
    for claim, memory in claims.items():
        api.create(
            f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims",
            claim_body(claim, names.CLASS_SHARED, memory=memory),
        )
    for claim in ("share-a", "share-b"):
        api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim(f"pod-{claim}", node, claim))
        assert wait_scheduled(api, f"pod-{claim}")["spec"]["nodeName"] == node
        result = allocation(api, claim)["devices"]["results"][0]
        assert (result["pool"], result["device"]) == (node, shared)
        # Compared as quantities: 1.36 echoes "8Gi", 1.37 writes the same in bytes ("8589934592").
        consumed = result["consumedCapacity"][names.CAPACITY_MEMORY]
        assert parse_quantity(consumed, where=claim) == parse_quantity(claims[claim], where=claim)
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-share-c", node, "share-c"))
    message = wait_unschedulable(api, "pod-share-c")
    print(f"share-c: {message}")
    assert "cannot allocate all claims" in message, message
    # While shares are taken, the GPU is not offered whole (the two devices take one counter).
    api.create(
        f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims", claim_body("whole-on-shared", names.CLASS_WHOLE)
    )
    api.create(
        f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-whole-on-shared", node, "whole-on-shared")
    )
    assert "cannot allocate all claims" in wait_unschedulable(api, "pod-whole-on-shared")


def test_compute_shares_asked_of_one_gpu_stay_within_it(dra: dict[str, Any]) -> None:
    """600 and then 500 milli-GPU of one T4: the second does not fit and stays Pending with kube-scheduler's
    reason; a claim that asks no compute still fits (it reserves none: its share follows its memory)."""
    api: Api = dra["admin"]
    node = NODES["compute"]
    for claim, compute in (("compute-a", "600"), ("compute-b", "500"), ("compute-none", None)):
        api.create(
            f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims",
            claim_body(claim, names.CLASS_SHARED, memory="1Gi", compute=compute),
        )
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-compute-a", node, "compute-a"))
    wait_scheduled(api, "pod-compute-a")
    consumed = allocation(api, "compute-a")["devices"]["results"][0]["consumedCapacity"]
    assert parse_quantity(consumed[names.CAPACITY_COMPUTE], where="compute") == 600
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-compute-b", node, "compute-b"))
    assert "cannot allocate all claims" in wait_unschedulable(api, "pod-compute-b")
    api.create(
        f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-compute-none", node, "compute-none")
    )
    wait_scheduled(api, "pod-compute-none")
    consumed = allocation(api, "compute-none")["devices"]["results"][0]["consumedCapacity"]
    assert parse_quantity(consumed.get(names.CAPACITY_COMPUTE, "0"), where="compute") == 0


def test_a_time_sliced_gpu_takes_as_many_claims_as_it_has_replicas(dra: dict[str, Any]) -> None:
    """A T4 time-sliced in 2: two claims of the time-sliced class share it, a third stays Pending with
    kube-scheduler's reason, and so does a claim for the GPU whole."""
    api: Api = dra["admin"]
    node = NODES["timesliced"]
    device = gpu_device_name(dra["gpus"]["timesliced"].uuid) + "-timesliced"
    for claim in ("ts-1", "ts-2", "ts-3"):
        api.create(
            f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims", claim_body(claim, names.CLASS_TIME_SLICED)
        )
    for claim in ("ts-1", "ts-2"):
        api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim(f"pod-{claim}", node, claim))
        wait_scheduled(api, f"pod-{claim}")
        assert allocation(api, claim)["devices"]["results"][0]["device"] == device
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-ts-3", node, "ts-3"))
    assert "cannot allocate all claims" in wait_unschedulable(api, "pod-ts-3")
    api.create(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims", claim_body("ts-whole", names.CLASS_WHOLE))
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-ts-whole", node, "ts-whole"))
    assert "cannot allocate all claims" in wait_unschedulable(api, "pod-ts-whole")


def test_a_mig_claim_takes_a_placement_and_profiles_that_no_longer_fit_are_not_offered(
    dra: dict[str, Any],
) -> None:
    """On an A100 in MIG mode, 4g.40gb takes slices 0-3; 7g.80gb then fits nowhere (Pending), 3g.40gb still
    fits at slice 4."""
    api: Api = dra["admin"]
    node, gpu = NODES["mig"], dra["gpus"]["mig"]
    attr = f'device.attributes["{DRIVER}"].profile'
    for claim, profile in (("mig-4g", "4g.40gb"), ("mig-7g", "7g.80gb"), ("mig-3g", "3g.40gb")):
        api.create(
            f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims",
            claim_body(claim, names.CLASS_MIG, cel=f'{attr} == "{profile}"'),
        )
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-mig-4g", node, "mig-4g"))
    wait_scheduled(api, "pod-mig-4g")
    assert allocation(api, "mig-4g")["devices"]["results"][0]["device"] == mig_device_name(
        gpu.uuid, "4g.40gb", 0
    )
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-mig-7g", node, "mig-7g"))
    assert "cannot allocate all claims" in wait_unschedulable(api, "pod-mig-7g")
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-mig-3g", node, "mig-3g"))
    wait_scheduled(api, "pod-mig-3g")
    assert allocation(api, "mig-3g")["devices"]["results"][0]["device"] == mig_device_name(
        gpu.uuid, "3g.40gb", 4
    )


def test_an_unchanged_nvidia_gpu_pod_gets_a_whole_gpu_through_dra(dra: dict[str, Any]) -> None:
    """A pod asking `nvidia.com/gpu: 1` on a node that advertises no such resource is placed through the
    whole-GPU class: kube-scheduler makes its claim and allocates the node's whole-GPU device."""
    api: Api = dra["admin"]
    node = NODES["whole"]
    api.create(
        f"/api/v1/namespaces/{NAMESPACE}/pods",
        pod_with_claim("pod-extended", node, None, limits={"nvidia.com/gpu": "1"}),
    )
    wait_scheduled(api, "pod-extended")

    def claim_name() -> str | None:
        pod = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/pod-extended")
        status = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
        return status.get("resourceClaimName")

    claim = eventually(claim_name, timeout_s=WAIT_S, what="the pod's extended-resource claim named")
    result = allocation(api, claim)["devices"]["results"][0]
    assert (result["pool"], result["device"]) == (node, gpu_device_name(dra["gpus"]["whole"].uuid))


@pytest.mark.parametrize(
    ("claim", "memory", "cel", "words"),
    [
        ("cel-unknown", None, f'device.attributes["{DRIVER}"].vramType == "hbm3"', "vramType"),
        ("too-much", "100Gi", None, "cannot allocate all claims"),
    ],
)
def test_a_claim_nothing_can_satisfy_says_why(
    dra: dict[str, Any], claim: str, memory: str | None, cel: str | None, words: str
) -> None:
    """A CEL selector on an attribute gpunode does not publish, and a share larger than any GPU, leave the pod
    Pending with kube-scheduler's reason naming the problem."""
    api: Api = dra["admin"]
    api.create(
        f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims",
        claim_body(claim, names.CLASS_SHARED, memory=memory, cel=cel),
    )
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim(f"pod-{claim}", NODES["shared"], claim))
    message = wait_unschedulable(api, f"pod-{claim}")
    print(f"{claim}: {message}")
    assert words in message, message


def test_an_xid_taints_the_device_noexecute_the_controller_evicts_and_a_reset_clears_it(
    dra: dict[str, Any], record_property: Callable[[str, object], None]
) -> None:
    """XID 79 through gpunode's HealthMonitor -> NoExecute taint on the GPU's devices -> kube-controller-manager
    evicts the pod holding it; after a reset (and the recovery window) the taint is gone."""
    api: Api = dra["admin"]
    plane: ControlPlane = dra["plane"]
    backend = SimBackend.from_profile("t4")
    gpu: Gpu = backend.gpus()[2]
    node = NODES["xid"]
    create_fake_node(api, node)
    state = DeviceState(Inventory(gpus=(gpu,)))
    config = HealthConfig(recovery_window_s=1.0)
    monitor = HealthMonitor(backend=backend, state=state, config=config)
    asyncio.run(monitor.probe_once())  # the baseline of the counters a reset restarts

    def pool() -> Pool:
        taints = device_taints(monitor.verdicts(), config.xid)
        return build_pool([gpu], unit_bytes=GIB, driver_version=backend.driver_version(), taints=taints)

    agent = Agent(plane, node, pool, state)
    try:
        api.create(
            f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims", claim_body("xid-whole", names.CLASS_WHOLE)
        )
        api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_with_claim("pod-xid", node, "xid-whole"))
        wait_scheduled(api, "pod-xid")
        started = time.monotonic()
        monitor.handle_event(DeviceEvent(EventKind.XID, gpu.uuid, xid=79))

        def tainted() -> float | None:
            devices = [d for s in slices_of(api, node) for d in s["spec"].get("devices") or []]
            marks = [t for d in devices for t in d.get("taints") or []]
            return time.monotonic() - started if len(marks) == 2 else None

        taint_s = eventually(
            tainted, timeout_s=WAIT_S, what="the NoExecute taint on the slice", interval_s=0.05
        )
        for d in (d for s in slices_of(api, node) for d in s["spec"].get("devices") or []):
            assert [(t["key"], t["value"], t["effect"]) for t in d["taints"]] == [
                (names.TAINT_KEY, "xid-79", names.NO_EXECUTE)
            ]

        def evicted() -> float | None:
            try:
                pod = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/pod-xid")
            except ApiError as exc:
                return time.monotonic() - started if exc.status == 404 else None
            return time.monotonic() - started if pod["metadata"].get("deletionTimestamp") else None

        evict_s = eventually(evicted, timeout_s=WAIT_S, what="pod-xid evicted", interval_s=0.1)
        record_property("xid_to_taint_s", round(taint_s, 3))
        record_property("xid_to_eviction_s", round(evict_s, 3))
        print(f"XID -> taint on the slice {taint_s:.3f} s, XID -> pod evicted {evict_s:.3f} s")

        backend.reset_gpu(gpu.uuid)
        asyncio.run(monitor.probe_once())  # the counters went back: the hold is released
        time.sleep(1.2)
        asyncio.run(monitor.probe_once())  # the recovery window has passed
        assert monitor.verdicts() == {}

        def clear() -> bool:
            devices = [d for s in slices_of(api, node) for d in s["spec"].get("devices") or []]
            return len(devices) == 2 and not any(d.get("taints") for d in devices)

        eventually(clear, timeout_s=WAIT_S, what="the taint removed after the reset")
    finally:
        agent.stop()


def test_a_restarted_publisher_keeps_the_names_and_the_generation(dra: dict[str, Any]) -> None:
    """A new publisher for the same unchanged pool writes nothing: the same slices, names and generation."""
    api: Api = dra["admin"]
    plane: ControlPlane = dra["plane"]
    node, gpu = NODES["whole"], dra["gpus"]["whole"]
    before = slices_of(api, node)
    pool = build_pool([gpu], unit_bytes=GIB, driver_version=dra["t4"].driver_version())
    agent = Agent(plane, node, lambda: pool, None)
    try:
        assert agent.publisher.writes == 0
    finally:
        agent.stop()
    after = slices_of(api, node)
    assert [s["metadata"]["resourceVersion"] for s in after] == [
        s["metadata"]["resourceVersion"] for s in before
    ]


def test_the_agent_publishes_its_slices_taints_them_on_an_xid_and_a_restart_keeps_them(
    dra: dict[str, Any], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """The whole agent (simulated T4 node, gpunode.dra serving GPUs 0 and 1) publishes their devices with
    the chart's agent credentials; an XID 79 injected on GPU 0 reaches the API server as a NoExecute taint
    on GPU 0's devices only, in a new pool generation; a restarted agent finds the same slices (the hold
    on GPU 0 survives the restart) and writes nothing."""
    api: Api = dra["admin"]
    plane: ControlPlane = dra["plane"]
    node = "e2e-dra-agent"
    create_fake_node(api, node)
    short = short_socket_dir("dra")  # Unix socket paths stay under 108 bytes
    config = make_config(
        short / "kubelet" / "device-plugins",
        tmp_path / "state",
        backend="sim",
        simProfile="t4",
        nodeName=node,
        nodeState={"enabled": False},
        remediation={"mode": "off", "kubeconfig": str(plane.kubeconfig("agent"))},
        dra={"enabled": True, "devices": [0, 1]},
    )

    def devices() -> list[dict[str, Any]]:
        return [d for s in slices_of(api, node) for d in s["spec"].get("devices") or []]

    with RunningAgent(NodeAgent(config)) as running:
        assert running.error is None, running.error
        backend = running.agent.backend
        assert isinstance(backend, SimBackend)
        g0, g1 = backend.gpus()[0], backend.gpus()[1]
        eventually(lambda: len(devices()) == 4, timeout_s=WAIT_S, what="the agent's four devices published")
        assert {attrs["uuid"]["string"] for d in devices() for attrs in [d["attributes"]]} == {
            g0.uuid,
            g1.uuid,
        }
        # (not a fixed number: the agent republishes when its claim watch first lists, in its device order)
        before_xid = max(s["spec"]["pool"]["generation"] for s in slices_of(api, node))
        started = time.monotonic()
        backend.inject_xid(g0.uuid, 79)

        def tainted() -> float | None:
            marked = [d["name"] for d in devices() if d.get("taints")]
            return time.monotonic() - started if marked else None

        latency = eventually(tainted, timeout_s=WAIT_S, what="the XID's taint on the slice", interval_s=0.02)
        record_property("agent_xid_to_slice_s", round(latency, 3))
        print(f"agent: XID injected -> taint on the API server {latency:.3f} s")
        marked = {d["name"]: d["taints"] for d in devices() if d.get("taints")}
        assert sorted(marked) == sorted([gpu_device_name(g0.uuid), gpu_device_name(g0.uuid) + "-shared"])
        [generation] = {s["spec"]["pool"]["generation"] for s in slices_of(api, node)}
        assert generation > before_xid  # the taint is a new generation of every slice of the pool
        before = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(api, node)}
    with RunningAgent(NodeAgent(config)) as running:
        time.sleep(2.0)  # the restarted agent has read the slices back and decided
        assert running.agent.dra_slices.writes == 0
    after = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(api, node)}
    assert after == before


def test_a_slice_deleted_behind_the_publishers_back_is_written_again_at_once(dra: dict[str, Any]) -> None:
    """The kubelet wipes a node's slices when it starts: the publisher (resync every hour here) sees the
    deletion through its watch and publishes the pool again, at a new generation, within seconds."""
    api: Api = dra["admin"]
    node = NODES["mig"]
    before = slices_of(api, node)
    generation = before[0]["spec"]["pool"]["generation"]
    victim = before[0]["metadata"]["name"]
    api.delete(f"{RESOURCE}/resourceslices/{victim}")

    def restored() -> list[dict[str, Any]] | None:
        now = slices_of(api, node)
        names_now = sorted(s["metadata"]["name"] for s in now)
        generations = {s["spec"]["pool"]["generation"] for s in now}
        return (
            now
            if names_now == sorted(s["metadata"]["name"] for s in before) and generations == {generation + 1}
            else None
        )

    eventually(restored, timeout_s=30, what=f"{victim} written again by the publisher", interval_s=0.1)


TOLERATE_UNHEALTHY = {"key": names.TAINT_KEY, "operator": "Exists"}
TOLERATE_EVERYTHING = {"operator": "Exists"}


def tolerating_claim(name: str, toleration: dict[str, Any], *, sub: bool = False) -> dict[str, Any]:
    """A claim whose request (or its first subrequest) carries one toleration."""
    body = claim_body(name, names.CLASS_WHOLE)
    request = body["spec"]["devices"]["requests"][0]
    if sub:
        exactly = request.pop("exactly")
        request["firstAvailable"] = [{"name": "any", **exactly, "tolerations": [toleration]}]
    else:
        request["exactly"]["tolerations"] = [toleration]
    return body


def refused(api: Api, path: str, body: dict[str, Any]) -> str | None:
    """The API server's refusal of `body`, or None when it was created (then deleted again): the policy
    takes a moment to be in force after it is applied."""
    try:
        api.create(path, body)
    except ApiError as exc:
        if exc.status in (403, 422) and "gpunode.io/unhealthy" in exc.body:
            return exc.body
        raise
    api.delete(f"{path}/{body['metadata']['name']}")
    return None


@pytest.mark.parametrize(
    ("what", "body", "path"),
    [
        ("tolerates the taint", tolerating_claim("t-key", TOLERATE_UNHEALTHY), "resourceclaims"),
        ("tolerates every taint", tolerating_claim("t-all", TOLERATE_EVERYTHING), "resourceclaims"),
        (
            "tolerates NoExecute by name",
            tolerating_claim("t-ne", {"key": names.TAINT_KEY, "value": "xid-79", "effect": "NoExecute"}),
            "resourceclaims",
        ),
        ("in a subrequest", tolerating_claim("t-sub", TOLERATE_UNHEALTHY, sub=True), "resourceclaims"),
        (
            "in a claim template",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "t-tpl"},
                "spec": {"spec": tolerating_claim("x", TOLERATE_UNHEALTHY)["spec"]},
            },
            "resourceclaimtemplates",
        ),
    ],
)
def test_a_tenant_claim_that_would_keep_a_broken_gpu_is_refused(
    dra: dict[str, Any], what: str, body: dict[str, Any], path: str
) -> None:
    """The attack: a tenant (no rights but creating claims) tolerates the NoExecute health taint, so that
    its pod would be given a GPU that needs a reset and never be evicted. The chart's admission policy
    refuses it, with one line saying what to do instead."""
    tenant = dra["plane"].api("nobody")
    message = eventually(
        lambda: refused(tenant, f"{RESOURCE}/namespaces/{NAMESPACE}/{path}", body),
        timeout_s=WAIT_S,
        what=f"a claim that {what} refused",
    )
    print(f"{what}: {json.loads(message)['message']}")
    assert "may not tolerate the NoExecute gpunode.io/unhealthy device taint" in message


def test_tolerating_only_noschedule_or_in_an_exempt_namespace_is_allowed(dra: dict[str, Any]) -> None:
    """A claim may accept a degraded GPU (NoSchedule); an operator's exempt namespace may tolerate all."""
    tenant = dra["plane"].api("nobody")
    eventually(
        lambda: refused(
            tenant,
            f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims",
            tolerating_claim("probe", TOLERATE_EVERYTHING),
        ),
        timeout_s=WAIT_S,
        what="the policy in force",
    )
    degraded = tolerating_claim(
        "t-degraded", {"key": names.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
    )
    tenant.create(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims", degraded)
    tenant.create(
        f"{RESOURCE}/namespaces/{EXEMPT}/resourceclaims", tolerating_claim("t-ops", TOLERATE_EVERYTHING)
    )
