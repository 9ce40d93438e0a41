"""Victim choice on hand-worked cases: least lost work, fewest pods, guarantees, minimum runtime."""

from __future__ import annotations

from typing import Any

from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import Job
from gpunode.cluster.queueing.preempt import Victims, choose_victims
from gpunode.placement.model import Request
from tests.cluster.queueing.sched_helpers import config, job, scheduler

ONE_QUEUE = [{"name": "a", "guarantee": {"gpu": 0}}, {"name": "hi", "guarantee": {"gpu": 0}}]


def start(s: Scheduler, jobs: list[tuple[Job, float]]) -> None:
    """Admit each job at its time (the cluster must have room)."""
    for j, t in jobs:
        s.submit(j, t)
        assert [a.job.name for a in s.cycle(t).admit] == [j.name]


def victims(s: Scheduler, preemptor: Job, now: float, min_runtime: float = 0.0) -> Victims | None:
    """choose_victims over every running job of the scheduler."""
    demand = {"gpu": preemptor.gpu_milli}
    return choose_victims(
        preemptor,
        demand,
        list(s.running.values()),
        s.cap,
        s.book,
        now,
        min_runtime_s=min_runtime,
        units=s.units_of,
    )


def chosen(v: Victims | None) -> list[str]:
    assert v is not None
    return [r.job.name for r in v.jobs]


def test_the_job_losing_the_least_work_goes_first_and_a_checkpoint_counts() -> None:
    s = scheduler(config(ONE_QUEUE), nodes=1)
    start(s, [(job("old", "a", 4), 0.0), (job("young", "a", 4), 500.0)])
    big = job("big", "hi", 4, t=1000.0)
    assert chosen(victims(s, big, 1000.0)) == ["young"]  # 4 x 500 GPU-s lost, against 4 x 1000
    s.checkpoint("old", 900.0)  # now "old" would lose only 4 x 100 GPU-s
    assert chosen(victims(s, big, 1000.0)) == ["old"]
    assert s.running["old"].lost_work(1000.0) == 400.0


def test_equal_lost_work_takes_the_job_with_fewer_pods() -> None:
    s = scheduler(config(ONE_QUEUE), nodes=1)
    start(s, [(Job(name="pair", queue="a", pods=(Request(gpus=2), Request(gpus=2)), arrival=0.0), 0.0)])
    start(s, [(job("single", "a", 4), 0.0)])
    assert chosen(victims(s, job("big", "hi", 4), 100.0)) == ["single"]


def test_victims_that_are_not_needed_are_given_back() -> None:
    s = scheduler(config(ONE_QUEUE), nodes=1)
    start(s, [(job("large", "a", 6), 0.0), (job("small", "a", 2), 50.0)])
    # least lost work first would take "small" (2 x 50) and then "large"; "large" alone suffices for 6 GPUs
    assert chosen(victims(s, job("six", "hi", 6), 100.0)) == ["large"]


def test_a_victim_is_never_taken_below_its_queues_guarantee() -> None:
    queues = [
        {"name": "a", "guarantee": {"gpu": 4}},
        {"name": "b", "guarantee": {"gpu": 0}},
        {"name": "hi", "guarantee": {"gpu": 0}},
    ]
    s = scheduler(config(queues), nodes=1)
    start(s, [(job("b-job", "b", 4), 0.0), (job("a-job", "a", 4), 500.0)])
    # a-job loses less work, but taking it leaves queue a below its 4-GPU guarantee
    assert chosen(victims(s, job("hi-job", "hi", 4), 1000.0)) == ["b-job"]
    assert victims(s, job("hi-job", "hi", 8), 1000.0) is None  # b-job alone frees too little


def test_young_unpreemptible_and_noticed_jobs_are_passed_over() -> None:
    s = scheduler(config(ONE_QUEUE), nodes=1)
    start(s, [(job("fixed", "a", 2, preemptible=False), 0.0), (job("noticed", "a", 2), 0.0)])
    start(s, [(job("old", "a", 2), 0.0), (job("young", "a", 2), 900.0)])
    s.running["noticed"].notice_deadline = 2000.0
    assert chosen(victims(s, job("hi-job", "hi", 2), 1000.0, min_runtime=600.0)) == ["old"]
    assert victims(s, job("hi-job", "hi", 4), 1000.0, min_runtime=600.0) is None
    assert chosen(victims(s, job("hi-job", "hi", 4), 1600.0, min_runtime=600.0)) == ["young", "old"]


