"""A real Prometheus scrapes the metrics endpoint of two simulated nodes, and promtool reads the exposition.

Node "node-h100" (dgx-h100): GPU 0 is held whole by one pod; GPU 2 is
fractional and shared by two pods through memory units; GPU 3 is time-sliced
between two pods; GPU 5 has XID errors and is unhealthy. Node "node-a100"
(a100-mig, migStrategy mixed): one pod holds one MIG instance. Pods reach the
collector through a pod-resources stand-in per node, over real Unix sockets;
Prometheus scrapes both endpoints over loopback every second and the tests
query its HTTP API.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpunode.config.agent import parse_config
from gpunode.config.metrics import MetricsConfig
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import Inventory, build_inventory, region_key
from gpunode.node.kubelet.podresources import ContainerDevices, PodAttribution
from gpunode.node.metrics import MetricsCollector
from tests.fakes import CappedProcess
from tests.fakes.podresources import PodResourcesStandIn
from tests.shared.prometheus import PROMETHEUS, Prometheus, ServingThread, needs_prometheus, values

DATA = Path(__file__).resolve().parents[1] / "data"
PROMTOOL = shutil.which("promtool")
GIB = 2**30

# The native module is built by every install of gpunode: its absence is a failure here, not a skip.
importlib.import_module("gpunode._memcap")
memcap = importlib.import_module("gpunode.node.memcap")

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install -y prometheus)"
)


@dataclass
class Node:
    """One simulated node: its backend, inventory, kubelet stand-in, collector and endpoint."""

    hostname: str
    backend: SimBackend
    inventory: Inventory
    kubelet: PodResourcesStandIn
    collector: MetricsCollector
    unhealthy: dict[str, str]
    processes: list[CappedProcess]
    port: int = 0

    @property
    def gpus(self) -> Any:
        return self.backend.gpus()


# -- the two nodes --------------------------------------------------------------------------------


def build_h100(sock_dir: str, regions_root: Path) -> Node:
    backend = SimBackend.from_profile("dgx-h100")
    gpus = backend.gpus()
    cfg = parse_config(
        {
            "version": "v1",
            "sharing": {
                "timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4, "devices": [3]}]}
            },
            "gpunode": {"fractional": {"devices": [2]}},
        },
        "test.yaml",
    )
    inv = build_inventory(gpus, cfg)
    g0, g2, g3 = gpus[0], gpus[2], gpus[3]
    replicas = [d.id for d in inv.devices if d.gpu_uuid == g3.uuid]
    units = [d.id for d in inv.devices if d.gpu_uuid == g2.uuid]
    pods = [
        ContainerDevices("ml", "train-0", "main", "nvidia.com/gpu", (g0.uuid,)),
        ContainerDevices("team-a", "notebook", "jupyter", "gpunode.io/gpu-memory", tuple(units[:2])),
        ContainerDevices("team-b", "batch", "worker", "gpunode.io/gpu-memory", tuple(units[2:10])),
        ContainerDevices("web", "api-0", "app", "nvidia.com/gpu", (replicas[0],)),
        ContainerDevices("web", "api-1", "app", "nvidia.com/gpu", (replicas[1],)),
    ]
    backend.add_process(g0.uuid, 1000, 10 * GIB)
    backend.add_process(g2.uuid, 2001, 1 * GIB)
    backend.add_process(g2.uuid, 2002, 6 * GIB)
    kubelet = PodResourcesStandIn(os.path.join(sock_dir, "h100.sock")).start()
    kubelet.set_pods(pods)
    unhealthy = {gpus[5].uuid: "XID 79 (GPU has fallen off the bus)"}
    # Each fractional pod has its region and one live process holding memory in it.
    processes = [
        capped(regions_root, pods[1], g2.uuid, 2 * GIB, g2.memory_total_bytes, used_bytes=1 * GIB),
        capped(regions_root, pods[2], g2.uuid, 8 * GIB, g2.memory_total_bytes, used_bytes=6 * GIB),
    ]
    collector = MetricsCollector(
        backend=backend,
        hostname="node-h100",
        config=MetricsConfig(interval_s=1.0),
        inventory=lambda: inv,
        health=lambda: unhealthy,
        attribution=PodAttribution(kubelet.socket_path, ttl_s=1.0),
        regions_root=regions_root,
    )
    return Node("node-h100", backend, inv, kubelet, collector, unhealthy, processes)


def capped(
    root: Path, holder: ContainerDevices, gpu_uuid: str, limit: int, total: int, used_bytes: int
) -> CappedProcess:
    """The container's memory-cap region, made as Allocate makes it, and a live process holding memory in it."""
    region = memcap.create_region(
        root, region_key(holder.device_ids), gpu_uuid=gpu_uuid, limit_bytes=limit, device_total_bytes=total
    )
    return CappedProcess(region.path, {0: used_bytes}).start()


