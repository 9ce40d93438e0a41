"""Fractional GPUs end to end: advertise memory units, keep a request on one GPU, cap it through Allocate.

The last test runs the real interposer (built by the native tests' toolchain)
against the fake libcuda with exactly the environment and mounts Allocate
returned, mapped from container paths to host paths as a container runtime would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpunode.node import doctor, memcap
from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import region_key
from gpunode.node.kubelet.podresources import ContainerDevices
from gpunode.node.memcap.compute import ComputeMode, read_compute
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn

MEM = "gpunode.io/gpu-memory"
GIB = 2**30
T4_BYTES = 15360 * 2**20


def fractional_doc(sockdir: Path, **frac: Any) -> dict[str, Any]:
    return {
        "gpunode": {
            "fractional": {"devices": [0, 1], "unit": "1Gi", **frac},
            "podResourcesSocket": str(sockdir / "pr.sock"),
        }
    }


@pytest.fixture
def agent(sockdir: Path, kubelet: KubeletStandIn) -> Iterator[RunningAgent]:
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", fractional_doc(sockdir))
    with RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4"))) as ra:
        kubelet.wait_for_resources([MEM, "nvidia.com/gpu"])
        yield ra


def units_of(kubelet: KubeletStandIn, gpu_uuid: str) -> list[str]:
    return sorted(
        (i for i in kubelet.healthy(MEM) if i.startswith(gpu_uuid)), key=lambda i: int(i.rsplit("mem", 1)[1])
    )


def host_path(mounts: Any, container_path: str) -> str:
    return next(m.host_path for m in mounts if m.container_path == container_path)


def test_units_are_advertised_per_gpu(agent: RunningAgent, kubelet: KubeletStandIn) -> None:
    gpus = agent.agent.backend.gpus()
    assert len(kubelet.healthy(MEM)) == 2 * (T4_BYTES // GIB)
    assert len(units_of(kubelet, gpus[0].uuid)) == 15
    assert sorted(kubelet.healthy("nvidia.com/gpu")) == sorted(g.uuid for g in gpus[2:])


def test_preferred_allocation_keeps_a_request_on_one_gpu(
    agent: RunningAgent, kubelet: KubeletStandIn
) -> None:
    gpus = agent.agent.backend.gpus()
    every = kubelet.healthy(MEM)
    chosen = kubelet.preferred(MEM, every, 6)
    assert len(chosen) == 6 and len({c.split("::")[0] for c in chosen}) == 1
    # GPU 0 has 3 free units left, GPU 1 all 15: a request for 4 must go to GPU 1, one for 3 may fit GPU 0.
    available = units_of(kubelet, gpus[0].uuid)[:3] + units_of(kubelet, gpus[1].uuid)
    four = kubelet.preferred(MEM, available, 4)
    assert {c.split("::")[0] for c in four} == {gpus[1].uuid}
    must = units_of(kubelet, gpus[1].uuid)[5]
    with_must = kubelet.preferred(MEM, available, 2, [must])
    assert must in with_must and {c.split("::")[0] for c in with_must} == {gpus[1].uuid}
    with pytest.raises(grpc.RpcError) as err:
        kubelet.preferred(MEM, available, 16)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_allocate_writes_a_capped_region_and_checkpoints_it(
    sockdir: Path, agent: RunningAgent, kubelet: KubeletStandIn
) -> None:
    gpu = agent.agent.backend.gpus()[0]
    ids = units_of(kubelet, gpu.uuid)[:4]
    resp = kubelet.allocate(MEM, ids)
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid
    assert resp.envs["LD_PRELOAD"].endswith("libgpunode-preload.so")
    region_dir = sockdir / "state" / "memcap" / region_key(ids)
    region = memcap.load_region(region_dir)
    assert [(d.uuid, d.limit_bytes) for d in region.devices] == [(gpu.uuid, 4 * GIB)]
    compute = read_compute(region)  # the compute share defaults to the memory share, work-conserving
    assert (compute.share_milli, compute.mode, compute.generation) == (
        4 * GIB * 1000 // gpu.memory_total_bytes,
        ComputeMode.WORK_CONSERVING,
        1,
    )
    limit_mount = next(m for m in resp.mounts if m.host_path == str(region.limit_path))
    usage_mount = next(m for m in resp.mounts if m.host_path == str(region.usage_path))
    assert limit_mount.read_only and not usage_mount.read_only
    staged = Path(host_path(resp.mounts, resp.envs["LD_PRELOAD"]))
    assert staged == sockdir / "state" / "lib" / "layout-2" / "libgpunode-preload.so", (
        "from the host state dir"
    )
    assert staged.read_bytes() == memcap.preload_library_path().read_bytes()
    saved = [json.loads(f.read_text()) for f in (sockdir / "state" / "checkpoint.d").iterdir()]
    assert [(c["key"], c["limit_bytes"], c["device_ids"]) for c in saved] == [(region.key, 4 * GIB, ids)]
    assert not (sockdir / "state" / "checkpoint.json").exists(), "one small file per cap, no single file"


def test_units_spanning_gpus_are_refused(agent: RunningAgent, kubelet: KubeletStandIn) -> None:
    g0, g1 = agent.agent.backend.gpus()[:2]
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(MEM, [units_of(kubelet, g0.uuid)[0], units_of(kubelet, g1.uuid)[0]])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one GPU" in (err.value.details() or "")


def test_capped_time_sliced_replicas(sockdir: Path, kubelet: KubeletStandIn) -> None:
    doc = {
        "sharing": {
            "timeSlicing": {"renameByDefault": True, "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}
        },
        "gpunode": {"replicaMemoryCap": "equal"},
    }
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    with RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4"))) as ra:
        kubelet.wait_for_resources(["nvidia.com/gpu.shared"])
        uuid = ra.agent.backend.gpus()[3].uuid
        resp = kubelet.allocate("nvidia.com/gpu.shared", [f"{uuid}::1"])
        region = memcap.load_region(sockdir / "state" / "memcap" / region_key([f"{uuid}::1"]))
        assert region.devices[0].limit_bytes == T4_BYTES // 4
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == uuid


def test_restart_keeps_every_cap(sockdir: Path, kubelet: KubeletStandIn) -> None:
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", fractional_doc(sockdir))
    backend = SimBackend.from_profile("t4")
    gpu = backend.gpus()[1]
    with RunningAgent(Agent(cfg, backend=backend)):
        kubelet.wait_for_resources([MEM])
        ids = units_of(kubelet, gpu.uuid)[2:7]
        kubelet.allocate(MEM, ids)
    region_dir = sockdir / "state" / "memcap" / region_key(ids)
    for f in region_dir.iterdir():  # the region is lost (e.g. a wiped host path) while the agent is down
        f.chmod(0o644)
        f.unlink()
    region_dir.rmdir()
    with RunningAgent(Agent(cfg, backend=backend)):
        kubelet.wait_for_resources([MEM])
        restored = memcap.load_region(region_dir)
        assert restored.devices[0].limit_bytes == 5 * GIB
        again = kubelet.allocate(MEM, ids)  # the same units allocated again: a fresh region, the same cap
        assert memcap.load_region(region_dir).devices[0].limit_bytes == 5 * GIB
        assert again.envs["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid


def test_corrupt_checkpoint_is_kept_aside(sockdir: Path, kubelet: KubeletStandIn) -> None:
    state = sockdir / "state"
    state.mkdir()
    (state / "checkpoint.json").write_text("{not json")
    cfg = make_config(sockdir / "device-plugins", state, fractional_doc(sockdir))
    with RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4"))) as ra:
        kubelet.wait_for_resources([MEM])
        assert ra.agent.checkpoint.problem and "could not be read" in ra.agent.checkpoint.problem
    aside = list(state.glob("checkpoint.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == "{not json"


def test_regions_of_vanished_containers_are_collected(sockdir: Path, kubelet: KubeletStandIn) -> None:
    doc = fractional_doc(sockdir, gcInterval="0.1s", gcGrace="0s")
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    backend = SimBackend.from_profile("t4")
    gpu = backend.gpus()[0]
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr, RunningAgent(Agent(cfg, backend=backend)) as ra:
        kubelet.wait_for_resources([MEM])
        units = units_of(kubelet, gpu.uuid)
        live, gone = units[:2], units[2:5]
        pr.set_pods([ContainerDevices("ns", "live", "c", MEM, tuple(live))])
        kubelet.allocate(MEM, live)
        kubelet.allocate(MEM, gone)
        root = sockdir / "state" / "memcap"
        deadline = time.monotonic() + 10
        # the pass removes the region in a worker thread, then drops its checkpoint and records the key:
        # wait for the record, the last of the three
        while region_key(gone) not in ra.agent.region_keeper.removed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (root / region_key(gone)).exists()
        assert (root / region_key(live)).is_dir()
        assert region_key(gone) in ra.agent.region_keeper.removed
        files = sorted(f.name for f in (sockdir / "state" / "checkpoint.d").iterdir())
        assert files == [f"{region_key(live)}.json"]


def test_no_collection_while_the_kubelet_cannot_be_asked(sockdir: Path, kubelet: KubeletStandIn) -> None:
    doc = fractional_doc(sockdir, gcInterval="0.1s", gcGrace="0s")
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    backend = SimBackend.from_profile("t4")
    with RunningAgent(Agent(cfg, backend=backend)) as ra:
        kubelet.wait_for_resources([MEM])
        ids = units_of(kubelet, backend.gpus()[0].uuid)[:2]
        kubelet.allocate(MEM, ids)
        time.sleep(0.5)  # several GC periods without a pod-resources socket
        assert (sockdir / "state" / "memcap" / region_key(ids)).is_dir()
        # Said in a metric and by doctor, with the fix.
        assert "gpunode_memcap_cleanup_blocked 1.0" in ra.agent.metrics.render().decode()
        check = next(c for c in doctor.checks(ra.agent.config) if c.name == "memory-cap clean-up")
        assert (
            check.status == doctor.WARN
            and "not collected" in check.detail
            and "does not exist" in check.detail
        )
        assert "pod-resources" in check.hint
    with PodResourcesStandIn(str(sockdir / "pr.sock")), RunningAgent(Agent(cfg, backend=backend)) as ra:
        kubelet.wait_for_resources([MEM])
        time.sleep(0.5)
        assert "gpunode_memcap_cleanup_blocked 0.0" in ra.agent.metrics.render().decode()
        check = next(c for c in doctor.checks(ra.agent.config) if c.name == "memory-cap clean-up")
        assert check.status == doctor.OK, check


def test_allocated_cap_holds_in_the_interposer(
    sockdir: Path, agent: RunningAgent, kubelet: KubeletStandIn, native_build: Any
) -> None:
    from tests.native.harness import run, snippet

    gpu = agent.agent.backend.gpus()[1]
    ids = units_of(kubelet, gpu.uuid)[:3]
    resp = kubelet.allocate(MEM, ids)
    region_in_container = resp.envs["GPUNODE_MEMCAP_REGION"]
    region_host = Path(host_path(resp.mounts, f"{region_in_container}/limit")).parent
    env = native_build.env(
        FAKE_CUDA_TOTAL_BYTES=str(T4_BYTES),
        FAKE_CUDA_UUIDS=gpu.uuid,
        GPUNODE_MEMCAP_REGION=str(region_host),
        LD_PRELOAD=host_path(resp.mounts, resp.envs["LD_PRELOAD"]),
    )
    for mode in ("dlopen", "procaddr"):
        result = run(snippet(native_build, mode, "cap", 3 * GIB), env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith("ok cap")
