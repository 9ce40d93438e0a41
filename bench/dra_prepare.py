"""NodePrepareResources and NodeUnprepareResources latency per claim, over the plugin's real sockets.

The DRA kubelet plugin runs as the agent runs it (write-ahead record, a fresh memory-cap region,
the CDI spec written and fsynced, the compute share written into the region, the claim and its pod
(checked for a second memory cap in one container) read from an API server stand-in on loopback over HTTP);
a gRPC client stands in for the kubelet and sends one claim per call, as the kubelet does for a pod
with one claim. Each claim is a 4 GiB share of one of three GPUs. --claims claims are prepared one
after another, then unprepared; every call is timed from the client.

    .venv/bin/python bench/dra_prepare.py [--claims 300]

Prints one JSON document: p50, p99 and max per call, in milliseconds, for prepare, for a repeated
prepare (answered from the record) and for unprepare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.node.dra_world import GPUS, claim, world


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(p99, 3),
        "max_ms": round(ms[-1], 3),
        "calls": len(ms),
    }


async def measure(n: int) -> dict[str, Any]:
    async with world() as w:
        refs = [
            w.api.add_with_pod(
                claim(f"bench-{i}", device=f"gpu-{i % len(GPUS)}-shared", memory="4Gi", share=f"s{i}"),
                f"pod-{i}",
            )
            for i in range(n)
        ]
        timings: dict[str, list[float]] = {"prepare": [], "prepare_again": [], "unprepare": []}
        for phase, call in (("prepare", w.prepare), ("prepare_again", w.prepare), ("unprepare", w.unprepare)):
            for r in refs:
                start = time.perf_counter()
                resp = await call(r)
                timings[phase].append(time.perf_counter() - start)
                if resp.claims[r.uid].error:
                    raise SystemExit(f"{phase} {r}: {resp.claims[r.uid].error}")
        return {k: summary(v) for k, v in timings.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=300)
    args = parser.parse_args()
    result = {
        "bench": "dra_prepare",
        "claims": args.claims,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load1": os.getloadavg()[0]},
        **asyncio.run(measure(args.claims)),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