def build_a100(sock_dir: str) -> Node:
    backend = SimBackend.from_profile("a100-mig")
    gpus = backend.gpus()
    inv = build_inventory(
        gpus, parse_config({"version": "v1", "flags": {"migStrategy": "mixed"}}, "test.yaml")
    )
    mig_gpu = next(g for g in gpus if g.mig_enabled)
    mig = mig_gpu.mig_devices[2]
    backend.add_process(mig_gpu.uuid, 3000, 4 * GIB, mig_uuid=mig.uuid)
    kubelet = PodResourcesStandIn(os.path.join(sock_dir, "a100.sock")).start()
    kubelet.set_pods(
        [ContainerDevices("inference", "llm-0", "server", f"nvidia.com/mig-{mig.profile}", (mig.uuid,))]
    )
    collector = MetricsCollector(
        backend=backend,
        hostname="node-a100",
        config=MetricsConfig(interval_s=1.0),
        inventory=lambda: inv,
        attribution=PodAttribution(kubelet.socket_path, ttl_s=1.0),
    )
    return Node("node-a100", backend, inv, kubelet, collector, {}, [])


@dataclass
class Cluster:
    h100: Node
    a100: Node
    serving: ServingThread
    prometheus: Prometheus | None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    sock_dir = tempfile.mkdtemp(prefix="gpn-prom-", dir="/tmp")
    workdir = tmp_path_factory.mktemp("prometheus")
    regions = workdir / "regions"
    regions.mkdir()
    h100, a100 = build_h100(sock_dir, regions), build_a100(sock_dir)
    gpu5 = h100.gpus[5].uuid
    for code in (79, 79, 48):
        h100.collector.record_event(h100.backend.inject_xid(gpu5, code))
    serving = ServingThread([h100, a100])
    serving.start()
    prometheus = Prometheus([h100.port, a100.port], workdir) if PROMETHEUS else None
    try:
        if prometheus is not None:
            prometheus.wait_until("both targets up", lambda: values(prometheus.query("sum(up)")) == [2.0])
            # Rates (NVLink) need two collections; the pod labels need the kubelet's answer.
            prometheus.wait_until(
                "a full scrape of both nodes",
                lambda: (
                    len(prometheus.query('DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL{Hostname="node-h100"}')) == 8
                    and len(prometheus.query('DCGM_FI_DEV_FB_USED{pod="llm-0"}')) == 1
                ),
            )
        yield Cluster(h100, a100, serving, prometheus)
    finally:
        if prometheus is not None:
            prometheus.stop()
        serving.stop()
        for node in (h100, a100):
            node.kubelet.stop()
            for proc in node.processes:
                proc.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def prom(cluster: Cluster) -> Prometheus:
    if cluster.prometheus is None:
        pytest.skip("the prometheus binary is not installed (apt-get install -y prometheus)")
    return cluster.prometheus


# -- promtool -------------------------------------------------------------------------------------

