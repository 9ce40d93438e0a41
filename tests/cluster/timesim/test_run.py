"""A small replay whose every number is checked by hand, preemption bookkeeping, and determinism per seed."""

from __future__ import annotations

import json

import pytest

from gpunode.cluster.queueing.config import parse_queue_config
from gpunode.cluster.queueing.model import Job
from gpunode.cluster.queueing.presets import PRESETS
from gpunode.cluster.timesim.rules import SimRules
from gpunode.cluster.timesim.run import run_replay
from gpunode.cluster.timesim.trace import Replay
from gpunode.cluster.tracesim.trace import TraceNode, node_state
from gpunode.config.reader import load_yaml
from gpunode.contract.names import GIB
from gpunode.placement import Request

from .helpers import QUEUES_YAML

CONFIG = parse_queue_config(load_yaml(QUEUES_YAML, where="q.yaml"), "q.yaml")
NODE = node_state(TraceNode(name="n1", cpu_milli=64000, memory_bytes=256 * GIB, gpus=2, model="V100M16"))


def job(name: str, queue: str, gpus: int, arrival: float, duration: float) -> Job:
    return Job(
        name=name,
        queue=queue,
        pods=(Request(gpus=gpus, cpu_milli=4000, memory_bytes=8 * GIB),),
        arrival=arrival,
        runtime_estimate=duration,
        duration=duration,
    )


def replay(jobs: list[Job], horizon: float) -> Replay:
    return Replay(
        jobs=tuple(jobs), horizon_s=horizon, lap_s=horizon, laps=1, offered_load=0.0, rows=3, dropped=0
    )


@pytest.mark.parametrize("policy", [p for p in PRESETS if p != "kai"])
def test_three_jobs_on_two_gpus_by_hand(policy: str) -> None:
    # j1 (2 GPUs) runs 0..100; j2 and j3 (1 GPU each) wait for it and both start at 100. No preset
    # preempts here: team-a borrows nothing from a guarantee, and KAI's reclaim towards the fair
    # share (next test) is the only rule that takes back GPUs above a share.
    jobs = [job("j1", "team-a", 2, 0, 100), job("j2", "team-a", 1, 10, 50), job("j3", "team-b", 1, 20, 30)]
    r = run_replay(
        replay(jobs, 200.0),
        config=CONFIG,
        nodes=[NODE],
        workload=None,
        policy=policy,
        seed=1,
        load=1.0,
        rules=SimRules(),
    )
    m = r.metrics["all"]
    assert m["jobs"] == 3 and m["not_started"] == 0
    # delays 0, 90, 80
    assert m["delay_mean"] == pytest.approx(170 / 3)
    assert m["delay_median"] == pytest.approx(80)
    assert m["delay_p95"] == pytest.approx(89)  # linear interpolation: 80 + 0.9 * (90 - 80)
    assert m["delay_multi_gpu_mean"] == 0 and m["delay_gang_count"] == 0
    # JCT 100, 140, 110; bounded slowdown 1, 140/50, 110/30
    assert m["jct_mean"] == pytest.approx(350 / 3)
    assert m["slowdown_mean"] == pytest.approx((1 + 2.8 + 110 / 30) / 3)
    # 2 GPUs held over [0, 130), 1 over [130, 150), none to 200: (260 + 20) / (2 x 200)
    assert m["allocation"] == pytest.approx(0.7)
    assert r.metrics["team-a"]["allocation"] == pytest.approx(250 / 400)
    assert r.metrics["team-b"]["allocation"] == pytest.approx(30 / 400)
    assert r.metrics["team-a"]["delay_mean"] == pytest.approx(45)
    # Energy: 280 busy GPU-seconds at 300 W; 20 idle GPU-seconds on the powered node at 40 W.
    assert m["busy_gpu_hours"] == pytest.approx(280 / 3600)
    assert m["idle_gpu_hours"] == pytest.approx(20 / 3600)
    assert m["kwh"] == pytest.approx((280 * 300 + 20 * 40) / 3.6e6)
    # Entitled (weights 1:1, capped at demand): team-a 2 GPUs over [0, 20), 1 over [20, 150);
    # team-b 1 over [20, 130). Received: a 250, b 30 -> x = 250/170, 30/110.
    xa, xb = 250 / 170, 30 / 110
    assert m["jain_mean"] == pytest.approx((xa + xb) ** 2 / (2 * (xa**2 + xb**2)))
    assert m["windows"] == 1
    assert m["preemptions"] == 0 and m["lost_gpu_hours"] == 0 and m["partial_gang_held_gpus"] == 0
    assert r.replay["end_s"] == 150.0


def test_kai_reclaims_towards_the_fair_share_by_hand() -> None:
    # At 20 team-b's j3 arrives; team-a holds both GPUs, above its fair share of 1: j1 gets a notice
    # (30 s grace), too short for the 60 s checkpoint, and is stopped at 50 having run 50 s on
    # 2 GPUs (100 GPU-seconds lost). j3 and j2 start at 50 (end 80 and 100); j1 restarts from
    # scratch at 100 and ends at 200.
    jobs = [job("j1", "team-a", 2, 0, 100), job("j2", "team-a", 1, 10, 50), job("j3", "team-b", 1, 20, 30)]
    r = run_replay(
        replay(jobs, 200.0),
        config=CONFIG,
        nodes=[NODE],
        workload=None,
        policy="kai",
        seed=1,
        load=1.0,
        rules=SimRules(),
    )
    m = r.metrics["all"]
    assert m["preemptions"] == 1 and r.metrics["team-a"]["preemptions"] == 1
    assert m["lost_gpu_hours"] == pytest.approx(100 / 3600)
    assert m["delay_mean"] == pytest.approx((0 + 40 + 30) / 3)  # the first start counts
    assert m["jct_mean"] == pytest.approx((200 + 90 + 60) / 3)
    # held: 2 GPUs over [0, 50), 2 over [50, 80), 1 over [80, 100), 2 over [100, 200)
    assert m["allocation"] == pytest.approx(380 / 400)
    assert m["delivered_gpu_hours"] == pytest.approx(380 / 3600)
    assert m["lost_share"] == pytest.approx(100 / 380)


def test_a_job_that_can_never_fit_is_counted_not_waited_for() -> None:
    jobs = [job("big", "team-a", 4, 0, 10), job("ok", "team-b", 1, 0, 10)]
    r = run_replay(
        replay(jobs, 60.0),
        config=CONFIG,
        nodes=[NODE],
        workload=None,
        policy="gpunode",
        seed=1,
        load=1.0,
        rules=SimRules(),
    )
    assert r.metrics["all"]["unplaceable"] == 1 and r.metrics["all"]["jobs"] == 1


def test_same_seed_same_numbers() -> None:
    jobs = [
        job(f"j{i}", "team-a" if i % 2 else "team-b", 1 + i % 2, i * 7.0, 30.0 + 11 * i) for i in range(12)
    ]
    nodes = [NODE, node_state(TraceNode("n2", 64000, 256 * GIB, 2, "V100M16"))]

    def once() -> str:
        return json.dumps(
            run_replay(
                replay(jobs, 120.0),
                config=CONFIG,
                nodes=nodes,
                workload=None,
                policy="gpunode",
                seed=3,
                load=1.0,
                rules=SimRules(),
            ).metrics,
            sort_keys=True,
        )  # NaN (no gang jobs) compares equal as text

    assert once() == once()
