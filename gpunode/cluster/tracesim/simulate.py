"""Trace-driven simulation of GPU placement policies, with the FGD paper's evaluation protocol.

For each (policy, seed): the trace's pods are shuffled by the seed, tuned to
`ratio` x the cluster's GPU capacity (1.3 by default), and arrive one by one with
no departures. Each pod goes to the node its policy scores best (ties go to the
node first in a seeded node order, as in the FGD simulator's scheduler), or fails
if no node fits. After each arrival the arrived and allocated GPU share (in % of
cluster GPU capacity) are recorded. The figure of merit is the unallocated GPU %
when the arrived workload reaches 100% of capacity: 100 - the mean allocated %
over the arrivals whose arrived % rounds to 100. The reported number per policy
is the mean over seeds.

Simulated GPUs carry their model's memory as well as their compute share, and a
fractional pod asks both (gpumemory.py: its `gpu_memory_mib` when the trace gives
one, else its compute share of the smallest GPU model it may land on), so a pod
whose memory does not fit a GPU is not placed there. The curves count compute
share (milli-GPU), as the paper's do.

Placement decisions come from gpunode.placement (its numpy form for speed), so
the simulator measures the same code the extender runs. Seeds run in parallel
processes. This module reads traces and writes results; it never talks to a
cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpunode.cluster.tracesim.gpumemory import MemoryAsks, unknown_notice
from gpunode.cluster.tracesim.trace import (
    DEFAULT_NODE_FILE,
    TraceNode,
    TracePod,
    build_arrivals,
    demand_shapes,
    find_csv,
    load_nodes,
    load_pods,
    node_capacity,
    node_state,
    pod_list_path,
    request_of,
    target_workload,
)
from gpunode.errors import ConfigError, MissingExtra
from gpunode.placement import Request, TargetWorkload
from gpunode.placement.batch import BATCH_POLICIES, ClusterArrays

DEFAULT_POLICIES = ("fgd", "bestfit", "packing", "dotprod", "random", "gpunode")
DEFAULT_SEEDS = tuple(range(42, 52))
DEFAULT_RATIO = 1.3
_TIE_STREAM = 3  # numpy SeedSequence spawn keys, so each use of a seed has its own stream
_CHOICE_STREAM = 7


@dataclass(frozen=True)
class SeedResult:
    """One (policy, seed) run: per-arrival curves (in % of cluster GPU capacity) and the figure of merit."""

    pods: str
    policy: str
    seed: int
    arrivals: int
    failed: int
    unallocated_at_100: float
    wall_s: float
    arrived_pct: tuple[float, ...]  # after each arrival
    allocated_pct: tuple[float, ...]

    def buckets(self) -> list[tuple[int, float]]:
        """(arrived % rounded to an integer, mean allocated % in that bucket), ascending."""
        arrived = np.rint(np.asarray(self.arrived_pct))
        allocated = np.asarray(self.allocated_pct)
        out = []
        for bucket in np.unique(arrived):
            out.append((int(bucket), float(allocated[arrived == bucket].mean())))
        return out


def unallocated_at(arrived_pct: np.ndarray, allocated_pct: np.ndarray, point: float = 100.0) -> float:
    """100 - mean allocated % over the arrivals whose arrived % rounds to `point` (within 1 when none does)."""
    bucket = np.rint(arrived_pct)
    chosen = bucket == point
    if not chosen.any():
        chosen = np.abs(bucket - point) <= 1
    if not chosen.any():
        return float("nan")
    return float(100.0 - np.round(allocated_pct[chosen], 2).mean())


def simulate_seed(
    *,
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    workload: TargetWorkload,
    policy: str,
    seed: int,
    ratio: float = DEFAULT_RATIO,
    label: str = "",
    gpu_memory: bool = True,
) -> SeedResult:
    """Replay one seed's arrivals under one policy.

    gpu_memory=False simulates compute only: GPUs without memory, pods asking none
    (a trace asking GPU memory then places none of its memory-asking pods).
    """
    started = time.perf_counter()
    arrivals = build_arrivals(pods, nodes=nodes, seed=seed, ratio=ratio)
    cluster = ClusterArrays([node_state(n, gpu_memory=gpu_memory) for n in nodes], workload=workload)
    asks = MemoryAsks(n.model for n in nodes if n.gpus) if gpu_memory else None
    priority = np.random.default_rng([seed, _TIE_STREAM]).permutation(len(nodes))
    rng = np.random.default_rng([seed, _CHOICE_STREAM])
    requests: dict[TracePod, Request] = {}
    capacity = float(arrivals.cluster_gpu_milli)
    arrived = allocated = failed = 0
    arrived_pct = np.empty(len(arrivals.pods))
    allocated_pct = np.empty(len(arrivals.pods))
    for i, pod in enumerate(arrivals.pods):
        request = requests.get(pod)
        if request is None:
            request = requests[pod] = request_of(pod, asks)
        arrived += pod.total_gpu_milli
        choice = cluster.choose(request, policy, rng=rng, priority=priority)
        if choice is None:
            failed += 1
        else:
            cluster.apply(request, choice.node, choice.gpus)
            allocated += pod.total_gpu_milli
        arrived_pct[i] = 100.0 * arrived / capacity
        allocated_pct[i] = 100.0 * allocated / capacity
    return SeedResult(
        pods=label,
        policy=policy,
        seed=seed,
        arrivals=len(arrivals.pods),
        failed=failed,
        unallocated_at_100=unallocated_at(arrived_pct, allocated_pct),
        wall_s=time.perf_counter() - started,
        arrived_pct=tuple(float(x) for x in arrived_pct),
        allocated_pct=tuple(float(x) for x in allocated_pct),
    )


@dataclass(frozen=True)
class TraceInput:
    """A loaded trace: its nodes, pods and target workload, ready to simulate."""

    label: str
    nodes: tuple[TraceNode, ...]
    pods: tuple[TracePod, ...]
    workload: TargetWorkload


def load_trace(trace_dir: Path, pods: str, *, node_file: str = DEFAULT_NODE_FILE) -> TraceInput:
    """Load a node list and a pod list (by variant name, e.g. `default`, or a CSV path)."""
    nodes = load_nodes(find_csv(trace_dir, node_file))
    pod_list = load_pods(pod_list_path(trace_dir, pods))
    supply: dict[str, int] = {}
    for n in nodes:
        supply[n.model] = supply.get(n.model, 0) + n.gpus
    workload = target_workload(pod_list).with_supply(
        supply, nodes=[node_capacity(n) for n in nodes], demand=demand_shapes(pod_list)
    )
    return TraceInput(label=pods, nodes=nodes, pods=pod_list, workload=workload)


# Worker processes load each trace once and keep it for the tasks that follow.
_TRACE_CACHE: dict[tuple[str, str, str], TraceInput] = {}


def _run_task(trace_dir: str, pods: str, node_file: str, policy: str, seed: int, ratio: float) -> SeedResult:
    key = (trace_dir, pods, node_file)
    if key not in _TRACE_CACHE:
        _TRACE_CACHE[key] = load_trace(Path(trace_dir), pods, node_file=node_file)
    trace = _TRACE_CACHE[key]
    return simulate_seed(
        nodes=trace.nodes,
        pods=trace.pods,
        workload=trace.workload,
        policy=policy,
        seed=seed,
        ratio=ratio,
        label=trace.label,
    )


@dataclass(frozen=True)
class SimulationSpec:
    """What to simulate: which trace, policies and seeds, and how many processes."""

    trace_dir: Path
    pods: str = "default"
    policies: tuple[str, ...] = DEFAULT_POLICIES
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    ratio: float = DEFAULT_RATIO
    jobs: int = 1
    node_file: str = DEFAULT_NODE_FILE

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in BATCH_POLICIES]
        if unknown:
            raise ConfigError(
                f"--policies: unknown policy {', '.join(unknown)}; known: {', '.join(BATCH_POLICIES)}"
            )
        if not self.policies or not self.seeds:
            raise ConfigError("--policies and --seeds need at least one entry each")
        if self.jobs < 1:
            raise ConfigError(f"--jobs must be at least 1, got {self.jobs}")
        if not 0 < self.ratio <= 10:
            raise ConfigError(f"--ratio must be within (0, 10], got {self.ratio}")


def run_simulation(spec: SimulationSpec, *, progress: bool | None = None) -> list[SeedResult]:
    """Run every (policy, seed) of the spec, in parallel when jobs > 1; results in (policy, seed) order."""
    load_trace(
        spec.trace_dir, spec.pods, node_file=spec.node_file
    )  # fail fast, in this process, on a bad trace
    tasks = [(p, s) for p in spec.policies for s in spec.seeds]
    bar = progress_bar(len(tasks), f"simulate {spec.pods}", progress)
    results: dict[tuple[str, int], SeedResult] = {}
    args = (str(spec.trace_dir), spec.pods, spec.node_file)
    try:
        if spec.jobs == 1:
            for policy, seed in tasks:
                results[(policy, seed)] = _run_task(*args, policy, seed, spec.ratio)
                bar.update()
        else:
            with ProcessPoolExecutor(max_workers=min(spec.jobs, len(tasks))) as pool:
                futures = {pool.submit(_run_task, *args, p, s, spec.ratio): (p, s) for p, s in tasks}
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    bar.update()
    finally:
        bar.close()
    return [results[t] for t in tasks]


class _NoBar:
    def update(self) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, progress: bool | None) -> Any:
    """A tqdm bar on stderr; none when progress is off (or auto without a terminal or without tqdm).

    Progress asked for (True) without tqdm installed is MissingExtra naming the `plot` extra.
    """
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        if progress is None:
            return _NoBar()
        raise MissingExtra("tqdm", "plot", "the progress bar of `gpunode simulate` (--progress on)") from None
    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)


def summarize(results: Sequence[SeedResult]) -> dict[str, dict[str, float]]:
    """Per policy: mean and standard deviation of unallocated GPU % at 100% arrival, and wall time per seed."""
    out: dict[str, dict[str, float]] = {}
    for policy in dict.fromkeys(r.policy for r in results):
        mine = [r for r in results if r.policy == policy]
        values = np.array([r.unallocated_at_100 for r in mine])
        walls = np.array([r.wall_s for r in mine])
        out[policy] = {
            "unallocated_gpu_pct_at_100": round(float(values.mean()), 3),
            "std": round(float(values.std()), 3),
            "seeds": len(mine),
            "wall_s_per_seed_mean": round(float(walls.mean()), 2),
            "wall_s_per_seed_max": round(float(walls.max()), 2),
        }
    return out


def write_csv(results: Sequence[SeedResult], path: Path) -> None:
    """One row per (policy, seed, arrived % bucket): the mean allocated % and unallocated % in it."""
    lines = ["pods,policy,seed,arrived_pct,allocated_pct,unallocated_pct"]
    for r in results:
        for bucket, allocated in r.buckets():
            lines.append(f"{r.pods},{r.policy},{r.seed},{bucket},{allocated:.3f},{100.0 - allocated:.3f}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_plot(results: Sequence[SeedResult], path: Path, *, title: str = "") -> None:
    """PNG: unallocated GPU % against arrived workload %, one line (mean over seeds) per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for policy in dict.fromkeys(r.policy for r in results):
        per_bucket: dict[int, list[float]] = {}
        for r in results:
            if r.policy == policy:
                for bucket, allocated in r.buckets():
                    per_bucket.setdefault(bucket, []).append(100.0 - allocated)
        xs = sorted(per_bucket)
        ax.plot(xs, [float(np.mean(per_bucket[x])) for x in xs], label=policy, linewidth=1.6)
    ax.plot([0, 100], [100, 0], linestyle=":", color="grey", label="ideal")
    ax.set_xlabel("Arrived workload (% of cluster GPU capacity)")
    ax.set_ylabel("Unallocated GPU (%)")
    ax.set_xlim(0, 130)
    ax.set_ylim(0, 100)
    ax.grid(linestyle="-.", alpha=0.6)
    ax.legend(loc="lower left")
    if title:
        ax.set_title(title)
    inset = fig.add_axes((0.62, 0.5, 0.22, 0.3))
    for line in ax.get_lines()[:-1]:
        inset.plot(*line.get_data(), color=line.get_color(), linewidth=1.2)
    inset.set_xlim(90, 110)
    inset.set_ylim(0, 15)
    inset.grid(linestyle="-.", alpha=0.6)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def write_outputs(results: Sequence[SeedResult], out_dir: Path, *, name: str) -> dict[str, Path]:
    """CSV of the curves, JSON summary and PNG plot under out_dir; returns their paths."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out_dir}: cannot create the folder: {exc}") from exc
    paths = {
        "csv": out_dir / f"{name}.csv",
        "summary": out_dir / f"{name}-summary.json",
        "png": out_dir / f"{name}.png",
    }
    write_csv(results, paths["csv"])
    summary = {
        "pods": name,
        "policies": summarize(results),
        "per_seed": [
            {k: v for k, v in asdict(r).items() if k not in ("arrived_pct", "allocated_pct")} for r in results
        ],
    }
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    try:
        write_plot(results, paths["png"], title=f"openb {name}")
    except ModuleNotFoundError as exc:  # matplotlib comes with the plot extra; the CSV and JSON do without
        if not (exc.name or "").startswith("matplotlib"):
            raise
        del paths["png"]
        print(
            "gpunode simulate: no PNG plot without matplotlib: pip install 'gpunode[plot]'", file=sys.stderr
        )
    return paths


# ----- command line ------------------------------------------------------------------------------


def parse_seeds(text: str) -> tuple[int, ...]:
    """`42-51`, `42,43,50` or a mix: the listed seeds in order, without repeats."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(f"--seeds: expected seeds such as 42-51 or 42,43,44, got {text!r}")
        first = int(m.group(1))
        seeds.extend(range(first, int(m.group(2) or first) + 1))
    return tuple(dict.fromkeys(seeds))