# What promtool's linter says about dcgm-exporter's own names, which dashboards depend on. These are
# accepted for DCGM_* families only; gpunode's own families must lint clean.
DCGM_NAME_LINTS = (
    'counter metrics should have "_total" suffix',
    "label names should be written in 'snake_case' not 'camelCase'",  # modelName
    "metric name should not include type 'counter'",  # DCGM_FI_DEV_PCIE_REPLAY_COUNTER
)


@needs_promtool
@pytest.mark.parametrize("node_name", ["h100", "a100"])
def test_promtool_check_metrics(cluster: Cluster, node_name: str) -> None:
    node: Node = getattr(cluster, node_name)
    body = cluster.serving.call(node.collector.render)
    assert PROMTOOL is not None
    proc = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60)
    # Exit 1 is a parse error; 3 means lint findings only.
    assert proc.returncode in (0, 3), proc.stderr.decode() + proc.stdout.decode()
    findings = [ln for ln in (proc.stdout + proc.stderr).decode().splitlines() if ln.strip()]
    for line in findings:
        name, _, problem = line.partition(" ")
        assert name.startswith("DCGM_FI_"), f"gpunode's own family fails lint: {line}"
        assert problem in DCGM_NAME_LINTS, f"unexpected lint finding: {line}"


@needs_promtool
def test_promtool_finds_our_own_families_clean(cluster: Cluster) -> None:
    body = cluster.serving.call(cluster.h100.collector.render).decode()
    ours = "\n".join(
        ln for ln in body.splitlines() if "gpunode_" in ln.split(" ")[0 if not ln.startswith("#") else 2]
    )
    assert "gpunode_container_memory" in ours
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=(ours + "\n").encode(), capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


# -- what Prometheus stored -----------------------------------------------------------------------


@needs_prometheus
def test_prometheus_stores_every_gpu_with_dcgm_labels(cluster: Cluster) -> None:
    p = prom(cluster)
    h100 = cluster.h100
    temps = p.query('DCGM_FI_DEV_GPU_TEMP{Hostname="node-h100"}')
    assert sorted(r["metric"]["gpu"] for r in temps) == [str(i) for i in range(8)]
    g1 = next(r["metric"] for r in temps if r["metric"]["gpu"] == "1")
    assert g1 == {
        "__name__": "DCGM_FI_DEV_GPU_TEMP",
        "gpu": "1",
        "UUID": h100.gpus[1].uuid,
        "pci_bus_id": h100.gpus[1].pci_bus_id,
        "device": "nvidia1",
        "modelName": "NVIDIA H100 80GB HBM3",
        "Hostname": "node-h100",
        "DCGM_FI_DRIVER_VERSION": "550.90.07",
        "instance": f"127.0.0.1:{h100.port}",
        "job": "gpunode",
    }


@needs_prometheus
def test_prometheus_sees_types_help_and_counter_names(cluster: Cluster) -> None:
    p = prom(cluster)
    spec = json.loads((DATA / "dcgm_default_counters.json").read_text())["fields"]
    metadata = p.api("metadata")
    for field in spec:
        if field["name"] in ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "DCGM_FI_DEV_ENC_UTIL"):
            assert field["name"] not in metadata, "neither a bare-metal H100 nor an A100 reports it"
            continue
        entries = metadata.get(field["name"])
        assert entries, field["name"]
        assert {(e["type"], e["help"]) for e in entries} == {(field["type"], field["help"])}, field["name"]
    energy = p.query('DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{Hostname="node-h100"}')
    assert len(energy) == 8 and not p.query("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total")
    # A counter as Prometheus understands it: rate() over two scrapes of an idle GPU is its idle power in mW.
    rate = 'rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{Hostname="node-h100"}[30s])'
    p.wait_until("two scrapes of the energy counter", lambda: len(p.query(rate)) == 8)
    assert min(values(p.query(rate))) > 0


