"""Placement under DRA on a real Kubernetes 1.36: the agent's device order steers kube-scheduler's first fit
onto the GPU gpunode's policy would take, the extender's view counts what DRA claims hold, and the chart's
second extenders entry (prioritize-claims) steers kube-scheduler's node choice onto the fullest GPU.

What is real: kube-apiserver, kube-scheduler's DRA allocator (which picks the device), the resourceclaim
controller (which deallocates a deleted claim), the chart's DeviceClasses and RBAC. gpunode's SlicePublisher
with ClaimUsage (the agent's DRA wiring: gpunode.node.parts.build_dra_slices) publishes the pool and
watches the claims as the chart's agent service account; the extender's ClaimView watches them as the
chart's extender service account; for the node choice, the extender's HTTP server behind the chart's
KubeSchedulerConfiguration (plain HTTP), in this process. The nodes are fake (pods are bound, not run).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gpunode.cluster.extender.claims import ClaimView
from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.drasteer import read_claim
from gpunode.cluster.extender.nodes import NodeCache
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.contract import dra as names
from gpunode.contract.draclaims import gpu_device_name, shared_device_name
from gpunode.contract.names import GIB
from gpunode.infra.kube import KubeClient
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.order import ClaimUsage
from gpunode.node.dra.slices import SlicePublisher, build_pool
from tests.e2e import chart
from tests.e2e.api import Api, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import KUBE_MINOR, ControlPlane
from tests.e2e.objects import create_dra_fake_node, ensure_namespace

pytestmark = pytest.mark.skipif(
    KUBE_MINOR < 36, reason=f"DRA mode needs Kubernetes 1.36+ (this is 1.{KUBE_MINOR})"
)
DRIVER = names.DEFAULT_DRIVER
NAMESPACE = "e2e-dra-placement"
NODE = "e2e-dra-place-t4"
RESOURCE = "/apis/resource.k8s.io/v1"
WAIT_S = 120.0


class Loop:
    """An asyncio loop in a thread of its own, running coroutines until stop()."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._tasks: list[Any] = []

    def start(self, coro: Any) -> None:
        self._tasks.append(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        time.sleep(0.2)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def claim_body(name: str, gib: int) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": names.CLASS_SHARED,
                            "capacity": {"requests": {"memory": f"{gib}Gi"}},
                        },
                    }
                ]
            }
        },
    }


def pod_body(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {"name": "main", "image": "gpunode.local/none:1", "resources": {"claims": [{"name": "gpu"}]}}
            ],
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
        },
    }


