"""How often kube-scheduler's DRA allocator takes the device gpunode's placement policy would, on a real 1.36.

Starts the e2e tier's control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler with DRA;
scripts/get-kube.sh builds them), the chart's DeviceClasses and the agent's DRA RBAC, and three fake nodes
(two T4 nodes, 4 x 15 GiB; one DGX H100, 8 x 80 GB) whose pools gpunode's SlicePublisher publishes as the
agent's service account, either in GPU index order (`index`: the allocator's first fit as it was) or in
gpunode's order (`ordered`: gpunode.node.dra.order.ClaimUsage watching the claims, the agent's wiring).

Agreement: the claims of the device-plugin scenario's mix (tests/e2e/scenario.py: a 2-GPU claim, three
1-GPU claims, then twenty shares of 2..6 GiB; later rounds shuffle it by seed) are made one at a time, each
with a pod the real kube-scheduler places. For each claim the device it was allocated is compared with the
GPU(s) gpunode's placement policy chooses on the same node, given the same state (the allocations so far,
read back from the claims): the `gpunode` policy with the mix as its target workload, and `bestfit` (the
tightest GPU). In `ordered` mode the next claim waits until the node's slice shows the order for the new
usage (the agent republishes within ~0.2 s); a claim that comes sooner is placed on the older order.
Node choice is kube-scheduler's own (nothing steers it for DRA pods): it is reported beside, as how often
the node chosen is among the policy's best-scoring nodes.

Side by side: the scenario's twenty shares alone, all created at once, through DRA (index and ordered
order, --bursts times each: node choice is kube-scheduler's and varies), with --steered through DRA with
the extender ranking the nodes (gpunode's order; a second kube-scheduler configured by the example's two
extenders entries, so prioritize-claims is asked for every pod; --bursts times) and, with --device-plugin,
through the device plugin (the `gpunode extender` with --bind and three simulated-agent nodes of the same
GPUs, all shared in 1 GiB units, as the scenario runs them): pods placed, GPUs used, GPUs left whole, nodes
used. With --steered, also the time of one prioritize-claims call (p50, p99 over --calls calls, HTTPS
with kube-scheduler's client certificate over one connection) for a pending pod with a claim and for a pod
without claims: what the second extenders entry adds to each pod's scheduling.

    .venv/bin/python bench/dra_placement.py --rounds 5 --bursts 3 --steered --device-plugin \
        > bench/results/dra_placement.json

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunode.cluster.extender.workload import WorkloadTracker
from gpunode.contract import dra as names
from gpunode.contract.draclaims import DeviceUsage, pool_usage
from gpunode.contract.names import ASSIGNMENT_ANNOTATION, GIB, GPU_MEMORY_RESOURCE
from gpunode.infra.kube import KubeClient
from gpunode.node.devices.base import Gpu
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.order import ClaimUsage, order_devices
from gpunode.node.dra.slices import Pool, SlicePublisher, build_pool, gpu_device_name, shared_device_name
from gpunode.placement import GpuState, NodeState, Request, TargetWorkload, score_node
from tests.e2e import chart
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import ROOT, ControlPlane, kube_version, missing_reason
from tests.e2e.objects import create_dra_fake_node, ensure_namespace

DRIVER = names.DEFAULT_DRIVER
RESOURCE = "/apis/resource.k8s.io/v1"
PROFILES = {"t4-a": "t4", "t4-b": "t4", "h100": "dgx-h100"}
WAIT_S = 120.0
SETTLE_S = 0.3  # after the slice shows the new order: kube-scheduler's informer sees it
CPU_FREE, MEMORY_FREE = 64_000, 512 * GIB  # the policy's view of a node's CPU and memory (pods ask none)


@dataclass(frozen=True)
class Item:
    name: str
    gpus: int = 0  # whole GPUs
    gib: int = 0  # a share of this many GiB

    def request(self) -> Request:
        return Request(gpus=self.gpus) if self.gpus else Request(gpu_memory_bytes=self.gib * GIB)


def scenario_mix() -> list[Item]:
    """The device-plugin scenario's whole-GPU and fractional pods, in its order (tests/e2e/scenario.py)."""
    items = [Item("whole-two", gpus=2)] + [Item(f"whole-{i}", gpus=1) for i in range(3)]
    return items + [Item(f"burst-{i:02d}", gib=2 + i % 5) for i in range(20)]


