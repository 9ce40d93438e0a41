"""The time simulator with GPU memory: a pod's memory ask makes it wait where compute alone would not.

Memory binds (two 0.3-GPU pods of 10 GiB on one 16 GiB GPU: the second waits for the first),
compute binds (two 0.6-GPU pods of 2 GiB), GPU memory switched on by the trace's column only,
and replays with proportional asks giving the same numbers as compute-only ones under every preset.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from gpunode.cluster.queueing.config import parse_queue_config
from gpunode.cluster.queueing.model import Job
from gpunode.cluster.queueing.presets import PRESETS
from gpunode.cluster.timesim.cli import memory_asks
from gpunode.cluster.timesim.rules import SimRules
from gpunode.cluster.timesim.run import RunResult, run_replay
from gpunode.cluster.timesim.trace import Replay, load_timed_pods
from gpunode.cluster.tracesim.gpumemory import MemoryAsks
from gpunode.cluster.tracesim.simulate import load_trace
from gpunode.cluster.tracesim.trace import TraceNode, TracePod, node_state, request_of
from gpunode.config.reader import load_yaml
from gpunode.contract.names import GIB

from .helpers import POD_HEADER, QUEUES_YAML, pod, write_trace

CONFIG = parse_queue_config(load_yaml(QUEUES_YAML, where="q.yaml"), "q.yaml")


def trace_node(gpus: int) -> TraceNode:
    return TraceNode(name="n1", cpu_milli=64000, memory_bytes=256 * GIB, gpus=gpus, model="V100M16")


def shared(name: str, milli: int, gpu_memory_gib: int = 0) -> TracePod:
    return TracePod(
        name=name,
        cpu_milli=1000,
        memory_bytes=GIB,
        num_gpu=1,
        gpu_milli=milli,
        gpu_models=None,
        gpu_memory_bytes=gpu_memory_gib * GIB,
    )


def run(
    pods: list[tuple[TracePod, float, float]],
    *,
    gpus: int = 1,
    gpu_memory: bool = True,
    policy: str = "gpunode",
) -> RunResult:
    """Each (pod, arrival, duration) as one job of team-a/team-b in turn, on one V100M16 node."""
    node = trace_node(gpus)
    asks = MemoryAsks([node.model]) if gpu_memory else None
    jobs = [
        Job(
            name=p.name,
            queue="team-a" if i % 2 == 0 else "team-b",
            pods=(request_of(p, asks),),
            arrival=arrival,
            runtime_estimate=duration,
            duration=duration,
        )
        for i, (p, arrival, duration) in enumerate(pods)
    ]
    replay = Replay(
        jobs=tuple(jobs), horizon_s=300.0, lap_s=300.0, laps=1, offered_load=0.0, rows=len(jobs), dropped=0
    )
    return run_replay(
        replay,
        config=CONFIG,
        nodes=[node_state(node, gpu_memory=gpu_memory)],
        workload=None,
        policy=policy,
        seed=1,
        load=1.0,
        rules=SimRules(),
    )


def test_memory_binds_the_second_pod_waits_for_the_first() -> None:
    # a (0.3 GPU, 10 GiB) runs 0..100; b (0.3 GPU, 10 GiB) arrives at 10: 20 GiB do not fit 16 GiB,
    # 0.6 GPU of compute would. b starts at 100: delays 0 and 90.
    m = run([(shared("a", 300, 10), 0, 100), (shared("b", 300, 10), 10, 50)]).metrics["all"]
    assert m["jobs"] == 2 and m["not_started"] == 0
    assert m["delay_mean"] == pytest.approx(45)
    # Without memory asks (each its compute share of the GPU's memory) both run at once.
    m = run([(shared("a", 300), 0, 100), (shared("b", 300), 10, 50)]).metrics["all"]
    assert m["delay_mean"] == 0
    # On a node of two GPUs the second goes to the other GPU at once.
    m = run([(shared("a", 300, 10), 0, 100), (shared("b", 300, 10), 10, 50)], gpus=2).metrics["all"]
    assert m["delay_mean"] == 0


def test_compute_binds_the_second_pod_waits_for_the_first() -> None:
    # 2 + 2 GiB fit 16 GiB; 0.6 + 0.6 GPU do not fit one GPU.
    m = run([(shared("a", 600, 2), 0, 100), (shared("b", 600, 2), 10, 50)]).metrics["all"]
    assert m["delay_mean"] == pytest.approx(45)


def test_a_pod_asking_more_memory_than_any_gpu_is_unplaceable() -> None:
    r = run([(shared("big", 100, 20), 0, 10), (shared("ok", 100, 2), 0, 10)])
    assert r.metrics["all"]["unplaceable"] == 1 and r.metrics["all"]["jobs"] == 1


def test_gpu_memory_is_simulated_when_the_trace_asks_for_it(tmp_path: Path) -> None:
    rows = [pod("A", 1, 0, 50, 0), pod("B", 1, 100, 5000, 100)]
    plain = write_trace(tmp_path / "plain", rows, nodes=[("n1", 2)])
    pods = load_timed_pods(plain / "csv" / "openb_pod_list_default.csv")
    assert memory_asks(load_trace(plain, "default"), pods) is None  # compute only, as before

    asking = write_trace(tmp_path / "asking", rows, nodes=[("n1", 2)])
    path = asking / "csv" / "openb_pod_list_default.csv"
    fraction = ["S", 4000, 8192, 1, 300, "", "LS", "Running", 0, 50, 0, 10240]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*POD_HEADER, "gpu_memory_mib"])
        w.writerows([[*r, ""] for r in rows] + [fraction])
    pods = load_timed_pods(path)
    asks = memory_asks(load_trace(asking, "default"), pods)
    assert asks is not None and asks.models == ("V100M16",)
    assert [request_of(p.pod, asks).gpu_memory_bytes for p in pods] == [0, 0, 10 * GIB]


def _mixed_jobs() -> list[tuple[TracePod, float, float]]:
    shapes = [(300, 0), (600, 0), (250, 0), (500, 0), (125, 0), (700, 0)]
    return [(shared(f"j{i}", shapes[i % len(shapes)][0]), i * 7.0, 30.0 + 11 * i) for i in range(18)]


@pytest.mark.parametrize("policy", list(PRESETS))
def test_proportional_asks_give_the_compute_only_numbers(policy: str) -> None:
    # Fractions that contend for two GPUs, run compute only (GPUs without memory, as before GPU memory was
    # simulated) and with memory and proportional asks: every metric equal, under every preset.
    jobs = _mixed_jobs()
    before = run(jobs, gpus=2, gpu_memory=False, policy=policy)
    after = run(jobs, gpus=2, gpu_memory=True, policy=policy)
    assert before.metrics["all"]["delay_mean"] > 0  # the jobs wait: placement and order matter
    assert json.dumps(after.metrics, sort_keys=True) == json.dumps(before.metrics, sort_keys=True)  # NaN too
    assert after.plot_held == before.plot_held