@pytest.fixture(scope="module")
def placed(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The chart's DeviceClasses and the agent's and extender's RBAC; one fake T4 node (4 x 15 GiB, all
    served through DRA) whose slice the agent's publisher orders; the extender's ClaimView; kube-scheduler."""
    tmp = tmp_path_factory.mktemp("dra-placement")
    docs = chart.render(
        {"config": {"gpunode": {"dra": {"enabled": True}}}, "extender": {"enabled": True}}, tmp
    )
    admin = control_plane.api()
    ensure_namespace(admin, chart.NAMESPACE)
    ensure_namespace(admin, NAMESPACE)
    assert chart.apply_rbac(admin, docs, "agent-dra") == E2E_USERS["agent"].name
    assert chart.apply_rbac(admin, docs, "extender") == E2E_USERS["extender"].name
    classes = [d for d in docs if d["kind"] == "DeviceClass"]
    for c in classes:
        admin.apply(f"{RESOURCE}/deviceclasses", c)
    backend = SimBackend.from_profile("t4")
    gpus = tuple(backend.gpus())
    create_dra_fake_node(admin, NODE, backend)

    def client(user: str) -> KubeClient:
        return KubeClient.for_host(
            control_plane.server, token_file=control_plane.token_file(user), ca_file=control_plane.ca_file
        )

    order = ClaimUsage(client_factory=lambda: client("agent"), node_name=NODE, driver=DRIVER, retry_s=1.0)
    pool = build_pool(gpus, unit_bytes=GIB, driver_version=backend.driver_version())
    publisher = SlicePublisher(
        client_factory=lambda: client("agent"), node_name=NODE, driver=DRIVER, pool=lambda: pool, order=order
    )
    claims = ClaimView(DRIVER)
    loop = Loop()
    loop.start(publisher.run())
    extender_client = client("extender")
    loop.start(claims.run(extender_client, retry_s=1.0))
    eventually(lambda: order.synced and claims.synced, timeout_s=WAIT_S, what="the claim watches listed")
    scheduler = control_plane.start_scheduler(name="kube-scheduler-dra-placement")
    try:
        yield {
            "admin": admin,
            "gpus": gpus,
            "order": order,
            "claims": claims,
            "publisher": publisher,
            "pool": pool,
        }
    finally:
        scheduler.stop()
        loop.stop()
        admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods")
        admin.delete(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims")
        admin.delete(f"/api/v1/nodes/{NODE}")
        for c in classes:
            admin.delete(f"{RESOURCE}/deviceclasses/{c['metadata']['name']}")


def devices_on_api(api: Api) -> list[str]:
    items = api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={NODE}")["items"]
    items.sort(key=lambda s: int(s["metadata"]["name"].rsplit("-", 1)[1]))
    return [d["name"] for s in items for d in s["spec"].get("devices") or ()]


def place(api: Api, name: str, gib: int) -> str:
    """Make a claim and its pod; the device kube-scheduler allocated."""
    api.create(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims", claim_body(f"c-{name}", gib))
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_body(f"p-{name}", f"c-{name}"))

    def device() -> str | None:
        c = api.get(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/c-{name}")
        results = ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
        return str(results[0]["device"]) if results else None

    return eventually(device, timeout_s=WAIT_S, what=f"claim c-{name} allocated", interval_s=0.1)


def end(api: Api, name: str) -> None:
    api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/p-{name}", {"gracePeriodSeconds": 0})
    api.delete(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/c-{name}")

    def gone() -> bool:
        items = api.get(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims")["items"]
        return all(c["metadata"]["name"] != f"c-{name}" for c in items)

    eventually(gone, timeout_s=WAIT_S, what=f"claim c-{name} deallocated and deleted")


def shared_first(api: Api, uuid: str) -> bool:
    devices = devices_on_api(api)
    return bool(devices) and next(d for d in devices if d.endswith("-shared")) == shared_device_name(uuid)


def test_first_fit_takes_the_fullest_gpu_that_fits_and_the_extender_counts_the_shares(
    placed: dict[str, Any],
) -> None:
    """10 GiB on GPU 0 and 10 GiB on GPU 1, then the first ends: GPU 0 is empty again and GPU 1 has 5 GiB
    left. A 4 GiB claim goes to GPU 1, where gpunode's policy puts it (the tightest fit, keeping GPU 0
    whole); in GPU index order the allocator's first fit would take GPU 0. The extender's view of the node
    counts the shares on the GPUs served through DRA, and forgets the one that ended."""
    api: Api = placed["admin"]
    gpus = placed["gpus"]
    assert place(api, "a", 10) == shared_device_name(gpus[0].uuid)
    eventually(lambda: shared_first(api, gpus[0].uuid), timeout_s=WAIT_S, what="GPU 0's share listed first")
    time.sleep(0.3)  # kube-scheduler's informer sees the new order
    assert place(api, "b", 10) == shared_device_name(gpus[1].uuid)  # 5 GiB left on GPU 0: does not fit
    cache = NodeCache()
    cache.dra = placed["claims"]
    admin_node = api.get(f"/api/v1/nodes/{NODE}")

    def free() -> tuple[int, ...] | None:
        state = cache.view(admin_node).state
        assert state is not None
        out = tuple(g.memory_free_bytes for g in state.gpus)
        return out if out[0] < gpus[0].memory_total_bytes and out[1] < gpus[1].memory_total_bytes else None

    total = gpus[0].memory_total_bytes
    assert eventually(free, timeout_s=WAIT_S, what="the extender's view counting the shares") == (
        total - 10 * GIB,
        total - 10 * GIB,
        total,
        total,
    )
    end(api, "a")
    eventually(lambda: shared_first(api, gpus[1].uuid), timeout_s=WAIT_S, what="GPU 1's share listed first")
    time.sleep(0.3)
    assert devices_on_api(api)[0] == gpu_device_name(gpus[0].uuid)  # whole GPUs: the free ones by index
    got = place(api, "c", 4)
    assert got == shared_device_name(gpus[1].uuid), (
        f"the 4 GiB share went to {got}, not the fullest GPU that fits"
    )

    def counted() -> list[int] | None:  # the extender's watch sees c's allocation a moment after the API
        state = cache.view(admin_node).state
        assert state is not None
        got = [g.memory_free_bytes for g in state.gpus]
        return got if got[1] != total - 10 * GIB else None

    assert eventually(counted, timeout_s=WAIT_S, what="the extender's view counting c") == [
        total,
        total - 14 * GIB,
        total,
        total,
    ]
    # The agent's view is the same usage, and the slice's names never changed.
    order: ClaimUsage = placed["order"]
    assert {d: u.memory_bytes for d, u in order.usage().items()} == {
        shared_device_name(gpus[1].uuid): 14 * GIB
    }
    assert sorted(devices_on_api(api)) == sorted(d["name"] for d in placed["pool"].devices)


# -- the node: the extender's prioritize-claims steering kube-scheduler's choice ---------------------------

STEER_NODES = ("e2e-dra-steer-a", "e2e-dra-steer-b", "e2e-dra-steer-c")
STEER_LABEL = "gpunode.io/e2e-dra-steer"
STEERED, ALONE = "gpunode-steered", "dra-alone"  # the two schedulers' profiles


@pytest.fixture(scope="module")
def steered(
    placed: dict[str, Any], control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Three fake T4 nodes served through DRA; the extender (in this process, its ClaimView watching as the
    chart's extender service account) behind the chart's scheduler configuration with DRA on (both entries,
    plain HTTP), as the profile STEERED of one kube-scheduler; another kube-scheduler with the profile
    ALONE and no extender. (The module's first scheduler serves default-scheduler only.)"""
    tmp = tmp_path_factory.mktemp("dra-steer")
    admin: Api = placed["admin"]
    values = {
        "config": {"gpunode": {"dra": {"enabled": True}}},
        "extender": {"enabled": True, "tls": {"enabled": False}, "schedulerNames": [STEERED]},
    }
    docs = chart.render(values, tmp)
    (cm,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-scheduler-config")
    ]
    config = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
    assert [e.get("prioritizeVerb") for e in config["extenders"]] == ["prioritize", "prioritize-claims"]

    def client(user: str) -> KubeClient:
        return KubeClient.for_host(
            control_plane.server, token_file=control_plane.token_file(user), ca_file=control_plane.ca_file
        )

    loop = Loop()
    for name in STEER_NODES:
        backend = SimBackend.from_profile("t4")
        create_dra_fake_node(admin, name, backend)
        admin.patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {STEER_LABEL: "1"}}})
        pool = build_pool(tuple(backend.gpus()), unit_bytes=GIB, driver_version=backend.driver_version())
        publisher = SlicePublisher(
            client_factory=lambda: client("agent"), node_name=name, driver=DRIVER, pool=lambda p=pool: p
        )
        loop.start(publisher.run())
    for name in STEER_NODES:
        eventually(lambda n=name: devices_of(admin, n), timeout_s=WAIT_S, what=f"{name}'s slices")
    extender = Extender(
        config=ExtenderConfig(policy="gpunode"), node_lister=lambda: admin.get("/api/v1/nodes")["items"]
    )
    claims = ClaimView(DRIVER, reader=read_claim(DRIVER))
    extender.nodes.dra = claims
    loop.start(claims.run(client("extender"), retry_s=1.0))
    eventually(lambda: claims.synced, timeout_s=WAIT_S, what="the extender's claim watch listed")
    calls: list[tuple[str, int]] = []  # (pod, hosts scored above 0) of each prioritize-claims call
    answer = extender.prioritize_claims

    def counted(body: Any) -> list[dict[str, Any]]:
        out = answer(body)
        calls.append((str(body["Pod"]["metadata"]["name"]), sum(1 for h in out if h["Score"] > 0)))
        return out

    extender.prioritize_claims = counted  # type: ignore[method-assign]
    server = ExtenderServer(extender, port=0)
    server.start()
    for entry in config["extenders"]:
        entry["urlPrefix"] = f"http://127.0.0.1:{server.port}"
    schedulers = [
        control_plane.start_scheduler(config=config, name="kube-scheduler-dra-steered"),
        control_plane.start_scheduler(profiles=[{"schedulerName": ALONE}], name="kube-scheduler-dra-alone"),
    ]
    try:
        yield {"admin": admin, "claims": claims, "calls": calls}
    finally:
        for s in schedulers:
            s.stop()
        server.stop()
        loop.stop()
        for name in STEER_NODES:
            admin.delete(f"/api/v1/nodes/{name}")