def workload(items: list[Item]) -> TargetWorkload:
    """The mix as the extender would learn it (its shapes and their frequencies)."""
    learned = WorkloadTracker()
    for item in items:
        learned.observe(item.request())
    target = learned.workload()
    assert target is not None
    return target


# -- the nodes' pools and their publishers ---------------------------------------------------------------


class Node:
    """One fake node: its GPUs, its pool, and a SlicePublisher (with ClaimUsage when ordered) in a thread."""

    def __init__(
        self, plane: ControlPlane, api: Api, name: str, profile: str, *, ordered: bool, run: str
    ) -> None:
        self.name = name
        backend = SimBackend.from_profile(profile)
        self.gpus: tuple[Gpu, ...] = tuple(backend.gpus())
        self.pool: Pool = build_pool(self.gpus, unit_bytes=GIB, driver_version=backend.driver_version())
        self.uuid_of = {d["name"]: d["attributes"][names.ATTR_UUID]["string"] for d in self.pool.devices}
        create_dra_fake_node(api, name, backend)  # with the agent's node state: the extender reads it
        api.patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {"bench-run": run}}})
        token = plane.token_file("agent")

        def client() -> KubeClient:
            return KubeClient.for_host(plane.server, token_file=token, ca_file=plane.ca_file)

        self.order = ClaimUsage(client_factory=client, node_name=name, driver=DRIVER) if ordered else None
        self.publisher = SlicePublisher(
            client_factory=client,
            node_name=name,
            driver=DRIVER,
            pool=lambda: self.pool,
            interval_s=3600.0,
            order=self.order,
        )
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self._loop)

            async def go() -> None:
                started = asyncio.Event()
                self._task = asyncio.ensure_future(self.publisher.run(ready=started))
                await started.wait()
                ready.set()
                await asyncio.gather(self._task, return_exceptions=True)

            self._loop.run_until_complete(go())

        self._thread = threading.Thread(target=main, name=f"slices-{name}", daemon=True)
        self._thread.start()
        assert ready.wait(WAIT_S), f"{name}: the publisher did not start"

    def device_of(self, uuid: str, shared: bool = True) -> str:
        """The shared device of a GPU (the whole one with shared=False)."""
        return shared_device_name(uuid) if shared else gpu_device_name(uuid)

    def stop(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(30)

    def view(self, usage: Mapping[str, DeviceUsage]) -> NodeState:
        """Placement's view of this node given its pool's usage: shares take memory, a GPU held whole all."""
        gpus = []
        for g in self.gpus:
            shared = self.pool.device(shared_device_name(g.uuid))
            total = (
                int(shared["capacity"][names.CAPACITY_MEMORY]["value"]) if shared else g.memory_total_bytes
            )
            whole = gpu_device_name(g.uuid) in usage
            used = (
                usage[shared_device_name(g.uuid)].memory_bytes if shared_device_name(g.uuid) in usage else 0
            )
            gpus.append(
                GpuState(
                    uuid=g.uuid,
                    index=g.index,
                    model=g.model,
                    milli_free=0 if whole else 1000,
                    memory_total_bytes=total,
                    memory_free_bytes=0 if whole else max(0, total - used),
                    numa_node=g.numa_node,
                    nvlink_peers=frozenset(g.nvlink_peers),
                    serves_whole=used == 0,
                )
            )
        return NodeState(self.name, tuple(gpus), cpu_milli_free=CPU_FREE, memory_free_bytes=MEMORY_FREE)


def devices_on_api(api: Api, node: str) -> list[str]:
    """The node's device names in the order its slices list them (by slice index)."""
    items = api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={node}")["items"]
    items.sort(key=lambda s: int(s["metadata"]["name"].rsplit("-", 1)[1]))
    return [d["name"] for s in items for d in s["spec"].get("devices") or ()]


# -- claims and pods -----------------------------------------------------------------------------------------


def claim_body(name: str, item: Item) -> dict[str, Any]:
    if item.gpus:
        exactly: dict[str, Any] = {"deviceClassName": names.CLASS_WHOLE, "count": item.gpus}
    else:
        exactly = {
            "deviceClassName": names.CLASS_SHARED,
            "capacity": {"requests": {"memory": f"{item.gib}Gi"}},
        }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def pod_body(
    name: str,
    run: str,
    *,
    claim: str | None = None,
    limits: Mapping[str, str] | None = None,
    scheduler: str = "default-scheduler",
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "gpunode.local/none:1", "imagePullPolicy": "Never"}
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "nodeSelector": {"bench-run": run},
        "containers": [container],
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
    }
    if claim is not None:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    if limits:
        container["resources"] = {"limits": dict(limits), "requests": dict(limits)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def claims_of(api: Api, ns: str) -> list[dict[str, Any]]:
    return list(api.get(f"{RESOURCE}/namespaces/{ns}/resourceclaims")["items"])


def allocated(api: Api, ns: str, claim: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        c: dict[str, Any] = api.get(f"{RESOURCE}/namespaces/{ns}/resourceclaims/{claim}")
        return c if (c.get("status") or {}).get("allocation") else None

    return eventually(check, timeout_s=WAIT_S, what=f"claim {claim} allocated", interval_s=0.05)


# -- one run --------------------------------------------------------------------------------------------------


def start_nodes(plane: ControlPlane, api: Api, run: str, ordered: bool) -> dict[str, Node]:
    nodes = {}
    for key, profile in PROFILES.items():
        name = f"{run}-{key}"
        nodes[name] = Node(plane, api, name, profile, ordered=ordered, run=run)
    for node in nodes.values():

        def published(n: Node = node) -> list[str]:
            return devices_on_api(api, n.name)

        eventually(published, timeout_s=WAIT_S, what=f"{node.name}'s slices")
    return nodes


def stop_nodes(api: Api, ns: str, nodes: Mapping[str, Node]) -> None:
    for node in nodes.values():
        node.stop()
    for pod in api.get(f"/api/v1/namespaces/{ns}/pods")["items"]:
        with contextlib.suppress(ApiError):
            api.request(
                "DELETE", f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}", {"gracePeriodSeconds": 0}
            )
    with contextlib.suppress(ApiError):
        api.delete(f"{RESOURCE}/namespaces/{ns}/resourceclaims")
    for name in nodes:
        with contextlib.suppress(ApiError):
            api.delete(f"/api/v1/nodes/{name}")  # its slices go with it


def wait_order(api: Api, node: Node, usage: Mapping[str, DeviceUsage]) -> float:
    """Until the node's slice lists its devices in gpunode's order for this usage; the seconds it took."""
    want = [d["name"] for d in order_devices(node.pool.devices, usage)]
    started = time.monotonic()
    eventually(
        lambda: devices_on_api(api, node.name) == want,
        timeout_s=WAIT_S,
        what=f"{node.name} reordered",
        interval_s=0.02,
    )
    return time.monotonic() - started


def agreement_run(
    plane: ControlPlane,
    api: Api,
    items: list[Item],
    target: TargetWorkload,
    *,
    ordered: bool,
    run: str,
    seed: int,
) -> dict[str, Any]:
    """Place the items one at a time, then end a seeded half of the shares and place them again; compare
    each allocation with the policies' choice on the same node, given the same state."""
    ns = run
    ensure_namespace(api, ns)
    nodes = start_nodes(plane, api, run, ordered)
    records: list[dict[str, Any]] = []
    waits: list[float] = []

    def place(item: Item, phase: str) -> None:
        usage = pool_usage(claims_of(api, ns), DRIVER)
        views = {n: node.view(usage.get(n, {})) for n, node in nodes.items()}
        claim = f"c-{item.name}"
        api.create(f"{RESOURCE}/namespaces/{ns}/resourceclaims", claim_body(claim, item))
        api.create(f"/api/v1/namespaces/{ns}/pods", pod_body(f"p-{item.name}", run, claim=claim))
        result = allocated(api, ns, claim)["status"]["allocation"]["devices"]["results"]
        node_name = result[0]["pool"]
        got = sorted(nodes[node_name].uuid_of[r["device"]] for r in result)
        record: dict[str, Any] = {
            "claim": item.name,
            "phase": phase,
            "node": node_name,
            "devices": [r["device"] for r in result],
        }
        for policy in ("gpunode", "bestfit"):
            request = item.request()
            choice = score_node(views[node_name], request, policy=policy, workload=target)
            record[f"agrees_{policy}"] = choice is not None and sorted(choice.gpu_uuids) == got
            if not record[f"agrees_{policy}"] and choice is not None:
                record[f"{policy}_would_take"] = [
                    nodes[node_name].device_of(u, shared=bool(item.gib)) for u in choice.gpu_uuids
                ]
            scores = {
                n: c.score
                for n, v in views.items()
                if (c := score_node(v, request, policy=policy, workload=target)) is not None
            }
            best = max(scores.values()) if scores else None
            record[f"best_node_{policy}"] = best is not None and scores.get(node_name) == best
        records.append(record)
        if ordered:
            after = pool_usage(claims_of(api, ns), DRIVER).get(node_name, {})
            waits.append(wait_order(api, nodes[node_name], after))
            time.sleep(SETTLE_S)

    try:
        for item in items:
            place(item, "arrivals")
        # Departures: a seeded half of the shares end (pod and claim deleted, the claim deallocated and
        # gone), leaving holes that first fit in index order and the policy fill differently.
        rng = random.Random(seed)
        shares = [i for i in items if i.gib]
        ending = rng.sample(shares, len(shares) // 2)
        for item in ending:
            api.request("DELETE", f"/api/v1/namespaces/{ns}/pods/p-{item.name}", {"gracePeriodSeconds": 0})
            api.delete(f"{RESOURCE}/namespaces/{ns}/resourceclaims/c-{item.name}")
        gone = {f"c-{i.name}" for i in ending}
        eventually(
            lambda: not gone & {c["metadata"]["name"] for c in claims_of(api, ns)},
            timeout_s=WAIT_S,
            what="the ended claims deallocated and gone",
        )
        if ordered:
            usage = pool_usage(claims_of(api, ns), DRIVER)
            for name, node in nodes.items():
                waits.append(wait_order(api, node, usage.get(name, {})))
            time.sleep(SETTLE_S)
        rng.shuffle(ending)
        for item in ending:
            place(Item(f"{item.name}-again", gib=item.gib), "after-departures")
    finally:
        stop_nodes(api, ns, nodes)
    out: dict[str, Any] = {"claims": len(records)}
    for phase in ("arrivals", "after-departures", None):
        rows = [r for r in records if phase is None or r["phase"] == phase]
        out[phase or "all"] = {
            "claims": len(rows),
            "device_agreement_gpunode": round(sum(r["agrees_gpunode"] for r in rows) / len(rows), 3),
            "device_agreement_bestfit": round(sum(r["agrees_bestfit"] for r in rows) / len(rows), 3),
            "node_among_best_gpunode": round(sum(r["best_node_gpunode"] for r in rows) / len(rows), 3),
        }
    out["disagreements"] = [r for r in records if not r["agrees_gpunode"]]
    if waits:
        out["reorder_visible_s"] = {
            "median": round(sorted(waits)[len(waits) // 2], 3),
            "max": round(max(waits), 3),
        }
    return out


def footprint(
    per_gpu: Mapping[tuple[str, str], int], all_gpus: list[tuple[str, str]], placed: int, total: int
) -> dict[str, Any]:
    used = sum(1 for g in all_gpus if per_gpu.get(g, 0) > 0)
    return {
        "pods": total,
        "pods_placed": placed,
        "gpus": len(all_gpus),
        "gpus_used": used,
        "gpus_left_whole": len(all_gpus) - used,
        "nodes_used": len({n for (n, _), v in per_gpu.items() if v > 0}),
    }


def shares_burst_dra(
    plane: ControlPlane,
    api: Api,
    items: list[Item],
    *,
    ordered: bool,
    run: str,
    scheduler: str = "default-scheduler",
) -> dict[str, Any]:
    """The shares alone, created at once through DRA (pods for `scheduler`); where they went."""
    ns = run
    ensure_namespace(api, ns)
    nodes = start_nodes(plane, api, run, ordered)
    try:
        for item in items:
            claim = f"c-{item.name}"
            api.create(f"{RESOURCE}/namespaces/{ns}/resourceclaims", claim_body(claim, item))
            api.create(
                f"/api/v1/namespaces/{ns}/pods",
                pod_body(f"p-{item.name}", run, claim=claim, scheduler=scheduler),
            )
        for item in items:
            allocated(api, ns, f"c-{item.name}")
        per_gpu: dict[tuple[str, str], int] = {}
        for c in claims_of(api, ns):
            for r in c["status"]["allocation"]["devices"]["results"]:
                key = (r["pool"], nodes[r["pool"]].uuid_of[r["device"]])
                per_gpu[key] = per_gpu.get(key, 0) + 1
        all_gpus = [(n, g.uuid) for n, node in nodes.items() for g in node.gpus]
        return footprint(per_gpu, all_gpus, len(claims_of(api, ns)), len(items))
    finally:
        stop_nodes(api, ns, nodes)


# -- the device plugin's side: the extender and simulated agents -------------------------------------------------


def shares_burst_device_plugin(plane: ControlPlane, api: Api, items: list[Item], tmp: Path) -> dict[str, Any]:
    """The same shares through `gpunode extender` and the device plugin (simulated agents, all GPUs shared
    in 1 GiB units), created at once as the scenario's burst is."""
    from tests.e2e.simnodes import SimNode

    run, ns = "dp", "bench-dra-dp"
    ensure_namespace(api, ns)
    extender, port, client = start_extender(
        plane, api, tmp, {"extender": {"enabled": True, "bind": True}}, bind=True
    )
    fractional = {"fractional": {"devices": "all", "unit": "1Gi"}}
    sims = {
        f"{run}-{key}": SimNode(
            plane, f"{run}-{key}", tmp / f"{run}-{key}", profile=profile, agent=fractional
        )
        for key, profile in PROFILES.items()
    }
    for sim in sims.values():
        sim.start()
        api.patch(f"/api/v1/nodes/{sim.name}", {"metadata": {"labels": {"bench-run": run}}})
    scheduler = plane.start_scheduler(example_entries(plane, port, client), name="kube-scheduler-bench-dp")
    try:
        for node in sims:

            def advertised(node: str = node) -> str | None:
                found = api.get(f"/api/v1/nodes/{node}")["status"]["allocatable"].get(GPU_MEMORY_RESOURCE)
                return str(found) if found else None

            eventually(
                advertised,
                timeout_s=WAIT_S,
                what=f"{node} advertising {GPU_MEMORY_RESOURCE}",
            )
        for item in items:
            api.create(
                f"/api/v1/namespaces/{ns}/pods",
                pod_body(f"p-{item.name}", run, limits={GPU_MEMORY_RESOURCE: str(item.gib)}),
            )

        def all_bound() -> list[dict[str, Any]] | None:
            pods = api.get(f"/api/v1/namespaces/{ns}/pods")["items"]
            done = [
                p
                for p in pods
                if p["spec"].get("nodeName") and ASSIGNMENT_ANNOTATION in p["metadata"].get("annotations", {})
            ]
            return done if len(done) == len(items) else None

        bound = eventually(all_bound, timeout_s=WAIT_S, what="every share pod bound with its GPU")
        per_gpu: dict[tuple[str, str], int] = {}
        for p in bound:
            for uuid in p["metadata"]["annotations"][ASSIGNMENT_ANNOTATION].split(","):  # the extender's GPUs
                key = (p["spec"]["nodeName"], uuid)
                per_gpu[key] = per_gpu.get(key, 0) + 1
        all_gpus = [
            (n, g.uuid) for n in sims for g in SimBackend.from_profile(PROFILES[n.split("-", 1)[1]]).gpus()
        ]
        return footprint(per_gpu, all_gpus, len(bound), len(items))
    finally:
        scheduler.stop()
        extender.stop()
        for sim in sims.values():
            sim.stop()
        for pod in api.get(f"/api/v1/namespaces/{ns}/pods")["items"]:
            with contextlib.suppress(ApiError):
                api.request(
                    "DELETE",
                    f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}",
                    {"gracePeriodSeconds": 0},
                )
        for node in sims:
            with contextlib.suppress(ApiError):
                api.delete(f"/api/v1/nodes/{node}")


def start_extender(
    plane: ControlPlane, api: Api, tmp: Path, values: Mapping[str, Any], *, bind: bool
) -> tuple[Any, int, Any]:
    """The real `gpunode extender` (HTTPS with client certificates, --kube-api, watching the DRA claims as
    the chart's extender service account): (its process, its port, kube-scheduler's client certificate)."""
    from tests.e2e.procs import Proc
    from tests.ports import free_port

    tmp.mkdir(parents=True, exist_ok=True)
    docs = chart.render(values, tmp)
    chart.apply_rbac(api, docs, "extender")
    chart.apply_rbac(api, docs, "agent")
    serving = plane.issue(
        f"bench-extender-{tmp.name}", common_name="gpunode-extender", server=True, hosts=("127.0.0.1",)
    )
    client = plane.issue(f"bench-scheduler-{tmp.name}", common_name="kube-scheduler", client=True)
    port, health = free_port(), free_port()
    extender = Proc(
        f"gpunode-extender-bench-{tmp.name}",
        [
            sys.executable, "-m", "gpunode.cli", "extender",
            "--listen", f"127.0.0.1:{port}", "--health-listen", f"127.0.0.1:{health}",
            "--kube-api", plane.server, "--kube-token-file", str(plane.token_file("extender")),
            "--kube-ca-file", str(plane.ca_file), "--node-refresh", "10s",
            "--tls-cert-file", str(serving.cert), "--tls-key-file", str(serving.key),
            "--client-ca-file", str(plane.ca_file), "--allowed-client-names", "kube-scheduler",
            *(["--bind"] if bind else []),
        ],
        plane.logs,
    ).start()  # fmt: skip
    plane.procs.append(extender)
    extender.wait_until(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=5).status == 200,
        timeout_s=WAIT_S,
        what="ready extender",
    )
    return extender, port, client


def example_entries(plane: ControlPlane, port: int, client: Any) -> list[dict[str, Any]]:
    """gpunode/examples/kube-scheduler-config.yaml's extenders (the device-plugin entry and the one for pods
    with DRA claims), pointed at the extender on `port`."""
    import yaml

    entries: list[dict[str, Any]] = yaml.safe_load(
        (ROOT / "gpunode/examples/kube-scheduler-config.yaml").read_text()
    )["extenders"]
    for entry in entries:
        entry["urlPrefix"] = f"https://127.0.0.1:{port}"
        entry["tlsConfig"] = {
            "certFile": str(client.cert),
            "keyFile": str(client.key),
            "caFile": str(plane.ca_file),
        }
    return entries


# -- DRA with the extender's prioritize-claims steering the node ------------------------------------------------

STEERED = "gpunode-steered"  # the profile of the kube-scheduler that has the example's extenders


def shares_burst_steered(
    plane: ControlPlane, api: Api, items: list[Item], tmp: Path, *, bursts: int, calls: int
) -> dict[str, Any]:
    """The shares at once through DRA (gpunode's order), with a kube-scheduler configured by the example's
    two extenders entries: the extender's prioritize-claims ranks the nodes. Then the latency of
    prioritize-claims for a pod with a claim and one without (`calls` each, kube-scheduler's request
    bodies sent over one HTTPS connection with its client certificate, as it sends them)."""
    values = {"config": {"gpunode": {"dra": {"enabled": True}}}, "extender": {"enabled": True}}
    extender, port, client = start_extender(plane, api, tmp, values, bind=True)
    scheduler = plane.start_scheduler(
        example_entries(plane, port, client),
        profiles=[{"schedulerName": STEERED}],
        name="kube-scheduler-bench-steer",
    )
    try:
        runs = [
            shares_burst_dra(plane, api, items, ordered=True, run=f"steer{b}", scheduler=STEERED)
            for b in range(bursts)
        ]
        latency = prioritize_claims_latency(plane, api, port, client, calls)
    finally:
        scheduler.stop()
        extender.stop()
    return {
        **{
            f"mean_{k}": round(sum(r[k] for r in runs) / len(runs), 2)
            for k in ("pods_placed", "gpus_used", "gpus_left_whole", "nodes_used")
        },
        "runs": runs,
        "prioritize_claims_latency_ms": latency,
    }


def prioritize_claims_latency(
    plane: ControlPlane, api: Api, port: int, client: Any, calls: int
) -> dict[str, Any]:
    """p50/p99 of POST /prioritize-claims for a pending pod with a 4 GiB claim and for a pod without claims,
    with the three nodes' names (nodeCacheCapable, as the example configures it)."""
    import http.client
    import ssl

    run = "lat"
    ensure_namespace(api, run)
    nodes = start_nodes(plane, api, run, ordered=True)
    try:
        api.create(f"{RESOURCE}/namespaces/{run}/resourceclaims", claim_body("c-lat", Item("lat", gib=4)))
        # no scheduler serves this name: the pod stays pending, its claim unallocated
        api.create(
            f"/api/v1/namespaces/{run}/pods", pod_body("p-claim", run, claim="c-lat", scheduler="nobody")
        )
        api.create(f"/api/v1/namespaces/{run}/pods", pod_body("p-plain", run, scheduler="nobody"))
        bodies = {
            kind: json.dumps(
                {"Pod": api.get(f"/api/v1/namespaces/{run}/pods/{pod}"), "NodeNames": sorted(nodes)}
            ).encode()
            for kind, pod in (("claim_pod", "p-claim"), ("pod_without_claims", "p-plain"))
        }
        context = ssl.create_default_context(cafile=str(plane.ca_file))
        context.load_cert_chain(str(client.cert), str(client.key))
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)

        def call(body: bytes) -> list[dict[str, Any]]:
            conn.request(
                "POST", "/prioritize-claims", body=body, headers={"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            answer: list[dict[str, Any]] = json.loads(resp.read())
            assert resp.status == 200, answer
            return answer

        # the extender's claim watch has the claim once the claim pod is ranked
        eventually(
            lambda: any(h["Score"] for h in call(bodies["claim_pod"])) or None,
            timeout_s=WAIT_S,
            what="claim pod ranked",
        )
        out: dict[str, Any] = {"calls": calls, "nodes": len(nodes), "load_average_1m": os.getloadavg()[0]}
        for kind, body in bodies.items():
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                answer = call(body)
                times.append((time.perf_counter() - start) * 1000)
            times.sort()
            out[kind] = {
                "p50": round(times[len(times) // 2], 3),
                "p99": round(times[min(len(times) - 1, int(len(times) * 0.99))], 3),
                "max": round(times[-1], 3),
                "answer": answer,
            }
        conn.close()
        return out
    finally:
        stop_nodes(api, run, nodes)


def setup_dra(plane: ControlPlane, api: Api, tmp: Path) -> None:
    docs = chart.render({"config": {"gpunode": {"dra": {"enabled": True}}}}, tmp)
    ensure_namespace(api, chart.NAMESPACE)
    chart.apply_rbac(api, docs, "agent-dra")
    for c in (d for d in docs if d["kind"] == "DeviceClass"):
        api.apply(f"{RESOURCE}/deviceclasses", c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=3, help="round 0 is the scenario's order, the rest shuffled"
    )
    parser.add_argument(
        "--device-plugin", action="store_true", help="also place the shares through the extender"
    )
    parser.add_argument(
        "--bursts", type=int, default=3, help="times the shares are placed at once through DRA, per order"
    )
    parser.add_argument(
        "--steered",
        action="store_true",
        help="also place the shares at once through DRA with the extender's prioritize-claims (the example's "
        "second extenders entry) ranking the nodes, --bursts times, and time that verb",
    )
    parser.add_argument(
        "--calls", type=int, default=500, help="prioritize-claims calls timed per kind of pod"
    )
    args = parser.parse_args()
    reason = missing_reason()
    if reason is not None:
        raise SystemExit(f"bench/dra_placement.py: {reason}")
    mix = scenario_mix()
    target = workload(mix)
    shares = [i for i in mix if i.gib]
    with tempfile.TemporaryDirectory(prefix="bench-dra-place-") as tmp_dir:
        tmp = Path(tmp_dir)
        plane = ControlPlane(tmp / "kube", users=E2E_USERS).start()
        try:
            api = plane.api()
            setup_dra(plane, api, tmp)
            scheduler = plane.start_scheduler(name="kube-scheduler-bench-dra")
            agreement: dict[str, list[dict[str, Any]]] = {"index": [], "ordered": []}
            try:
                for r in range(args.rounds):
                    items = list(mix)
                    if r:
                        random.Random(r).shuffle(items)
                    for mode in ("index", "ordered"):
                        agreement[mode].append(
                            agreement_run(
                                plane,
                                api,
                                items,
                                target,
                                ordered=mode == "ordered",
                                run=f"r{r}-{mode}",
                                seed=r,
                            )
                        )
                side: dict[str, Any] = {}
                for mode in ("index", "ordered"):
                    runs = [
                        shares_burst_dra(
                            plane, api, shares, ordered=mode == "ordered", run=f"burst{b}-{mode}"
                        )
                        for b in range(args.bursts)
                    ]
                    side[mode] = {
                        **{
                            f"mean_{k}": round(sum(r[k] for r in runs) / len(runs), 2)
                            for k in ("pods_placed", "gpus_used", "gpus_left_whole", "nodes_used")
                        },
                        "runs": runs,
                    }
            finally:
                scheduler.stop()
            if args.steered:
                side["dra_steered"] = shares_burst_steered(
                    plane, api, shares, tmp / "steer", bursts=args.bursts, calls=args.calls
                )
            if args.device_plugin:
                side["device_plugin"] = shares_burst_device_plugin(plane, api, shares, tmp / "dp")
        finally:
            plane.stop()

    def total(mode: str, phase: str, key: str) -> float:
        runs = [x[phase] for x in agreement[mode]]
        return round(sum(x[key] * x["claims"] for x in runs) / sum(x["claims"] for x in runs), 3)

    keys = ("device_agreement_gpunode", "device_agreement_bestfit", "node_among_best_gpunode")
    print(
        json.dumps(
            {
                "bench": "dra_placement",
                "kubernetes": kube_version(),
                "python": platform.python_version(),
                "nodes": PROFILES,
                "mix": [i.name for i in mix],
                "rounds": args.rounds,
                "agreement": {
                    mode: {
                        **{
                            phase: {
                                "claims": sum(x[phase]["claims"] for x in agreement[mode]),
                                **{k: total(mode, phase, k) for k in keys},
                            }
                            for phase in ("all", "arrivals", "after-departures")
                        },
                        "runs": agreement[mode],
                    }
                    for mode in ("index", "ordered")
                    if agreement[mode]
                },
                "side_by_side_shares_at_once": side,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
