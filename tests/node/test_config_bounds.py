"""Absurd counts, sizes and durations in the configuration: refused at once with one line naming the file,
the key and the allowed range; on SIGHUP, refused before anything running is touched.

The reported cases: `replicas: 9223372036854775808` hung `gpunode devices`, `replicas: 1000000` took
40 s and 6.4 GB, and a SIGHUP reload to it took a running agent from 81 MB to 5.6 GB.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpunode.config.agent import parse_config, read_config_file
from gpunode.contract.names import MIB
from gpunode.errors import ConfigError
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.inventory import MAX_DEVICES_PER_NODE, MAX_UNITS_PER_GPU, build_inventory
from gpunode.node.kubelet._proto import deviceplugin_v1beta1_pb2 as pb
from tests.fakes.kubelet import KubeletStandIn

GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
ISSUE_REPLICAS = (9223372036854775808, 1000000)
CLEAN_ENV = {
    k: v for k, v in os.environ.items() if not k.startswith("GPUNODE_") and k not in ("CONFIG_FILE",)
}


def sliced(replicas: object, devices: object = "all") -> str:
    # Written as text, so the integer reaches the parser exactly as an operator typed it.
    return (
        "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
        f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n      devices: {devices}\n"
        "gpunode:\n  metrics: {listen: '127.0.0.1:0'}\n"
    )


@pytest.mark.parametrize("replicas", ISSUE_REPLICAS)
def test_gpunode_devices_refuses_the_reported_replicas_at_once(tmp_path: Path, replicas: int) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(sliced(replicas))
    cmd = [sys.executable, "-m", "gpunode.cli", "devices", "--backend", "sim", "--sim-profile", "dgx-h100"]
    proc = subprocess.run(
        [*cmd, "--config", str(config)], capture_output=True, text=True, timeout=60, env=CLEAN_ENV
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    first, hint = proc.stderr.strip().splitlines()
    assert f"{config}: sharing.timeSlicing.resources[0].replicas: at most 48 replicas per GPU" in first
    assert "(allowed 2..48)" in first and f"got {replicas}" in first
    assert hint.startswith("HINT: ")


# -- every bound, one key at a time ----------------------------------------------------------------


def ts(**resource: Any) -> dict[str, Any]:
    return {"sharing": {"timeSlicing": {"resources": [{"name": GPU, "replicas": 2, **resource}]}}}


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        pytest.param(
            ts(replicas=49), "replicas: at most 48 replicas per GPU (allowed 2..48), got 49", id="replicas"
        ),
        pytest.param(
            {
                "sharing": {
                    "timeSlicing": {
                        "resources": [{"name": f"mig-{i}g.10gb", "replicas": 2} for i in range(33)]
                    }
                }
            },
            "resources: at most 32 resources can be time-sliced, got 33",
            id="resources-list",
        ),
        pytest.param(
            ts(devices=list(range(129))), "a device list has 1..128 entries, got 129", id="device-list"
        ),
        pytest.param(ts(devices=[256]), "a GPU or MIG index is 0..255, got 256", id="gpu-index"),
        pytest.param(ts(devices=[str(2**70)]), "a GPU or MIG index is 0..255", id="gpu-index-string"),
        pytest.param(ts(devices=["0:1000"]), "a GPU or MIG index is 0..255, got 1000", id="mig-index"),
        pytest.param(ts(devices=["GPU-" + "a" * 200]), "a GPU or MIG UUID has at most 128", id="uuid-length"),
        pytest.param(
            {"flags": {"plugin": {"deviceListStrategy": ["envvar"] * 200}}},
            "deviceListStrategy: expected a strategy or a list of them (1..128 entries)",
            id="strategy-list",
        ),
        pytest.param(
            {"gpunode": {"fractional": {"unit": "2Ti"}}},
            "unit: the unit must be at most 1Ti, got 2Ti",
            id="unit",
        ),
        pytest.param(
            {"gpunode": {"replicaMemoryCap": "512Ki"}}, "cap is 1Mi..1Ti, got 512Ki", id="cap-small"
        ),
        pytest.param({"gpunode": {"replicaMemoryCap": "4Ti"}}, "cap is 1Mi..1Ti, got 4Ti", id="cap-large"),
        pytest.param(
            {"gpunode": {"replicaMemoryCap": "9" * 400 + "Gi"}},
            "expected equal, none or a size such as 10Gi",
            id="cap-overflow",
        ),
        pytest.param(
            {"gpunode": {"fractional": {"unit": "9" * 60 + "Gi"}}},
            "a size must be at most 1Pi",
            id="unit-huge",
        ),
        pytest.param(
            {"gpunode": {"fractional": {"unit": 10**300}}}, "a size must be at most 1Pi", id="unit-int"
        ),
        pytest.param(
            {"gpunode": {"rediscoverInterval": 0}},
            "rediscoverInterval: expected 1s..1h, got 0",
            id="rediscover-0",
        ),
        pytest.param(
            {"gpunode": {"rediscoverInterval": "2h"}},
            "rediscoverInterval: expected 1s..1h, got 2h",
            id="rediscover-2h",
        ),
        pytest.param(
            {"gpunode": {"rediscoverInterval": -5}}, "a duration cannot be negative", id="rediscover-negative"
        ),
        pytest.param(
            {"gpunode": {"rediscoverInterval": 1e300}},
            "a duration must be at most 7d, got 1e+300",
            id="1e300",
        ),
        pytest.param(
            {"gpunode": {"rediscoverInterval": float("inf")}}, "a duration must be at most 7d", id="inf"
        ),
        pytest.param(
            {"gpunode": {"rediscoverInterval": float("nan")}}, "a duration must be at most 7d", id="nan"
        ),
        pytest.param(
            {"gpunode": {"nodeState": {"interval": "0.5s"}}},
            "nodeState.interval: expected 1s..1h",
            id="publish",
        ),
        pytest.param(
            {"gpunode": {"fractional": {"gcInterval": 0}}},
            "gcInterval: expected 0.1s..1h, got 0",
            id="gc-interval",
        ),
        pytest.param(
            {"gpunode": {"fractional": {"gcGrace": "25h"}}}, "gcGrace: expected 0..1d, got 25h", id="gc-grace"
        ),
        pytest.param(
            {"gpunode": {"health": {"probeInterval": 10**30}}},
            "health.probeInterval: a duration must be at most 7d",
            id="health",
        ),
        pytest.param(
            {"gpunode": {"nodeName": "n" * 300}}, "nodeName: expected 0..253 characters", id="node-name"
        ),
        pytest.param(
            {"gpunode": {"simControlSocket": "/" + "s" * 200}},
            "simControlSocket: expected 0..107",
            id="socket-path",
        ),
    ],
)
def test_each_bound_is_one_line_naming_the_key_and_the_range(doc: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(doc, "cfg.yaml")
    message = str(info.value)
    assert message.startswith("cfg.yaml: ") and fragment in message, message
    assert "\n" not in message and len(message) < 300 and info.value.hint


@pytest.mark.parametrize(
    ("doc", "path", "value"),
    [
        pytest.param(ts(replicas=48), "replicas", 48, id="replicas-48"),
        pytest.param(
            {"gpunode": {"rediscoverInterval": "1h"}}, "rediscover_interval_s", 3600.0, id="rediscover-1h"
        ),
        pytest.param(
            {"gpunode": {"fractional": {"gcInterval": "100ms", "gcGrace": 0}}},
            "gc",
            (0.1, 0.0),
            id="gc-edges",
        ),
        pytest.param({"gpunode": {"replicaMemoryCap": "1Mi"}}, "replica_memory_cap", MIB, id="cap-1Mi"),
    ],
)
def test_the_edges_of_each_range_are_accepted(doc: dict[str, Any], path: str, value: object) -> None:
    cfg = parse_config(doc, "cfg.yaml")
    got: object = {
        "replicas": lambda: cfg.time_slicing.resources[0].replicas,
        "gc": lambda: (cfg.fractional.gc_interval_s, cfg.fractional.gc_grace_s),
    }.get(path, lambda: getattr(cfg, path))()
    assert got == value


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("a: " + "[" * 5000 + "]" * 5000, "nested too deeply", id="deep-yaml"),
        pytest.param(
            "gpunode: {rediscoverInterval: " + "9" * 5000 + "}", "not valid configuration", id="huge-int"
        ),
        pytest.param("# padding\n" * 120_000, "larger than 1024 KiB", id="huge-file"),
    ],
)
def test_absurd_files_are_refused_in_one_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    assert fragment in str(info.value) and "\n" not in str(info.value) and info.value.hint


# -- what a node advertises --------------------------------------------------------------------------


def test_a_unit_giving_too_many_units_per_gpu_names_the_smallest_allowed() -> None:
    gpus = SimBackend.from_profile("dgx-h100").gpus()
    cfg = parse_config({"gpunode": {"fractional": {"devices": "all", "unit": "1Mi"}}}, "cfg.yaml")
    for strict in (True, False):  # rediscovery refuses it too (and keeps its last inventory)
        with pytest.raises(ConfigError) as info:
            build_inventory(gpus, cfg, strict=strict)
        assert f"at most {MAX_UNITS_PER_GPU} units per GPU" in str(info.value)
        smallest = info.value.hint.split("at least ")[1].split(" ")[0]
        assert smallest == "80Mi"
    fits = parse_config({"gpunode": {"fractional": {"devices": "all", "unit": "80Mi"}}}, "cfg.yaml")
    assert all(n <= MAX_UNITS_PER_GPU for n in _units_per_gpu(build_inventory(gpus, fits)))


def _units_per_gpu(inv: Any) -> list[int]:
    counts: dict[str, int] = {}
    for d in inv.devices:
        counts[d.gpu_uuid] = counts.get(d.gpu_uuid, 0) + 1
    return list(counts.values())


def test_the_node_total_is_bounded_before_devices_are_built() -> None:
    gpu = SimBackend.from_profile("dgx-h100").gpus()[0]
    many = [replace(gpu, index=i, uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000") for i in range(400)]
    cfg = parse_config(ts(replicas=48), "cfg.yaml")
    with pytest.raises(
        ConfigError,
        match=rf"would advertise \d+ devices before GPU \d+; a node advertises at most {MAX_DEVICES_PER_NODE}",
    ):
        build_inventory(many, cfg)


def test_a_list_and_watch_message_at_the_node_bound_fits_grpc_default_limit() -> None:
    """The longest device IDs gpunode makes (memory units of the longest UUIDs), with topology, at the bound."""
    long_id = "MIG-GPU-" + "f" * 36 + "/99/99::mem1023"
    devices = [
        pb.Device(ID=long_id, health="Unhealthy", topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=2**31)]))
        for _ in range(MAX_DEVICES_PER_NODE)
    ]
    size = pb.ListAndWatchResponse(devices=devices).ByteSize()
    assert size < 4 * 1024 * 1024 // 2, f"{size} bytes: keep ListAndWatch well under gRPC's 4 MiB"


# -- SIGHUP: validated before anything running is touched ------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def wait_for_text(path: Path, text: str, count: int, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        content = path.read_text()
        if content.count(text) >= count:
            return content
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} did not appear {count} time(s) in the log:\n{content}")
        time.sleep(0.1)


def test_sighup_to_absurd_replicas_keeps_the_running_agent(sockdir: Path, kubelet: KubeletStandIn) -> None:
    config = sockdir / "config.yaml"
    config.write_text(sliced(2, "[0]"))
    log = sockdir / "agent.log"
    cmd = [
        sys.executable, "-m", "gpunode.cli", "agent", "--backend", "sim", "--sim-profile", "t4",
        "--kubelet-dir", str(sockdir / "device-plugins"), "--state-dir", str(sockdir / "state"),
        "--config", str(config),
    ]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=CLEAN_ENV)
    try:
        kubelet.wait_for_resources([GPU, SHARED])
        kubelet.wait_for(lambda: len(kubelet.healthy(SHARED)) == 2, what="two replicas")
        before = rss_bytes(proc.pid)
        for n, replicas in enumerate(ISSUE_REPLICAS, start=1):
            config.write_text(sliced(replicas, "[0]"))
            proc.send_signal(signal.SIGHUP)
            text = wait_for_text(log, "reload refused", n)
            refused = [line for line in text.splitlines() if "reload refused" in line]
            assert len(refused) == n and f"got {replicas}" in refused[-1] and "(allowed 2..48)" in refused[-1]
            assert proc.poll() is None, "a refused reload must not stop the agent"
            assert len(kubelet.healthy(SHARED)) == 2 and len(kubelet.healthy(GPU)) == 3
            # Nothing was built: the agent's memory stays where it was (the bug took it to 5.6 GB).
            assert rss_bytes(proc.pid) < before + 64 * 1024 * 1024
        # A FIFO in the file's place is refused at once (open() of a FIFO would wait for a writer for
        # ever, freezing the agent's loop: ListAndWatch and Allocate with it).
        config.unlink()
        os.mkfifo(config)
        proc.send_signal(signal.SIGHUP)
        n = len(ISSUE_REPLICAS) + 1
        text = wait_for_text(log, "reload refused", n)
        refused = [line for line in text.splitlines() if "reload refused" in line]
        assert "not a regular file (a FIFO)" in refused[-1], refused[-1]
        assert proc.poll() is None and len(kubelet.healthy(SHARED)) == 2
        config.unlink()
        # A good configuration still reloads afterwards.
        config.write_text(sliced(4, "[0]"))
        proc.send_signal(signal.SIGHUP)
        kubelet.wait_for(lambda: len(kubelet.healthy(SHARED)) == 4, what="the good reload")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "Traceback" not in log.read_text()
