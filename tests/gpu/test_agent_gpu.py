"""The agent on a real GPU: fractional memory units from NVML, one Allocate, PyTorch under that cap.

The agent runs with the NVML backend and sells the first whole GPU in 1 GiB units. A
container's request for 4 units is allocated through the kubelet's gRPC API; PyTorch then
runs with exactly the environment and mounts the answer gave (container paths mapped to
host paths, as a runtime would), while the pod-resources stand-in lists the container. The
agent's own metrics must show that container's usage and cap, and the GPU's framebuffer.
Skipped without an NVIDIA GPU, NVML and PyTorch with CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpunode.errors import BackendUnavailable
from gpunode.node.agent import Agent
from gpunode.node.devices.nvml.backend import NvmlBackend
from gpunode.node.kubelet.podresources import ContainerDevices
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn
from tests.gpu.conftest import torch_with_cuda
from tests.ports import free_port

MEM = "gpunode.io/gpu-memory"
GIB = 1 << 30
MIB = 1 << 20

HOLD_PROGRAM = """
import json, sys, torch
free, total = torch.cuda.mem_get_info(0)
held = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
held.fill_(1)
torch.cuda.synchronize()
try:
    torch.empty(6 << 30, dtype=torch.uint8, device="cuda")
    over = "allocated"
except torch.cuda.OutOfMemoryError:
    over = "OutOfMemoryError"
print(json.dumps({"total": total, "over": over}), flush=True)
sys.stdin.readline()
"""


def _host(mounts: Any, container_path: str) -> str:
    return next(m.host_path for m in mounts if m.container_path == container_path)


def _series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of name in an exposition."""
    return [
        (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    ]


def _sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the first series of name whose labels include labels, or None."""
    return next((v for have, v in _series(text, name) if labels.items() <= have.items()), None)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def test_a_fractional_container_is_capped_and_attributed(sockdir: Path, kubelet: KubeletStandIn) -> None:
    if not torch_with_cuda():
        pytest.skip("PyTorch with CUDA is not installed")
    try:
        backend = NvmlBackend(probe_timeout_s=10.0)
    except BackendUnavailable as exc:
        pytest.skip(f"no usable NVML here: {exc}")
    gpu = next((g for g in backend.gpus() if not g.mig_enabled), None)
    if gpu is None:
        backend.close()
        pytest.skip("no whole (non-MIG) GPU")
    port = free_port()
    doc = {
        "gpunode": {
            "fractional": {"devices": [gpu.index], "unit": "1Gi"},
            "podResourcesSocket": str(sockdir / "pr.sock"),
            "metrics": {"listen": f"127.0.0.1:{port}", "interval": "1s"},
        }
    }
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pods, RunningAgent(Agent(cfg, backend=backend)):
        kubelet.wait_for_resources([MEM])
        units = [i for i in kubelet.healthy(MEM) if i.startswith(gpu.uuid)]
        assert len(units) == gpu.memory_total_bytes // GIB
        ids = kubelet.preferred(MEM, units, 4)
        answer = kubelet.allocate(MEM, ids)
        region_in_container = answer.envs["GPUNODE_MEMCAP_REGION"]
        env = dict(os.environ)
        env.update(answer.envs)
        env.update(
            {
                "LD_PRELOAD": _host(answer.mounts, answer.envs["LD_PRELOAD"]),
                "GPUNODE_MEMCAP_REGION": str(
                    Path(_host(answer.mounts, f"{region_in_container}/limit")).parent
                ),
                "CUDA_VISIBLE_DEVICES": gpu.uuid,
            }
        )
        pods.set_pods([ContainerDevices("research", "trainer-0", "main", MEM, tuple(ids))])
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_PROGRAM],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else "no output"
            assert json.loads(line) == {"total": 4 * GIB, "over": "OutOfMemoryError"}
            deadline = time.monotonic() + 30
            used = limit = fb_used = None
            while time.monotonic() < deadline:
                text = _scrape(port)
                series = {"UUID": gpu.uuid, "pod": "trainer-0", "namespace": "research", "container": "main"}
                used = _sample(text, "gpunode_container_memory_used_bytes", **series)
                limit = _sample(text, "gpunode_container_memory_limit_bytes", **series)
                fb_used = _sample(text, "DCGM_FI_DEV_FB_USED", UUID=gpu.uuid)
                if used is not None and used >= 3 * GIB and fb_used is not None and fb_used >= 3 * GIB / MIB:
                    break
                time.sleep(0.5)
            assert limit == 4 * GIB
            assert used is not None and 3 * GIB <= used <= 4 * GIB, used
            own = [
                line
                for line in text.splitlines()
                if line.startswith(("gpunode_metrics_", "gpunode_backend_errors", "DCGM_FI_DEV_FB_"))
            ]
            assert fb_used is not None and fb_used >= 3 * GIB / MIB, "\n".join(own)
            # The framebuffer series of a shared GPU carries no pod: several containers hold it.
            assert all(have.get("pod") != "trainer-0" for have, _ in _series(text, "DCGM_FI_DEV_FB_USED"))
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=120)
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
