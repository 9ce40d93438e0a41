"""The agent cross-checks each pod's compute share against the driver, end to end, under attack.

A running agent (simulated node, MPS replicas: a hard share of 1/4 each) hands two pods a replica of GPU
0 through Allocate; their client processes run under the real interposer against the fake libcuda, whose
device timeline records the device time each process got (the ground truth). A pump feeds that ground
truth to the simulated backend, which answers per-process utilisation as NVML does; the host's
/proc/<pid>/cgroup of each process (the kubelet's pod cgroup) is written under a directory the agent reads
as /proc, since tests cannot create kubelet cgroups. The tenant then attacks: it zeroes its busy
counters, writes itself a huge budget, replaces the mapping of its usage file by private memory (the
interposer goes on with a region nobody else sees), or runs a launcher that bypasses the hooks. Its driver figure still shows its
work: it gets one Warning Event and, above its hard share, is evicted; the neighbour is not flagged.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.node.agent import Agent
from gpunode.node.allocation.sharecheck import EVENT_REASON, pod_uid_of_cgroup
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import region_key
from gpunode.node.kubelet.podresources import ContainerDevices
from gpunode.node.memcap.compute import ComputeMode, read_compute
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.apiserver import ApiServerStandIn
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn
from tests.native import fake_timeline as ft
from tests.native.test_compute_share import scribble
from tests.native.toolchain import NativeBuild
from tests.node.test_publish import kubeconfig

NODE = "gpu-node-9"
SHARED = "nvidia.com/gpu.shared"
WAIT_S = 40.0
UIDS = {"tenant": "0b7c2a1e-5d4f-4e3a-9c8b-7a6d5e4f3a21", "neighbour": "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"}


def test_pod_uid_is_read_from_either_cgroup_driver() -> None:
    uid = UIDS["tenant"]
    assert pod_uid_of_cgroup(f"12:pids:/kubepods/besteffort/pod{uid}/cri-containerd-ab\n") == uid
    systemd = f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-ab.scope\n"
    assert pod_uid_of_cgroup(systemd) == uid
    assert pod_uid_of_cgroup("0::/user.slice/session-3.scope\n") is None


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ft.build_client(tmp_path_factory.mktemp("compute-client"))


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.add_node(NODE)
        for name, uid in UIDS.items():
            server.put_pod(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": "team", "uid": uid},
                    "spec": {"nodeName": NODE, "containers": [{"name": "main"}]},
                    "status": {"phase": "Running"},
                }
            )
        yield server


def wait(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Node:
    """The running agent, the two pods' replicas and their client processes on the fake device."""

    def __init__(self, sockdir: Path, tmp: Path, build: NativeBuild, client: Path, agent: Agent) -> None:
        self.sockdir, self.tmp, self.build, self.client, self.agent = sockdir, tmp, build, client, agent
        self.timeline = tmp / "timeline"
        self.proc = tmp / "proc"
        self.procs: list[subprocess.Popen[str]] = []
        self.gpu = agent.backend.gpus()[0]
        self.env: dict[str, dict[str, str]] = {}
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self.pump, daemon=True)

    def pump(self) -> None:
        """The driver's side: the device time each process got, as the simulated NVML's source."""
        while not self._stop.wait(0.1):
            self.agent.backend.report_process_busy(self.gpu.uuid, ft.busy_by_pid(self.timeline))

    def allocate(self, kubelet: KubeletStandIn, pod: str, replica: int) -> Path:
        dev = f"{self.gpu.uuid}::{replica}"
        resp = kubelet.allocate(SHARED, [dev])
        region = self.sockdir / "state" / "memcap" / region_key([dev])
        preload = next(m.host_path for m in resp.mounts if m.container_path == resp.envs["LD_PRELOAD"])
        self.env[pod] = self.build.env(
            FAKE_CUDA_TOTAL_BYTES=str(self.gpu.memory_total_bytes),
            FAKE_CUDA_UUIDS=self.gpu.uuid,
            FAKE_CUDA_TIMELINE=str(self.timeline),
            GPUNODE_MEMCAP_LOG_LEVEL="error",
            GPUNODE_MEMCAP_REGION=str(region),
            LD_PRELOAD=preload,
        )
        return region

    def start(
        self, pod: str, per_sync: int, *, preload: bool = True, unmap_after_ms: int | None = None
    ) -> subprocess.Popen[str]:
        env = dict(self.env[pod])
        if unmap_after_ms is not None:  # the process swaps its usage file's mapping for private memory
            env["COMPUTE_CLIENT_UNMAP_AFTER_MS"] = str(unmap_after_ms)
        if not preload:  # a launcher that bypasses the hooks: no interposer at all
            del env["LD_PRELOAD"]
        argv = [str(self.client), "dlsym", "kernel", "1000", str(per_sync), "0"]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", pod
        cgroup = self.proc / str(proc.pid) / "cgroup"  # as the kubelet's cgroup driver places it
        cgroup.parent.mkdir(parents=True)
        cgroup.write_text(f"12:pids:/kubepods/besteffort/pod{UIDS[pod]}/cri-containerd-{proc.pid:x}\n")
        if not self._pump.is_alive():
            self._pump.start()
        return proc

    def stop(self) -> None:
        self._stop.set()
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(timeout=30)
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()


