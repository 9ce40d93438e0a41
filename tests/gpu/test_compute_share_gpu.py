"""The compute share with real kernels on a real GPU: PyTorch matmuls (launched as kernels, or
replayed as a CUDA graph) in containers of one process each, under the interposer with a hard share.

The ground truth is the work done: a matmul takes the same GPU time whoever else runs, so a
process's achieved share is its matmul rate over the rate it reaches alone on the GPU (measured
first, without the interposer). Skipped without an NVIDIA GPU, NVML and PyTorch with CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode.errors import BackendUnavailable
from gpunode.node import memcap
from gpunode.node.devices.nvml.backend import NvmlBackend
from gpunode.node.memcap.compute import ComputeMode, set_compute_share
from tests.gpu.conftest import torch_with_cuda

TOLERANCE = 0.05
SECONDS = 8.0
WARM_UP_WINDOWS = 2  # of 1 s

PROGRAM = """
import json, sys, time, torch
kind, seconds = sys.argv[1], float(sys.argv[2])
n = 2048
a = torch.randn(n, n, device="cuda")
b = torch.randn(n, n, device="cuda")
c = torch.empty_like(a)

def step():
    torch.matmul(a, b, out=c)

run = step
if kind == "graph":
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    run = graph.replay
for _ in range(10):
    run()
torch.cuda.synchronize()
print("ready", flush=True)
rates, count, t0 = [], 0, time.monotonic()
end = t0 + seconds
while time.monotonic() < end:
    for _ in range(4):
        run()
    torch.cuda.synchronize()
    count += 4
    now = time.monotonic()
    if now - t0 >= 1.0:
        rates.append(count / (now - t0))
        count, t0 = 0, now
print(json.dumps(rates), flush=True)
"""


@pytest.fixture(scope="module")
def gpu() -> tuple[str, int]:
    if not torch_with_cuda():
        pytest.skip("PyTorch with CUDA is not available")
    try:
        backend = NvmlBackend()
    except BackendUnavailable as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    try:
        gpus = [g for g in backend.gpus() if not g.mig_enabled]
    finally:
        backend.close()
    if not gpus:
        pytest.skip("no whole (non-MIG) NVIDIA GPU")
    return gpus[0].uuid, gpus[0].memory_total_bytes


def start(kind: str, env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, kind, str(SECONDS)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line + (proc.stderr.read() if proc.stderr else "")
    return proc


def rates_of(proc: subprocess.Popen[str]) -> list[float]:
    out, err = proc.communicate(timeout=SECONDS + 120)
    assert proc.returncode == 0, err
    return [float(r) for r in json.loads(out.strip().splitlines()[-1])]


def env_for(gpu_uuid: str, region: memcap.Region | None) -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu_uuid)
    if region is not None:
        env.update({"LD_PRELOAD": str(memcap.preload_library_path()), memcap.ENV_REGION: str(region.path)})
    return env


def solo_rate(gpu_uuid: str, kind: str) -> float:
    rates = rates_of(start(kind, env_for(gpu_uuid, None)))
    return max(rates[WARM_UP_WINDOWS:])


@pytest.mark.parametrize(
    ("kind", "shares"),
    [("kernel", [300]), ("graph", [300]), ("kernel", [500, 500]), ("kernel", [700, 250])],
    ids=["30-alone", "30-alone-graph", "50/50", "70/25"],
)
def test_hard_shares_hold_on_a_real_gpu(
    gpu: tuple[str, int], tmp_path: Path, kind: str, shares: list[int]
) -> None:
    gpu_uuid, total = gpu
    alone = solo_rate(gpu_uuid, kind)
    regions = []
    for i, share in enumerate(shares):
        region = memcap.create_region(
            tmp_path / "regions", f"c{i}", gpu_uuid=gpu_uuid, limit_bytes=total, device_total_bytes=total
        )
        set_compute_share(region, share, ComputeMode.HARD)
        regions.append(region)
    procs = [start(kind, env_for(gpu_uuid, r)) for r in regions]
    achieved = [[rate / alone for rate in rates_of(p)[WARM_UP_WINDOWS:]] for p in procs]
    for share, series in zip(shares, achieved, strict=True):
        worst = max(abs(a - share / 1000) for a in series)
        assert worst <= TOLERANCE, f"target {share / 10:.0f}%, achieved {[f'{a:.1%}' for a in series]}"


def test_the_driver_reports_each_process_share_as_the_cross_check_reads_it(
    gpu: tuple[str, int], tmp_path: Path
) -> None:
    """nvmlDeviceGetProcessUtilization through NvmlBackend.process_utilization: a process held to a hard 30%
    reads about 30% of the SMs by the driver, one alone about all of them."""
    import time

    gpu_uuid, total = gpu
    region = memcap.create_region(
        tmp_path / "regions", "held", gpu_uuid=gpu_uuid, limit_bytes=total, device_total_bytes=total
    )
    set_compute_share(region, 300, ComputeMode.HARD)
    backend = NvmlBackend()
    try:
        for env, low, high in ((env_for(gpu_uuid, region), 0.15, 0.45), (env_for(gpu_uuid, None), 0.7, 1.0)):
            proc = start("kernel", env)
            since = int(time.time() * 1e6)
            time.sleep(3.0)
            samples = [s for s in backend.process_utilization(gpu_uuid, since) if s.pid == proc.pid]
            rates_of(proc)
            assert samples, "NVML gave no sample of the running process"
            mean = sum(s.sm_percent for s in samples) / len(samples) / 100
            assert low <= mean <= high, f"{mean:.0%} of the SMs by the driver, expected {low:.0%}..{high:.0%}"
    finally:
        backend.close()
