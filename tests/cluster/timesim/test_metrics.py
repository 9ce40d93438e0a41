"""Metric definitions on hand-made records and timelines: censored delays, windows of fairness."""

from __future__ import annotations

import pytest

from gpunode.cluster.queueing.config import parse_queue_config
from gpunode.cluster.timesim.metrics import JobRecord, Timeline, allocation, fairness, job_metrics
from gpunode.config.reader import load_yaml

from .helpers import QUEUES_YAML

CONFIG = parse_queue_config(load_yaml(QUEUES_YAML, where="q.yaml"), "q.yaml")


def test_fairness_per_window_by_hand() -> None:
    t = Timeline(("team-a", "team-b"))
    t.record(0.0, (1.0, 0.0), (1.0, 0.0))  # a holds what it asks for; b asks nothing
    t.record(100.0, (0.0, 1.0), (1.0, 1.0))  # both ask for 1 of 2 GPUs; only b gets it
    got = fairness(t, CONFIG, horizon=200.0, cluster_gpus=2.0, window=100.0)
    # window 1: only a is entitled (x = 1): 1.0; window 2: x = (0, 1): 1 / 2 = 0.5
    assert got == {"jain_mean": pytest.approx(0.75), "jain_min": pytest.approx(0.5), "windows": 2}
    assert allocation(t, horizon=200.0, cluster_gpus=2.0) == {
        "all": pytest.approx(0.5),
        "team-a": pytest.approx(0.25),
        "team-b": pytest.approx(0.25),
    }


def test_timeline_keeps_only_changes_and_the_last_state_of_an_instant() -> None:
    t = Timeline(("q",))
    t.record(0.0, (1.0,), (1.0,))
    t.record(5.0, (1.0,), (1.0,))  # no change: not kept
    t.record(10.0, (2.0,), (2.0,))
    t.record(10.0, (3.0,), (3.0,))  # same instant: replaces
    assert t.times == [0.0, 10.0] and t.held == [(1.0,), (3.0,)]


def test_a_job_never_started_counts_until_the_end_and_is_reported() -> None:
    records = [
        JobRecord(
            "a",
            "q",
            arrival=0.0,
            gpus=1,
            duration=50,
            multi_gpu=False,
            gang=False,
            first_start=20.0,
            end=70.0,
        ),
        JobRecord("b", "q", arrival=10.0, gpus=4, duration=50, multi_gpu=True, gang=True),
    ]
    m = job_metrics(records, end=110.0, slowdown_bound=10.0)
    assert m["not_started"] == 1
    assert m["delay_mean"] == pytest.approx((20 + 100) / 2)
    assert m["delay_gang_mean"] == 100 and m["gang_wait_max"] == 100
    assert m["jct_mean"] == 70 and m["slowdown_mean"] == pytest.approx(70 / 50)
