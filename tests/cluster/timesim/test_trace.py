"""Trace times, the rule for never-scheduled rows, gangs, and load compression, checked by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpunode.cluster.timesim.rules import EstimateRules, GangRules, ReplayRules, SimRules
from gpunode.cluster.timesim.trace import build_replay, load_timed_pods
from gpunode.errors import TraceError

from .helpers import pod, write_trace

RULES = SimRules(replay=ReplayRules(horizon_s=100.0, max_jobs=2000))


def _pods(tmp_path: Path, rows: list[list[object]]) -> Path:
    write_trace(tmp_path, rows, nodes=[("n1", 2)])
    return tmp_path / "csv" / "openb_pod_list_default.csv"


def test_load_compression_by_hand(tmp_path: Path) -> None:
    # The observation starts at the first deletion (50): A arrives at offset 0, B at 50 (span 50).
    # With laps of l seconds over H = 100 s: A at 0, l, 2l; B at l, 2l (for 100/3 < l < 50). Offered
    # GPU-seconds inside [0, 100): A 50 + 50 + (100 - 2l), B (100 - l) + (100 - 2l) = 400 - 5l.
    # Load 1 on 2 GPUs is 200 GPU-seconds, so l = 40.
    path = _pods(tmp_path, [pod("A", 1, 0, 50, 0), pod("B", 1, 100, 5000, 100)])
    replay = build_replay(load_timed_pods(path), cluster_gpus=2, load=1.0, rules=RULES, seed=1)
    assert replay.lap_s == pytest.approx(40.0, rel=1e-6)
    assert replay.laps == 3
    assert replay.offered_load == pytest.approx(1.0, rel=1e-6)
    got = [(j.name, round(j.arrival, 3), j.duration) for j in replay.jobs]
    assert got == [
        ("A", 0.0, 50.0),
        ("A~1", 40.0, 50.0),
        ("B", 40.0, 4900.0),
        ("A~2", 80.0, 50.0),
        ("B~1", 80.0, 4900.0),
    ]
    assert all(j.runtime_estimate == j.duration for j in replay.jobs)  # estimates: exact


@pytest.mark.parametrize("mode", ["exact", "noisy"])
def test_a_bias_scales_every_estimate_and_no_runtime(tmp_path: Path, mode: str) -> None:
    # Systematically optimistic users: estimates at a quarter, the same arrivals and true runtimes.
    path = _pods(tmp_path, [pod("A", 1, 0, 50, 0), pod("B", 1, 100, 5000, 100)])
    pods = load_timed_pods(path)
    plain = replace(RULES, estimates=EstimateRules(mode=mode, sigma=1.0))
    biased = replace(RULES, estimates=EstimateRules(mode=mode, sigma=1.0, bias=0.25))
    a = build_replay(pods, cluster_gpus=2, load=1.0, rules=plain, seed=3).jobs
    b = build_replay(pods, cluster_gpus=2, load=1.0, rules=biased, seed=3).jobs
    assert [(j.name, j.arrival, j.duration) for j in a] == [(j.name, j.arrival, j.duration) for j in b]
    for x, y in zip(a, b, strict=True):
        assert x.runtime_estimate is not None and y.runtime_estimate is not None
        assert y.runtime_estimate == pytest.approx(0.25 * x.runtime_estimate, rel=1e-12)
    if mode == "noisy":
        assert any(x.runtime_estimate != x.duration for x in a)


def test_lower_load_means_longer_laps_and_fewer_jobs(tmp_path: Path) -> None:
    path = _pods(tmp_path, [pod("A", 1, 0, 50, 0), pod("B", 1, 100, 5000, 100)])
    pods = load_timed_pods(path)
    low = build_replay(pods, cluster_gpus=2, load=0.5, rules=RULES, seed=1)
    high = build_replay(pods, cluster_gpus=2, load=1.0, rules=RULES, seed=1)
    assert low.lap_s > high.lap_s and len(low.jobs) < len(high.jobs)
    assert low.offered_load == pytest.approx(0.5, rel=1e-6)


def test_unreachable_load_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = _pods(tmp_path, [pod("A", 1, 0, 50, 0), pod("B", 1, 100, 5000, 100)])
    rules = replace(RULES, replay=replace(RULES.replay, max_jobs=3))
    with pytest.raises(TraceError, match="cannot be offered") as exc:
        build_replay(load_timed_pods(path), cluster_gpus=2, load=5.0, rules=rules, seed=1)
    assert "maxJobs" in (exc.value.hint or "")


def test_never_scheduled_rows_follow_the_rule(tmp_path: Path) -> None:
    rows = [
        pod("A", 1, 0, 50, 0),
        pod("B", 1, 10, 80, 20),  # runs 60 s
        pod("P", 1, 30, 45, None),  # never scheduled: lived 15 s
        pod("C", 2, 30, 1030, 30),  # the only 2-GPU row that ran: 1000 s
        pod("Q", 2, 40, 41, None),
    ]
    pods = load_timed_pods(_pods(tmp_path, rows))

    def durations(unscheduled: str, seed: int = 3) -> dict[str, float]:
        rules = replace(RULES, replay=replace(RULES.replay, unscheduled=unscheduled, horizon_s=60.0))
        replay = build_replay(pods, cluster_gpus=20, load=0.05, rules=rules, seed=seed)
        return {j.name: float(j.duration or 0) for j in replay.jobs if "~" not in j.name}

    lifetime = durations("lifetime")
    assert (lifetime["P"], lifetime["Q"]) == (15.0, 1.0)
    assert set(durations("drop")) == {"A", "B", "C"}
    for seed in range(5):
        sampled = durations("sample", seed)
        assert sampled["P"] in (50.0, 60.0)  # drawn from the 1-GPU rows that ran
        assert sampled["Q"] == 1000.0  # drawn from the 2-GPU rows that ran
        assert sampled["A"] == 50.0 and sampled["C"] == 1000.0


def test_gangs_split_multi_gpu_jobs_and_keep_their_gpus(tmp_path: Path) -> None:
    pods = load_timed_pods(_pods(tmp_path, [pod("A", 1, 0, 50, 0), pod("G", 4, 0, 500, 0)]))
    rules = replace(RULES, gangs=GangRules(share=1.0, members=(2,)))
    replay = build_replay(pods, cluster_gpus=8, load=0.3, rules=rules, seed=1)
    gangs = [j for j in replay.jobs if j.name.startswith("G")]
    assert gangs and all(len(j.pods) == 2 and j.gpu_milli == 4000 for j in gangs)
    assert all(p.gpus == 2 and p.cpu_milli == 2000 for j in gangs for p in j.pods)
    none = build_replay(
        pods, cluster_gpus=8, load=0.3, rules=replace(rules, gangs=GangRules(share=0.0)), seed=1
    )
    assert all(len(j.pods) == 1 for j in none.jobs)


def test_same_seed_same_replay_other_seed_other_draws(tmp_path: Path) -> None:
    rows = [pod(f"p{i}", 1 + (i % 3 == 0) * 3, i * 10, i * 10 + 100 + i, i * 10) for i in range(30)]
    rows += [pod(f"u{i}", 1, i * 7, i * 7 + 5, None) for i in range(10)]
    pods = load_timed_pods(_pods(tmp_path, rows))
    one = build_replay(pods, cluster_gpus=16, load=0.8, rules=RULES, seed=7)
    again = build_replay(pods, cluster_gpus=16, load=0.8, rules=RULES, seed=7)
    other = build_replay(pods, cluster_gpus=16, load=0.8, rules=RULES, seed=8)
    assert one == again
    assert [(j.name, j.queue) for j in one.jobs[:40]] == [(j.name, j.queue) for j in other.jobs[:40]]
    assert [j.duration for j in one.jobs] != [j.duration for j in other.jobs]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (pod("X", 1, 100, 50, None), "times out of order"),
        (pod("X", 1, 100, 500, 50), "times out of order"),
        (pod("X", 1, "soon", 500, 50), "creation_time: expected a time"),
        (pod("X", 1, -5, 500, 50), "non-negative"),
        (pod("X", 1, "", 500, 50), "needs creation_time"),
    ],
)
def test_bad_times_name_the_line(tmp_path: Path, row: list[object], message: str) -> None:
    path = _pods(tmp_path, [pod("A", 1, 0, 50, 0), row])
    with pytest.raises(TraceError, match=message) as exc:
        load_timed_pods(path)
    assert ":3:" in str(exc.value)


def test_a_pod_list_without_times_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pods.csv"
    path.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1000,1024,1,1000\n")
    with pytest.raises(TraceError, match="missing column"):
        load_timed_pods(path)
