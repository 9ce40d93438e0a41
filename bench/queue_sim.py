"""Benchmark: the issue's target table for the queueing policies, from the time simulator.

openb default with its own durations, four teams weighted 4:3:2:1
(gpunode/examples/sim-queues.yaml), offered loads 0.9 and 1.2, every preset
(gpunode and the baselines kube, kueue-strict, kueue-besteffort, kai), 10 seeds
by default. Prints one JSON document (and writes it to --json): per load and
preset the mean over seeds and the per-seed values of every metric, each target
with the measured values and whether it is met, and the wall and CPU time of one seed at
load 1.2 on one core (a separate single-process run of the gpunode preset).
Nothing here asserts: read the numbers.

    .venv/bin/python bench/queue_sim.py --trace-dir /work/shared/traces/openb \\
        --seeds 42-51 --jobs 2 --json /tmp/queue_sim.json [--out results/]

The JSON (and the CSV and PNGs under --out) are rewritten after each (load, preset), in the
order the targets need them, so a run cut short still says what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from gpunode.cluster.queueing.presets import PRESETS
from gpunode.cluster.timesim.cli import DEFAULT_QUEUES, TimeSpec, run_task, run_time_simulation
from gpunode.cluster.timesim.report import summarize, write_outputs
from gpunode.cluster.timesim.run import RunResult
from gpunode.cluster.tracesim.simulate import parse_seeds

LOADS = (0.9, 1.2)


def _m(summary: dict[str, Any], load: float, policy: str, key: str) -> float:
    try:
        return float(summary[f"{load:g}"][policy]["mean"][key])
    except KeyError:
        return float("nan")


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue with the values it compares and whether it is met (None: not measured)."""
    out: list[dict[str, Any]] = []

    def add(name: str, values: dict[str, float], met: bool | None) -> None:
        nan = any(math.isnan(v) for v in values.values())
        out.append(
            {
                "target": name,
                "values": {k: round(v, 4) for k, v in values.items()},
                "met": None if nan else met,
            }
        )

    for load in LOADS:
        for kind in ("multi_gpu", "gang"):
            g, k = (
                _m(summary, load, "gpunode", f"delay_{kind}_p95"),
                _m(summary, load, "kube", f"delay_{kind}_p95"),
            )
            add(
                f"load {load:g}: p95 delay of {kind} jobs <= 0.5 x kube's",
                {"gpunode": g, "kube": k},
                g <= 0.5 * k,
            )
        g, k = _m(summary, load, "gpunode", "delay_mean"), _m(summary, load, "kube", "delay_mean")
        add(f"load {load:g}: mean delay <= 1.1 x kube's", {"gpunode": g, "kube": k}, g <= 1.1 * k)
    g, s = _m(summary, 1.2, "gpunode", "delay_mean"), _m(summary, 1.2, "kueue-strict", "delay_mean")
    add("load 1.2: mean delay <= 0.7 x kueue-strict's", {"gpunode": g, "kueue-strict": s}, g <= 0.7 * s)
    g, k = _m(summary, 1.2, "gpunode", "allocation"), _m(summary, 1.2, "kube", "allocation")
    add("load 1.2: time-averaged allocation >= kube's", {"gpunode": g, "kube": k}, g >= k)
    for load in LOADS:
        j = _m(summary, load, "gpunode", "jain_mean")
        add(f"load {load:g}: Jain fairness over one-day windows >= 0.95", {"gpunode": j}, j >= 0.95)
        lost = _m(summary, load, "gpunode", "lost_share")
        add(f"load {load:g}: preemption losses <= 2% of delivered GPU-hours", {"gpunode": lost}, lost <= 0.02)
        partial = _m(summary, load, "gpunode", "partial_gang_held_gpus")
        add(f"load {load:g}: no partial gang ever holds a GPU", {"gpunode": partial}, partial == 0)
        for rival in ("kueue-strict", "kueue-besteffort", "kai"):
            gd, rd = _m(summary, load, "gpunode", "delay_mean"), _m(summary, load, rival, "delay_mean")
            ga, ra = _m(summary, load, "gpunode", "allocation"), _m(summary, load, rival, "allocation")
            add(
                f"load {load:g}: better than {rival} on mean delay or allocation",
                {"gpunode_delay": gd, f"{rival}_delay": rd, "gpunode_alloc": ga, f"{rival}_alloc": ra},
                gd < rd or ga > ra,
            )
    gi, ki = _m(summary, 0.9, "gpunode", "idle_gpu_hours"), _m(summary, 0.9, "kube", "idle_gpu_hours")
    gd, kd = _m(summary, 0.9, "gpunode", "delay_mean"), _m(summary, 0.9, "kube", "delay_mean")
    add(
        "load 0.9: idle GPU-hours on powered nodes <= 0.9 x kube's, at equal or better mean delay",
        {"gpunode_idle": gi, "kube_idle": ki, "gpunode_delay": gd, "kube_delay": kd},
        gi <= 0.9 * ki and gd <= kd,
    )
    return out


