"""PyTorch and nvidia-smi on a real GPU under the memory-cap interposer (4 GiB cap).

Skipped without an NVIDIA GPU, NVML and PyTorch with CUDA. The capped programs run
in subprocesses, because the library must be preloaded when a process starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode.errors import BackendUnavailable
from gpunode.node import memcap
from gpunode.node.devices.nvml.backend import NvmlBackend
from tests.gpu.conftest import torch_with_cuda

GIB = 1 << 30
CAP_BYTES = 4 * GIB

TORCH_PROGRAM = """
import json, torch
assert torch.cuda.is_available(), "CUDA is not available to torch"
free, total = torch.cuda.mem_get_info(0)
result = {"mem_get_info_total": total, "mem_get_info_free": free}
small = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
small.fill_(1)
torch.cuda.synchronize()
result["three_gib_ok"] = True
try:
    big = torch.empty(6 << 30, dtype=torch.uint8, device="cuda")
    result["six_gib"] = "allocated"
except torch.cuda.OutOfMemoryError:
    result["six_gib"] = "OutOfMemoryError"
result["total_after"] = torch.cuda.mem_get_info(0)[1]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def gpu_region(tmp_path_factory: pytest.TempPathFactory) -> tuple[memcap.Region, str]:
    try:
        backend = NvmlBackend()
    except BackendUnavailable as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    try:
        gpus = backend.gpus()
    finally:
        backend.close()
    if not gpus:
        pytest.skip("no NVIDIA GPU")
    gpu = next((g for g in gpus if not g.mig_enabled), None)
    if gpu is None:
        pytest.skip("every GPU is in MIG mode; this test needs a whole GPU")
    if gpu.memory_total_bytes < 8 * GIB:
        pytest.skip("the GPU has less than 8 GiB, so a 6 GiB tensor would fail without the cap")
    region = memcap.create_region(
        tmp_path_factory.mktemp("regions"),
        "torch",
        gpu_uuid=gpu.uuid,
        limit_bytes=CAP_BYTES,
        device_total_bytes=gpu.memory_total_bytes,
    )
    return region, gpu.uuid


def _capped_env(region: memcap.Region, gpu_uuid: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "LD_PRELOAD": str(memcap.preload_library_path()),
            memcap.ENV_REGION: str(region.path),
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
            memcap.ENV_LOG_LEVEL: "info",
        }
    )
    return env


def test_pytorch_is_capped_at_4_gib(gpu_region: tuple[memcap.Region, str]) -> None:
    if not torch_with_cuda():
        pytest.skip("PyTorch with CUDA is not installed")
    region, uuid = gpu_region
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_PROGRAM],
        env=_capped_env(region, uuid),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mem_get_info_total"] == CAP_BYTES
    assert result["mem_get_info_free"] <= CAP_BYTES
    assert result["three_gib_ok"] is True
    assert result["six_gib"] == "OutOfMemoryError"
    assert result["total_after"] == CAP_BYTES
    assert "[gpunode-memcap]" in proc.stderr  # the library was active (info level logs registration)
    memcap.reclaim_dead(region)  # the exited process's tensors (PyTorch does not free at exit)
    assert memcap.read_usage(region).used_bytes == 0


def test_nvidia_smi_shows_the_cap(gpu_region: tuple[memcap.Region, str]) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi is not installed")
    region, uuid = gpu_region
    proc = subprocess.run(
        [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", uuid],
        env=_capped_env(region, uuid),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert int(proc.stdout.strip().splitlines()[0]) == CAP_BYTES // (1 << 20)


def test_preload_library_is_the_installed_one() -> None:
    assert Path(memcap.preload_library_path()).is_file()
