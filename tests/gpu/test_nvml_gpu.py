"""NvmlBackend on a real NVIDIA GPU, checked against nvidia-smi and a real CUDA context.

Skipped, with the reason, where NVML cannot start or sees no GPU.
"""

from __future__ import annotations

import ctypes.util
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from gpunode.errors import BackendUnavailable
from gpunode.node.devices.nvml.backend import NvmlBackend
from gpunode.node.devices.select import detect_backend


def _why_no_gpu() -> str | None:
    try:
        backend = NvmlBackend()
    except BackendUnavailable as e:
        return f"no usable NVML here: {e}"
    try:
        return None if backend.gpus() else "NVML starts but sees no GPU"
    finally:
        backend.close()


_REASON = _why_no_gpu()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
MIG_UUID = re.compile(r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
BUS_ID = re.compile(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]")
WAIT_S = 10.0  # an upper bound for counters that move within milliseconds; never a measured time

# A process that holds 256 MiB of GPU memory through the CUDA driver API until its stdin closes.
CUDA_HOLDER = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0
assert cuda.cuDeviceGet(ctypes.byref(dev), int(sys.argv[1])) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), 256 << 20) == 0
print("ready", flush=True)
sys.stdin.read()
"""


def _smi(query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.strip().splitlines()]


def test_discovery_is_complete_and_well_formed(nvml: NvmlBackend) -> None:
    gpus = nvml.gpus()
    uuids = {g.uuid for g in gpus}
    assert [g.index for g in gpus] == list(range(len(gpus)))
    for g in gpus:
        assert GPU_UUID.fullmatch(g.uuid), g.uuid
        assert BUS_ID.fullmatch(g.pci_bus_id), g.pci_bus_id
        assert g.model and g.memory_total_bytes > 2**30 and g.minor >= 0
        assert g.numa_node is None or g.numa_node >= 0
        assert set(g.nvlink_peers) <= uuids - {g.uuid}
        for peer in g.nvlink_peers:
            assert g.uuid in next(o for o in gpus if o.uuid == peer).nvlink_peers
        assert g.mig_enabled or g.mig_devices == ()
        for m in g.mig_devices:
            assert MIG_UUID.fullmatch(m.uuid) and m.parent_uuid == g.uuid
            assert 1 <= m.slices <= 8 and re.fullmatch(r"(\d+c\.)?\d+g\.\d+gb(\+me)?", m.profile), m.profile
            assert 0 < m.memory_total_bytes < g.memory_total_bytes


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi is not installed")
def test_discovery_agrees_with_nvidia_smi(nvml: NvmlBackend) -> None:
    rows = _smi("index,uuid,pci.bus_id,name,memory.total,driver_version")
    gpus = nvml.gpus()
    assert len(rows) == len(gpus)
    for (index, uuid, bus, name, memory_mib, driver), g in zip(rows, gpus, strict=True):
        assert (int(index), uuid, bus.upper(), name) == (g.index, g.uuid, g.pci_bus_id, g.model)
        assert abs(int(memory_mib) * 2**20 - g.memory_total_bytes) <= 0.01 * g.memory_total_bytes
        assert driver == nvml.driver_version()


def test_sample_reads_plausible_values_and_energy_grows(nvml: NvmlBackend) -> None:
    gpu = nvml.gpus()[0]
    first = nvml.sample(gpu.uuid)
    assert first.power_w is not None and 0 < first.power_w < 2000
    assert first.gpu_temp_c is not None and 0 < first.gpu_temp_c < 120
    assert first.sm_clock_hz is not None and first.sm_clock_hz > 0
    assert first.memory_used_bytes is not None and first.memory_free_bytes is not None
    accounted = first.memory_used_bytes + first.memory_free_bytes + (first.memory_reserved_bytes or 0)
    assert abs(accounted - gpu.memory_total_bytes) <= 0.01 * gpu.memory_total_bytes
    assert first.total_energy_j is not None and first.total_energy_j > 0
    deadline = time.monotonic() + WAIT_S
    while (
        later := nvml.sample(gpu.uuid)
    ).total_energy_j == first.total_energy_j and time.monotonic() < deadline:
        time.sleep(0.05)
    assert later.total_energy_j is not None and later.total_energy_j > first.total_energy_j
    if gpu.architecture in ("hopper", "blackwell") and not gpu.mig_enabled:
        assert later.gr_engine_active is not None and 0.0 <= later.gr_engine_active <= 1.0
    if gpu.mig_enabled:
        assert [m.uuid for m in later.mig] == [m.uuid for m in gpu.mig_devices]


@pytest.mark.skipif(ctypes.util.find_library("cuda") is None, reason="libcuda is not installed")
def test_a_cuda_process_shows_up_with_its_memory(nvml: NvmlBackend) -> None:
    gpu = next((g for g in nvml.gpus() if not g.mig_enabled), None)
    if gpu is None:
        pytest.skip("every GPU is in MIG mode")
    before = nvml.sample(gpu.uuid).memory_used_bytes or 0
    holder = subprocess.Popen(
        [sys.executable, "-c", CUDA_HOLDER, str(gpu.index)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        | {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        procs = nvml.processes(gpu.uuid)
        assert procs, "NVML lists no process on a GPU that has a CUDA context"
        # Inside a container NVML may report host PIDs; the memory is there either way.
        ours = [p for p in procs if p.pid == holder.pid] or [
            p for p in procs if (p.used_memory_bytes or 0) >= 256 << 20
        ]
        assert ours and all(p.gpu_uuid == gpu.uuid for p in procs)
        assert (nvml.sample(gpu.uuid).memory_used_bytes or 0) >= before + (256 << 20)
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(timeout=60)


def test_probe_and_events(nvml: NvmlBackend) -> None:
    for gpu in nvml.gpus():
        probe = nvml.probe(gpu.uuid)
        assert probe.reachable, probe.detail
        assert probe.ecc_dbe_volatile is None or probe.ecc_dbe_volatile >= 0
    event = nvml.wait_event(0.2)  # registers XID/ECC events on every GPU; a healthy node has none pending
    assert event is None or event.gpu_uuid in {g.uuid for g in nvml.gpus()}


def test_auto_detection_picks_nvml() -> None:
    backend = detect_backend("auto")
    try:
        assert isinstance(backend, NvmlBackend) and backend.gpus()
    finally:
        backend.close()
