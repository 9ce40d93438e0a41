"""The driver's per-process figures the compute-share cross-check relies on: NVML's
nvmlDeviceGetProcessUtilization through NvmlBackend, the simulated backend's equivalent with
time-slicing's deflation, and the cross-check's metrics."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpunode.config.sharing import ComputeShareCheck
from gpunode.errors import GpuLostError
from gpunode.node.allocation.sharecheck import PodCompute, ShareCheck
from gpunode.node.allocation.shares import ComputeShares
from gpunode.node.devices.base import ProcessUtilization
from gpunode.node.devices.nvml.backend import NvmlBackend
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.memcap.checkpoint import Checkpoint
from gpunode.node.memcap.compute import ComputeMode
from tests.node.test_nvml_backend import FakeNvml, t4_pair

E = pynvml


class NvmlWithSamples(FakeNvml):
    """The fake NVML with per-process utilisation samples per GPU index (pid, timestamp us, sm %)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.samples: dict[int, list[tuple[int, int, int]]] = {}
        self.empty_as_success = False

    def nvmlDeviceGetProcessUtilization(self, h: Any, since: int) -> list[Any]:
        gpu, _ = self._dev(h, "nvmlDeviceGetProcessUtilization")
        rows = [s for s in self.samples.get(self.gpus.index(gpu), []) if s[1] > since]
        if not rows:  # real NVML: NOT_FOUND; nvidia-ml-py's size probe can also surface SUCCESS as an error
            raise pynvml.NVMLError(E.NVML_SUCCESS if self.empty_as_success else E.NVML_ERROR_NOT_FOUND)
        out = []
        for pid, ts, sm in rows:
            sample = pynvml.c_nvmlProcessUtilizationSample_t()
            sample.pid, sample.timeStamp, sample.smUtil = pid, ts, sm
            out.append(sample)
        return out


def test_nvml_per_process_utilisation_since_a_timestamp() -> None:
    fake = NvmlWithSamples(t4_pair())
    backend = NvmlBackend(nvml=fake)
    uuid = backend.gpus()[0].uuid
    fake.samples[0] = [(101, 1_000, 40), (102, 1_000, 35), (101, 2_000, 55), (0, 2_000, 9)]
    got = backend.process_utilization(uuid, 1_000)
    assert got == (ProcessUtilization(101, 2_000, 55),)  # after the timestamp only; pid 0 is no process
    assert len(backend.process_utilization(uuid, 0)) == 3
    assert backend.process_utilization(uuid, 5_000) == ()  # NOT_FOUND: no sample since
    fake.empty_as_success = True
    assert backend.process_utilization(uuid, 5_000) == ()
    fake.gpus[0].lost = True
    with pytest.raises(GpuLostError):
        backend.process_utilization(uuid, 0)


def test_sim_utilisation_is_the_device_time_each_process_got() -> None:
    now = [1000.0]
    backend = SimBackend.from_profile("t4", wall_clock=lambda: now[0])
    uuid = backend.gpus()[0].uuid
    backend.report_process_busy(uuid, {7: 0, 8: 0})
    now[0] += 1.0
    # Two processes time-slice the GPU: each got half of the second, though each would fill it alone.
    backend.report_process_busy(uuid, {7: 500_000_000, 8: 500_000_000})
    now[0] += 1.0
    backend.report_process_busy(uuid, {7: 1_400_000_000})  # 8 ended; 7 alone got 90%
    samples = backend.process_utilization(uuid, 0)
    assert [(s.pid, s.sm_percent) for s in samples] == [(7, 50), (8, 50), (7, 90)]
    assert [(s.pid, s.sm_percent) for s in backend.process_utilization(uuid, samples[1].timestamp_us)] == [
        (7, 90)
    ]
    assert [p.pid for p in backend.processes(uuid)] == [7]  # the driver's pid list follows the reports


