"""The order within a queue: small jobs by GPU-hours (order.shift*), big jobs at their arrival, none starves."""

from __future__ import annotations

import pytest

from gpunode.cluster.queueing.engine import Scheduler
from gpunode.errors import QueueConfigError
from tests.cluster.queueing.sched_helpers import config, job, scheduler

ONE_QUEUE = [{"name": "a", "guarantee": {"gpu": 8}}]


def _order(s: Scheduler) -> list[str]:
    return [w.job for w in sorted(s.waiting(), key=lambda w: w.position)]


@pytest.mark.parametrize(
    ("up_to", "expected"),
    [
        # every job shifted: B (8 GPU-hours) at 480 s goes behind both small ones
        (0, ["short", "long", "B"]),
        # only jobs of at most 4 GPUs shifted: B keeps its arrival (0 s) and goes first; the small ones
        # still go shortest first (short at 110 s, long at 370 s although it arrived first)
        (4, ["B", "short", "long"]),
    ],
)
def test_small_jobs_go_by_gpu_hours_and_big_jobs_keep_their_arrival(up_to: int, expected: list[str]) -> None:
    order = {"shiftPerGpuHour": "60s", "shiftMax": "1h", "shiftUpToGpus": up_to}
    s = scheduler(config(ONE_QUEUE, order=order), nodes=1)
    s.submit(job("L", "a", 8, est=1e6), 0.0)
    s.cycle(0.0)
    s.submit(job("B", "a", 8, t=0.0, est=3600.0), 0.0)  # 8 GPU-hours: 480 s
    s.submit(job("long", "a", 2, t=10.0, est=3 * 3600.0), 10.0)  # 6 GPU-hours: 360 s, place 370 s
    s.submit(job("short", "a", 1, t=100.0, est=600.0), 100.0)  # 1/6 GPU-hour: 10 s, place 110 s
    s.cycle(100.0)
    assert _order(s) == expected


def test_a_big_job_is_passed_by_no_later_arrival() -> None:
    # A stream of short one-GPU jobs after an unshifted 8-GPU job: every one of them waits behind it, and
    # it is the first to start when the node frees, however many arrived.
    order = {"shiftPerGpuHour": "1h", "shiftMax": "12h", "shiftUpToGpus": 4}
    s = scheduler(config(ONE_QUEUE, order=order), nodes=1)
    s.submit(job("L", "a", 8, est=1e6), 0.0)
    s.cycle(0.0)
    s.submit(job("big", "a", 8, t=5.0, est=10 * 3600.0), 5.0)
    for i in range(20):
        s.submit(job(f"s{i}", "a", 1, t=10.0 + i, est=60.0), 10.0 + i)
    s.cycle(30.0)
    assert _order(s)[0] == "big"
    s.finished("L", 100.0)
    assert [a.job.name for a in s.cycle(100.0).admit] == ["big"]


def test_a_shifted_job_is_passed_only_by_jobs_arriving_within_its_shift() -> None:
    # X (4 GPUs, planned for days) is shifted by the whole shiftMax, 1 h: its place is 3,600 s. `early`
    # arrives inside that hour and goes ahead of it; `late` arrives after it and goes behind, short as it
    # is. When the node frees, early starts, X reserves the node for early's end, late (which would run
    # past that) waits, and X starts next: the long job does not starve behind a stream of short ones.
    order = {"shiftPerGpuHour": "60s", "shiftMax": "1h", "shiftUpToGpus": 4}
    s = scheduler(config(ONE_QUEUE, order=order), nodes=1, gpus=4)
    s.submit(job("L", "a", 4, est=1e6), 0.0)
    s.cycle(0.0)
    s.submit(job("X", "a", 4, t=0.0, est=1e6), 0.0)
    s.submit(job("early", "a", 1, t=1000.0, est=600.0), 1000.0)
    s.submit(job("late", "a", 1, t=4000.0, est=700.0), 4000.0)
    s.cycle(4000.0)
    assert _order(s) == ["early", "X", "late"]
    s.finished("L", 5000.0)
    assert [a.job.name for a in s.cycle(5000.0).admit] == ["early"]
    assert "late" not in s.running
    s.finished("early", 5600.0)
    assert [a.job.name for a in s.cycle(5600.0).admit] == ["X"]


def test_without_the_shift_the_order_is_arrival() -> None:
    s = scheduler(config(ONE_QUEUE, order={"shiftMax": "0s"}), nodes=1)  # shiftMax 0: no shift at all
    s.submit(job("L", "a", 8, est=1e6), 0.0)
    s.cycle(0.0)
    s.submit(job("long", "a", 2, t=10.0, est=3 * 3600.0), 10.0)
    s.submit(job("short", "a", 1, t=100.0, est=600.0), 100.0)
    s.cycle(100.0)
    assert _order(s) == ["long", "short"]


def test_shift_up_to_gpus_is_read_and_checked() -> None:
    default = config(ONE_QUEUE).order
    assert (default.shift_per_gpu_hour_s, default.shift_max_s, default.shift_up_to_gpus) == (
        3600.0,
        43200.0,
        4,
    )
    assert config(ONE_QUEUE, order={"shiftUpToGpus": 0}).order.shift_up_to_gpus == 0
    for bad in (-1, "4", True):
        with pytest.raises(QueueConfigError, match="shiftUpToGpus"):
            config(ONE_QUEUE, order={"shiftUpToGpus": bad})


@pytest.mark.parametrize(("learned", "expected"), [(False, ["one", "four"]), (True, ["four", "one"])])
def test_the_learned_size_orders_by_what_the_queue_s_jobs_really_ran(
    learned: bool, expected: list[str]
) -> None:
    # Without estimates both sizes are planned with the default hour: `one` (1 GPU-hour, place 60 s after its
    # arrival) goes before `four` (4 GPU-hours, 240 s). The queue's history says its one-GPU jobs run 10 h
    # and its four-GPU jobs a minute: with order.learnedSize `four` (4 s) goes before `one` (600 s). Backfill
    # still plans with the default hour: learnedSize moves no reservation.
    order = {"shiftPerGpuHour": "60s", "shiftMax": "1h", "shiftUpToGpus": 4, "learnedSize": learned}
    s = scheduler(config(ONE_QUEUE, order=order), nodes=1)
    for i in range(3):
        s.submit(job(f"o{i}", "a", 1), 0.0)
    t = 0.0
    for i in range(3):
        s.submit(job(f"f{i}", "a", 4, t=t), t)
        assert f"f{i}" in [a.job.name for a in s.cycle(t).admit]
        t += 60.0
        s.finished(f"f{i}", t)
    for i in range(3):
        s.finished(f"o{i}", 36_000.0)
    s.submit(job("L", "a", 8, t=36_000.0, est=1e6), 36_000.0)
    s.cycle(36_000.0)
    s.submit(job("one", "a", 1, t=36_001.0), 36_001.0)
    s.submit(job("four", "a", 4, t=36_001.0), 36_001.0)
    s.cycle(36_001.0)
    assert _order(s) == expected
    s.finished("L", 40_000.0)
    assert {a.job.name for a in s.cycle(40_000.0).admit} == {"one", "four"}
    assert s.running["one"].expected_end(3600.0) == 40_000.0 + 3600.0


def test_learned_size_is_read_and_checked() -> None:
    assert not config(ONE_QUEUE).order.learned_size
    assert config(ONE_QUEUE, order={"learnedSize": True}).order.learned_size
    with pytest.raises(QueueConfigError, match="learnedSize"):
        config(ONE_QUEUE, order={"learnedSize": "yes"})
