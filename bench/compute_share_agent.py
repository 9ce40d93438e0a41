"""What the agent's compute-share loops cost per tick, for a node with N capped containers.

Two loops run beside the device plugin while memory caps are in use:
gpunode.node.allocation.shares.ComputeShares (once a second: the kubelet's List mapped to
regions, every region's share read, the ones that differ written) and
gpunode.node.allocation.sharecheck.ShareCheck (every gpunode.computeShare.interval: every
region's compute block read, the driver's per-process samples read and attributed by
/proc/<pid>/cgroup, one ShareWatch window per pod). This measures both on real regions in a
temporary directory (the kubelet's List and the driver are the simulated node's and a
stand-in list, so only the agent's own work is timed): the wall time and CPU time of one
tick, p50 and p99 over --ticks ticks, for N in --containers, with half of the pods asking a
compute share of their own and one process per container.

    .venv/bin/python bench/compute_share_agent.py [--containers 10,100,250] [--ticks 50] [--out FILE]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpunode.config.sharing import ComputeShareCheck  # noqa: E402  (after the repository is on sys.path)
from gpunode.node import memcap  # noqa: E402
from gpunode.node.allocation.sharecheck import ShareCheck  # noqa: E402
from gpunode.node.allocation.shares import ComputeShares  # noqa: E402
from gpunode.node.devices.simnode.backend import SimBackend  # noqa: E402
from gpunode.node.inventory import region_key  # noqa: E402
from gpunode.node.kubelet.podresources import ContainerDevices  # noqa: E402
from gpunode.node.memcap.checkpoint import CapRecord, Checkpoint  # noqa: E402
from gpunode.node.memcap.compute import ComputeMode  # noqa: E402

GIB = 2**30


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(wall: list[float], cpu: list[float]) -> dict[str, float]:
    return {
        "wall_ms_p50": round(statistics.median(wall) * 1e3, 3),
        "wall_ms_p99": round(percentile(wall, 0.99) * 1e3, 3),
        "cpu_ms_p50": round(statistics.median(cpu) * 1e3, 3),
        "cpu_ms_p99": round(percentile(cpu, 0.99) * 1e3, 3),
    }


def run(n: int, ticks: int) -> dict[str, Any]:
    backend = SimBackend.from_profile("dgx-h100")
    gpus = backend.gpus()
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        checkpoint = Checkpoint(state)
        containers: list[ContainerDevices] = []
        asks: dict[str, str] = {}
        uids: dict[str, str] = {}
        proc = state / "proc"
        per_gpu = -(-n // len(gpus))
        for i in range(n):
            gpu = gpus[i % len(gpus)]
            ids = (f"{gpu.uuid}::mem{i}",)
            key = region_key(ids)
            limit = gpu.memory_total_bytes // per_gpu
            memcap.create_region(
                state / "memcap",
                key,
                gpu_uuid=gpu.uuid,
                limit_bytes=limit,
                device_total_bytes=gpu.memory_total_bytes,
            )
            checkpoint.replace(
                CapRecord(
                    key, "gpunode.io/gpu-memory", ids, gpu.uuid, limit, gpu.memory_total_bytes, False, 0.0
                )
            )
            pod = f"team/p{i}"
            containers.append(ContainerDevices("team", f"p{i}", "main", "gpunode.io/gpu-memory", ids))
            if i % 2 == 0:
                asks[pod] = str(max(1, 1000 // per_gpu // 2))
            uid = f"{i:08x}-0000-4000-8000-000000000000"
            uids[pod] = uid
            (proc / str(100_000 + i)).mkdir(parents=True)
            (proc / str(100_000 + i) / "cgroup").write_text(
                f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice\n"
            )

        async def listed() -> list[ContainerDevices]:
            return containers

        shares = ComputeShares(
            checkpoint=checkpoint, regions_root=state / "memcap", list_containers=listed, asks=lambda: asks
        )
        check = ShareCheck(
            backend=backend, shares=shares, config=ComputeShareCheck(), pod_uids=lambda: uids, api=None,
            node_name="bench", mode_of=lambda _: ComputeMode.WORK_CONSERVING, proc_root=proc,
        )  # fmt: skip
        busy = {g.uuid: {} for g in gpus}  # type: dict[str, dict[int, int]]

        async def go() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, step in (("shares_tick", shares.tick), ("check_tick", check.tick)):
                wall: list[float] = []
                cpu: list[float] = []
                for t in range(ticks):
                    for i in range(n):  # the driver's figures move on between ticks
                        busy[gpus[i % len(gpus)].uuid][100_000 + i] = t * 1_000_000
                    for g in gpus:
                        backend.report_process_busy(g.uuid, busy[g.uuid])
                    w0, c0 = time.perf_counter(), time.process_time()
                    await step()
                    wall.append(time.perf_counter() - w0)
                    cpu.append(time.process_time() - c0)
                out[name] = summary(wall[1:], cpu[1:])  # the first tick writes every share: reported apart
                out[name]["first_tick_ms"] = round(wall[0] * 1e3, 3)
            out["shares_written"] = shares.written
            out["pods_checked"] = len(check.view)
            return out

        return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", default="10,100,250")
    parser.add_argument("--ticks", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    doc = {
        "bench": "compute_share_agent",
        "host": {"python": platform.python_version(), "machine": platform.machine()},
        "ticks": args.ticks,
        "results": {n: run(int(n), args.ticks) for n in args.containers.split(",")},
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