def test_priority_preemption_in_the_engine_respects_the_minimum_runtime() -> None:
    pre = {"notice": "1m", "minRuntime": "10m", "shareReclaim": False}  # priority alone, not the share
    s = scheduler(config(ONE_QUEUE, preemption=pre), nodes=1)
    start(s, [(job("low", "a", 8), 0.0)])
    s.submit(job("urgent", "hi", 8, t=100.0, priority=5), 100.0)
    assert s.cycle(100.0).notices == []  # low has run 100 s of its 600
    (n,) = s.cycle(600.0).notices
    assert (n.victim, n.preemptor, n.deadline, n.reason) == ("low", "urgent", 660.0, "priority")
    d = s.cycle(660.0)
    assert d.kill == ["low"] and [a.job.name for a in d.admit] == ["urgent"]


ORG = [
    {
        "name": "org",
        "guarantee": {"gpu": 8},
        "children": [
            {"name": "team-a", "guarantee": {"gpu": 4}, "borrowLimit": {"gpu": 4}},
            {"name": "team-b", "guarantee": {"gpu": 4}, "borrowLimit": {"gpu": 0}},
        ],
    }
]


def test_a_sibling_under_the_same_parent_reclaims_what_the_other_borrowed() -> None:
    # org holds all 8 of its GPUs (team-a: 4 guaranteed + 4 borrowed). team-b's 4-GPU job is within team-b's
    # guarantee; org would hold 12 with it, but gets the victim's 4 back: org is not asked, only where the
    # two chains part (team-b within its guarantee, team-a borrowing).
    s = scheduler(config(ORG), nodes=1)
    start(s, [(job("a0", "team-a", 4), 0.0), (job("a1", "team-a", 4, t=100.0), 100.0)])
    assert [s.running[n].borrowed for n in ("a0", "a1")] == [False, True]
    s.submit(job("b0", "team-b", 4, t=200.0), 200.0)
    d = s.cycle(200.0)
    assert d.admit == []
    (n,) = d.notices  # a1 started later: it loses the least work (100 s x 4 GPUs against 200 s x 4)
    assert (n.victim, n.preemptor, n.deadline, n.reason) == ("a1", "b0", 500.0, "reclaim")
    assert s.cycle(499.0).kill == []
    d = s.cycle(500.0)
    assert d.kill == ["a1"] and [a.job.name for a in d.admit] == ["b0"]
    alloc = s.allocated_by_queue()
    assert (alloc["team-a"]["gpu"], alloc["team-b"]["gpu"], alloc["org"]["gpu"]) == (4000, 4000, 8000)
    assert s.pending_count == 1  # a1 waits again; team-a at its guarantee gives nothing more
    s.submit(job("b1", "team-b", 4, t=600.0), 600.0)
    d = s.cycle(600.0)
    assert d.notices == [] and d.admit == []  # team-b is at its limit: b1 may reclaim nothing


def test_a_sibling_does_not_reclaim_beyond_its_own_guarantee_nor_below_the_others() -> None:
    queues = [
        {
            "name": "org",
            "guarantee": {"gpu": 8},
            "children": [
                {"name": "team-a", "guarantee": {"gpu": 4}},
                {"name": "team-b", "guarantee": {"gpu": 4}},
            ],
        }
    ]
    s = scheduler(config(queues), nodes=1)
    start(s, [(job("a0", "team-a", 2), 0.0), (job("a1", "team-a", 2, t=1.0), 1.0)])
    start(s, [(job("b0", "team-b", 2, t=2.0), 2.0), (job("b1", "team-b", 2, t=3.0), 3.0)])
    # Both teams at their guarantee: team-b's next job would borrow, team-a has nothing borrowed.
    s.submit(job("b2", "team-b", 2, t=10.0), 10.0)
    assert s.cycle(10.0).notices == []
    # The same when team-a borrows but team-b would still go above its guarantee.
    assert s.book.may_reclaim("team-b", {"gpu": 2000}, "team-a") is False
    assert s.book.may_reclaim("team-b", {"gpu": 0}, "team-a") is False  # team-a is not borrowing


def _idle_case(**preemption: Any) -> Scheduler:
    """One node, queue a running "old" (4 GPUs, from 0) and "young" (4 GPUs, from 500); "old" idle since 600.

    Share reclaim is off: priority alone makes room."""
    pre = {"notice": "1m", "minRuntime": "0s", "shareReclaim": False, **preemption}
    s = scheduler(config(ONE_QUEUE, preemption=pre), nodes=1)
    start(s, [(job("old", "a", 4), 0.0), (job("young", "a", 4), 500.0)])
    s.mark_idle("old", 600.0)
    s.mark_idle("gone", 600.0)  # not running: ignored
    s.submit(job("big", "hi", 4, t=1000.0, priority=10), 1000.0)
    return s


