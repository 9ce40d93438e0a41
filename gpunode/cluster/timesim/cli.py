"""`gpunode simulate --mode time`: every (load, policy, seed) of a spec, seeds in parallel processes.

    gpunode simulate --mode time --trace-dir /work/shared/traces/openb --load 0.9,1.2 \\
        --policies gpunode,kube,kueue-strict,kueue-besteffort,kai --seeds 42-51 \\
        [--rules FILE] [--queues FILE] --out results/

Each worker process loads the trace, the rules and the queue file once, builds
each (seed, load) replay once and runs it through every policy asked of it. The
summary (mean over seeds per load and policy) is printed as JSON; CSV and PNGs go
to --out (report.py).

GPU memory is simulated when the pod list asks for it (a `gpu_memory_mib` value
on any row): GPUs then carry their model's memory and every fractional pod asks
memory too (tracesim.gpumemory). Without memory asks the GPUs are compute only,
as before: once GPUs carry memory, GPU memory is a resource the queues' fair
shares and dominant shares count, so on a cluster of several GPU models the
results of a trace that never asked for memory could move.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from gpunode.cluster.queueing.config import QueueConfig, load_queue_config
from gpunode.cluster.queueing.presets import PRESETS
from gpunode.cluster.timesim.report import summarize, write_outputs
from gpunode.cluster.timesim.rules import SimRules, load_rules
from gpunode.cluster.timesim.run import RunResult, run_replay
from gpunode.cluster.timesim.trace import Replay, TimedPod, build_replay, load_timed_pods
from gpunode.cluster.tracesim.gpumemory import MemoryAsks, unknown_notice
from gpunode.cluster.tracesim.simulate import TraceInput, load_trace, parse_seeds, progress_bar
from gpunode.cluster.tracesim.trace import DEFAULT_NODE_FILE, node_state, pod_list_path
from gpunode.errors import ConfigError
from gpunode.placement import NodeState

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEFAULT_QUEUES = EXAMPLES / "sim-queues.yaml"
DEFAULT_LOADS = (0.9,)


@dataclass(frozen=True)
class TimeSpec:
    """What to simulate over time: trace, loads, presets, seeds, rules and queue files, processes."""

    trace_dir: Path
    pods: str = "default"
    loads: tuple[float, ...] = DEFAULT_LOADS
    policies: tuple[str, ...] = tuple(PRESETS)
    seeds: tuple[int, ...] = (42,)
    rules: Path | None = None
    queues: Path = DEFAULT_QUEUES
    jobs: int = 1
    node_file: str = DEFAULT_NODE_FILE

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in PRESETS]
        if unknown:
            raise ConfigError(f"--policies: unknown preset {', '.join(unknown)}; known: {', '.join(PRESETS)}")
        if not self.policies or not self.seeds or not self.loads:
            raise ConfigError("--policies, --seeds and --load need at least one entry each")
        if any(not (0 < x <= 10 and math.isfinite(x)) for x in self.loads):
            raise ConfigError(f"--load: each load must be within (0, 10], got {list(self.loads)}")
        if self.jobs < 1:
            raise ConfigError(f"--jobs must be at least 1, got {self.jobs}")


def parse_loads(text: str) -> tuple[float, ...]:
    """`0.9` or `0.9,1.2`: the loads in order, without repeats."""
    try:
        loads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--load: expected numbers such as 0.9 or 0.9,1.2, got {text!r}") from None
    return tuple(dict.fromkeys(loads))


@dataclass
class _Inputs:
    trace: TraceInput
    pods: tuple[TimedPod, ...]
    nodes: tuple[NodeState, ...]
    config: QueueConfig
    rules: SimRules
    replays: dict[tuple[int, float], Replay]
    asks: MemoryAsks | None  # GPU memory simulated (the pod list asks for it), else None


def memory_asks(trace: TraceInput, pods: Sequence[TimedPod]) -> MemoryAsks | None:
    """The memory asks of a simulation with GPU memory, when some pod asks for memory; else None."""
    if not any(p.pod.gpu_memory_bytes for p in pods):
        return None
    return MemoryAsks(n.model for n in trace.nodes if n.gpus)


_CACHE: dict[tuple[str, ...], _Inputs] = {}


def _inputs(trace_dir: str, pods: str, node_file: str, rules: str, queues: str) -> _Inputs:
    key = (trace_dir, pods, node_file, rules, queues)
    if key not in _CACHE:
        trace = load_trace(Path(trace_dir), pods, node_file=node_file)
        timed = load_timed_pods(pod_list_path(Path(trace_dir), pods))
        asks = memory_asks(trace, timed)
        _CACHE[key] = _Inputs(
            trace=trace,
            pods=timed,
            nodes=tuple(node_state(n, gpu_memory=asks is not None) for n in trace.nodes),
            config=load_queue_config(queues),
            rules=load_rules(rules or None),
            replays={},
            asks=asks,
        )
    return _CACHE[key]


def replay_for(inputs: _Inputs, seed: int, load: float) -> Replay:
    """The (seed, load) replay of these inputs (built once per process)."""
    if (seed, load) not in inputs.replays:
        inputs.replays[(seed, load)] = build_replay(
            inputs.pods,
            cluster_gpus=float(sum(n.gpus for n in inputs.trace.nodes)),
            load=load,
            rules=inputs.rules,
            seed=seed,
            priorities={q: s.priority for q, s in inputs.config.queues.items()},
            asks=inputs.asks,
        )
    return inputs.replays[(seed, load)]


def run_task(args: tuple[str, str, str, str, str], policy: str, seed: int, load: float) -> RunResult:
    """One (policy, seed, load) run in this process."""
    inputs = _inputs(*args)
    return run_replay(
        replay_for(inputs, seed, load),
        config=inputs.config,
        nodes=inputs.nodes,
        workload=inputs.trace.workload,
        policy=policy,
        seed=seed,
        load=load,
        rules=inputs.rules,
    )


def run_time_simulation(spec: TimeSpec, *, progress: bool | None = None) -> list[RunResult]:
    """Every (load, policy, seed) of the spec, in that order; in parallel processes when jobs > 1."""
    args = (str(spec.trace_dir), spec.pods, spec.node_file, str(spec.rules or ""), str(spec.queues))
    inputs = _inputs(*args)  # fail fast, in this process, on a bad trace, rules or queue file
    notice = unknown_notice(inputs.asks.models) if inputs.asks is not None else None
    if notice:
        print(f"gpunode simulate: {notice}", file=sys.stderr)
    missing = sorted({q for q in inputs.rules.queues.names() if q not in inputs.config.leaves})
    if missing:
        raise ConfigError(
            f"the rules send jobs to {', '.join(missing)}, which the queue file has no leaf queue for",
            hint=f"leaves of {spec.queues}: {', '.join(inputs.config.leaves)}; align queues.teams/qos in the rules",
        )
    tasks = [(load, policy, seed) for load in spec.loads for policy in spec.policies for seed in spec.seeds]
    bar = progress_bar(len(tasks), f"simulate --mode time {spec.pods}", progress)
    results: dict[tuple[float, str, int], RunResult] = {}
    try:
        if spec.jobs == 1:
            for load, policy, seed in tasks:
                results[(load, policy, seed)] = run_task(args, policy, seed, load)
                bar.update()
        else:
            with ProcessPoolExecutor(max_workers=min(spec.jobs, len(tasks))) as pool:
                futures = {pool.submit(run_task, args, p, s, x): (x, p, s) for x, p, s in tasks}
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    bar.update()
    finally:
        bar.close()
    return [results[t] for t in tasks]


def headline(results: Sequence[RunResult]) -> dict[str, dict[str, dict[str, float]]]:
    """The key figures per load and policy (means over seeds), for the terminal."""
    keys = (
        "delay_mean",
        "delay_p95",
        "delay_multi_gpu_p95",
        "delay_gang_p95",
        "allocation",
        "jain_mean",
        "lost_share",
        "idle_gpu_hours",
        "partial_gang_held_gpus",
    )
    out: dict[str, dict[str, dict[str, float]]] = {}
    for load, per_policy in summarize(results).items():
        for policy, s in per_policy.items():
            mean = s["mean"]
            assert isinstance(mean, dict)
            out.setdefault(load, {})[policy] = {k: round(float(mean[k]), 4) for k in keys if k in mean}
    return out


def run_time_cli(args: argparse.Namespace) -> int:
    """Run `gpunode simulate --mode time`; prints the headline figures as JSON, returns the exit code."""
    spec = TimeSpec(
        trace_dir=args.trace_dir,
        pods=args.pods,
        loads=parse_loads(args.load),
        policies=tuple(p.strip() for p in (args.policies or ",".join(PRESETS)).split(",") if p.strip()),
        seeds=parse_seeds(args.seeds),
        rules=args.rules,
        queues=args.queues or DEFAULT_QUEUES,
        jobs=args.jobs,
        node_file=args.node_file,
    )
    progress = None if args.progress == "auto" else args.progress == "on"
    results = run_time_simulation(spec, progress=progress)
    paths = write_outputs(results, args.out, name=f"time-{Path(spec.pods).stem}")
    print(
        json.dumps({"summary": headline(results), "files": {k: str(v) for k, v in paths.items()}}, indent=2)
    )
    return 0
