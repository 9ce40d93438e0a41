"""An agent upgrade that changes the region layout (version 1, memory only, to version 2 with the compute
share) leaves the older agent's interposer where its pods' allocations point.

The kubelet keeps each pod's Allocate answer and mounts the same host path again when one of its
containers restarts; had the new agent staged its library over the old one, such a container would get a
version 2 library with its version 1 region, which the library refuses (its allocations fail until the pod
is re-created). Libraries are staged one directory per layout instead.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.memcap import preload_library_path
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn

MEM = "gpunode.io/gpu-memory"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_an_older_agents_library_stays_where_its_allocations_point(
    sockdir: Path, kubelet: KubeletStandIn
) -> None:
    state = sockdir / "state"
    older = state / "lib" / "libgpunode-preload.so"  # where a layout-1 agent staged its library
    older.parent.mkdir(parents=True)
    older.write_bytes(b"\x7fELF the older agent's interposer")
    dead = _dead_pid()
    stale = state / "lib" / "layout-2" / f".libgpunode-preload.so.{dead}.tmp"  # a killed agent's half-write
    stale.parent.mkdir()
    stale.write_bytes(b"half")
    doc = {"gpunode": {"fractional": {"devices": [0], "unit": "1Gi"}}}
    cfg = make_config(sockdir / "device-plugins", state, doc)
    backend = SimBackend.from_profile("t4")
    gpu = backend.gpus()[0]
    with RunningAgent(Agent(cfg, backend=backend)):
        kubelet.wait_for_resources([MEM])
        unit = next(i for i in kubelet.healthy(MEM) if i.startswith(gpu.uuid))
        resp = kubelet.allocate(MEM, [unit])
        staged = Path(next(m.host_path for m in resp.mounts if m.container_path == resp.envs["LD_PRELOAD"]))
    assert staged == state / "lib" / "layout-2" / "libgpunode-preload.so"
    assert not stale.exists()
    assert staged.read_bytes() == preload_library_path().read_bytes()
    assert older.read_bytes() == b"\x7fELF the older agent's interposer", "the older library was not replaced"
    inode = os.stat(staged).st_ino
    with RunningAgent(Agent(cfg, backend=backend)):  # the same agent again: the staged file is kept as is
        kubelet.wait_for_resources([MEM])
    assert os.stat(staged).st_ino == inode