def test_with_idle_first_an_idle_job_goes_before_a_busy_one_losing_less() -> None:
    s = _idle_case(idleFirst=True)
    # "old" would lose 4 x 1000 GPU-s, "young" 4 x 500; "old" is idle and of lower priority than "big"
    notices = s.cycle(1000.0).notices
    assert [(n.victim, n.preemptor, n.reason) for n in notices] == [("old", "big", "idle")]


def test_without_idle_first_lost_work_decides_as_before() -> None:
    s = _idle_case()
    assert [(n.victim, n.reason) for n in s.cycle(1000.0).notices] == [("young", "priority")]


def test_an_idle_job_counts_only_once_flagged_for_idle_minimum_and_while_still_flagged() -> None:
    s = _idle_case(idleFirst=True, idleMinimum="10m")  # "old" flagged 400 s before: not yet
    assert [(n.victim, n.reason) for n in s.cycle(1000.0).notices] == [("young", "priority")]
    s = _idle_case(idleFirst=True)
    s.mark_idle("old", None)  # busy again
    assert [n.victim for n in s.cycle(1000.0).notices] == ["young"]
    s = _idle_case(idleFirst=True)
    s.mark_idle("old", 2000.0)  # a time still to come (a wrong clock, or a tenant's own mark): not idle
    assert [n.victim for n in s.cycle(1000.0).notices] == ["young"]


def test_an_idle_job_within_its_guarantee_and_of_equal_priority_is_not_best_effort() -> None:
    teams = [{"name": "a", "guarantee": {"gpu": 4}}, {"name": "b", "guarantee": {"gpu": 4}}]
    s = scheduler(config(teams, preemption={"notice": "1m", "minRuntime": "0s", "idleFirst": True}), nodes=1)
    start(s, [(job("first", "a", 4), 0.0), (job("second", "a", 4), 500.0)])
    assert (s.running["first"].borrowed, s.running["second"].borrowed) == (False, True)
    s.mark_idle("first", 0.0)  # idle, but within a's guarantee and of the preemptor's priority
    s.submit(job("b1", "b", 4, t=1000.0), 1000.0)
    assert [(n.victim, n.reason) for n in s.cycle(1000.0).notices] == [("second", "reclaim")]
    s = scheduler(config(teams, preemption={"notice": "1m", "minRuntime": "0s", "idleFirst": True}), nodes=1)
    start(s, [(job("first", "a", 4), 0.0), (job("second", "a", 4), 500.0)])
    s.checkpoint("first", 900.0)  # "first" now loses less (4 x 100) than "second" (4 x 500) ...
    s.mark_idle("second", 600.0)  # ... but "second" is idle and borrowed: best-effort, so it goes first
    s.submit(job("b1", "b", 4, t=1000.0), 1000.0)
    assert [(n.victim, n.reason) for n in s.cycle(1000.0).notices] == [("second", "idle")]


def test_choose_victims_prefers_an_idle_set_to_a_busy_one_losing_less() -> None:
    s = scheduler(config(ONE_QUEUE), nodes=1)
    start(s, [(job("old", "a", 4), 0.0), (job("young", "a", 4), 500.0)])
    big = job("big", "hi", 4, t=1000.0)
    demand = {"gpu": big.gpu_milli}
    run = list(s.running.values())
    kw: dict[str, Any] = {"min_runtime_s": 0.0, "units": s.units_of}
    assert chosen(choose_victims(big, demand, run, s.cap, s.book, 1000.0, **kw)) == ["young"]
    picked = choose_victims(big, demand, run, s.cap, s.book, 1000.0, idle=frozenset({"old"}), **kw)
    assert chosen(picked) == ["old"]


def test_pods_bound_counts_the_pods_the_open_nodes_could_take_and_never_fewer() -> None:
    # Three nodes of 8 GPUs: best fit puts "six" and "two" on one node, the other two stay empty.
    s = scheduler(config(ONE_QUEUE), nodes=3)
    start(s, [(job("six", "a", 6), 0.0), (job("two", "a", 2), 0.0)])
    cap = s.cap
    used = {
        n: sum(len(p.gpus) for r in s.running.values() for p in r.plan.pods if p.node == n)
        for n in cap.node_names
    }
    assert sorted(used.values()) == [0, 0, 8]
    empty = sorted(n for n, k in used.items() if k == 0)
    assert cap.pods_bound(4000, frozenset()) == 4  # two 4-GPU pods on each empty node
    assert cap.pods_bound(4000, frozenset({empty[0]})) == 2
    assert cap.pods_bound(3000, frozenset()) == 4 and cap.pods_bound(1000, frozenset()) == 16
    # a job of more pods than the bound allows cannot be placed; one it allows here can
    assert cap.plan(job("g5", "a", 4, pods=5)) is None
    assert cap.plan(job("g4", "a", 4, pods=4)) is not None
    assert cap.plan(job("g3", "a", 4, pods=3), exclude_nodes=frozenset({empty[0]})) is None
    s.finished("two", 10.0)  # 2 GPUs free beside "six": no 4-GPU pod more, two 1-GPU pods more
    assert cap.pods_bound(4000, frozenset()) == 4 and cap.pods_bound(1000, frozenset()) == 18


