"""Runtime estimates learned from each queue's completed jobs, and the share of GPUs reservations may hold."""

from __future__ import annotations

import math

import pytest

from gpunode.cluster.queueing.history import MIN_SAMPLES, RuntimeHistory
from tests.cluster.queueing.sched_helpers import config, job, scheduler


def test_a_queue_that_under_estimates_gets_its_estimates_scaled() -> None:
    h = RuntimeHistory()
    for i in range(MIN_SAMPLES - 1):
        h.completed(job(f"a{i}", "a", est=100.0), 300.0)
    assert h.estimate(job("next", "a", est=50.0), 3600.0) == 50.0  # too few completions yet
    h.completed(job("a9", "a", est=100.0), 300.0)
    assert h.estimate(job("next", "a", est=50.0), 3600.0) == pytest.approx(150.0)
    assert h.estimate(job("other", "b", est=50.0), 3600.0) == 50.0  # another queue learns on its own


def test_without_estimates_the_geometric_mean_per_size() -> None:
    h = RuntimeHistory()
    for rt in (100.0, 400.0, 1600.0):
        h.completed(job(f"s{rt}", "a", 1), rt)
    assert h.estimate(job("x", "a", 1), 3600.0) == pytest.approx(400.0)
    assert h.estimate(job("big", "a", 8, pods=2), 3600.0) == 3600.0  # another size: the default still
    for rt in (10_000.0, 10_000.0, 40_000.0):
        h.completed(job(f"g{rt}", "a", 8, pods=2), rt)
    assert h.estimate(job("big", "a", 8, pods=2), 3600.0) == pytest.approx(
        math.exp((2 * math.log(1e4) + math.log(4e4)) / 3)
    )


def test_the_scheduler_plans_with_the_learned_runtime_and_preempted_jobs_teach_nothing() -> None:
    cfg = config([{"name": "a", "guarantee": {"gpu": 8}}], backfill={"learnEstimates": True})
    s = scheduler(cfg, nodes=1)
    t = 0.0
    for i in range(MIN_SAMPLES):
        s.submit(job(f"j{i}", "a", 8, t=t, est=100.0), t)
        assert [a.job.name for a in s.cycle(t).admit] == [f"j{i}"]
        t += 200.0
        s.finished(f"j{i}", t)  # ran twice its estimate
    s.submit(job("late", "a", 8, t=t, est=100.0), t)
    s.cycle(t)
    assert s.running["late"].expected_end(3600.0) == pytest.approx(t + 200.0)
    s.killed("late", t + 10.0)  # requeued; its next completion is not its length
    s.cycle(t + 10.0)
    s.finished("late", t + 15.0)
    s.submit(job("after", "a", 8, t=t + 15.0, est=100.0), t + 15.0)
    s.cycle(t + 15.0)
    assert s.running["after"].expected_end(3600.0) == pytest.approx(t + 15.0 + 200.0)


def test_off_by_default_the_estimate_as_given() -> None:
    s = scheduler(config([{"name": "a", "guarantee": {"gpu": 8}}]), nodes=1)
    for i in range(MIN_SAMPLES):
        s.submit(job(f"j{i}", "a", 8, t=0.0, est=100.0), 1000.0 * i)
        s.cycle(1000.0 * i)
        s.finished(f"j{i}", 1000.0 * i + 500.0)
    s.submit(job("x", "a", 8, est=100.0), 5000.0)
    s.cycle(5000.0)
    assert s.running["x"].expected_end(3600.0) == 5100.0