def register_simulate_cli(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add `simulate` to a subparsers object; run it with run_simulate_cli(args)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay an openb trace through the placement policies (FGD paper protocol)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument(
        "--trace-dir", type=Path, required=True, help="folder with the openb CSVs (or its csv/)"
    )
    parser.add_argument(
        "--pods", default="default", help="pod list variant (default, gpushare40, ...) or a CSV path"
    )
    parser.add_argument(
        "--mode",
        choices=("place", "time"),
        default="place",
        help="place: placement only, no departures (default); time: queueing policies over time",
    )
    parser.add_argument(
        "--policies",
        help=f"comma-separated policies (place: default {','.join(DEFAULT_POLICIES)}; "
        "time: presets, default all)",
    )
    parser.add_argument("--seeds", default="42-51", help="seeds, e.g. 42-51 or 42,43")
    parser.add_argument(
        "--ratio", type=float, default=DEFAULT_RATIO, help="arrivals as a multiple of GPU capacity"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the CSV, JSON summary and PNG")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel processes")
    parser.add_argument(
        "--node-file", default=DEFAULT_NODE_FILE, help="node list CSV name in the trace folder"
    )
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto", help="progress bar")
    parser.add_argument("--load", default="0.9", help="time: offered load(s) L, e.g. 0.9 or 0.9,1.2")
    parser.add_argument("--rules", type=Path, help="time: simulator rules YAML (default: built-in rules)")
    parser.add_argument(
        "--queues", type=Path, help="time: queue configuration YAML (default: examples/sim-queues.yaml)"
    )
    return parser


def run_simulate_cli(args: argparse.Namespace) -> int:
    """Run `gpunode simulate --mode place`; prints the summary as JSON on stdout, returns the exit code.

    `gpunode.cli` sends `--mode time` to gpunode.cluster.timesim.cli.run_time_cli instead."""
    spec = SimulationSpec(
        trace_dir=args.trace_dir,
        pods=args.pods,
        policies=tuple(
            p.strip() for p in (args.policies or ",".join(DEFAULT_POLICIES)).split(",") if p.strip()
        ),
        seeds=parse_seeds(args.seeds),
        ratio=args.ratio,
        jobs=args.jobs,
        node_file=args.node_file,
    )
    progress = None if args.progress == "auto" else args.progress == "on"
    results = run_simulation(spec, progress=progress)
    # after the run, so that a failure stays the first line on stderr
    notice = unknown_notice(n.model for n in load_nodes(find_csv(spec.trace_dir, spec.node_file)) if n.gpus)
    if notice:
        print(f"gpunode simulate: {notice}", file=sys.stderr)
    paths = write_outputs(results, args.out, name=Path(spec.pods).stem)
    print(
        json.dumps({"summary": summarize(results), "files": {k: str(v) for k, v in paths.items()}}, indent=2)
    )
    return 0