@needs_prometheus
def test_a_pod_holding_a_whole_gpu_labels_its_series(cluster: Cluster) -> None:
    p = prom(cluster)
    held = p.query('DCGM_FI_DEV_FB_USED{pod="train-0"}')
    assert len(held) == 1
    m = held[0]["metric"]
    assert (m["gpu"], m["namespace"], m["container"]) == ("0", "ml", "main")
    assert values(held) == [10240.0]
    # Only that GPU's series name a pod: the shared GPUs 2 and 3 have several holders, so none.
    assert len(p.query('DCGM_FI_DEV_GPU_TEMP{Hostname="node-h100", pod!=""}')) == 1


@needs_prometheus
def test_mig_instances_through_prometheus(cluster: Cluster) -> None:
    p = prom(cluster)
    a100 = cluster.a100
    mig_gpu = next(g for g in a100.gpus if g.mig_enabled)
    inst = p.query(f'DCGM_FI_DEV_FB_USED{{Hostname="node-a100", UUID="{mig_gpu.uuid}", GPU_I_ID!=""}}')
    assert sorted(r["metric"]["GPU_I_ID"] for r in inst) == sorted(str(m.gi_id) for m in mig_gpu.mig_devices)
    for r in inst:
        assert r["metric"]["gpu"] == str(mig_gpu.index) and r["metric"]["device"] == f"nvidia{mig_gpu.index}"
        assert r["metric"]["GPU_I_PROFILE"] == "1g.10gb"
    mig = mig_gpu.mig_devices[2]
    held = p.query('DCGM_FI_DEV_FB_USED{pod="llm-0"}')
    assert [(r["metric"]["GPU_I_ID"], r["metric"]["UUID"]) for r in held] == [(str(mig.gi_id), mig_gpu.uuid)]
    assert values(held) == [4096.0]
    gr = p.query(f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{UUID="{mig_gpu.uuid}", GPU_I_PROFILE="1g.10gb"}}')
    assert len(gr) == len(mig_gpu.mig_devices)


@needs_prometheus
def test_values_the_backend_cannot_read_are_absent(cluster: Cluster) -> None:
    p = prom(cluster)
    # NVML has no utilisation for a MIG-enabled GPU; a bare-metal H100 has no encoder and no vGPU licence.
    mig_uuids = [g.uuid for g in cluster.a100.gpus if g.mig_enabled]
    util = p.query('DCGM_FI_DEV_GPU_UTIL{Hostname="node-a100"}')
    assert {r["metric"]["UUID"] for r in util}.isdisjoint(mig_uuids)
    assert len(util) == len(cluster.a100.gpus) - len(mig_uuids)
    assert not p.query("DCGM_FI_DEV_ENC_UTIL")
    assert not p.query("DCGM_FI_DEV_VGPU_LICENSE_STATUS")


@needs_prometheus
def test_health_and_xid_by_code(cluster: Cluster) -> None:
    p = prom(cluster)
    gpu5 = cluster.h100.gpus[5].uuid
    assert values(p.query(f'gpunode_device_healthy{{device_id="{gpu5}"}}')) == [0.0]
    assert values(p.query('gpunode_device_healthy{Hostname="node-h100", gpu="4"}')) == [1.0]
    assert values(p.query(f'gpunode_xid_errors_total{{UUID="{gpu5}", code="79"}}')) == [2.0]
    assert values(p.query(f'gpunode_xid_errors_total{{UUID="{gpu5}", code="48"}}')) == [1.0]
    assert values(p.query(f'DCGM_FI_DEV_XID_ERRORS{{UUID="{gpu5}"}}')) == [48.0]
    assert values(p.query('DCGM_FI_DEV_XID_ERRORS{Hostname="node-h100", gpu="4"}')) == [0.0]


@needs_prometheus
def test_allocation_by_device_id(cluster: Cluster) -> None:
    p = prom(cluster)
    held = p.query('gpunode_device_allocated{Hostname="node-h100"} == 1')
    by_pod = sorted((r["metric"]["pod"], r["metric"]["resource"]) for r in held)
    assert by_pod == sorted(
        [("train-0", "nvidia.com/gpu"), ("api-0", "nvidia.com/gpu"), ("api-1", "nvidia.com/gpu")]
        + [("notebook", "gpunode.io/gpu-memory")] * 2
        + [("batch", "gpunode.io/gpu-memory")] * 8
    )
    free_replicas = p.query('gpunode_device_allocated{Hostname="node-h100", device_id=~".*::[0-9]+"} == 0')
    assert len(free_replicas) == 2


