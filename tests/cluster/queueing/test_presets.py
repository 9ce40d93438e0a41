"""The baselines are the same engine with switches: each switch shown on a case where it decides."""

from __future__ import annotations

import pytest

from gpunode.cluster.queueing.presets import POD_GRACE_S, PRESETS, preset
from gpunode.errors import ConfigError
from tests.cluster.queueing.sched_helpers import TWO_TEAMS, config, free_gpus, job, names, scheduler


def test_an_unknown_policy_is_refused_with_the_known_names() -> None:
    with pytest.raises(ConfigError) as err:
        preset("slurm")
    assert str(err.value) == "unknown scheduling policy 'slurm'"
    assert err.value.hint == "choose one of: gpunode, kube, kueue-strict, kueue-besteffort, kai"
    assert all(p.description for p in PRESETS.values())


def test_kube_places_gang_members_one_by_one_so_a_partial_gang_holds_gpus() -> None:
    s = scheduler(config(TWO_TEAMS), policy="kube")
    s.submit(job("x", "a", 8), 0.0)
    s.submit(job("g", "b", 8, pods=2), 0.0)
    d = s.cycle(0.0)
    assert names(d.admit) == ["x"]
    assert free_gpus(s) == 0 and s.partial_gangs == {"g"}  # g's first pod holds 8 GPUs, the second waits
    (w,) = [w for w in d.waiting if w.job == "g"]
    assert w.reason == "queued in b, position 1: 1 of 2 pods placed; the others wait for room"
    s.finished("x", 10.0)
    d = s.cycle(10.0)
    assert names(d.admit) == ["g"] and len(d.admit[0].plan.pods) == 2


def test_kube_orders_all_jobs_by_priority_then_arrival_and_skips_what_does_not_fit() -> None:
    s = scheduler(config(TWO_TEAMS), nodes=1, policy="kube")
    s.submit(job("early", "a", 8, t=0.0), 0.0)
    s.submit(job("late-high", "b", 4, t=1.0, priority=1), 1.0)
    s.submit(job("late-big", "a", 16, t=2.0, priority=1), 2.0)  # can never fit one node
    d = s.cycle(2.0)
    assert names(d.admit) == ["late-high"]  # priority first; the 16-GPU pod does not block the others
    assert s.pending_count == 2  # "early" waits behind the higher priority, "late-big" never fits


@pytest.mark.parametrize(("policy", "admitted"), [("kueue-strict", []), ("kueue-besteffort", ["a-small"])])
def test_strict_fifo_head_blocks_its_queue_best_effort_does_not(policy: str, admitted: list[str]) -> None:
    queues = [
        {"name": "a", "guarantee": {"gpu": 8}, "borrowLimit": {"gpu": 0}},
        {"name": "b", "guarantee": {"gpu": 8}},
    ]
    s = scheduler(config(queues), policy=policy)
    s.submit(job("a-big", "a", 8, pods=2, t=0.0), 0.0)  # 16 GPUs: over a's nominal quota of 8
    s.submit(job("a-small", "a", 2, t=1.0), 1.0)
    d = s.cycle(1.0)
    assert names(d.admit) == admitted
    assert s.reservation is None  # no backfill in Kueue


def test_kueue_serves_a_head_within_its_nominal_quota_before_a_borrowing_one() -> None:
    s = scheduler(config(TWO_TEAMS), nodes=2, policy="kueue-besteffort")
    s.submit(job("a0", "a", 8), 0.0)
    s.cycle(0.0)  # a at its nominal quota
    s.submit(job("a1", "a", 8, t=1.0), 1.0)  # would borrow
    s.submit(job("b0", "b", 8, t=2.0), 2.0)  # within b's quota, arrived later
    d = s.cycle(2.0)
    assert names(d.admit) == ["b0"]


@pytest.mark.parametrize("policy", ["kueue-strict", "kai"])
def test_baselines_reclaim_with_the_pod_grace_period_and_no_minimum_runtime(policy: str) -> None:
    s = scheduler(config(TWO_TEAMS, preemption={"notice": "5m", "minRuntime": "1h"}), policy=policy)
    for i in range(4):
        s.submit(job(f"a{i}", "a", 4), 0.0)
    assert len(s.cycle(0.0).admit) == 4  # a borrows all of b's quota
    s.submit(job("b0", "b", 4, t=5.0), 5.0)
    (n,) = s.cycle(5.0).notices
    assert n.reason == "reclaim" and n.deadline == 5.0 + POD_GRACE_S


def test_kai_keeps_no_backfill_reservation_where_gpunode_does() -> None:
    for policy, reserved in (("gpunode", True), ("kai", False)):
        s = scheduler(config([{"name": "a", "guarantee": {"gpu": 8}}]), nodes=1, policy=policy)
        s.submit(job("L", "a", 6, est=100.0), 0.0)
        s.submit(job("H", "a", 8, t=1.0), 1.0)
        s.cycle(1.0)
        assert (s.reservation is not None) is reserved
