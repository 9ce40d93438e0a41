"""The scheduling engine on hand-worked cases: gangs, borrowing and reclaim, notices, backfill, reasons."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import Job, Plan, PodPlacement
from tests.cluster.queueing.sched_helpers import TWO_TEAMS, config, free_gpus, job, names, scheduler


def test_a_gang_that_never_fits_never_holds_gpus_and_is_reported_once_after_its_timeout() -> None:
    s = scheduler(config([{"name": "a", "guarantee": {"gpu": 16}}], gang={"timeout": "10m"}))
    s.submit(job("g", "a", 8, pods=3), 0.0)  # 24 GPUs on a 16-GPU cluster
    s.submit(job("small", "a", 1, t=1.0), 1.0)
    d = s.cycle(1.0)
    assert names(d.admit) == ["small"]  # the impossible gang does not block the job behind it
    assert free_gpus(s) == 15
    (w,) = [w for w in d.waiting if w.job == "g"]
    assert w.reason == (
        "queued in a, position 1: gang of 3 asking for 24 GPUs can never fit this cluster, even when it is empty"
    )
    assert s.cycle(599.0).timed_out == []
    (late,) = s.cycle(600.0).timed_out
    assert late.job == "g" and late.position == 1
    assert late.reason.startswith(
        "queued in a, position 1: waited longer than the gang timeout (600s): gang of 3"
    )
    assert s.cycle(1200.0).timed_out == []  # reported once
    assert "g" not in s.running and free_gpus(s) == 15


@pytest.mark.parametrize("policy", ["kai", "gpunode"])
def test_a_gang_waits_whole_until_every_member_fits(policy: str) -> None:
    s = scheduler(config([{"name": "a", "guarantee": {"gpu": 16}}]), policy=policy)
    s.submit(job("x", "a", 8, preemptible=False, est=100.0), 0.0)
    s.submit(job("g", "a", 8, pods=2, t=0.0), 0.0)
    d = s.cycle(0.0)
    assert names(d.admit) == ["x"]
    assert free_gpus(s) == 8  # half a gang would fit; it holds nothing
    (w,) = d.waiting
    if policy == "kai":  # no backfill: the reason counts the members that fit
        assert w.reason == "queued in a, position 1: gang of 2: only 1 member fits"
    else:  # the head of line holds a reservation from x's expected end
        assert w.reason == "queued in a, position 1: waiting for 16 GPUs; reserved from t=100s on 2 nodes"
    s.finished("x", 50.0)
    d = s.cycle(50.0)
    assert names(d.admit) == ["g"]
    assert len(d.admit[0].plan.pods) == 2 and len(d.admit[0].plan.nodes) == 2
    assert free_gpus(s) == 0


def test_a_gang_reason_counts_the_members_that_fit_whether_or_not_its_plan_was_tried() -> None:
    """Ten GPUs free as 4 + 3 + 3: a gang of two 4-GPU members is tried (one member placed before the
    plan failed), one of three is not (12 GPUs > 10 free); both say how many members fit."""
    s = scheduler(config([{"name": "a", "guarantee": {"gpu": 24}}]), nodes=3, policy="kai")
    for name, gpus in (("x0", 4), ("x1", 5), ("x2", 5)):
        s.submit(job(name, "a", gpus, preemptible=False, est=10_000.0), 0.0)
    assert names(s.cycle(0.0).admit) == ["x0", "x1", "x2"]
    assert sorted(free_per_node(s)) == [3, 3, 4]
    s.submit(job("g2", "a", 4, pods=2, t=1.0), 1.0)
    s.submit(job("g3", "a", 4, pods=3, t=2.0), 2.0)
    s.submit(job("g4", "a", 3, pods=4, t=3.0), 3.0)
    reasons = {w.job: w.reason.split(": ", 1)[1] for w in s.cycle(3.0).waiting}
    assert reasons == {
        "g2": "gang of 2: only 1 member fits",
        "g3": "gang of 3: only 1 member fits",
        "g4": "gang of 4: only 3 members fit",
    }


def free_per_node(s: Scheduler) -> list[int]:
    """Whole GPUs free on each node."""
    arrays = s.cap._arrays
    return [
        sum(g.milli_free == 1000 for g in arrays.node_state(i).gpus) for i in range(len(s.cap.node_names))
    ]


def borrowed_cluster() -> Scheduler:
    """Team a holds 12 of 16 GPUs (4 borrowed, on the node it shares with nobody); b holds nothing."""
    s = scheduler(config(TWO_TEAMS))
    for i in range(3):
        s.submit(job(f"a{i}", "a", 4, est=10_000.0), 0.0)
    d = s.cycle(0.0)
    assert [(a.job.name, a.borrowed) for a in d.admit] == [("a0", False), ("a1", False), ("a2", True)]
    assert s.running["a2"].plan.nodes.isdisjoint(s.running["a0"].plan.nodes | s.running["a1"].plan.nodes)
    return s


def test_reclaim_gives_the_borrowed_job_its_notice_and_the_room_to_the_owner_at_the_deadline() -> None:
    s = borrowed_cluster()
    a2_node = s.running["a2"].plan.nodes
    s.submit(job("b0", "b", 8, t=10.0, est=100.0), 10.0)
    d = s.cycle(10.0)
    assert d.admit == [] and d.kill == []
    (notice,) = d.notices
    assert (notice.victim, notice.preemptor, notice.deadline, notice.reason) == ("a2", "b0", 310.0, "reclaim")
    assert s.running["a2"].notice_deadline == 310.0
    assert "preempting 1 job for it; starts when they stop, by t=310s" in d.waiting[0].reason
    # During the notice, the 4 GPUs free next to the victim are promised to b0: a's new job may not take them.
    s.submit(job("a3", "a", 1, t=100.0, est=10.0), 100.0)
    d = s.cycle(100.0)
    assert d.admit == [] and d.notices == []
    assert free_gpus(s) == 4
    d = s.cycle(310.0)
    assert d.kill == ["a2"]
    assert names(d.admit) == ["b0"]
    assert d.admit[0].plan.nodes == a2_node and not d.admit[0].borrowed
    assert "a2" not in s.running and s.pending_count == 2  # the victim waits again, with a3
    alloc = s.allocated_by_queue()
    assert alloc["a"]["gpu"] == 8_000 and alloc["b"]["gpu"] == 8_000  # a is back at its guarantee


def share_reclaim_cluster(above: float, policy: str = "gpunode") -> Scheduler:
    """a (weight 3) and b (weight 1), no guarantees, 16 GPUs: b took all of them while a was idle.

    With k = 0 the fair shares go by weight and demand alone: once a asks for 4 GPUs, a's
    share is 4 and b's 12, so b holds 16 / 12 = 1.33 x its share.
    """
    queues = [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}]
    pre = {"notice": "5m", "minRuntime": "0s", "shareReclaim": {"above": above, "after": "1h"}}
    s = scheduler(config(queues, preemption=pre, fairShare={"k": 0}), policy=policy)
    for i in range(16):
        s.submit(job(f"b{i}", "b", 1, est=100_000.0), 0.0)
    assert len(s.cycle(0.0).admit) == 16
    s.submit(job("a0", "a", 4, t=10.0, est=100.0), 10.0)
    return s


def test_share_reclaim_waits_its_time_then_takes_room_from_a_queue_far_above_its_share() -> None:
    s = share_reclaim_cluster(1.25)
    for t in (10.0, 1800.0, 3609.0):  # a0 has waited less than the hour
        d = s.cycle(t)
        assert d.admit == [] and d.notices == []
    assert s.shares["a"]["gpu"] == 4_000 and s.shares["b"]["gpu"] == 12_000
    d = s.cycle(3610.0)
    assert len(d.notices) == 4
    assert {n.preemptor for n in d.notices} == {"a0"} and {n.reason for n in d.notices} == {"reclaim"}
    assert {n.deadline for n in d.notices} == {3910.0}
    assert names(s.cycle(3910.0).admit) == ["a0"]
    assert s.allocated_by_queue()["b"]["gpu"] == 12_000  # b is back at its share


def test_share_reclaim_leaves_a_queue_within_the_multiple_of_its_share_alone() -> None:
    s = share_reclaim_cluster(1.5)  # b holds 1.33 x its share: not above 1.5 x
    for t in (10.0, 3610.0, 7200.0):
        d = s.cycle(t)
        assert d.admit == [] and d.notices == []


def test_share_reclaim_is_gpunode_s_own_rule_kai_reclaims_at_once_and_kueue_not_at_all() -> None:
    (n, *_) = share_reclaim_cluster(1.5, policy="kai").cycle(10.0).notices  # KAI: above the share, at once
    assert (n.preemptor, n.reason) == ("a0", "reclaim")
    s = share_reclaim_cluster(1.25, policy="kueue-besteffort")
    assert s.cycle(3610.0).notices == []


def test_a_victim_that_stops_early_lets_the_preemptor_start_before_the_deadline() -> None:
    s = borrowed_cluster()
    s.submit(job("b0", "b", 8, t=10.0), 10.0)
    s.cycle(10.0)
    assert s.next_deadline() == 310.0
    s.checkpoint("a2", 50.0)
    s.killed("a2", 60.0)
    d = s.cycle(60.0)
    assert names(d.admit) == ["b0"] and d.kill == []
    assert s.next_deadline() is None
    s.killed("a2", 61.0)  # not running any more: ignored


def test_a_queue_at_its_limit_waits_with_a_reason() -> None:
    queues = [
        {"name": "a", "guarantee": {"gpu": 8}, "borrowLimit": {"gpu": 0}},
        {"name": "b", "guarantee": {"gpu": 8}},
    ]
    s = scheduler(config(queues))
    for i in range(3):
        s.submit(job(f"a{i}", "a", 4), 0.0)
    d = s.cycle(0.0)
    assert names(d.admit) == ["a0", "a1"]
    (w,) = d.waiting
    assert w.reason == "queued in a, position 1: a is over its quota: it holds 8 GPUs of at most 8 GPUs"
    assert free_gpus(s) == 8


def test_backfill_starts_only_what_cannot_delay_the_head_of_line() -> None:
    s = scheduler(config([{"name": "a", "guarantee": {"gpu": 8}}]), nodes=1)
    s.submit(job("L", "a", 6, est=1000.0), 0.0)
    s.cycle(0.0)
    s.submit(job("H", "a", 8, t=1.0, est=100.0), 1.0)
    s.cycle(1.0)
    assert s.reservation is not None and s.reservation[0] == "H" and s.reservation[1].start == 1000.0
    s.submit(job("T", "a", 2, t=2.0, est=5000.0), 2.0)  # would still run at t=1000
    s.submit(job("S", "a", 2, t=3.0, est=500.0), 3.0)  # ends by t=503
    d = s.cycle(3.0)
    assert names(d.admit) == ["S"]
    (w,) = [w for w in d.waiting if w.job == "T"]
    assert (
        w.reason
        == "queued in a, position 2: waiting for 2 GPUs: no node has room now; it may not delay H, reserved from t=1000s"
    )
    s.finished("S", 503.0)
    assert s.cycle(503.0).admit == []  # T still may not start: it would delay H
    s.finished("L", 1000.0)
    d = s.cycle(1000.0)
    assert names(d.admit) == ["H"]


def test_backfill_may_use_nodes_outside_the_reservation() -> None:
    s = scheduler(config([{"name": "a", "guarantee": {"gpu": 16}}]))
    s.submit(job("L1", "a", 6, est=1000.0), 0.0)
    s.submit(job("L2", "a", 4, est=2000.0), 0.0)
    s.cycle(0.0)
    assert s.running["L1"].plan.nodes != s.running["L2"].plan.nodes
    s.submit(job("H", "a", 8, t=1.0), 1.0)
    s.cycle(1.0)
    assert s.reservation is not None
    reserved = s.reservation[1].nodes
    assert reserved == s.running["L1"].plan.nodes and s.reservation[1].start == 1000.0
    for i in range(3):
        s.submit(job(f"T{i}", "a", 2, t=2.0, est=5000.0), 2.0)
    d = s.cycle(2.0)
    assert names(d.admit) == ["T0", "T1"]  # the 4 GPUs beside L2; the 2 beside L1 stay free for H
    assert all(a.plan.nodes.isdisjoint(reserved) for a in d.admit)
    assert free_gpus(s) == 2


@pytest.mark.parametrize("reservations", [1, 4])
def test_a_big_job_behind_another_queues_head_gets_a_reservation_and_starts_on_time(
    reservations: int,
) -> None:
    # L0 (a) and L1 (b) leave 2 GPUs free on each node. X (a, 4 GPUs) is the head of line: its reservation
    # is n1 from t=1000 (L0's end). B (b, 8 GPUs) needs a whole node: with further reservations it gets
    # n0 from t=2000 (L1's end), the node X's reservation leaves; with one reservation it gets none.
    s = scheduler(config(TWO_TEAMS, backfill={"reservations": reservations, "reservedShare": 1}))
    s.submit(job("L0", "a", 6, est=1000.0), 0.0)
    s.submit(job("L1", "b", 6, est=2000.0), 0.0)
    assert names(s.cycle(0.0).admit) == ["L0", "L1"]
    assert (s.running["L0"].plan.nodes, s.running["L1"].plan.nodes) == ({"n1"}, {"n0"})
    s.submit(job("X", "a", 4, t=1.0, est=100.0), 1.0)
    s.submit(job("B", "b", 8, t=2.0, est=500.0), 2.0)
    d = s.cycle(2.0)
    assert d.admit == []
    (w,) = [w for w in d.waiting if w.job == "B"]
    got = {name: (r.start, set(r.nodes)) for name, r in s.reservations.items()}
    # T (a, 2 GPUs until t=5003) fits beside L1 on n0 now, but would still run there at t=2000.
    s.submit(job("T", "a", 2, t=3.0, est=5000.0), 3.0)
    d = s.cycle(3.0)
    if reservations == 1:
        assert got == {"X": (1000.0, {"n1"})}
        assert w.reason == "queued in b, position 1: waiting for 8 GPUs: no node has room now"
        assert names(d.admit) == ["T"] and s.running["T"].plan.nodes == {"n0"}  # no node is left whole for B
        s.finished("L0", 1000.0)
        assert names(s.cycle(1000.0).admit) == ["X"]
        s.finished("L1", 2000.0)
        assert s.cycle(2000.0).admit == []  # T holds n0 until t=5003, X holds n1
        return
    assert got == {"X": (1000.0, {"n1"}), "B": (2000.0, {"n0"})}
    assert w.reason == "queued in b, position 1: waiting for 8 GPUs; reserved from t=2000s on 1 nodes"
    assert d.admit == []  # T may not delay B
    s.finished("L0", 1000.0)
    d = s.cycle(1000.0)
    assert names(d.admit) == ["X", "T"]  # T ends after t=2000, so it goes beside X on n1, off B's node
    assert s.running["T"].plan.nodes == {"n1"} and set(s.reservations) == {"B"}
    s.finished("L1", 2000.0)
    d = s.cycle(2000.0)
    assert names(d.admit) == ["B"] and d.admit[0].plan.nodes == {"n0"}  # at its reservation's start
    assert s.reservations == {}


@pytest.mark.parametrize(
    ("backfill", "held", "reserved"),
    [
        ({"reservationsPerQueue": 1}, [2, 3, 3, 3], {"A1", "A2", "B1"}),
        ({"reservationsPerQueue": 7}, [2, 3, 4, 4], {"A1", "A2", "A3", "A4"}),
        ({"reservationsPerQueue": 7, "reserveAfter": "3s"}, [1, 1, 2, 3], {"A1", "A2", "A3"}),
    ],
)
def test_one_queue_holds_at_most_its_number_of_the_further_reservations(
    backfill: dict[str, Any], held: list[int], reserved: set[str]
) -> None:
    # c's four long jobs leave 2 GPUs on each of the 4 nodes, free at t=1000, 2000, 3000, 4000. a (walked
    # first) has four 8-GPU jobs, b one. A1 is the head of line; one further reservation is placed per
    # cycle, to the first queue walked that may hold one, so a takes every node unless its number is capped.
    # With reserveAfter 3s no job that arrived at t=1 gets a further one before t=4 (the head's is not aged).
    queues = [{"name": "a", "guarantee": {"gpu": 8}}, {"name": "b", "guarantee": {"gpu": 8}}, {"name": "c"}]
    pre = {"reclaim": False, "priority": False}
    s = scheduler(
        config(queues, backfill={"reservations": 8, "reservedShare": 1, **backfill}, preemption=pre), nodes=4
    )
    for i in range(4):
        s.submit(job(f"L{i}", "c", 6, est=1000.0 * (i + 1)), 0.0)
    assert len(s.cycle(0.0).admit) == 4
    for i in range(1, 5):
        s.submit(job(f"A{i}", "a", 8, t=1.0, est=100.0), 1.0)
    s.submit(job("B1", "b", 8, t=2.0, est=100.0), 2.0)
    got = []
    for t in (2.0, 3.0, 4.0, 5.0):
        assert s.cycle(t).admit == []
        got.append(len(s.reservations))
    assert got == held  # one new further reservation per cycle at most
    assert set(s.reservations) == reserved
    assert len({n for r in s.reservations.values() for n in r.nodes}) == len(reserved)  # a node each


def replay(policy: str, seed: int, n: int = 120) -> list[str]:
    """Drive a scheduler through a random workload; return its decisions as text, checking invariants."""
    rng = np.random.default_rng(seed)
    queues = [
        {
            "name": "org",
            "guarantee": {"gpu": 24},
            "children": [
                {"name": "t1", "guarantee": {"gpu": 12}, "weight": 2},
                {"name": "t2", "guarantee": {"gpu": 12}, "weight": 1},
            ],
        },
        {"name": "t3", "guarantee": {"gpu": 8}, "borrowLimit": {"gpu": 8}},
    ]
    s = scheduler(config(queues, gang={"timeout": "20m"}), nodes=4, policy=policy, seed=seed)
    jobs: list[Job] = []
    t = 0.0
    for i in range(n):
        t += float(rng.exponential(60.0))
        pods = int(rng.choice([1, 1, 1, 2, 4]))
        gpus = int(rng.choice([1, 2, 4, 8])) if pods == 1 else int(rng.choice([2, 4, 8]))
        jobs.append(
            job(
                f"j{i}",
                str(rng.choice(["t1", "t2", "t3"])),
                gpus,
                pods=pods,
                t=round(t, 1),
                est=float(rng.choice([300.0, 1800.0, 3600.0])),
                priority=int(rng.choice([0, 0, 1])),
            )
        )
    durations = {j.name: (j.runtime_estimate or 0.0) * float(rng.uniform(0.5, 1.2)) for j in jobs}
    ends: dict[str, float] = {}
    log: list[str] = []
    arrivals = list(jobs)
    now = 0.0
    while arrivals or ends or s.pending_count:
        times = [
            x
            for x in (
                arrivals[0].arrival if arrivals else None,
                min(ends.values(), default=None),
                s.next_deadline(),
            )
            if x is not None
        ]
        if not times:
            break
        now = max(now, min(times))
        while arrivals and arrivals[0].arrival <= now:
            s.submit(arrivals.pop(0), now)
        for name in sorted(k for k, v in ends.items() if v <= now):
            del ends[name]
            s.finished(name, now)
        d = s.cycle(now)
        for a in d.admit:
            ends[a.job.name] = now + durations[a.job.name]
            log.append(f"{now:.1f} admit {a.job.name} {a.plan}")
        for name in d.kill:
            ends.pop(name, None)
            log.append(f"{now:.1f} kill {name}")
        log += [f"{now:.1f} notice {x}" for x in d.notices] + [f"{now:.1f} late {w}" for w in d.timed_out]
        assert s.cap.free()["gpu"] >= 0
        if s.preset.gang:
            assert not s.partial_gangs
        if not ends and not arrivals and s.next_deadline() is None and s.pending_count:
            break  # what is left can never start (kube's partial gangs may deadlock)
    return log


@pytest.mark.parametrize("policy", ["gpunode", "kube", "kueue-strict", "kueue-besteffort", "kai"])
def test_decisions_are_the_same_for_the_same_inputs_and_seed(policy: str) -> None:
    first = replay(policy, seed=7)
    assert first == replay(policy, seed=7)
    assert sum(line.split()[1] == "admit" for line in first) >= 60


def test_adopt_rebuilds_a_running_job_on_its_own_plan_without_a_decision() -> None:
    first = borrowed_cluster()
    plans = {n: first.running[n].plan for n in ("a0", "a1", "a2")}
    s = scheduler(config(TWO_TEAMS))  # a restarted controller: same cluster, nothing held yet
    for i, name in enumerate(("a0", "a1", "a2")):
        r = s.adopt(job(name, "a", 4, est=10_000.0), plans[name], start=float(i), now=5.0)
        assert r.plan == plans[name] and r.start == float(i)
    assert [s.running[n].borrowed for n in ("a0", "a1", "a2")] == [False, False, True]
    assert s.allocated_by_queue()["a"]["gpu"] == 12_000 and free_gpus(s) == 4
    d = s.cycle(5.0)
    assert d.admit == [] and d.notices == [] and s.pending_count == 0
    with pytest.raises(ValueError, match="already pending or running"):
        s.adopt(job("a0", "a", 4), plans["a0"], start=0.0, now=5.0)
    # The adopted borrowed job is reclaimed as if this scheduler had admitted it.
    s.submit(job("b0", "b", 8, t=10.0), 10.0)
    (n,) = s.cycle(10.0).notices
    assert (n.victim, n.reason) == ("a2", "reclaim")
    d = s.cycle(310.0)
    assert d.kill == ["a2"] and names(d.admit) == ["b0"]


def test_an_adopted_victim_is_stopped_at_its_notice_deadline_and_its_room_kept_for_the_preemptor() -> None:
    s = scheduler(config(TWO_TEAMS), nodes=1)
    plan = Plan(pods=(PodPlacement("n0", tuple(f"n0-g{i}" for i in range(4))),))
    s.adopt(job("v", "a", 4), plan, start=0.0, now=50.0, notice_deadline=300.0, preemptor="b0")
    assert s.next_deadline() == 300.0 and s.excluded_for_preemptors == plan.nodes
    s.submit(job("b0", "b", 8, t=40.0), 50.0)
    s.submit(job("a-small", "a", 1, t=45.0), 50.0)
    d = s.cycle(50.0)
    assert d.admit == []  # n0 is promised to b0; b0 waits for its victim
    assert [w.reason for w in s.waiting() if w.job == "b0"] == [
        "queued in b, position 1: preempting 1 job for it; starts when they stop, by t=300s"
    ]
    d = s.cycle(300.0)
    assert d.kill == ["v"] and names(d.admit) == ["b0"]


def test_withdraw_takes_a_pending_job_off_the_queue_and_lifts_the_notices_given_for_it() -> None:
    s = borrowed_cluster()
    s.submit(job("b0", "b", 8, t=10.0), 10.0)
    s.submit(job("b1", "b", 2, t=11.0), 11.0)
    (n,) = s.cycle(11.0).notices
    assert n.victim == "a2" and s.pending_count == 2
    assert s.withdraw("b0", 20.0) == ("a2",)
    assert s.pending_count == 1 and s.next_deadline() is None and s.excluded_for_preemptors == frozenset()
    assert s.running["a2"].notice_deadline is None and s.running["a2"].preemptor is None
    assert s.withdraw("b0", 20.0) == () and s.withdraw("a0", 20.0) == ()  # not pending: ignored
    d = s.cycle(20.0)
    assert names(d.admit) == ["b1"]  # the room b0 held is free for others
    assert s.cycle(400.0).kill == [] and "a2" in s.running  # the lifted notice never runs out
    assert [w.job for w in s.waiting()] == []


def test_withdrawing_a_partly_placed_kube_job_gives_back_the_pods_it_held() -> None:
    s = scheduler(config(TWO_TEAMS), nodes=1, policy="kube")
    s.submit(job("g", "a", 4, pods=3), 0.0)  # two members fit on the 8 GPUs, the third waits
    s.cycle(0.0)
    assert s.partial_gangs == {"g"} and free_gpus(s) == 0
    s.withdraw("g", 1.0)
    assert s.partial_gangs == set() and free_gpus(s) == 8 and s.pending_count == 0


def test_a_rebuilt_scheduler_keeps_the_usage_memory_of_the_one_it_replaces() -> None:
    cfg = config(TWO_TEAMS)
    old = scheduler(cfg)
    old.submit(job("a0", "a", 8, est=10_000.0), 0.0)
    assert names(old.cycle(0.0).admit) == ["a0"]
    old.cycle(3600.0)  # team a has held 8 GPUs for an hour
    assert old._ledger is not None
    used = old._ledger.usage(3600.0)["a"]["gpu"]
    assert used > 0
    new = scheduler(cfg)  # the controller's rebuild: same cluster, the running job adopted
    new.adopt(job("a0", "a", 8, est=10_000.0), old.running["a0"].plan, start=0.0, now=3600.0)
    assert new._ledger is not None and new._ledger.usage(3600.0).get("a", {}).get("gpu", 0) == 0
    assert new.inherit_usage(old, 3600.0)
    assert new._ledger.usage(3600.0)["a"]["gpu"] == pytest.approx(used)
    new.cycle(7200.0)  # charged on from where the old one stopped: more than the decayed hour alone
    assert new._ledger.usage(7200.0)["a"]["gpu"] > used
    # Other fair-share settings give the figures another meaning: usage starts afresh.
    other = scheduler(config(TWO_TEAMS, fairShare={"halfLife": "1h", "window": "24h"}))
    assert not other.inherit_usage(old, 3600.0)