def _urgency(pair: tuple[float, str]) -> int:
    load, policy = pair
    order = {"gpunode": 0, "kube": 1, "kueue-strict": 2, "kai": 3, "kueue-besteffort": 4}.get(policy, 5)
    return order if order < 2 else 2 + order * 2 + (load < 1.0)


def main() -> int:
    """Run the table and print the JSON document."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trace-dir", type=Path, required=True)
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS))
    parser.add_argument("--policies", default=",".join(PRESETS))
    parser.add_argument("--rules", type=Path)
    parser.add_argument("--queues", type=Path, default=DEFAULT_QUEUES)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="also write the JSON document here")
    parser.add_argument("--out", type=Path, help="also write the CSV and PNGs here")
    parser.add_argument("--no-timing", action="store_true", help="skip the one-seed, one-core timing run")
    args = parser.parse_args()
    seeds = parse_seeds(args.seeds)
    doc: dict[str, Any] = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count()}}
    if not args.no_timing:  # one seed at load 1.2, this process alone: the speed target
        targs = (
            str(args.trace_dir),
            "default",
            "openb_node_list_gpu_node.csv",
            str(args.rules or ""),
            str(args.queues),
        )
        started, cpu = time.perf_counter(), time.process_time()
        r = run_task(targs, "gpunode", seeds[0], 1.2)
        doc["one_seed_load_1_2"] = {
            "wall_s_total": round(time.perf_counter() - started, 2),
            "wall_s_run": round(r.wall_s, 2),
            "cpu_s_total": round(time.process_time() - cpu, 2),  # what other work on the machine leaves as is
            "jobs": r.replay["jobs"],
            "target_s": 60,
        }
        print(json.dumps(doc["one_seed_load_1_2"]), flush=True)
    started = time.perf_counter()
    results: list[RunResult] = []
    pairs = [(float(x), p) for x in args.loads.split(",") for p in args.policies.split(",")]
    pairs.sort(key=_urgency)  # the pairs most targets compare first, so a cut-short run says the most
    for load, policy in pairs:  # one (load, preset) at a time, seeds in parallel
        spec = TimeSpec(
            trace_dir=args.trace_dir,
            loads=(load,),
            policies=(policy,),
            seeds=seeds,
            rules=args.rules,
            queues=args.queues,
            jobs=args.jobs,
        )
        results.extend(run_time_simulation(spec, progress=None))
        summary = summarize(results)
        doc.update(
            {
                "wall_s": round(time.perf_counter() - started, 1),
                "targets": targets(summary),
                "results": summary,
            }
        )
        if args.out:
            doc["files"] = {
                k: str(v) for k, v in write_outputs(results, args.out, name="time-default").items()
            }
        if args.json:  # what has finished so far, so a long run can be read before its end
            args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"done: load {load:g} {policy} ({doc['wall_s']} s)", file=sys.stderr, flush=True)
    text = json.dumps(doc, indent=2)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
