"""What one holder of memory units can leave behind must not reach the next one, nor host users.

- Allocate gives every container a fresh region (new generation, no usage) whatever the
  previous holder of the same units did to its usage file.
- On the host only root can reach the regions: another user can neither list the keys nor
  open a container's usage file for writing.
- Temporary files a killed agent left in the state directory are removed at start.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.node import memcap
from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import region_key
from gpunode.node.memcap.checkpoint import Checkpoint, remove_stale_temp_files
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn

MEM = "gpunode.io/gpu-memory"
GIB = 2**30
T4_BYTES = 15360 * 2**20
USED_BYTES_OFFSET = 64  # struct gpunode_memcap_usage.used_bytes[0]
GENERATION_OFFSET = 16  # struct gpunode_memcap_usage.generation


def _zero_magic(usage: Path) -> None:
    with usage.open("r+b") as f:
        f.write(b"\0" * 8)


def _garbage(usage: Path) -> None:
    usage.write_bytes(os.urandom(usage.stat().st_size))


def _truncated(usage: Path) -> None:
    os.truncate(usage, 0)


def _wrong_generation(usage: Path) -> None:
    with usage.open("r+b") as f:
        f.seek(GENERATION_OFFSET)
        f.write(struct.pack("<Q", 0x1234567890ABCDEF))


def _huge_counter(usage: Path) -> None:
    with usage.open("r+b") as f:
        f.seek(USED_BYTES_OFFSET)
        f.write(struct.pack("<Q", 2**63))


DAMAGE = [
    pytest.param(_zero_magic, id="zero-magic"),
    pytest.param(_garbage, id="garbage"),
    pytest.param(_truncated, id="truncated"),
    pytest.param(_wrong_generation, id="wrong-generation"),
    pytest.param(_huge_counter, id="huge-counter"),
]


@pytest.fixture
def agent(sockdir: Path, kubelet: KubeletStandIn) -> Iterator[RunningAgent]:
    doc = {"gpunode": {"fractional": {"devices": [0, 1], "unit": "1Gi"}}}
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    with RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4"))) as ra:
        kubelet.wait_for_resources([MEM])
        yield ra


def units_of(kubelet: KubeletStandIn, gpu_uuid: str) -> list[str]:
    ids = [i for i in kubelet.healthy(MEM) if i.startswith(gpu_uuid)]
    return sorted(ids, key=lambda i: int(i.rsplit("mem", 1)[1]))


@pytest.mark.parametrize("damage", DAMAGE)
def test_the_next_holder_gets_a_fresh_region(
    sockdir: Path, agent: RunningAgent, kubelet: KubeletStandIn, damage: Callable[[Path], None]
) -> None:
    gpu = agent.agent.backend.gpus()[0]
    ids = units_of(kubelet, gpu.uuid)[:3]
    kubelet.allocate(MEM, ids)
    region_dir = sockdir / "state" / "memcap" / region_key(ids)
    before = memcap.load_region(region_dir)
    damage(before.usage_path)  # what the departing container leaves behind
    kubelet.allocate(MEM, ids)  # the next container on the same units
    after = memcap.load_region(region_dir)
    assert after.generation != before.generation
    assert [(d.uuid, d.limit_bytes) for d in after.devices] == [(gpu.uuid, 3 * GIB)]
    usage = memcap.read_usage(after)
    assert (usage.used_bytes, usage.per_process, usage.registrations) == (0, (), 0)
    assert agent.agent.checkpoint.records()[region_dir.name].limit_bytes == 3 * GIB
    assert [p.name for p in region_dir.parent.iterdir()] == [region_dir.name], "no leftovers"


def test_a_fresh_region_is_usable_up_to_its_cap(
    sockdir: Path, agent: RunningAgent, kubelet: KubeletStandIn, native_build: Any
) -> None:
    from tests.native.harness import run, snippet

    gpu = agent.agent.backend.gpus()[1]
    ids = units_of(kubelet, gpu.uuid)[:3]
    kubelet.allocate(MEM, ids)
    region_dir = sockdir / "state" / "memcap" / region_key(ids)
    _huge_counter(region_dir / memcap.USAGE_FILE)
    _zero_magic(region_dir / memcap.USAGE_FILE)
    resp = kubelet.allocate(MEM, ids)
    library = next(m.host_path for m in resp.mounts if m.container_path == resp.envs["LD_PRELOAD"])
    env = native_build.env(
        FAKE_CUDA_TOTAL_BYTES=str(T4_BYTES),
        FAKE_CUDA_UUIDS=gpu.uuid,
        GPUNODE_MEMCAP_REGION=str(region_dir),
        LD_PRELOAD=library,
    )
    result = run(snippet(native_build, "dlopen", "cap", 3 * GIB), env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok cap")


def test_replace_region_keeps_the_old_holders_mapping(tmp_path: Path) -> None:
    caps = (memcap.DeviceCap("GPU-a", GIB, 16 * GIB),)
    old = memcap.replace_region(tmp_path, "k", devices=caps)
    with old.usage_path.open("r+b") as f:
        f.seek(USED_BYTES_OFFSET)
        f.write(struct.pack("<Q", 12345))
        new = memcap.replace_region(tmp_path, "k", devices=caps)
        f.seek(USED_BYTES_OFFSET)
        assert struct.unpack("<Q", f.read(8))[0] == 12345  # the old file lives on for its holder
    assert new.generation != old.generation
    assert memcap.read_usage(new).used_bytes == 0


# ---- host users -------------------------------------------------------------------------


def _as_nobody(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    setpriv = shutil.which("setpriv")
    assert setpriv is not None
    cmd = [
        setpriv,
        "--reuid",
        "65534",
        "--regid",
        "65534",
        "--clear-groups",
        sys.executable,
        "-c",
        code,
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


PROBE = """
import os, sys
results = []
try:
    os.listdir(sys.argv[1]); results.append("listed")