def test_learn_missing_learns_only_for_jobs_without_an_estimate() -> None:
    cfg = config([{"name": "a", "guarantee": {"gpu": 8}}], backfill={"learnMissing": True})
    assert cfg.backfill.learn_missing and not cfg.backfill.learn_estimates
    s = scheduler(cfg, nodes=1)
    t = 0.0
    for i in range(
        MIN_SAMPLES
    ):  # jobs with an estimate of 100 s that ran 200 s, and jobs without one that ran 7200 s
        for name, est, ran in ((f"e{i}", 100.0, 200.0), (f"m{i}", None, 7200.0)):
            s.submit(job(name, "a", 8, t=t, est=est), t)
            assert [a.job.name for a in s.cycle(t).admit] == [name]
            t += ran
            s.finished(name, t)
    s.submit(job("given", "a", 8, t=t, est=100.0), t)
    s.cycle(t)
    assert s.running["given"].expected_end(3600.0) == pytest.approx(t + 100.0)  # its estimate, as given
    s.finished("given", t + 50.0)
    s.submit(job("none", "a", 8, t=t + 50.0), t + 50.0)
    s.cycle(t + 50.0)
    assert s.running["none"].expected_end(3600.0) == pytest.approx(t + 50.0 + 7200.0)  # learned, not the 1 h


@pytest.mark.parametrize(
    ("share", "reserved"), [(1.0, {"A1", "A2", "A3"}), (0.5, {"A1", "A2"}), (0.2, {"A1"})]
)
def test_reservations_hold_at_most_their_share_of_the_gpus(share: float, reserved: set[str]) -> None:
    # Four nodes, each with 6 of 8 GPUs held by a long job; three 8-GPU jobs wait. The head of line's
    # reservation always counts; further ones only while the reserved jobs ask at most share x 32 GPUs.
    queues = [{"name": "a", "guarantee": {"gpu": 8}}, {"name": "c"}]
    pre = {"reclaim": False, "priority": False}
    backfill = {"reservations": 8, "reservationsPerQueue": 8, "reservedShare": share}
    s = scheduler(config(queues, backfill=backfill, preemption=pre), nodes=4)
    for i in range(4):
        s.submit(job(f"L{i}", "c", 6, est=1000.0 * (i + 1)), 0.0)
    assert len(s.cycle(0.0).admit) == 4
    for i in range(1, 4):
        s.submit(job(f"A{i}", "a", 8, t=1.0, est=100.0), 1.0)
    for t in (1.0, 2.0, 3.0, 4.0):
        s.cycle(t)
    assert set(s.reservations) == reserved


def test_the_settings_are_read_and_checked() -> None:
    from gpunode.errors import QueueConfigError

    default = config([{"name": "a"}])
    assert default.backfill.reserved_share == 0.1 and not default.backfill.learn_estimates
    cfg = config([{"name": "a"}], backfill={"reservedShare": 0.3, "learnEstimates": True})
    assert cfg.backfill.reserved_share == 0.3 and cfg.backfill.learn_estimates
    with pytest.raises(QueueConfigError, match="reservedShare"):
        config([{"name": "a"}], backfill={"reservedShare": 1.5})


@pytest.mark.parametrize(
    ("order", "first"),
    [
        ({}, "B"),
        ({"shiftPerGpuHour": "60s", "shiftMax": "1h", "shiftUpToGpus": 0}, "S"),
        ({"shiftPerGpuHour": "60s", "shiftMax": "50s", "shiftUpToGpus": 0}, "B"),
    ],
)
def test_a_small_job_passes_a_big_one_that_arrived_shortly_before_it(
    order: dict[str, object], first: str
) -> None:
    # B (8 GPUs x 1 h: 8 GPU-hours) arrives at 0, S (1 GPU x 10 min) at 100 s. Shifted by 60 s per GPU-hour,
    # B's place is 480 s, S's 110 s: S goes first. With the shift capped at 50 s, B's place is 50 s.
    s = scheduler(config([{"name": "a", "guarantee": {"gpu": 8}}], order=order), nodes=1)
    s.submit(job("L", "a", 8, est=1e6), 0.0)
    s.cycle(0.0)
    s.submit(job("B", "a", 8, t=0.0, est=3600.0), 0.0)
    s.submit(job("S", "a", 1, t=100.0, est=600.0), 100.0)
    s.cycle(100.0)
    assert min(s.waiting(), key=lambda w: w.position).job == first