@needs_prometheus
def test_the_agent_reports_on_itself(cluster: Cluster) -> None:
    p = prom(cluster)
    assert min(values(p.query("gpunode_metrics_collections_total"))) >= 2
    age = values(p.query("gpunode_metrics_sample_age_seconds"))
    assert len(age) == 2 and max(age) < 30
    assert len(p.query("gpunode_metrics_last_success_timestamp_seconds")) == 2
    assert (
        values(p.query('gpunode_gpu_last_sample_timestamp_seconds{Hostname="node-h100", gpu="0"}'))[0] > 1.7e9
    )


@needs_prometheus
def test_each_pod_on_a_shared_gpu_has_its_own_memory_and_cap(cluster: Cluster) -> None:
    p = prom(cluster)
    used = p.query("gpunode_container_memory_used_bytes")
    limit = p.query("gpunode_container_memory_limit_bytes")
    assert {r["metric"]["pod"]: float(r["value"][1]) for r in used} == {"notebook": 1 * GIB, "batch": 6 * GIB}
    assert {r["metric"]["pod"]: float(r["value"][1]) for r in limit} == {
        "notebook": 2 * GIB,
        "batch": 8 * GIB,
    }
    nb = next(r["metric"] for r in used if r["metric"]["pod"] == "notebook")
    assert (nb["namespace"], nb["container"], nb["gpu"]) == ("team-a", "jupyter", "2")
    assert (nb["UUID"], nb["resource"]) == (cluster.h100.gpus[2].uuid, "gpunode.io/gpu-memory")
    gpu2 = p.query('DCGM_FI_DEV_FB_USED{Hostname="node-h100", gpu="2"}')
    assert values(gpu2) == [7168.0], "the GPU's own series stays the GPU's total"


# -- the Grafana dashboard ------------------------------------------------------------------------


def _fill(expr: str) -> str:
    return expr.replace("$Hostname", ".+").replace("$gpu", ".+").replace("$instance", ".+")


@needs_prometheus
@pytest.mark.parametrize(
    "panel",
    json.loads((DATA / "grafana_12239_queries.json").read_text())["panels"],
    ids=lambda panel: str(panel["title"]),
)
def test_dashboard_12239_panel(cluster: Cluster, panel: dict[str, Any]) -> None:
    p = prom(cluster)
    result = p.query(_fill(panel["expr"]))
    assert result, f"panel {panel['title']!r} would be empty"
    for r in result:
        for label in panel["legend_labels"]:
            assert r["metric"].get(label), f"{panel['title']}: legend label {label} missing in {r['metric']}"
        v = float(r["value"][1])
        assert panel["min"] <= v <= panel["max"], f"{panel['title']}: {v} is not a plausible {panel['unit']}"
    for label in panel.get("mig_legend_labels", []):
        assert any(r["metric"].get(label) for r in result), f"{panel['title']}: no MIG series with {label}"


@needs_prometheus
@pytest.mark.parametrize(
    "variable",
    json.loads((DATA / "grafana_12239_queries.json").read_text())["variables"],
    ids=lambda v: str(v["name"]),
)
def test_dashboard_12239_variable(cluster: Cluster, variable: dict[str, str]) -> None:
    p = prom(cluster)
    match = (
        f"{variable['metric']}{{{_fill(variable['selector'])}}}"
        if variable["selector"]
        else variable["metric"]
    )
    got = p.api(f"label/{variable['label']}/values", **{"match[]": match})
    expected = {
        "Hostname": ["node-a100", "node-h100"],
        "gpu": [str(i) for i in range(8)],
        "instance": sorted(f"127.0.0.1:{n.port}" for n in (cluster.h100, cluster.a100)),
    }[variable["label"]]
    assert sorted(got) == sorted(expected)