except PermissionError:
    results.append("no-list")
try:
    os.close(os.open(sys.argv[2], os.O_RDWR)); results.append("opened")
except PermissionError:
    results.append("no-open")
print(" ".join(results))
"""


@pytest.fixture
def open_state_dir() -> Iterator[Path]:
    """A state directory any user may traverse (pytest's own temporary directories are root-only)."""
    path = Path(tempfile.mkdtemp(prefix="gpunode-state-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_host_users_cannot_reach_the_regions(open_state_dir: Path) -> None:
    root = open_state_dir / "memcap"
    region = memcap.create_region(root, "ctr", gpu_uuid="GPU-a", limit_bytes=GIB, device_total_bytes=GIB)
    assert stat.S_IMODE(root.stat().st_mode) == memcap.REGIONS_ROOT_MODE == 0o700
    assert stat.S_IMODE(region.path.stat().st_mode) == memcap.REGION_DIR_MODE == 0o700
    assert _as_nobody(PROBE, str(root), str(region.usage_path)).stdout.split() == ["no-list", "no-open"]
    # A root left open by an older version, and a region in it, are tightened at start.
    os.chmod(root, 0o755)
    os.chmod(region.path, 0o755)
    assert _as_nobody(PROBE, str(root), str(region.usage_path)).stdout.split() == ["listed", "opened"]
    assert sorted(memcap.secure_root(root)) == [root, region.path]
    assert _as_nobody(PROBE, str(root), str(region.usage_path)).stdout.split() == ["no-list", "no-open"]
    assert memcap.read_usage(region).limit_bytes == GIB  # root (the agent, the runtime) still can


def test_the_agent_tightens_an_open_regions_root_at_start(sockdir: Path, kubelet: KubeletStandIn) -> None:
    root = sockdir / "state" / "memcap"
    region = memcap.create_region(root, "ctr", gpu_uuid="GPU-a", limit_bytes=GIB, device_total_bytes=GIB)
    os.chmod(root, 0o755)
    os.chmod(region.path, 0o755)
    doc = {"gpunode": {"fractional": {"devices": [0], "unit": "1Gi"}}}
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", doc)
    with RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4"))):
        kubelet.wait_for_resources([MEM])
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert stat.S_IMODE(region.path.stat().st_mode) == 0o700


# ---- leftovers of a killed agent ----------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_files_are_removed_at_start(sockdir: Path, kubelet: KubeletStandIn) -> None:
    state = sockdir / "state"
    region = memcap.create_region(
        state / "memcap", "ctr", gpu_uuid="GPU-a", limit_bytes=GIB, device_total_bytes=GIB
    )
    (state / "lib").mkdir(parents=True)
    dead, live = _dead_pid(), os.getppid()
    stale = [
        state / f".checkpoint.json.{dead}.tmp",
        state / "lib" / f".libgpunode-preload.so.{dead}.tmp",
        region.path / f".ld.so.preload.{dead}.tmp",
    ]
    kept = [state / f".checkpoint.json.{live}.tmp", state / "notes.tmp", state / ".other.tmp"]
    for path in stale + kept:
        path.write_text("x")
    doc = {"gpunode": {"fractional": {"devices": [0], "unit": "1Gi"}}}
    cfg = make_config(sockdir / "device-plugins", state, doc)
    with RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4"))):
        kubelet.wait_for_resources([MEM])
        assert [p for p in stale if p.exists()] == []
        assert [p for p in kept if not p.exists()] == []


def test_a_temporary_file_with_the_agents_own_pid_is_stale(tmp_path: Path) -> None:
    """A restarted agent in a container often gets its predecessor's pid."""
    own = tmp_path / f".checkpoint.json.{os.getpid()}.tmp"
    own.write_text("{}")
    assert remove_stale_temp_files(tmp_path) == [own]
    own.write_text("{}")
    Checkpoint(tmp_path).load()  # loading the checkpoint (at start) does it
    assert not own.exists()


# ---- gpunode doctor -------------------------------------------------------------------------


def test_doctor_names_a_damaged_region_and_an_open_root(sockdir: Path) -> None:
    from gpunode.node.doctor import OK, WARN, checks

    cfg = make_config(sockdir / "device-plugins", sockdir / "state", backend="sim")
    root = sockdir / "state" / "memcap"
    good = memcap.create_region(root, "good", gpu_uuid="GPU-a", limit_bytes=GIB, device_total_bytes=GIB)
    bad = memcap.create_region(root, "tenant", gpu_uuid="GPU-b", limit_bytes=GIB, device_total_bytes=GIB)
    check = {c.name: c for c in checks(cfg)}["memory-cap regions"]
    assert check.status == OK and "2 region(s)" in check.detail
    _truncated(bad.usage_path)
    os.chmod(root, 0o755)
    check = {c.name: c for c in checks(cfg)}["memory-cap regions"]
    assert check.status == WARN
    assert "1 of 2 region(s) unusable" in check.detail and "tenant:" in check.detail
    assert "a container truncated or rewrote its usage file" in check.detail
    assert f"{root} may be reached by users other than root" in check.detail
    assert "restart the pod" in check.hint and "chmod 700" in check.hint
    assert memcap.read_usage(good).limit_bytes == GIB