@pytest.fixture
def node(
    sockdir: Path, tmp_path: Path, kubelet: KubeletStandIn, api: ApiServerStandIn, native_build: NativeBuild,
    client: Path,
) -> Iterator[tuple[Node, dict[str, Path]]]:  # fmt: skip
    doc: dict[str, Any] = {
        "sharing": {
            "mps": {
                "renameByDefault": True,
                "resources": [{"name": "nvidia.com/gpu", "replicas": 4, "devices": [0]}],
            }
        },
        "gpunode": {
            "nodeName": NODE,
            "podResourcesSocket": str(sockdir / "pr.sock"),
            "nodeState": {"interval": "1h"},
            "remediation": {"mode": "off", "kubeconfig": str(kubeconfig(sockdir / "kubeconfig", api.url))},
            "computeShare": {"interval": "0.5s", "flagAfter": "1.5s", "evict": True},
        },
    }
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    agent = Agent(cfg, backend=SimBackend.from_profile("t4"))
    agent.proc_root = tmp_path / "proc"
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr, RunningAgent(agent):
        kubelet.wait_for_resources([SHARED])
        n = Node(sockdir, tmp_path, native_build, client, agent)
        regions = {
            "tenant": n.allocate(kubelet, "tenant", 0),
            "neighbour": n.allocate(kubelet, "neighbour", 1),
        }
        pr.set_pods(
            [
                ContainerDevices("team", pod, "main", SHARED, (f"{n.gpu.uuid}::{i}",))
                for i, pod in enumerate(("tenant", "neighbour"))
            ]
        )
        try:
            yield n, regions
        finally:
            n.stop()


def events_about(api: ApiServerStandIn, pod: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.events()
        if e.get("reason") == EVENT_REASON and e.get("involvedObject", {}).get("name") == pod
    ]


@pytest.mark.parametrize(
    ("attack", "over"),
    [
        pytest.param("counters", False, id="zeroes-its-busy-counters"),
        pytest.param("budget", True, id="writes-a-huge-budget"),
        pytest.param("unmap", False, id="unmaps-its-region"),  # still held by its last share: it only hides
        pytest.param("bypass", True, id="launcher-bypassing-the-hooks"),
    ],
)
def test_a_tenant_defeating_its_share_is_seen_by_the_driver_flagged_and_evicted(
    node: tuple[Node, dict[str, Path]], api: ApiServerStandIn, attack: str, over: bool
) -> None:
    n, regions = node
    check = n.agent.share_check
    assert check is not None, "the simulated backend reports per-process utilisation"
    assert read_compute(regions["tenant"]).mode == ComputeMode.HARD  # an MPS replica: 1/4, hard
    n.start("neighbour", 32)
    tenant = n.start("tenant", 8, unmap_after_ms=3000 if attack == "unmap" else None)
    key = ("team/tenant", n.gpu.uuid)
    wait(
        lambda: key in check.view and check.view[key].driver_share > 0.1, "the driver's figure of the tenant"
    )
    assert not check.view[key].flagged
    attacker = None
    if attack == "unmap":
        pass  # the tenant's process does it itself, 3 s after it started
    elif attack == "bypass":
        n.start("tenant", 8, preload=False)
    else:
        attacker = scribble(regions["tenant"] / "usage", attack, WAIT_S)
    try:
        wait(lambda: bool(events_about(api, "tenant")), "the Warning Event on the tenant")
        seen = check.view[key]
        assert (seen.flagged and seen.driver_share > seen.reported_share + check.config.tolerance) or over, (
            seen
        )
        if over:
            assert seen.driver_share > 0.25 + check.config.tolerance, seen  # the driver still shows its work
            wait(lambda: ("team", "tenant") in api.evictions(), "the tenant's eviction")
        time.sleep(3 * check.config.interval_s)
        assert len(events_about(api, "tenant")) == 1, "one Event per run above the share"
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.wait()
    neighbour = check.view[("team/neighbour", n.gpu.uuid)]
    assert not neighbour.flagged and not events_about(api, "neighbour"), neighbour
    assert ("team", "neighbour") not in api.evictions()
    assert abs(neighbour.driver_share - neighbour.reported_share) <= check.config.tolerance, neighbour
    if not over:
        assert ("team", "tenant") not in api.evictions(), "under-reporting alone is flagged, not evicted"
    assert tenant.poll() is None  # the stand-in API evicts nothing itself; the pod's processes run on