def test_pod_room_counts_releases_before_they_are_made_and_bounds_the_room_after_them() -> None:
    # "six" and "two" share a node; a third job holds half of another node; one node stays empty.
    s = scheduler(config(ONE_QUEUE), nodes=3)
    start(s, [(job("six", "a", 6), 0.0), (job("two", "a", 2), 0.0), (job("four", "a", 4), 0.0)])
    cap = s.cap
    room = cap.pod_room(4000, frozenset())
    assert room.bound() == cap.pods_bound(4000, frozenset()) == 3  # nothing counted: the room now
    room.count(["two"])
    assert room.bound() == 3  # 2 GPUs beside "six" take no 4-GPU pod
    room.count(["six"])
    assert room.bound() == 5  # with both released, their node takes two
    with cap.trial():
        cap.release("two")
        cap.release("six")
        assert cap.pods_bound(4000, frozenset()) == 5 <= room.bound()
    node_of_four = next(p.node for p in s.running["four"].plan.pods)
    fenced = cap.pod_room(4000, frozenset({node_of_four}))
    fenced.count(["four"])  # what it frees is on an excluded node: no room there
    assert fenced.bound() == cap.pods_bound(4000, frozenset({node_of_four})) == 2


def test_a_search_whose_candidates_can_never_make_room_releases_nothing() -> None:
    """The victim search gives up before releasing when the open nodes could not take every pod of the
    preemptor even with all its candidates stopped (releasing rebuilds nodes)."""
    s = scheduler(config(ONE_QUEUE), nodes=3)
    for i in range(3):  # each node: a job that may not be preempted beside one that may
        start(s, [(job(f"keep{i}", "a", 4, preemptible=False), 0.0), (job(f"low{i}", "a", 4), 0.0)])
    assert len({next(iter(s.running[f"keep{i}"].plan.nodes)) for i in range(3)}) == 3
    releases: list[str] = []
    cap_release = s.cap.release

    def spy(name: str) -> None:
        releases.append(name)
        cap_release(name)

    s.cap.release = spy  # type: ignore[method-assign]
    # 12 GPUs could be freed, but never 8 on one node: no victims, and nothing released to find that out
    assert victims(s, job("whole", "a", 8, priority=5), 100.0) is None
    assert releases == []
    # a 4-GPU pod fits once one of them stops: the search releases to place it
    found = victims(s, job("half", "a", 4, priority=5), 100.0)
    assert found is not None and len(chosen(found)) == 1 and chosen(found)[0].startswith("low")
    assert releases


def test_a_needed_victim_is_kept_without_a_plan_and_an_unneeded_one_is_given_back() -> None:
    """Giving back a victim the open nodes could not do without (the bound falls below the pods) asks
    for no plan; one they can do without is given back after a plan says so."""
    s = scheduler(config(ONE_QUEUE), nodes=3)
    start(s, [(job("keep0", "a", 4, preemptible=False), 0.0), (job("x0", "a", 4), 0.0)])
    start(s, [(job("keep1", "a", 4, preemptible=False), 10.0), (job("x1", "a", 4), 10.0)])
    start(s, [(job("keep2", "a", 6, preemptible=False), 50.0), (job("z", "a", 2), 50.0)])
    nodes = [s.running[n].plan.nodes for n in ("x0", "x1", "z")]
    assert nodes == [s.running[n].plan.nodes for n in ("keep0", "keep1", "keep2")] and len(set(nodes)) == 3
    plans: list[str] = []
    cap_plan = s.cap.plan

    def spy(job: Job, **kw: Any) -> Any:
        plans.append(job.name)
        return cap_plan(job, **kw)

    s.cap.plan = spy  # type: ignore[method-assign]
    gang = Job(name="gang", queue="hi", pods=(Request(gpus=4), Request(gpus=4)), arrival=100.0)
    # least lost work first: z (2 x 50), x1 (4 x 90), x0 (4 x 100); the gang plans once all three stopped
    assert sorted(chosen(victims(s, gang, 100.0))) == ["x0", "x1"]
    # one plan to place the gang, one to give z back; x0 and x1 are kept without one
    assert plans == ["gang", "gang"]