def test_the_check_exports_both_figures_per_pod(tmp_path: Path) -> None:
    backend = SimBackend.from_profile("t4")

    async def no_containers() -> list[Any]:
        return []

    shares = ComputeShares(
        checkpoint=Checkpoint(tmp_path),
        regions_root=tmp_path / "memcap",
        list_containers=no_containers,
        asks=dict,
    )
    check = ShareCheck(
        backend=backend, shares=shares, config=ComputeShareCheck(), pod_uids=dict, api=None, node_name="n",
        mode_of=lambda _: ComputeMode.HARD,
    )  # fmt: skip
    gpu = backend.gpus()[0].uuid
    check.view[("team/a", gpu)] = PodCompute("team/a", gpu, 250, ComputeMode.HARD, 0.6, 0.25, True)
    check.unattributed[gpu] = 0.125
    registry = CollectorRegistry()
    registry.register(check.collector())
    text = generate_latest(registry).decode()
    labels = f'gpu="{gpu}",namespace="team",pod="a"'
    assert f"gpunode_pod_compute_share_driver{{{labels}}} 0.6" in text
    assert f"gpunode_pod_compute_share_reported{{{labels}}} 0.25" in text
    assert f"gpunode_pod_compute_share_flagged{{{labels}}} 1.0" in text
    assert f'gpunode_gpu_compute_unattributed_share{{gpu="{gpu}"}} 0.125' in text
    asyncio.run(check.tick())  # no capped pod: nothing measured, nothing flagged
    assert check.watches == {}


CLAIMER = """
import fcntl, mmap, os, struct, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
for i, pid in enumerate(sys.argv[2:]):
    offset = 128 + 128 * i  # struct gpunode_memcap_usage.slots[i]
    with mmap.mmap(fd, 0) as m:
        struct.pack_into("<Qi", m, offset, 0x5EED + i, int(pid))
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
print("claimed", flush=True)
time.sleep(60)
"""