def devices_of(api: Api, node: str) -> list[str]:
    items = api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={node}")["items"]
    return [d["name"] for s in items for d in s["spec"].get("devices") or ()]


def place_share(api: Api, name: str, gib: int, scheduler: str) -> tuple[str, str]:
    """A claim of `gib` GiB and its pod (half a CPU, so kube-scheduler's own scores spread) for
    `scheduler`; the node and device it was allocated."""
    api.create(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims", claim_body(f"c-{name}", gib))
    pod = pod_body(f"p-{name}", f"c-{name}")
    pod["spec"]["schedulerName"] = scheduler
    pod["spec"]["nodeSelector"] = {STEER_LABEL: "1"}
    pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "500m"}
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod)

    def result() -> tuple[str, str] | None:
        c = api.get(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/c-{name}")
        results = ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
        return (str(results[0]["pool"]), str(results[0]["device"])) if results else None

    return eventually(result, timeout_s=WAIT_S, what=f"claim c-{name} allocated", interval_s=0.1)


def test_the_extender_packs_dra_shares_onto_the_fullest_gpu_where_kube_scheduler_alone_spreads_them(
    steered: dict[str, Any],
) -> None:
    """Six 2 GiB shares, one after the other (each allocated before the next is made), on three empty T4
    nodes. kube-scheduler alone spreads them over the nodes (its own scores prefer the least used node);
    with the chart's second extender entry it asks prioritize-claims, which scores the node whose GPU is
    fullest best, and all six share one GPU of one node, leaving the other eleven GPUs whole. A pod
    without claims is scheduled through the same profile (the extender answers it with nothing)."""
    api: Api = steered["admin"]
    claims: ClaimView = steered["claims"]
    calls: list[tuple[str, int]] = steered["calls"]

    def seen(count: int) -> bool:  # the extender's view has every allocation so far, and no other
        return sum(u.claims for n in STEER_NODES for u in claims.node_usage(n).values()) == count

    alone = []
    for i in range(6):
        alone.append(place_share(api, f"alone-{i}", 2, ALONE))
        eventually(lambda i=i: seen(i + 1), timeout_s=WAIT_S, what="the extender's view of the claims")
    assert len({node for node, _ in alone}) >= 2, f"kube-scheduler alone put every share on one node: {alone}"
    assert calls == []  # the ALONE profile has no extender
    for i in range(6):
        end(api, f"alone-{i}")
    eventually(lambda: seen(0), timeout_s=WAIT_S, what="the extender's view without the ended claims")

    packed = []
    for i in range(6):
        packed.append(place_share(api, f"steer-{i}", 2, STEERED))
        eventually(lambda i=i: seen(i + 1), timeout_s=WAIT_S, what="the extender's view of the claims")
    assert len(set(packed)) == 1, f"the shares went to {packed}, not onto the fullest GPU"
    # kube-scheduler called prioritize-claims for every steered pod after the first, and the extender
    # preferred some nodes over others (the first share found three empty nodes: all score alike)
    steered_calls = [c for c in calls if c[0].startswith("p-steer-")]
    assert {name for name, _ in steered_calls} >= {f"p-steer-{i}" for i in range(1, 6)}
    assert all(scored == 1 for name, scored in steered_calls if name != "p-steer-0")

    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p-no-claims"},
        "spec": {
            "schedulerName": STEERED,
            "nodeSelector": {STEER_LABEL: "1"},
            "containers": [{"name": "main", "image": "gpunode.local/none:1"}],
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
        },
    }
    api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", plain)

    def bound() -> str | None:
        return api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/p-no-claims")["spec"].get("nodeName")

    eventually(bound, timeout_s=WAIT_S, what="the pod without claims bound")
    assert ("p-no-claims", 0) in calls
