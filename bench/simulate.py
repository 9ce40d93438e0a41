"""Benchmark: the FGD-paper policy table on the openb trace, and simulator wall time per seed.

Runs every policy over seeds on the default pod list and on the variants
(gpushare*, multigpu*, gpuspec*, cpu*), and prints one JSON document: per pod
list and policy, the mean and spread of the unallocated GPU % at 100% arrival,
the published figure where there is one, and the wall time per seed. Nothing
here asserts: read the numbers.

    .venv/bin/python bench/simulate.py --trace-dir /work/shared/traces/openb \
        --seeds 42-51 --variant-seeds 42-44 --jobs 2 [--out results/]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from gpunode.cluster.tracesim.simulate import (
    DEFAULT_POLICIES,
    SimulationSpec,
    parse_seeds,
    run_simulation,
    summarize,
    write_outputs,
)

# Unallocated GPU % at 100% arrival, openb default, mean of seeds 42..51 (FGD paper, USENIX ATC'23).
PUBLISHED_DEFAULT = {"fgd": 4.77, "bestfit": 7.14, "packing": 8.22, "dotprod": 9.38, "random": 13.70}
VARIANTS = (
    "gpushare20",
    "gpushare40",
    "gpushare60",
    "gpushare80",
    "gpushare100",
    "multigpu20",
    "multigpu30",
    "multigpu40",
    "multigpu50",
    "gpuspec05",
    "gpuspec10",
    "gpuspec20",
    "gpuspec25",
    "gpuspec33",
    "cpu0",
    "cpu037",
    "cpu050",
    "cpu072",
    "cpu100",
    "cpu200",
    "cpu235",
    "cpu250",
    "cpu300",
)


def run_one(
    trace_dir: Path, pods: str, policies: tuple[str, ...], seeds: tuple[int, ...], jobs: int, out: Path | None
) -> dict[str, object]:
    started = time.perf_counter()
    spec = SimulationSpec(trace_dir=trace_dir, pods=pods, policies=policies, seeds=seeds, jobs=jobs)
    results = run_simulation(spec, progress=False)
    if out is not None:
        write_outputs(results, out, name=pods)
    table = summarize(results)
    if pods == "default":
        for policy, row in table.items():
            if policy in PUBLISHED_DEFAULT:
                row["published"] = PUBLISHED_DEFAULT[policy]
                row["delta_vs_published"] = round(
                    row["unallocated_gpu_pct_at_100"] - PUBLISHED_DEFAULT[policy], 3
                )
    fgd = table.get("fgd", {}).get("unallocated_gpu_pct_at_100")
    ours = table.get("gpunode", {}).get("unallocated_gpu_pct_at_100")
    return {
        "pods": pods,
        "seeds": list(seeds),
        "policies": table,
        "gpunode_minus_fgd": round(ours - fgd, 3) if fgd is not None and ours is not None else None,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace-dir", type=Path, default=Path("/work/shared/traces/openb"))
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--seeds", default="42-51", help="seeds for the default pod list")
    p.add_argument("--variant-seeds", default="42-44", help="seeds for the variants (empty: skip them)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, help="also write CSV/PNG/summary per pod list here")
    args = p.parse_args(argv)
    policies = tuple(x for x in args.policies.split(",") if x)
    report: dict[str, object] = {
        "benchmark": "simulate",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "protocol": "openb, gpu nodes, arrivals tuned to 130% of GPU capacity, unallocated GPU % at 100% arrival",
    }
    runs = [run_one(args.trace_dir, "default", policies, parse_seeds(args.seeds), args.jobs, args.out)]
    print(json.dumps(runs[0]), file=sys.stderr, flush=True)
    if args.variant_seeds:
        seeds = parse_seeds(args.variant_seeds)
        for pods in (v for v in args.variants.split(",") if v):
            runs.append(run_one(args.trace_dir, pods, policies, seeds, args.jobs, args.out))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    report["runs"] = runs
    losses = [
        r["pods"] for r in runs if isinstance(r["gpunode_minus_fgd"], float) and r["gpunode_minus_fgd"] > 0
    ]
    report["gpunode_loses_to_fgd_on"] = losses
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