def claim_slots(usage: Path, *pids: int) -> subprocess.Popen[str]:
    """What a tenant can do to its own usage file: write slots claiming `pids` and hold their locks (in a
    process of its own), so they read as live processes of its container."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, str(usage), *map(str, pids)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    return proc


def _shares_over_regions(
    tmp_path: Path, checkpoint: Checkpoint, gpu: Any, keys: Iterable[str]
) -> ComputeShares:
    """A 1 GiB capped region for each key on `gpu`, checkpointed, and the share loop over them (no
    containers listed: the tests set its plan themselves)."""
    from gpunode.node import memcap
    from gpunode.node.memcap.checkpoint import CapRecord

    for key in keys:
        memcap.create_region(
            tmp_path / "memcap",
            key,
            gpu_uuid=gpu.uuid,
            limit_bytes=2**30,
            device_total_bytes=gpu.memory_total_bytes,
        )
        checkpoint.replace(CapRecord(key, "r", (key,), gpu.uuid, 2**30, gpu.memory_total_bytes, False, 1.0))

    async def no_containers() -> list[Any]:
        return []

    return ComputeShares(
        checkpoint=checkpoint, regions_root=tmp_path / "memcap", list_containers=no_containers, asks=dict
    )


def test_a_tenant_claiming_a_neighbours_pid_does_not_take_its_gpu_time(tmp_path: Path) -> None:
    """The pids a region lists are the tenant's to write: the host's cgroup decides where it says anything."""
    from gpunode.node.allocation.shares import Planned

    now = [1000.0]
    backend = SimBackend.from_profile("t4", wall_clock=lambda: now[0])
    gpu = backend.gpus()[0]
    checkpoint = Checkpoint(tmp_path)
    keys = {"team/tenant": "a" * 20, "team/neighbour": "b" * 20}
    shares = _shares_over_regions(tmp_path, checkpoint, gpu, keys.values())
    shares.planned = {k: Planned(k, pod, gpu.uuid, 250, False) for pod, k in keys.items()}
    shares.owners = {k: pod for pod, k in keys.items()}
    uids = {
        "team/tenant": "11111111-2222-4333-8444-555555555555",
        "team/neighbour": "66666666-7777-4888-9999-aaaaaaaaaaaa",
    }
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-pod{uids['team/neighbour'].replace('-', '_')}.slice\n"
    )
    clock = [0.0]
    check = ShareCheck(
        backend=backend, shares=shares, config=ComputeShareCheck(), pod_uids=lambda: uids, api=None, node_name="n",
        mode_of=lambda _: ComputeMode.HARD, proc_root=proc, clock=lambda: clock[0],
    )  # fmt: skip
    tenant_usage = tmp_path / "memcap" / keys["team/tenant"] / "usage"
    claimer = claim_slots(tenant_usage, 4242, 4343)  # the neighbour's pid, and one of its own
    try:
        backend.report_process_busy(gpu.uuid, {4242: 0, 4343: 0, 4444: 0})
        asyncio.run(check.tick())
        now[0] += 1.0
        clock[0] += 1.0
        backend.report_process_busy(gpu.uuid, {4242: 600_000_000, 4343: 200_000_000, 4444: 100_000_000})
        asyncio.run(check.tick())
    finally:
        claimer.kill()
        claimer.wait()
    neighbour, tenant = check.view[("team/neighbour", gpu.uuid)], check.view[("team/tenant", gpu.uuid)]
    assert neighbour.driver_share == pytest.approx(
        0.6
    )  # its cgroup says so, whatever the tenant's slots claim
    assert tenant.driver_share == pytest.approx(0.2)  # 4343: no cgroup names a pod, its region's claim counts
    assert check.unattributed[gpu.uuid] == pytest.approx(0.1)  # 4444: no pod accounts for it


def test_an_event_the_api_refused_and_a_blocked_eviction_are_tried_again(tmp_path: Path) -> None:
    """The API server fails the Event once and a PodDisruptionBudget blocks the eviction twice: the next
    windows post the one Event and evict the pod."""
    from gpunode.infra.kube import KubeClient
    from gpunode.node.allocation.shares import Planned
    from tests.fakes.apiserver import ApiServerStandIn
    from tests.node.test_publish import kubeconfig

    now = [1000.0]
    backend = SimBackend.from_profile("t4", wall_clock=lambda: now[0])
    gpu = backend.gpus()[0]
    checkpoint = Checkpoint(tmp_path)
    key = "c" * 20
    shares = _shares_over_regions(tmp_path, checkpoint, gpu, [key])
    shares.planned = {key: Planned(key, "team/greedy", gpu.uuid, 100, False)}
    shares.owners = {key: "team/greedy"}
    uid = "12345678-1234-4234-8234-123456789abc"
    (tmp_path / "proc" / "77").mkdir(parents=True)
    (tmp_path / "proc" / "77" / "cgroup").write_text(f"12:pids:/kubepods/pod{uid}/abc\n")
    with ApiServerStandIn() as api:
        api.add_pod("team", "greedy", node_name="n", uid=uid)
        api.fail("POST", r"/api/v1/namespaces/team/events$", 500, times=1)
        api.block_evictions("team", "greedy", times=2)
        config = kubeconfig(tmp_path / "kubeconfig", api.url)
        clock = [0.0]
        check = ShareCheck(
            backend=backend, shares=shares, config=ComputeShareCheck(interval_s=1.0, flag_after_s=2.0, evict=True),
            pod_uids=lambda: {"team/greedy": uid},
            api=lambda: KubeClient.from_environment(kubeconfig=str(config), request_timeout_s=5.0),
            node_name="n", mode_of=lambda _: ComputeMode.HARD, proc_root=tmp_path / "proc", clock=lambda: clock[0],
        )  # fmt: skip

        async def windows(count: int) -> None:
            for _ in range(count):
                now[0] += 1.0
                clock[0] += 1.0
                backend.report_process_busy(gpu.uuid, {77: int((now[0] - 1000.0) * 0.9e9)})  # 90% of the GPU
                await check.tick()

        async def scenario() -> None:
            backend.report_process_busy(gpu.uuid, {77: 0})
            await check.tick()
            await windows(2)  # flagged now (2 s above 10% + 5 points): the Event fails
            assert check.view[("team/greedy", gpu.uuid)].flagged and not check.posted
            await windows(1)  # posted; the eviction is blocked
            await windows(2)  # blocked once more, then evicted
            await windows(2)  # nothing more: one Event, one eviction
            await check._client().close()

        asyncio.run(scenario())
        events = [e for e in api.events() if e.get("reason") == "ComputeShareExceeded"]
        assert len(events) == 1 and events[0]["involvedObject"]["uid"] == uid
        assert "above its hard compute share of 100/1000" in events[0]["message"]
        assert api.evictions() == [("team", "greedy")] * 3  # two blocked by the budget, then granted
        assert check.evicted == {"team/greedy"}
