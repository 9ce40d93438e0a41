"""The fake libnvidia-ml's per-process utilisation, read by gpunode's own NVML backend through
nvidia-ml-py as on a real node: each process's share of the SMs over a sampling period is the device
time the fake device's timeline gave it, so two processes time-slicing the device read about half each
(the deflation real NVML shows: each would fill the device alone), and one alone reads about all of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.native import fake_timeline as ft
from tests.native.harness import FAKE_TOTAL_BYTES
from tests.native.toolchain import NativeBuild

REPO = Path(__file__).resolve().parents[2]
READER = """
import json, sys, time
from gpunode.node.devices.nvml.backend import NvmlBackend
backend = NvmlBackend()
uuid = backend.gpus()[0].uuid
since = 0
for s in backend.process_utilization(uuid, since):  # the baseline sample
    since = max(since, s.timestamp_us)
for _ in sys.stdin:  # one period per line read: its samples, as JSON
    time.sleep(2.0)
    got = backend.process_utilization(uuid, since)
    since = max([since, *(s.timestamp_us for s in got)])
    print(json.dumps({s.pid: s.sm_percent for s in got}), flush=True)
backend.close()
"""


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ft.build_client(tmp_path_factory.mktemp("compute-client"))


def test_per_process_utilisation_shows_time_slicing(
    native_build: NativeBuild, client: Path, tmp_path: Path
) -> None:
    env = native_build.env(
        FAKE_CUDA_TOTAL_BYTES=str(FAKE_TOTAL_BYTES), FAKE_CUDA_TIMELINE=str(tmp_path / "timeline")
    )
    procs = []
    for _ in range(2):  # each would keep the device busy alone: 8 kernels of 1 ms per synchronisation
        p = subprocess.Popen(
            [str(client), "dlsym", "kernel", "1000", "8", "0"], env=env, stdout=subprocess.PIPE, text=True
        )
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        procs.append(p)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER],
        env={**env, "PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert reader.stdin is not None and reader.stdout is not None

    def period() -> dict[int, int]:
        reader.stdin.write("\n")
        reader.stdin.flush()
        line = reader.stdout.readline()
        assert line, reader.stderr.read() if reader.stderr else ""
        return {int(pid): pct for pid, pct in json.loads(line).items()}

    try:
        shared = period()
        procs[1].kill()
        procs[1].wait()
        period()  # the period in which the second process ended
        alone = period()
    finally:
        reader.stdin.close()
        reader.wait(timeout=30)
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
        for stream in (reader.stdout, reader.stderr):
            if stream:
                stream.close()
    a, b = procs[0].pid, procs[1].pid
    assert set(shared) == {a, b}, shared
    assert all(35 <= shared[pid] <= 65 for pid in (a, b)), shared  # time-sliced: about half each
    assert shared[a] + shared[b] >= 85, shared  # and the device busy all along
    assert alone.get(a, 0) >= 85 and b not in alone, alone  # alone: the whole device
